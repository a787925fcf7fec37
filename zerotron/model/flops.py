"""Model FLOPs per iteration and the peak a device could reach, for TFLOP/s, MFU and HFU.

Counted GEMM by GEMM (B batch, s sequence, l layers, h hidden, f = ``ffn_size``, V the padded
vocabulary; a GEMM of m×k by k×n costs 2·m·k·n). One layer's forward over T = B·s tokens:

* QKV 2·T·h·3h, attention output 2·T·h·h, fc1 2·T·h·f, fc2 2·T·f·h  → T·(8h² + 4hf);
* scores QKᵀ and probabilities × V, 2·T·s·h each                    → 4·T·s·h;

the logit GEMM 2·T·h·V. The Llama family's layer (``GPTConfig``'s architecture fields): QKV
2·T·h·(h + 2·kv) with kv = query_groups·head_dim (grouped-query attention's smaller K and V),
SwiGLU's gate and up GEMM 2·T·h·2f; the scores are unchanged (every query head attends), an
untied output layer costs what the tied one does. Backward costs twice the forward. So, with
f = 4h as in GPT-2, the **model FLOPs** (no recompute; Korthikanti et al. 2022, App. A)

    F = 3·l·T·(8h² + 4hf + 4sh) + 6·T·h·V = 72·B·s·l·h²·(1 + s/(6h) + V/(12·l·h)),

and **full recompute** runs each layer's forward once more (the logits are never recomputed):

    F_hw = 4·l·T·(8h² + 4hf + 4sh) + 6·T·h·V = 96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h))   ([N21] Eq. 3).

**Selective recompute** (Korthikanti et al. 2022 §5) runs each layer's attention core -- its two
4·T·s·h GEMMs -- once more in backward, on its own or inside full recompute's chunks, so it
adds l·4·T·s·h to what the device does (not to the model FLOPs).

MFU divides the model FLOPs by the time and the peak, HFU the FLOPs the device really did
(recompute included, what [N21] and ZeRO report as TFLOPs): checkpointing raises HFU and
leaves MFU alone, so only MFU compares runs. A pipeline stage counts its own layers and, on the
last stage, the logits (``layers``, ``logits``).
"""

from __future__ import annotations

import torch

from zerotron.model.config import GPTConfig

# Dense (no 2:4 sparsity) peak TFLOP/s per device from the vendor datasheets, SXM parts unless
# named: tensor-core fp16/bf16, and fp32 without TF32 (the honest peak for a strict fp32 run; torch
# leaves TF32 off for matmuls). Looked up by the longest key contained in the device name, so
# "NVIDIA H100 PCIe" is not read as an SXM H100 and "NVIDIA GB200" not as a B200.
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "V100": {"float16": 125.0, "bfloat16": 0.0, "float32": 15.7},  # no bf16 on Volta
    "A100": {"float16": 312.0, "bfloat16": 312.0, "float32": 19.5},
    "H100": {"float16": 989.0, "bfloat16": 989.0, "float32": 67.0},
    "H100 PCIe": {"float16": 756.0, "bfloat16": 756.0, "float32": 51.0},
    "H200": {"float16": 989.0, "bfloat16": 989.0, "float32": 67.0},
    "B200": {"float16": 2250.0, "bfloat16": 2250.0, "float32": 75.0},  # HGX B200, 1000 W
    "GB200": {"float16": 2500.0, "bfloat16": 2500.0, "float32": 80.0},
}


def layer_forward_flops(cfg: GPTConfig, tokens: int, seq: int) -> int:
    """GEMM FLOPs of one transformer layer's forward over ``tokens`` tokens of sequences ``seq`` long."""
    h, f, kv = cfg.hidden_size, cfg.ffn_size, cfg.kv_size
    up = 2 * f if cfg.gated else f  # SwiGLU: gate and up rows in one GEMM
    return tokens * (2 * h * (h + 2 * kv) + 2 * h * h + 2 * h * up + 2 * f * h + 4 * seq * h)


def flops_per_iteration(cfg: GPTConfig, batch: int, seq: int | None = None, recompute: bool = False,
                        tp: int = 1, layers: int | None = None, logits: bool = True,
                        selective: bool = False) -> float:
    """FLOPs of one forward+backward over ``batch`` sequences (global batch → global FLOPs).

    ``recompute=True`` counts the extra forward of full activation recompute, ``selective=True``
    the extra attention core of selective recompute (both may hold). V is the padded
    vocabulary at ``tp`` (the logit GEMM really computes the padding). ``layers`` (default all)
    and ``logits`` select what one pipeline stage computes."""
    s = cfg.seq_length if seq is None else seq
    n_layers = cfg.num_layers if layers is None else layers
    tokens = batch * s
    passes = 4 if recompute else 3
    head = 6 * tokens * cfg.hidden_size * cfg.padded_vocab_size(tp) if logits else 0
    core = n_layers * 4 * tokens * s * cfg.hidden_size if selective else 0
    return float(passes * n_layers * layer_forward_flops(cfg, tokens, s) + head + core)


def _dtype_name(dtype) -> str:
    if isinstance(dtype, torch.dtype):
        return str(dtype).removeprefix("torch.")
    return {"fp16": "float16", "half": "float16", "bf16": "bfloat16", "fp32": "float32"}.get(dtype, dtype)


def peak_tflops(device_name: str, dtype=torch.bfloat16, override: float | None = None) -> float | None:
    """Peak TFLOP/s of one device, or None when unknown (CPUs, unlisted GPUs or dtypes).

    ``override`` (or env ``ZEROTRON_PEAK_TFLOPS``) wins, for CPUs or parts not in the table.
    ``device_name`` is matched by substring, e.g. ``torch.cuda.get_device_name()`` =
    "NVIDIA H200" or "Tesla V100-SXM2-32GB".
    """
    if override is None:  # the one read of the variable (start-up's check calls here)
        from zerotron.parallel.runtime import positive_env

        override = positive_env("ZEROTRON_PEAK_TFLOPS", "the device's peak TFLOP/s, for MFU")
    if override is not None:
        if override <= 0:
            raise ValueError(f"peak TFLOP/s override={override}: must be > 0")
        return float(override)
    keys = [k for k in PEAK_TFLOPS if k.lower() in device_name.lower()]
    if not keys:
        return None
    peak = PEAK_TFLOPS[max(keys, key=len)].get(_dtype_name(dtype))
    return peak if peak else None


def device_peak_tflops(device: torch.device, dtype, override: float | None = None) -> float | None:
    """``peak_tflops`` of the CUDA device ``device`` by its name; a CPU has no entry (override only)."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    return peak_tflops(name, dtype, override)


def throughput(cfg: GPTConfig, batch: int, iteration_s: float, num_devices: int, seq: int | None = None,
               recompute: bool = False, peak: float | None = None, tp: int = 1) -> dict[str, float | None]:
    """TFLOP/s per device, MFU and HFU (None when the peak is unknown) for one timed iteration.

    ``tflops_per_device`` counts the recompute pass when ``recompute`` (hardware FLOPs, as the
    papers report) and so does ``hfu``; ``mfu`` always uses the no-recompute model FLOPs.
    """
    if iteration_s <= 0 or num_devices < 1:
        raise ValueError(f"throughput: iteration_s={iteration_s} and num_devices={num_devices} must be positive")
    done = flops_per_iteration(cfg, batch, seq, recompute, tp) / iteration_s / num_devices / 1e12
    model = flops_per_iteration(cfg, batch, seq, False, tp) / iteration_s / num_devices / 1e12
    return {"tflops_per_device": done, "mfu": (model / peak) if peak else None,
            "hfu": (done / peak) if peak else None}
