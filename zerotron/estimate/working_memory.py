"""The memory that comes and goes inside a step, beside the model states: what a layer, a
recomputed layer and the head hold, the tied embedding's gradients, the CB buffers and what a
reduction in flight copies -- and at which moment of the step the largest of them coincide
(``step_working_bytes``). ``memory_model.estimate`` adds them to the model states; the module
docstring there derives each term, ``scripts/bench/memory_grid.py`` measures them.
"""

from __future__ import annotations

from zerotron.estimate.activations import layer_activation_bytes, llama_extra_bytes
from zerotron.estimate.context_parallel import (attention_side_bytes, ring_saved_bytes,
                                                ring_working_bytes)
from zerotron.parallel.rng import STREAMS


def dropout_mask_bytes(setup, act_bytes: int) -> int:
    """Bytes per element of a residual-dropout mask: none at ``model.dropout`` 0 (torch returns
    the input unchanged), CUDA's fused kernel a byte, the CPU kernel its scaled noise in the
    activation dtype (``estimate.activations``)."""
    if setup.model.dropout == 0:
        return 0
    return act_bytes if setup.device == "cpu" else 1


def layer_working_bytes(b: int, s: int, h: int, heads: int, tp: int = 1, fused_attention: bool = True,
                        sequence_parallel: bool = False, selective: bool = False, act_bytes: int = 2,
                        mask_bytes: int = 1, ffn: int | None = None) -> float:
    """Activations one transformer layer saves for backward (Korthikanti 2022, eq. 2 / Table 2, TP t)."""
    return layer_activation_bytes(b, s, h, heads, tp, sequence_parallel, "selective" if selective else "none",
                                  ffn=ffn, fused_attention=fused_attention, act_bytes=act_bytes,
                                  mask_bytes=mask_bytes)


def block_layer_bytes(setup, act_bytes: int) -> float:
    """What one layer of ``setup``'s block saves for backward without a checkpoint: Table 2 at
    its MLP width, plus the Llama block's own tensors (``llama_extra_bytes``: GQA, SwiGLU,
    RMSNorm, RoPE, a CPU's dense document mask); GPT-2's block is Table 2 alone."""
    cfg, t = setup.model, setup.tp
    sp, sel = setup.sequence_parallel and t > 1, setup.recompute_granularity == "selective"
    table2 = layer_working_bytes(setup.micro_batch, cfg.seq_length, cfg.hidden_size,
                                 cfg.num_heads, t, setup.fused_attention, sp, sel, act_bytes,
                                 dropout_mask_bytes(setup, act_bytes), cfg.ffn_size)
    table2 += 0 if sel else ring_saved_bytes(setup, act_bytes)  # a CP ring's output in fp32
    return table2 + llama_extra_bytes(cfg, setup.micro_batch, t, sp, "selective" if sel else "none",
                                      act_bytes, cpu=setup.device == "cpu", ring=setup.cp > 1)


def recompute_working_bytes(b: int, s: int, h: int, heads: int, tp: int = 1, fused_attention: bool = True,
                            sequence_parallel: bool = False, selective: bool = False, act_bytes: int = 2,
                            mask_bytes: int = 1, keep_gathers: bool = True,
                            ffn: int | None = None) -> float:
    """Peak of one checkpointed layer's backward beyond its checkpoint (module docstring), per
    s·b·h: replicated 6e + 2m (14 at the paper's e = 2, m = 1), TP-split 12e/t; with sequence
    parallelism the replicated part is split along the sequence too, except that the recompute
    keeps the two column-parallel GEMMs' gathered inputs for their weight gradients
    (``kept_gather_bytes``), and the peak moves to fc2's input-gradient GEMM, beside fc2's
    output gradient all-gathered by g's backward, e, and that GEMM's result, 4e/t
    (``parallel.sequence_parallel._GatherLinear``). With ``keep_gathers`` off (Megatron's
    re-gather) a column-parallel GEMM's backward holds its re-gathered input and its whole input
    gradient before the reduce-scatter instead, 2e. ``ffn``: the MLP width f (4h, the
    paper's), whose two f-wide tensors make 8e of the 12e/t."""
    e, m = act_bytes, mask_bytes
    replicated = 6 * e + 2 * m
    split = 4 * e + 2 * e * (4 if ffn is None else ffn / h)
    probs = 0 if (fused_attention or selective) else (2 * e + m) * heads * s / (h * tp)
    if not sequence_parallel:
        return s * b * h * (replicated + split / tp + probs)
    extra = (_kept_gathers_per_sbh(tp, e) + e + 4 * e / tp) if keep_gathers else 2 * e
    return s * b * h * (replicated / tp + extra + split / tp + probs)


