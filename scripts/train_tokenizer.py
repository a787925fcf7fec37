#!/usr/bin/env python
"""Train a SentencePiece tokenizer for zerotron from files, directories or a hub dataset.

Example:
    python scripts/train_tokenizer.py data/*.jsonl --text-field text \\
        --model-prefix tokenizers/my32k --vocab-size 32000

Writes ``<model-prefix>.model`` (pass it to preprocess_data.py --tokenizer) and ``.vocab``.
SentencePiece keeps every training sentence in memory, so cap a large corpus with
``--max-documents`` (a few million lines are plenty for a 32k-50k vocabulary).
Exit codes: 0 written; 2 bad input (a missing file, malformed JSON named by file and line, a
missing text field, an empty corpus).
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time


from zerotron.data import iter_texts, load_source, train_tokenizer
from zerotron.data.atomic import check_output_prefix


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("inputs", nargs="+", help="files (a row per document; a .txt file is one document), "
                                              "directories, globs, or one hub dataset name")
    ap.add_argument("--text-field", default="text",
                    help="the column holding each document's text (default: %(default)s)")
    ap.add_argument("--model-prefix", required=True, help="writes PREFIX.model and PREFIX.vocab")
    ap.add_argument("--vocab-size", type=int, required=True,
                    help="pieces in the vocabulary, the model's vocab_size (e.g. 32000)")
    ap.add_argument("--model-type", choices=["bpe", "unigram"], default="bpe",
                    help="SentencePiece algorithm (default: %(default)s)")
    ap.add_argument("--no-byte-fallback", action="store_true",
                    help="map characters unseen in training to <unk> instead of their UTF-8 bytes (loses text)")
    ap.add_argument("--max-documents", type=int, default=None,
                    help="train on the first N documents only (default: all; SentencePiece holds them in memory)")
    ap.add_argument("--split", default="train",
                    help="dataset split of a hub or save_to_disk input (default: %(default)s)")
    ap.add_argument("--threads", type=int, default=2, help="SentencePiece trainer threads (default: %(default)s)")
    args = ap.parse_args(argv)
    for flag, value, least in (("--vocab-size", args.vocab_size, 1), ("--threads", args.threads, 1),
                               ("--max-documents", args.max_documents, 1)):
        if value is not None and value < least:
            ap.error(f"{flag} must be >= {least}, got {value}")
    try:
        check_output_prefix("--model-prefix", args.model_prefix, "PREFIX.model and PREFIX.vocab")
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
