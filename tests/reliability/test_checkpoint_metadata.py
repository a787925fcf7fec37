"""``metadata.json`` is untrusted: sealed, schema-checked, every file it names inside (issue 46).

The checkpoint is a real one (one rank of the tiny GPT, one step). Loading is the export's
reader (``export.full_tensors`` assembles every parameter from the shards, as a resharding load
does, in this process), so what it opens can be watched: an audit hook records every file Python
opens and ``safe_open`` is wrapped. The reference for "outside" is a bait directory beside the
checkpoint holding valid copies of its shards and tokenizer: a loader that followed a path trick
would read them and succeed.
"""

from __future__ import annotations

import json
import pickle
import shutil
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.harness import spawn
from tests.training.test_trainer import run_steps
from zerotron.checkpoint import files as checkpoint_io
from zerotron.checkpoint.files import CheckpointError, read_metadata
from zerotron.checkpoint.schema import SEAL, seal
from zerotron.checkpoint.export import full_tensors, tokenizer_model

_WATCH: dict = {"on": False, "opened": []}


def _audit(event, args):
    if _WATCH["on"] and event == "open" and isinstance(args[0], (str, bytes, Path)):
        _WATCH["opened"].append(str(args[0]))


sys.addaudithook(_audit)


@pytest.fixture(scope="module")
def checkpoint(zerotron_cache, tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("metadata")
    flags = ["--save", tmp / "ck", "--save-interval", "1"]
    spawn(run_steps, 1, tmp / "run", zerotron_cache, 1, flags, timeout=120)
    step = tmp / "ck" / "step_00000001"
    bait = tmp / "outside"
    bait.mkdir()
    for f in step.iterdir():
        shutil.copy(f, bait / f.name)
    return step


@pytest.fixture
def copy(checkpoint, tmp_path) -> Path:
    out = tmp_path / "ck" / "step_00000001"
    shutil.copytree(checkpoint, out)
    shutil.copy(out / "metadata.json", out / "metadata.json.orig")
    return out


def _load(path: Path, monkeypatch=None) -> str:
    """Load every tensor and the tokenizer; ``"ok"`` or the CheckpointError's text. Any other
    exception propagates (a traceback is a failure), and so does a read outside ``path``."""
    _WATCH.update(on=True, opened=[])
    try:
        list(full_tensors(str(path)))
        tokenizer_model(str(path))
        result = "ok"
    except CheckpointError as e:
        result = str(e)
    finally:
        _WATCH["on"] = False
    root = str(path.resolve())
    outside = [p for p in _WATCH["opened"] if not str(Path(p).resolve()).startswith(root)]
    assert not outside, f"read outside the checkpoint: {outside}"
    return result


def _write(path: Path, meta: dict, sealed: bool) -> None:
    """``meta`` resealed, or under the seal the checkpoint was written with (an edit in place)."""
    stale = json.loads((path / "metadata.json.orig").read_text())[SEAL]
    (path / "metadata.json").write_text(json.dumps(seal(meta) if sealed else {**meta, SEAL: stale}))


def _meta(path: Path) -> dict:
    meta = json.loads((path / "metadata.json").read_text())
    meta.pop(SEAL)
    return meta


def test_an_intact_checkpoint_loads_and_any_edit_breaks_its_seal(copy):
    assert _load(copy) == "ok"
    meta = _meta(copy)
    meta["run_id"] = "someone-else"
    _write(copy, meta, sealed=False)
    assert "metadata.json is corrupt: its checksum does not match" in _load(copy)
    (copy / "metadata.json").write_text(json.dumps(meta))  # no seal at all
    assert "metadata.json carries no checksum" in _load(copy)


@pytest.mark.parametrize("name", ["../../outside/rank_00000.safetensors", "/etc/passwd",
                                  "sub/rank_00000.safetensors", ".."])
def test_a_shard_name_that_leaves_the_directory_is_refused_even_resealed(copy, name):
    meta = _meta(copy)
    meta["files"][name] = meta["files"].pop("rank_00000.safetensors")
    _write(copy, meta, sealed=True)
    assert "metadata.json is corrupt: files" in _load(copy)


def test_a_tokenizer_record_pointing_elsewhere_is_refused(copy):
    meta = _meta(copy)
    meta["tokenizer"]["file"] = "../../outside/tokenizer.model"
    _write(copy, meta, sealed=True)
    assert "tokenizer.file='../../outside/tokenizer.model'" in _load(copy)


def test_an_hf_tokenizer_copy_loads_and_a_file_of_it_linked_outside_is_refused(copy, tmp_path):
    from tests.hf_tokenizers import bpe_tokenizer_dir
    from zerotron.data.hf_tokenizer import files_sha256

    source = bpe_tokenizer_dir(tmp_path / "hf")
    kept = copy / "tokenizer"
    shutil.copytree(source, kept)
    meta = _meta(copy)
    meta["tokenizer"] = {"path": str(source), "file": "tokenizer", "sha256": files_sha256(kept)}
    _write(copy, meta, sealed=True)
    assert _load(copy) == "ok"
    (kept / "tokenizer.json").unlink()
    (kept / "tokenizer.json").symlink_to(source / "tokenizer.json")  # the same bytes, outside
    assert "tokenizer.file's tokenizer.json='tokenizer.json' is a link to" in _load(copy)


def test_a_shard_symlinked_outside_is_refused(copy):
    shard = copy / "rank_00000.safetensors"
    shard.unlink()
    shard.symlink_to(copy.parent.parent.parent / "outside" / "rank_00000.safetensors")
    assert "is a link to" in _load(copy)


@pytest.mark.parametrize("field, value, needle", [
    ("step", "two", "step='two' must be an integer"),
    ("step", 1000, "step=1000 but the directory is step_00000001"),
    ("consumed_samples", 10**15, "consumed_samples=1000000000000000"),
    ("consumed_samples", -64, "consumed_samples=-64"),
    ("layout", {"tp": 1, "pp": 1, "dp": 3, "stage": 2, "world_size": 3}, "files must name"),
])
def test_out_of_range_fields_are_named_not_tracebacks(copy, field, value, needle):
    meta = _meta(copy)
    meta[field] = value
    _write(copy, meta, sealed=True)
    assert needle in _load(copy)


def test_a_huge_shape_or_an_index_past_the_shard_is_refused_before_allocating(copy):
    meta = _meta(copy)
    name = sorted(meta["params"])[0]
    meta["params"][name]["global_shape"] = [10**12]
    _write(copy, meta, sealed=True)
    assert "is not covered by the shards' index" in _load(copy)
    meta = _meta(copy)
    entry = meta["files"]["rank_00000.safetensors"]
    entry["index"][0][4] = 10**12  # an offset far past the shard's bytes
    _write(copy, meta, sealed=True)
    assert "index reaches element" in _load(copy)


def test_a_pickle_in_place_of_a_shard_is_named_corrupt(copy):
    from zerotron.checkpoint.files import sha256_file

    shard = copy / "rank_00000.safetensors"
    data = pickle.dumps({"master": [1.0, 2.0]})
    shard.write_bytes(data + b"\0" * (shard.stat().st_size - len(data)))  # same size as before
    meta = _meta(copy)
    meta["files"]["rank_00000.safetensors"]["sha256"] = sha256_file(shard)
    _write(copy, meta, sealed=True)
    assert f"checkpoint shard {shard} is corrupt: not a safetensors file" in _load(copy)


# fuzz ------------------------------------------------------------------------------------------
def _paths(obj, prefix=()):
    """Every (path of keys/indices) in a JSON value, the value itself included."""
    yield prefix
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _paths(v, prefix + (i,))


TRICKS = ["../outside/rank_00000.safetensors", "../../outside/tokenizer.model", "/etc/hostname",
          "..", ".", "rank_00000.safetensors/..", "", "tokenizer.model"]
VALUES = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=True),
                   st.sampled_from(TRICKS), st.text(max_size=8), st.just([]), st.just({}),
                   st.just([10**12]))


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_fuzzed_metadata_never_tracebacks_reads_outside_or_loads_changed(copy_factory, data):
    path, original = copy_factory
    meta = json.loads(json.dumps(original))
    for _ in range(data.draw(st.integers(1, 3))):
        where = data.draw(st.sampled_from([p for p in _paths(meta) if p]))
        parent = meta
        for k in where[:-1]:
            parent = parent[k]
        op = data.draw(st.sampled_from(["delete", "replace"]))
        if op == "delete":
            del parent[where[-1]]
        else:
            parent[where[-1]] = data.draw(VALUES)
        if isinstance(parent, dict) and data.draw(st.booleans()) and where[-1] in parent:
            # rename a key to a path trick
            parent[data.draw(st.sampled_from(TRICKS))] = parent.pop(where[-1])
    changed = meta != original
    _write(path, meta, sealed=False)
    result = _load(path)
    assert result != "ok" or not changed, "a changed checkpoint loaded"
    _write(path, meta, sealed=True)  # a hostile writer that reseals: refused or loaded, no crash
    _load(path)


