"""GPT-2 with Megatron-LM tensor parallelism, built in pieces a pipeline stage can hold.

    embed:  vocab-parallel word embedding (g) + learned positions, dropout      [pre_process]
    blocks: TransformerBlock × layers held by this stage                         [layer_ids]
    head:   final LayerNorm, f, logits = h · Eᵀ against the *tied* word embedding,
            vocab-parallel cross-entropy (only b×s values all-reduced)           [post_process]

Initialisation (GPT-2 / Megatron-LM §5): N(0, 0.02) for GEMM weights and embeddings, residual
output projections N(0, 0.02/√(2·layers)), biases 0, LayerNorm 1/0. Each rank's slice is that of
one full tensor drawn from a seed derived from (seed, global parameter name), the full tensor
never held (``init_sharded_`` draws it a chunk at a time), so the same seed gives the same full
weights for every TP/PP/DP layout and runs of different layouts can be compared step by step.
Names use the *global* layer index, so a pipeline stage holding layers 6..11 initialises them
exactly as a single process would.

Sequence parallelism (``sequence_parallel=True``; Korthikanti et al. 2022 §4.2.2, as Megatron
does it): the hidden state between embed, blocks and head (and between pipeline stages) is this
TP rank's s/t of a sequence-first [s/t, b, h]. The embedding reduce-scatters its vocab-parallel
lookups along the sequence instead of all-reducing them, adds its tokens' positions (the
position table's gradient summed over TP) and drops on the per-rank stream; the head normalises
its tokens and all-gathers them into the logit GEMM (``gather_linear``: backward reduce-scatters),
so the loss region is vocab-parallel over the whole sequence, as without it.
"""

from __future__ import annotations

import functools
import math

import torch
from torch import nn

from zerotron.model.block import TransformerBlock
from zerotron.model.documents import document_layout
from zerotron.model.layernorm import make_norm
from zerotron.model.config import GPTConfig
from zerotron.parallel import collectives as C
from zerotron.parallel.context_parallel import check_context_parallel, local_chunks
from zerotron.parallel.cross_entropy import vocab_parallel_cross_entropy
from zerotron.parallel.grid import Grid
from zerotron.parallel.rng import TPRNG
from zerotron.parallel.sequence_parallel import (check_sequence_length, gather_linear, sequence_parallel_norm,
                                                 tp_summed)
from zerotron.parallel.tensor_parallel import VocabParallelEmbedding, init_sharded_, tp_param
from zerotron.parallel.tp_mappings import copy_to_tp_region

WORD_EMBEDDING = "embedding.word.weight"
NORMS = ("ln1", "ln2", "final_ln", "q_norm", "k_norm")  # norm modules: weight 1, bias 0 at init


