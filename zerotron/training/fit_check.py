"""The start-up fit check: the memory model's per-rank prediction against what the rank has.

Why: a model that cannot fit used to start anyway -- hidden 16384 x 48 layers failed after
107 s with a 309 GB allocation traceback; a 1.2B model in a 6 GiB container had both ranks
OOM-killed without a word -- while the banner printed a prediction nobody compared with the
machine. Here, before ``init_process_group``, every rank compares the prediction
(``estimate/memory_model.py``, ZeRO §5-§6 model states plus activations, working memory and
buffers) *before* its fragmentation margin -- the least the run will hold, so only a run that
certainly cannot fit is refused -- with ``parallel.runtime.memory_available``: the GPU's free
memory, or the host's available memory (a cgroup limit included) shared by the node's ranks.

The refusal names the prediction, what is available and the nearest fix the model says would
fit (a higher ZeRO stage, activation checkpointing, twice the ranks);
``training.skip_memory_check=true`` starts anyway, for users who know better. Setups outside
the model (pipeline, ZeRO-Offload/Infinity) are not checked.
"""

from __future__ import annotations

import dataclasses
import os

from zerotron.config.run_config import ConfigError


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**28 else f"{n / 2**20:.1f} MiB"


def predicted_bytes(cfg, mcfg, world_size: int, device_type: str, backend: str) -> float | None:
    """Per-rank bytes before the fragmentation margin, or None where the model does not apply."""
    from zerotron.estimate import memory_model

    try:
        setup = memory_model.fullest_stage_setup(cfg, mcfg, world_size, backend=backend,
                                                   device=device_type)
        return memory_model.estimate(setup)["before_margin"]
    except (ValueError, ArithmeticError, TypeError):  # a setup outside the model: not checked
        return None


def _nearest_fix(cfg, mcfg, world_size: int, device_type: str, backend: str, room: int) -> str:
    """The first change the memory model says fits in ``room``, in order of least disruption."""
    z, ac = cfg.zero, cfg.activation_checkpointing
    tries = []
    for stage in range(z.stage + 1, 4):
        tries.append((f"zero.stage={stage}", dataclasses.replace(cfg, zero=dataclasses.replace(
            z, stage=stage)), world_size))
    if not ac.checkpoint_activations:
        tries.append(("activation_checkpointing.checkpoint_activations=true", dataclasses.replace(
            cfg, activation_checkpointing=dataclasses.replace(ac, checkpoint_activations=True)),
            world_size))
    tries.append((f"{2 * world_size} ranks (twice the data-parallel size)", cfg, 2 * world_size))
    for what, changed, ranks in tries:
        need = predicted_bytes(changed, mcfg, ranks, device_type, backend)
        if need is not None and need <= room:
            return f"{what} (predicted {_gib(need)} per rank)"
    return "a smaller model, more ranks or a device with more memory"


def check_fit(cfg, mcfg, world_size: int) -> None:
    """Raise ``ConfigError`` (exit 2, before any process group) if this rank cannot hold the run."""
    from zerotron.parallel.runtime import memory_available, pick_backend, pick_device

    if cfg.training.skip_memory_check:
        return
    try:
        device = pick_device(int(os.environ.get("LOCAL_RANK", 0)))
        backend = pick_backend(device)
    except (ValueError, RuntimeError) as e:
        raise ConfigError(str(e)) from None
    need = predicted_bytes(cfg, mcfg, world_size, device.type, backend)
    if need is None:
        return
    local = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    room, where = memory_available(device, local)
    if not where or need <= room:
        return
    fix = _nearest_fix(cfg, mcfg, world_size, device.type, backend, room)
    raise ConfigError(
        f"the run cannot fit: the memory model predicts at least {_gib(need)} per rank "
        f"(estimate/memory_model.py, before its fragmentation margin) but {_gib(room)} is "
        f"available ({where}); nearest fix: {fix}; or pass --training.skip_memory_check true "
        f"to start anyway")