@pytest.fixture
def copy_factory(copy):
    return copy, _meta(copy)


def test_read_metadata_names_the_directory_for_unparsable_json(copy):
    (copy / "metadata.json").write_bytes(b"\xff\xfe[")
    with pytest.raises(CheckpointError, match="metadata.json is corrupt"):
        read_metadata(copy)
    assert checkpoint_io.FORMAT_VERSION == 1


# writers ---------------------------------------------------------------------------------------
def test_convert_never_replaces_a_device_node_and_a_write_error_is_one_line(checkpoint, tmp_path,
                                                                            capsys, monkeypatch):
    import os
    import stat

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
    import convert_checkpoint

    assert convert_checkpoint.main([str(checkpoint), "--safetensors", "/dev/full"]) == 2
    assert stat.S_ISCHR(os.stat("/dev/full").st_mode) and not os.path.exists("/dev/full.partial")
    assert "/dev/full exists and is not a regular file" in capsys.readouterr().err

    from zerotron.checkpoint import safetensors_stream

    def full_disk(self, *args):
        raise OSError(28, os.strerror(28), str(self.path))

    monkeypatch.setattr(safetensors_stream.SafetensorsStreamWriter, "write", full_disk)
    out = tmp_path / "m.safetensors"
    assert convert_checkpoint.main([str(checkpoint), "--safetensors", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "No space left on device" in err and "Traceback" not in err, err
    assert not out.exists()


def test_the_disk_space_check_matches_a_real_checkpoint(checkpoint, zerotron_cache, tmp_path):
    """``checkpoint_bytes`` (the start-up disk-space check) against the shards on disk: it counted
    16 bytes a parameter where an fp32 checkpoint holds 12."""
    from tests.training.test_trainer import make_config
    from zerotron.training.setup_run import checkpoint_bytes, validate_model

    cfg = make_config(tmp_path, zerotron_cache)
    need = checkpoint_bytes(cfg, validate_model(cfg))[0]
    shards = sum(p.stat().st_size for p in checkpoint.glob("rank_*.safetensors"))
    assert need <= shards <= need * 1.02 + 65536, (need, shards)  # headers and RNG states on top


def test_a_failed_hf_export_leaves_no_half_written_directory(checkpoint, tmp_path, capsys,
                                                            monkeypatch):
    import os

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
    import convert_checkpoint

    from zerotron.checkpoint import export

    def full_disk(model, out, max_length):
        raise OSError(28, os.strerror(28), str(Path(out) / "tokenizer.json"))

    monkeypatch.setattr(export, "write_hf_tokenizer", full_disk)  # after the weights are written
    out = tmp_path / "hf"
    assert convert_checkpoint.main([str(checkpoint), "--hf", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "No space left on device" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # neither hf nor hf.partial