class Embedding(nn.Module):
    """Word (vocab-parallel) plus learned position embeddings, then dropout on the shared stream
    (with ``sequence_parallel``: this rank's s/t tokens, sequence-first, dropout per rank)."""

    def __init__(self, cfg: GPTConfig, grid: Grid, dtype, device, sequence_parallel: bool = False,
                 rng: TPRNG | None = None):
        super().__init__()
        self.max_positions = cfg.max_positions
        self.sequence_parallel, self.group, self.rng, self.tp_rank = sequence_parallel, grid.tp_group, rng, grid.tp_rank
        self.word = VocabParallelEmbedding(cfg.padded_vocab_size(grid.tp_size), cfg.hidden_size, grid,
                                           dtype=dtype, device=device, sequence_parallel=sequence_parallel)
        self.position = None  # RoPE: positions act inside attention, no table
        if cfg.position_embedding_type == "learned":
            shape = (cfg.max_positions, cfg.hidden_size)
            self.position = tp_param(shape, None, grid.tp_size, dtype, device)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None
                ) -> torch.Tensor:
        """``positions`` [b, s]: each token's position (document masking), else 0..s-1."""
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, seq], got shape {tuple(input_ids.shape)}")
        s = input_ids.shape[1]
        if self.position is not None and s > self.max_positions:
            raise ValueError(f"input sequence length {s} exceeds the position table "
                             f"(model.max_position_embeddings={self.max_positions}); "
                             f"shorten the sequences or raise model.max_position_embeddings to >= {s}")
        if not self.sequence_parallel:
            x = self.word(input_ids)
            if self.position is not None:
                x = x + (self.position[:s] if positions is None else self.position[positions])
            return self.dropout(x)
        check_sequence_length(s, self.group.size)
        lo, hi = self.tp_rank * (s // self.group.size), (self.tp_rank + 1) * (s // self.group.size)
        x = self.word(input_ids.t())
        if self.position is not None and positions is None:
            x = x + tp_summed(self.position[:s], self.group)[lo:hi].unsqueeze(1)
        elif self.position is not None:  # this rank's tokens, sequence-first
            x = x + tp_summed(self.position, self.group)[positions.t()[lo:hi]]
        if not (self.training and self.dropout.p > 0):
            return x
        with self.rng.fork("sp"):  # this rank's tokens: its own mask
            return self.dropout(x)


class GPT(nn.Module):
    """GPT-2 language model, tensor-parallel over ``grid.tp_group``.

    ``pre_process`` / ``post_process`` / ``layer_ids`` select the pieces a pipeline stage holds
    (default: the whole model). A post-process stage without the embedding keeps its own copy of
    the word embedding (its ``ShardInfo.embedding_copy`` set), initialised identically; keeping the
    two copies equal during training (all-reducing their gradients over ``grid.embedding_group``)
    is the pipeline's job. ``seed`` drives initialisation and seeds ``self.rng`` (Megatron's two
    dropout streams, which also resets torch's default generator). ``sequence_parallel``: see the
    module docstring; ``model.seq_length`` must then divide by the TP size.
    """

    def __init__(self, config: GPTConfig, grid: Grid, dtype: torch.dtype = torch.float32, device=None,
                 seed: int = 1234, pre_process: bool = True, post_process: bool = True,
                 layer_ids: list[int] | None = None, layout_independent_init: bool = True,
                 sequence_parallel: bool = False, chunk_sizes: list[int] | None = None):
        super().__init__()
        config.validate(grid.tp_size)
        if config.document_masking and (config.eod_token_id is None or grid.pp_size > 1):
            raise ValueError(f"model.reset_attention_mask/reset_position_ids need "
                             f"model.eod_token_id (the trainer sets the tokenizer's) and "
                             f"parallel.pp=1 (the documents' layout does not travel between "
                             f"pipeline stages yet); got "
                             f"eod_token_id={config.eod_token_id}, pp={grid.pp_size}")
        if sequence_parallel:
            check_sequence_length(config.seq_length // grid.cp_size, grid.tp_size)
        check_context_parallel(config.seq_length, grid.cp_size, grid.tp_size, sequence_parallel,
                               config.attention_dropout)
        self.sequence_parallel = sequence_parallel
        if dtype not in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
            raise ValueError(f"dtype={dtype}: use torch.float32, torch.float16 or torch.bfloat16 "
                             f"(torch.float64 for parity tests)")
        layer_ids = list(range(config.num_layers)) if layer_ids is None else list(layer_ids)
        bad = [i for i in layer_ids if not 0 <= i < config.num_layers]
        if bad or len(set(layer_ids)) != len(layer_ids):
            raise ValueError(f"layer_ids={layer_ids}: must be distinct global layer indices in "
                             f"[0, num_layers={config.num_layers})")
        self.config, self.grid, self.dtype = config, grid, dtype
        self.pre_process, self.post_process, self.layer_ids = pre_process, post_process, layer_ids
        self.vocab_size = config.vocab_size
        self.padded_vocab_size = config.padded_vocab_size(grid.tp_size)
        self.vocab_start = grid.tp_rank * (self.padded_vocab_size // grid.tp_size)
        self.rng = TPRNG()
        self.rng.seed(seed, grid)

        sp = sequence_parallel
        self.embedding = Embedding(config, grid, dtype, device, sp, self.rng) if pre_process else None
        self.blocks = nn.ModuleList(TransformerBlock(config, grid, self.rng, i, dtype, device, sp) for i in layer_ids)
        # Interleaved pipelines: the blocks form model chunks run one at a time (``forward(chunk=c)``),
        # the embedding in chunk 0, the head in the last (``model.stages.build_stage``).
        self.chunk_sizes = [len(layer_ids)] if chunk_sizes is None else list(chunk_sizes)
        if chunk_sizes is not None and (sum(self.chunk_sizes) != len(layer_ids) or min(self.chunk_sizes) < 1):
            raise ValueError(f"chunk_sizes={self.chunk_sizes}: positive block counts summing to {len(layer_ids)}")
        # Replaces the plain block loop when set (activation checkpointing, ZeRO-R Pa/Pa+cpu/MD:
        # zerotron.activation.checkpoint.apply_activation_checkpointing); called as runner(blocks, x).
        self.block_runner = None
        norm = config.normalization, config.hidden_size, config.layernorm_eps
        self.final_ln = make_norm(*norm, dtype, device) if post_process else None
        self.word_embedding_copy = self.output_layer = None
        vocab_slice = (self.padded_vocab_size // grid.tp_size, config.hidden_size)
        if post_process and not config.tied:  # its own weight, vocab-parallel as the embedding
            self.output_layer = tp_param(vocab_slice, 0, grid.tp_size, dtype, device)
        elif post_process and not pre_process:
            self.word_embedding_copy = tp_param((self.padded_vocab_size // grid.tp_size, config.hidden_size), 0,
                                                grid.tp_size, dtype, device, embedding_copy=True)
        self.init_weights(seed, layout_independent_init)

    # initialisation ----------------------------------------------------------------------------
    def global_name(self, local_name: str) -> str:
        """The layout-independent name of a parameter: global layer index, shared embedding name."""
        if local_name == "word_embedding_copy":
            return WORD_EMBEDDING
        if local_name.startswith("blocks."):
            _, idx, rest = local_name.split(".", 2)
            return f"layers.{self.layer_ids[int(idx)]}.{rest}"
        return local_name

    @torch.no_grad()
    def init_weights(self, seed: int, layout_independent: bool = True) -> None:
        """(Re)initialise every parameter from ``seed`` (GPT-2 / Megatron-LM §5 scheme)."""
        self.init_seed, self.layout_independent_init = seed, layout_independent
        for local_name, p in self.named_parameters():
            self.init_parameter_(local_name, p)

    @torch.no_grad()
    def init_parameter_(self, local_name: str, out: torch.Tensor) -> None:
        """Write the initial values of parameter ``local_name`` (``init_weights``' seed and layout) into
        ``out``, a contiguous tensor of its shape in any dtype and on any device (the parameter itself
        may be on the meta device).

        One parameter can so be drawn again, alone: the fp32 master of a parameter built in 16 bits
        then comes from the values it was rounded from, without an fp32 copy of the whole model.
        """
        cfg, grid = self.config, self.grid
        p = self.get_parameter(local_name)
        name = self.global_name(local_name)
        if name.split(".")[-2:-1] in [[n] for n in NORMS]:  # a norm's weight 1, bias 0
            out.fill_(1.0 if name.endswith("weight") else 0.0)
        elif p.ndim == 1:  # biases
            out.zero_()
        else:
            residual = name.endswith(TransformerBlock.residual_projections)
            std = cfg.init_std / math.sqrt(2.0 * cfg.num_layers) if residual else cfg.init_std
            vocab_table = name in (WORD_EMBEDDING, "output_layer")
            rows = cfg.vocab_size if vocab_table else None  # padding rows stay 0
            init_sharded_(p, std, self.init_seed, name, grid.tp_rank, grid.tp_size, self.layout_independent_init,
                          rows, out=out)

    # the three pieces --------------------------------------------------------------------------
    @property
    def output_weight(self) -> nn.Parameter:
        """This rank's vocab slice of the output layer: its own when untied, else the word
        embedding."""
        return self.word_embedding_weight if self.output_layer is None else self.output_layer

    @property
    def word_embedding_weight(self) -> nn.Parameter:
        """This rank's vocab slice of the (tied) word embedding, the output layer's weight."""
        if self.embedding is not None:
            return self.embedding.word.weight
        if self.word_embedding_copy is None:
            raise RuntimeError("this GPT stage has neither the embedding nor the head (pre_process=post_process=False)")
        return self.word_embedding_copy

    def hidden_shape(self, micro_batch: int, seq: int | None = None) -> tuple[int, int, int]:
        """Shape of the hidden state between embed, blocks, head and pipeline stages on this rank."""
        s, h = self.config.seq_length if seq is None else seq, self.config.hidden_size
        s //= self.grid.cp_size  # context parallelism: this rank's two chunks
        return (s // self.grid.tp_size, micro_batch, h) if self.sequence_parallel else (micro_batch, s, h)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token ids [b, s] → hidden [b, s, h] (replicated over TP ranks), or with sequence
        parallelism this rank's [s/t, b, h]."""
        if self.embedding is None:
            raise RuntimeError("embed() on a stage built with pre_process=False")
        cp, cp_rank = self.grid.cp_size, self.grid.cp_rank
        if not self.config.document_masking and cp == 1:
            return self.embedding(input_ids)
        if not self.config.document_masking:  # CP: this rank's chunks, their global positions
            ids = local_chunks(input_ids, cp_rank, cp)
            positions = local_chunks(torch.arange(input_ids.shape[1], device=input_ids.device), cp_rank, cp, 0)
            return self.embedding(ids, positions.expand_as(ids))
        documents, positions = document_layout(input_ids, self.config.eod_token_id)  # whole sequence
        if not self.config.reset_position_ids:
            positions = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
        positions = local_chunks(positions, cp_rank, cp)  # global or in-document, per token
        for block in self.blocks:  # read by attention in this forward, and in its recomputes
            block.attn.documents = documents if self.config.reset_attention_mask else None
            block.attn.positions = positions if (self.config.reset_position_ids or cp > 1) else None
        ids = local_chunks(input_ids, cp_rank, cp)
        return self.embedding(ids, positions if (self.config.reset_position_ids or cp > 1) else None)

    def head(self, hidden: torch.Tensor, labels: torch.Tensor | None = None,
             ignore_index: int = -100) -> torch.Tensor:
        """Final LN and tied output layer: per-token fp32 loss [b, s] with ``labels``, else local logits.

        Logits stay split over the vocabulary ([b, s, V_padded/tp], padded columns set to the
        lowest value so they never win); the loss never gathers them (Megatron-LM §3).
        """
        if self.final_ln is None:
            raise RuntimeError("head() on a stage built with post_process=False")
        group = self.grid.tp_group
        if self.sequence_parallel:  # [s/t, b, h] → logits [s, b, V/t] (all-gathered into the GEMM)
            x = sequence_parallel_norm(self.final_ln, hidden, group)
            logits = gather_linear(x, self.output_weight, None, group)
            if labels is not None:  # the loss in the logits' own [s, b] order, returned [b, s]
                return vocab_parallel_cross_entropy(logits, labels.t(), group, self.vocab_start, self.vocab_size,
                                                    ignore_index).t()
            logits = logits.transpose(0, 1)
        else:
            x = copy_to_tp_region(self.final_ln(hidden), group)  # f: grads all-reduced
            logits = torch.matmul(x, self.output_weight.t())
        if labels is not None:
            return vocab_parallel_cross_entropy(logits, labels, self.grid.tp_group, self.vocab_start,
                                                self.vocab_size, ignore_index)
        pad_from = self.vocab_size - self.vocab_start
        if pad_from < logits.shape[-1]:
            mask = torch.arange(logits.shape[-1], device=logits.device) >= pad_from
            logits = logits.masked_fill(mask, torch.finfo(logits.dtype).min)
        return logits

    def run_blocks(self, x: torch.Tensor, blocks=None) -> torch.Tensor:
        """This stage's transformer blocks (or ``blocks``) in order, through ``block_runner`` when set."""
        blocks = self.blocks if blocks is None else blocks
        if self.block_runner is not None:
            return self.block_runner(blocks, x)
        for block in blocks:
            x = block(x)
        return x

    def pipeline_chunks(self) -> list:
        """The callables the pipeline schedule runs, one per model chunk (``parallel.pipeline``)."""
        if len(self.chunk_sizes) == 1:
            return [self]
        return [functools.partial(self, chunk=c) for c in range(len(self.chunk_sizes))]

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
                ignore_index: int = -100, chunk: int | None = None) -> torch.Tensor:
        """head(blocks(embed(input_ids))): mean fp32 loss over non-ignored tokens, or local logits.

        On a stage without the embedding ``input_ids`` is the incoming hidden state; on a stage
        without the head the hidden state is returned. ``chunk``: only that model chunk's blocks
        (with the embedding if it is the first, the head if it is the last).
        """
        blocks, pre, post = self.blocks, self.pre_process, self.post_process
        if chunk is not None:
            lo = sum(self.chunk_sizes[:chunk])
            blocks = self.blocks[lo:lo + self.chunk_sizes[chunk]]
            pre, post = pre and chunk == 0, post and chunk == len(self.chunk_sizes) - 1
        x = self.embed(input_ids) if pre else input_ids
        x = self.run_blocks(x, blocks)
        if not post:
            return x
        cp = self.grid.cp_size
        if labels is not None:
            labels = local_chunks(labels, self.grid.cp_rank, cp)  # the labels of this rank's tokens
        out = self.head(x, labels, ignore_index)
        if labels is None:
            return out
        count = (labels != ignore_index).sum()
        if cp == 1:
            return out.sum() / count.clamp(min=1)
        # Context parallelism: the mean over the whole sequence's tokens, as at cp = 1. Gradients
        # are averaged over DP x CP, so each rank's share is scaled by cp (Megatron-LM#906).
        C.all_reduce(count, self.grid.cp_group)
        return out.sum() * cp / count.clamp(min=1)
