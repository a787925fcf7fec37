#!/usr/bin/env python
"""Train a SentencePiece tokenizer for zerotron from files, directories or a hub dataset.

Example:
    python scripts/train_tokenizer.py data/*.jsonl --text-field text \\
        --model-prefix tokenizers/my32k --vocab-size 32000

Writes ``<model-prefix>.model`` (pass it to preprocess_data.py --tokenizer) and ``.vocab``.
SentencePiece keeps every training sentence in memory, so cap a large corpus with
``--max-documents`` (a few million lines are plenty for a 32k-50k vocabulary).
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time


from zerotron.data import iter_texts, load_source, train_tokenizer


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("inputs", nargs="+", help="files, directories, globs, or one hub dataset name")
    ap.add_argument("--text-field", default="text")
    ap.add_argument("--model-prefix", required=True)
    ap.add_argument("--vocab-size", type=int, required=True)
    ap.add_argument("--model-type", choices=["bpe", "unigram"], default="bpe")
    ap.add_argument("--no-byte-fallback", action="store_true")
    ap.add_argument("--max-documents", type=int, default=None)
    ap.add_argument("--split", default="train")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    try:
        ds = load_source(args.inputs, args.text_field, streaming=True, split=args.split)
        texts = itertools.islice(iter_texts(ds, args.text_field), args.max_documents)
        t0 = time.perf_counter()
        tok = train_tokenizer(texts, args.model_prefix, args.vocab_size, args.model_type,
                              byte_fallback=not args.no_byte_fallback, num_threads=args.threads,
                              text_field=args.text_field)
    except (FileNotFoundError, KeyError, ValueError, TypeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {args.model_prefix}.model: vocab {tok.vocab_size}, eod id {tok.eod_id}, "
          f"{time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
