"""Generation's forward: the model's own layers run over new tokens only, keys and values of the
tokens before them kept in a cache.

Why a separate path: training's forward (``GPT.forward``, ``TransformerBlock.forward``) sees whole
sequences and must stay as it is and as fast; generating one token at a time through it would
recompute every earlier token's keys and values (O(n²) GEMMs for n tokens). Here each block's
attention writes the new tokens' K and V into ``KVCache`` and attends over everything cached,
reusing the same modules (fused QKV, norms, SwiGLU/GeLU MLP, TP collectives) so the weights are
the trained ones and TP works as in training: each rank caches and attends over its own query
groups' K/V heads (grouped-query attention, Ainslie et al. 2023), and RoPE rotates each new
token at its absolute position (``start + i``). Sequence parallelism is not used here (a decode
step has one token); pipeline stages are not chained (``generate.py`` refuses pp > 1).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from zerotron.model.gpt import GPT
from zerotron.model.rope import rotary_tables, rotate
from zerotron.parallel import collectives as C
from zerotron.parallel import host_sync


class KVCache:
    """Per block: K and V [b, groups on this rank, max_len, head_dim], filled up to ``length``."""

    def __init__(self, model: GPT, batch: int, max_len: int):
        attn = model.blocks[0].attn
        shape = (batch, attn.groups_per_rank, max_len, attn.head_dim)
        p = next(model.parameters())
        self.keys = [p.new_zeros(shape) for _ in model.blocks]
        self.values = [p.new_zeros(shape) for _ in model.blocks]
        self.max_len, self.length = max_len, 0


def _attention(attn, x: torch.Tensor, cache: KVCache, layer: int, start: int) -> torch.Tensor:
    """``ParallelAttention.forward`` for tokens at positions start..start+s-1 of a cached prefix."""
    q, k, v = attn.split_heads(attn.qkv(x))  # [b, heads, s, d], [b, groups, s, d]
    cfg, s = attn.cfg, q.shape[2]
    if cfg.qk_layernorm:
        q, k = attn.q_norm(q), attn.k_norm(k)
    if cfg.position_embedding_type == "rope":
        cos, sin = rotary_tables(cfg, torch.arange(start, start + s, device=q.device), q.dtype)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
    end = start + s
    cache.keys[layer][:, :, start:end] = k
    cache.values[layer][:, :, start:end] = v
    keys, values = cache.keys[layer][:, :, :end], cache.values[layer][:, :, :end]
    # query i (position start + i) sees keys 0..start + i: causal within the new tokens
    visible = torch.ones(s, end, dtype=torch.bool, device=q.device).tril(start)
    y = F.scaled_dot_product_attention(q, keys, values, attn_mask=visible,
                                       enable_gqa=keys.shape[1] != q.shape[1])
    b = q.shape[0]
    return attn.proj(y.transpose(1, 2).reshape(b, s, attn.heads_per_rank * attn.head_dim))


@torch.no_grad()
def forward_cached(model: GPT, input_ids: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """Logits [b, padded vocab] of the last of ``input_ids`` [b, s] (the tokens after the cached
    ones), gathered over TP; the cache then holds them too. Padding columns are -inf."""
    if model.training or model.sequence_parallel or not (model.pre_process and model.post_process):
        raise ValueError("forward_cached needs the whole model (pp=1) in eval mode without "
                         "sequence parallelism")
    start, s = cache.length, input_ids.shape[1]
    if start + s > cache.max_len:
        raise ValueError(f"{start + s} tokens exceed the cache's {cache.max_len}")
    x = model.embedding.word(input_ids)
    if model.embedding.position is not None:  # GPT-2's learned positions
        x = x + model.embedding.position[start:start + s]
    for i, block in enumerate(model.blocks):
        x = x + _attention(block.attn, block.ln1(x), cache, i, start)
        x = x + block.mlp(block.ln2(x))
    cache.length = start + s
    h = model.final_ln(x[:, -1])
    local = F.linear(h, model.output_weight)  # [b, this rank's vocab slice]
    group = model.grid.tp_group
    b = local.shape[0]
    parts = local.new_empty((group.size * b, local.shape[1]))  # rank-major: [tp · b, V/tp]
    C.all_gather(parts, local.contiguous(), group)
    logits = parts.view(group.size, b, -1).permute(1, 0, 2).reshape(b, -1)
    logits[:, model.vocab_size:] = float("-inf")  # the TP padding rows are no tokens
    return logits


def _pick(logits: torch.Tensor, temperature: float, top_p: float,
          generator: torch.Generator | None) -> torch.Tensor:
    """Greedy (``temperature`` 0: the first largest logit, as ``torch.argmax`` and transformers
    pick) or a draw from the softmax at ``temperature`` over the smallest set of tokens whose
    probability reaches ``top_p`` (Holtzman et al. 2019). Every TP rank holds the same gathered
    logits and the same generator state, so every rank draws the same token."""
    if temperature == 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        before = sorted_probs.cumsum(-1) - sorted_probs  # mass of the tokens ranked above each
        sorted_probs[before >= top_p] = 0  # the first token is always kept
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@torch.no_grad()
def generate(model: GPT, prompt_ids: list[int], max_new_tokens: int, *, temperature: float = 0.0,
             top_p: float = 1.0, seed: int = 0, eos_id: int | None = None) -> list[int]:
    """The new token ids after ``prompt_ids``: one prefill forward over the prompt, then one
    forward per token over the cache; stops after ``eos_id`` (kept, as transformers keeps it)."""
    device = next(model.parameters()).device
    cache = KVCache(model, 1, len(prompt_ids) + max_new_tokens)
    generator = torch.Generator(device=device).manual_seed(seed) if temperature > 0 else None
    tokens = torch.tensor([prompt_ids], dtype=torch.long, device=device)
    out: list[int] = []
    for _ in range(max_new_tokens):
        nxt = _pick(forward_cached(model, tokens, cache), temperature, top_p, generator)
        out.append(int(host_sync.read(nxt, "the next token decides the stop")))
        if out[-1] == eos_id:
            break
        tokens = nxt.view(1, 1)
    return out
