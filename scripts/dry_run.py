"""Dry run at cluster scale: the real code, K training steps, as chosen ranks of a simulated world.

    python scripts/dry_run.py --config configs/zero100b/table5/zero-100b.yaml --gpus 400
    python scripts/dry_run.py --config configs/zero100b/table5/zero-100b.yaml --gpus 400 --ranks 0 399 --json
    python scripts/dry_run.py --config configs/tiny.yaml --gpus 8 --parallel.tp 2 --parallel.pp 2

Each chosen rank builds its grid, model, ZeRO optimizer and activation checkpointing exactly as
the trainer does (``parallelize_gpt``), on fake tensors and torch's ``fake`` process group, and
runs the trainer's step (``training.step.run_step``) on synthetic batches, then assembles its
checkpoint shard and writes the shard's metadata (no tensor data) under ``--out``. Per rank it
prints the peak of live device memory by category and phase (construction included), the
collectives per step per group, host synchronisations per step, whether it fits ``--device-gb``,
the memory model's figure for the same setup (``scripts/estimate_memory.py``) and a predicted
step time split into compute, pipeline bubble, exposed communication per group, optimizer and
host copies (``zerotron.estimate.step_model``, on the rank's measured collectives; ``--gpu``
picks the hardware preset, v100 -- the paper's DGX-2 cluster -- by default, and the other flags
of that group override its figures). Nothing here needs a GPU; ``--device cuda`` (default)
computes on a fake GPU.
Exit 2 on bad input, before any work.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from zerotron.estimate import memory_model, nccl_memory, step_model  # noqa: E402
from zerotron.estimate.hardware import HARDWARE, Hardware  # noqa: E402
from zerotron.parallel import fake_cuda, simulation  # noqa: E402
from zerotron.parallel.runtime import keep_compiler_cache_in  # noqa: E402
from zerotron.config.cli import parse_config  # noqa: E402
from zerotron.config.run_config import ConfigError  # noqa: E402
from zerotron.config.inert import no_effect  # noqa: E402
from zerotron.training.dry_run import simulate_rank  # noqa: E402
from zerotron.training.setup_run import validate_model  # noqa: E402

GB = 1e9


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--config", required=True, help="YAML run config, e.g. configs/zero100b/table5/zero-100b.yaml")
    p.add_argument("--gpus", type=int, required=True, help="world size to simulate; DP = gpus / (tp x cp x pp)")
    p.add_argument("--ranks", type=int, nargs="+", help="global ranks to simulate (default: first and last)")
    p.add_argument("--steps", type=int, default=1, help="training steps per rank (default 1)")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="fake device kind (default cuda)")
    p.add_argument("--device-gb", type=float,
                   help="device memory a rank must fit (default: the --gpu's, V100 32, H100 80)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p.add_argument("--out", default=str(ROOT / "runs" / "dry_run"),
                   help="where each rank's checkpoint metadata goes (default: runs/dry_run of the repository)")
    g = p.add_argument_group("predicted step time (each flag defaults to the --gpu preset's)")
    g.add_argument("--gpu", choices=sorted(HARDWARE), default="v100",
                   help="hardware preset: v100 (the ZeRO paper's DGX-2 nodes, default) or h100")
    g.add_argument("--peak-tflops", type=float, help="per-GPU dense peak of the run's precision "
                   "(V100: 125 fp16, 15.7 fp32; H100: 989 fp16/bf16)")
    g.add_argument("--efficiency", type=float,
                   help="fraction of peak a large GEMM reaches (V100 0.456, H100 0.551)")
    g.add_argument("--sm-count", type=int, help="SMs a GEMM's tiles fill a wave of (80, 132; "
                   "0: no wave quantization)")
    g.add_argument("--hbm-gbps", type=float, help="device memory GB/s (V100 900, H100 3350)")
    g.add_argument("--gpus-per-node", type=int, help="V100 DGX-2 16, H100 DGX 8")
    g.add_argument("--intra-node-gbps", type=float,
                   help="NVLink/NVSwitch GB/s per GPU per direction (150, 450)")
    g.add_argument("--inter-node-gbps", type=float,
                   help="InfiniBand GB/s per node (8 x EDR 100, 8 x NDR 400)")
    g.add_argument("--intra-latency-us", type=float, help="per ring step inside a node (5, 3)")
    g.add_argument("--inter-latency-us", type=float, help="per ring step across nodes (10, 6)")
    g.add_argument("--pcie-gbps", type=float, help="host <-> device GB/s per GPU (16, 64)")
    g.add_argument("--attention", choices=["unfused", "math", "flash"],
                   help="attention kernel modelled (V100: unfused, the 2019 stack; H100: flash)")
    g.add_argument("--grad-reduce", choices=["reduce_scatter", "per_rank_reduce"],
                   help="how stage 2 reduces a bucket (V100: per_rank_reduce, DeepSpeed's "
                   "dist.reduce per owner as the paper ran; H100: reduce_scatter, zerotron's)")
    g.add_argument("--grad-dtype", choices=["accumulate", "model"],
                   help="the dtype DP collectives carry gradients in (V100: model, the fp16 the "
                   "paper's stacks sent; H100: accumulate, zero.grad_accum_dtype's)")
    p.epilog = "Any other --section.field value overrides the config, as in scripts/pretrain_gpt.py."
    return p


def load(a, overrides: list[str]):
    """The validated run config and model for ``--gpus``; raises ``ConfigError`` naming the field."""
    if a.gpus < 1:
        raise ConfigError(f"--gpus {a.gpus}: the simulated world needs at least 1 GPU")
    cfg = parse_config(["--config", a.config, *overrides], world_size=a.gpus)  # sizes a DeepSpeed JSON's batch
    cfg.validate(a.gpus, a.gpus_per_node)
    ranks = a.ranks if a.ranks else sorted({0, a.gpus - 1})
    bad = [r for r in ranks if not 0 <= r < a.gpus]
    if bad:
        raise ConfigError(f"--ranks {bad}: a rank of a {a.gpus}-GPU world is in [0, {a.gpus - 1}]")
    if a.steps < 1:
        raise ConfigError(f"--steps {a.steps}: simulate at least 1 step")
    for flag in ("peak_tflops", "device_gb", "efficiency"):
        value = getattr(a, flag)
        if value is not None and not value > 0:
            raise ConfigError(f"--{flag.replace('_', '-')} {value}: must be > 0")
    if a.efficiency is not None and not a.efficiency <= 1:
        raise ConfigError(f"--efficiency {a.efficiency}: a fraction of peak in (0, 1], e.g. 0.45")
    try:
        a.hardware = hardware(a, cfg.training.precision)
        a.hardware.link()
        a.hardware.peak(cfg.training.precision)
    except ValueError as e:  # Hardware/LinkModel name their field; the user wrote the flag
        field = str(e).split("=")[0].removeprefix("LinkModel.").removeprefix("Hardware.")
        flag = "--efficiency" if field == "gemm_efficiency" else f"--{field.replace('_', '-')}"
        raise ConfigError(f"{flag}: {e}" if field.isidentifier() else str(e)) from None
    if a.device_gb is None:
        a.device_gb = a.hardware.memory_gb
    return cfg, validate_model(cfg), ranks


def hardware(a, precision: str) -> Hardware:
    """The ``--gpu`` preset with the flags given replacing its figures."""
    hw = HARDWARE[a.gpu]
    dtype = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}.get(precision, precision)
    peak = None if a.peak_tflops is None else {**hw.peak_tflops, dtype: a.peak_tflops}
    return hw.with_overrides(peak_tflops=peak, gemm_efficiency=a.efficiency, hbm_gbps=a.hbm_gbps,
                             gpus_per_node=a.gpus_per_node, intra_node_gbps=a.intra_node_gbps,
                             inter_node_gbps=a.inter_node_gbps, intra_latency_us=a.intra_latency_us,
                             inter_latency_us=a.inter_latency_us, pcie_gbps=a.pcie_gbps,
                             attention=a.attention, grad_reduce=a.grad_reduce,
                             sm_count=a.sm_count, grad_dtype=a.grad_dtype)


def model_figures(cfg, mcfg, gpus: int, rank: int = 0) -> dict | None:
    """The memory model's bytes for this setup (``scripts/estimate_memory.py``'s breakdown) at the
    pipeline stage of ``rank``, or None for a setup it does not cover (offload): then there is
    nothing to compare."""
    stage = rank // (gpus // cfg.parallel.pp)  # PP is the outermost: TP x CP x DP ranks a stage
    try:
        setup = memory_model.setup_from_run_config(cfg, mcfg, gpus, pipeline_rank=stage)
    except ValueError as e:
        print(f"[dry-run] no memory-model comparison: {e}", file=sys.stderr)
        return None
    e = memory_model.estimate(setup)
    return {k: e[k] for k in ("model_states", "checkpoints_device", "working", "fixed_buffers", "accounted")} | {
        "before_margin": e["before_margin"], "total": e["total"]}


def predict(a, cfg, mcfg, rep) -> dict:
    """The step model on this rank's measured collectives (compute: the last, slowest stage)."""
    pred = step_model.predict(cfg, mcfg, a.gpus, a.hardware, comm=rep.comm_ops,
                              ranks=rep.group_ranks)
    return pred.as_dict()


