"""Activation checkpointing of transformer layers with ZeRO-R's Pa, Pa+cpu and MD (ZeRO §6.1, §6.3).

A GPT's blocks are run in chunks of ``checkpoint_every`` = k blocks. Each chunk is one
``_CheckpointedChunk`` autograd function: forward runs the chunk without building a graph and
saves only the chunk's *input* (through ``CheckpointStore``: partitioned over TP ranks = Pa,
moved to CPU = Pa+cpu / offload, copied into one pre-allocated buffer = MD); backward restores
the input (all-gathering the Pa slices over the "tp" group), restores the random streams as they
were when the chunk first ran -- the TP-shared default generators (CPU and CUDA) and the per-rank
TP-region stream of ``TPRNG`` -- re-runs the chunk with a graph and back-propagates through it.
The dropout masks are therefore the same bits as in forward, and gradients equal those of a run
without checkpointing exactly, not just approximately.

We do not use ``torch.utils.checkpoint``: it decides itself what is saved and where, whereas Pa,
offload and MD must own the one tensor that is kept (§6.1: "partition the activation
checkpoints", "offload them to CPU"). Per block the cost is one extra forward (33% more
compute, §3.2) and, with Pa, one b·s·h all-gather -- 1/12 of the block's TP all-reduce volume
with recompute (2+2+2 all-reduces of b·s·h at 2Ψ each; §8).

    handle = apply_activation_checkpointing(model, grid, ActivationCheckpointConfig(...))
    ...train...
    handle.memory_report()   # saved bytes on device / host, Pa gather volume, buffers, peaks

``apply_activation_checkpointing`` installs the handle as ``GPT.block_runner`` (the hook
``GPT.run_blocks`` calls); parameters, their names and the model's structure are unchanged, so
ZeRO, checkpoints and pipeline stages see the same model. With ``recompute_granularity:
selective`` it also installs selective recompute of the attention core (``selective.py``).

With sequence parallelism (Korthikanti et al. 2022) a block's input is already this TP rank's
1/t of the sequence, not a replicated tensor: Pa has nothing left to partition there, so the
checkpoint is kept as it is (and offloaded with ``cpu_checkpointing``); that is said once. The
recompute runs inside ``keeping_gathered_inputs`` (``sequence_parallel_gather: keep``): its
column-parallel GEMMs keep the inputs they have just all-gathered for their weight gradients
instead of gathering them a third time.
"""

from __future__ import annotations

import copy
import functools
import warnings

import torch

from zerotron.activation.config import ActivationCheckpointConfig
from zerotron.activation.selective import apply_selective_recompute
from zerotron.activation.store import CheckpointStore
from zerotron.parallel import host_sync
from zerotron.parallel.rng import capture_rng, restore_rng
from zerotron.parallel.sequence_parallel import keeping_gathered_inputs


def _cuda_ready() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def _run_chunk(blocks, x: torch.Tensor) -> torch.Tensor:
    for block in blocks:
        x = block(x)
    return x


def _boundary(device: torch.device) -> None:
    host_sync.synchronize(device)  # synchronize_checkpoint_boundary: a debugging aid, as in DeepSpeed


class _CheckpointedChunk(torch.autograd.Function):
    """Forward without a graph, keep the input via the store; backward = restore, recompute, backprop."""

    @staticmethod
    def forward(ctx, runner, run, x, *extra):
        ctx.runner, ctx.run, ctx.n_extra = runner, run, len(extra)
        ctx.x_requires_grad = x.requires_grad
        ctx.rng_states = capture_rng(runner.rng)
        y = run(x)  # grad mode is off inside forward: no activations are kept
        ctx.saved = runner.store.save(x)
        if runner.cfg.synchronize_checkpoint_boundary:
            _boundary(x.device)
        return y

    @staticmethod
    def backward(ctx, grad):
        runner = ctx.runner
        x = runner.store.load(ctx.saved).detach().requires_grad_(ctx.x_requires_grad)
        now = capture_rng(runner.rng)
        restore_rng(runner.rng, ctx.rng_states)  # same dropout masks as in forward
        try:
            with torch.enable_grad(), keeping_gathered_inputs(runner.cfg.sequence_parallel_gather == "keep"):
                y = ctx.run(x)
        finally:
            restore_rng(runner.rng, now)  # the streams continue as if nothing had been replayed
        if y.requires_grad:  # parameter gradients accumulate (and fire ZeRO's hooks) here
            torch.autograd.backward(y, grad)
        runner.store.release(ctx.saved)
        ctx.saved = ctx.run = None
        if runner.cfg.synchronize_checkpoint_boundary:
            _boundary(grad.device)
        return (None, None, x.grad if ctx.x_requires_grad else None) + (None,) * ctx.n_extra


