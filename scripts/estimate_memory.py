"""Per-device memory of ZeRO training, from the memory model (zerotron.estimate.memory_model).

    python scripts/estimate_memory.py                       # paper Tables 1 and 2, C1-C5 max model
    python scripts/estimate_memory.py --preset zero-100b --tp 16 --gpus 400 --batch 32 --config-name C4
    python scripts/estimate_memory.py --config configs/zero100b/table5/zero-100b.yaml --gpus 400
    python scripts/estimate_memory.py --layers 40 --hidden 4096 --heads 32 --tp 4 --gpus 64 --json

Prints the ZeRO paper's Table 1 (model states per device for 7.5B, 128B and 1T at Nd 1…1024)
and Table 2 (theoretical largest model per MP degree, 32 GB, 64-way DP) exactly as the paper
prints them, a per-term breakdown of any preset, run config or custom shape, and the largest
GPT each ZeRO configuration C1–C5 (Table 3) fits on ``--device-gb`` GPUs. ``--json`` writes
one JSON object instead, for machines.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

from zerotron.model import GPTConfig, get_preset
from zerotron.estimate.memory_model import C_CONFIGS, Setup, estimate, max_model
from zerotron.estimate.paper_tables import c_config_max_models, table1, table1_text, table2, table2_text

GB = 1e9


def build_setup(a) -> Setup | None:
    """The setup to break down: from --config, --preset or --layers/--hidden/--heads; None if none given."""
    tp, batch, stage, pa, cpu, md = a.tp, a.batch, a.stage, a.pa, a.cpu, True
    if a.config:
        from zerotron.training.cli import parse_config
        cfg = parse_config(["--config", a.config])
        model = get_preset(cfg.model.preset, **{k: v for k, v in dataclasses.asdict(cfg.model).items()
                                                  if k != "preset" and v is not None})
        ac = cfg.activation_checkpointing
        tp, batch, stage = cfg.parallel.tp, cfg.training.micro_batch_size, cfg.zero.stage
        pa, cpu, md = ac.partition_activations, ac.cpu_checkpointing, ac.contiguous_memory_optimization
        ckpt = ac.checkpoint_activations
    elif a.preset:
        model, ckpt = get_preset(a.preset), True
    elif a.layers and a.hidden and a.heads:
        model = GPTConfig(num_layers=a.layers, hidden_size=a.hidden, num_heads=a.heads, vocab_size=50257,
                          seq_length=a.seq or 1024)
        ckpt = True
    else:
        return None
    if a.seq:
        model = dataclasses.replace(model, seq_length=a.seq)
    if a.gpus % tp:
        raise SystemExit(f"--gpus {a.gpus} is not divisible by the MP degree {tp}; use a multiple of it")
    setup = Setup(model, tp=tp, dp=a.gpus // tp, micro_batch=batch, stage=stage, checkpoint_activations=ckpt,
                  partition_activations=pa, cpu_checkpointing=cpu, contiguous_memory=md)
    return setup.with_config(a.config_name) if a.config_name else setup


def fmt_table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join([lines[0], "-" * len(lines[0]), *lines[1:]])


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--config", help="YAML run config (its model, MP, batch, ZeRO and checkpointing)")
    p.add_argument("--preset", help="zerotron.model preset name, e.g. zero-100b")
    p.add_argument("--layers", type=int)
    p.add_argument("--hidden", type=int)
    p.add_argument("--heads", type=int)
    p.add_argument("--seq", type=int, help="sequence length (default: the preset's, 1024)")
    p.add_argument("--tp", type=int, default=1, help="MP (tensor-parallel) degree")
    p.add_argument("--gpus", type=int, default=400, help="total GPUs; DP = gpus / tp")
    p.add_argument("--batch", type=int, default=4, help="micro-batch per DP rank")
    p.add_argument("--stage", type=int, default=2, choices=[0, 1, 2, 3])
    p.add_argument("--pa", action="store_true", help="Pa: partition activation checkpoints over MP")
    p.add_argument("--cpu", action="store_true", help="Pa+cpu: checkpoints in host memory")
    p.add_argument("--config-name", choices=sorted(C_CONFIGS), help="apply C1..C5 (Table 3) to the setup")
    p.add_argument("--device-gb", type=float, default=32.0, help="device memory (V100 32 GB)")
    p.add_argument("--c-gpus", type=int, default=400, help="GPUs of the C1-C5 max-model estimate")
    p.add_argument("--c-mp", type=int, default=16, help="MP of the C1-C5 max-model estimate")
    p.add_argument("--c-batches", default="4,8,16", help="micro-batches of the C1-C5 estimate")
    a = p.parse_args(argv)

    out: dict = {"table1": table1(), "table2": table2()}
    setup = build_setup(a)
    if setup is not None:
        out["breakdown"] = {"model": setup.model.name or f"{setup.model.num_layers}x{setup.model.hidden_size}",
                            "tp": setup.tp, "dp": setup.dp, "micro_batch": setup.micro_batch, "stage": setup.stage,
                            "pa": setup.partition_activations, "cpu": setup.cpu_checkpointing,
                            **estimate(setup), "fits": estimate(setup)["total"] <= a.device_gb * GB,
                            "max_model": max_model(setup, a.device_gb * GB)}
    batches = [int(b) for b in a.c_batches.split(",") if b]
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
        print(f"\nBreakdown per GPU: {b['model']}, MP {b['tp']} x DP {b['dp']}, micro-batch {b['micro_batch']}, "
              f"stage {b['stage']}, Pa {b['pa']}, Pa+cpu {b['cpu']}")
        for key in ("params_total", "params_per_rank"):
            print(f"  {key:22s} {b[key] / 1e9:10.3f} B")
        for key in ("model_states", "checkpoints_device", "checkpoints_host", "working", "fixed_buffers", "total"):
            print(f"  {key:22s} {b[key] / GB:10.2f} GB")
        print(f"  fragmentation margin   {b['fragmentation_margin']:10.0%}   fits {a.device_gb:g} GB: {b['fits']}")
        m = b["max_model"]
        print(f"  largest GPT that fits: {m['layers']} layers x {m['hidden']} hidden = {m['params'] / 1e9:.1f}B")
    print(f"\nMax model size per ZeRO configuration (Table 3), {a.c_gpus} GPUs x {a.device_gb:g} GB, MP {a.c_mp}, "
          f"seq 1024 (batch and seq of the paper's runs are not stated; assumed):")
    names = list(next(iter(out["c_configs"].values())))
    rows = [["batch", *names]] + [[str(bt), *(f"{r[n]['params'] / 1e9:.1f}B ({r[n]['layers']}x{r[n]['hidden']})"
                                               for n in names)] for bt, r in out["c_configs"].items()]
    print(fmt_table(rows))
    return out


if __name__ == "__main__":
    main()
