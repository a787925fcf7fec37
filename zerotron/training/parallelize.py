"""The whole parallel plan of a GPT in one function, applied in torchtitan's order.

1. **Pipeline stage** -- which layers this rank holds (``model.stages.build_stage``; the whole
   model when pp = 1). The word embedding lives on the first stage, the head and loss on the
   last, with a tied copy of the embedding there (Megatron-LM). It is built on the meta device
   in the working dtype: shapes only, until step 4 gives the parameters their storage.
2. **Tensor parallelism** -- built into the layers (column/row-parallel linears, vocab-parallel
   embedding and loss; Megatron-LM §3), so it is decided by ``grid.tp_size`` when the stage is
   made: every parameter carries its ``ShardInfo`` from birth. ``parallel.sequence_parallel``
   (Korthikanti et al. 2022) is decided there too: it changes the layers' collectives and layout.
3. **Activation checkpointing** -- ZeRO-R (ZeRO §6.1, §6.3): which block inputs are kept, where
   (Pa, Pa+cpu) and how (MD); its buffer is sized by the micro-batches a stage holds at once,
   which the pipeline schedule decides (an interleaved rank's v model chunks are one module here).
   Selective recompute (the attention core only, Korthikanti §5) is installed by the same call.
4. **ZeRO-DP** (ZeRO §5) -- the optimizer partitions states, gradients and (stage 3) parameters
   over DP; stage 3 gathers in explicit units ``[model, *model.blocks]``: the root (embeddings,
   final norm, head) for the whole forward and backward, each block only while it runs. It
   allocates the flat 16-bit buffer (stage 3: the partition) and the fp32 master shard and fills
   them chunk by chunk from ``GPT.init_parameter_``, one parameter drawn in fp32 at a time
   (``zero.materialize``), as DeepSpeed's ``zero.Init``: construction never holds an fp32 model
   beside them, and every DP rank draws the same values, so nothing is broadcast.

5. **Compilation** (``training.compile``) -- each block's forward through ``torch.compile``;
   lazy: it traces at the first forward, with the parameters' storage already in place.

The trainer, the benchmarks and the paper scripts build through here, so they measure the
model a run trains.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from zerotron.activation import apply_activation_checkpointing
from zerotron.activation.checkpoint import ActivationCheckpointing
from zerotron.model import GPT, GPTConfig
from zerotron.model.stages import build_stage, split_chunks
from zerotron.parallel.grid import Grid
from zerotron.parallel.pipeline import microbatches_in_flight
from zerotron.config.run_config import RunConfig
from zerotron.zero import ZeroOptimizer
from zerotron.zero.loss_scaler import make_loss_scaler
from zerotron.zero.optimizer import DTYPES


@dataclass
class ParallelGPT:
    """What ``parallelize_gpt`` returns: this rank's stage, its optimizer, its checkpointing handle."""

    model: GPT
    optimizer: ZeroOptimizer
    activations: ActivationCheckpointing | None


def model_dtype(precision: str) -> torch.dtype:
    """The dtype a model is built in: the parameters' own (16 bits for fp16/bf16 runs). Building in
    16 bits rounds nothing the masters need: the model is built on the meta device, without values,
    and the optimizer draws every parameter's initial values in the master dtype
    (``promote_types(dtype, float32)``), keeps them as the master and rounds them for the parameter."""
    return DTYPES[precision]


