"""The random streams of tensor and sequence parallelism (Megatron-LM Appendix B.2).

Dropout *outside* a TP region acts on activations that every TP rank holds in full (the
residual stream after g, the embedding output); the ranks must drop the same elements or their
copies diverge. That stream is torch's default generator, seeded identically on every rank of a
TP group. Dropout *inside* a TP region (attention probabilities, whose heads are split over the
ranks) must differ per rank, or every rank's heads would share one mask; that stream is a
second, per-rank generator state which ``fork()`` swaps in for the duration of a block of code.

With sequence parallelism (Korthikanti et al. 2022, arXiv 2205.05198) the residual stream and
the embedding output are split along the sequence, so each rank's dropout there acts on
different tokens and must draw its own mask: a third, per-rank stream, ``fork("sp")``. Megatron
draws these masks from its TP-region stream; a separate stream keeps the attention-probability
masks the very bits a TP run without sequence parallelism draws (the ``"tp"`` stream is advanced
by exactly the same draws), so the two layouts can be compared mask for mask where they agree.

Seeds follow Megatron-LM (``_set_random_seed`` / ``model_parallel_cuda_manual_seed``):
shared = seed + 100 * pp_rank (stages do not reuse a stream), TP-region = shared + 2718 +
tp_rank; the sequence-parallel region = TP-region + 2**20 (no collision below a million stages
or TP ranks). ``get_states()`` / ``set_states()`` snapshot every stream (CPU, and CUDA when it is
initialised) so activation recompute (ZeRO-R Pa, Megatron's checkpointing, selective recompute)
replays exactly the same masks, and checkpoints can resume the streams.

This module is the one home of the run's RNG snapshots: recompute takes and puts back its own
(``capture_rng`` / ``restore_rng``: ``activation/checkpoint.py``, ``activation/selective.py``), a
checkpoint keeps its own (``checkpoint_states``) and a resume puts them back or, when the layout
changed, reseeds (``resume_streams``); no other module reads or sets a generator's state.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from zerotron.parallel import host_sync

TP_SEED_OFFSET = 2718
PP_SEED_STRIDE = 100
SP_SEED_OFFSET = 1 << 20
STREAMS = ("tp", "sp")  # the per-rank streams ``fork`` swaps in; "shared" is torch's default generator


def _cuda_ready() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()


class TPRNG:
    """Tracks the per-rank streams (TP region, sequence-parallel region); the default torch
    generator is the TP-shared stream."""

    def __init__(self) -> None:
        self._cpu: dict[str, torch.Tensor] = {}
        self._cuda: dict[str, torch.Tensor | None] = {}
        self._seeds: dict[str, int] = {}
        self.shared_seed: int | None = None

    # seeding -----------------------------------------------------------------------------------
    def seed(self, seed: int, grid) -> None:
        """Seed every stream for this rank: shared on the default generator, per-rank for ``fork()``."""
        if not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed={seed!r}: must be a non-negative integer")
        self.shared_seed = seed + PP_SEED_STRIDE * grid.pp_rank
        tp_seed = self.shared_seed + TP_SEED_OFFSET + grid.tp_rank
        self._seeds = {"tp": tp_seed, "sp": tp_seed + SP_SEED_OFFSET}
        torch.manual_seed(self.shared_seed)  # seeds CPU and every CUDA device
        self._cpu = {k: torch.Generator().manual_seed(v).get_state() for k, v in self._seeds.items()}
        self._cuda = {k: (self._fresh_cuda_state(v) if _cuda_ready() else None) for k, v in self._seeds.items()}

    @staticmethod
    def _fresh_cuda_state(seed: int) -> torch.Tensor:
        saved = torch.cuda.get_rng_state()
        torch.cuda.manual_seed(seed)
        state = torch.cuda.get_rng_state()
        torch.cuda.set_rng_state(saved)
        return state

    def _require_seeded(self) -> None:
        if not self._cpu:
            raise RuntimeError("TPRNG used before seed(seed, grid); call model.rng.seed(...) first")

    def _cuda_state(self, stream: str) -> torch.Tensor:
        if self._cuda.get(stream) is None:  # CUDA came up after seed(): derive its stream now
            self._cuda[stream] = self._fresh_cuda_state(self._seeds[stream])
        return self._cuda[stream]

    # the per-rank streams ----------------------------------------------------------------------
    @contextlib.contextmanager
    def fork(self, stream: str = "tp") -> Iterator[None]:
        """Run the body on a per-rank stream (``"tp"``: TP region, ``"sp"``: sequence-parallel
        region), then restore the shared stream.

        Both the CPU and (if initialised) the current CUDA default generators are swapped, so
        dropout on either device draws from the per-rank stream, and the shared stream resumes
        exactly where it stopped -- it is not advanced by anything drawn inside.
        """
        self._require_seeded()
        if stream not in STREAMS:
            raise ValueError(f"TPRNG.fork({stream!r}): use one of {STREAMS}")
        if host_sync.simulated():  # a dry run draws nothing: fake tensors hold no values
            yield
            return
        cuda = _cuda_ready()
        shared_cpu = torch.get_rng_state()
        shared_cuda = torch.cuda.get_rng_state() if cuda else None
        torch.set_rng_state(self._cpu[stream])
        if cuda:
            torch.cuda.set_rng_state(self._cuda_state(stream))
        try:
            yield
        finally:
            self._cpu[stream] = torch.get_rng_state()
            torch.set_rng_state(shared_cpu)
            if cuda:
                self._cuda[stream] = torch.cuda.get_rng_state()
                torch.cuda.set_rng_state(shared_cuda)

    # snapshots ---------------------------------------------------------------------------------
    def get_states(self) -> dict[str, torch.Tensor]:
        """Copies of every stream: ``shared_cpu``, ``tp_cpu``, ``sp_cpu`` and, with CUDA,
        ``shared_cuda``, ``tp_cuda``, ``sp_cuda``."""
        self._require_seeded()
        if host_sync.simulated():
            return {}
        states = {"shared_cpu": torch.get_rng_state()}
        states.update({f"{k}_cpu": v.clone() for k, v in self._cpu.items()})
        if _cuda_ready():
            states["shared_cuda"] = torch.cuda.get_rng_state()
            states.update({f"{k}_cuda": self._cuda_state(k).clone() for k in STREAMS})
        return states

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        """Restore streams captured by ``get_states()`` (keys it lacks are left as they are: a
        checkpoint written before the ``sp`` stream existed resumes the others)."""
        known = {f"{k}_{d}" for k in ("shared", *STREAMS) for d in ("cpu", "cuda")}
        unknown = set(states) - known
        if unknown:
            raise ValueError(f"set_states: unknown RNG state keys {sorted(unknown)}")
        if "shared_cpu" in states:
            torch.set_rng_state(states["shared_cpu"])
        if "shared_cuda" in states and _cuda_ready():
            torch.cuda.set_rng_state(states["shared_cuda"])
        for k in STREAMS:
            if f"{k}_cpu" in states:
                self._cpu[k] = states[f"{k}_cpu"].clone()
            if f"{k}_cuda" in states:
                self._cuda[k] = states[f"{k}_cuda"].clone()


# The run's snapshots: every random stream in one home -----------------------------------------
def capture_rng(rng: TPRNG | None) -> dict:
    """Every stream dropout can draw from, for a recompute to replay: ``TPRNG``'s (default CPU/CUDA +
    TP-region + SP-region) when it is seeded, else torch's default generators."""
    if rng is not None and rng.shared_seed is not None:
        return {"tprng": rng.get_states()}
    states = {"cpu": torch.get_rng_state()}
    if _cuda_ready():
        states["cuda"] = torch.cuda.get_rng_state()
    return states


