"""The step-time model against published numbers: ZeRO Tables 5, 6 and 10, Megatron-core on H100.

    python scripts/bench/step_time_table.py                          # runs/step_time/step_time.md
    python scripts/bench/step_time_table.py --out docs/step_time.md  # the page the docs show
    python scripts/bench/step_time_table.py --dry-run table6/zero-60b-64gpus table10/zero-1.5b

Every config in ``configs/zero100b/{table5,table6,table10}`` at the GPU count of its header is
predicted on the V100 DGX-2 preset from the config alone (``estimate.step_model``, collectives
counted by ``estimate.comm_volumes``: no dry run, a second for all 33), against the paper's
TFLOPs/GPU (the header's Figure 2-4 reading). Megatron-core's published H100 MFU for GPT-175B
is predicted on the H100 preset for the layout in ``MEGATRON_H100``, and Megatron-LM's MP
strong scaling of its 1.2B model (Table 8) on the V100 preset. ``--dry-run`` also runs
``scripts/dry_run.py`` on the named configs (30-60 s each) and sets the prediction on their
measured collectives beside the counted one. Exit 2 on a bad flag, before writing anything.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from zerotron.estimate import step_model  # noqa: E402
from zerotron.estimate.comm_volumes import analytic_comm, group_ranks  # noqa: E402
from zerotron.estimate.step_time import collective_time, group_span  # noqa: E402
from zerotron.estimate.hardware import H100_DGX, V100_DGX2  # noqa: E402
from zerotron.model.config import GPTConfig  # noqa: E402
from zerotron.config.cli import parse_config  # noqa: E402
from zerotron.config.run_config import RunConfig  # noqa: E402
from zerotron.training.setup_run import validate_model  # noqa: E402

sys.path.insert(0, str(ROOT / "scripts" / "bench"))
from step_time_notes import (INTRO, IMPLIED_TP_NOTE, LINK_SWEEP_NOTE, MEGATRON_NOTE,  # noqa: E402
                             MP_SCALING_NOTE, NOTES, TOLERANCE)

CONFIGS = ROOT / "configs" / "zero100b"
GPT_175B = GPTConfig(num_layers=96, hidden_size=12288, num_heads=96, vocab_size=50257,
                     seq_length=2048, dropout=0.0, attention_dropout=0.0, name="gpt-175b")
# Megatron-core README: GPT-175B strong scaling, 96 -> 4,608 H100s, 47 % -> 42 % MFU. The layout
# is not in our reference; assumed: TP 4 x PP 8, 6 interleaved chunks of 2 layers per rank,
# micro-batch 1, global batch 1152, sequence parallel, distributed optimizer (stage 1) with
# its gradient reduce-scatter and parameter all-gather overlapped, no recompute, bf16
MEGATRON_H100 = [(96, 0.47), (4608, 0.42)]
MEGATRON_OVERLAP = {"reduce_scatter/dp": 1.0, "all_gather/dp": 1.0}
# Megatron-LM (arXiv 1909.08053) App. D.2 Table 8: the 1.2B model (40 x 1536, 16 heads, seq 1024,
# checkpointed, fp16) at batch 8 on 1, 2, 4, 8 GPUs of one DGX-2H by MP alone: its speed-ups
GPT_1_2B = GPTConfig(num_layers=40, hidden_size=1536, num_heads=16, vocab_size=50257,
                     seq_length=1024, dropout=0.1, attention_dropout=0.1, name="gpt-1.2b")
MEGATRON_TABLE8 = [(1, 1.0), (2, 1.64), (4, 2.34), (8, 2.98)]
# the network figures (GB/s a node) every table row is predicted again at, the datasheet's 100 among
# them: would a second constant, a cluster-measured network bandwidth, bring every row in?
LINK_SWEEP_GBPS = (150, 100, 80, 65, 50, 40, 30, 25, 20, 15, 12.5, 10)


def megatron_config(gpus: int) -> RunConfig:
    cfg = RunConfig()
    par = cfg.parallel
    par.tp, par.pp, par.virtual_stages, par.sequence_parallel = 4, 8, 6, True
    par.dp = gpus // (par.tp * par.pp)
    cfg.training.micro_batch_size, cfg.training.global_batch_size = 1, 1152
    cfg.training.precision = "bf16"
    cfg.zero.stage, cfg.zero.overlap_comm = 1, True
    return cfg


def setups() -> dict[str, Path]:
    """Every ZeRO-100B table config by name (table5/zero-100b ...), in table order."""
    return {f"{folder}/{path.stem}": path for folder in ("table5", "table6", "table10")
            for path in sorted((CONFIGS / folder).glob("*.yaml"))}


def paper_configs() -> list[tuple[str, Path, int, float, object, object]]:
    """Each table config read once: name, path, GPUs and the paper's TFLOPs (its header), the
    validated run config and its model."""
    out = []
    for name, path in setups().items():
        text = path.read_text()
        gpus = int(re.search(r"^# GPUs: (\d+)", text, re.M).group(1))
        paper = float(re.search(r"~([\d.]+) TFLOPs/GPU", text).group(1))
        cfg = parse_config(["--config", str(path)], world_size=gpus)
        cfg.validate(gpus)
        out.append((name, path, gpus, paper, cfg, validate_model(cfg)))
    return out


def paper_rows(hw=V100_DGX2, configs: list | None = None) -> list[dict]:
    out = []
    for name, path, gpus, paper, cfg, mcfg in configs or paper_configs():
        pred = step_model.predict(cfg, mcfg, gpus, hw)
        out.append({"name": name, "table": name.split("/")[0],
                    "config": str(path.relative_to(ROOT)), "gpus": gpus, "tp": cfg.parallel.tp,
                    "batch": cfg.training.micro_batch_size, "paper": paper,
                    "predicted": pred.tflops_per_gpu, "pred": pred.as_dict(), "cfg": cfg,
                    "mcfg": mcfg})
    return out


def megatron_rows() -> list[dict]:
    out = []
    for gpus, mfu in MEGATRON_H100:
        pred = step_model.predict(megatron_config(gpus), GPT_175B, gpus, H100_DGX,
                                  overlap=MEGATRON_OVERLAP)
        out.append({"name": f"megatron/gpt-175b-{gpus}gpus", "table": "megatron", "gpus": gpus,
                    "tp": 4, "batch": 1, "paper": mfu * 100, "predicted": pred.mfu * 100,
                    "pred": pred.as_dict()})
    return out


def mp_scaling_rows() -> list[dict]:
    """Megatron-LM's Table 8 strong scaling by MP inside a node, as speed-ups over one GPU."""
    steps = {}
    for mp, _ in MEGATRON_TABLE8:
        cfg = RunConfig()
        cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.dp = mp, 1, 1
        cfg.training.micro_batch_size = cfg.training.global_batch_size = 8
        cfg.training.precision = "fp16"
        cfg.activation_checkpointing.checkpoint_activations = True
        steps[mp] = step_model.predict(cfg, GPT_1_2B, mp, V100_DGX2).step_s
    return [{"mp": mp, "paper": speedup, "predicted": steps[1] / steps[mp], "step_s": steps[mp]}
            for mp, speedup in MEGATRON_TABLE8]


