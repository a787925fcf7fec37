"""``scripts/generate.py`` continues a prompt exactly as transformers' greedy ``generate`` does.

Reference: ``LlamaForCausalLM`` (GQA 3:1, Llama-3.1 rope scaling, untied), ``Qwen2ForCausalLM``
(q/k/v biases, tied) and ``MistralForCausalLM`` built at random from local configs (no download)
in fp32, each continuing the same prompt for 32 tokens with ``generate(do_sample=False)``.
Their weights go into a zerotron checkpoint written at TP 1 by this file's own mapping
(``test_llama_parity.to_zerotron``, not the code under test), with a ``tokenizers`` BPE
tokenizer directory; ``generate.py --load CKPT --tp 2 --json`` must give the same ids, through
its KV cache (one prefill, then one token per forward), and the prompt's text through the kept
tokenizer the same ids as ``AutoTokenizer``. fp32 greedy tokens are compared exactly: an
argmax flips only where two logits tie within fp32 noise, which these seeds do not hit.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from tests.harness import spawn
from tests.hf_tokenizers import bpe_tokenizer_dir
from tests.model.test_llama_parity import FAMILIES, SHAPE, to_zerotron

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import generate as generate_script  # noqa: E402

NEW = 32
PROMPT = [5, 77, 130, 9, 64, 200, 31]
TEXT = "the lazy dog reads tokens"
GENERATED = ("llama", "qwen2", "mistral")


def zerotron_config(family, vocab):
    from zerotron.model import GPTConfig
    return GPTConfig(**{**SHAPE, "num_layers": 2, "vocab_size": vocab, "seq_length": 64},
                     **FAMILIES[family])


def hf_model(family, vocab):
    """The family's transformers model at SHAPE's sizes (2 layers), fp32, eos = the tokenizer's."""
    import transformers as tf

    s, f = SHAPE, FAMILIES[family]
    common = dict(vocab_size=vocab, hidden_size=s["hidden_size"],
                  intermediate_size=s["ffn_hidden_size"], num_hidden_layers=2,
                  num_attention_heads=s["num_heads"], num_key_value_heads=s["num_query_groups"],
                  max_position_embeddings=1024, rms_norm_eps=f.get("layernorm_eps", 1e-5),
                  tie_word_embeddings="untie_embeddings_and_output_weights" not in f,
                  attn_implementation="sdpa", bos_token_id=0, eos_token_id=1)
    rope = {"rope_type": "default", "rope_theta": f["rotary_base"]}
    if family == "llama":
        rope = {"rope_type": "llama3", "rope_theta": f["rotary_base"], "factor": 8.0,
                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 512}
        return tf.LlamaForCausalLM(tf.LlamaConfig(**common, rope_parameters=rope))
    if family == "qwen2":
        cfg = tf.Qwen2Config(**common, rope_parameters=rope, use_sliding_window=False)
        return tf.Qwen2ForCausalLM(cfg)
    cfg = tf.MistralConfig(**common, rope_parameters=rope, sliding_window=None)
    return tf.MistralForCausalLM(cfg)


def build_references(tmp: str) -> dict:
    """Per family: transformers' greedy continuation of PROMPT and of TEXT, and a checkpoint."""
    from transformers import AutoTokenizer

    from zerotron.model.gpt import GPT
    from zerotron.parallel import Grid, ParallelDims
    from zerotron.checkpoint.checkpointer import Checkpointer, RunIdentity
    from zerotron.config.run_config import CheckpointSection
    from zerotron.zero import ZeroConfig, ZeroOptimizer

    tok_dir = bpe_tokenizer_dir(Path(tmp) / "tokenizer")
    hf_tok = AutoTokenizer.from_pretrained(str(tok_dir))
    vocab = len(hf_tok)
    out = {}
    for i, family in enumerate(GENERATED):
        torch.manual_seed(20 + i)
        model = hf_model(family, vocab).eval()
        with torch.no_grad():  # norms and biases away from 1 / 0 so their weights matter
            for name, p in model.named_parameters():
                if "norm" in name or name.endswith("bias"):
                    p.add_(0.1 * torch.randn_like(p))
                if name.endswith(("q_proj.weight", "k_proj.weight")):
                    p.mul_(10)  # sharp attention: what a key's position is changes the tokens
                if name.endswith(("o_proj.weight", "down_proj.weight")):
                    p.mul_(20)  # the blocks outweigh the token's own (tied) embedding
        greedy = {}
        prompts = (("ids", PROMPT), ("text", hf_tok.encode(TEXT)))  # text: llama's only
        for key, ids in prompts if family == "llama" else prompts[:1]:
            got = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=NEW,
                                 eos_token_id=1, pad_token_id=1)
            greedy[key] = got[0, len(ids):].tolist()
        hf_dir = Path(tmp) / f"{family}-hf"  # the llama's weights sharded, with an index
        model.save_pretrained(hf_dir, max_shard_size="100KB" if family == "llama" else "1GB")
        hf_tok.save_pretrained(hf_dir)
        cfg = zerotron_config(family, vocab)
        ours = GPT(cfg, Grid(ParallelDims(), 0, 1))
        weights = to_zerotron({n: p.detach() for n, p in model.named_parameters()}, cfg)
        with torch.no_grad():
            for name, p in ours.named_parameters():
                full = weights[ours.global_name(name)]
                pad = full.new_zeros(p.shape[0] - full.shape[0], *full.shape[1:])  # vocab padding
                p.copy_(torch.cat([full, pad]))
        grid = Grid(ParallelDims(), 0, 1)
        opt = ZeroOptimizer(ours, grid, ZeroConfig(stage=1))
        model_meta = {**dataclasses.asdict(cfg), "architecture": cfg.architecture}
        saver = Checkpointer(CheckpointSection(save=f"{tmp}/{family}"), grid, opt.device,
                             RunIdentity(family, tokenizer=str(tok_dir)))
        saver.track(ours, opt, model_meta)
        path = saver.save(0, consumed_samples=0)
        out[family] = {"greedy": greedy, "--load": str(path), "--hf": str(hf_dir),
                       "text_ids": hf_tok.encode(TEXT)}
    out["gpt2"] = gpt2_through_the_export(tmp, tok_dir)
    return out


