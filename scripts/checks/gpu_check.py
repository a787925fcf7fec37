"""One-GPU check: does zerotron compute right and fast on a real GPU? Exits 1 on any mismatch.

    bash scripts/gpu_check.sh                        # on a one-GPU machine; installs nothing, <= 8 min
    python scripts/checks/gpu_check.py --tiny        # the same code on CPU with a tiny model (CI smoke test)

Without ``--tiny`` it needs a CUDA device and exits 2 where none is visible (or
``ZEROTRON_DEVICE=cpu`` hides it), before building anything: on the CPU its parity would compare
the CPU with itself and its ~1.3B model would not fit. A bad flag also exits 2, naming it.

What it asserts, one table row per run, through the trainer's own step (``training.step.run_step``)
and plan (``parallelize_gpt``):

1. **fp32 parity**: a small GPT for a few steps on the GPU in strict fp32 (TF32 off) has the
   losses of the same run on the CPU, rtol 1e-4 (same initial weights: they are drawn on the host).
2. **bf16, ZeRO stages 0-3, each with and without activation checkpointing, Pa+cpu and optimizer
   CPU offload** on a ~1.3B GPT: every loss finite and within 2% of stage 0's (on one rank the
   stages partition over one member: same arithmetic, different code paths). Reported: median
   step time, hardware TFLOP/s, MFU (model FLOPs) and HFU (recompute included) against the
   device's peak (``model.flops``; MFU and HFU must be <= 100%), peak allocated memory against the
   memory model's prediction (``estimate.memory_model``; it must lie between half the prediction
   and the prediction with its fragmentation margin), and the attention kernel SDPA really ran,
   recorded from the dispatched aten ops (flash or cuDNN expected in bf16 on sm80+).
   Then the paths a CPU run cannot see on a device: ZeRO-Infinity's NVMe optimizer tier
   (``s3+nvme``, files under ``--nvme-path``), stage 3's partition in host memory
   (``s3+param-cpu``), fp16 with loss scaling (``s2+fp16``), ZeRO++'s int8 quantization
   (``s3+qwZ+qgZ``) and the debug sequence check (``s1+debug``), under the same checks.
3. **two processes on the one GPU** (row ``2proc``, ``gpu_check_pair.py``): TP 2 and stage-0
   DP 2 over a gloo group handed the device's tensors, each against one process, fp32 rtol 1e-4:
   the collectives, the TP all-reduces and ZeRO's gradient all-reduce run on the device.
4. **bit-identical resume** (row ``resume``, ``gpu_check_resume.py``): a tiny run with
   ``training.deterministic`` on, against the same run stopped at a checkpoint and resumed:
   losses and final weights bit for bit (bf16, flash attention, dropout), in a fresh process.
5. **pinned host<->device bandwidth** (what Pa+cpu and offload move): at least 5 GiB/s each way.

In the single-process rows the DP degree is 1, so every collective returns before reaching a
group; the stages show their overheads, not their savings. NCCL itself is not exercised: it
refuses two ranks on one GPU, so that needs two GPUs.
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from zerotron.estimate import memory_model
from zerotron.model import GPTConfig
from zerotron.model.flops import device_peak_tflops, flops_per_iteration
from zerotron.parallel import Grid, ParallelDims, init_distributed, shutdown
from zerotron.parallel.runtime import pick_device
from zerotron.testing.bench_args import flag_errors, nonnegative_int, positive_float, positive_int
from zerotron.config.run_config import RunConfig
from zerotron.training.parallelize import parallelize_gpt
from zerotron.training.step import run_step
from zerotron.zero.optimizer import DTYPES

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: scripts.checks
from scripts.checks.gpu_check_pair import pair_row  # noqa: E402
from scripts.checks.gpu_check_resume import resume_row  # noqa: E402

ROWS = [  # name, zero stage, activation checkpointing, Pa+cpu, optimizer CPU offload, others
    *((f"s{s}", s, False, False, False, {}) for s in range(4)),
    *((f"s{s}+ckpt", s, True, False, False, {}) for s in range(4)),
    ("s2+ckpt+Pa+cpu", 2, True, True, False, {}),
    ("s2+offload", 2, False, False, True, {}),
    # the device paths issue 41 found untested: the NVMe tier's host Adam, stage 3's host
    # partition, fp16's loss scaling and overflow read, ZeRO++'s int8 kernels, the debug check
    ("s3+nvme", 3, False, False, False, {"zero.offload_optimizer_device": "nvme"}),
    ("s3+param-cpu", 3, False, False, False, {"zero.offload_param_device": "cpu"}),
    ("s2+fp16", 2, False, False, False, {"training.precision": "fp16"}),
    ("s3+qwZ+qgZ", 3, False, False, False, {"zero.zero_quantized_weights": True,
                                            "zero.zero_quantized_gradients": True}),
    ("s1+debug", 1, False, False, False, {"debug_collectives": True}),
]
PARITY_RTOL, LOSS_RTOL, MIN_GBPS = 1e-4, 0.02, 5.0
FUSED_BF16 = ("flash", "cudnn")


class AttentionKernel(TorchDispatchMode):
    """Records which SDPA kernel the dispatcher picked: the fused ones are aten ops of their own,
    the math fallback decomposes into matmuls and softmax before it reaches this mode."""

    def __init__(self):
        super().__init__()
        self.seen: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__
        if "attention" in name and "backward" not in name:
            self.seen.add(name)
        return func(*args, **(kwargs or {}))

    @property
    def backend(self) -> str:
        for kind in ("flash_attention_for_cpu", "flash", "efficient", "cudnn"):
            if any(kind in n for n in self.seen):
                return {"flash_attention_for_cpu": "flash_cpu"}.get(kind, kind)
        return "math"


def run_config(cfg: RunConfig) -> RunConfig:
    o = cfg.optimizer
    o.lr, o.beta1, o.beta2, o.eps, o.weight_decay, o.clip_grad = 1e-4, 0.9, 0.95, 1e-8, 0.1, 1.0
    return cfg.validate(1)


def train(mcfg: GPTConfig, grid, device, precision: str, stage: int, ckpt: bool, pa_cpu: bool, offload: bool,
          args, other: dict | None = None) -> dict:
    """``args.warmup + args.steps`` steps of ``args.micro`` micro-batches; times, losses, memory,
    kernel. ``other``: the row's ``{"section.field": value}``; ``debug_collectives``: the check."""
    cfg = RunConfig()
    cfg.zero.stage, cfg.zero.offload_optimizer = stage, offload
    other = dict(other or {})
    grid.health.check_sequence = other.pop("debug_collectives", False)  # ZEROTRON_DEBUG_COLLECTIVES
    if other.get("zero.offload_optimizer_device") == "nvme":
        cfg.zero.offload_optimizer_nvme_path = args.nvme_path
    ac = cfg.activation_checkpointing
    ac.checkpoint_activations, ac.partition_activations, ac.cpu_checkpointing = ckpt, pa_cpu, pa_cpu
    t = cfg.training
    t.precision, t.seed, t.micro_batch_size = precision, 1, args.micro_batch
    t.global_batch_size = args.micro_batch * args.micro
    for key, value in other.items():
        section, name = key.split(".")
        setattr(getattr(cfg, section), name, value)
    cfg = run_config(cfg)
    plan = parallelize_gpt(cfg, mcfg, grid, device=device, layout_independent_init=False)
    g = torch.Generator().manual_seed(7)
    tokens = [torch.randint(0, mcfg.vocab_size, (args.micro_batch, mcfg.seq_length + 1), generator=g)
              for _ in range(args.micro)]
    batches = [(x[:, :-1].contiguous().to(device), x[:, 1:].contiguous().to(device)) for x in tokens]
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    kernel, times, losses = AttentionKernel(), [], []
    for step in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        if step == 0:
            with kernel:
                res = run_step(plan.model, plan.optimizer, batches, grid)
        else:
            res = run_step(plan.model, plan.optimizer, batches, grid)
        losses.append(float(res.loss_sum))  # a host read: the step is done
        if step >= args.warmup:
            times.append(time.perf_counter() - t0)
    row = {"step_s": statistics.median(times), "losses": losses, "sdpa": kernel.backend,
           "peak_GB": torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None, "predicted": None}
    try:
        row["predicted"] = memory_model.estimate(memory_model.setup_from_run_config(cfg, mcfg, gpus=1))
    except ValueError:  # offload: outside the memory model
        pass
    hardware = flops_per_iteration(mcfg, t.global_batch_size, recompute=ckpt)
    model = flops_per_iteration(mcfg, t.global_batch_size, recompute=False)
    peak = args.peak_tflops or device_peak_tflops(device, DTYPES[cfg.training.precision])
    row["tflops"] = hardware / row["step_s"] / 1e12
    row["mfu"] = model / row["step_s"] / 1e12 / peak if peak else None
    row["hfu"] = row["tflops"] / peak if peak else None
    del plan, batches
    if cuda:  # the next run's peak must not see this one's memory
        gc.collect()
        torch.cuda.empty_cache()
    return row


