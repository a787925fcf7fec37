"""Tiny random transformers models saved as model directories (no download), for the HF tests.

Sizes are odd on purpose (ffn 44, 3 query heads per group) and the vocabulary is the built-in
corpus's 1024, so a directory can also be trained on. Saved in fp32 with a small
``max_shard_size``, so the Llama directory is sharded (``model.safetensors.index.json``).
"""

from __future__ import annotations

SHAPE = dict(vocab_size=1024, hidden_size=48, intermediate_size=44, num_hidden_layers=4,
             num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=256)


def build(family: str, out: str, seed: int = 0, shard: str | None = None, **extra) -> str:
    """Save a random ``family`` (llama | qwen2 | mistral | gpt2) model to ``out``; returns it."""
    import torch
    import transformers as tf

    torch.manual_seed(seed)
    if family == "gpt2":
        cfg = tf.GPT2Config(vocab_size=1024, n_embd=48, n_layer=2, n_head=6, n_positions=256,
                            bos_token_id=0, eos_token_id=0, **extra)
        model = tf.GPT2LMHeadModel(cfg)
    elif family == "llama":
        rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64}
        cfg = tf.LlamaConfig(**{**SHAPE, **extra}, rope_parameters=rope, tie_word_embeddings=False)
        model = tf.LlamaForCausalLM(cfg)
    elif family == "qwen2":
        cfg = tf.Qwen2Config(**{**SHAPE, **extra}, tie_word_embeddings=True,
                             rope_parameters={"rope_type": "default", "rope_theta": 1e6})
        model = tf.Qwen2ForCausalLM(cfg)
    else:
        cfg = tf.MistralConfig(**{**SHAPE, "sliding_window": None, **extra},
                               tie_word_embeddings=False)
        model = tf.MistralForCausalLM(cfg)
    with torch.no_grad():  # norms and biases away from their init, so a swap would show
        for name, p in model.named_parameters():
            if "norm" in name or "ln" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    model.float().save_pretrained(out, max_shard_size=shard or "1GB")
    return out