def gpt2_through_the_export(tmp: str, tok_dir: Path) -> dict:
    """A GPT-2 checkpoint that keeps an HF tokenizer, exported by ``convert_checkpoint.py --hf``:
    the export's ``AutoTokenizer`` gives the source directory's ids, its generation config the
    tokenizer's bos/eos/pad, and ``GPT2LMHeadModel`` from it the greedy reference."""
    import convert_checkpoint
    from transformers import AutoTokenizer, GPT2LMHeadModel, GenerationConfig

    from zerotron.model import GPTConfig
    from zerotron.model.gpt import GPT
    from zerotron.parallel import Grid, ParallelDims
    from zerotron.checkpoint.checkpointer import Checkpointer, RunIdentity
    from zerotron.config.run_config import CheckpointSection
    from zerotron.zero import ZeroConfig, ZeroOptimizer

    source = AutoTokenizer.from_pretrained(str(tok_dir))
    cfg = GPTConfig(num_layers=2, hidden_size=48, num_heads=4, vocab_size=len(source),
                    seq_length=64, gelu_approximate="none")
    grid = Grid(ParallelDims(), 0, 1)
    model = GPT(cfg, grid, seed=7)
    with torch.no_grad():  # as the families' references: sharp attention, strong blocks
        for name, p in model.named_parameters():
            p.mul_(10 if name.endswith("qkv.weight") else 20 if name.endswith("fc2.weight") else 1)
    opt = ZeroOptimizer(model, grid, ZeroConfig(stage=1))
    meta = {**dataclasses.asdict(cfg), "architecture": cfg.architecture}
    saver = Checkpointer(CheckpointSection(save=f"{tmp}/gpt2"), grid, opt.device,
                         RunIdentity("gpt2", tokenizer=str(tok_dir)))
    saver.track(model, opt, meta)
    path = saver.save(0, consumed_samples=0)
    assert (path / "tokenizer" / "tokenizer.json").is_file()  # the checkpoint keeps its own copy
    out = f"{tmp}/gpt2-hf"
    assert convert_checkpoint.main([str(path), "--hf", out]) == 0
    exported = AutoTokenizer.from_pretrained(out)
    for text in (TEXT, "def forward(self, x): return x + 1 # naïve ▁"):
        assert exported.encode(text) == source.encode(text), text
    gen = GenerationConfig.from_pretrained(out)
    assert (gen.bos_token_id, gen.eos_token_id, gen.pad_token_id) == (0, 1, 2)
    hf = GPT2LMHeadModel.from_pretrained(out).eval()
    got = hf.generate(torch.tensor([PROMPT]), do_sample=False, max_new_tokens=NEW)
    return {"greedy": {"ids": got[0, len(PROMPT):].tolist()}, "--load": str(path)}


def generate_in_ranks(refs: dict) -> dict:
    """``generate.main`` at TP 2 on these ranks, for each reference; rank 0's JSON."""
    results = {}
    for family, ref in refs.items():
        for key, prompt in (("ids", ["--prompt-ids", ",".join(map(str, PROMPT))]),
                            ("text", ["--prompt", TEXT])):
            if key not in ref["greedy"]:
                continue
            for source in ("--load", "--hf"):
                if source not in ref:
                    continue
                printed = io.StringIO()
                with contextlib.redirect_stdout(printed):
                    code = generate_script.main([source, ref[source], "--tp", "2", *prompt,
                                                 "--max-new-tokens", str(NEW), "--json"])
                assert code == 0, f"{family} {key} {source}: exit {code}"
                results[(family, key, source)] = (json.loads(printed.getvalue())
                                                  if printed.getvalue() else None)
    return results


def test_generate_at_tp2_equals_transformers_greedy(tmp_path):
    refs = spawn(build_references, 1, str(tmp_path), timeout=300)[0]
    ranks = spawn(generate_in_ranks, 2, refs, timeout=300)
    assert all(v is None for v in ranks[1].values())  # rank 0 prints, the others do not
    # the text prompt: bos + the text's ids, as AutoTokenizer gives them
    for (family, key, source), got in ranks[0].items():
        what = f"{family} {key} {source}"
        assert got["output_ids"] == refs[family]["greedy"][key], what
        assert len(got["output_ids"]) == NEW or got["output_ids"][-1] == 1, what
        assert got["prompt_ids"] == (PROMPT if key == "ids" else refs[family]["text_ids"]), what
    assert len(ranks[0]) == 3 * 2 + 2 + 1  # ids from both sources, llama's text too, gpt2's
    # the command itself, under torchrun: one family
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           str(ROOT / "scripts" / "generate.py"), "--hf", refs["llama"]["--hf"], "--tp", "2",
           "--prompt-ids", ",".join(map(str, PROMPT)), "--max-new-tokens", str(NEW), "--json"]
    env = {**os.environ, "ZEROTRON_DEVICE": "cpu", "OMP_NUM_THREADS": "1"}
    run = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stderr
    lines = [line for line in run.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1, run.stdout  # rank 0 only
    assert json.loads(lines[0])["output_ids"] == refs["llama"]["greedy"]["ids"]
