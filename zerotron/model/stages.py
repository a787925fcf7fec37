"""Cutting the GPT into pipeline stages, and keeping the tied word embedding in sync across them.

Split rule: ``num_layers`` transformer blocks over ``pp`` stages as evenly as possible, the
*earlier* stages taking the extra layer when the division is uneven (10 layers on 4 stages:
3, 3, 2, 2), unless an explicit ``layers_per_stage`` list is given. The embedding lives on the
first stage, the final LayerNorm, the tied output layer and the loss on the last. Interleaved
(``parallel.virtual_stages`` v > 1): the same rule over ``pp * v`` virtual stages, and rank r holds
virtual stages r, pp + r, 2pp + r, ... as its model chunks, in one ``GPT`` (``chunk_sizes``); the
embedding is then in rank 0's first chunk, the head in the last rank's last chunk.

Tied embeddings (Megatron-LM): the last stage holds its own copy of the word embedding
(``GPT.word_embedding_copy``), initialised identically. After every step's backwards the two
gradients are summed by an all-reduce over ``grid.embedding_group`` (first and last stage of
one pipeline), so both copies receive the full gradient and take the same optimizer step: they
stay bit-identical, and the step equals the single-process one where the weight is shared.
"""

from __future__ import annotations

from typing import Sequence

import torch

from zerotron.model.config import GPTConfig
from zerotron.model.gpt import GPT
from zerotron.parallel import collectives as C
from zerotron.parallel.grid import Grid
from zerotron.parallel.pipeline import StepOutput, eval_step, train_step


def split_layers(num_layers: int, pp: int, layers_per_stage: Sequence[int] | None = None,
                 virtual_stages: int = 1) -> list[list[int]]:
    """Global layer indices held by each pipeline rank (all its model chunks, chunk by chunk);
    raises ValueError naming the field and the fix."""
    chunks = split_chunks(num_layers, pp, layers_per_stage, virtual_stages)
    return [[i for chunk in rank for i in chunk] for rank in chunks]


def split_chunks(num_layers: int, pp: int, layers_per_stage: Sequence[int] | None = None,
                 virtual_stages: int = 1) -> list[list[list[int]]]:
    """``[rank][chunk]`` -> global layer indices. The layers are cut into ``pp * v`` virtual stages
    (the earlier ones taking the extra layer; ``layers_per_stage`` gives one count per virtual
    stage instead) and chunk c of rank r is virtual stage ``c * pp + r`` (Megatron's assignment:
    with pp 2, v 2 and 4 layers rank 0 holds layers 0 and 2, rank 1 layers 1 and 3)."""
    if not isinstance(pp, int) or pp < 1:
        raise ValueError(f"parallel.pp={pp!r}: must be a positive integer")
    v = virtual_stages
    if not isinstance(v, int) or isinstance(v, bool) or v < 1 or (v > 1 and pp < 2):
        raise ValueError(f"parallel.virtual_stages={v!r}: must be a positive integer, and 1 unless parallel.pp >= 2")
    if not isinstance(num_layers, int) or num_layers < 1:
        raise ValueError(f"model.num_layers={num_layers!r}: must be a positive integer")
    n = pp * v
    what = f"parallel.pp={pp}" if v == 1 else f"parallel.pp*parallel.virtual_stages={pp}*{v}={n}"
    if layers_per_stage is None:
        if n > num_layers:
            raise ValueError(f"{what} exceeds model.num_layers={num_layers}: every "
                             f"{'stage' if v == 1 else 'model chunk'} needs at least one transformer layer; use "
                             f"{'pp' if v == 1 else 'pp*virtual_stages'} <= {num_layers}")
        base, extra = divmod(num_layers, n)
        counts = [base + (1 if s < extra else 0) for s in range(n)]  # earlier stages get the extra layer
    else:
        counts = list(layers_per_stage)
        if len(counts) != n:
            raise ValueError(f"parallel.layers_per_stage={counts} has {len(counts)} entries but {what}; "
                             f"give one layer count per {'stage' if v == 1 else 'virtual stage'}")
        if any(not isinstance(c, int) or isinstance(c, bool) or c < 1 for c in counts):
            raise ValueError(f"parallel.layers_per_stage={counts}: every stage needs a positive integer number "
                             f"of layers")
        if sum(counts) != num_layers:
            raise ValueError(f"parallel.layers_per_stage={counts} sums to {sum(counts)} but model.num_layers="
                             f"{num_layers}; make the counts add up to num_layers")
    stages, start = [], 0
    for c in counts:
        stages.append(list(range(start, start + c)))
        start += c
    return [[stages[c * pp + r] for c in range(v)] for r in range(pp)]