def mp_scaling_table(rows: list[dict]) -> str:
    lines = ["| MP (GPUs) | published speed-up | predicted speed-up | ratio | predicted step s |",
             "|---|---|---|---|---|"]
    lines += [f"| {r['mp']} | {r['paper']:.2f} | {r['predicted']:.2f} | "
              f"{r['predicted'] / r['paper']:.2f} | {r['step_s']:.3f} |" for r in rows]
    return "\n".join(lines)


def implied_tp_rows(rows: list[dict]) -> list[dict]:
    """For each Megatron-LM baseline of Table 5, what its published TFLOPs say its TP all-reduces
    took: the published step (the model's step scaled by predicted/published) less every other
    term of the model, and the bus bandwidth that leaves the ring once its latency is paid."""
    out = []
    for r in rows:
        if not (r["table"] == "table5" and "baseline" in r["name"] and r["tp"] > 1):
            continue
        cfg = r["cfg"]
        ar = analytic_comm(cfg, r["mcfg"])["all_reduce/tp"]
        span = group_span(group_ranks(cfg.parallel.tp, 1, cfg.parallel.dp)["tp"],
                          V100_DGX2.gpus_per_node)
        latency, _ = collective_time("all_reduce", ar["calls"], ar["bytes"], span, V100_DGX2.link())
        p = r["pred"]
        step = p["step_s"] * r["predicted"] / r["paper"]
        implied = step - (p["step_s"] - p["exposed_s"]["tp"])
        moved = (span.size - 1) / span.size * ar["bytes"]  # what each ring edge carries
        out.append({"name": r["name"], "tp": r["tp"], "nodes": span.nodes, "step": step,
                    "model_step": p["step_s"], "model_tp": p["exposed_s"]["tp"],
                    "latency": latency, "implied": implied,
                    "bus_gbps": moved / (implied - latency) / 1e9 if implied > latency else None})
    return out