def kept_gather_bytes(b: int, s: int, h: int, tp: int, act_bytes: int = 2) -> float:
    """What a recomputed sequence-parallel layer holds beyond its sequence-split activations: the
    whole gathered inputs of QKV and fc1, kept for their weight gradients, in place of their s/t
    pieces -- 2e(1 - 1/t) per s·b·h, in every layer of the chunk being recomputed."""
    return s * b * h * _kept_gathers_per_sbh(tp, act_bytes)


def _kept_gathers_per_sbh(tp: int, act_bytes: int) -> float:
    return 2 * act_bytes * (1 - 1 / tp)


def layer_backward_bytes(setup, act_bytes: int) -> float:
    """A layer's backward beyond what it saved, where no head is larger (a pipeline stage without
    the head): the gradient arriving from above, e per s·b·h (1/t of it with sequence
    parallelism), and the MLP's backward at its fullest, in f/t-wide tensors of e bytes: GeLU's
    fc2 input gradient beside the saved GeLU output, 1; SwiGLU's silu and up gradients made from
    fc2's input gradient once fc2's input (their product) is freed, 2 -- where the dry run's
    tracker puts a middle stage's peak (``tests/estimate/test_pipeline_memory.py``). A recomputed
    layer's backward adds it to the layer's whole saved set, as the recompute re-made it."""
    cfg, t = setup.model, setup.tp
    sp = setup.sequence_parallel and t > 1
    mlp = (2 if cfg.gated else 1) * cfg.ffn_size / t
    sb = setup.micro_batch * cfg.seq_length
    return sb * act_bytes * (cfg.hidden_size / (t if sp else 1) + mlp)


def head_input_bytes(b: int, s: int, h: int, tp: int = 1, sequence_parallel: bool = False,
                     act_bytes: int = 2) -> float:
    """What the head keeps of the hidden state until its backward: the last block's output (the
    final LayerNorm's saved input) and the LayerNorm's output (the logit GEMM's saved input), each
    b·s·h 16-bit, or their [s/t] pieces with sequence parallelism. No layer's formula has them."""
    return 2 * b * s * h * act_bytes / (tp if sequence_parallel else 1)


# torch's CPU generator (mt19937) state, ``torch.get_rng_state().numel()`` bytes
CPU_GENERATOR_STATE_BYTES = 5056


def rng_snapshot_bytes(setup, snapshots: int) -> int:
    """Each checkpoint (and each selectively recomputed core) snapshots the RNG streams dropout can
    draw from -- with ``TPRNG``: the shared CPU generator's state and each per-rank stream's --
    so its recompute replays the same masks (``parallel/rng.py: capture_rng``), and the
    TPRNG holds its per-rank streams besides. On a GPU these are host tensors (the CUDA states
    are 16 bytes each, on the host too), so only a CPU device holds them: 5056 bytes per state,
    three per checkpoint, which at h 32 (b 8, s 64) is half of a 32 KiB checkpoint."""
    if setup.device != "cpu":
        return 0
    return ((1 + len(STREAMS)) * snapshots + len(STREAMS)) * CPU_GENERATOR_STATE_BYTES