def bandwidth(device: torch.device, mbytes: int) -> dict[str, float]:
    host = torch.empty(mbytes << 20, dtype=torch.uint8).pin_memory()
    dev = torch.empty_like(host, device=device)
    out = {}
    for name, dst, src in (("h2d", dev, host), ("d2h", host, dev)):
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        for _ in range(5):
            dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize(device)
        out[name] = 5 * mbytes / 1024 / (time.perf_counter() - t0)
    return out


def check_row(name: str, r: dict, ref_loss: float | None, device: torch.device, failures: list[str]) -> None:
    if not all(math.isfinite(x) for x in r["losses"]):
        failures.append(f"{name}: non-finite loss {r['losses']}")
    elif ref_loss is not None and abs(r["losses"][-1] - ref_loss) > LOSS_RTOL * abs(ref_loss):
        failures.append(f"{name}: loss {r['losses'][-1]:.5f} is not within {LOSS_RTOL:.0%} of stage 0's {ref_loss:.5f}")
    for key in ("mfu", "hfu"):
        if r[key] is not None and not 0 < r[key] <= 1:
            failures.append(f"{name}: {key.upper()} {r[key]:.1%} is impossible (FLOP count or timing is wrong)")
    if device.type != "cuda":
        return
    major, _ = torch.cuda.get_device_capability(device)
    expected = FUSED_BF16 if major >= 8 else ("efficient",)
    if r["sdpa"] not in expected:
        failures.append(f"{name}: SDPA ran {r['sdpa']!r} in bf16, expected one of {expected} on sm{major}x")
    e = r["predicted"]
    if e is not None:
        low, high = 0.5 * e["before_margin"] / 2**30, e["total"] / 2**30
        if not low <= r["peak_GB"] <= high:
            failures.append(f"{name}: peak allocated {r['peak_GB']:.2f} GiB is outside the memory model's "
                            f"[{low:.2f}, {high:.2f}] GiB")