def implied_tp_table(rows: list[dict]) -> str:
    lines = ["| setup | MP | nodes | published step s | model step s | model TP s (latency) | "
             "implied TP s | implied TP bus GB/s |", "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['name']} | {r['tp']} | {r['nodes']} | {r['step']:.2f} | "
              f"{r['model_step']:.2f} | {r['model_tp']:.2f} ({r['latency']:.2f}) | "
              f"{r['implied']:.2f} | "
              + ("latency alone exceeds it" if r["bus_gbps"] is None else f"{r['bus_gbps']:.1f}")
              + " |" for r in rows]
    return "\n".join(lines)


def link_sweep_rows() -> list[dict]:
    """Every table row predicted again at each of ``LINK_SWEEP_GBPS``: the rows within 25 %."""
    out, configs = [], paper_configs()
    for gbps in LINK_SWEEP_GBPS:
        ratios = {r["name"]: r["predicted"] / r["paper"]
                  for r in paper_rows(replace(V100_DGX2, inter_node_gbps=gbps), configs)}
        out.append({"gbps": gbps, "rows": len(ratios),
                    "outside": {n: x for n, x in ratios.items() if abs(x - 1) > TOLERANCE}})
    return out


def link_sweep_table(rows: list[dict]) -> str:
    best = max(r["rows"] - len(r["outside"]) for r in rows)
    at = [r["gbps"] for r in rows if r["rows"] - len(r["outside"]) == best]
    lines = ["| network GB/s a node | rows within 25 % | outside (ratio) |", "|---|---|---|"]
    for r in rows:
        gbps = f"{r['gbps']:g}" + (" (datasheet)" if r["gbps"] == V100_DGX2.inter_node_gbps else "")
        short = sorted((n.split("/")[1], x) for n, x in r["outside"].items())
        outside = ", ".join(f"{n} {x:.2f}" for n, x in short)
        lines.append(f"| {gbps} | {r['rows'] - len(r['outside'])} of {r['rows']} | {outside} |")
    return "\n".join(lines) + (f"\n\nThe most rows within 25 % at any of these figures: {best} of "
                               f"{rows[0]['rows']}, at {' and '.join(f'{g:g}' for g in at)} GB/s.")


def pairs(rows: list[dict], gap: float = 0.0) -> tuple[int, list[tuple[str, str]]]:
    """Pairs whose published values differ by more than ``gap`` (relative), and those of them the
    model orders the other way."""
    count, bad = 0, []
    for i, a in enumerate(rows):
        for b in rows[i + 1:]:
            if abs(a["paper"] - b["paper"]) <= gap * max(a["paper"], b["paper"]):  # unreadable
                continue
            count += 1
            if (a["paper"] - b["paper"]) * (a["predicted"] - b["predicted"]) < 0:
                bad.append((a["name"].split("/")[1], b["name"].split("/")[1]))
    return count, bad


def ranking(rows: list[dict]) -> str:
    every, bad = pairs(rows)
    clear, bad_clear = pairs(rows, 0.10)
    listed = ", ".join(f"{x} / {y}" for x, y in bad_clear)
    return (f"Ranking: {every - len(bad)} of {every} pairs ordered as published; of the {clear} "
            f"pairs more than 10 % apart, {clear - len(bad_clear)}"
            + (f" (reversed: {listed})." if bad_clear else "."))


def term_summary(p: dict) -> str:
    exposed = sorted(((s, g) for g, s in p["exposed_s"].items() if s > 0.005), reverse=True)
    parts = [f"compute {p['compute_s']:.2f}"] + [f"{g} {s:.2f}" for s, g in exposed[:2]]
    parts += [f"{k} {p[k + '_s']:.2f}" for k in ("bubble", "optimizer", "host_copy")
              if p[k + "_s"] > 0.005]
    return ", ".join(parts)


