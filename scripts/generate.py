#!/usr/bin/env python
"""A quick look at what a model has learned: continue a prompt, greedy unless told otherwise.

    python scripts/generate.py --load runs/tiny/checkpoints --prompt "The optimizer"
    torchrun --nproc-per-node 2 scripts/generate.py --load CKPT --tp 2 --prompt-ids 1,2,3 --json

--load reads a zerotron checkpoint of any TP x PP x DP layout (its fp32 masters), --hf a
transformers directory (each rank reading only its rows, as --init-from-hf does), into --tp
ranks (default: every rank of the job; pipeline stages are not chained, so the model runs whole
on each TP group). Each new token reuses the keys and values of the earlier ones (a KV cache).
--prompt is encoded with the checkpoint's own tokenizer copy (--hf: the directory's), after the
tokenizer's bos where it has one, as the token files begin a document; --json prints
{"prompt_ids": [...], "output_ids": [...], "text": "..."} on rank 0 only (text: the decoded new
tokens, null without a tokenizer). Generation stops after --max-new-tokens or the tokenizer's
end-of-document id.
Exit codes: 0 done; 2 bad input (a flag, a checkpoint, a prompt), said on every rank before any
collective.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--load", help="a zerotron checkpoint (step_XXXXXXXX) or save directory")
    source.add_argument("--hf", help="a transformers Llama, Mistral, Qwen2 or GPT-2 directory "
                                     "(config.json, safetensors, tokenizer.json)")
    prompt = p.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="text, encoded with the model's tokenizer")
    prompt.add_argument("--prompt-ids", help="token ids, comma-separated: 1,2,3")
    p.add_argument("--tp", type=int, help="tensor-parallel ranks (default: the job's world size)")
    p.add_argument("--max-new-tokens", type=int, default=32,
                   help="at most this many new tokens (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0: greedy (default); > 0: sample from the softmax at this temperature")
    p.add_argument("--top-p", type=float, default=1.0,
                   help="sample among the most likely tokens holding this much probability "
                        "(default: %(default)s, all); needs --temperature > 0")
    p.add_argument("--seed", type=int, default=0, help="the sampling seed (default: %(default)s)")
    p.add_argument("--json", action="store_true", help="print one JSON object on rank 0")
    return p, p.parse_args(argv)


def check_flags(p, args, world: int) -> None:
    """Flag values, before anything is read or any process group exists (exit 2 on every rank)."""
    tp = world if args.tp is None else args.tp
    if tp != world:
        p.error(f"--tp {tp} on {world} rank(s): generate runs one TP group; start it with "
                f"torchrun --nproc-per-node {tp} (or pass --tp {world})")
    if args.max_new_tokens < 1:
        p.error(f"--max-new-tokens {args.max_new_tokens}: give at least 1")
    if not args.temperature >= 0:
        p.error(f"--temperature {args.temperature}: give 0 (greedy) or a positive temperature")
    if not 0 < args.top_p <= 1:
        p.error(f"--top-p {args.top_p}: give a probability in (0, 1]")
    if args.top_p < 1 and args.temperature == 0:
        p.error(f"--top-p {args.top_p} with greedy decoding does nothing; add --temperature T > 0")
    if args.prompt_ids is not None:
        try:
            args.ids = [int(i) for i in args.prompt_ids.split(",")]
        except ValueError:
            p.error(f"--prompt-ids {args.prompt_ids!r}: give integers separated by commas, "
                    f"e.g. 1,2,3")
    elif not args.prompt:
        p.error("--prompt is empty; give some text, or --prompt-ids")


def prepare(args):
    """Model source, config, tokenizer and prompt ids, checked on every rank (no collective);
    returns the config, the tokenizer (or None) and how to build the model on a grid."""
    from zerotron.data.hf_tokenizer import is_hf_dir
    from zerotron.checkpoint import for_generation as g

    if args.hf is not None:
        tokenizer = args.hf if is_hf_dir(args.hf) else None
        where = f"{args.hf} holds no tokenizer.json"
    else:
        path, meta, cfg = g.open_checkpoint(args.load)
        tokenizer = g.kept_tokenizer(path)
        where = f"{path} keeps no tokenizer"
    if args.prompt is not None:
        if tokenizer is None:
            raise ValueError(f"--prompt: {where} to encode it with; pass --prompt-ids")
        args.ids = g.prompt_from_text(tokenizer, args.prompt)
    if args.hf is not None:  # a sliding window is refused only where these tokens reach it
        cfg, family = g.hf_config(args.hf, len(args.ids) + args.max_new_tokens)
        reader = g.hf_tensors(args.hf, cfg, family)

        def build(grid, device):
            return g.model_from_hf(reader, cfg, family, grid, device)
    else:
        def build(grid, device):
            return g.model_from_checkpoint(path, meta, cfg, grid, device)
    bad = [i for i in args.ids if not 0 <= i < cfg.vocab_size]
    if bad or not args.ids:
        raise ValueError(f"--prompt-ids: {bad or 'none given'}; ids must lie in [0, "
                         f"{cfg.vocab_size}), the model's vocabulary")
    total = len(args.ids) + args.max_new_tokens
    if cfg.position_embedding_type == "learned" and total > cfg.max_positions:
        raise ValueError(f"{len(args.ids)} prompt + {args.max_new_tokens} new tokens exceed the "
                         f"model's {cfg.max_positions} positions; shorten the prompt or "
                         f"--max-new-tokens")
    cfg.validate(args.tp)  # heads and query groups divide over the TP ranks
    return cfg, tokenizer, build


def main(argv=None) -> int:
    p, args = parse(argv)
    world = int(os.environ.get("WORLD_SIZE", 1))
    check_flags(p, args, world)
    args.tp = world
    from zerotron.checkpoint.files import CheckpointError

    try:
        cfg, tokenizer, build = prepare(args)
    except (CheckpointError, OSError, ValueError) as e:  # ValueError: ConfigError too
        print(f"error: {str(e).replace('checkpoint.init_from_hf=', '--hf ')}", file=sys.stderr)
        return 2
    from zerotron.data.tokenizer import Tokenizer
    from zerotron.model.inference import generate
    from zerotron.parallel import Grid, ParallelDims
    from zerotron.parallel.runtime import init_distributed, shutdown

    import torch.distributed as dist

    started = not dist.is_initialized()  # a caller's group (tests) is left to the caller
    if started:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    env = init_distributed()
    try:
        grid = Grid(ParallelDims(tp=args.tp))
        model = build(grid, env.device)
        tok = Tokenizer.load(tokenizer) if tokenizer else None
        out = generate(model, args.ids, args.max_new_tokens, temperature=args.temperature,
                       top_p=args.top_p, seed=args.seed, eos_id=tok.eod_id if tok else None)
        text = tok.decode(out) if tok else None
        if env.rank == 0:
            if args.json:
                print(json.dumps({"prompt_ids": args.ids, "output_ids": out, "text": text}))
            else:
                print(text if text is not None else " ".join(map(str, out)))
    finally:
        if started:
            shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
