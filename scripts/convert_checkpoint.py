"""Export a zerotron checkpoint (any TP/PP/DP/ZeRO layout) to one file or a Hugging Face model.

    python scripts/convert_checkpoint.py runs/tiny/checkpoints --safetensors out/model.safetensors --dtype bf16
    python scripts/convert_checkpoint.py runs/tiny/checkpoints/step_00000300 --hf out/gpt2-tiny

Streams one tensor at a time: memory is bounded by the largest tensor, not the model.
"""

import argparse
import sys

from zerotron.training.checkpoint_io import CheckpointError
from zerotron.training.export import export_hf_gpt2, export_safetensors


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", help="a step_XXXXXXXX directory, or a save directory (its newest complete one)")
    p.add_argument("--safetensors", help="write every parameter into this single .safetensors file")
    p.add_argument("--hf", help="write a transformers GPT-2 directory (GPT2LMHeadModel.from_pretrained)")
    p.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32")
    args = p.parse_args()
    if not args.safetensors and not args.hf:
        p.error("give --safetensors PATH and/or --hf DIR")
    try:
        if args.safetensors:
            print(f"wrote {export_safetensors(args.checkpoint, args.safetensors, args.dtype)}")
        if args.hf:
            print(f"wrote {export_hf_gpt2(args.checkpoint, args.hf, args.dtype)}")
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