def table(rows: list[dict], unit: str, tolerance: float) -> str:
    head = ["setup", "GPUs", "MP", "batch", f"published {unit}", f"predicted {unit}", "ratio",
            f"within {tolerance:.0%}", "step s", "terms (s)", "why off"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        ratio = r["predicted"] / r["paper"]
        ok = abs(ratio - 1) <= tolerance
        note = NOTES.get(r["name"], "" if ok else "not explained")
        lines.append(f"| {r['name']} | {r['gpus']} | {r['tp']} | {r['batch']} | "
                     f"{r['paper']:.1f} | {r['predicted']:.1f} | {ratio:.2f} | "
                     f"{'yes' if ok else '**no**'} | {r['pred']['step_s']:.2f} | "
                     f"{term_summary(r['pred'])} | {note} |")
    return "\n".join(lines)


def dry_run_check(names: list[str], rows: list[dict]) -> str:
    """The prediction on a dry run's measured collectives beside the counted one."""
    sys.path.insert(0, str(ROOT / "scripts" / "bench"))
    from dry_run_sweep import dry_run_env

    env, lines = dry_run_env(), ["| setup | counted TFLOPs/GPU | on the dry run's collectives |",
                                 "|---|---|---|"]
    for name in names:
        r = next(x for x in rows if x["name"] == name)
        cmd = [sys.executable, str(ROOT / "scripts" / "dry_run.py"), "--config", r["config"],
               "--gpus", str(r["gpus"]), "--ranks", str(r["gpus"] - 1), "--json",
               "--out", str(ROOT / "runs" / "step_time" / "dry_run")]
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env)
        if proc.returncode != 0:
            raise SystemExit(f"step_time_table: dry run of {name} failed: {proc.stderr[-500:]}")
        measured = next(iter(json.loads(proc.stdout)["ranks"].values()))["predicted"]
        lines.append(f"| {name} | {r['predicted']:.2f} | {measured['tflops_per_gpu']:.2f} |")
        print(lines[-1], flush=True)
    return "\n".join(lines)


def main(argv=None) -> str:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/step_time/step_time.md",
                   help="the markdown page, under the repository root unless absolute")
    p.add_argument("--dry-run", nargs="*", default=[], metavar="SETUP",
                   help="also dry-run these setups (table6/zero-60b-64gpus ...) and compare")
    a = p.parse_args(argv)
    unknown = [n for n in a.dry_run if n not in setups()]
    if unknown:
        p.error(f"--dry-run {unknown}: not a setup; give names such as table5/zero-100b")
    rows = paper_rows()
    mega = megatron_rows()
    parts = [INTRO]
    for folder, title in (("table5", "ZeRO Table 5 (Figure 2): ZeRO vs Megatron-LM, V100 DGX-2"),
                          ("table6", "ZeRO Table 6 (Figure 3): 60B on 64-400 GPUs"),
                          ("table10", "ZeRO Table 10 (Figure 4): DP only")):
        sub = [r for r in rows if r["table"] == folder]
        within = sum(abs(r["predicted"] / r["paper"] - 1) <= TOLERANCE for r in sub)
        parts += [f"## {title}", "", table(sub, "TFLOPs/GPU", TOLERANCE), "",
                  f"{within} of {len(sub)} rows within {TOLERANCE:.0%}. {ranking(sub)}", ""]
    parts += ["## What the MP baselines' published figures imply for their TP all-reduces", "",
              IMPLIED_TP_NOTE, "", implied_tp_table(implied_tp_rows(rows)), ""]
    parts += ["## Would a second constant do? Every row at other network figures", "",
              LINK_SWEEP_NOTE, "", link_sweep_table(link_sweep_rows()), ""]
    parts += ["## Megatron-core on H100 (README): GPT-175B strong scaling", "", MEGATRON_NOTE, "",
              table(mega, "MFU %", 0.20), "",
              "## Megatron-LM Table 8: MP inside one node (a check, not a target)", "",
              MP_SCALING_NOTE, "", mp_scaling_table(mp_scaling_rows()), ""]
    if a.dry_run:
        parts += ["## Counted against measured collectives", "",
                  "The same prediction on the collectives a dry run of the last rank records "
                  f"(`--dry-run {' '.join(a.dry_run)}`):", "", dry_run_check(a.dry_run, rows), ""]
    text = "\n".join(parts)
    out = Path(a.out) if Path(a.out).is_absolute() else ROOT / a.out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(text)
    print(f"\nwritten: {out}", file=sys.stderr)
    return text


if __name__ == "__main__":
    main()
