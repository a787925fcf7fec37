"""Token ids are checked where they are read: an id past the vocabulary stops the run naming
the token file and the document, whatever the ``.idx`` header claims (issue 46).

Reference: the corrupted ``.bin`` itself -- the document the error names must hold the bad id
(read back with numpy from the file, not through the loader).
"""

import numpy as np
import pytest
import torch

from zerotron.data import GPTDataset, IndexedTokenDataset, IndexedTokenWriter
from zerotron.training.batches import BatchLoader, TokenIdError

VOCAB, SEQ, MICRO, GLOBAL = 1024, 16, 2, 4
POISONED = 11  # the document whose ids are corrupted


def _corpus(tmp_path, poison: bool):
    prefix = str(tmp_path / "corpus")
    rng = np.random.default_rng(0)
    with IndexedTokenWriter(prefix, VOCAB) as w:
        for n in rng.integers(5, 40, size=30):
            w.add_document(rng.integers(0, VOCAB, size=int(n)))
    if poison:  # every 7th id of one document set to 5000 under a header that still says max < 1024
        idx = IndexedTokenDataset(prefix)
        start, end = int(idx.offsets[POISONED]), int(idx.offsets[POISONED + 1])
        tokens = np.memmap(prefix + ".bin", np.uint16, "r+")
        tokens[start:end:7] = 5000
        tokens.flush()
        del tokens, idx
    return prefix


@pytest.mark.parametrize("depth", [0, 2])
def test_out_of_vocabulary_id_names_file_and_document(tmp_path, depth):
    prefix = _corpus(tmp_path, poison=True)
    assert IndexedTokenDataset(prefix).max_token_id < VOCAB  # the header still claims a clean file
    ds = GPTDataset(prefix, None, SEQ, 8 * GLOBAL, seed=1, cache_dir=str(tmp_path))
    loader = BatchLoader(ds, MICRO, GLOBAL, GLOBAL // MICRO, 0, 1, torch.device("cpu"), depth=depth,
                         vocab_size=VOCAB)
    with pytest.raises(TokenIdError) as err:
        for step in range(8):  # the read-ahead thread finds it; the step that needs it raises
            loader.get(step * GLOBAL)
    loader.close()
    text = str(err.value)
    assert f"{prefix}.bin, document " in text and "token id 5000" in text
    assert f"[0, {VOCAB})" in text
    assert f"document {POISONED} " in text, text


def test_clean_files_load_the_same_with_the_check(tmp_path):
    prefix = _corpus(tmp_path, poison=False)
    ds = GPTDataset(prefix, None, SEQ, 8 * GLOBAL, seed=1, cache_dir=str(tmp_path))
    args = (ds, MICRO, GLOBAL, GLOBAL // MICRO, 0, 1, torch.device("cpu"))
    checked, plain = BatchLoader(*args, vocab_size=VOCAB), BatchLoader(*args)
    for step in range(4):
        for (x, y), (px, py) in zip(checked.get(step * GLOBAL), plain.get(step * GLOBAL)):
            assert torch.equal(x, px) and torch.equal(y, py)
    checked.close(), plain.close()


def test_a_token_file_cut_short_under_the_run_is_named_not_a_sigbus(tmp_path):
    prefix = _corpus(tmp_path, poison=False)
    ds = GPTDataset(prefix, None, SEQ, 8 * GLOBAL, seed=1, cache_dir=str(tmp_path))
    loader = BatchLoader(ds, MICRO, GLOBAL, GLOBAL // MICRO, 0, 1, torch.device("cpu"), depth=0,
                         vocab_size=VOCAB)
    loader.get(0)
    with open(prefix + ".bin", "r+b") as f:  # rewritten in place, shorter, as a new preprocess run
        f.truncate(100)
    with pytest.raises(TokenIdError, match=f"token file {prefix}.bin changed while the run reads it"):
        loader.get(GLOBAL)
