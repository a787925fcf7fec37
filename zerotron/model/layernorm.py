"""The normalisations: LayerNorm (GPT-2), with apex's fused kernel on CUDA tensors when apex is
importable, and RMSNorm (the Llama family: Zhang & Sennrich 2019, no mean, no bias).

The kernel is chosen per call from the input's device, not when the module is built: the model
is built on the meta device (parameters get their storage from the ZeRO optimizer later), so a
choice made at construction would never see CUDA. The parameters are ``nn.LayerNorm``'s own
(``weight``, ``bias``), so checkpoints and the Hugging Face export do not depend on apex.
"""

from __future__ import annotations

import torch
from torch import nn

from zerotron.parallel.shard_info import ShardInfo, set_shard_info

try:  # NVIDIA apex's fused kernel, only when it is importable (never pip-installed: see DEVELOPERS.md)
    from apex.normalization.fused_layer_norm import fused_layer_norm_affine as _apex_layer_norm
except Exception:  # noqa: BLE001 - any import failure means "not available"
    _apex_layer_norm = None


class LayerNorm(nn.LayerNorm):
    """``nn.LayerNorm`` with apex's fused forward/backward for CUDA inputs."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _apex_layer_norm is not None and x.is_cuda and self.elementwise_affine:
            return _apex_layer_norm(x, self.weight, self.bias, self.normalized_shape, self.eps)
        return super().forward(x)


class RMSNorm(nn.Module):
    """x / sqrt(mean(x²) + eps) · weight over the last dimension.

    16-bit inputs are normalised in fp32 and rounded back before the weight (as Llama's reference
    code); fp32 and float64 inputs at their own precision, so a float64 run stays float64.
    """

    def __init__(self, hidden: int, eps: float, dtype=None, device=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        wide = x.float() if x.element_size() < 4 else x  # bf16/fp16: statistics in fp32
        normed = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


def make_norm(kind: str, hidden: int, eps: float, dtype, device) -> nn.Module:
    """``model.normalization``'s module (LayerNorm or RMSNorm), its parameters TP-replicated."""
    if kind == "RMSNorm":
        norm = RMSNorm(hidden, eps, dtype, device)
    else:
        norm = LayerNorm(hidden, eps=eps, dtype=dtype, device=device)
    for p in norm.parameters():
        set_shard_info(p, ShardInfo(None, tuple(p.shape)))
    return norm