def restore_rng(rng: TPRNG | None, states: dict) -> None:
    """Put back what ``capture_rng`` took."""
    if "tprng" in states:
        rng.set_states(states["tprng"])
        return
    torch.set_rng_state(states["cpu"])
    if "cuda" in states:
        torch.cuda.set_rng_state(states["cuda"])


def checkpoint_states(rng: TPRNG, device: torch.device) -> dict[str, torch.Tensor]:
    """What a checkpoint keeps of the random streams (flat names, as safetensors stores them):
    torch's default generators of this process and the model's ``TPRNG`` streams under ``model/``."""
    states = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        states["torch_cuda"] = torch.cuda.get_rng_state(device)
    for k, v in rng.get_states().items():
        states[f"model/{k}"] = v
    return states


def restore_checkpoint_states(rng: TPRNG, states: dict, device: torch.device) -> None:
    """Put back what ``checkpoint_states`` took (``states`` is consumed)."""
    torch.set_rng_state(states.pop("torch_cpu"))
    if "torch_cuda" in states:
        torch.cuda.set_rng_state(states.pop("torch_cuda"), device)
    rng.set_states({k[len("model/"):]: v for k, v in states.items() if k.startswith("model/")})


def resume_streams(rng: TPRNG, states: dict | None, seed: int, grid, device: torch.device) -> None:
    """Put the streams where a resumed run continues: the checkpoint's own (``checkpoint_states``)
    when it was written with this layout, else (``states`` is None) freshly seeded from ``seed``,
    since another layout's per-rank streams cannot carry over (the caller passes the run's seed plus
    the step, so a resume point does not replay the first step's masks)."""
    if states is None:
        rng.seed(seed, grid)
        return
    restore_checkpoint_states(rng, states, device)
