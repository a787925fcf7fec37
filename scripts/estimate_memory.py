"""Per-device memory of ZeRO training, from the memory model (zerotron.estimate.memory_model).

    python scripts/estimate_memory.py                       # paper Tables 1 and 2, C1-C5 max model
    python scripts/estimate_memory.py --preset zero-100b --tp 16 --gpus 400 --batch 32 --config-name C4
    python scripts/estimate_memory.py --config configs/zero100b/table5/zero-100b.yaml --gpus 400
    python scripts/estimate_memory.py --config configs/tiny.yaml --gpus 4
    python scripts/estimate_memory.py --layers 40 --hidden 4096 --heads 32 --tp 4 --gpus 64 --json
    python scripts/estimate_memory.py --config configs/llama/llama3.1-8b-seq131k-64gpus.yaml \
        --gpu h100

Prints the ZeRO paper's Table 1 (model states per device for 7.5B, 128B and 1T at Nd 1…1024)
and Table 2 (theoretical largest model per MP degree, 32 GB, 64-way DP) exactly as the paper
prints them, a per-term breakdown of any preset, run config or custom shape, and the largest
GPT each ZeRO configuration C1–C5 (Table 3) fits on ``--device-gb`` GPUs (by default the memory
of ``--gpu``'s preset: v100 32 GB, the paper's; h100 80 GB). ``--json`` writes one JSON object
instead, for machines.

A breakdown needs the world size: ``--gpus``, or with ``--config`` the config's own when it fixes
``parallel.dp`` (world = tp x cp x pp x dp). There is no default, because every per-rank term but the
activations divides by it and a guessed one gives a plausible-looking wrong answer. Exit codes:
0 printed, 2 a bad or incomplete request (the message names the flag or field and the fix).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import typing

from zerotron.model import GPTConfig, get_preset
from zerotron.zero.config import Stage
from zerotron.estimate.hardware import HARDWARE
from zerotron.estimate.memory_model import (C_CONFIGS, Setup, estimate,
                                             fullest_stage_setup, max_model)
from zerotron.estimate.paper_tables import c_config_max_models, table1, table1_text, table2, table2_text

GB = 1e9


class UsageError(Exception):
    """A request the estimate cannot answer as given; main() prints it and exits 2."""


def _config_setup(a) -> Setup:
    """The run config's setup (``fullest_stage_setup``, as the trainer's banner sees it);
    ``--tp``/``--cp``/``--batch``/``--stage``/``--seq``/``--vocab``/``--pa``/``--cpu`` override its
    fields."""
    from zerotron.config.cli import parse_config
    from zerotron.config.run_config import ConfigError
    from zerotron.training.setup_run import validate_model

    overrides = {"--parallel.tp": a.tp, "--parallel.cp": a.cp,
                 "--training.micro_batch_size": a.batch, "--zero.stage": a.stage,
                 "--model.seq_length": a.seq, "--model.vocab_size": a.vocab,
                 "--activation_checkpointing.partition_activations": a.pa or None,
                 "--activation_checkpointing.cpu_checkpointing": a.cpu or None}
    argv = ["--config", a.config] + [str(x) for k, v in overrides.items() if v is not None for x in (k, v)]
    try:
        cfg = parse_config(argv)
        p = cfg.parallel
        gpus = a.gpus
        mp = p.tp * p.pp * p.cp
        if gpus is None and p.dp not in (None, -1):
            gpus = mp * p.dp
        if gpus is None:
            raise UsageError(f"--config {a.config} does not fix the world size (parallel.dp is unset: DP is what "
                             f"the launcher's processes leave after tp x cp x pp = {mp}); pass --gpus N, the "
                             f"number of processes the run starts (torchrun --nnodes x --nproc-per-node)")
        cfg.validate(gpus)
        return fullest_stage_setup(cfg, validate_model(cfg), gpus)  # a pipeline's fullest stage
    except (ConfigError, ValueError) as e:
        raise UsageError(str(e) if str(e).startswith("--config") else f"--config {a.config}: {e}") from None


def _given(value) -> bool:
    """Whether a flag was given: ``--stage 0`` was (0 is not None), an unset ``--pa`` was not."""
    return value is not None and value is not False


def check_args(a) -> list[int]:
    """Every flag a request gives must shape it: sizes positive, one way of naming the model, and
    no flag that the request would silently drop. Returns the C1-C5 micro-batches."""
    for flag in ("layers", "hidden", "heads", "seq", "vocab", "tp", "cp",
                 "gpus", "batch", "c_gpus", "c_mp"):
        value = getattr(a, flag)
        if value is not None and value < 1:
            raise UsageError(f"--{flag.replace('_', '-')} {value}: must be a positive integer")
    if a.device_gb is None:
        a.device_gb = HARDWARE[a.gpu].memory_gb
    if not 0 < a.device_gb < float("inf"):
        raise UsageError(f"--device-gb {a.device_gb}: must be a finite size > 0 (a V100 has 32)")
    if a.c_gpus % a.c_mp:
        raise UsageError(f"--c-gpus {a.c_gpus} is not a multiple of --c-mp {a.c_mp}; DP = c-gpus / c-mp")
    custom = [f"--{f}" for f in ("layers", "hidden", "heads") if getattr(a, f) is not None]
    named = [x for x, on in (("--config", a.config), ("--preset", a.preset), ("--layers/--hidden/--heads", custom))
             if on]
    if len(named) > 1:
        raise UsageError(f"{' and '.join(named)} each name the model; give one of them")
    if custom and len(custom) < 3:
        raise UsageError(f"a custom GPT needs --layers, --hidden and --heads; {', '.join(custom)} given")
    fields = ("config_name", "gpus", "tp", "cp", "batch", "stage", "seq", "vocab", "pa", "cpu")
    shaping = [f"--{f.replace('_', '-')}" for f in fields if _given(getattr(a, f))]
    if shaping and not named:
        verb = "shapes" if len(shaping) == 1 else "shape"
        raise UsageError(f"{' '.join(shaping)} {verb} a breakdown, which needs a model: give --config, --preset "
                         f"or --layers/--hidden/--heads (with --gpus)")
    if a.config_name:  # C1-C5 are a stage, Pa and Pa+cpu: a flag setting one of them would be dropped
        clash = [f"--{f}" for f in ("stage", "pa", "cpu") if _given(getattr(a, f))]
        if clash:
            c = C_CONFIGS[a.config_name]
            raise UsageError(f"--config-name {a.config_name} sets the ZeRO stage ({c['stage']}), Pa "
                             f"({c['partition_activations']}) and Pa+cpu ({c['cpu_checkpointing']}); "
                             f"drop {' and '.join(clash)} or --config-name")
    try:
        batches = [int(b) for b in a.c_batches.split(",") if b.strip()]
    except ValueError:
        batches = []
    if not batches or min(batches) < 1:
        raise UsageError(f"--c-batches {a.c_batches!r}: give positive micro-batch sizes separated by commas, "
                         f"e.g. 4,8,16")
    return batches


def build_setup(a) -> Setup | None:
    """The setup to break down: from --config, --preset or --layers/--hidden/--heads; None if none given."""
    if a.config:
        setup = _config_setup(a)
    else:
        tp = a.tp if a.tp is not None else 1
        cp = a.cp if a.cp is not None else 1
        try:
            if a.preset:
                model = get_preset(a.preset)
            elif a.layers:
                model = GPTConfig(num_layers=a.layers, hidden_size=a.hidden, num_heads=a.heads, vocab_size=50257,
                                  seq_length=1024)
            else:
                return None
            if a.seq is not None:
                model = dataclasses.replace(model, seq_length=a.seq)
            if a.vocab is not None:
                model = dataclasses.replace(model, vocab_size=a.vocab)
            model.validate(tp)
        except ValueError as e:
            raise UsageError(str(e)) from None
        if model.seq_length % (2 * cp):
            raise UsageError(f"--cp {cp}: the sequence ({model.seq_length}) must split into "
                             f"2 x cp = {2 * cp} equal chunks; give a --seq that is a multiple of "
                             f"{2 * cp} or another --cp")
        if a.gpus is None:
            raise UsageError(f"a breakdown needs the world size: pass --gpus N (a multiple of "
                             f"tp x cp = {tp * cp})")
        if a.gpus % (tp * cp):
            raise UsageError(f"--gpus {a.gpus} is not a multiple of --tp {tp} x --cp {cp}; "
                             f"use a multiple")
        setup = Setup(model, tp=tp, cp=cp, dp=a.gpus // (tp * cp), micro_batch=a.batch if a.batch is not None else 4,
                      stage=2 if a.stage is None else a.stage, checkpoint_activations=True,
                      partition_activations=a.pa, cpu_checkpointing=a.cpu)
    setup = setup.with_config(a.config_name) if a.config_name else setup
    if setup.tp == 1 and a.pa:  # asked for by name; C2/C4/C5 at MP 1 are the paper's, Pa a no-op there
        raise UsageError("--pa partitions activation checkpoints over the MP ranks, and this setup has MP 1 "
                         "(nothing to partition over); give --tp > 1 or drop --pa")
    return setup


def count(n: float) -> str:
    """A parameter count a person reads at a glance at any scale: 213.5 K, 1.56 B, 1.00 T."""
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f}"


def size(n: float) -> str:
    """Bytes in the unit that shows them (decimal, as the paper's GB): never a tiny model's 0.00 GB."""
    for unit, scale in (("TB", 1e12), ("GB", GB), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def fmt_table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join([lines[0], "-" * len(lines[0]), *lines[1:]])


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--config", help="YAML run config (its model, MP, batch, ZeRO and checkpointing)")
    p.add_argument("--preset", help="zerotron.model preset name, e.g. zero-100b")
    p.add_argument("--layers", type=int, help="custom GPT: number of transformer layers (with --hidden, --heads)")
    p.add_argument("--hidden", type=int, help="custom GPT: hidden size")
    p.add_argument("--heads", type=int, help="custom GPT: attention heads")
    p.add_argument("--seq", type=int, help="sequence length (default: the config's or preset's; 1024 for a custom GPT)")
    p.add_argument("--vocab", type=int, help="vocabulary size (default: the config's or preset's; 50257 for a "
                                             "custom GPT)")
    p.add_argument("--tp", type=int, help="MP (tensor-parallel) degree (default: the config's parallel.tp, else 1)")
    p.add_argument("--cp", type=int, help="context-parallel degree: each GPU holds seq/cp tokens "
                                          "(default: the config's parallel.cp, else 1)")
    p.add_argument("--gpus", type=int, help="world size, required for a breakdown unless the --config fixes "
                                            "parallel.dp; DP = gpus / (tp x cp x pp)")
    p.add_argument("--batch", type=int, help="micro-batch per DP rank (default: the config's, else 4)")
    p.add_argument("--stage", type=int, choices=typing.get_args(Stage), help="ZeRO stage (default: the config's, else 2)")
    p.add_argument("--pa", action="store_true", help="Pa: partition activation checkpoints over MP")
    p.add_argument("--cpu", action="store_true", help="Pa+cpu: checkpoints in host memory")
    p.add_argument("--config-name", choices=sorted(C_CONFIGS), help="apply C1..C5 (Table 3) to the setup")
    p.add_argument("--gpu", choices=sorted(HARDWARE), default="v100",
                   help="device whose memory the fit checks use: v100 (32 GB, default), h100 (80)")
    p.add_argument("--device-gb", type=float, help="device memory in GB (default: the --gpu's)")
    p.add_argument("--c-gpus", type=int, default=400, help="GPUs of the C1-C5 max-model estimate")
    p.add_argument("--c-mp", type=int, default=16, help="MP of the C1-C5 max-model estimate")
    p.add_argument("--c-batches", default="4,8,16", help="micro-batches of the C1-C5 estimate")
    a = p.parse_args(argv)

    out: dict = {"table1": table1(), "table2": table2()}
    try:
        batches = check_args(a)
        setup = build_setup(a)
    except UsageError as e:
        p.exit(2, f"{p.prog}: error: {e}\n")
    if setup is not None:
        out["breakdown"] = {"model": setup.model.name or f"{setup.model.num_layers}x{setup.model.hidden_size}",
                            "gpus": setup.tp * setup.cp * setup.dp, "tp": setup.tp, "cp": setup.cp,
                            "dp": setup.dp,
                            "micro_batch": setup.micro_batch, "stage": setup.stage,
                            "pa": setup.partition_activations, "cpu": setup.cpu_checkpointing,
                            **estimate(setup), "fits": estimate(setup)["total"] <= a.device_gb * GB,
                            "max_model": max_model(setup, a.device_gb * GB)}
    out["c_configs"] = {b: c_config_max_models(a.c_gpus, a.c_mp, b, a.device_gb) for b in batches}
    if a.json:
        print(json.dumps(out, indent=1, default=str))
        return out

    print("Table 1: model states per device (GB), Ψ = 7.5B / 128B / 1T, K = 12 (ZeRO §5.4)")
    print(fmt_table(table1_text()))
    print("\nTable 2: theoretical max model size, 32 GB/GPU, 64-way DP (ZeRO §7)")
    print(fmt_table(table2_text()))
    if setup is not None:
        b = out["breakdown"]
        cp = f" x CP {b['cp']}" if b["cp"] > 1 else ""
        print(f"\nBreakdown per GPU: {b['model']} on {b['gpus']} GPUs, MP {b['tp']}{cp} x "
              f"DP {b['dp']}, "
              f"micro-batch {b['micro_batch']}, seq {setup.model.seq_length}, stage {b['stage']}, "
              f"Pa {b['pa']}, Pa+cpu {b['cpu']}")
        for key in ("params_total", "params_per_rank"):
            print(f"  {key:22s} {count(b[key]):>10s}")
        for key in ("model_states", "checkpoints_device", "checkpoints_host", "working", "fixed_buffers",
                    "nccl_communicators", "total"):  # NCCL's buffers: outside torch's allocator and margin
            print(f"  {key:22s} {size(b[key]):>10s}")
        print(f"  fragmentation margin   {b['fragmentation_margin']:10.0%}   fits {a.device_gb:g} GB with the "
              f"margin: {b['fits']}")
        m = b["max_model"]
        print(f"  largest GPT that fits: {m['layers']} layers x {m['hidden']} hidden = {m['params'] / 1e9:.1f}B"
              if m["layers"] else f"  largest GPT that fits: none (not one layer of the paper's widths at this "
                                  f"batch, MP and stage)")
    print(f"\nMax model size per ZeRO configuration (Table 3), {a.c_gpus} GPUs x {a.device_gb:g} GB, MP {a.c_mp}, "
          f"seq 1024, fp16 gradients as the paper's (2 + 2 + K)Ψ (batch and seq of the paper's runs are not "
          f"stated; assumed):")
    names = list(next(iter(out["c_configs"].values())))
    rows = [["batch", *names]] + [[str(bt), *(f"{r[n]['params'] / 1e9:.1f}B ({r[n]['layers']}x{r[n]['hidden']})"
                                               if r[n]["layers"] else "none fits" for n in names)]
                                  for bt, r in out["c_configs"].items()]
    print(fmt_table(rows))
    return out


if __name__ == "__main__":
    main()
