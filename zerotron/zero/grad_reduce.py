"""Bucketed gradient reduction across the DP group, driven by backward hooks.

A chunk of the flat layout is the bucket (CB, §6.2): once every parameter touching it has its
gradient, the chunk is averaged over DP and

* all-reduced in place (stage 0, plain DP: 2Ψ, §7), or
* reduce-scattered so each rank receives only the shard it owns (Pos / Pos+g, §5.1-5.2: Ψ).

Gradients are accumulated over micro-batches, reduced and held in the *accumulation dtype*
(``ZeroConfig.grad_accum_dtype``: fp32 for 16-bit runs by default, as Megatron-LM's fp32
``main_grad``), so a sum over micro-batches and DP ranks is not rounded to 16 bits at every add.
Two ways of holding them:

* **flat** (stages 0-1 with ``contiguous_gradients``, MD §6.3): one pre-allocated flat buffer.
  When it has the parameters' dtype every ``param.grad`` is a view of it and autograd accumulates
  into it; otherwise each backward's 16-bit gradient is added into the (fp32) view and freed at
  once, so only one parameter's 16-bit gradient is alive at a time.
* **packed** (stages 2-3, or ``contiguous_gradients=False``): autograd's gradient tensors are
  copied into a fixed bucket buffer, reduced, added to the contiguous gradient *partition*, and
  freed at once -- so a Pos+g rank never holds more than its partition plus the buckets in flight.
  Stages 0-1 packed reduce only after the last micro-batch, so until then autograd sums the
  micro-batches in ``.grad``, in the parameters' dtype (16-bit in a 16-bit run): the one case where
  the accumulation is not in ``grad_accum_dtype``; take ``contiguous_gradients`` to have it.

Stages 0-1 reduce only after the last micro-batch; stages 2-3 on every backward (accumulating
into the partition; in a pipeline too, through ``ZeroOptimizer.pipeline_backward``). With ``overlap_comm`` the collectives are asynchronous (gloo handles, NCCL
streams) and at most two buckets are in flight while backward continues.

A gradient can arrive more than once in one backward: reentrant activation checkpointing runs
every recomputed segment in a backward of its own, so a module used in two segments fires its
hook twice. A parameter is therefore ready after as many arrivals as it had in the previous
backward (one before the first), and an arrival after one of its buckets went out is taken apart
by a tensor pre-hook (autograd adds zeros instead), reduced at the end of the backward as buckets
of its own and *added* to what was reduced: the reduction is linear, so nothing is lost or early.
Where ``.grad`` views the flat buffer, autograd adds those zeros in place, so the pre-hook first
waits for the collectives in flight (an in-place add racing an all-reduce can restore a value
read before the reduction wrote it); late arrivals are rare (learned after the first backward).

How a bucket of stages 1-3 reaches its owners is the ``ReduceScatter`` strategy
(``zero.strategies``): the plain reduce-scatter, or ZeRO++ qgZ (arXiv 2306.10209 §3.3), whose
synchronous quantized all-to-all hands back an already-finished handle that joins the same queue.
"""

from __future__ import annotations

import torch

from zerotron.parallel import collectives as C
from zerotron.zero.grad_buckets import BucketPool
from zerotron.zero.strategies import PlainReduceScatter, ReduceScatter


