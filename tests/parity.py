"""The three tiers of parity every layout test uses, so no tolerance is tuned on one machine.

1. **bitwise** -- where zerotron does the same arithmetic as the reference (one rank, same
   micro-batching, same kernels): ``torch.equal``. Nothing to tune.
2. **float64** -- the same run in float64 against a float64 reference. Round-off is ~1e-16
   relative, so a reordered sum moves the result by far less than ``FP64_ZERO`` / ``FP64_TP_PP``
   while any real bug (a missed micro-batch, a wrong shard, a double-counted norm) moves it by
   many orders of magnitude more.
3. **fp32, relative to torch** -- an fp32 run is judged against the float64 truth by torch's own
   fp32 error on the same problem: ``err(zerotron) <= 2 * err(torch fp32) + 1e-7``. The bound
   follows the machine's kernels (AVX2, AVX-512, a GPU), not a constant picked on one CPU.
"""

from __future__ import annotations

import torch

FP64_ZERO = 1e-9  # ZeRO stages: the same sums over DP, partitioned differently
FP64_TP_PP = 1e-8  # tensor / pipeline parallel: matmul and reduction order change with the split
FP32_FACTOR, FP32_FLOOR = 2.0, 1e-7


def max_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest absolute difference, computed in float64."""
    return (got.detach().double() - want.detach().double()).abs().max().item()


def assert_bitwise(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, f"{what}: {got.dtype}{tuple(got.shape)} " \
                                                               f"vs {want.dtype}{tuple(want.shape)}"
    assert torch.equal(got, want), f"{what}: not bit-identical (max diff {max_err(got, want):.3g})"


def assert_fp64(got: torch.Tensor, want: torch.Tensor, atol: float, what: str) -> None:
    assert got.dtype == torch.float64 and want.dtype == torch.float64, f"{what}: not a float64 comparison " \
                                                                       f"({got.dtype}, {want.dtype})"
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} vs {tuple(want.shape)}"
    err = max_err(got, want)
    assert err <= atol, f"{what}: float64 error {err:.3g} > {atol:g}"


def fp32_bound(torch_fp32: torch.Tensor, truth: torch.Tensor) -> float:
    """The error zerotron's fp32 result may have: twice torch's own fp32 error, plus a floor."""
    return FP32_FACTOR * max_err(torch_fp32, truth) + FP32_FLOOR


def assert_fp32(got: torch.Tensor, truth: torch.Tensor, torch_fp32: torch.Tensor, what: str) -> None:
    assert got.dtype == torch.float32 and torch_fp32.dtype == torch.float32, f"{what}: not fp32"
    assert truth.dtype == torch.float64, f"{what}: the truth must be float64"
    err, bound = max_err(got, truth), fp32_bound(torch_fp32, truth)
    assert err <= bound, (f"{what}: fp32 error vs float64 truth {err:.3g} > {bound:.3g} "
                          f"(= {FP32_FACTOR:g} x torch's own fp32 error + {FP32_FLOOR:g})")
