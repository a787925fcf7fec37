"""A checkpoint's Hugging Face tokenizer written back beside an exported model.

Why copy rather than rebuild: the kept files are the tokenizer the run read (``tokenizer.json``
and its configs, checked by SHA-256 in the checkpoint), so ``AutoTokenizer.from_pretrained`` on
the export encodes every text to the ids the run trained on. ``generation_config.json`` names
its bos, eos (the end-of-document id the token files hold, where ``generate`` stops) and pad
(eos when the tokenizer has none, so batched ``generate`` needs no extra token).
"""

from __future__ import annotations

from pathlib import Path

from zerotron.data.hf_tokenizer import HFTokenizer, copy_files


def _write(path: Path, data: bytes) -> None:
    path.write_bytes(data)  # the export's directory is renamed into place whole by the script


def special_ids(directory: Path) -> dict[str, int]:
    """``bos_token_id`` / ``eos_token_id`` / ``pad_token_id`` of the tokenizer in ``directory``."""
    tok = HFTokenizer.load(str(directory))
    ids = {"eos_token_id": tok.eod_id}  # raises naming the fix when there is no eos
    pad = tok.special_id("pad_token")
    ids["pad_token_id"] = tok.eod_id if pad is None else pad
    if tok.bos_id is not None:
        ids["bos_token_id"] = tok.bos_id
    return ids


def write_hf_tokenizer_dir(kept: Path, out: Path) -> dict[str, int]:
    """The kept files into ``out`` and ``generation_config.json``; returns the special ids for
    ``config.json``."""
    from transformers import GenerationConfig

    ids = special_ids(kept)
    copy_files(kept, out, _write)
    GenerationConfig(**ids).save_pretrained(out)
    return ids
