"""Stage 3's terms of the memory model (ZeRO §5.3, Pos+g+p): the gathered 16-bit units at the
peak and the gradient buffer of the persistent group, sized as ``zero/`` lays them out.

A unit is sized by the group it all-gathers (``zero/plan.py``): its parameters above
``stage3_param_persistence_threshold``, cut into chunks of the bucket size, each padded to the ZeRO
partition degree (DP x CP) (``zero/partition.py``). The smaller parameters of every unit form one *persistent* group,
gathered for the whole run, whose gradients arrive from the first block's backward to the last:
the reducer gives it buffers of its own (``zero/grad_buckets.py``). Gathered at the peak: the root
unit (embeddings, final LayerNorm: gathered through the whole forward and backward), the running
block and those the prefetch window holds ahead -- ``stage3_prefetch_bucket_size`` elements
(unset: one unit ahead, ``zero/stage3_prefetch.py``), everything gathered capped by
``stage3_max_live_parameters`` -- or, with a reuse distance, the model up to that cap.
"""

from __future__ import annotations

from zerotron.model.config import GPTConfig


def norm_numels(cfg: GPTConfig, width: int) -> list[int]:
    """A norm's parameters: weight and bias, or RMSNorm's weight alone."""
    return [width] if cfg.normalization == "RMSNorm" else [width, width]


def block_param_numels(cfg: GPTConfig, tp: int = 1) -> list[int]:
    """One block's parameters on a TP rank, GPT-2's or the Llama family's: QKV (GQA: K and V of
    the query groups) and fc1 (SwiGLU: gate and up rows) split by columns, weights and biases;
    proj and fc2 by rows, weights only; the row-parallel GEMMs' biases and the norms whole."""
    h, f, kv = cfg.hidden_size, cfg.ffn_size, cfg.kv_size
    fc1 = 2 * f if cfg.gated else f
    bias = cfg.add_bias_linear
    attn = norm_numels(cfg, h) + [(h + 2 * kv) * h // tp] + [(h + 2 * kv) // tp] * cfg.qkv_bias
    attn += (norm_numels(cfg, cfg.head_dim) * 2) if cfg.qk_layernorm else []
    attn += [h * h // tp] + [h] * bias
    mlp = norm_numels(cfg, h) + [fc1 * h // tp] + [fc1 // tp] * bias + [f * h // tp] + [h] * bias
    return attn + mlp


def root_param_numels(cfg: GPTConfig, tp: int = 1) -> list[int]:
    """The root unit's: word-embedding slice, a learned position table, the final norm, and an
    untied output layer's slice."""
    h, table = cfg.hidden_size, cfg.padded_vocab_size(tp) * cfg.hidden_size // tp
    positions = [cfg.max_positions * h] if cfg.position_embedding_type == "learned" else []
    return [table] + positions + norm_numels(cfg, h) + ([] if cfg.tied else [table])


def padded_group_numel(numel: int, chunk: int, dp: int) -> int:
    """Elements of a layout group of ``numel`` elements: chunks of ``chunk`` (rounded down to the DP
    degree), the last padded to it; a group is never empty of chunks once it exists."""
    if numel == 0:
        return 0
    chunk -= chunk % dp
    full, rest = divmod(numel, chunk)
    return full * chunk + -(-rest // dp) * dp


def unit_sizes(setup) -> dict[str, int]:
    """Gathered elements of a block and of the root, and the persistent group's (padded)."""
    cfg, t, nd, cut = setup.model, setup.tp, setup.zero_shards, setup.persistence_threshold
    block, root = block_param_numels(cfg, t), root_param_numels(cfg, t)
    small = cfg.num_layers * sum(n for n in block if n <= cut) + sum(n for n in root if n <= cut)
    return {"block": padded_group_numel(sum(n for n in block if n > cut), setup.bucket_size, nd),
            "root": padded_group_numel(sum(n for n in root if n > cut), setup.bucket_size, nd),
            "persistent": padded_group_numel(small, setup.bucket_size, nd)}


def window_numel(setup) -> int:
    """The prefetch window in elements: the key, or one block's gathered group when it is unset."""
    if setup.prefetch_bucket_size is None:
        return unit_sizes(setup)["block"]
    return setup.prefetch_bucket_size


def gathered_numel(setup, head: bool = False) -> int:
    """Non-persistent elements gathered at the fullest moment of a step, plus the persistent group.

    Two moments compete: a block running with the root and the window ahead of it, and the start
    of backward (``head``: the head's backward), when the root runs alone with the window ahead.
    A prefetch never takes the live total past ``max_live_parameters`` (the running units are
    gathered whatever the cap)."""
    sizes, layers = unit_sizes(setup), setup.model.num_layers
    block, root, cap = sizes["block"], sizes["root"], setup.max_live_parameters
    if setup.max_reuse_distance > 0:  # units stay gathered from forward into backward, to the cap
        return sizes["persistent"] + min(root + block * layers, max(root + block, cap))

    def ahead(running: int, room: int) -> int:
        fit = min(window_numel(setup), max(0, cap - running)) // block if block else 0
        return running + block * min(room, fit)

    at_head = ahead(root, layers)
    in_blocks = ahead(root + block, layers - 1)
    return sizes["persistent"] + (at_head if head else max(in_blocks, at_head))


def gathered_param_bytes(setup, param_bytes: int, head: bool = False) -> int:
    """Stage 3's gathered 16-bit parameters at the peak, or (``head``) at the head's backward (0 at
    stages 0-2)."""
    return param_bytes * gathered_numel(setup, head) if setup.stage == 3 else 0


def forward_head_gathered_bytes(setup, param_bytes: int) -> int:
    """What stage 3 holds gathered while the head runs in forward: the root and the persistent group
    (every block was released after its forward; nothing is prefetched past the last)."""
    sizes = unit_sizes(setup)
    return param_bytes * (sizes["root"] + sizes["persistent"])


def persistent_bucket_bytes(setup, grad_bytes: int) -> int:
    """The persistent group's own gradient buffer (stage 3; ``zero/grad_buckets.py``)."""
    return grad_bytes * unit_sizes(setup)["persistent"] if setup.stage == 3 else 0


def largest_gathered_group(setup) -> int:
    """The largest group a stage-3 chunk can belong to, bounding the shared bucket."""
    sizes = unit_sizes(setup)
    return max(sizes["block"], sizes["root"])