class ActivationCheckpointing:
    """The handle ``apply_activation_checkpointing`` returns and installs as ``model.block_runner``.

    Called as ``handle(blocks, x)``: without grad (eval, inference) the blocks run plainly, since
    nothing has to be kept; with grad they run in checkpointed chunks of ``checkpoint_every``.
    """

    def __init__(self, grid, cfg: ActivationCheckpointConfig, rng, num_blocks: int, microbatches_in_flight: int = 1,
                 sequence_parallel: bool = False):
        self.grid, self.cfg, self.rng, self.num_blocks = grid, cfg, rng, num_blocks
        self.microbatches_in_flight, self.sequence_parallel = microbatches_in_flight, sequence_parallel
        self.num_chunks = -(-num_blocks // cfg.checkpoint_every)
        self.number_checkpoints = cfg.number_checkpoints or self.num_chunks * microbatches_in_flight
        self.store = CheckpointStore(grid, cfg, self.number_checkpoints, replicated=not sequence_parallel)

    def __call__(self, blocks, x: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled():
            return _run_chunk(blocks, x)
        k = self.cfg.checkpoint_every
        for lo in range(0, len(blocks), k):
            chunk = list(blocks[lo:lo + k])
            extra = ()
            if not x.requires_grad and any(p.requires_grad for b in chunk for p in b.parameters()):
                # the function's output must require grad for backward to reach the parameters
                extra = (torch.empty(0, device=x.device, requires_grad=True),)
            x = _CheckpointedChunk.apply(self, functools.partial(_run_chunk, chunk), x, *extra)
        return x

    # accounting ----------------------------------------------------------------------------------
    def memory_report(self) -> dict:
        """Saved-activation bytes per placement (live and peak), Pa all-gather volume, MD/CB buffers.

        ``peak_device_allocated_bytes`` is torch's CUDA peak of the whole process (None on CPU):
        nothing in zerotron resets it, so it is not this step's or this window's peak.
        """
        out = self.store.report()
        out.update(partition_activations=self.store.partition, cpu_checkpointing=self.cfg.cpu_checkpointing,
                   contiguous_memory_optimization=self.cfg.contiguous_memory_optimization,
                   checkpoint_every=self.cfg.checkpoint_every, checkpoints_per_forward=self.num_chunks)
        out["peak_device_allocated_bytes"] = torch.cuda.max_memory_allocated() if _cuda_ready() else None
        return out

    def step_report(self, steps: int = 1) -> dict:
        """``memory_report()`` over the ``steps`` steps since the last call (the trainer's log
        window), then restart the peaks and gather counters: peaks are the window's, the Pa
        all-gather volume is per step, as the ``comm_bytes`` logged beside it."""
        if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
            raise ValueError(f"step_report(steps={steps!r}): the number of steps since the last report, >= 1")
        out = self.memory_report()
        for key in ("pa_allgather_elements", "pa_allgather_bytes"):
            out[key] //= steps
        self.store.acct.reset_peak()
        return out

    def __deepcopy__(self, memo):
        # A deep-copied model gets its own store and the copy of its RNG; the grid is shared.
        return ActivationCheckpointing(self.grid, self.cfg, copy.deepcopy(self.rng, memo), self.num_blocks,
                                       self.microbatches_in_flight, self.sequence_parallel)


def apply_activation_checkpointing(model, grid, cfg: ActivationCheckpointConfig,
                                   microbatches_in_flight: int = 1) -> ActivationCheckpointing | None:
    """Checkpoint ``model.blocks`` as ``cfg`` says; returns the handle, or None when it is off.
    ``recompute_granularity="selective"`` recomputes every block's attention core as well (alone
    when ``checkpoint_activations`` is off).

    ``model`` is a ``GPT`` (or a pipeline stage of one): anything with ``blocks`` and the
    ``block_runner`` hook. With ``partition_activations`` and tp = 1 there is nothing to
    partition; that is said once, here, and checkpointing runs unpartitioned.
    ``microbatches_in_flight`` (forwards whose backward has not run yet: 1 without a pipeline,
    up to pp - pp_rank for 1F1B, m for AFAB) sizes the MD buffer when ``number_checkpoints`` is unset.
    """
    cfg.validate()
    if not isinstance(microbatches_in_flight, int) or microbatches_in_flight < 1:
        raise ValueError(f"microbatches_in_flight={microbatches_in_flight!r}: must be a positive integer "
                         f"(forwards alive before their backward; 1 without pipelining)")
    if cfg.recompute_granularity == "selective":
        apply_selective_recompute(model)
    if not cfg.checkpoint_activations:
        return None
    if not hasattr(model, "blocks") or not hasattr(model, "block_runner"):
        raise TypeError(f"apply_activation_checkpointing: {type(model).__name__} has no `blocks` / "
                        f"`block_runner` hook; pass a zerotron.model.GPT (or a stage built from one)")
    if model.block_runner is not None:
        raise RuntimeError("apply_activation_checkpointing: the model already has a block_runner; "
                           "apply it once per model")
    if cfg.partition_activations and grid.tp_size == 1:
        warnings.warn("activation_checkpointing.partition_activations=true with tensor parallel size 1: "
                      "there are no MP ranks to partition over (ZeRO §6.1), so Pa is a no-op and whole "
                      "checkpoints are kept", stacklevel=2)
    sp = bool(getattr(model, "sequence_parallel", False))
    if cfg.partition_activations and grid.tp_size > 1 and sp:
        warnings.warn("activation_checkpointing.partition_activations=true with parallel.sequence_parallel=true: "
                      "each checkpoint is already this rank's 1/tp of the sequence (nothing is replicated over "
                      "TP), so Pa has nothing left to partition and the checkpoints are kept as they are",
                      stacklevel=2)
    handle = ActivationCheckpointing(grid, cfg, getattr(model, "rng", None), len(model.blocks),
                                     microbatches_in_flight, sp)
    model.block_runner = handle
    return handle


def remove_activation_checkpointing(model) -> None:
    """Undo ``apply_activation_checkpointing``: the blocks run in the plain loop again."""
    model.block_runner = None
