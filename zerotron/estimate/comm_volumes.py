"""The collectives one rank of a run issues per step, counted from its config (no dry run).

The same ``{"op/group": {"calls", "bytes"}}`` a dry run measures (``parallel.comm_stats``: an
all-reduce of Ψ bytes counts 2Ψ, a reduce-scatter or all-gather Ψ, a send what it moves), so
``step_time.predict_step`` times either. Volumes follow the paper: Megatron-LM's TP all-reduces,
2 per layer in forward and 2 in backward, 2 more with recompute ([Z] §8, [M] §3); Pa's one
all-gather per layer before recompute ([Z] §8); ZeRO-DP's Ψ reduce-scatter plus Ψ all-gather at
stages 1-2, 2Ψ all-reduce at stage 0, plus the forward and backward gathers at stage 3 ([Z]
§7.2), over DP x CP with context parallelism; ring attention's K/V and dK/dV transfers
(``ring_comm``). ``tests/estimate/test_step_model.py`` holds these against a dry run of the same config.
"""

from __future__ import annotations

import math

from zerotron.estimate.memory_model import block_params_per_rank
from zerotron.estimate.stage3_memory import norm_numels
from zerotron.model.config import GPTConfig

DTYPE_BYTES = {"fp16": 2, "bf16": 2, "fp32": 4}


def group_ranks(tp: int, pp: int, dp: int, cp: int = 1) -> dict[str, list[int]]:
    """Rank 0's groups: TP innermost, then CP, then DP, then PP
    (rank = t + tp·(c + cp·(d + dp·p)))."""
    out = {"tp": list(range(tp)), "dp": [tp * cp * d for d in range(dp)],
           "pp": [tp * cp * dp * p for p in range(pp)], "embedding": [0, tp * cp * dp * (pp - 1)],
           "world": list(range(tp * cp * dp * pp))}
    if cp > 1:  # the ring, and the data-parallel-with-CP group that reduces and partitions
        out["cp"] = [tp * c for c in range(cp)]
        out["dp_cp"] = [tp * c for c in range(cp * dp)]
    return out


def rank_params(mcfg: GPTConfig, tp: int, pp: int) -> int:
    """Parameters a rank of the last stage holds (the largest stage with the first).

    Per block, ``memory_model.block_params_per_rank`` (GEMMs split over TP, norms and row-parallel
    biases whole). The vocab-parallel embedding splits over TP; the last stage holds the output
    layer (tied: a copy of the embedding), and with one stage the untied embedding besides; the
    learned position table sits on the first stage, the final norm on the last."""
    h = mcfg.hidden_size
    table = mcfg.padded_vocab_size(tp) // tp * h
    tables = 2 if pp == 1 and not mcfg.tied else 1
    learned = mcfg.position_embedding_type == "learned"
    positions = mcfg.max_positions * h if pp == 1 and learned else 0
    final_norm = sum(norm_numels(mcfg, h))
    block = block_params_per_rank(mcfg, tp)
    return math.ceil(mcfg.num_layers / pp) * block + tables * table + positions + final_norm


def _add(out: dict, key: str, calls: float, nbytes: float) -> None:
    if calls > 0:
        slot = out.setdefault(key, {"calls": 0, "bytes": 0})
        slot["calls"] += calls
        slot["bytes"] += nbytes


