"""The ZeRO paper's memory tables, recomputed from the model-state formulas (arXiv 1910.02054).

* **Table 1** (§5.4): per-device model states in GB for Ψ = 7.5B, 128B, 1T at Nd = 1…1024,
  for Pos, Pos+g, Pos+g+p (K = 12, 16-bit parameters and gradients).
* **Table 2** (§7): the theoretical largest model whose model states fit 32 GB per GPU, for
  MP = 1…16 with 64-way DP (GPUs = 64·MP): Ψ ≤ 32·MP / (per-parameter bytes at Nd = 64).
* **C1–C5** (§10.5, Table 3): the largest GPT each configuration fits on a V100, from the full
  per-device model of ``memory_model`` (model states, checkpoints, working memory, CB, margin).

The paper's printing conventions are reproduced so the tables compare digit for digit:
Table 1 truncates values of 100 GB or more to whole GB (1T, Nd = 64: 4187.5 → "4187"; 128B,
Nd = 1024: 513.5 → "513") and rounds smaller ones half-up to one decimal from 10 GB and two
below (41.25 → "41.3", 0.469 → "0.47"), dropping trailing zeros. Table 2 rounds the MP = 1
bound to 0.1B and scales it by MP (hence 15.2B, not 15.28B, at MP = 2); 512B and above print
in T = 1024B, as the paper does ("0.5T", "1T", "2T").
"""

from __future__ import annotations

import dataclasses
from decimal import ROUND_HALF_UP, Decimal

from zerotron.model.presets import get_preset
from zerotron.estimate.memory_model import C_CONFIGS, Setup, estimate, max_model, model_state_bytes

GB = 1e9
TABLE1_MODELS = {"7.5B": 7.5e9, "128B": 128e9, "1T": 1e12}
TABLE1_ND = (1, 4, 16, 64, 256, 1024)
STAGE_NAMES = {1: "Pos", 2: "Pos+g", 3: "Pos+g+p"}
TABLE2_MP = (1, 2, 4, 8, 16)
TABLE2_DP = 64
V100_GB = 32


def paper_gb(value: float) -> str:
    """A GB figure printed as Table 1 prints it (see the module docstring)."""
    if value >= 100:
        return str(int(value))
    places = Decimal("0.1") if value >= 10 else Decimal("0.01")
    text = str(Decimal(repr(value)).quantize(places, rounding=ROUND_HALF_UP))
    return text.rstrip("0").rstrip(".") if "." in text else text


def table1() -> list[dict]:
    """Rows {nd, "<model> <stage>": GB} of Table 1, as numbers."""
    rows = []
    for nd in TABLE1_ND:
        row = {"nd": nd}
        for name, psi in TABLE1_MODELS.items():
            for stage, sname in STAGE_NAMES.items():
                row[f"{name} {sname}"] = model_state_bytes(psi, nd, stage) / GB
        rows.append(row)
    return rows


def table1_text(rows: list[dict] | None = None) -> list[list[str]]:
    """Table 1 as the paper prints it: a header row, then one row per Nd."""
    rows = table1() if rows is None else rows
    keys = [k for k in rows[0] if k != "nd"]
    return [["Nd", *keys]] + [[str(r["nd"]), *(paper_gb(r[k]) for k in keys)] for r in rows]


def max_psi_model_states(mp: int, nd: int, stage: int, device_gb: float = V100_GB) -> float:
    """Largest Ψ (parameters) whose model states fit ``device_gb`` per GPU: Ψ/MP per GPU (§7)."""
    return device_gb * GB * mp / model_state_bytes(1.0, nd, stage)


def _billions(psi: float, mp: int) -> str:
    """Table 2's printing: the MP = 1 bound to 0.1B, times MP; T = 1024B from 512B on."""
    per_mp = Decimal(repr(psi / mp / 1e9)).quantize(Decimal("0.1"), rounding=ROUND_HALF_UP)
    value = per_mp * mp
    if value >= 512:
        text = str((value / 1024).normalize())
        return f"{text}T"
    text = str(value.normalize()) if value != value.to_integral() else str(int(value))
    return f"{text}B"


def table2() -> list[dict]:
    """Rows of Table 2's theoretical columns: {mp, gpus, Baseline, Pos, Pos+g, Pos+g+p} in parameters."""
    rows = []
    for mp in TABLE2_MP:
        row = {"mp": mp, "gpus": mp * TABLE2_DP, "Baseline": max_psi_model_states(mp, TABLE2_DP, 0)}
        for stage, sname in STAGE_NAMES.items():
            row[sname] = max_psi_model_states(mp, TABLE2_DP, stage)
        rows.append(row)
    return rows


def table2_text(rows: list[dict] | None = None) -> list[list[str]]:
    rows = table2() if rows is None else rows
    keys = ["Baseline", *STAGE_NAMES.values()]
    return [["MP", "GPUs", *keys]] + [[str(r["mp"]), str(r["gpus"]), *(_billions(r[k], r["mp"]) for k in keys)]
                                       for r in rows]


def c_config_max_models(gpus: int = 400, mp: int = 16, micro_batch: int = 8, device_gb: float = V100_GB,
                        seq: int = 1024, bucket_size: int = 500_000_000) -> dict[str, dict]:
    """Largest GPT per configuration C1–C5 (plus the no-ZeRO baseline) on ``gpus`` V100s at MP ``mp``.

    The paper (§10.5) does not state the batch or sequence of its C1–C5 runs; ``micro_batch``
    (per DP rank) and ``seq`` are assumptions and are printed with the result.
    """
    base = Setup(get_preset("zero-100b", seq_length=seq), tp=mp, dp=gpus // mp, micro_batch=micro_batch,
                 bucket_size=bucket_size, grad_bytes=2)  # the paper's fp16 gradients (2 + 2 + K)
    setups = {"baseline": dataclasses.replace(base, stage=0)}
    setups.update({name: base.with_config(name) for name in C_CONFIGS})
    out = {}
    for name, setup in setups.items():
        best = max_model(setup, device_gb * GB)
        if best["layers"]:
            m = dataclasses.replace(setup.model, num_layers=best["layers"], hidden_size=best["hidden"],
                                    num_heads=best["heads"])
            best["breakdown"] = estimate(dataclasses.replace(setup, model=m))
        out[name] = best
    return out
