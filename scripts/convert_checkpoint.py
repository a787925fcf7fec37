"""Export a zerotron checkpoint (any TP/PP/DP/ZeRO layout) to one file or a Hugging Face model.

    python scripts/convert_checkpoint.py runs/tiny/checkpoints --safetensors out/model.safetensors --dtype bf16
    python scripts/convert_checkpoint.py runs/tiny/checkpoints/step_00000300 --hf out/gpt2-tiny

Streams one tensor at a time: memory is bounded by the largest tensor, not the model. The --hf
directory also holds the run's tokenizer (tokenizer.json, tokenizer_config.json, tokenizer.model)
and generation_config.json, so AutoTokenizer.from_pretrained and generate work on it as they are.
Exit codes: 0 written, 2 a bad checkpoint or tokenizer (the message says which and the fix).
"""

import argparse
import sys

from zerotron.training.checkpoint_io import CheckpointError
from zerotron.training.export import export_hf_gpt2, export_safetensors


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", help="a step_XXXXXXXX directory, or a save directory (its newest complete one)")
    p.add_argument("--safetensors", help="write every parameter into this single .safetensors file")
    p.add_argument("--hf", help="write a transformers GPT-2 directory with its tokenizer "
                                "(GPT2LMHeadModel / AutoTokenizer.from_pretrained)")
    p.add_argument("--tokenizer", help="the run's sentencepiece .model, only for checkpoints that do not keep "
                                       "their own (default: the checkpoint's copy)")
    p.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32",
                   help="dtype of the written weights (default: %(default)s)")
    args = p.parse_args(argv)
    if not args.safetensors and not args.hf:
        p.error("give --safetensors PATH and/or --hf DIR")
    try:
        if args.safetensors:
            print(f"wrote {export_safetensors(args.checkpoint, args.safetensors, args.dtype)}")
        if args.hf:
            print(f"wrote {export_hf_gpt2(args.checkpoint, args.hf, args.dtype, args.tokenizer)}")
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
