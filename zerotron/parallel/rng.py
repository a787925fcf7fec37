"""Two random streams for tensor parallelism (Megatron-LM Appendix B.2).

Dropout *outside* a TP region acts on activations that every TP rank holds in full (the
residual stream after g, the embedding output); the ranks must drop the same elements or their
copies diverge. That stream is torch's default generator, seeded identically on every rank of a
TP group. Dropout *inside* a TP region (attention probabilities, whose heads are split over the
ranks) must differ per rank, or every rank's heads would share one mask; that stream is a
second, per-rank generator state which ``fork()`` swaps in for the duration of a block of code.

Seeds follow Megatron-LM (``_set_random_seed`` / ``model_parallel_cuda_manual_seed``):
shared = seed + 100 * pp_rank (stages do not reuse a stream), TP-region = shared + 2718 +
tp_rank. ``get_states()`` / ``set_states()`` snapshot both streams (CPU, and CUDA when it is
initialised) so activation recompute (ZeRO-R Pa, Megatron's checkpointing) replays exactly the
same masks, and checkpoints can resume the streams.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from zerotron.parallel import host_sync

TP_SEED_OFFSET = 2718
PP_SEED_STRIDE = 100


def _cuda_ready() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()


class TPRNG:
    """Tracks the per-rank TP-region stream; the default torch generator is the TP-shared stream."""

    def __init__(self) -> None:
        self._tp_cpu: torch.Tensor | None = None
        self._tp_cuda: torch.Tensor | None = None
        self._tp_seed: int | None = None
        self.shared_seed: int | None = None

    # seeding -----------------------------------------------------------------------------------
    def seed(self, seed: int, grid) -> None:
        """Seed both streams for this rank: shared on the default generator, per-rank for ``fork()``."""
        if not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed={seed!r}: must be a non-negative integer")
        self.shared_seed = seed + PP_SEED_STRIDE * grid.pp_rank
        self._tp_seed = self.shared_seed + TP_SEED_OFFSET + grid.tp_rank
        torch.manual_seed(self.shared_seed)  # seeds CPU and every CUDA device
        g = torch.Generator().manual_seed(self._tp_seed)
        self._tp_cpu = g.get_state()
        self._tp_cuda = None
        if _cuda_ready():
            self._tp_cuda = self._fresh_cuda_state(self._tp_seed)

    @staticmethod
    def _fresh_cuda_state(seed: int) -> torch.Tensor:
        saved = torch.cuda.get_rng_state()
        torch.cuda.manual_seed(seed)
        state = torch.cuda.get_rng_state()
        torch.cuda.set_rng_state(saved)
        return state

    def _require_seeded(self) -> None:
        if self._tp_cpu is None:
            raise RuntimeError("TPRNG used before seed(seed, grid); call model.rng.seed(...) first")

    # the TP-region stream ----------------------------------------------------------------------
    @contextlib.contextmanager
    def fork(self) -> Iterator[None]:
        """Run the body on the per-rank TP-region stream, then restore the shared stream.

        Both the CPU and (if initialised) the current CUDA default generators are swapped, so
        dropout on either device draws from the per-rank stream, and the shared stream resumes
        exactly where it stopped -- it is not advanced by anything drawn inside.
        """
        self._require_seeded()
        if host_sync.simulated():  # a dry run draws nothing: fake tensors hold no values
            yield
            return
        cuda = _cuda_ready()
        if cuda and self._tp_cuda is None:  # CUDA came up after seed(): derive its stream now
            self._tp_cuda = self._fresh_cuda_state(self._tp_seed)
        shared_cpu = torch.get_rng_state()
        shared_cuda = torch.cuda.get_rng_state() if cuda else None
        torch.set_rng_state(self._tp_cpu)
        if cuda:
            torch.cuda.set_rng_state(self._tp_cuda)
        try:
            yield
        finally:
            self._tp_cpu = torch.get_rng_state()
            torch.set_rng_state(shared_cpu)
            if cuda:
                self._tp_cuda = torch.cuda.get_rng_state()
                torch.cuda.set_rng_state(shared_cuda)

    # snapshots ---------------------------------------------------------------------------------
    def get_states(self) -> dict[str, torch.Tensor]:
        """Copies of every stream: ``shared_cpu``, ``tp_cpu`` and, with CUDA, ``shared_cuda``, ``tp_cuda``."""
        self._require_seeded()
        if host_sync.simulated():
            return {}
        states = {"shared_cpu": torch.get_rng_state(), "tp_cpu": self._tp_cpu.clone()}
        if _cuda_ready():
            if self._tp_cuda is None:
                self._tp_cuda = self._fresh_cuda_state(self._tp_seed)
            states["shared_cuda"] = torch.cuda.get_rng_state()
            states["tp_cuda"] = self._tp_cuda.clone()
        return states

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        """Restore streams captured by ``get_states()`` (keys it lacks are left as they are)."""
        unknown = set(states) - {"shared_cpu", "tp_cpu", "shared_cuda", "tp_cuda"}
        if unknown:
            raise ValueError(f"set_states: unknown RNG state keys {sorted(unknown)}")
        if "shared_cpu" in states:
            torch.set_rng_state(states["shared_cpu"])
        if "tp_cpu" in states:
            self._tp_cpu = states["tp_cpu"].clone()
        if "shared_cuda" in states and _cuda_ready():
            torch.cuda.set_rng_state(states["shared_cuda"])
        if "tp_cuda" in states:
            self._tp_cuda = states["tp_cuda"].clone()
