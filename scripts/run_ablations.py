"""Run the ZeRO paper's C1–C5 ablations (Table 3, §10.5) on the hardware at hand and check them
against the memory model (``zerotron.estimate.memory_model``).

    python scripts/run_ablations.py                 # ~2 min on a 2-core CPU
    python scripts/run_ablations.py --quick         # the test's run (~25 s)
    python scripts/run_ablations.py --figures docs/figures   # refresh the committed figures

Layout: a tiny GPT on 4 gloo ranks, TP 2 x DP 2, so Pa has MP ranks to partition over. Configs:
the no-ZeRO baseline (stage 0), C1–C5 (read from ``configs/zero100b/ablations/c*.yaml``) and
stage 3 (Pos+g+p with C4's ZeRO-R), all with CB (fixed buckets) and MD (contiguous checkpoints
and gradients), 16-bit. For each it measures, per rank, the model states
(``ZeroOptimizer.memory_report()``), the checkpoint bytes (the checkpointing handle's
``step_report()``), the fixed buffers, the RSS, and TFLOP/s per device (recompute counted,
``zerotron.model.flops``) and the peak of live tensor storage (``MemoryTracker``: what is
allocated, measured, not the optimizer's own sizes), then searches the most layers whose
*measured* peak fits a memory cap: every probe is a real run of a few steps, and the memory
model's prediction (its bytes before the fragmentation margin) is only where the walk starts. On
a CPU the interpreter dominates RSS, so the cap is on live tensor bytes, not on RSS.
Finally it measures model states per rank at DP 2, 4, 8 (TP 1) for stages 0–3 (Figure 1).

Every measured figure is compared with the memory model's prediction; results go to CSV, JSONL,
a markdown table and wandb (offline by default), and figures to PNG (matplotlib, Agg) -- all
under ``--out`` (default ``runs/ablations``, figures in its ``figures/``). The committed
``docs/figures`` change only when asked for with ``--figures docs/figures``, so a quick or
partial run never overwrites them.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import typing
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
from zerotron.data.progress import Progress
from zerotron.model import GPTConfig, flops_per_iteration
from zerotron.testing.bench_args import check_out_dir, flag_errors
from zerotron.testing.launch import spawn
from zerotron.config.cli import apply_mapping, read_yaml
from zerotron.config.run_config import RunConfig
from zerotron.config.sections import WandbMode
from zerotron.training.step_memory import StepMemory
from zerotron.training.tracking import WANDB_DIRS
from zerotron.zero.accounting import expected_model_state_bytes
from zerotron.estimate.memory_model import Setup, estimate, max_layers

from zerotron.estimate.ablation_report import ratio, results_table, write_outputs

NAMES = ["baseline", "C1", "C2", "C3", "C4", "C5", "stage3"]


def ablation_config(name: str) -> RunConfig:
    """The run config of a configuration: C1-C5 from their YAML, baseline and stage3 spelled here."""
    cfg = RunConfig()
    if name.startswith("C"):
        path = ROOT / "configs" / "zero100b" / "ablations" / f"{name.lower()}.yaml"
        apply_mapping(cfg, read_yaml(path), str(path))
    else:  # baseline: plain DP + checkpointing, CB + MD; stage3: Pos+g+p + C4's ZeRO-R
        cfg.zero.stage = 0 if name == "baseline" else 3
        ac = cfg.activation_checkpointing
        ac.checkpoint_activations = ac.contiguous_memory_optimization = True
        ac.partition_activations = name == "stage3"
    return cfg


def ablation_settings(name: str) -> dict:
    """zero.stage and the ZeRO-R switches of a configuration, for the memory model and the tables."""
    cfg = ablation_config(name)
    ac = cfg.activation_checkpointing
    return {"stage": cfg.zero.stage, "pa": ac.partition_activations, "cpu": ac.cpu_checkpointing,
            "md": ac.contiguous_memory_optimization}


def model_cfg(a, layers: int) -> GPTConfig:
    return GPTConfig(num_layers=layers, hidden_size=a.hidden, num_heads=a.heads, vocab_size=256, seq_length=a.seq,
                     make_vocab_size_divisible_by=64)


# stage 3 gathers every parameter with its unit (no persistent group), in the run and its model
PERSISTENCE_THRESHOLD = 0


def setup_of(a, name: str, layers: int, tp: int, dp: int) -> Setup:
    s = ablation_settings(name)
    return Setup(model_cfg(a, layers), tp=tp, dp=dp, micro_batch=a.batch, stage=s["stage"],
                 partition_activations=s["pa"], cpu_checkpointing=s["cpu"], contiguous_memory=s["md"],
                 precision=a.precision, bucket_size=a.bucket, grad_bytes=2, backend="gloo",
                 device="cpu", persistence_threshold=PERSISTENCE_THRESHOLD)


# worker side ---------------------------------------------------------------------------------------
def train_and_measure(grid, a, name: str, layers: int, steps: int) -> dict:
    """Build GPT + ZeroOptimizer + checkpointing from the library, train ``steps`` steps, measure."""
    from zerotron.parallel import ParallelDims
    from zerotron.parallel import collectives as C
    from zerotron.training.parallelize import parallelize_gpt

    cfg = ablation_config(name)
    cfg.parallel = ParallelDims(tp=grid.tp_size)
    z, ac, t, o = cfg.zero, cfg.activation_checkpointing, cfg.training, cfg.optimizer
    z.reduce_bucket_size = z.allgather_bucket_size = a.bucket
    z.stage3_param_persistence_threshold = PERSISTENCE_THRESHOLD
    z.grad_accum_dtype = a.precision  # the paper's 16-bit gradients, so its 2 + 2 + K accounting holds
    ac.partition_activations = ac.partition_activations and grid.tp_size > 1  # Pa needs MP ranks (§6.1)
    t.precision, t.seed, t.micro_batch_size, t.global_batch_size = a.precision, 1234, a.batch, a.batch * grid.dp_size
    o.lr, o.beta2, o.weight_decay, o.clip_grad = 1e-4, 0.999, 0.0, 1.0
    tracked = StepMemory(interval=1)  # live storages (allocator's side), not the optimizer's sizes
    with tracked.construction():
        plan = parallelize_gpt(cfg.validate(grid.world_size), model_cfg(a, layers), grid)
    model, opt, handle = plan.model, plan.optimizer, plan.activations
    tracked.register(opt)
    gen = torch.Generator().manual_seed(1000 * grid.dp_rank + layers)
    times, act = [], {}
    for step in range(1, steps + 1):
        ids = torch.randint(0, 256, (a.batch, a.seq), generator=gen)
        t0 = time.perf_counter()
        tracked.train_step(step, model, opt, ids)
        times.append(time.perf_counter() - t0)
        act = handle.step_report() if handle else {}
    peak = tracked.record()["mem_peak_bytes"]  # the last step's: the first records stage 3's order of use
    mem = opt.memory_report()
    device = max(act.get("peak_saved_device_bytes", 0),
                 act.get("md_buffer_bytes", 0) if act.get("md_buffer_placement") == "device" else 0)
    pa_gather = act.get("fixed_buffers", {}).get("pa_gather_bytes", 0)
    row = {"model_states": mem["total_model_states"], "checkpoints_device": device,
           "checkpoints_host": act.get("peak_saved_host_bytes", 0), "fixed_buffers": mem["fixed_buffers"] + pa_gather,
           "params_per_rank": opt.num_params,
           "rss_bytes": int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
           if Path("/proc/self/statm").exists() else 0}
    row["accounted"] = row["model_states"] + device + row["fixed_buffers"]
    worst = torch.tensor([float(row["accounted"]), float(peak), min(times[1:] or times)], dtype=torch.float64)
    C.all_reduce(worst, grid.world_group, op="max")  # every rank decides on the same numbers
    row["accounted_max_rank"], row["peak"], row["step_s"] = int(worst[0]), int(worst[1]), float(worst[2])
    return row


def ablation_worker(a) -> dict:
    from zerotron.parallel import Grid, ParallelDims

    grid = Grid(ParallelDims(tp=a.tp))
    out = {}
    shown = Progress("ablations", total=len(a.configs), unit="config", enabled=grid.rank == 0, interval=0.0)
    for name in a.configs:
        row = train_and_measure(grid, a, name, a.layers, a.steps)
        setup = setup_of(a, name, a.layers, a.tp, grid.dp_size)
        pred_l = max_layers(setup, a.cap_bytes, basis="before_margin", limit=a.max_search_layers)
        # the walk starts where the model predicts once scaled by its error on the run just measured
        # (fewer probes); only where it starts, not where it ends, depends on the model
        scale = row["peak"] / estimate(setup)["before_margin"]
        start = max_layers(setup, a.cap_bytes / scale, basis="before_margin", limit=a.max_search_layers)
        probes, layers = {}, max(1, start)
        while True:  # walk from the prediction to the boundary; every probe is a real run, its measured peak
            if layers not in probes:
                probes[layers] = train_and_measure(grid, a, name, layers, 2)["peak"] <= a.cap_bytes
            if probes[layers] and layers + 1 not in probes and layers < a.max_search_layers:
                layers += 1
            elif not probes[layers] and layers > 1:
                layers -= 1
            else:
                break
        best = max([n for n, ok in probes.items() if ok], default=0)
        out[name] = {**row, "max_layers": best, "max_layers_predicted": pred_l, "probes": sorted(probes.items())}
        shown.update(1)
    shown.close()
    return out


def dp_worker(a) -> dict:
    from zerotron.parallel import Grid, ParallelDims

    grid = Grid(ParallelDims(tp=1))
    names = {0: "baseline", 1: "C1", 2: "C3", 3: "stage3"}  # stages 0-3, no Pa at TP 1
    return {stage: train_and_measure(grid, a, names[stage], a.layers, 1) for stage in (0, 1, 2, 3)}


def launch(fn, world: int, a, timeout: float = 900.0) -> list:
    """``world`` gloo ranks running ``fn(a)``; their results, or an error naming the failed rank."""
    return spawn(fn, world, a, timeout=timeout, collective_timeout=120.0, store_dir=str(Path(a.out)))


# parent side -----------------------------------------------------------------------------------------


def run(a) -> dict:
    t0 = time.time()
    world = a.tp * a.dp
    per_rank = launch(ablation_worker, world, a)[0]
    rows = []
    for name in a.configs:
        m = per_rank[name]
        p = estimate(setup_of(a, name, a.layers, a.tp, a.dp))
        psi_total = model_cfg(a, m["max_layers"]).exact_num_params(a.tp) if m["max_layers"] else 0
        tflops = flops_per_iteration(model_cfg(a, a.layers), a.batch * a.dp, recompute=True, tp=a.tp) / m["step_s"] / world / 1e12
        rows.append({"config": name, **{k: v for k, v in m.items() if k != "probes"}, "probes": json.dumps(m["probes"]),
                     "max_params": psi_total, "tflops_per_device": tflops,
                     **{f"pred_{k}": p[k] for k in ("model_states", "checkpoints_device", "checkpoints_host",
                                                    "fixed_buffers", "accounted")},
                     # Setup.device "cpu": C5's host checkpoints are in before_margin, as they are live storages
                     "pred_peak": p["before_margin"],
                     "ratio_peak": ratio(m["peak"], p["before_margin"]),
                     **{f"ratio_{k}": ratio(m[k], p[k]) for k in ("model_states", "checkpoints_device",
                                                                  "checkpoints_host", "accounted")}})
    dp_rows = []
    sweep = Progress("model states over DP", total=len(a.dp_sweep), unit="layout", interval=0.0)
    for nd in a.dp_sweep:
        res = launch(dp_worker, nd, a)[0]
        sweep.update(1)
        for stage, m in res.items():
            want = expected_model_state_bytes(m["params_per_rank"], nd, stage)
            dp_rows.append({"dp": nd, "stage": stage, "params": m["params_per_rank"], "measured": m["model_states"],
                            "formula": want, "ratio": m["model_states"] / want})
    sweep.close()
    return {"rows": rows, "dp_rows": dp_rows, "seconds": time.time() - t0}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small run for the test (~25 s)")
    p.add_argument("--configs", default=",".join(NAMES), help=f"comma list of {NAMES}")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--dp", type=int, default=2)
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--heads", type=int, default=4, help="attention heads; --tp must divide them")
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=8, help="micro-batch per rank")
    p.add_argument("--layers", type=int, default=8, help="layers of the measured (fixed) model")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--precision", default="fp16", choices=["fp16", "bf16"])
    p.add_argument("--bucket", type=int, default=4096, help="reduce/all-gather bucket (CB), elements")
    p.add_argument("--cap-kib", type=float, default=3072.0, help="cap on the measured peak per rank, KiB")
    p.add_argument("--max-search-layers", type=int, default=48)
    p.add_argument("--dp-sweep", default="2,4,8")
    p.add_argument("--out", default=str(ROOT / "runs" / "ablations"))
    p.add_argument("--figures", default=None, help="where the PNGs go (default: <out>/figures)")
    p.add_argument("--wandb-mode", default="offline", choices=typing.get_args(WandbMode))
    p.add_argument("--wandb-project", default="zerotron-ablations")
    a = p.parse_args(argv)
    for flag, path in (("--out", a.out), ("--figures", a.figures)):
        check_out_dir(p, flag, path, "the results")
    a.figures = a.figures or str(Path(a.out) / "figures")
    if a.quick:
        a.layers, a.steps, a.batch, a.cap_kib, a.dp_sweep = 4, 2, 4, 1024.0, "2,4"
    a.configs = [c for c in a.configs.split(",") if c]
    bad = sorted(set(a.configs) - set(NAMES))
    if bad or not a.configs:
        p.error(f"--configs: unknown {bad}; choose from {NAMES}" if bad else f"--configs: name at least one of {NAMES}")
    for flag in ("tp", "dp", "hidden", "heads", "seq", "batch", "layers", "steps", "bucket", "max_search_layers"):
        if getattr(a, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} {getattr(a, flag)}: must be at least 1")
    if not 0 < a.cap_kib < float("inf"):
        p.error(f"--cap-kib {a.cap_kib}: must be a positive number of KiB")
    try:
        a.dp_sweep = [int(x) for x in str(a.dp_sweep).split(",") if x]
    except ValueError:
        p.error(f"--dp-sweep {a.dp_sweep}: give DP sizes as a comma list of whole numbers, e.g. 2,4,8")
    if not a.dp_sweep or min(a.dp_sweep) < 1:
        p.error(f"--dp-sweep {a.dp_sweep}: give at least one DP size, each at least 1")
    for tp in {a.tp, 1}:  # the ablation ranks at --tp, the DP sweep at TP 1
        with flag_errors(p, {"hidden_size": "--hidden", "num_heads": "--heads", "seq_length": "--seq", "tp": "--tp"}):
            model_cfg(a, a.layers).validate(tp)
    a.cap_bytes = int(a.cap_kib * 1024)
    return a


def main(argv=None) -> dict:
    a = parse_args(argv)
    for var, sub in WANDB_DIRS.items():  # wandb's cache and debug logs beside the results, not in ~/.cache
        os.environ.setdefault(var, str((Path(a.out) / "wandb" / sub).resolve()))
    res = run(a)
    write_outputs(a, res, lambda layers: model_cfg(a, layers).exact_num_params(a.tp))
    print(results_table(a, res) + f"\n{res['seconds']:.0f} s; results in {a.out}, figures in {a.figures}")
    return res


if __name__ == "__main__":
    main()
