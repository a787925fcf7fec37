"""The dry run over every ZeRO-100B setup: measured memory against the memory model, predicted
TFLOPs against the paper's.

    python scripts/bench/dry_run_sweep.py                     # 33 configs + C1-C5 on 40B and 100B
    python scripts/bench/dry_run_sweep.py --only table5 --jobs 2

Runs ``scripts/dry_run.py --json`` (first and last rank) for each config in
``configs/zero100b/{table5,table6,table10}`` at the GPU count of its ``# GPUs: N`` header, and for
the ZeRO configurations C1-C5 (``configs/zero100b/ablations``) applied to the 40B (50 x 8192,
batch 16) and 100B (125 x 8192, batch 32) models on 400 GPUs at MP 16 (ZeRO Table 3). Writes
``sweep.json`` and ``sweep.md`` (the table ``docs/dry_run.md`` shows) under ``--out`` and prints
the table. The paper's TFLOPs/GPU come from each config's header (its Figure 2-4 reading).
Exits 2 on a bad flag or an ``--only`` that matches no setup, before writing anything (an empty
table must not replace the one the docs show), and 1 when any dry run failed.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from zerotron.parallel import fake_cuda, simulation  # noqa: E402
from zerotron.testing.bench_args import positive_int  # noqa: E402
CONFIGS = ROOT / "configs" / "zero100b"
ABLATION_MODELS = {  # Table 3's models: (base config, overrides)
    "40B": ("table5/zero-100b.yaml", ["--model.num_layers", "50", "--training.micro_batch_size", "16",
                                      "--training.global_batch_size", "400"]),
    "100B": ("table5/zero-100b.yaml", []),
}


ONLY_CHOICES = ("table (the 33 setups), table5, table6, table10, ablations, a C1-C5 name (C5, C4 100B) or a "
                "config's name (table5/zero-100b)")


def header(path: Path, pattern: str) -> str | None:
    m = re.search(pattern, path.read_text(), re.M)
    return m.group(1) if m else None


def ablation_overrides(name: str) -> list[str]:
    """A C1-C5 fragment as command-line overrides (``--section.field value``)."""
    from zerotron.config.cli import read_yaml

    data = read_yaml(CONFIGS / "ablations" / f"{name}.yaml")
    return [arg for section, fields in data.items() for k, v in fields.items()
            for arg in (f"--{section}.{k}", str(v).lower() if isinstance(v, bool) else str(v))]


def jobs(only: str | None) -> list[dict]:
    out = []
    for folder in ("table5", "table6", "table10"):
        for path in sorted((CONFIGS / folder).glob("*.yaml")):
            name = f"{folder}/{path.stem}"
            if only and not name.startswith(only):
                continue
            gpus = int(header(path, r"^# GPUs: (\d+)"))
            paper = header(path, r"~([\d.]+) TFLOPs/GPU")
            out.append({"name": name, "config": str(path), "gpus": gpus, "overrides": [],
                        "paper_tflops": float(paper) if paper else None})
    for model, (base, extra) in ABLATION_MODELS.items():
        for c in ("c1", "c2", "c3", "c4", "c5"):
            if not only or only == "ablations" or f"{c.upper()} {model}".startswith(only):
                out.append({"name": f"{c.upper()} {model}", "config": str(CONFIGS / base), "gpus": 400,
                            "overrides": extra + ablation_overrides(c), "paper_tflops": None})
    return out


def dry_run_env() -> dict | None:
    """Each dry run starts on the fake CUDA library when this torch has no CUDA, as
    ``scripts/dry_run.py`` would re-execute itself: once here instead of once per setup."""
    return None if simulation.cuda_is_built() else fake_cuda.environ()


def run(job: dict, out_dir: Path, env: dict | None) -> dict:
    cmd = [sys.executable, str(ROOT / "scripts" / "dry_run.py"), "--config", job["config"], "--gpus",
           str(job["gpus"]), "--json", "--out", str(out_dir / "metadata" / job["name"].replace(" ", "_")),
           *job["overrides"]]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env)
    job = {**job, "seconds": round(time.perf_counter() - start, 1)}
    if proc.returncode != 0:
        return {**job, "error": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit {proc.returncode}"}
    return {**job, "result": json.loads(proc.stdout)}


def row(r: dict) -> list[str]:
    if "error" in r:
        return [r["name"], str(r["gpus"]), "error: " + r["error"][:80], "", "", "", "", "", ""]
    res = r["result"]
    ranks = list(res["ranks"].values())
    peak = max(e["peak_bytes"] for e in ranks)
    build = max(e["construction_peak_bytes"] for e in ranks)
    ratios = [e["measured_vs_model"] for e in ranks]
    pred = ranks[0]["predicted"]["tflops_per_gpu"]
    paper = f"{r['paper_tflops']:.1f}" if r["paper_tflops"] else "—"
    return [r["name"], str(r["gpus"]), f"{peak / 1e9:.2f}", f"{res['model']['before_margin'] / 1e9:.2f}",
            " / ".join(f"{x:.3f}" for x in ratios), f"{build / 1e9:.2f}",
            "yes" if all(e["fits"] for e in ranks) else "no", f"{pred:.1f}", paper]


def table(results: list[dict]) -> str:
    head = ["setup", "GPUs", "measured peak GB", "model GB", "measured / model (first / last rank)",
            "construction GB", "fits 32 GB (peak + NCCL, no margin)", "predicted TFLOPs/GPU", "paper TFLOPs/GPU"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(row(r)) + " |" for r in results]
    return "\n".join(lines)


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", help=f"a prefix: {ONLY_CHOICES}")
    p.add_argument("--jobs", type=positive_int, default=2, help="dry runs at once (one CPU core each)")
    p.add_argument("--out", default="runs/dry_run/sweep",
                   help="where sweep.json and sweep.md go, under the repository root unless absolute")
    a = p.parse_args(argv)
    todo = jobs(a.only)
    if not todo:
        p.error(f"--only {a.only!r} matches no setup; give {ONLY_CHOICES}")
    try:
        env = dry_run_env()
    except fake_cuda.FakeCudaUnavailable as e:
        print(f"dry_run_sweep: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    out_dir = ROOT / a.out
    out_dir.mkdir(parents=True, exist_ok=True)
    start, results = time.perf_counter(), []
    with ThreadPoolExecutor(a.jobs) as pool:
        for i, r in enumerate(pool.map(lambda j: run(j, out_dir, env), todo), 1):
            results.append(r)
            status = r.get("error") or " / ".join(f"{e['measured_vs_model']:.3f}" for e in r["result"]["ranks"].values())
            print(f"[sweep] {i}/{len(todo)} {r['name']}: {r['seconds']} s, measured/model {status}", flush=True)
    (out_dir / "sweep.json").write_text(json.dumps(results, indent=1))
    md = table(results)
    (out_dir / "sweep.md").write_text(md + "\n")
    print(md)
    failed = [r["name"] for r in results if "error" in r]
    print(f"\n{len(results)} setups in {time.perf_counter() - start:.0f} s; {out_dir / 'sweep.md'}")
    if failed:
        print(f"dry_run_sweep: {len(failed)} of {len(results)} dry runs failed: {', '.join(failed)}", file=sys.stderr)
        raise SystemExit(1)
    return results


if __name__ == "__main__":
    main()
