#!/usr/bin/env python
"""Tokenize a corpus into zerotron token files (``<output-prefix>.bin`` / ``.idx``).

Example:
    python scripts/preprocess_data.py data/*.jsonl --text-field text \\
        --tokenizer tokenizers/my32k.model --output-prefix tokens/mycorpus --workers 8 --streaming

Inputs are anything ``datasets`` reads: local text / json / jsonl / parquet / arrow files or
directories, a ``save_to_disk`` directory, or a hub name. ``--streaming`` reads row by row
(bounded memory, no Arrow cache on disk): use it for corpora larger than memory; without it the
Arrow cache goes to .cache/zerotron/datasets (or $HF_DATASETS_CACHE). Progress shows documents
(of the total, with an ETA, when the reader knows it), documents/s and tokens/s: a bar on a
terminal, a plain line every 10 s in a log file. The final report gives throughput and peak
resident memory. Every document ends with the tokenizer's end-of-document id (and an HF
tokenizer's documents begin with its bos, where it has one).
Exit codes: 0 written; 2 bad input (a missing file, malformed JSON named by file and line, a
missing text field), and then no output file is written.
"""

from __future__ import annotations

import argparse
import json
import os
import sys


from zerotron.data import Tokenizer, iter_texts, load_source
from zerotron.data.atomic import check_output_prefix
from zerotron.data.preprocess import WorkerDied, tokenize_to_file
from zerotron.data.sources import known_rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("inputs", nargs="+", help="files (a row per document; a .txt file is one document), "
                                              "directories, globs, or one hub dataset name")
    ap.add_argument("--text-field", default="text",
                    help="the column holding each document's text (default: %(default)s)")
    ap.add_argument("--tokenizer", required=True,
                    help="SentencePiece .model file (scripts/train_tokenizer.py) or a Hugging Face "
                         "tokenizer directory (tokenizer.json)")
    ap.add_argument("--output-prefix", required=True,
                    help="writes PREFIX.bin and PREFIX.idx; pass PREFIX as --data.data_path to training")
    ap.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) - 1),
                    help="encoding processes (default: the CPU count - 1 = %(default)s)")
    ap.add_argument("--streaming", action="store_true",
                    help="read row by row: bounded memory and no Arrow cache, for corpora larger than memory")
    ap.add_argument("--split", default="train",
                    help="dataset split of a hub or save_to_disk input (default: %(default)s)")
    ap.add_argument("--batch-size", type=int, default=256, help="documents per worker task (default: %(default)s)")
    ap.add_argument("--no-eod", action="store_true",
                    help="do not delimit documents (end-of-document id; an HF tokenizer's bos)")
    ap.add_argument("--no-progress", action="store_true", help="print no progress bar or progress lines")
    ap.add_argument("--json", action="store_true", help="print the report as one JSON line")
    args = ap.parse_args(argv)
    if args.workers < 1:
        ap.error(f"--workers must be >= 1, got {args.workers}")
    if args.batch_size < 1:
        ap.error(f"--batch-size must be >= 1, got {args.batch_size}")
    try:
        check_output_prefix("--output-prefix", args.output_prefix, "PREFIX.bin and PREFIX.idx")
        tok = Tokenizer.load(args.tokenizer)
        ds = load_source(args.inputs, args.text_field, streaming=args.streaming, split=args.split)
        stats = tokenize_to_file(iter_texts(ds, args.text_field), tok, args.output_prefix,
                                 workers=args.workers, append_eod=not args.no_eod,
                                 batch_size=args.batch_size, progress=not args.no_progress,
                                 total_docs=known_rows(ds))
    except (OSError, KeyError, ValueError, TypeError, WorkerDied) as exc:  # OSError: a full disk
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(stats))
    else:
        print(f"wrote {args.output_prefix}.bin/.idx: {stats['documents']:,} documents, "
              f"{stats['tokens']:,} tokens in {stats['seconds']:.1f} s = "
              f"{stats['tokens_per_s']:,.0f} tokens/s; peak RSS {stats['peak_rss_mb']:.0f} MB "
              f"(main), {stats['peak_worker_rss_mb']:.0f} MB (largest worker)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
