"""Document masking of packed samples: Megatron's reset_attention_mask / reset_position_ids.

A training sample packs several documents, each ended by the end-of-document token. With
``reset_attention_mask`` a token attends only to earlier tokens of its own document (the end
token belongs to the document it ends), and with ``reset_position_ids`` positions restart at 0
after each end token, so a packed sample computes what each of its documents would alone.

On a GPU the mask is ``flex_attention``'s document-causal block mask (torchtitan's): only the
blocks a document touches are computed and nothing of size b·a·s² is ever made. On a CPU, where
exactness matters more than memory, SDPA takes the dense boolean mask.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F


def document_layout(ids: torch.Tensor, eod: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(document index, position inside the document), each [b, s], of every token of ``ids``."""
    ends = (ids == eod).long()
    doc = torch.cumsum(ends, dim=1) - ends  # the end token stays in the document it closes
    index = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
    starts = torch.where(ends.bool(), index + 1, torch.zeros_like(index))  # the next one's start
    starts = torch.cat([torch.zeros_like(index[:, :1]), starts[:, :-1]], dim=1)  # seen one later
    start = torch.cummax(starts, dim=1).values  # each token's document start
    return doc, index - start


def document_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       doc: torch.Tensor) -> torch.Tensor:
    """Causal attention inside each document; q [b, heads, s, d], k and v [b, groups, s, d],
    doc [b, s]."""
    gqa = k.shape[1] != q.shape[1]
    if q.is_cuda:
        return _flex(q, k, v, doc, gqa)
    s = q.shape[2]
    causal = torch.ones(s, s, dtype=torch.bool, device=q.device).tril()
    mask = (doc.unsqueeze(2) == doc.unsqueeze(1)) & causal  # [b, s, s]: same document, not later
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.unsqueeze(1), enable_gqa=gqa)


def _flex(q, k, v, doc, gqa):
    from torch.nn.attention.flex_attention import create_block_mask

    def document_causal(b, h, q_idx, kv_idx):
        return (doc[b, q_idx] == doc[b, kv_idx]) & (q_idx >= kv_idx)

    b, s = doc.shape
    block_mask = create_block_mask(document_causal, b, None, s, s, device=q.device)
    return _compiled_flex()(q, k, v, block_mask=block_mask, enable_gqa=gqa)


@functools.cache
def _compiled_flex():
    """``flex_attention`` compiled once per process (eager flex materialises the scores)."""
    from torch.nn.attention.flex_attention import flex_attention
    return torch.compile(flex_attention, dynamic=False)
