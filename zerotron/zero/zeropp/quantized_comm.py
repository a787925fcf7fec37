"""ZeRO++ quantized collectives: qwZ (weight all-gather) and qgZ (gradient reduce-scatter).

Both move block-quantized int8 values plus one fp32 scale per block (``quantize.py``) through
the counted collectives, so the byte counters show the saving directly.

* **qwZ** -- every rank quantizes its parameter shard, the int8 values and scales are
  all-gathered, and each shard is dequantized on arrival. Wire bytes: (1 + 4/block) per element
  instead of 2 (bf16/fp16) or 4 (fp32).
* **qgZ** -- a reduce-scatter cannot sum int8 values on the wire, so it is done as all-to-all:
  each rank quantizes the block destined for every peer, the blocks are exchanged, dequantized
  and summed in fp32 by their owner. Hierarchical (``inner``/``outer`` groups, e.g. the GPUs of a
  node and the same GPU of every node): first an all-to-all inside the node reduces, for every
  node-local position, the chunks that position will own; then an all-to-all across nodes
  finishes the sum. Quantization error is paid once per level, and the cross-node step moves
  only 1/inner_size of the data.

Both take ``async_op`` like the plain collectives (ZeRO++ overlaps them as DeepSpeed does): the
int8 transfers are issued at once and the handle's ``wait()`` dequantizes. Under NCCL a
synchronous collective would sit in the compute stream, so ``overlap_comm`` and the stage-3
prefetch would overlap nothing. The hierarchical qgZ's cross-node level needs the node level's
sum: it is issued when the handle is waited on (the node level, most of the bytes, overlaps).
"""

from __future__ import annotations

import torch

from zerotron.parallel import collectives as C
from zerotron.parallel.grid import Group
from zerotron.zero.zeropp.quantize import dequantize, num_blocks, quantize


def _result(finish, handles: list, async_op: bool):
    """``finish()`` now, or a handle whose ``wait()`` waits for ``handles`` and then finishes."""
    if not async_op:
        return finish()

    def wait_then_finish():
        for h in handles:
            h.wait()
        return finish()

    return C.Handle(finish=wait_then_finish)


def quantized_all_gather(output: torch.Tensor, shard: torch.Tensor, group: Group, block_size: int,
                         async_op: bool = False):
    """qwZ: ``output`` (flat, ``group.size * shard.numel()``) <- every rank's dequantized shard."""
    n = shard.numel()
    if output.numel() != n * group.size:
        raise ValueError(f"quantized_all_gather: output has {output.numel()} elements, expected {n}*{group.size}")
    if group.size == 1:
        output.copy_(shard.reshape(-1))
        return C.Handle(result=output) if async_op else output
    q, s = quantize(shard, block_size)
    qs = torch.empty(q.numel() * group.size, dtype=torch.int8, device=shard.device)
    ss = torch.empty(s.numel() * group.size, dtype=torch.float32, device=shard.device)
    handles = [C.all_gather(qs, q, group, async_op=async_op), C.all_gather(ss, s, group, async_op=async_op)]

    def finish():
        for r, (qr, sr) in enumerate(zip(qs.chunk(group.size), ss.chunk(group.size))):
            output[r * n:(r + 1) * n] = dequantize(qr, sr, n, output.dtype)
        return output

    return _result(finish, handles, async_op)


def _quantized_exchange(chunks: torch.Tensor, group: Group, block_size: int, async_op: bool = False):
    """All-to-all of ``chunks`` [group.size, n] quantized: a handle whose ``wait()`` returns the
    received rows, dequantized fp32 (done already without ``async_op``)."""
    size, n = chunks.shape
    nb = num_blocks(n, block_size)
    q = torch.empty(size, nb * block_size, dtype=torch.int8, device=chunks.device)
    s = torch.empty(size, nb, dtype=torch.float32, device=chunks.device)
    for j in range(size):
        q[j], s[j] = quantize(chunks[j], block_size)
    q_in, s_in = torch.empty_like(q), torch.empty_like(s)
    handles = [C.all_to_all(q_in.view(-1), q.view(-1), group, async_op=async_op),
               C.all_to_all(s_in.view(-1), s.view(-1), group, async_op=async_op)]
    rows = _result(lambda: torch.stack([dequantize(q_in[j], s_in[j], n) for j in range(size)]),
                   handles, async_op)
    return rows if async_op else C.Handle(result=rows)


def quantized_reduce_scatter(output: torch.Tensor, input: torch.Tensor, group: Group, block_size: int,
                             inner: Group | None = None, outer: Group | None = None,
                             async_op: bool = False):
    """qgZ: ``output`` <- this rank's chunk of the sum over ``group`` of ``input`` (fp32 sum).

    ``input`` holds ``group.size`` equal chunks in group order. With ``inner``/``outer`` (from
    ``Grid.split_group``) the reduction is hierarchical: members ``group.ranks[b*k:(b+1)*k]`` form
    block ``b`` (``k = inner.size``), and the rank at position ``l`` of block ``b`` owns chunk ``b*k + l``.
    """
    n = output.numel()
    size = group.size
    if input.numel() != n * size:
        raise ValueError(f"quantized_reduce_scatter: input has {input.numel()} elements, expected {n}*{size}")
    chunks = input.reshape(size, n)
    if size == 1:
        output.copy_(chunks[0])
        return C.Handle(result=output) if async_op else output
    if inner is None or inner.size in (1, size):
        exchange = _quantized_exchange(chunks, group, block_size, async_op)
        return _result(lambda: output.copy_(exchange.wait().sum(0).to(output.dtype)), [], async_op)
    k, m = inner.size, size // inner.size
    # level 1 (inside the block): position l receives, from every block member, the m chunks {b*k + l}
    by_position = chunks.view(m, k, n).transpose(0, 1).reshape(k, m * n)  # row l: chunks b*k+l for all b
    level1 = _quantized_exchange(by_position, inner, block_size, async_op)

    def finish():
        partial = level1.wait().sum(0)  # [m*n]: block sums of my chunks
        # level 2 (across blocks): the rank at block b keeps chunk b*k+l; the others' partial sums arrive
        final = _quantized_exchange(partial.view(m, n), outer, block_size).wait().sum(0)
        return output.copy_(final.to(output.dtype))

    return _result(finish, [], async_op)