def rank_entry(a, rep, model: dict, pred: dict, nccl: dict) -> dict:
    """``nccl``: ``nccl_memory.run_communicators`` of this rank, outside torch's allocator."""
    peak = max(rep.peak_bytes, rep.construction_peak_bytes)
    return {"peak_bytes": rep.peak_bytes, "construction_peak_bytes": rep.construction_peak_bytes,
            "by_category": rep.by_category, "by_phase": rep.by_phase, "comm": rep.comm, "comm_ops": rep.comm_ops,
            "host_syncs_per_step": rep.host_syncs_per_step, "host_sync_reasons": rep.host_sync_reasons,
            "host_tensor_bytes_per_step": rep.host_tensor_bytes_per_step, "coords": rep.coords,
            "checkpoint_shard_bytes": rep.checkpoint_shard_bytes, "num_params": rep.num_params,
            "device": rep.device, "fits": peak + nccl["bytes"] <= a.device_gb * GB,
            "nccl_communicators": nccl["bytes"], "nccl_groups": nccl["groups"],
            "model_bytes": model["before_margin"] if model else None,
            "measured_vs_model": rep.peak_bytes / model["before_margin"] if model else None,
            "predicted": pred, "seconds": round(rep.seconds, 1)}


def print_rank(r: int, e: dict, a) -> None:
    print(f"\nrank {r} {e['coords']}: {e['seconds']} s simulated")
    print(f"  peak live device memory   {e['peak_bytes'] / GB:8.2f} GB (step)   "
          f"{e['construction_peak_bytes'] / GB:8.2f} GB (construction)   fits {a.device_gb:g} GB (peak + NCCL, "
          f"no margin): {e['fits']}")
    groups = ", ".join(f"{g} {n}" for g, n in e["nccl_groups"].items()) or "none"
    print(f"  NCCL communicators        {e['nccl_communicators'] / GB:8.2f} GB (outside torch's allocator; "
          f"groups of this rank: {groups})")
    print("  " + "  ".join(f"{k} {v / GB:.2f}" for k, v in e["by_category"].items()) + "  (GB at the peak)")
    print("  by phase: " + "  ".join(f"{k} {v / GB:.2f}" for k, v in e["by_phase"].items()) + " GB")
    if e["model_bytes"] is not None:
        print(f"  memory model (before the fragmentation margin) {e['model_bytes'] / GB:.2f} GB: "
              f"measured / model = {e['measured_vs_model']:.3f}")
    print("  comm per step: " + "  ".join(f"{g} {c['calls']} calls {c['bytes'] / GB:.2f} GB"
                                          for g, c in sorted(e["comm"].items())))
    reasons = ", ".join(f"{k} {v:g}" for k, v in e["host_sync_reasons"].items()) or "none"
    print(f"  host syncs per step {e['host_syncs_per_step']:g} ({reasons}); "
          f"host tensors {e['host_tensor_bytes_per_step'] / GB:.2f} GB/step")
    p = e["predicted"]
    print(f"  predicted step {seconds(p['step_s'])} -> {p['tflops_per_gpu']:.1f} TFLOPs/GPU, MFU "
          f"{p['mfu']:.1%} on {p['hardware']} (GEMMs at {a.hardware.gemm_efficiency:g} of peak, "
          f"{a.hardware.attention} attention, stage 2 reducing by {a.hardware.grad_reduce}, "
          f"gradients sent in the {a.hardware.grad_dtype} dtype):")
    terms = [("compute", p["compute_s"]), ("pipeline bubble", p["bubble_s"])]
    terms += [(f"exposed comm {g}", s) for g, s in sorted(p["exposed_s"].items()) if s > 0]
    terms += [("optimizer", p["optimizer_s"]), ("host copies", p["host_copy_s"])]
    print("    " + "  ".join(f"{name} {seconds(s)}" for name, s in terms))
    print(f"    compute = GEMMs {seconds(p['gemm_s'])} + attention core "
          f"{seconds(p['attention_s'])} + element-wise {seconds(p['elementwise_s'])}")


