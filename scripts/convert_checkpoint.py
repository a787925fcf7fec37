"""Export a zerotron checkpoint (any TP/PP/DP/ZeRO layout) to one file or a Hugging Face model.

    python scripts/convert_checkpoint.py runs/tiny/checkpoints --safetensors out/model.safetensors --dtype bf16
    python scripts/convert_checkpoint.py runs/tiny/checkpoints/step_00000300 --hf out/gpt2-tiny

--hf writes the transformers class of the checkpoint's family: GPT2LMHeadModel, or for the Llama
family the class it was imported from with --init-from-hf (LlamaForCausalLM, MistralForCausalLM,
Qwen2ForCausalLM; Qwen2 for q/k/v biases, else Llama, when it records none).

Streams one tensor at a time: memory is bounded by the largest tensor, not the model. The --hf
directory also holds the run's tokenizer (tokenizer.json, tokenizer_config.json, tokenizer.model)
and generation_config.json, so AutoTokenizer.from_pretrained and generate work on it as they are.
Exit codes: 0 written, 2 a bad checkpoint or tokenizer, an output that cannot be written (a device
node such as /dev/full, a full disk): the message says which and the fix.
"""

import argparse
import os
import shutil
import sys
from pathlib import Path

from zerotron.data.atomic import nearest_existing, write_probe
from zerotron.checkpoint.files import (LOAD_EARLIER, PARTIAL_STEP_DIR, STEP_DIR, CheckpointError,
                                             complete_checkpoints, resolve_load_path)
from zerotron.config.run_config import ConfigError
from zerotron.checkpoint.export import export_safetensors
from zerotron.checkpoint.hf_export import export_hf as export_hf_class


def check_output(flag: str, out: str, directory: bool) -> None:
    """``out`` can be written, as a file or a directory, and lies in no checkpoint: an export into
    a step directory would replace files its checksums vouch for."""
    path = Path(out).absolute()
    if directory and path.is_file():
        raise ConfigError(f"{flag} {out} is a file; the Hugging Face export is a directory: name a new one")
    if not directory and path.is_dir():
        raise ConfigError(f"{flag} {out} is a directory; give the path of the .safetensors file to write")
    if not directory and path.exists() and not path.is_file():  # /dev/full, a FIFO: never replaced
        raise ConfigError(f"{flag} {out} exists and is not a regular file (a device, FIFO or "
                          f"socket); give the path of a .safetensors file to write")
    for above in [path, *path.parents] if directory else path.parents:
        if (above / "metadata.json").is_file() or STEP_DIR.match(above.name) or PARTIAL_STEP_DIR.match(above.name):
            raise ConfigError(f"{flag} {out} is inside the checkpoint {above}; write the export elsewhere")
    where = nearest_existing(path if directory else path.parent)
    if not os.path.isdir(where):
        raise ConfigError(f"{flag} {out}: {where} is a file, not a directory; write the export elsewhere")
    if write_probe(where) is not None:
        raise ConfigError(f"{flag} {out}: cannot write in {where}; choose a writable directory")


def export_hf(checkpoint: str, out: str, dtype: str, tokenizer: str | None) -> Path:
    """``export_hf_class`` (the checkpoint's class) into ``out``; a new directory is built under ``<out>.partial`` and renamed
    when complete, so a failure (a full disk, a bad tokenizer) leaves no half-written model."""
    final = Path(out)
    if final.exists():  # the user's own directory: written into, as before
        return export_hf_class(checkpoint, out, dtype, tokenizer)
    tmp = final.with_name(final.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        export_hf_class(checkpoint, str(tmp), dtype, tokenizer)
        tmp.rename(final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def earlier(path: Path) -> str:
    """What to export instead of a damaged ``path``: the newest complete checkpoint before it."""
    before = [p for p in complete_checkpoints(path.parent) if p.name < path.name]
    if not before:
        return "; there is no earlier checkpoint beside it"
    return f"; export an earlier one, e.g. {before[-1]}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", help="a step_XXXXXXXX directory, or a save directory (its newest complete one)")
    p.add_argument("--safetensors", help="write every parameter into this single .safetensors file")
    p.add_argument("--hf", help="write a transformers directory of the checkpoint's class (GPT2LMHeadModel, "
                                "LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM) with its tokenizer")
    p.add_argument("--tokenizer", help="the run's sentencepiece .model, only for checkpoints that do not keep "
                                       "their own (default: the checkpoint's copy)")
    p.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32",
                   help="dtype of the written weights (default: %(default)s)")
    args = p.parse_args(argv)
    if not args.safetensors and not args.hf:
        p.error("give --safetensors PATH and/or --hf DIR")
    path = None
    try:
        path, _ = resolve_load_path(args.checkpoint, field="checkpoint", otherwise="")
        for flag, out, directory in (("--safetensors", args.safetensors, False), ("--hf", args.hf, True)):
            if out:
                check_output(flag, out, directory)
        if args.safetensors:
            print(f"wrote {export_safetensors(str(path), args.safetensors, args.dtype)} (from {path})")
        if args.hf:
            print(f"wrote {export_hf(str(path), args.hf, args.dtype, args.tokenizer)} (from {path})")
    except OSError as e:  # a full disk, a quota, a file system gone read-only: one line, exit 2
        where = e.filename or "no file named"
        print(f"error: cannot write the export: {e.strerror or e} ({where}); free space or write "
              f"elsewhere", file=sys.stderr)
        return 2
    except (CheckpointError, ConfigError) as e:
        text = str(e)
        if text.endswith(LOAD_EARLIER) and path is not None:
            text = text.removesuffix(LOAD_EARLIER) + earlier(path)
        print(f"error: {text}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
