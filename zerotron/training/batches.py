"""The micro-batches of a step, read ahead in a background thread so data never waits on the device.

Each step's micro-batches are gathered from the memory-mapped token files, stacked and (on a
real CUDA device, ``host_sync.pinned``) pinned by a worker thread while the device runs the
steps before; the step then only issues ``non_blocking`` copies from pinned memory, which do
not make the host wait for the device queue (a pageable copy does). On CPU nothing is pinned and
the copy is the tensor itself.

A step is named by its ``consumed`` samples, the number a checkpoint stores: the loader serves
whatever position it is asked for, so a resume, a rewind or an evaluation that starts over is
exact -- a prefetched step that is not the one asked for is dropped and the asked one is read
in the caller's thread. What is read is the sampler's (``data.sampler``) and is stacked and
split into (inputs, labels) exactly as without read-ahead, so batches are bitwise the same.
A read error is raised by the step that needs the batch, not by the read-ahead.

Every micro-batch's ids are checked against the model's vocabulary here, on the host, before
they reach the device (no device sync): a token file's header is only a claim, and an id past
the vocabulary would index the embedding out of range (TP 1) or be masked to a zero embedding
and a zero target logit by the vocab-parallel layers (TP > 1), training on in silence. The
error names the token file and the document that holds the id.
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future

import numpy as np
import torch

from zerotron.data import PretrainSampler
from zerotron.parallel import host_sync
from zerotron.config.run_config import ConfigError


class TokenIdError(ConfigError):
    """A token file holds an id outside the model's vocabulary, or changed under the run (found
    when a batch is read)."""


class BatchLoader:
    """``get(consumed)``: this DP rank's ``(inputs, labels)`` device pairs of the step that starts at
    ``consumed`` samples; the next ``depth`` steps are read ahead (0: none, no thread).
    ``vocab_size``: ids must lie in ``[0, vocab_size)`` (None: not checked)."""

    def __init__(self, dataset, micro_batch_size: int, global_batch_size: int, num_microbatches: int,
                 dp_rank: int, dp_size: int, device: torch.device, depth: int = 2,
                 vocab_size: int | None = None):
        if depth < 0:
            raise ValueError(f"data.prefetch={depth}: must be >= 0 (0 reads each step when it starts)")
        self.dataset, self.device, self.depth, self.vocab_size = dataset, device, depth, vocab_size
        self.micro, self.global_batch, self.num_micro = micro_batch_size, global_batch_size, num_microbatches
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self._pending: dict[int, Future] = {}
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._closed = False

    def indices(self, consumed: int) -> list[list[int]]:
        """Sample indices of this rank's micro-batches of the step at ``consumed`` (the sampler's)."""
        sampler = PretrainSampler(len(self.dataset), consumed, self.micro, self.global_batch,
                                  self.dp_rank, self.dp_size)
        it = iter(sampler)
        return [next(it) for _ in range(self.num_micro)]

    def host_tokens(self, consumed: int) -> list[torch.Tensor]:
        """Each micro-batch as one int64 ``[micro, seq + 1]`` host tensor, pinned when it feeds a GPU."""
        pin = host_sync.pinned(self.device)
        if hasattr(self.dataset, "check_unchanged"):  # a file cut short under us: named, not a SIGBUS
            try:
                self.dataset.check_unchanged()
            except ValueError as e:
                raise TokenIdError(str(e)) from None
        out = []
        for ix in self.indices(consumed):
            tokens = torch.from_numpy(np.stack([self.dataset[i] for i in ix]).astype(np.int64))
            self._check_ids(tokens, ix, consumed)
            out.append(tokens.pin_memory() if pin else tokens)
        return out

    def _check_ids(self, tokens: torch.Tensor, ix: list[int], consumed: int) -> None:
        """Raise ``TokenIdError`` if an id of this host micro-batch is outside the vocabulary,
        naming the token file and document it came from (``dataset.locate``, when it can)."""
        if self.vocab_size is None or tokens.numel() == 0:
            return
        bad = (tokens >= self.vocab_size) | (tokens < 0)
        if not bool(bad.any()):
            return
        row, position = (int(v) for v in bad.nonzero()[0])
        token, sample = int(tokens[row, position]), ix[row]
        where = f"sample {sample}"
        if hasattr(self.dataset, "locate"):
            prefix, doc = self.dataset.locate(sample, position)
            where = f"{prefix}.bin, document {doc} (sample {sample})"
        raise TokenIdError(f"token id {token} in {where}, read for the step at consumed samples "
                           f"{consumed}, is outside the model's vocabulary [0, {self.vocab_size}); the "
                           f"file's .idx header does not describe its tokens: re-create it with "
                           f"scripts/preprocess_data.py and the model's tokenizer")

    def get(self, consumed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        fut = self._pending.pop(consumed, None)
        if fut is None:  # not the step read ahead (first step, resume, eval from the start): drop those
            for stale in self._pending.values():
                stale.cancel()
            self._pending.clear()
        host = fut.result() if fut is not None else self.host_tokens(consumed)
        self._read_ahead(consumed)
        pinned = host_sync.pinned(self.device)
        out = []
        for tokens in host:
            tokens = tokens.to(self.device, non_blocking=pinned)
            out.append((tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()))
        return out

    def _read_ahead(self, consumed: int) -> None:
        if self.depth == 0 or self._closed:
            return
        for k in range(1, self.depth + 1):
            nxt = consumed + k * self.global_batch
            if nxt + self.global_batch > len(self.dataset):
                break
            if nxt in self._pending:
                continue
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, name="zerotron-batches", daemon=True)
                self._thread.start()
            self._pending[nxt] = fut = Future()
            self._requests.put((nxt, fut))

    def _work(self) -> None:
        while True:
            item = self._requests.get()
            if item is None:
                return
            consumed, fut = item
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(self.host_tokens(consumed))
            except BaseException as e:  # noqa: BLE001 - raised by the step that asks for this batch
                fut.set_exception(e)

    def close(self) -> None:
        """Stop the read-ahead thread; ``get`` still works, reading in the caller's thread."""
        self._closed = True
        if self._thread is not None:
            self._requests.put(None)
            self._thread.join(timeout=10)
            self._thread = None
        for fut in self._pending.values():
            fut.cancel()
        self._pending.clear()
