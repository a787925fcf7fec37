"""zerotron.data: tokenizer, datasets ingestion, indexed token files, GPT samples, samplers.

Flow: ``sources`` (any ``datasets`` input) -> ``tokenizer`` (SentencePiece) -> ``preprocess``
(parallel, streaming) -> ``indexed`` (``.bin``/``.idx`` token files) -> ``gpt_dataset`` (packed,
shuffled, cached samples; ``blending`` for several files) -> ``sampler`` (DP-aware, resumable).
``default_corpus`` builds a no-download corpus from the Python stdlib. Nothing here imports
``torch.distributed``: the trainer runs rank 0 first and the barrier.
"""

from zerotron.data.default_corpus import build_default_corpus
from zerotron.data.gpt_dataset import GPTDataset, build_index_cache, prepare_dataset_index
from zerotron.data.indexed import IndexedTokenDataset, IndexedTokenWriter
from zerotron.data.sampler import PretrainSampler
from zerotron.data.sources import iter_texts, load_source
from zerotron.data.tokenizer import Tokenizer, train_tokenizer

__all__ = ["Tokenizer", "train_tokenizer", "load_source", "iter_texts", "IndexedTokenWriter",
           "IndexedTokenDataset", "GPTDataset", "build_index_cache", "prepare_dataset_index",
           "PretrainSampler", "build_default_corpus"]
