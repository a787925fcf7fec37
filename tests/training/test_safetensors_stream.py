"""The streaming safetensors writer produces files the safetensors library reads back exactly."""

import pytest
import torch
from safetensors.torch import load_file

from zerotron.checkpoint.safetensors_stream import SafetensorsStreamWriter


def test_stream_roundtrip(tmp_path):
    tensors = {"a": torch.randn(3, 5), "b": torch.randn(7).to(torch.bfloat16), "c": torch.arange(4),
               "d": torch.randn(2, 3).half()}
    specs = [(k, list(v.shape), v.dtype) for k, v in tensors.items()]
    path = tmp_path / "m.safetensors"
    with SafetensorsStreamWriter(path, specs, metadata={"format": "pt"}) as w:
        for k, v in tensors.items():
            w.write(k, v)
    back = load_file(str(path))
    for k, v in tensors.items():
        assert torch.equal(back[k], v)


def test_incomplete_write_leaves_nothing(tmp_path):
    path = tmp_path / "m.safetensors"
    with pytest.raises(RuntimeError, match="only 1 of 2"):
        with SafetensorsStreamWriter(path, [("a", [2], torch.float32), ("b", [2], torch.float32)]) as w:
            w.write("a", torch.zeros(2))
    assert list(tmp_path.iterdir()) == []