def head_working_bytes(b: int, s: int, vocab: int, tp: int = 1, logit_bytes: int = 2, padded: bool = False) -> float:
    """The loss's forward peak over this rank's vocabulary slice (``parallel/cross_entropy.py``):
    the logits, their copy in the softmax dtype (fp32 at least) -- made by the cast from 16 bits,
    or by the clone that masks the padding columns when the logits are already fp32 -- and the
    shifted ``x - max`` beside it: 2 + 4 + 4 bytes a logit in 16 bits, 4 + 4 in fp32 (4 + 4 + 4
    on a rank with padding columns)."""
    f = max(logit_bytes, 4)
    copy = f if (logit_bytes != f or padded) else 0
    return b * s * (vocab // tp) * (logit_bytes + copy + f)


def head_backward_bytes(b: int, s: int, vocab: int, tp: int = 1) -> float:
    """The head at its backward: 16-bit logits, the fp32 softmax turned into the gradient in place,
    and that gradient cast back to 16 bits -- 2 + 4 + 2 bytes per logit of this rank's slice."""
    return b * s * (vocab // tp) * 8


def tied_gradient_bytes(vocab: int, h: int, tp: int = 1, param_bytes: int = 2) -> float:
    """The end of backward: the tied word embedding receives two dense gradients of this rank's
    vocabulary slice, the LM head's and the lookup's, and autograd sums them into a third."""
    return 3 * (vocab // tp) * h * param_bytes


def bucket_elements(stage: int, bucket: int, nd: int, largest_group: int) -> int:
    """C: the bucket rounded down to a multiple of the shards, capped by the largest flat group
    padded to the shards -- the whole model at stages 0-2, the largest gathered unit at stage 3,
    whose groups are its units (``zero/partition.py``)."""
    shards = nd if stage >= 1 else 1
    c = bucket - bucket % shards
    return min(c, -(-largest_group // shards) * shards)


def fixed_buffer_bytes(stage: int, bucket: int, nd: int, psi: int, param_bytes: int = 2,
                       overlap: bool = False, grad_bytes: int | None = None, contiguous: bool = True) -> int:
    """CB (§6.2): ZeRO buffers sized by the bucket, not the model (mirrors zerotron's optimizer).

    C = ``bucket_elements`` (``psi``: the largest flat group's elements); per stage:
    0: fp32 staging C (unsharded); 1: shard buffer, fp32 staging and all-gather input of C/Nd;
    2: + a 16-bit bucket of C; 3: bucket, shard buffer and staging (no all-gather input).
    ``overlap`` doubles the bucket and shard buffers (two in flight). Buckets and shard buffers
    hold gradients (``grad_bytes``, default ``param_bytes``); fp32 gradients need no fp32 staging.
    Stages 0-1 without ``contiguous`` gradients (no MD) reduce through packed buckets too.
    """
    g = param_bytes if grad_bytes is None else grad_bytes
    staging = 0 if g == 4 else 4
    shards = nd if stage >= 1 else 1
    c = bucket_elements(stage, bucket, nd, psi)
    shard, nbuf = c // shards, 2 if overlap else 1
    packed = 0 if (stage >= 2 or contiguous) else nbuf * g * c
    if stage == 0:
        return staging * c + packed
    out = nbuf * g * shard + staging * shard
    if stage <= 2:
        out += param_bytes * shard
    if stage >= 2:
        out += nbuf * g * c
    return out + packed


def reduce_copy_bytes(setup, c: int, grad_bytes: int) -> int:
    """gloo's reduce-scatter works on a copy of its whole input (an all-reduce, then each rank's
    slice), so on a CPU run every bucket in flight is held twice; NCCL reduces in place."""
    if setup.backend not in ("gloo", "nccl"):
        raise ValueError(f"backend={setup.backend!r}: the memory model knows gloo and nccl")
    if setup.backend != "gloo" or setup.stage == 0 or setup.zero_shards == 1:  # one rank: copied, not reduced
        return 0
    return (2 if setup.overlap_comm else 1) * c * grad_bytes


def step_working_bytes(setup, *, psi: int, largest_group: int, kept: float, layer: float, gathered: float,
                       root: float, param_bytes: int, grad_bytes: int,
                       head_gathered: float | None = None) -> float:
    """The working memory at the step's worst moment, above the model states, the ``kept``
    activations (checkpoints, or every layer's without checkpointing) and ``gathered`` units.

    Forward's worst is the head (logits and cross-entropy, beside the hidden state it normalised,
    ``head_input_bytes``). Backward's is the largest of: the
    head's backward, which comes before any bucket is full; a recomputed layer beside a bucket
    in flight (none before the end when one bucket holds the whole model) and, at stage 3, the
    head's gradient of the tied embedding waiting in its unit for the lookup's; the tied
    gradients summed at the end, once the activations are gone; and their bucket going out.
    Stage 3 releases each block after its forward and gathers blocks again only once backward
    starts (with or without checkpointing), so its forward head meets the root unit alone (``root``)
    and its backward head the root with the prefetch window ahead of it (``head_gathered``; no
    block runs yet), the other backward moments a running block too (``gathered``). With
    context parallelism ``setup`` is one CP rank's (``context_parallel.local_setup``: s/cp
    tokens) and a layer's backward holds the ring's buffers too."""
    cfg, t, b, pb = setup.model, setup.tp, setup.micro_batch, param_bytes
    s, h, vocab = cfg.seq_length, cfg.hidden_size, cfg.padded_vocab_size(setup.tp)
    sp, sel = setup.sequence_parallel and t > 1, setup.recompute_granularity == "selective"
    c = bucket_elements(setup.stage, setup.bucket_size, setup.zero_shards, largest_group)
    copy = reduce_copy_bytes(setup, c, grad_bytes)
    pp, rank = setup.pp, setup.pipeline_rank
    head_here, table_here = rank == pp - 1, rank in (0, pp - 1)  # a pipeline's last / either end
    one_tied = pb * (vocab // t) * h if table_here else 0
    # untied, or a pipeline's two copies: the rank's one table gradient at the end, no sum
    tied = tied_gradient_bytes(vocab, h, t, pb) if cfg.tied and pp == 1 else one_tied
    head_in = head_input_bytes(b, s, h, t, sp, param_bytes)
    if cfg.normalization == "RMSNorm":  # the final norm's input at fp32 width and its output
        head_in += b * s * h * max(pb, 4) / (t if sp else 1)
    padded = vocab > cfg.vocab_size  # the TP rank holding the padding columns: the model is the worst rank's
    head_fwd = head_working_bytes(b, s, vocab, t, param_bytes, padded) + head_in if head_here else 0
    head_bwd = head_backward_bytes(b, s, vocab, t) + head_in if head_here else 0
    waiting = one_tied if setup.stage == 3 else 0
    if setup.checkpoint_activations:
        keep = sp and setup.sequence_parallel_gather == "keep"
        segment = (recompute_working_bytes(b, s, h, cfg.num_heads, t, setup.fused_attention, sp, sel, pb,
                                           dropout_mask_bytes(setup, pb), keep, cfg.ffn_size)
                   + llama_extra_bytes(cfg, b, t, sp, "selective" if sel else "none", pb,
                                       cpu=setup.device == "cpu", ring=setup.cp > 1)
                   + (setup.checkpoint_every - 1) * (layer + (kept_gather_bytes(b, s, h, t, pb) if keep else 0)))
        segment += 0 if sel else ring_saved_bytes(setup, pb)  # a CP ring's output, fp32
        if ring_working_bytes(setup, pb):  # its backward, once the MLP's tensors are freed
            segment = max(segment, attention_side_bytes(setup, pb) + ring_working_bytes(setup, pb))
        if pp > 1:  # no head outgrows it: a recomputed layer's saved tensors and its own backward
            segment = max(segment, layer + layer_backward_bytes(setup, pb))
        mid = copy if setup.stage == 3 or c < psi else 0
        blocks = max(segment + mid + waiting, tied - kept, one_tied + copy - kept)
    else:  # the first bucket goes out once its C elements' layers are done, their activations freed
        done = kept * min(1.0, c / psi)
        ring = ring_working_bytes(setup, pb)  # the last layer's backward ring, beside all kept
        blocks = max(waiting + max(ring, copy - done), tied - kept, layer_backward_bytes(setup, pb))
    ring_fwd = ring_working_bytes(setup, pb, backward=False)  # the last layer's forward ring
    if setup.stage == 3:
        at_head = gathered if head_gathered is None else head_gathered
        return max(head_fwd + root, head_bwd + at_head, blocks + gathered,
                   ring_fwd + gathered) - gathered
    return max(head_fwd, head_bwd, blocks, ring_fwd)