def analytic_comm(cfg, mcfg: GPTConfig) -> dict[str, dict[str, float]]:
    """Per step, for a rank of the last pipeline stage, keyed ``"op/group"``."""
    par, z, ac = cfg.parallel, cfg.zero, cfg.activation_checkpointing
    tp, pp, dp, cp = par.tp, par.pp, par.dp, par.cp
    elem = DTYPE_BYTES[cfg.training.precision]
    grad = DTYPE_BYTES[z.grad_accum(cfg.training.precision)]
    micro = cfg.num_microbatches
    tokens = cfg.training.micro_batch_size * mcfg.seq_length // cp  # a CP rank's s/cp
    layers = math.ceil(mcfg.num_layers / pp)
    act = tokens * mcfg.hidden_size * elem  # one [s, b, h] activation
    recompute = ac.checkpoint_activations
    out: dict[str, dict[str, float]] = {}
    if tp > 1:
        per_layer = 4 + (2 if recompute else 0)
        ends = 1 + (1 if pp == 1 else 0)  # the head's f backward; the embedding's g (1st stage)
        calls = micro * (layers * per_layer + ends)
        _add(out, "all_reduce/tp", calls, calls * 2 * act)
        _add(out, "all_reduce/tp", 3 * micro, 3 * micro * 2 * tokens * 4)  # cross-entropy, fp32
        if recompute and ac.partition_activations:
            _add(out, "all_gather/tp", micro * layers, micro * layers * act)
    if pp > 1:
        chunks = par.virtual_stages
        boundary = act // tp if par.sequence_parallel else act  # SP: each TP rank sends its s/t
        _add(out, "send/pp", micro * chunks, micro * chunks * boundary)
        _add(out, "recv/pp", micro * chunks, micro * chunks * boundary)
        table = mcfg.padded_vocab_size(tp) // tp * mcfg.hidden_size
        shard = dp if z.stage >= 2 else 1  # Pos+g reduces the tied gradient's shard (zero.plan)
        _add(out, "all_reduce/embedding", 1, 2 * table // shard * grad)
    if cp > 1:
        for key, calls, nbytes in ring_comm(cfg, mcfg):
            _add(out, key, calls, nbytes)
    shards, zero_group = dp * cp, "dp_cp" if cp > 1 else "dp"  # ZeRO over DP x CP
    if shards > 1:
        params = rank_params(mcfg, tp, pp)
        bucket = z.reduce_bucket_size or params
        buckets = max(1, math.ceil(params / bucket)) + (1 if pp > 1 else 0)  # tied weight: its own
        if z.stage == 0:
            _add(out, f"all_reduce/{zero_group}", buckets, 2 * params * grad)
        else:
            # Pos+g under a pipeline reduces each micro-batch's gradients as its backward ends
            times = micro if z.stage >= 2 and pp > 1 else 1
            _add(out, f"reduce_scatter/{zero_group}", buckets * times, times * params * grad)
            # stage 3 gathers again in forward, (recompute,) backward
            gathers = 1 if z.stage < 3 else micro * (3 if recompute else 2)
            _add(out, f"all_gather/{zero_group}", buckets * gathers, gathers * params * elem)
    return out


def ring_comm(cfg, mcfg: GPTConfig) -> list[tuple[str, float, float]]:
    """Ring attention's transfers per step on one CP rank, as ``(key, calls, bytes)``.

    Every attention of a micro-batch passes this rank's K/V pair -- 2·b·(s/cp)·kv/t elements,
    kv = query groups × head dim (GQA sends the groups, not the heads) -- cp − 1 times around
    the ring in forward, once more per recompute of the core (full recompute's forward,
    selective's in backward), and cp − 1 times again in backward, where each rank also sends
    the dK/dV it accumulated for the pair it holds onward with it: cp − 1 hops, plus one home,
    of a pair of the gradient's size. Each transfer is one send and one receive, in the ring's
    compute dtype (fp32 for 16-bit runs: ``parallel/ring_attention.py``).
    """
    par, ac = cfg.parallel, cfg.activation_checkpointing
    cp, tp = par.cp, par.tp
    elem = max(4, DTYPE_BYTES[cfg.training.precision])  # the ring moves its fp32 compute copies
    layers = math.ceil(mcfg.num_layers / par.pp)
    pair = 2 * cfg.training.micro_batch_size * (mcfg.seq_length // cp) * mcfg.kv_size // tp
    # the attention core runs again in full recompute's forward and in selective's backward
    forwards = 1 + ac.checkpoint_activations + (ac.recompute_granularity == "selective")
    kv_hops = (forwards + 1) * (cp - 1)  # forward(s), then backward's K/V
    grad_hops = cp  # dK/dV: cp - 1 with the K/V, one more home
    calls = cfg.num_microbatches * layers * (kv_hops + grad_hops)
    nbytes = cfg.num_microbatches * layers * pair * elem * (kv_hops + grad_hops)
    return [("send/cp", calls, nbytes), ("recv/cp", calls, nbytes)]
