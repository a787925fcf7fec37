"""Write a safetensors file one tensor at a time, so memory is bounded by the largest tensor.

``safetensors.torch.save_file`` needs every tensor in memory at once -- the reason DeepSpeed's
``zero_to_fp32`` runs out of memory on big models. The format is simple enough to stream: an
8-byte little-endian header length, a JSON header giving each tensor's dtype, shape and byte
range, then the raw bytes in that order. Shapes and dtypes are known up front from checkpoint
metadata, so the header is written first and the tensors follow as they are produced.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import torch

from zerotron.data.atomic import publish

_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16",
           torch.int64: "I64"}


class SafetensorsStreamWriter:
    """``with SafetensorsStreamWriter(path, specs) as w: w.write(name, tensor)`` in ``specs`` order."""

    def __init__(self, path: str | Path, specs: list[tuple[str, list[int], torch.dtype]], metadata: dict | None = None):
        self.path = Path(path)
        self.specs = specs
        header, offset = {}, 0
        for name, shape, dtype in specs:
            nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
            header[name] = {"dtype": _DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
        if metadata:
            header["__metadata__"] = {k: str(v) for k, v in metadata.items()}
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # align the data section to 8 bytes
        self._header = raw
        self._next = 0

    def __enter__(self) -> "SafetensorsStreamWriter":
        self._tmp = self.path.with_name(self.path.name + ".partial")
        self._f = open(self._tmp, "wb")
        self._f.write(struct.pack("<Q", len(self._header)))
        self._f.write(self._header)
        return self

    def write(self, name: str, tensor: torch.Tensor) -> None:
        want_name, shape, dtype = self.specs[self._next]
        if name != want_name or list(tensor.shape) != list(shape) or tensor.dtype != dtype:
            raise ValueError(f"expected {want_name} {shape} {dtype}, got {name} {list(tensor.shape)} {tensor.dtype}")
        t = tensor.detach().contiguous().cpu()
        self._f.write(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        self._next += 1

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None and self._next != len(self.specs):
            self._f.close()
            os.unlink(self._tmp)
            raise RuntimeError(f"only {self._next} of {len(self.specs)} tensors were written to {self.path}")
        self._f.close()
        if exc_type is None:
            publish(str(self._tmp), str(self.path))  # fsync, then atomic rename
        else:
            os.unlink(self._tmp)
