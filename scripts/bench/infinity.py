"""ZeRO-Infinity step-time cost against the disk's measured bandwidth (tiny-to-small GPT, gloo ranks).

    .venv/bin/python scripts/bench/infinity.py --ranks 2 --steps 6 --hidden 256 --layers 4 \
        [--nvme-path /local_nvme] [--sub-group-size 1000000] [--buffer-count 4]

Runs stage 3 without offload, with CPU offload, with NVMe optimizer offload and with the
parameters on NVMe too (``offload_param``; same model, data, seed) and prints the median step time
(first step excluded, max over ranks), the disk bytes read/written per step per rank, and the time
those bytes would take at ``measure_bandwidth``'s sequential rates -- the floor the read-ahead /
write-behind pipeline can approach. The read rate may come from the page cache (an upper bound on
the disk). The parameter configuration's extra cost is printed against the optimizer-only one.
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import statistics
import tempfile
from pathlib import Path

from zerotron.model import GPTConfig
from zerotron.testing.bench_args import flag_errors, positive_int
from zerotron.testing.launch import spawn
from zerotron.testing.zero_runs import train_gpt
from zerotron.zero import ZeroConfig
from zerotron.zero.infinity.disk_store import measure_bandwidth

ROOT = Path(__file__).resolve().parents[2]
STORE = str(ROOT / "runs" / "bench")  # the ranks' rendezvous files: under the checkout, whatever the cwd


def _run(kw, steps, shape):
    return train_gpt(kw, steps, shape=shape)


def offload_configs(a, path: str) -> tuple[dict, dict]:
    """The ZeroConfig keys of the NVMe optimizer offload and of NVMe parameters on top of it."""
    nvme = dict(stage=3, offload_optimizer_device="nvme", offload_optimizer_nvme_path=path,
                sub_group_size=a.sub_group_size, offload_optimizer_buffer_count=a.buffer_count)
    return nvme, dict(nvme, offload_param_device="nvme", offload_param_nvme_path=path,
                      offload_param_buffer_count=a.param_buffer_count)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=positive_int, default=2, help="gloo CPU ranks (DP size) (default: %(default)s)")
    ap.add_argument("--steps", type=positive_int, default=6,
                    help="training steps per configuration, at least 2: the first is excluded (default: %(default)s)")
    ap.add_argument("--layers", type=positive_int, default=4, help="GPT layers (default: %(default)s)")
    ap.add_argument("--hidden", type=positive_int, default=256, help="GPT hidden size (default: %(default)s)")
    ap.add_argument("--heads", type=positive_int, default=4, help="attention heads (default: %(default)s)")
    ap.add_argument("--vocab", type=positive_int, default=4096, help="GPT vocabulary size (default: %(default)s)")
    ap.add_argument("--seq", type=positive_int, default=64, help="sequence length (default: %(default)s)")
    ap.add_argument("--nvme-path", default=None,
                    help="directory for the offloaded files (default: a fresh one under the checkout's "
                         "runs/bench/infinity, removed when done)")
    ap.add_argument("--sub-group-size", type=positive_int, default=1_000_000,
                    help="zero.sub_group_size: elements of one optimizer-step tile (default: %(default)s)")
    ap.add_argument("--buffer-count", type=positive_int, default=4,
                    help="zero.offload_optimizer_buffer_count: optimizer tiles in flight (default: %(default)s)")
    ap.add_argument("--param-buffer-count", type=positive_int, default=5,
                    help="zero.offload_param_buffer_count: parameter buffers read ahead (default: %(default)s)")
    ap.add_argument("--probe-mb", type=positive_int, default=256,
                    help="MiB written and read to measure the disk's bandwidth (default: %(default)s)")
    a = ap.parse_args(argv)
    if a.steps < 2:
        ap.error(f"--steps {a.steps}: give at least 2 (the first step is excluded from the median)")
    if a.nvme_path is not None and not Path(a.nvme_path).is_dir():
        ap.error(f"--nvme-path {a.nvme_path}: not a directory; create it, or omit the flag for one under runs/bench")
    shape = dict(num_layers=a.layers, hidden_size=a.hidden, num_heads=a.heads, vocab_size=a.vocab, seq_length=a.seq)
    with flag_errors(ap, {"hidden_size": "--hidden", "num_heads": "--heads", "seq_length": "--seq",
                          "vocab_size": "--vocab", "sub_group_size": "--sub-group-size",
                          "offload_optimizer_buffer_count": "--buffer-count",
                          "offload_param_buffer_count": "--param-buffer-count"}):
        GPTConfig(**shape).validate()
        ZeroConfig(**offload_configs(a, a.nvme_path or "the default")[1]).validate(dp_size=a.ranks)
    if a.nvme_path is not None:
        measure(a, a.nvme_path, shape)
        return
    # under the checkout's runs/, never the system temp dir (often RAM-backed tmpfs); removed when
    # done, as the offload files inside it are: nothing of this run is left behind
    parent = ROOT / "runs" / "bench" / "infinity"
    parent.mkdir(parents=True, exist_ok=True)
    path = tempfile.mkdtemp(prefix="nvme_", dir=parent)
    try:
        measure(a, path, shape)
    finally:
        shutil.rmtree(path, ignore_errors=True)
        with contextlib.suppress(OSError):  # another run's directory may still be in it
            parent.rmdir()


def measure(a, path: str, shape: dict) -> None:
    """The disk's bandwidth under ``path``, then the four configurations and what they cost."""
    bw = measure_bandwidth(path, a.probe_mb)
    print(f"disk {path}: write {bw['write_GiBps']:.2f} GiB/s, read {bw['read_GiBps']:.2f} GiB/s "
          f"({a.probe_mb} MiB probe, fsync'd write; read may hit the page cache)")
    nvme, params = offload_configs(a, path)
    rows = {}
    for name, kw in (("stage3", dict(stage=3)), ("stage3+cpu", dict(stage=3, offload_optimizer=True)),
                     ("stage3+nvme", nvme), ("+nvme params", params)):
        res = spawn(_run, a.ranks, kw, a.steps, shape, timeout=120 + 30 * a.steps, store_dir=STORE)
        step = statistics.median(max(r["times"][i] for r in res) for i in range(1, a.steps))
        rows[name] = (step, res[0])
        mem = res[0]["memory"]
        print(f"{name:13s} step {step * 1e3:8.1f} ms  model states in memory {mem['total_model_states'] / 2**20:7.2f} MiB"
              f"  on disk {mem['offloaded_to_disk'] / 2**20:7.2f} MiB")
    step, r = rows["stage3+nvme"]
    read = r["disk"]["read"] / a.steps
    written = r["disk"]["written"] / a.steps
    floor = read / (bw["read_GiBps"] * 2**30) + written / (bw["write_GiBps"] * 2**30)
    cost = step - rows["stage3"][0]
    print(f"nvme per step per rank: read {read / 2**20:.2f} MiB, written {written / 2**20:.2f} MiB -> "
          f"{floor * 1e3:.1f} ms at the measured bandwidth (serial); measured offload cost "
          f"{cost * 1e3:+.1f} ms vs stage 3 ({(cost) / rows['stage3'][0]:+.1%}), "
          f"{(step - rows['stage3+cpu'][0]) * 1e3:+.1f} ms vs CPU offload")

    step_p, r = rows["+nvme params"]
    io = r["param_disk"]
    read, written = io["read"] / a.steps, io["written"] / a.steps
    floor = read / (bw["read_GiBps"] * 2**30) + written / (bw["write_GiBps"] * 2**30)
    saved = rows["stage3+nvme"][1]["memory"]["total_model_states"] - r["memory"]["total_model_states"]
    print(f"params on nvme per step per rank: read {read / 2**20:.2f} MiB, written {written / 2**20:.2f} MiB -> "
          f"{floor * 1e3:.1f} ms at the measured bandwidth (serial); {io['read_ahead_hits']} unit reads served by "
          f"read-ahead; cost {(step_p - step) * 1e3:+.1f} ms vs optimizer-only NVMe "
          f"({(step_p - step) / step:+.1%}), {(step_p - rows['stage3'][0]) * 1e3:+.1f} ms vs stage 3; "
          f"{saved / 2**20:.2f} MiB less model state in memory")


if __name__ == "__main__":
    main()
