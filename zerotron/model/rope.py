"""Rotary position embeddings (Su et al. 2021, RoFormer) with Llama-3.1's frequency scaling.

Each head's dimension i < d/2 is paired with dimension i + d/2 (the "rotate half" convention of
Hugging Face's Llama, so its q/k weights load as they are) and the pair is rotated by the angle
position · inv_freq[i]. The frequencies and the cos/sin tables are computed in fp32 whatever the
model's precision, then rounded to it, as Llama's reference code and Megatron do: the tables are
then the same numbers in every precision and every layout.

Positions are those of the whole sequence (a TP rank rotates its own heads, a sequence-parallel
rank sees the gathered sequence inside attention, a pipeline stage the whole micro-batch), or,
with document masking, each token's position inside its document (``positions``).
"""

from __future__ import annotations

import math

import torch

from zerotron.model.config import GPTConfig


def inverse_frequencies(cfg: GPTConfig, device=None) -> torch.Tensor:
    """inv_freq[i] = base^(-2i/d) for i < d/2, in fp32; with ``rope_scaling`` Llama-3.1's rule:
    wavelengths above original_context/low_freq_factor are stretched by ``factor``, those below
    original_context/high_freq_factor kept, and those between interpolated smoothly."""
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rotary_base ** (torch.arange(0, d, 2, device=device).float() / d))
    if not cfg.rope_scaling:
        return inv_freq
    factor, context = cfg.rope_scaling_factor, cfg.rope_scaling_original_max_position_embeddings
    low, high = cfg.rope_scaling_low_freq_factor, cfg.rope_scaling_high_freq_factor
    wavelength = 2 * math.pi / inv_freq
    stretched = torch.where(wavelength > context / low, inv_freq / factor, inv_freq)
    smooth = (context / wavelength - low) / (high - low)  # 0 at the long end, 1 at the short end
    between = (1 - smooth) * stretched / factor + smooth * stretched
    in_between = (wavelength >= context / high) & (wavelength <= context / low)
    return torch.where(in_between, between, stretched)


def rotary_tables(cfg: GPTConfig, positions: torch.Tensor, dtype,
                  inv_freq: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [..., d] for integer ``positions`` [...] (each angle twice: a pair's halves);
    ``inv_freq``: ``inverse_frequencies(cfg, positions.device)`` made once by the caller."""
    if inv_freq is None:
        inv_freq = inverse_frequencies(cfg, positions.device)
    angles = positions.float().unsqueeze(-1) * inv_freq
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


class FrequencyCache:
    """``inverse_frequencies`` made once per device, not in every attention forward: they depend
    on the configuration alone, and with Llama-3.1's scaling they are ~15 operators per layer and
    micro-batch (a third of the dry run's RoPE time in a 70B step). Keyed by the device and the
    active fake-tensor mode, so a tensor of one mode never meets another."""

    def __init__(self, cfg: GPTConfig):
        self.cfg, self.key, self.value = cfg, None, None

    def __call__(self, device: torch.device) -> torch.Tensor:
        fake = torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE)
        key = (device, id(fake) if fake is not None else None)
        if key != self.key:
            self.key, self.value = key, inverse_frequencies(self.cfg, device)
        return self.value


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x · cos + rotate_half(x) · sin, rotate_half(x1, x2) = (-x2, x1) over a head's halves."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin
