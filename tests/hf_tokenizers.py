"""A tiny Hugging Face tokenizer built locally for tests: ``tokenizers`` BPE trained on a few
lines, wrapped in transformers' ``PreTrainedTokenizerFast`` and saved with ``save_pretrained``
(``tokenizer.json`` + ``tokenizer_config.json``), as Llama-3 / Qwen2 / Mistral ship theirs.
Nothing is downloaded."""

from __future__ import annotations

import json
from pathlib import Path

LINES = ["the quick brown fox jumps over the lazy dog",
         "a model reads tokens and predicts the next",
         "zero redundancy optimizer partitions states gradients and parameters",
         "pipeline stages send activations to the next stage", "def forward(self, x): return x + 1",
         "tensor parallel layers split heads over ranks"] * 4


def bpe_tokenizer_dir(out: Path, vocab_size: int = 320, bos: bool = True,
                      lines: list[str] = LINES) -> Path:
    """Save a byte-level BPE tokenizer of ``vocab_size`` tokens (``<s>``, ``</s>``, ``<pad>``,
    256 bytes first) into ``out``; with ``bos`` it names ``<s>`` its bos token and its
    post-processor prepends it (Llama's convention), without it no bos (Qwen2's)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<s>", "</s>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(lines, trainer)
    if bos:
        tok.post_processor = processors.TemplateProcessing(single="<s> $A",
                                                           special_tokens=[("<s>", 0)])
    specials = dict(eos_token="</s>", pad_token="<pad>") | (dict(bos_token="<s>") if bos else {})
    PreTrainedTokenizerFast(tokenizer_object=tok, **specials).save_pretrained(out)
    return Path(out)


def swap_two_tokens(source: Path, out: Path) -> Path:
    """A copy of ``source`` whose vocabulary swaps two ordinary tokens' ids: the same size, other
    ids for the same text (what a token file's ``.idx`` header cannot tell apart)."""
    from tokenizers import Tokenizer

    data = json.loads((source / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[-2:]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    out.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        if (source / name).is_file():
            (out / name).write_text((source / name).read_text())
    (out / "tokenizer.json").write_text(json.dumps(data))
    Tokenizer.from_file(str(out / "tokenizer.json"))  # still loads
    return out