def build_stage(config: GPTConfig, grid: Grid, layers_per_stage: Sequence[int] | None = None,
                virtual_stages: int | None = None, **gpt_kwargs) -> GPT:
    """This rank's pipeline stage of the GPT (``gpt_kwargs``: dtype, device, seed, ...): its
    ``virtual_stages`` model chunks (default ``grid.dims.virtual_stages``) in one module, so ZeRO,
    checkpoints and activation checkpointing see one set of parameters with global names.

    The same seed gives the same full weights for every (tp, pp, v) layout: parameters are
    initialised by their global names, so stage 1 of 2 draws layers 3.. exactly as a single process.
    """
    config.validate(grid.tp_size)
    v = getattr(getattr(grid, "dims", None), "virtual_stages", 1) if virtual_stages is None else virtual_stages
    chunks = split_chunks(config.num_layers, grid.pp_size, layers_per_stage, v)[grid.pp_rank]
    return GPT(config, grid, pre_process=grid.is_first_stage, post_process=grid.is_last_stage,
               layer_ids=[i for chunk in chunks for i in chunk], chunk_sizes=[len(c) for c in chunks], **gpt_kwargs)


def sync_embedding_grads(model: GPT, optimizer=None) -> None:
    """Sum the tied word embedding's gradient over the first and last stage (Megatron's embedding group).

    Call after every backward of the step and before the data-parallel reduction. No-op when one
    stage holds both ends (pp = 1) or on middle stages. With a ZeRO ``optimizer`` the sum acts on the
    gradient it holds (``ZeroOptimizer.tied_grad``: its fp32 buffer when 16-bit parameters accumulate
    in fp32, where ``.grad`` is empty; the reduced shard at stage 2); without one, on ``.grad``.
    """
    group = model.grid.embedding_group
    ends = model.pre_process or model.post_process
    if group is None or group.size == 1 or not ends or not model.config.tied:
        return  # untied (model.untie_embeddings_and_output_weights): two weights, nothing to sum
    weight = model.word_embedding_weight
    if hasattr(optimizer, "tied_grad"):
        C.all_reduce(optimizer.tied_grad(weight), group)
        return
    if weight.grad is None:  # e.g. Pos+g freed it and no backward ran: contribute zeros
        weight.grad = torch.zeros_like(weight)
    C.all_reduce(weight.grad, group)


def pipeline_step(model: GPT, microbatches: Sequence, optimizer=None, schedule: str = "1f1b",
                  micro_batch_size: int | None = None, memory=None, free_outputs: bool = True) -> StepOutput:
    """Forward + backward of one global batch on this rank's stage, gradients reduced; then call ``step()``.

    ``microbatches``: ``m`` pairs ``(token_ids [b, s], labels [b, s])`` for this DP rank (middle
    stages may pass None for both, then ``micro_batch_size`` is required). The tied-embedding
    gradients are all-reduced after the last backward and before the optimizer's reduction.
    Nothing is read on the host: ``out.loss`` is a device tensor (``parallel.host_sync``).
    ``memory``, ``free_outputs``: see ``parallel.pipeline.train_step``.
    """
    shape, dtype, device = stage_wire(model, microbatches, micro_batch_size, "pipeline_step")
    return train_step(model, microbatches, model.grid, shape, schedule=schedule,
                      optimizer=optimizer, after_backward=lambda: sync_embedding_grads(model, optimizer),
                      dtype=dtype, device=device, memory=memory, free_outputs=free_outputs)


def pipeline_eval(model: GPT, microbatches: Sequence, micro_batch_size: int | None = None) -> torch.Tensor:
    """Forward only of ``microbatches`` through the pipeline (``parallel.pipeline.eval_step``),
    on the same wire as ``pipeline_step``; the mean loss, a 0-dim float64 device tensor, on
    every stage."""
    shape, dtype, device = stage_wire(model, microbatches, micro_batch_size, "pipeline_eval")
    return eval_step(model, microbatches, model.grid, shape, dtype=dtype, device=device)


def stage_wire(model: GPT, microbatches: Sequence, micro_batch_size: int | None,
               caller: str) -> tuple[tuple[int, ...], torch.dtype, torch.device]:
    """What passes between stages, the one derivation training and evaluation share: the hidden
    state's shape for this micro-batch size (``[s/t, b, h]`` with sequence parallelism), the
    parameters' dtype and device. The micro-batch size is read from the first tensor given when
    ``micro_batch_size`` is None; every micro-batch must be ``(b, seq_length)``."""
    b = micro_batch_size
    if b is None:
        sample = next((t for t in microbatches[0] if t is not None), None) if len(microbatches) else None
        if sample is None:
            raise ValueError(f"{caller}: cannot infer the micro-batch size from micro-batches of None; "
                             "pass micro_batch_size")
        b = sample.shape[0]
    seq = model.config.seq_length
    for ids, labels in microbatches:
        for name, t in (("token_ids", ids), ("labels", labels)):
            if t is not None and tuple(t.shape) != (b, seq):
                raise ValueError(f"{caller}: {name} shape {tuple(t.shape)} != (micro_batch_size, seq_length)"
                                 f" = ({b}, {seq}); every micro-batch must have the same shape")
    first = next(model.parameters())  # not model.dtype: ZeroOptimizer casts parameters to 16-bit in place
    return model.hidden_shape(b), first.dtype, first.device
