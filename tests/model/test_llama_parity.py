"""The Llama-family block against ``transformers``, float64, at TP 1, TP 2 and TP 2 x PP 2.

Reference: ``LlamaForCausalLM`` (GQA 3:1, Llama-3.1 rope scaling, untied), ``Qwen2ForCausalLM``
(q/k/v biases, tied), ``MistralForCausalLM`` (untied) and ``Qwen3ForCausalLM`` (qk_layernorm),
built at random from local configs (no download) in float64 with odd sizes (vocab 97, ffn 44).
Their weights are written into zerotron's layout by this file's own plan (q/k/v rows regrouped
per query group, gate and up rows alternated, the vocabulary padded and split; the TP split of
every parameter written here, not read from the code under test). Compared, relative to the
reference's largest magnitude: the logits and every parameter's gradient, to 1e-10.

transformers' RMSNorm normalises in fp32 whatever its input (a mixed-precision choice); the
reference's runs the same formula at the input's precision, so it stays float64. Its attention
is SDPA's (the eager path's softmax is fp32 too). RoPE tables are fp32 in both, by design.

One forked process builds the references (transformers is imported once) and checks TP 1; 2
ranks check TP 2 (plain, SP, full recompute with Pa, selective recompute with SP); 4 ranks
TP 2 x PP 2, 1F1B and interleaved (v 2), with and without SP.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.harness import spawn

REL_TOL = 1e-10
SHAPE = dict(num_layers=4, hidden_size=48, num_heads=6, num_query_groups=2, vocab_size=97,
             seq_length=12, make_vocab_size_divisible_by=8, ffn_hidden_size=44,
             position_embedding_type="rope", normalization="RMSNorm", activation="swiglu",
             add_bias_linear=False)
UNTIED = dict(untie_embeddings_and_output_weights=True)
FAMILIES = {  # zerotron's fields for each reference family
    "llama": dict(rotary_base=500000.0, rope_scaling=True, rope_scaling_factor=8.0,
                  rope_scaling_original_max_position_embeddings=512, **UNTIED),
    "qwen2": dict(rotary_base=1e6, layernorm_eps=1e-6, add_qkv_bias=True),
    "mistral": dict(rotary_base=1e6, **UNTIED),
    "qwen3": dict(rotary_base=1e6, layernorm_eps=1e-6, qk_layernorm=True, **UNTIED),
}
# the TP split dimension of each parameter (None: every rank holds it whole)
SPLIT = {"embedding.word.weight": 0, "output_layer": 0, "attn.qkv.weight": 0, "attn.qkv.bias": 0,
         "mlp.fc1.weight": 0, "attn.proj.weight": 1, "mlp.fc2.weight": 1}


def gpt_config(family):
    from zerotron.model import GPTConfig
    return GPTConfig(**SHAPE, **FAMILIES[family])


def hf_model(family):
    import transformers as tf

    s, f = SHAPE, FAMILIES[family]
    tied = not f.get("untie_embeddings_and_output_weights", False)
    common = dict(vocab_size=s["vocab_size"], hidden_size=s["hidden_size"],
                  intermediate_size=s["ffn_hidden_size"], num_hidden_layers=s["num_layers"],
                  num_attention_heads=s["num_heads"], num_key_value_heads=s["num_query_groups"],
                  max_position_embeddings=64, rms_norm_eps=f.get("layernorm_eps", 1e-5),
                  tie_word_embeddings=tied, attn_implementation="sdpa")
    rope = {"rope_type": "default", "rope_theta": f["rotary_base"]}
    if family == "llama":
        rope = {"rope_type": "llama3", "rope_theta": f["rotary_base"], "factor": 8.0,
                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 512}
        cfg = tf.LlamaConfig(**common, rope_parameters=rope, attention_bias=False, mlp_bias=False)
        return tf.LlamaForCausalLM(cfg)
    if family == "qwen2":
        cfg = tf.Qwen2Config(**common, rope_parameters=rope, use_sliding_window=False)
        return tf.Qwen2ForCausalLM(cfg)
    if family == "mistral":
        cfg = tf.MistralConfig(**common, rope_parameters=rope, sliding_window=None)
        return tf.MistralForCausalLM(cfg)
    cfg = tf.Qwen3Config(**common, rope_parameters=rope, head_dim=8, attention_bias=False,
                         use_sliding_window=False)
    return tf.Qwen3ForCausalLM(cfg)


def float64_rmsnorm(self, x):
    """transformers' RMSNorm formula at the input's precision (its own upcasts to fp32)."""
    return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))


def to_zerotron(sd, cfg):
    """transformers' tensors (weights or gradients) under zerotron's global names, vocabulary
    unpadded."""
    h, g, d = cfg.hidden_size, cfg.query_groups, cfg.head_dim
    rep = cfg.num_heads // g
    out = {"embedding.word.weight": sd["model.embed_tokens.weight"],
           "final_ln.weight": sd["model.norm.weight"]}
    if cfg.untie_embeddings_and_output_weights:
        out["output_layer"] = sd["lm_head.weight"]
    for i in range(cfg.num_layers):
        hf, zt = f"model.layers.{i}.", f"layers.{i}."
        out[zt + "ln1.weight"] = sd[hf + "input_layernorm.weight"]
        out[zt + "ln2.weight"] = sd[hf + "post_attention_layernorm.weight"]
        for kind in ("weight", "bias"):
            if hf + f"self_attn.q_proj.{kind}" not in sd:
                continue
            q, k, v = (sd[hf + f"self_attn.{n}_proj.{kind}"] for n in "qkv")
            rest = q.shape[1:]  # per group: its rep query heads, then its k head, then its v head
            grouped = [q.reshape(g, rep * d, *rest), k.reshape(g, d, *rest), v.reshape(g, d, *rest)]
            out[zt + f"attn.qkv.{kind}"] = torch.cat(grouped, dim=1).reshape(-1, *rest)
        out[zt + "attn.proj.weight"] = sd[hf + "self_attn.o_proj.weight"]
        if hf + "self_attn.q_norm.weight" in sd:
            out[zt + "attn.q_norm.weight"] = sd[hf + "self_attn.q_norm.weight"]
            out[zt + "attn.k_norm.weight"] = sd[hf + "self_attn.k_norm.weight"]
        gate, up = sd[hf + "mlp.gate_proj.weight"], sd[hf + "mlp.up_proj.weight"]
        fc1 = torch.stack([gate, up], dim=1).reshape(-1, h)  # rows gate_0, up_0, gate_1, ...
        out[zt + "mlp.fc1.weight"] = fc1
        out[zt + "mlp.fc2.weight"] = sd[hf + "mlp.down_proj.weight"]
    return out


def references():
    """Per family: zerotron-named weights and gradients, logits, the batch; checks TP 1."""
    import transformers as tf

    m = tf.models
    for cls in (m.llama.modeling_llama.LlamaRMSNorm, m.qwen2.modeling_qwen2.Qwen2RMSNorm,
                m.mistral.modeling_mistral.MistralRMSNorm, m.qwen3.modeling_qwen3.Qwen3RMSNorm):
        cls.forward = float64_rmsnorm
    out = {}
    for i, family in enumerate(FAMILIES):
        torch.manual_seed(10 + i)
        model = hf_model(family).double()
        with torch.no_grad():  # norms away from 1 so their gradients and weights matter
            for name, p in model.named_parameters():
                if "norm" in name or name.endswith("bias"):
                    p.add_(0.1 * torch.randn_like(p))
        cfg = gpt_config(family)
        ids = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length))
        labels = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length))
        logits = model(input_ids=ids).logits
        F.cross_entropy(logits.reshape(-1, cfg.vocab_size), labels.reshape(-1)).backward()
        weights = to_zerotron({n: p.detach() for n, p in model.named_parameters()}, cfg)
        grads = to_zerotron({n: p.grad for n, p in model.named_parameters()}, cfg)
        out[family] = dict(weights=weights, grads=grads, logits=logits.detach(), ids=ids,
                           labels=labels)
    for family, ref in out.items():
        check_layout(family, ref, tp=1, pp=1)
    return out


def rel_err(got, want):
    return ((got - want).abs().max() / want.abs().max()).item()


def local_shard(full, name, cfg, tp, rank):
    dim = next((d for k, d in SPLIT.items() if name.endswith(k)), None)
    if name in ("embedding.word.weight", "output_layer"):  # the vocabulary padded for this TP size
        pad = full.new_zeros(cfg.padded_vocab_size(tp) - full.shape[0], full.shape[1])
        full = torch.cat([full, pad])
    return full if dim is None else full.chunk(tp, dim=dim)[rank]


def check_layout(family, ref, tp, pp, v=1, sp=False, ac=None):
    """Build this rank's piece of the layout, load the reference weights, compare logits and
    gradients."""
    from zerotron.activation import ActivationCheckpointConfig, apply_activation_checkpointing
    from zerotron.model.stages import build_stage, pipeline_step
    from zerotron.parallel import Grid, ParallelDims

    cfg, what = gpt_config(family), f"{family} tp={tp} pp={pp} v={v} sp={sp} ac={ac}"
    if tp * pp > 1:
        grid = Grid(ParallelDims(tp=tp, pp=pp, virtual_stages=v))
    else:
        grid = Grid(ParallelDims(), 0, 1)
    model = build_stage(cfg, grid, dtype=torch.float64, sequence_parallel=sp)
    if ac:
        apply_activation_checkpointing(model, grid, ActivationCheckpointConfig(**ac).validate())
    with torch.no_grad():
        for name, p in model.named_parameters():
            full = model.global_name(name)
            p.copy_(local_shard(ref["weights"][full], full, cfg, tp, grid.tp_rank))
    logits = forward_logits(model, grid, ref["ids"], v)
    if logits is not None:
        err = rel_err(logits[..., :cfg.vocab_size], ref["logits"])
        assert err <= REL_TOL, f"{what}: logits off by {err:.3g} relative"
    halves = [(ref["ids"][i:i + 1], ref["labels"][i:i + 1]) for i in range(2)]
    if pp == 1:
        model(ref["ids"], ref["labels"]).backward()
    else:
        pipeline_step(model, halves)
    for name, p in model.named_parameters():
        full = model.global_name(name)
        want = local_shard(ref["grads"][full], full, cfg, tp, grid.tp_rank)
        err = rel_err(p.grad, want)
        assert err <= REL_TOL, f"{what}: gradient of {full} off by {err:.3g} relative"
    return True


def forward_logits(model, grid, ids, v):
    """The whole model's logits (gathered over TP) on the last stage, None elsewhere: the virtual
    stages run in order, each sending its hidden state on to the next (rank r, chunk c -> r + 1)."""
    pp, x = grid.pp_size, ids
    shape = model.hidden_shape(ids.shape[0])
    with torch.no_grad():
        for c in range(v):
            for r in range(pp):
                if grid.pp_rank != r:
                    continue
                if (c, r) != (0, 0):
                    x = torch.empty(shape, dtype=torch.float64)
                    dist.recv(x, src=grid.pp_group.ranks[(r - 1) % pp])
                x = model(x, chunk=c if v > 1 else None)
                if (c, r) != (v - 1, pp - 1):
                    dist.send(x.contiguous(), dst=grid.pp_group.ranks[(r + 1) % pp])
    if not grid.is_last_stage:
        return None
    parts = [torch.empty_like(x) for _ in range(grid.tp_size)]
    if grid.tp_size > 1:
        dist.all_gather(parts, x.contiguous(), group=grid.tp_group.pg)
    else:
        parts[0] = x
    return torch.cat(parts, dim=-1)


def run_layouts(refs, layouts):
    for family, tp, pp, v, sp, ac in layouts:
        check_layout(family, refs[family], tp, pp, v, sp, ac)
    return True


@pytest.fixture(scope="module")
def refs():
    return spawn(references, 1, timeout=300)[0]


def test_tp1_and_tp2_equal_transformers(refs):
    full_pa = dict(checkpoint_activations=True, partition_activations=True)
    layouts = [(f, 2, 1, 1, False, None) for f in FAMILIES] + [
        ("llama", 2, 1, 1, True, None), ("llama", 2, 1, 1, False, full_pa),
        ("qwen3", 2, 1, 1, True, dict(recompute_granularity="selective"))]
    assert spawn(run_layouts, 2, refs, layouts, timeout=300) == [True, True]


def test_tp2_pp2_and_interleaved_equal_transformers(refs):
    layouts = [("llama", 2, 2, 1, True, None), ("llama", 2, 2, 2, False, None),
               ("qwen2", 2, 2, 2, True, None),
               ("mistral", 2, 2, 1, False, dict(recompute_granularity="selective"))]
    assert spawn(run_layouts, 4, refs, layouts, timeout=300) == [True] * 4
