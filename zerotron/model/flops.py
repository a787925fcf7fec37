"""Model FLOPs per iteration and the peak a device could reach, for TFLOP/s and MFU reporting.

Formulas from Narayanan et al. 2021 (arXiv 2104.04473, §5.1 and Appendix; B batch, s sequence,
l layers, h hidden, V vocab):

* a layer's forward costs 24·B·s·h² + 4·B·s²·h; backward twice that; the logit GEMM 2·B·s·h·V
  forward (6·B·s·h·V with backward, never recomputed);
* **full recompute** adds one more forward per layer:
  F = 96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h))   ([N21] Eq. 3)
* **no recompute** (model FLOPs, Korthikanti et al. 2022 App. A):
  F = 72·B·s·l·h²·(1 + s/(6h) + V/(12·l·h)).

Counting the recompute pass gives the hardware FLOPs the GPU actually did ([N21]'s and ZeRO's
reported TFLOPs); MFU conventionally uses the no-recompute count.
"""

from __future__ import annotations

import os

import torch

from zerotron.model.config import GPTConfig

# Dense peak TFLOP/s per device (vendor datasheets; SXM parts): tensor-core fp16/bf16, and fp32
# without TF32 (the honest peak for a strict fp32 run).
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "V100": {"float16": 125.0, "bfloat16": 0.0, "float32": 15.7},  # no bf16 on Volta
    "A100": {"float16": 312.0, "bfloat16": 312.0, "float32": 19.5},
    "H100": {"float16": 989.0, "bfloat16": 989.0, "float32": 67.0},
    "H200": {"float16": 989.0, "bfloat16": 989.0, "float32": 67.0},
}


def flops_per_iteration(cfg: GPTConfig, batch: int, seq: int | None = None, recompute: bool = False,
                        tp: int = 1) -> float:
    """Model FLOPs of one forward+backward over ``batch`` sequences (global batch → global FLOPs).

    ``recompute=True`` counts the extra forward of full activation recompute. V is the padded
    vocabulary at ``tp`` (the logit GEMM really computes the padding).
    """
    s = cfg.seq_length if seq is None else seq
    l, h, v = cfg.num_layers, cfg.hidden_size, cfg.padded_vocab_size(tp)
    if recompute:
        return 96.0 * batch * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h))
    return 72.0 * batch * s * l * h * h * (1 + s / (6 * h) + v / (12 * l * h))


def _dtype_name(dtype) -> str:
    if isinstance(dtype, torch.dtype):
        return str(dtype).removeprefix("torch.")
    return {"fp16": "float16", "half": "float16", "bf16": "bfloat16", "fp32": "float32"}.get(dtype, dtype)


def peak_tflops(device_name: str, dtype=torch.bfloat16, override: float | None = None) -> float | None:
    """Peak TFLOP/s of one device, or None when unknown (CPUs, unlisted GPUs).

    ``override`` (or env ``ZEROTRON_PEAK_TFLOPS``) wins, for CPUs or parts not in the table.
    ``device_name`` is matched by substring, e.g. ``torch.cuda.get_device_name()`` =
    "NVIDIA H200" or "Tesla V100-SXM2-32GB".
    """
    if override is None and os.environ.get("ZEROTRON_PEAK_TFLOPS"):
        override = float(os.environ["ZEROTRON_PEAK_TFLOPS"])
    if override is not None:
        if override <= 0:
            raise ValueError(f"peak TFLOP/s override={override}: must be > 0")
        return float(override)
    name = _dtype_name(dtype)
    for key, table in PEAK_TFLOPS.items():
        if key.lower() in device_name.lower():
            peak = table.get(name)
            return peak if peak else None
    return None


def throughput(cfg: GPTConfig, batch: int, iteration_s: float, num_devices: int, seq: int | None = None,
               recompute: bool = False, peak: float | None = None, tp: int = 1) -> dict[str, float | None]:
    """TFLOP/s per device and MFU (None when the peak is unknown) for one timed iteration.

    ``tflops_per_device`` counts the recompute pass when ``recompute`` (hardware FLOPs, as the
    papers report); ``mfu`` always uses the no-recompute model FLOPs.
    """
    if iteration_s <= 0 or num_devices < 1:
        raise ValueError(f"throughput: iteration_s={iteration_s} and num_devices={num_devices} must be positive")
    done = flops_per_iteration(cfg, batch, seq, recompute, tp) / iteration_s / num_devices / 1e12
    model = flops_per_iteration(cfg, batch, seq, False, tp) / iteration_s / num_devices / 1e12
    return {"tflops_per_device": done, "mfu": (model / peak) if peak else None}
