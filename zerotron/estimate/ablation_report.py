"""Outputs of ``run_ablations.py``: CSV, JSONL, wandb, the paper-style PNG figures and a results table."""

from __future__ import annotations

import csv
import json
from pathlib import Path


def ratio(measured: float, predicted: float) -> float:
    return 1.0 if measured == predicted == 0 else measured / predicted if predicted else float("inf")


def write_outputs(a, res: dict, params_of) -> None:
    """``params_of(layers)``: the parameter count of the ablation model with that many layers."""
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    for key, stem in (("rows", "ablations"), ("dp_rows", "memory_vs_dp")):
        with open(out / f"{stem}.csv", "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(res[key][0]))
            w.writeheader()
            w.writerows(res[key])
        with open(out / f"{stem}.jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in res[key])
    (out / "results.md").write_text(results_table(a, res))
    plot_all(a, res, params_of)
    if a.wandb_mode != "disabled":
        import wandb
        wb = wandb.init(project=a.wandb_project, mode=a.wandb_mode, dir=str(out), config=vars(a), name="ablations")
        for i, r in enumerate(res["rows"]):
            wb.log({f"ablation/{k}": v for k, v in r.items() if isinstance(v, (int, float))} | {"config_index": i})
        wb.log({"ablations": wandb.Table(data=[list(r.values()) for r in res["rows"]], columns=list(res["rows"][0]))})
        wb.finish()


def plot_all(a, res: dict, params_of) -> None:
    """The paper's Figures 6-8 (max model size, max cached memory, throughput per config) and Figure 1."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figdir, rows, kib = Path(a.figures), res["rows"], 1024
    figdir.mkdir(parents=True, exist_ok=True)
    names, x = [r["config"] for r in rows], list(range(len(rows)))

    def bars(fname, values, ylabel, title, predicted=None):
        fig, ax = plt.subplots(figsize=(6, 3.2))
        ax.bar(x, values, color="tab:blue", label="measured")
        if predicted is not None:
            ax.plot(x, predicted, "kx", markersize=9, label="memory model")
            ax.legend(fontsize=8)
        ax.set_xticks(x, names)
        ax.set_ylabel(ylabel)
        ax.set_title(title, fontsize=9)
        fig.tight_layout()
        fig.savefig(figdir / fname, dpi=80)
        plt.close(fig)

    bars("ablation_max_model_size.png", [r["max_params"] / 1e3 for r in rows], "largest model (K params)",
         f"Max model size per config, measured-peak cap {a.cap_kib:.0f} KiB/rank (TP {a.tp} x DP {a.dp})",
         [params_of(r["max_layers_predicted"]) / 1e3 for r in rows])
    bars("ablation_max_cached_memory.png", [r["peak"] / kib for r in rows], "measured peak per rank (KiB)",
         f"Peak live tensor memory per config, {a.layers}-layer model", [r["pred_peak"] / kib for r in rows])
    bars("ablation_throughput.png", [r["tflops_per_device"] * 1e3 for r in rows], "GFLOP/s per rank",
         f"Throughput per config (CPU, gloo, {a.precision}, recompute counted)")
    fig, ax = plt.subplots(figsize=(6, 3.2))
    for stage, label in ((0, "baseline DP"), (1, "Pos"), (2, "Pos+g"), (3, "Pos+g+p")):
        pts = [r for r in res["dp_rows"] if r["stage"] == stage]
        line, = ax.plot([r["dp"] for r in pts], [r["formula"] / kib for r in pts], "-", label=f"{label} formula")
        ax.plot([r["dp"] for r in pts], [r["measured"] / kib for r in pts], "o", color=line.get_color())
    ax.set_xscale("log", base=2)
    ax.set_xlabel("DP degree Nd")
    ax.set_ylabel("model states per rank (KiB)")
    ax.set_title("Model states per rank vs DP (Figure 1): lines formula, dots measured", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(figdir / "ablation_memory_vs_dp.png", dpi=80)
    plt.close(fig)


def results_table(a, res: dict) -> str:
    kb = 1024
    lines = [f"Layout TP {a.tp} x DP {a.dp}, GPT h={a.hidden} s={a.seq} b={a.batch} ({a.precision}), "
             f"{a.layers} layers for the memory and throughput columns; cap {a.cap_bytes / kb:.0f} KiB on the measured "
             "peak of live tensors.", "",
             "| config | model states KiB (pred) | ckpt device KiB (pred) | ckpt host KiB (pred) | fixed KiB (pred) "
             "| accounted KiB (pred) | measured peak KiB (pred) | RSS MiB | TFLOP/s/dev | max layers (pred) | max params |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        cell = lambda k: f"{r[k] / kb:.1f} ({r['pred_' + k] / kb:.1f})"  # noqa: E731
        lines.append(f"| {r['config']} | {cell('model_states')} | {cell('checkpoints_device')} | {cell('checkpoints_host')} "
                     f"| {cell('fixed_buffers')} | {cell('accounted')} | {cell('peak')} | {r['rss_bytes'] / kb / kb:.0f} | "
                     f"{r['tflops_per_device']:.4f} | {r['max_layers']} ({r['max_layers_predicted']}) | {r['max_params']:,} |")
    lines += ["", "| DP | stage | Ψ per rank | measured KiB | formula KiB | ratio |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['dp']} | {r['stage']} | {r['params']:,} | {r['measured'] / kb:.1f} | {r['formula'] / kb:.1f} | "
              f"{r['ratio']:.4f} |" for r in res["dp_rows"]]
    return "\n".join(lines) + "\n"