def seconds(s: float) -> str:
    if s == 0:
        return "0 s"
    return f"{s:.2f} s" if s >= 0.1 else f"{s * 1e3:.2f} ms" if s >= 1e-4 else f"{s * 1e6:.1f} µs"


def on_fake_cuda(argv) -> None:
    """Re-execute this script on ``fake_cuda``'s library when ``--device cuda`` meets a CPU-only
    torch: the library must be loaded before torch is imported (see ``parallel/fake_cuda.py``)."""
    if simulation.cuda_is_built():
        return
    if fake_cuda.active():  # loaded: what this process starts need not carry it
        fake_cuda.unload_from_children()
        os.environ.pop("ZEROTRON_FAKE_CUDA_EXEC", None)
        return
    if os.environ.get("ZEROTRON_FAKE_CUDA_EXEC"):
        raise fake_cuda.FakeCudaUnavailable("the fake CUDA library was preloaded but torch does not see a cuda "
                                            "accelerator (another library set CUDA hooks first?); pass --device cpu")
    env = fake_cuda.environ() | {"ZEROTRON_FAKE_CUDA_EXEC": "1"}
    sys.stdout.flush()
    os.execve(sys.executable, [sys.executable, *_interpreter_flags(), str(Path(__file__).resolve()), *argv], env)