def checkpointed_forwards_in_flight(cfg: RunConfig, grid: Grid, chunk_sizes: list[int]) -> int:
    """The ``microbatches_in_flight`` that sizes activation checkpointing's MD buffer, which holds
    (checkpoints of a forward of all the rank's blocks) x that many slots. An interleaved rank
    keeps ``microbatches_in_flight(..., v)`` chunk-forwards of ``ceil(chunk / k)`` checkpoints each:
    round up to whole-stage forwards so every one of them has a slot."""
    p = cfg.parallel
    chunk_forwards = microbatches_in_flight(p.pipeline_schedule, grid.pp_size, grid.pp_rank, cfg.num_microbatches,
                                            p.virtual_stages)
    if len(chunk_sizes) == 1:
        return chunk_forwards
    k = cfg.activation_checkpointing.checkpoint_every
    per_chunk = max(-(-n // k) for n in chunk_sizes)
    return -(-(chunk_forwards * per_chunk) // -(-sum(chunk_sizes) // k))


def check_number_checkpoints(cfg: RunConfig, num_layers: int) -> None:
    """Refuse an MD buffer (``activation_checkpointing.number_checkpoints``) certainly too small for
    a pipeline rank: its forwards in flight, each keeping at least the checkpoints of its rank's
    smallest model chunk (exact when the chunks are equal; an interleaved rank whose chunks differ
    may need more, and a shortfall then still stops it mid-step). Checked for every rank on every
    rank, so all of them stop before any collective; found mid-step, the full buffer would stop one
    rank while the others wait out the collective timeout. DeepSpeed's count is per forward; here
    it is every slot of the buffer."""
    ac, p = cfg.activation_checkpointing, cfg.parallel
    n = ac.number_checkpoints
    if not (ac.checkpoint_activations and ac.contiguous_memory_optimization) or n is None:
        return
    k, need = ac.checkpoint_every, 0
    for rank, chunks in enumerate(split_chunks(num_layers, p.pp, None, p.virtual_stages)):
        forwards = microbatches_in_flight(p.pipeline_schedule, p.pp, rank, cfg.num_microbatches, p.virtual_stages)
        need = max(need, forwards * min(-(-len(chunk) // k) for chunk in chunks))
    if n < need:
        raise ValueError(f"activation_checkpointing.number_checkpoints={n}: the contiguous checkpoint buffer (MD) "
                         f"needs at least {need} slots, the checkpoints a pipeline rank keeps at once (its forwards "
                         f"in flight x checkpoints per forward, {p.pipeline_schedule}, pp={p.pp}); set it to {need} "
                         f"or more, or leave it unset to size it from the model")


def parallelize_gpt(cfg: RunConfig, model_cfg: GPTConfig, grid: Grid, device: torch.device | None = None,
                    layout_independent_init: bool = True) -> ParallelGPT:
    """Build this rank's part of the GPT and everything that parallelizes it, from one validated
    ``RunConfig`` (``cfg.validate(world_size)`` first) and the model's ``GPTConfig``.

    ``layout_independent_init=False`` draws each rank's shard directly (fast for big models on one
    device) instead of the same full weights for every (tp, pp) layout.
    """
    t, o = cfg.training, cfg.optimizer
    check_number_checkpoints(cfg, model_cfg.num_layers)
    device = torch.get_default_device() if device is None else torch.device(device)
    model = build_stage(model_cfg, grid, dtype=model_dtype(t.precision), device="meta", seed=t.seed,
                        layout_independent_init=layout_independent_init,
                        sequence_parallel=cfg.parallel.sequence_parallel)
    in_flight = checkpointed_forwards_in_flight(cfg, grid, model.chunk_sizes)
    activations = apply_activation_checkpointing(model, grid, cfg.activation_checkpointing,
                                                 microbatches_in_flight=in_flight)
    scaler = make_loss_scaler(t.precision, o.initial_loss_scale, o.loss_scale_window, o.hysteresis,
                              o.min_loss_scale, o.loss_scale, o.consecutive_hysteresis)
    optimizer = ZeroOptimizer(model, grid, cfg.zero, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps,
                              weight_decay=o.weight_decay, clip_grad=o.clip_grad,
                              stage3_units=[model, *model.blocks], precision=t.precision, loss_scaler=scaler,
                              master_init=model.init_parameter_, device=device, adam_w_mode=o.adam_w_mode)
    if t.compile:
        compile_blocks(model)
    return ParallelGPT(model, optimizer, activations)


def compile_blocks(model: GPT) -> None:
    """``training.compile``: each transformer block's ``forward`` through ``torch.compile``
    (inductor), as torchtitan compiles per block: one graph per block shape, reused by every
    layer. The module call stays eager, so what is attached to a block -- stage 3's gather and
    release hooks, activation checkpointing's recompute -- runs as without compiling; a
    collective inside a block (TP, SP) is a graph break, and the computation between them is
    compiled."""
    for block in model.blocks:
        block.forward = torch.compile(block.forward)
