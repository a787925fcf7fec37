"""Context parallelism: each rank of the CP group holds two chunks of every sequence.

A sequence of s tokens is cut into 2·cp chunks of s/(2·cp); CP rank i holds chunks i and
2·cp-1-i, in that order (Megatron-core's load balancing: under the causal mask an early chunk
attends to little and a late one to much, so every rank gets the same causal work). Everything
outside attention is per token, so only attention communicates (``parallel.ring_attention``).

The model receives the whole sample on every CP rank (token ids are cheap next to activations)
and keeps its own tokens with ``local_chunks``; positions (RoPE, learned tables) and document ids
are computed on the whole sequence first, so each token keeps its *global* position and the
document it belongs to across chunk boundaries.
"""

from __future__ import annotations

import torch


def check_context_parallel(seq_length: int, cp: int, tp: int = 1, sequence_parallel: bool = False,
                           attention_dropout: float = 0.0) -> None:
    """The sequence must cut into 2·cp equal chunks (and each rank's 2 chunks over TP under
    sequence parallelism); raises ValueError naming the field and the fix."""
    if cp == 1:
        return
    if seq_length % (2 * cp):
        raise ValueError(f"model.seq_length={seq_length} is not divisible by 2*parallel.cp="
                         f"{2 * cp}: context parallelism cuts every sequence into 2*cp chunks; "
                         f"use a seq_length that is a multiple of {2 * cp} or another parallel.cp")
    local = seq_length // cp
    if sequence_parallel and local % tp:
        raise ValueError(f"model.seq_length={seq_length}: each CP rank's {local} tokens are split "
                         f"over parallel.tp={tp} by sequence parallelism; use a seq_length that is "
                         f"a multiple of {2 * cp * tp // _gcd(2, tp)} or turn "
                         f"parallel.sequence_parallel off")
    if attention_dropout > 0:
        raise ValueError(f"model.attention_dropout={attention_dropout} with parallel.cp={cp}: "
                         f"the ring attention computes exact probabilities with no dropout; set "
                         f"model.attention_dropout=0 or parallel.cp=1")


def _gcd(a: int, b: int) -> int:
    while b:
        a, b = b, a % b
    return a


def chunk_index(cp_rank: int, cp: int) -> tuple[int, int]:
    """The two chunks of the sequence that CP rank ``cp_rank`` holds, in the order it holds them."""
    return cp_rank, 2 * cp - 1 - cp_rank


def local_positions(seq_length: int, cp_rank: int, cp: int, device=None) -> torch.Tensor:
    """Global positions [s/cp] of the tokens CP rank ``cp_rank`` holds."""
    c = seq_length // (2 * cp)
    a, b = chunk_index(cp_rank, cp)
    return torch.cat([torch.arange(a * c, (a + 1) * c, device=device),
                      torch.arange(b * c, (b + 1) * c, device=device)])


def local_chunks(x: torch.Tensor, cp_rank: int, cp: int, dim: int = 1) -> torch.Tensor:
    """This CP rank's two chunks of ``x`` along ``dim`` (the whole sequence), concatenated."""
    if cp == 1:
        return x
    s = x.shape[dim]
    if s % (2 * cp):
        raise ValueError(f"sequence length {s} is not divisible by 2*parallel.cp={2 * cp}; use "
                         f"batches whose length is a multiple of {2 * cp}")
    pieces = x.chunk(2 * cp, dim=dim)
    a, b = chunk_index(cp_rank, cp)
    return torch.cat([pieces[a], pieces[b]], dim=dim)
