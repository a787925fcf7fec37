"""What one rank keeps for backward under context parallelism, measured, at cp 1, 2 and 4.

    .venv/bin/python scripts/bench/cp_activations.py                 # seq 1024, 4 gloo ranks
    .venv/bin/python scripts/bench/cp_activations.py --seq 2048 --json

A small GPT (``--layers`` x ``--hidden``, ``--heads`` heads, fp32, micro-batch 1) runs one forward
with labels on 4 gloo ranks laid out as CP c x DP 4/c; ``MemoryTracker`` (the allocator's side)
gives the storages alive at the end of that forward that it created (category ``activations``:
what autograd keeps for backward) and the forward's peak, the maximum over ranks. Each CP rank
holds s/c tokens, so both should fall as 1/c (the ring keeps q, k, v, the output and the
log-sum-exp per layer, as SDPA's flash kernel for CPU does at cp = 1). The script prints each
ratio to the previous cp; it measures and exits 0, judging nothing.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from zerotron.testing.bench_args import positive_int  # noqa: E402
from zerotron.testing.launch import spawn  # noqa: E402

MiB = 1 << 20


def worker(a) -> dict:
    import torch

    from zerotron.model import GPT, GPTConfig
    from zerotron.parallel import Grid, ParallelDims
    from zerotron.parallel import collectives as C
    from zerotron.parallel.memory_tracker import MemoryTracker

    torch.set_num_threads(1)
    cfg = GPTConfig(num_layers=a.layers, hidden_size=a.hidden, num_heads=a.heads, vocab_size=512,
                    seq_length=a.seq, dropout=0.0, attention_dropout=0.0)
    ids = torch.randint(0, 512, (1, a.seq), generator=torch.Generator().manual_seed(3))
    out = {}
    for cp in (1, 2, 4):
        grid = Grid(ParallelDims(cp=cp))
        model = GPT(cfg, grid, seed=1)
        tracker = MemoryTracker("cpu")
        with tracker.phase("forward"):
            loss = model(ids, labels=ids)
        kept = tracker.breakdown()["activations"]
        peak = tracker.report()["by_phase"]["forward"]
        worst = torch.tensor([float(kept), float(peak)], dtype=torch.float64)
        C.all_reduce(worst, grid.world_group, op="max")
        out[cp] = {"kept_bytes": int(worst[0]), "forward_peak_bytes": int(worst[1])}
        del loss, model
        grid.close()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seq", type=positive_int, default=1024,
                    help="sequence length (a multiple of 8)")
    ap.add_argument("--layers", type=positive_int, default=2)
    ap.add_argument("--hidden", type=positive_int, default=64)
    ap.add_argument("--heads", type=positive_int, default=4)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", default=str(ROOT / "runs" / "bench"),
                    help="where the ranks' rendezvous file goes")
    a = ap.parse_args(argv)
    if a.seq % 8:
        ap.error(f"--seq {a.seq}: cp 4 cuts it into 8 chunks; use a multiple of 8")
    res = spawn(worker, 4, a, timeout=600, store_dir=a.out)[0]
    if a.json:
        print(json.dumps(res))
        return 0
    print(f"seq {a.seq}, {a.layers} layers, hidden {a.hidden}, {a.heads} heads, fp32, "
          f"micro-batch 1; max over 4 ranks (MemoryTracker)")
    print("| cp | kept for backward (MiB) | ratio to previous cp | forward peak (MiB) | ratio |")
    print("|---|---|---|---|---|")
    prev = None
    for cp, r in res.items():
        k, p = r["kept_bytes"] / MiB, r["forward_peak_bytes"] / MiB
        ratios = ("", "") if prev is None else (f"{k / prev[0]:.3f}", f"{p / prev[1]:.3f}")
        print(f"| {cp} | {k:.2f} | {ratios[0]} | {p:.2f} | {ratios[1]} |")
        prev = (k, p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
