"""What zerotron's machinery costs on the CPU: its step against the plainest loops torch offers.

    .venv/bin/python scripts/bench/overhead.py --rounds 5

Two comparisons, same GPT (``zerotron.model.gpt.GPT``, same seed), same data, same AdamW
hyper-parameters, fp32, gloo ranks forked by ``zerotron.testing.launch``:

* **one process**: a plain PyTorch loop -- the model, ``torch.optim.AdamW`` (its default
  implementation), backward per micro-batch, ``step``, ``zero_grad`` and nothing else -- against
  zerotron at TP 1 / DP 1 / ZeRO stage 0 built by ``parallelize_gpt`` and stepped by the
  trainer's own step (``training.step.run_step``: flat buffers, fp32 master, grad norm, fused AdamW);
* **``--ranks`` processes** (default 4): zerotron stage 0 against ``DistributedDataParallel``
  with the same AdamW.

Clipping is off on both sides unless ``--clip`` (zerotron still computes the norm it logs).
Every configuration runs in fresh processes, ``--rounds`` times, interleaved so that a load
change on a shared machine hits all of them alike; the table shows the medians over rounds of
each run's median step time (first ``--warmup`` steps excluded; max over ranks) and the ratio
zerotron ÷ peer, for wall time and for the CPU time the processes used (``time.process_time``,
all their threads; on a machine shared with other work the wall time also counts waiting for a
core, the CPU time does not). Goal (issue 22): <= 1.05 single-process, <= 1.0 against DDP.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from zerotron.testing.bench_args import (add_gpt_flags, check_gpt, gpt_config, nonnegative_float, nonnegative_int,
                                          positive_int)
from zerotron.testing.launch import spawn

ROOT = Path(__file__).resolve().parents[2]
STORE = str(ROOT / "runs" / "bench")  # the ranks' rendezvous files: under the checkout, whatever the cwd

HYPER = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def model_config(args):
    return gpt_config(args)


def groups(model):
    """zerotron's AdamW groups: decoupled decay on ndim >= 2 only (no biases, no LayerNorm)."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [{"params": [p for p in params if p.dim() >= 2]},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]


def zerotron_step(args, grid):
    from zerotron.config.run_config import RunConfig
    from zerotron.training.parallelize import parallelize_gpt
    from zerotron.training.step import run_step

    run = RunConfig()
    run.zero.stage, run.training.precision, run.training.seed = 0, "fp32", 1
    run.training.micro_batch_size = args.micro_batch
    run.training.global_batch_size = args.micro_batch * args.micro * grid.dp_size
    o = run.optimizer
    o.lr, (o.beta1, o.beta2), o.eps, o.weight_decay = HYPER["lr"], HYPER["betas"], HYPER["eps"], HYPER["weight_decay"]
    o.clip_grad = args.clip
    plan = parallelize_gpt(run.validate(grid.world_size), model_config(args), grid)

    def step(batches):
        return run_step(plan.model, plan.optimizer, batches, grid).loss_sum

    return step


def torch_step(args, grid, ddp: bool):
    from zerotron.model.gpt import GPT

    model = GPT(model_config(args), grid, seed=1)
    if ddp:
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model, gradient_as_bucket_view=True)
    opt = torch.optim.AdamW(groups(model), **HYPER)

    def step(batches):
        total = 0.0
        for x, y in batches:
            loss = model(x, labels=y)
            (loss / len(batches)).backward()
            total = total + loss.detach() / len(batches)
        if args.clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        opt.step()
        opt.zero_grad()
        return total

    return step


def worker(args, kind: str) -> tuple[float, float]:
    """One rank of one configuration: its median step time, wall and CPU, in seconds."""
    import torch.distributed as dist

    from zerotron.parallel import Grid, ParallelDims

    grid = Grid(ParallelDims())
    step = zerotron_step(args, grid) if kind == "zerotron" else torch_step(args, grid, ddp=kind == "ddp")
    g = torch.Generator().manual_seed(100 + dist.get_rank())
    tokens = [torch.randint(0, args.vocab, (args.micro_batch, args.seq + 1), generator=g) for _ in range(args.micro)]
    batches = [(t[:, :-1].contiguous(), t[:, 1:].contiguous()) for t in tokens]
    wall, cpu = [], []
    for k in range(args.warmup + args.steps):
        t0, c0 = time.perf_counter(), time.process_time()
        float(step(batches))  # the loss on the host: the step is done
        if k >= args.warmup:
            wall.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
    grid.close()
    return statistics.median(wall), statistics.median(cpu)


def measure(kind: str, ranks: int, args) -> tuple[float, float]:
    out = spawn(worker, ranks, args, kind, threads=args.threads, collective_timeout=600.0, timeout=1800.0,
                store_dir=STORE)
    return max(w for w, _ in out), max(c for _, c in out)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_gpt_flags(ap, layers=4, hidden=256, vocab=8192, seq=128)
    ap.add_argument("--micro-batch", type=positive_int, default=4)
    ap.add_argument("--micro", type=positive_int, default=2, help="micro-batches per step")
    ap.add_argument("--steps", type=positive_int, default=10)
    ap.add_argument("--warmup", type=nonnegative_int, default=2)
    ap.add_argument("--rounds", type=positive_int, default=3)
    ap.add_argument("--ranks", type=positive_int, default=4)
    ap.add_argument("--threads", type=positive_int, default=1, help="torch threads per rank")
    ap.add_argument("--clip", type=nonnegative_float, default=0.0, help="gradient clipping on both sides (0: off)")
    ap.add_argument("--only", choices=("single", "dp"), help="one of the two comparisons")
    args = ap.parse_args(argv)
    check_gpt(ap, args)
    runs = {"single": [("plain", 1), ("zerotron", 1)], "dp": [("ddp", args.ranks), ("zerotron", args.ranks)]}
    runs = {k: v for k, v in runs.items() if args.only in (None, k)}
    got: dict[tuple[str, int], list[tuple[float, float]]] = {}
    for r in range(args.rounds):
        for pair in runs.values():
            for kind, ranks in pair:
                got.setdefault((kind, ranks), []).append(measure(kind, ranks, args))
                wall, cpu = got[(kind, ranks)][-1]
                print(f"  round {r + 1}: {kind} x{ranks} {wall * 1e3:.1f} ms/step wall, {cpu * 1e3:.1f} ms CPU",
                      file=sys.stderr, flush=True)
    print(f"layers={args.layers} hidden={args.hidden} vocab={args.vocab} seq={args.seq} micro_batch="
          f"{args.micro_batch}x{args.micro} steps={args.steps} rounds={args.rounds} threads={args.threads} "
          f"clip={args.clip} torch={torch.__version__}")
    print(f"{'comparison':<24}{'peer ms':>9}{'zerotron ms':>13}{'ratio':>7}{'peer CPU ms':>13}"
          f"{'zerotron CPU ms':>17}{'ratio':>7}{'goal':>6}")
    for name, ((peer, ranks), _) in runs.items():
        (pw, pc), (zw, zc) = [[statistics.median(x[i] for x in got[(k, ranks)]) for i in (0, 1)]
                              for k in (peer, "zerotron")]
        label = f"{'1 process' if name == 'single' else f'{ranks} ranks'}: vs {'AdamW loop' if peer == 'plain' else 'DDP'}"
        print(f"{label:<24}{pw * 1e3:>9.1f}{zw * 1e3:>13.1f}{zw / pw:>7.3f}{pc * 1e3:>13.1f}{zc * 1e3:>17.1f}"
              f"{zc / pc:>7.3f}{1.05 if name == 'single' else 1.0:>6.2f}")


if __name__ == "__main__":
    main()
