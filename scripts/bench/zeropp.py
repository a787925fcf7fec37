"""ZeRO++ against its unquantized peers on gloo ranks, tiny GPT, the issue's full length.

    .venv/bin/python scripts/bench/zeropp.py --ranks 4 --steps 200 [--node 2] [--block 256]

Prints per pair: bytes of the collective ZeRO++ replaces (qwZ: stage-3 all-gather over "dp";
qgZ: stage-2 reduce-scatter vs the quantized all-to-alls; hpZ: cross-node "dp" gather bytes) and
the relative gap of the mean loss over the last 5 steps. The tests run shorter (tests/zero/test_zeropp.py).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from zerotron.testing.bench_args import flag_errors, positive_int
from zerotron.testing.launch import spawn
from zerotron.testing.zero_runs import comm_bytes, tail_loss, train_gpt
from zerotron.zero import ZeroConfig

ROOT = Path(__file__).resolve().parents[2]
STORE = str(ROOT / "runs" / "bench")  # the ranks' rendezvous files: under the checkout, whatever the cwd


def _run(configs, steps):
    return [train_gpt(kw, steps) for kw in configs]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=positive_int, default=4, help="gloo CPU ranks (DP size) (default: %(default)s)")
    ap.add_argument("--steps", type=positive_int, default=200,
                    help="training steps of each run; the loss gap is over the last 5 (default: %(default)s)")
    ap.add_argument("--node", type=positive_int, default=2,
                    help="hpZ / hierarchical qgZ group size, ranks per simulated node (default: %(default)s)")
    ap.add_argument("--block", type=positive_int, default=256,
                    help="zero_quantization_block_size: elements per quantization scale (default: %(default)s)")
    a = ap.parse_args(argv)
    b = dict(zero_quantization_block_size=a.block)
    pairs = [
        ("qwZ", dict(stage=3), dict(stage=3, zero_quantized_weights=True, **b), "all_gather", ("dp",)),
        ("qgZ", dict(stage=2), dict(stage=2, zero_quantized_gradients=True, zero_quantized_gradients_node_size=a.node,
                                    **b), None, None),
        ("hpZ", dict(stage=3), dict(stage=3, zero_hpz_partition_size=a.node), "all_gather", ("dp",)),
    ]
    with flag_errors(ap, {"zero_hpz_partition_size": "--node", "zero_quantized_gradients_node_size": "--node",
                          "zero_quantization_block_size": "--block"}, note=f"--ranks {a.ranks} is the DP size"):
        for _, base_kw, kw, _, _ in pairs:
            ZeroConfig(**base_kw).validate(dp_size=a.ranks)
            ZeroConfig(**kw).validate(dp_size=a.ranks)
    for name, base_kw, kw, op, groups in pairs:
        base, new = spawn(_run, a.ranks, [base_kw, kw], a.steps, timeout=60 + 2 * a.steps, store_dir=STORE)[0]
        if op is None:  # qgZ: the reduce-scatter becomes all-to-alls
            ratio = comm_bytes(new["comm"], "all_to_all") / comm_bytes(base["comm"], "reduce_scatter")
        else:
            ratio = comm_bytes(new["comm"], op, groups) / comm_bytes(base["comm"], op, groups)
        lb, ln = tail_loss(base["losses"]), tail_loss(new["losses"])
        print(f"{name}: bytes ratio {ratio:.4f}  loss {ln:.4f} vs {lb:.4f} (gap {abs(ln - lb) / lb:.3%}) "
              f"after {a.steps} steps on {a.ranks} ranks")


if __name__ == "__main__":
    main()
