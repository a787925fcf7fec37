"""A watch over asynchronous collectives: no tensor op may write into a buffer one of them is using.

An in-flight all-reduce reads and writes its buffer from another thread (gloo) or stream (NCCL),
so an in-place op there -- even autograd adding zeros -- can put back a value read before the
collective wrote its result. The watch sits outside the code under test: it wraps
``zerotron.parallel.collectives``' asynchronous calls to note each one's storage bytes until its
handle is waited on, and a ``TorchDispatchMode`` sees every ATen op, autograd's own gradient
accumulation included, and records each mutating op whose output overlaps a noted range.
"""

from __future__ import annotations

import contextlib

from torch.utils._python_dispatch import TorchDispatchMode


def _span(t):
    start = t.untyped_storage().data_ptr() + t.storage_offset() * t.element_size()
    return start, start + t.numel() * t.element_size()


class _Writes(TorchDispatchMode):
    def __init__(self, inflight: dict, hits: list):
        super().__init__()
        self.inflight, self.hits = inflight, hits

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "aten" and func._schema.is_mutable:
            written = [a for a, arg in zip(args, func._schema.arguments)
                       if arg.alias_info is not None and arg.alias_info.is_write]
            written += [v for k, v in kwargs.items() if k == "out"]
            for t in [t for w in written for t in (w if isinstance(w, (list, tuple)) else [w])]:
                lo, hi = _span(t)
                for op, (a, b) in self.inflight.items():
                    if lo < b and a < hi:
                        self.hits.append(f"{func} wrote into the buffer of an in-flight {op[0]}")
        return func(*args, **kwargs)


@contextlib.contextmanager
def no_writes_into_inflight_collectives():
    """Yields the list of offending writes; the caller asserts it is empty."""
    from zerotron.parallel import collectives as C

    inflight, hits, originals = {}, [], {}

    def watched(name, buffers):
        original = originals[name] = getattr(C, name)

        def call(*args, async_op=False, **kwargs):
            handle = original(*args, async_op=async_op, **kwargs)
            if not async_op or getattr(handle, "_work", None) is None:  # done already (a group of 1)
                return handle
            keys = [((name, id(handle), i), _span(args[i])) for i in buffers]
            inflight.update(keys)
            wait = handle.wait

            def wait_and_forget():
                for key, _ in keys:
                    inflight.pop(key, None)
                return wait()

            handle.wait = wait_and_forget
            return handle
        setattr(C, name, call)

    watched("all_reduce", (0,))
    watched("reduce_scatter", (0, 1))
    watched("all_gather", (0, 1))
    try:
        with _Writes(inflight, hits):
            yield hits
    finally:
        for name, fn in originals.items():
            setattr(C, name, fn)