def _interpreter_flags() -> list[str]:
    """The interpreter's own options (-X, -W, -O ...) as given, when this script was started as a
    file; otherwise the ones ``subprocess`` knows how to rebuild (as multiprocessing does)."""
    n = len(sys.argv)
    if len(sys.orig_argv) > n and sys.orig_argv[-n:] == sys.argv:
        return sys.orig_argv[1:-n]
    return subprocess._args_from_interpreter_flags()


def metadata_dir(a) -> Path:
    """``<out>/<config>-<gpus>gpus/checkpoint``, emptied of an earlier dry run's shards: the config
    named by its path under configs/ (table5's and table10's zero-1.5b are different runs), and
    one directory holding one simulated world's metadata, not a mix of layouts."""
    path = Path(a.config).resolve()
    try:
        name = "-".join(path.relative_to(ROOT / "configs").with_suffix("").parts)
    except ValueError:
        name = path.stem
    out = Path(a.out) / f"{name}-{a.gpus}gpus" / "checkpoint"
    for old in out.glob("rank_*.json"):
        old.unlink()
    return out


def main(argv=None) -> dict:
    argv = sys.argv[1:] if argv is None else list(argv)
    a, overrides = build_parser().parse_known_args(argv)
    try:
        cfg, mcfg, ranks = load(a, overrides)
        keep_compiler_cache_in(cfg.data.cache_dir)  # inherited by the re-executed process below
        if a.device == "cuda":
            on_fake_cuda(argv)
    except (ConfigError, ValueError, TypeError, fake_cuda.FakeCudaUnavailable) as e:
        print(f"dry_run: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    for line in no_effect(cfg):
        print(f"[config] {line}", file=sys.stderr)
    model = model_figures(cfg, mcfg, a.gpus)  # the first stage's; each rank meets its own
    out = {"world": a.gpus, "config": a.config, "model": model, "ranks": {}}
    meta_dir = metadata_dir(a)
    for r in ranks:
        print(f"[dry-run] rank {r} of {a.gpus}: building and running {a.steps} step(s) ...", file=sys.stderr,
              flush=True)
        start = time.perf_counter()
        rep = simulate_rank(cfg, mcfg, a.gpus, r, steps=a.steps, device_kind=a.device, metadata_dir=meta_dir)
        own = model if cfg.parallel.pp == 1 else model_figures(cfg, mcfg, a.gpus, r)
        nccl = nccl_memory.run_communicators(cfg, a.gpus, r, nccl=a.device == "cuda")  # gloo on cpu
        out["ranks"][str(r)] = rank_entry(a, rep, own, predict(a, cfg, mcfg, rep), nccl)
        print(f"[dry-run] rank {r} done in {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
    if a.json:
        print(json.dumps(out, indent=1))
        return out
    cp = f" x CP {cfg.parallel.cp}" if cfg.parallel.cp > 1 else ""
    print(f"{a.config} on {a.gpus} simulated GPUs (TP {cfg.parallel.tp}{cp} x PP {cfg.parallel.pp} x "
          f"DP {cfg.parallel.dp}), stage {cfg.zero.stage}, {cfg.training.precision}; checkpoint metadata in {meta_dir}")
    for r, e in out["ranks"].items():
        print_rank(int(r), e, a)
    return out


if __name__ == "__main__":
    main()