class GradReducer:
    """``dtype``: the accumulation and reduction dtype; ``param_dtype``: the parameters' (default: the same)."""

    def __init__(self, layout, params: list[torch.nn.Parameter], dp_group, stage: int, flat: bool,
                 overlap: bool, dtype: torch.dtype, device: torch.device, scatter: ReduceScatter | None = None,
                 param_dtype: torch.dtype | None = None):
        self.layout, self.params, self.dp_group = layout, params, dp_group
        self.scatter = scatter or PlainReduceScatter(dp_group)
        self.stage, self.flat, self.overlap = stage, flat, overlap
        self.dtype, self.device = dtype, device
        self.attached = flat and (param_dtype is None or param_dtype == dtype)  # param.grad views flat_grad
        chunks = layout.chunks
        self.expected = [len({pc.param for pc in c.pieces if params[pc.param].requires_grad}) for c in chunks]
        self.ready = [0] * len(chunks)
        self.reduced = [False] * len(chunks)
        self.touched = [False] * len(chunks)  # a gradient arrived in this round (see ``flush``)
        self.packed_chunks = [0] * len(params)
        self.arrivals = [1] * len(params)  # gradient arrivals per backward, learned from the last one
        self.seen = [0] * len(params)      # arrivals in this round
        self.late: dict[int, torch.Tensor] = {}  # arrivals after a bucket of theirs was reduced
        self.taking: dict[int, bool] = {}        # arrival taken by the pre-hook -> free .grad after it
        self.inflight: list = []
        self.sync = True        # set by the optimizer: reduce in the hooks now?
        self.pending = False    # a backward ran whose gradients are not yet reduced
        max_shard = max(c.shard for c in chunks)
        n_buf = self.n_buf = 2 if overlap else 1
        self.flat_grad = self.part_grad = None
        if flat:
            # MD: one contiguous buffer; param.grad are views so autograd accumulates in place.
            self.flat_grad = torch.zeros(layout.full_numel, dtype=dtype, device=device)
            if self.attached:
                for i, p in enumerate(params):
                    p.grad = layout.param_view(self.flat_grad, i)
        else:
            self.part_grad = torch.zeros(layout.part_numel, dtype=dtype, device=device)
        self.pool = None if flat else BucketPool(layout, n_buf, dtype, device)  # packed (CB)
        self.shard_bufs = ([torch.empty(max_shard, dtype=dtype, device=device) for _ in range(n_buf)]
                           if stage >= 1 else [])
        self.index = {id(p): i for i, p in enumerate(params)}
        self.handles = []
        for i, p in enumerate(params):
            if p.requires_grad:
                self.handles.append(p.register_hook(lambda grad, i=i: self._take_late(i, grad)))
                self.handles.append(p.register_post_accumulate_grad_hook(self._on_grad))

    def tensors(self) -> list[torch.Tensor]:
        """The gradient storage this reducer owns (flat buffer or partition, buckets, shard buffers)."""
        buckets = self.pool.tensors() if self.pool else []
        held = (self.flat_grad, self.part_grad, *buckets, *self.shard_bufs)
        return [t for t in held if t is not None]

    # hooks ----------------------------------------------------------------------------------------
    def _take_late(self, i: int, grad: torch.Tensor) -> torch.Tensor | None:
        """Before autograd accumulates: an arrival for a parameter with an already reduced bucket is kept
        apart for ``_reduce_late`` and replaced by zeros (a bucket sent out cannot take more)."""
        if not (self.sync and any(self.reduced[ci] for ci in self.layout.param_chunks[i])):
            return None
        if self.attached:
            self.wait()  # autograd adds the zeros into flat_grad, which a collective in flight may be writing
        if i in self.late:
            self.late[i].add_(grad)
        else:
            self.late[i] = grad.detach().to(self.dtype, copy=True)
        self.taking[i] = self.params[i].grad is None
        return torch.zeros_like(grad)

    def _on_grad(self, param: torch.nn.Parameter) -> None:
        i = self.index[id(param)]
        if i in self.taking:  # autograd just added the zeros of a taken-apart arrival
            if self.taking.pop(i):
                param.grad = None
            self.seen[i] += 1
            return
        if self.flat:
            view = self.layout.param_view(self.flat_grad, i)
            if not self.attached:
                view.add_(param.grad)  # e.g. fp32 += this backward's 16-bit gradient
                param.grad = None
            elif param.grad is not view and param.grad.data_ptr() != view.data_ptr():
                view.copy_(param.grad)  # someone replaced .grad (zero_grad(set_to_none)); re-attach
                param.grad = view
        elif self.sync:
            self._stage(i, param)
        self.pending = True
        for ci in self.layout.param_chunks[i]:
            self.touched[ci] = True
        if not self.sync:
            return
        self.seen[i] += 1
        if self.seen[i] != self.arrivals[i]:
            return
        for ci in self.layout.param_chunks[i]:
            self.ready[ci] += 1
            if self.ready[ci] == self.expected[ci] and not self.reduced[ci]:
                self._reduce(ci)

    # packed buckets: filled as gradients arrive ---------------------------------------------------
    def _stage(self, i: int, param: torch.nn.Parameter) -> None:
        """Add this arrival's gradient into the buckets of its chunks now and free it, as DeepSpeed's
        contiguous gradients do, so no 16-bit gradient waits for its bucket to fill (a bucket of them
        would be alive beside the bucket itself). Only when every chunk it touches holds a bucket;
        otherwise it stays in ``.grad``, ``_pack`` adds it when the chunk is reduced, and the
        buckets claimed for it here are given back (``grad_buckets``: none is held by a chunk
        it cannot fill)."""
        chunks = self.layout.param_chunks[i]
        slots, claimed = [], []
        for ci in chunks:
            slot = self.pool.slot_of.get(ci)
            if slot is None:
                slot = self._claim_slot(ci)
                claimed.append(ci)
            if slot is None:
                for cj in claimed:
                    self.pool.release(cj)
                return
            slots.append(slot)
        flat = param.grad.view(-1)
        for ci, slot in zip(chunks, slots):
            bucket = self.pool.bucket(slot)
            for pc in self.layout.chunks[ci].pieces:
                if pc.param == i:
                    bucket.narrow(0, pc.offset, pc.end - pc.start).add_(flat.narrow(0, pc.start, pc.end - pc.start))
        param.grad = None

    def _claim_slot(self, ci: int):
        """A zeroed bucket for chunk ``ci`` (``BucketPool.claim``), once no reduction reads it."""
        def wait_for(slot) -> None:
            while any(job[3] == slot for job in self.inflight):
                self._finish(self.inflight.pop(0))

        return self.pool.claim(ci, lambda s: any(job[3] == s for job in self.inflight), wait_for)

    # reduction ------------------------------------------------------------------------------------
    def _reduce(self, ci: int) -> None:
        c = self.layout.chunks[ci]
        self.reduced[ci] = True
        slot = None
        if self.flat:
            bucket = self.flat_grad[c.offset:c.offset + c.numel]
        else:
            slot = self.pool.slot_of.get(ci)
            if slot is None:
                slot = self._claim_slot(ci)
            self.pool.release(ci)
            # every bucket held by a chunk still filling (gradients arrived out of layout order): a
            # temporary one, rather than stall the open chunks
            bucket = self.pool.bucket(slot)[:c.numel] if slot is not None else torch.zeros(
                c.numel, dtype=self.dtype, device=self.device)
            self._pack(c, bucket)
        if self.overlap and len(self.inflight) >= 2:
            self._finish(self.inflight.pop(0))
        if self.dp_group.size > 1:
            bucket.div_(self.dp_group.size)  # average before summing keeps 16-bit sums in range
        shard = None
        if self.stage == 0:
            out = bucket
            work = C.all_reduce(bucket, self.dp_group, async_op=self.overlap)
        else:
            shard = self._next_shard()
            out = self.shard_bufs[shard][:c.shard]
            work = self.scatter.reduce_scatter(out, bucket, async_op=self.overlap)
        job = (work, c, out, slot, shard, bucket)  # slot: the bucket read (None: flat or temporary)
        if self.overlap:
            self.inflight.append(job)
        else:
            self._deliver(c, out)

    def _next_shard(self) -> int:
        """A shard buffer no reduction in flight writes into (waiting for the oldest if none)."""
        busy = {job[4] for job in self.inflight}
        free = [s for s in range(len(self.shard_bufs)) if s not in busy]
        if not free:
            self._finish(self.inflight.pop(0))
            return self._next_shard()
        return free[0]

    def _finish(self, job) -> None:
        work, c, out = job[:3]
        work.wait()
        self._deliver(c, out)

    def _deliver(self, c, out: torch.Tensor, add: bool = False) -> None:
        """The reduced bucket ``out`` into this rank's gradient: copied (flat), or added (packed, or ``add``)."""
        if not self.flat:
            self.part_grad[c.part_offset:c.part_offset + c.shard].add_(out)
            return
        lo, hi = self.layout.own_range(c) if self.stage >= 1 else (c.offset, c.offset + c.numel)
        if add:
            self.flat_grad[lo:hi].add_(out)
        elif self.stage >= 1:
            self.flat_grad[lo:hi].copy_(out)

    def _pack(self, c, bucket: torch.Tensor) -> None:
        """Add the gradients ``_stage`` could not take (and every one after ``no_sync`` backwards) to
        the zeroed or partly staged ``bucket``; free each once all its chunks have it."""
        for pc in c.pieces:
            p = self.params[pc.param]
            if p.grad is not None:
                bucket.narrow(0, pc.offset, pc.end - pc.start).add_(p.grad.view(-1).narrow(0, pc.start, pc.end - pc.start))
            self.packed_chunks[pc.param] += 1
            if self.packed_chunks[pc.param] == len(self.layout.param_chunks[pc.param]):
                p.grad = None  # Pos+g: the full gradient is gone as soon as it is in the bucket
                self.packed_chunks[pc.param] = 0

    def _reduce_late(self) -> None:
        """Reduce the taken-apart arrivals, chunk by chunk through one temporary bucket (CB), and add them
        to what their buckets already delivered. Every DP rank runs the same model, so the same chunks."""
        for ci in sorted({ci for i in self.late for ci in self.layout.param_chunks[i]}):
            c = self.layout.chunks[ci]
            bucket = torch.zeros(c.numel, dtype=self.dtype, device=self.device)
            for pc in c.pieces:
                grad = self.late.get(pc.param)
                if grad is not None:
                    bucket[pc.offset:pc.offset + pc.end - pc.start].copy_(grad.reshape(-1)[pc.start:pc.end])
            if self.dp_group.size > 1:
                bucket.div_(self.dp_group.size)
            if self.stage == 0:
                out = C.all_reduce(bucket, self.dp_group)
            else:
                out = torch.empty(c.shard, dtype=self.dtype, device=self.device)
                self.scatter.reduce_scatter(out, bucket, async_op=True).wait()
            self._deliver(c, out, add=True)
        self.late = {}

    def flush(self, only_touched: bool = False) -> None:
        """Reduce every chunk not yet reduced in this round (unused params count as zero), wait, reset.

        ``only_touched``: skip chunks no gradient reached in this round -- a backward of one model
        chunk of an interleaved pipeline stage reaches only that chunk's buckets; reducing the
        others would add zeros to the partition (stage 2) at the cost of a collective each. Every
        DP rank runs the same backward, so they skip the same chunks."""
        if self.pending:
            for ci in range(len(self.layout.chunks)):
                if not self.reduced[ci] and (self.touched[ci] or not only_touched):
                    self._reduce(ci)
        self.wait()
        if self.late:
            self._reduce_late()
        self.arrivals = [s or a for s, a in zip(self.seen, self.arrivals)]
        self.seen = [0] * len(self.seen)
        self.ready = [0] * len(self.ready)
        self.reduced = [False] * len(self.reduced)
        self.touched = [False] * len(self.touched)
        self.pending = False

    def wait(self) -> None:
        while self.inflight:
            self._finish(self.inflight.pop(0))

    # reads for the optimizer step -------------------------------------------------------------------
    def grad_shard(self, c) -> torch.Tensor:
        """This rank's reduced gradient for chunk ``c`` (``c.shard`` elements, accumulation dtype)."""
        if self.flat:
            lo, hi = self.layout.own_range(c)
            return self.flat_grad[lo:hi]
        return self.part_grad[c.part_offset:c.part_offset + c.shard]

    def grad_range(self, lo: int, hi: int) -> torch.Tensor:
        """Elements ``[lo, hi)`` of this rank's reduced gradient partition (stages 2-3, across chunks)."""
        return self.part_grad[lo:hi]

    def local_grad(self, i: int) -> torch.Tensor:
        """Parameter ``i``'s gradient accumulated here and not yet reduced (after ``no_sync`` backwards):
        what tied copies of a weight sum over their group before the DP reduction."""
        if self.flat:
            return self.layout.param_view(self.flat_grad, i)
        p = self.params[i]
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        return p.grad

    def zero(self) -> None:
        if self.flat:
            self.flat_grad.zero_()
        else:
            self.part_grad.zero_()
        if not self.attached:
            for p in self.params:
                p.grad = None
        self.packed_chunks = [0] * len(self.params)
        if self.pool:
            self.pool.reset()

    def buffer_bytes(self) -> tuple[int, int]:
        """(gradient bytes held as model state, fixed bucket bytes)."""
        grads = (self.flat_grad if self.flat else self.part_grad)
        held = grads.numel() * grads.element_size()
        if not self.attached:  # autograd's own gradients not yet packed / added into the buffer
            held += sum(p.grad.numel() * p.grad.element_size() for p in self.params if p.grad is not None)
        buckets = self.pool.tensors() if self.pool else []
        fixed = sum(b.numel() * b.element_size() for b in buckets + self.shard_bufs)
        return held, fixed
