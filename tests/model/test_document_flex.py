"""On a GPU, document masking runs ``flex_attention`` with a document-causal block mask
(``model/documents.py``); no GPU is lent to the suite, so the same path runs here on CPU tensors
(flex_attention compiles for CPU too) against the dense mask SDPA takes, in fp32, judged against
a float64 truth by torch's own fp32 error. Forward only: torch 2.13 has no flex_attention
backward on CPU ("does not support backward on CPU"), so its gradients wait for a GPU run."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tests.parity import assert_fp32
from zerotron.model import documents


def dense(q, k, v, doc):
    s = q.shape[2]
    mask = (doc[:, :, None] == doc[:, None, :]) & torch.ones(s, s, dtype=torch.bool).tril()
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], enable_gqa=True)


def test_the_gpu_document_mask_path_equals_the_dense_mask():
    g = torch.Generator().manual_seed(0)
    b, heads, groups, s, d = 2, 6, 2, 128, 16  # GQA 3:1; documents cross the 128-token blocks
    q, k, v = (torch.randn(b, n, s, d, generator=g) for n in (heads, groups, groups))
    doc = torch.tensor([[0] * 40 + [1] * 50 + [2] * 38, [0] * 127 + [1]])
    flex = documents._flex(q, k, v, doc, True)
    as64 = [t.double() for t in (q, k, v)]
    assert_fp32(flex, dense(*as64, doc), dense(q, k, v, doc), "flex document-causal attention")
