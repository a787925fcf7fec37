"""Activation bytes per transformer layer at TP 2, measured, against Korthikanti et al. 2022 Table 2.

    python scripts/bench/activation_memory.py [--hidden 256 --heads 8 --seq 128 --batch 2]

Forks two gloo ranks on CPU. For each row (none, SP, selective, SP+selective, full, full+Pa,
full+SP, Pa+cpu) it builds the GPT on TP 2 (dropout 0.1 and attention dropout 0.1, so every
mask of the paper's count exists) and measures one forward of its blocks
(``zerotron.testing.activation_bytes``): **saved** = the tensors autograd saved (the paper's way of
counting), **freed** = the storages that die with the graph (what the allocator holds for
backward, checkpoints included). The formula column is ``estimate.activations`` with this
run's widths: fp32 activations (e = 4) and, on a CPU, fp32 dropout masks (torch's CPU dropout
keeps the scaled noise; m = 4); the rows with a graph add the LayerNorm statistics (mean, 1/σ),
which Table 2 leaves out. The last column is Table 2 as printed (16-bit values, byte masks) for
the same shape: the figures a GPU run in bf16 with an unfused attention kernel would have.
fp32 because the CPU's SDPA math kernel upcasts 16-bit inputs to fp32 internally, which no
16-bit formula describes.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from zerotron.testing.bench_args import flag_errors, positive_int
from zerotron.testing.launch import spawn

ROOT = Path(__file__).resolve().parents[2]
STORE = str(ROOT / "runs" / "bench")  # the ranks' rendezvous files: under the checkout, whatever the cwd


def worker(args) -> dict:
    from zerotron.parallel import Grid, ParallelDims
    from zerotron.testing.activation_bytes import ROWS, measure_row

    grid = Grid(ParallelDims(tp=2))
    return {name: measure_row(name, model_cfg(args), grid, args.batch) for name in ROWS}


def model_cfg(args):
    from zerotron.model import GPTConfig

    return GPTConfig(num_layers=args.layers, hidden_size=args.hidden, num_heads=args.heads, vocab_size=256,
                     seq_length=args.seq, make_vocab_size_divisible_by=8, dropout=0.1, attention_dropout=0.1)


def formula(name: str, args, t: int = 2) -> tuple[float, float]:
    """(this run's formula incl. LayerNorm statistics, Table 2 as printed) bytes per layer."""
    from zerotron.estimate.activations import korthikanti_table2, layer_activation_bytes, layernorm_stats_bytes
    from zerotron.testing.activation_bytes import ROWS

    sp, fields = ROWS[name]
    full = fields.get("checkpoint_activations", False)
    recompute = "full" if full else ("selective" if fields.get("recompute_granularity") == "selective" else "none")
    pa = fields.get("partition_activations", False)
    b, s, h, a = args.batch, args.seq, args.hidden, args.heads
    ours = layer_activation_bytes(b, s, h, a, t, sp, recompute, act_bytes=4, mask_bytes=4, partition_activations=pa)
    if not full:
        ours += layernorm_stats_bytes(b, s, t, sp)
    table = korthikanti_table2(s, b, h, a, t)
    key = {"none": "tp", "SP": "tp+sp", "selective": "tp+selective", "SP+selective": "tp+sp+selective"}.get(name)
    printed = table[key] if key else table["full"] / (t if (sp or pa) else 1)
    return ours, printed


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=positive_int, default=256)
    parser.add_argument("--heads", type=positive_int, default=8, help="attention heads; TP 2 needs an even count")
    parser.add_argument("--seq", type=positive_int, default=128)
    parser.add_argument("--batch", type=positive_int, default=2)
    parser.add_argument("--layers", type=positive_int, default=2)
    args = parser.parse_args(argv)
    with flag_errors(parser, {"hidden_size": "--hidden", "num_heads": "--heads", "seq_length": "--seq"},
                     note="this benchmark runs at TP 2"):
        model_cfg(args).validate(2)
    got = spawn(worker, 2, args, timeout=600, store_dir=STORE)[0]
    print(f"TP 2, per layer, rank 0: s={args.seq} b={args.batch} h={args.hidden} a={args.heads}, fp32, "
          f"dropout 0.1 + attention dropout 0.1, {args.layers} layers measured")
    print(f"| {'row':12} | {'saved (autograd)':>16} | {'freed (allocator)':>17} | {'formula':>10} | "
          f"{'measured/formula':>16} | {'Table 2, bf16':>13} |")
    print(f"|{'-' * 14}|{'-' * 18}:|{'-' * 19}:|{'-' * 11}:|{'-' * 17}:|{'-' * 14}:|")
    for name, m in got.items():
        ours, printed = formula(name, args)
        measured = m["saved"] if m["saved"] else m["freed"]  # a checkpoint is kept outside autograd
        print(f"| {name:12} | {int(m['saved']):>16,} | {int(m['freed']):>17,} | {int(ours):>10,} | "
              f"{measured / ours:>16.4f} | {int(printed):>13,} |")


if __name__ == "__main__":
    main()
