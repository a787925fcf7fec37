"""A full disk on one rank during a save is reported as such by every rank, and loses nothing.

Rank 1's shard write raises ``ENOSPC`` at the step-4 save (``ZEROTRON_FAULT=enospc``: the ranks of
one host share a file system, so a real full disk cannot single out one rank). Before
``checkpoint_agree`` rank 1 died with a traceback (exit 1) and rank 0 blamed it as "dead or
frozen" (exit 3). Now both exit 2 with the same "disk full on rank 1", the partial ``.tmp`` is
gone and the step-2 checkpoint is still the newest complete one, its checksums intact.
"""

from __future__ import annotations

import json

from tests.reliability.common import run, tiny
from zerotron.checkpoint.files import resolve_load_path, verify_file


def test_enospc_on_one_rank_is_named_by_every_rank_and_the_previous_checkpoint_stays(zerotron_cache, tmp_path):
    save = tmp_path / "ck"
    argv = tiny(zerotron_cache) + ["--train-steps", "6", "--run-dir", str(tmp_path / "run"), "--save", str(save),
                                   "--save-interval", "2"]
    res = run(argv, fault="enospc@step=4@rank=1")
    for rank, (code, _, err, _) in enumerate(res):
        assert code == 2, f"rank {rank}: {err}"
        assert "CheckpointWriteError: checkpoint step_00000004 was not written: disk full on rank 1" in err, err
        assert "step_00000002, is intact" in err and "rerun the same command" in err, err
        assert "dead or frozen" not in err, err
    assert sorted(p.name for p in save.iterdir() if p.name.startswith("step_")) == ["step_00000002"]
    path, notes = resolve_load_path(save)
    assert path.name == "step_00000002" and notes == []
    for name, entry in json.loads((path / "metadata.json").read_text())["files"].items():
        verify_file(path / name, entry["sha256"])  # raises if a shard were damaged


def test_a_full_disk_under_safetensors_raises_oserror_enospc(tmp_path, monkeypatch):
    """safetensors reports I/O errors as ``SafetensorError`` (this text is safetensors 0.8's on a full
    tmpfs), not ``OSError``: without the conversion a real full disk escaped ``checkpoint_agree``."""
    import errno

    import pytest
    import torch
    from safetensors import SafetensorError

    from zerotron.checkpoint import files as checkpoint_io

    def full(*args, **kwargs):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(checkpoint_io, "save_file", full)
    with pytest.raises(OSError) as info:
        checkpoint_io.write_shard(tmp_path / "rank_00000.safetensors", {"a": torch.zeros(4)}, {})
    assert info.value.errno == errno.ENOSPC and info.value.filename.endswith("rank_00000.safetensors.partial")
