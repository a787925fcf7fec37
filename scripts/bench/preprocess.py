#!/usr/bin/env python
"""Benchmark scripts/preprocess_data.py (streaming, bounded pool) against a plain ``datasets.map``.

Generates a ~100 MB jsonl corpus in a fresh directory under ``--out`` (default
``runs/bench/preprocess``, removed afterwards unless ``--keep``) from standard-library docstrings
(shuffled and repeated; never committed), takes the default-corpus tokenizer, and runs, each in
its own process and measured the same way (wall time; peak RSS of the process tree, sampled
every 0.2 s, summed over processes -- an upper bound, since forked workers share pages):

  1. zerotron: ``preprocess_data.py --streaming --workers N`` -> .bin/.idx
  2. peer:     ``load_dataset("json")`` + ``Dataset.map(batched encode, num_proc=N)``

    python scripts/bench/preprocess.py [--size-mb 100] [--workers 2] [--out DIR] [--keep]

Exits 1 if the two token counts disagree or a method fails; 2 on a bad flag, before any work, or
when a method refuses its input (its message is printed).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np
import psutil

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))

from zerotron.data import build_default_corpus
from zerotron.data.default_corpus import harvest_stdlib_texts
from zerotron.testing.bench_args import positive_float, positive_int

PEER = r"""
import json, sys, time
import datasets
from zerotron.data import Tokenizer
src, model, cache, workers = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
t = time.perf_counter()
tok = Tokenizer.load(model)
ds = datasets.load_dataset("json", data_files=src, split="train", cache_dir=cache)
out = ds.map(lambda b: {"ids": tok.encode_batch(b["text"])}, batched=True, batch_size=256,
             num_proc=workers if workers > 1 else None, remove_columns=ds.column_names)
tokens = sum(len(x) for b in out.iter(batch_size=4096) for x in b["ids"])
print(json.dumps({"tokens": tokens, "documents": len(out), "seconds": time.perf_counter() - t}))
"""


def make_corpus(path: str, size_mb: float, seed: int = 0) -> int:
    texts = harvest_stdlib_texts()
    rng = np.random.default_rng(seed)
    written = docs = 0
    with open(path, "w", encoding="utf-8") as f:
        while written < size_mb * 1e6:
            order = rng.permutation(len(texts))
            for i in range(0, len(order) - 4, 4):  # documents of ~4 joined texts (~1 KB)
                line = json.dumps({"id": docs, "text": "\n\n".join(texts[j] for j in order[i:i + 4])})
                f.write(line + "\n")
                written += len(line) + 1
                docs += 1
                if written >= size_mb * 1e6:
                    break
    return docs


class ChildFailed(Exception):
    """A measured command exited non-zero; ``code`` is its exit status, the message its stderr's tail."""

    def __init__(self, name: str, code: int, stderr: str):
        super().__init__(f"{name} exited {code}" + (f":\n{stderr}" if stderr else " and printed nothing on stderr"))
        self.code = code


def run_measured(name: str, cmd: list[str], log: str) -> tuple[dict, float, float, float]:
    """(last JSON line of stdout, wall s, peak tree RSS MiB, peak main RSS MiB). stderr goes to
    ``log`` (a file: a pipe left unread could fill and stall the child), read back on failure."""
    t = time.perf_counter()
    with open(log, "w") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, cwd=ROOT)
        ps = psutil.Process(proc.pid)
        peak_tree = peak_main = 0.0
        while proc.poll() is None:
            try:
                main = ps.memory_info().rss
                kids = sum(c.memory_info().rss for c in ps.children(recursive=True))
                peak_main, peak_tree = max(peak_main, main), max(peak_tree, main + kids)
            except psutil.Error:
                pass
            time.sleep(0.2)
        out = proc.stdout.read()
    if proc.returncode != 0:
        with open(log) as f:
            tail = "".join(f.readlines()[-20:]).rstrip()
        raise ChildFailed(name, proc.returncode, tail)
    result = json.loads(out.strip().splitlines()[-1])
    return result, time.perf_counter() - t, peak_tree / 2**20, peak_main / 2**20


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mb", type=positive_float, default=100, help="corpus size, MB (10^6 bytes)")
    ap.add_argument("--workers", type=positive_int, default=2, help="tokenizer processes of both methods")
    ap.add_argument("--out", default=os.path.join(ROOT, "runs", "bench", "preprocess"),
                    help="where the work directory is made (not the system temp dir: ~100 MB)")
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    args = ap.parse_args(argv)
    made_out = not os.path.isdir(args.out)
    os.makedirs(args.out, exist_ok=True)
    work = tempfile.mkdtemp(prefix="work_", dir=args.out)
    try:
        src = os.path.join(work, "corpus.jsonl")
        t = time.perf_counter()
        docs = make_corpus(src, args.size_mb)
        print(f"corpus: {src}, {os.path.getsize(src) / 1e6:.0f} MB, {docs:,} documents "
              f"({time.perf_counter() - t:.0f} s to generate)")
        _, model, _ = build_default_corpus(os.path.join(work, "default_corpus"))
        py = sys.executable
        rows = []
        ours = [py, "scripts/preprocess_data.py", src, "--tokenizer", model, "--output-prefix",
                os.path.join(work, "tokens"), "--workers", str(args.workers), "--streaming",
                "--no-progress", "--json"]
        peer = [py, "-c", PEER, src, model, os.path.join(work, "hf_cache"), str(args.workers)]
        for name, cmd in (("zerotron preprocess_data --streaming", ours), ("datasets.map", peer)):
            try:
                res, wall, tree, main_rss = run_measured(name, cmd, os.path.join(work, "stderr.log"))
            except ChildFailed as e:
                print(f"preprocess.py: {e}", file=sys.stderr)
                return 2 if e.code == 2 else 1
            rows.append((name, res["tokens"], wall, res["tokens"] / wall, tree, main_rss))
        print(f"\n{'method':<38}{'tokens':>13}{'wall s':>9}{'tokens/s':>13}{'peak tree RSS MiB':>18}"
              f"{'peak main RSS MiB':>18}")
        for name, tokens, wall, tps, tree, main_rss in rows:
            print(f"{name:<38}{tokens:>13,}{wall:>9.1f}{tps:>13,.0f}{tree:>18,.0f}{main_rss:>18,.0f}")
        ours_tok = rows[0][1] - docs  # minus one end-of-document id per document
        agree = ours_tok == rows[1][1]
        print(f"\ntoken counts agree (ours minus EOD ids == peer): {agree}")
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
            if made_out and not os.listdir(args.out):
                os.rmdir(args.out)
    if not agree:
        print(f"preprocess.py: FAILED: the two methods' token counts differ ({ours_tok:,} vs {rows[1][1]:,})",
              file=sys.stderr)
    return 0 if agree else 1


if __name__ == "__main__":
    sys.exit(main())