def fmt(x, width: int, spec: str) -> str:
    return f"{'-' if x is None else format(x, spec):>{width}}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true",
                   help="tiny models, a few steps (the CPU smoke test of this script); size flags given beside it hold")
    p.add_argument("--layers", type=positive_int, default=24)
    p.add_argument("--hidden", type=positive_int, default=2048)
    p.add_argument("--heads", type=positive_int, default=16)
    p.add_argument("--seq", type=positive_int, default=1024)
    p.add_argument("--vocab", type=positive_int, default=50257)
    p.add_argument("--micro-batch", type=positive_int, default=4)
    p.add_argument("--micro", type=positive_int, default=2, help="micro-batches per step")
    p.add_argument("--warmup", type=nonnegative_int, default=2)
    p.add_argument("--steps", type=positive_int, default=3)
    p.add_argument("--peak-tflops", type=positive_float, default=None, help="override the device table (model.flops)")
    p.add_argument("--nvme-path", default=os.path.join(".cache", "zerotron", "gpu_check_nvme"),
                   help="directory for the s3+nvme row's optimizer files (node-local NVMe)")
    row_names = [r[0] for r in ROWS] + ["2proc", "resume"]
    p.add_argument("--only", nargs="*", choices=row_names, metavar="ROW",
                   help=f"run only these of {row_names} (parity always runs)")
    args = p.parse_args(argv)
    if args.tiny:  # tiny sizes as the defaults: a size flag given beside --tiny still holds
        p.set_defaults(layers=2, hidden=64, heads=4, seq=32, vocab=512, micro_batch=2, warmup=1, steps=1)
        args = p.parse_args(argv)
    with flag_errors(p, {"num_layers": "--layers", "hidden_size": "--hidden", "num_heads": "--heads",
                         "seq_length": "--seq", "vocab_size": "--vocab"}):
        big = GPTConfig(num_layers=args.layers, hidden_size=args.hidden, num_heads=args.heads,
                        vocab_size=args.vocab, seq_length=args.seq).validate()
    try:
        small = GPTConfig(num_layers=2, hidden_size=min(args.hidden, 256), num_heads=4,
                          vocab_size=min(args.vocab, 1024), seq_length=min(args.seq, 128)).validate()
    except ValueError:
        p.error(f"--hidden {args.hidden}: the fp32 parity model has min(--hidden, 256) hidden and 4 heads, so "
                f"--hidden must be a multiple of 4")
    try:
        device = pick_device(int(os.environ.get("LOCAL_RANK", 0)))
    except (ValueError, RuntimeError) as e:
        p.error(str(e))
    if device.type != "cuda" and not args.tiny:
        p.error("no CUDA device is visible (torch.cuda.is_available() is False, or ZEROTRON_DEVICE=cpu), so there "
                "is nothing to check against the CPU; run it on a GPU machine, or pass --tiny for the CPU smoke mode")
    owned = not dist.is_initialized()  # else a launcher's group (the CI smoke test): leave it to it
    env = init_distributed(timeout_s=600)
    # at TP 1 Pa has no ranks to partition over: Pa+cpu keeps whole checkpoints on the host, as intended here
    warnings.filterwarnings("ignore", message=".*Pa is a no-op.*")
    device, grid = env.device, Grid(ParallelDims())
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False  # strict fp32 parity
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"[gpu_check] {name}, torch {torch.__version__} | bf16 runs: {big.exact_num_params() / 1e9:.2f}B params "
          f"({args.layers} layers, hidden {args.hidden}, seq {args.seq}, batch {args.micro_batch} x {args.micro})",
          flush=True)
    failures: list[str] = []
    here = train(small, grid, device, "fp32", 0, False, False, False, args)["losses"]
    cpu = train(small, grid, torch.device("cpu"), "fp32", 0, False, False, False, args)["losses"]
    worst = max(abs(a - b) / abs(b) for a, b in zip(here, cpu))
    if worst > PARITY_RTOL:
        failures.append(f"fp32 parity: {device} losses {here} vs CPU {cpu} (worst relative {worst:.1e})")
    head = (f"{'run':<16}{'step s':>8}{'TFLOP/s':>9}{'MFU':>7}{'HFU':>7}{'peak GiB':>10}{'model GiB':>10}"
            f"{'SDPA':>11}{'loss':>9}")
    print(head + "\n" + "-" * len(head))
    itself = "" if device.type == "cuda" else " (cpu against itself: --tiny runs the code, it checks no parity)"
    print(f"{'fp32 parity':<16}{'':>8}{'':>9}{'':>7}{'':>7}{'':>10}{'':>10}{'':>11}{here[-1]:>9.4f}"
          f"  worst rel. diff to CPU {worst:.1e}{itself}", flush=True)
    ref = None
    for row_name, stage, ckpt, pa_cpu, offload, other in ROWS:
        if args.only and row_name not in args.only:
            continue
        r = train(big, grid, device, "bf16", stage, ckpt, pa_cpu, offload, args, other)
        ref = r["losses"][-1] if ref is None else ref
        check_row(row_name, r, ref, device, failures)
        model_gb = r["predicted"]["before_margin"] / 2**30 if r["predicted"] else None
        print(f"{row_name:<16}{r['step_s']:>8.3f}{r['tflops']:>9.2f}{fmt(r['mfu'], 7, '.1%')}{fmt(r['hfu'], 7, '.1%')}"
              f"{fmt(r['peak_GB'], 10, '.2f')}{fmt(model_gb, 10, '.2f')}{r['sdpa']:>11}{r['losses'][-1]:>9.4f}",
              flush=True)
    blank = " " * (9 + 7 + 7 + 10 + 10 + 11)  # the columns the 2proc and resume rows leave empty
    if not args.only or "2proc" in args.only:  # two ranks on this one device, over gloo
        sizes = dict(num_layers=2, hidden_size=small.hidden_size, num_heads=4,
                     vocab_size=small.vocab_size, seq_length=small.seq_length)
        pair, bad = pair_row(device, sizes, max(2, args.steps), args.micro, args.micro_batch,
                             os.path.join(os.path.dirname(args.nvme_path), "gpu_check_store"))
        failures += bad
        if pair:
            print(f"{'2proc tp2+dp2':<16}{pair['seconds']:>8.1f}{blank}{pair['tp2'][-1]:>9.4f}"
                  f"  gloo on {pair['device']}: worst rel. diff to one process "
                  f"tp2 {pair['tp2_worst']:.1e}, dp2 {pair['dp2_worst']:.1e}"
                  " (step s: the pair's runs)", flush=True)
    if not args.only or "resume" in args.only:  # deterministic kernels, in a process of its own
        work = os.path.join(os.path.dirname(args.nvme_path), "gpu_check_resume")
        res, bad = resume_row(device, work)
        failures += bad
        if res:
            same, steps = "DIFFER" if bad else "bit-identical", len(res["full"])
            print(f"{'resume':<16}{res['seconds']:>8.1f}{blank}{res['full'][-1]:>9.4f}  "
                  f"training.deterministic on {device.type}: steps "
                  f"{steps - len(res['resumed']) + 1}-{steps} resumed and final weights {same} "
                  "(step s: both runs)", flush=True)
    if device.type == "cuda":
        bw = bandwidth(device, 1024)
        print(f"[gpu_check] pinned copies: host->device {bw['h2d']:.1f} GiB/s, device->host {bw['d2h']:.1f} GiB/s")
        failures += [f"pinned {k} {v:.1f} GiB/s < {MIN_GBPS} GiB/s" for k, v in bw.items() if v < MIN_GBPS]
    if owned:
        shutdown()
    for f in failures:
        print(f"[gpu_check] FAIL {f}", file=sys.stderr)
    print(f"[gpu_check] {'FAILED: ' + str(len(failures)) + ' mismatch(es)' if failures else 'all checks passed'}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
