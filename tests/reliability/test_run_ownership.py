"""A run owns its checkpoint directory, and resumes only a checkpoint that is intact and continues it.

Through the real entry point (scripts/pretrain_gpt.py ``main``) on 2 gloo ranks: a second run on
a locked directory is refused naming the holder, a stale lock is taken over, the lock goes
however the run ends; pruning deletes only this run's checkpoints; a fresh start never writes
over checkpoints; a corrupt newest checkpoint is named with the one before it, which is loaded
only with ``checkpoint.fallback``; a changed schedule / global batch / seed is refused unless
``checkpoint.override_schedule``; a run already at ``train_steps`` exits 0 saying so; the same
command after a crash resumes by itself (``checkpoint.load=auto``); a SIGTERM says truthfully
whether a checkpoint was written.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.harness import spawn
from tests.reliability.common import _main, forbid_process_group, run, tiny
from zerotron.checkpoint.run_lock import LOCK_NAME, STALE_S

HOST = socket.gethostname()


def argv(cache: str, run_dir: Path, steps: int = 4, *flags) -> list[str]:
    """The tiny run, saving every 2 steps into ``<run_dir>/checkpoints`` (tiny.yaml's default)."""
    return tiny(cache) + ["--train-steps", str(steps), "--run-dir", str(run_dir), "--save", "{run_dir}/checkpoints",
                          "--save-interval", "2", *flags]


def steps_in(save: Path) -> list[str]:
    return sorted(p.name for p in save.iterdir() if p.name.startswith("step_"))


def run_id(checkpoint: Path) -> str:
    return json.loads((checkpoint / "metadata.json").read_text())["run_id"]


def codes(res) -> list[int]:
    return [r[0] for r in res]


@pytest.fixture(scope="module")
def trained(zerotron_cache, tmp_path_factory) -> Path:
    """A finished 4-step run (checkpoints at steps 2 and 4); tests that use it leave it unchanged."""
    run_dir = tmp_path_factory.mktemp("trained")
    res = run(argv(zerotron_cache, run_dir))
    assert codes(res) == [0, 0], res[0][2]
    assert "holds no checkpoint yet; starting from scratch" in res[0][1]
    assert steps_in(run_dir / "checkpoints") == ["step_00000002", "step_00000004"]
    return run_dir


HOLD = """import sys, time
from zerotron.checkpoint.run_lock import RunLock
RunLock.acquire(sys.argv[1], "another-run")
print("held", flush=True)
time.sleep(120)
"""


@pytest.mark.parametrize("holder", ["live", "other_host", "stale", "other_host_expired"])
def test_a_locked_directory_is_refused_naming_the_holder_and_a_stale_lock_taken_over(holder, zerotron_cache,
                                                                                     tmp_path):
    save = tmp_path / "checkpoints"
    save.mkdir()
    proc = None
    if holder == "live":  # a running process of this host holds it (not this one: no thread before the fork)
        proc = subprocess.Popen([sys.executable, "-c", HOLD, str(save)], stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline().strip() == "held"
        host, pid = HOST, proc.pid
    else:
        host, pid = "node-elsewhere", 4242
        if holder == "stale":  # a process of this host that has exited
            gone = subprocess.Popen(["true"])
            gone.wait()
            host, pid = HOST, gone.pid
        (save / LOCK_NAME).write_text(json.dumps({"host": host, "pid": pid, "run_id": "old", "started": 0}))
        if holder == "other_host_expired":  # its holder stopped refreshing it long ago
            old = time.time() - 10 * STALE_S
            os.utime(save / LOCK_NAME, (old, old))
    try:
        with pytest.MonkeyPatch.context() as patch:
            if holder in ("live", "other_host"):  # refused before any process group, not timed
                forbid_process_group(patch)
            res = run(argv(zerotron_cache, tmp_path, 2))
    finally:
        if proc is not None:
            proc.kill()
            proc.wait()
    if holder in ("stale", "other_host_expired"):
        assert codes(res) == [0, 0], res[0][2]
        why = "process no longer running" if holder == "stale" else "not refreshed for"
        assert f"took over the stale lock of host {host}, pid {pid}" in res[0][1] and why in res[0][1], res[0][1]
        assert not (save / LOCK_NAME).exists()
        return
    for code, _, err, _ in res:
        assert code == 2, err
        assert f"checkpoint.save={save} is in use by" in err and f"host {host}, pid {pid}" in err, err
        assert "config error" in err  # refused by preflight, before init_process_group (run_lock.check_free)
    assert steps_in(save) == []
    assert ("delete" in res[0][2]) == (holder == "other_host")  # only an unprobeable holder may need a hand


@pytest.mark.parametrize("ending, fault, want", [("done", "", [0, 0]), ("nan loss", "nan@step=2", [2, 2]),
                                                 ("peer died", "kill@step=2@rank=1", [3, None])])
def test_the_lock_is_released_however_the_run_ends(ending, fault, want, zerotron_cache, tmp_path):
    res = run(argv(zerotron_cache, tmp_path, 3), fault=fault, may_die=(1,) if "kill" in fault else ())
    assert [r and r[0] for r in res] == want, res[0][2]
    assert not (tmp_path / "checkpoints" / LOCK_NAME).exists(), ending


@pytest.mark.parametrize("keep_last", [1, 2])
def test_pruning_touches_only_checkpoints_this_run_wrote(keep_last, zerotron_cache, tmp_path):
    save, keep = tmp_path / "a" / "checkpoints", ["--checkpoint.keep_last", str(keep_last)]
    assert codes(run(argv(zerotron_cache, tmp_path / "a", 4, *keep))) == [0, 0]
    mine_a = steps_in(save)
    assert mine_a == ["step_00000002", "step_00000004"][-keep_last:]
    # another run (another weight decay: it trains something else) continues A's checkpoint in A's directory
    res = run(argv(zerotron_cache, tmp_path / "b", 8, *keep, "--save", str(save), "--load", str(save),
                   "--optimizer.weight_decay", "0.05", "--optimizer.schedule_steps", "4"))
    assert codes(res) == [0, 0], res[0][2]
    mine_b = ["step_00000006", "step_00000008"][-keep_last:]
    assert steps_in(save) == mine_a + mine_b
    assert {run_id(save / s) for s in mine_a}.isdisjoint({run_id(save / s) for s in mine_b})


@pytest.mark.parametrize("flags, text", [
    (["--load", "none"], "already holds this run's checkpoints (newest step_00000004) and this run starts from "
                         "scratch, so it would write over them: continue it with --load auto"),
    (["--model.dropout", "0.1"], "holds checkpoints of another run (step_00000004: model.dropout=0.0 in the "
                                 "checkpoint, 0.1 in this run)"),
])
def test_a_fresh_run_never_writes_over_checkpoints(flags, text, trained, zerotron_cache):
    before = steps_in(trained / "checkpoints")
    res = run(argv(zerotron_cache, trained, 6, *flags))
    for code, _, err, _ in res:
        assert code == 2 and text in err, err
    assert steps_in(trained / "checkpoints") == before


@pytest.mark.parametrize("damage, load, fallback", [("shard", "auto", False), ("shard", "auto", True),
                                                    ("metadata", "directory", False)])
def test_a_corrupt_newest_checkpoint_is_named_and_the_one_before_loaded_only_with_fallback(
        damage, load, fallback, zerotron_cache, tmp_path):
    save = tmp_path / "checkpoints"
    assert codes(run(argv(zerotron_cache, tmp_path))) == [0, 0]
    newest, before = save / "step_00000004", save / "step_00000002"
    victim = newest / ("rank_00001.safetensors" if damage == "shard" else "metadata.json")
    damaged = bytearray(victim.read_bytes())
    damaged[len(damaged) // 2] ^= 0xFF  # one flipped byte
    damaged = bytes(damaged) if damage == "shard" else b"{not json"
    victim.write_bytes(damaged)
    flags = (["--load", str(save)] if load == "directory" else []) + ["--checkpoint.fallback", str(fallback).lower()]
    res = run(argv(zerotron_cache, tmp_path, 6, *flags))
    if not fallback:
        for code, _, err, _ in res:
            assert code == 2, err
            assert f"checkpoint {newest} is corrupt: " in err, err
            assert ("shard rank_00001.safetensors is corrupt" if damage == "shard" else "metadata.json is corrupt") in err
            assert f"The one before it, {before}, is intact (verified): pass --checkpoint.fallback true" in err, err
        assert victim.read_bytes() == damaged  # nothing written
        return
    assert codes(res) == [0, 0], res[0][2]
    out = res[0][1]
    assert f"{newest} is corrupt (shard rank_00001.safetensors is corrupt" in out, out
    assert f"loaded {before} (step 2," in out, out
    assert steps_in(save) == ["step_00000004", "step_00000006"]  # the corrupt step 4 replaced by a new one


@pytest.mark.parametrize("save, fix", [("/ck", "remove {path} to start from scratch"),
                                       ("/elsewhere", "pass --load none to start from scratch"),
                                       (None, "pass --load none to start from scratch")])
def test_a_corrupt_only_checkpoint_gets_a_fix_that_works_from_where_it_lies(save, fix):
    """With nothing before it the advice cannot be "load an earlier checkpoint"; inside the run's
    own checkpoint.save a fresh start is refused while the checkpoint is there (it would be
    written over), so the fix is to remove it; elsewhere ``--load none`` starts afresh."""
    from zerotron.checkpoint.files import LOAD_EARLIER
    from zerotron.checkpoint.resume import _corrupt

    path = Path("/ck/step_00000002")
    text = _corrupt(path, f"{path}/metadata.json is corrupt (bad json){LOAD_EARLIER}", [], None, None,
                    Path(save) if save else None)
    assert "earlier checkpoint" not in text and fix.format(path=path) in text, text


@pytest.mark.parametrize("flags, load, field, old, new", [
    (["--lr", "0.001"], "auto", "optimizer.lr", 0.003, 0.001),
    (["--global-batch-size", "8"], "auto", "training.global_batch_size", 4, 8),
    (["--seed", "7"], "explicit", "training.seed", 1234, 7),
    ([], "auto", "training.train_steps", 4, 6),  # the cosine decay ended at 4: issue 46
])
def test_resume_refuses_a_changed_schedule_batch_or_seed(flags, load, field, old, new, trained, zerotron_cache):
    extra = ["--load", str(trained / "checkpoints")] if load == "explicit" else []
    res = run(argv(zerotron_cache, trained, 6, *flags, *extra))
    for code, _, err, _ in res:
        assert code == 2, err
        assert f"would change its run's schedule: {field}={old!r} in the checkpoint, {new!r} in this run" in err, err
        assert "--checkpoint.override_schedule true" in err, err
        if field == "training.train_steps":  # and the way on along the checkpoint's decay
            assert "its update 4 ran at lr 0.00165, which a cosine decay over 6 steps puts at " \
                   "0.0026); to train on along the checkpoint's decay pass " \
                   "--optimizer.schedule_steps 4" in err, err
    assert steps_in(trained / "checkpoints") == ["step_00000002", "step_00000004"]
    if field == "training.train_steps":  # that fix resumes, no override: steps 5, 6 at min_lr
        run_dir = trained / "along_the_decay"
        res = run(argv(zerotron_cache, trained, 6, "--optimizer.schedule_steps", "4", "--load",
                       str(trained / "checkpoints"), "--save", "none", "--run-dir", str(run_dir)))
        assert codes(res) == [0, 0] and "(step 4," in res[0][1], res[0][2]
        lrs = [json.loads(line).get("lr") for line in (run_dir / "metrics.jsonl").open()]
        assert [lr for lr in lrs if lr is not None] == [0.0003, 0.0003], lrs  # tiny.yaml's min_lr


def test_override_schedule_resumes_with_the_new_values(zerotron_cache, tmp_path):
    assert codes(run(argv(zerotron_cache, tmp_path))) == [0, 0]
    res = run(argv(zerotron_cache, tmp_path, 6, "--lr", "0.001", "--checkpoint.override_schedule", "true"))
    assert codes(res) == [0, 0], res[0][2]
    out = res[0][1]
    assert "checkpoint.override_schedule=true: continuing with optimizer.lr=0.003 in the checkpoint, 0.001" in out
    assert "(step 4," in out and "[zerotron] done: step 6 of 6" in out, out


@pytest.mark.parametrize("old, new", [(4, 12), (8, 4)])
def test_override_resumes_with_a_global_batch_that_does_not_divide_or_shrinks(old, new, zerotron_cache, tmp_path):
    """16 consumed samples and a batch of 12 (not a multiple); 32 consumed and a batch of 4 (6 x 4 < 32)."""
    assert codes(run(argv(zerotron_cache, tmp_path, 4, "--global-batch-size", str(old)))) == [0, 0]
    res = run(argv(zerotron_cache, tmp_path, 6, "--global-batch-size", str(new), "--checkpoint.override_schedule", "true"))
    assert codes(res) == [0, 0], res[0][2]
    assert "(step 4," in res[0][1] and "[zerotron] done: step 6 of 6" in res[0][1], res[0][1]


@pytest.mark.parametrize("target, needle", [
    ("step_00000004/metadata.json", "is a file; give the checkpoint's directory, {ckpts}/step_00000004"),
    ("step_00000006.tmp", "is a partial checkpoint (a save that did not finish"),
])
def test_a_load_that_names_a_file_or_a_partial_checkpoint_is_refused(target, needle, trained, zerotron_cache):
    ckpts = trained / "checkpoints"
    (ckpts / "step_00000006.tmp").mkdir(exist_ok=True)  # what a save cut short leaves
    try:
        res = run(argv(zerotron_cache, trained, 8, "--load", str(ckpts / target), "--save", "none"))
    finally:
        (ckpts / "step_00000006.tmp").rmdir()
    for code, _, err, _ in res:
        assert code == 2 and f"checkpoint.load={ckpts / target}" in err, err
        assert needle.format(ckpts=ckpts) in err, err


def test_resume_refuses_another_tokenizer_naming_the_checkpoints_copy(trained, zerotron_cache):
    ckpt = trained / "checkpoints" / "step_00000004"
    res = run(argv(zerotron_cache, trained, 6, "--data.default_corpus_vocab", "1000", "--load", str(ckpt),
                   "--save", "none", "--optimizer.schedule_steps", "4"),  # keep the schedule
              collective_timeout=120)  # rank 0 first builds the 1000-piece corpus, the others wait
    for code, _, err, _ in res:
        assert code == 2, err
        assert f"checkpoint {ckpt} was trained with another tokenizer: this run's tokenizer" in err, err
        assert f"set data.default_corpus_vocab=1024, the checkpoint's, with --load {ckpt}" in err, err
        assert "or start from scratch: --load none" in err, err


def test_a_rebuilt_tokenizer_that_encodes_the_same_resumes_and_another_does_not(trained):
    """The built-in corpus's tokenizer rebuilt elsewhere has other bytes (SentencePiece records
    the directory it trained in) and encodes the same: no refusal. One changed score is refused."""
    from sentencepiece import sentencepiece_model_pb2

    from zerotron.checkpoint.files import CheckpointError
    from zerotron.config.cli import parse_config
    from zerotron.checkpoint.resume import check_tokenizer

    ckpt = trained / "checkpoints" / "step_00000004"
    cfg = parse_config(["--config", "configs/tiny.yaml"])
    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString((ckpt / "tokenizer.model").read_bytes())
    proto.trainer_spec.model_prefix, proto.trainer_spec.num_threads = "/elsewhere/.tmp-x/tokenizer", 7
    rebuilt = trained / "rebuilt.model"
    rebuilt.write_bytes(proto.SerializeToString())
    assert rebuilt.read_bytes() != (ckpt / "tokenizer.model").read_bytes()
    check_tokenizer(ckpt, str(rebuilt), cfg)
    proto.pieces[300].score += 1.0
    other = trained / "other.model"
    other.write_bytes(proto.SerializeToString())
    with pytest.raises(CheckpointError, match="encodes otherwise than"):
        check_tokenizer(ckpt, str(other), cfg)


@pytest.mark.parametrize("train_steps", [4, 3])
def test_a_run_already_at_train_steps_exits_0_saying_so(train_steps, trained, zerotron_cache):
    res = run(argv(zerotron_cache, trained, train_steps))
    assert codes(res) == [0, 0], res[0][2]
    assert (f"the run is already complete at step 4 ({trained / 'checkpoints' / 'step_00000004'}; "
            f"training.train_steps={train_steps}): nothing to train; raise training.train_steps to "
            f"go on (with --optimizer.schedule_steps 4 to keep its decay)") in res[0][1], res[0][1]
    assert steps_in(trained / "checkpoints") == ["step_00000002", "step_00000004"]


@pytest.mark.parametrize("dead", [0, 1])
def test_the_same_command_after_a_crash_resumes_by_itself(dead, zerotron_cache, tmp_path):
    cmd = argv(zerotron_cache, tmp_path, 6)
    crashed = run(cmd, fault=f"kill@step=4@rank={dead}", may_die=(dead,))
    assert crashed[1 - dead][0] == 3
    res = run(cmd)  # what torchrun --max-restarts does: the same command again
    assert codes(res) == [0, 0], res[0][2]
    out = res[0][1]
    assert f"loaded {tmp_path / 'checkpoints' / 'step_00000002'} (step 2," in out, out
    assert ("took over the stale lock" in out) == (dead == 0), out  # rank 0 died holding it
    assert "[zerotron] done: step 6 of 6" in out


def _sigterm_at_step_3(argv: list[str], told: int = 0):
    """``main`` with a SIGTERM to rank ``told`` right after step 3 (only one rank is told)."""
    from zerotron.training.trainer import Trainer

    step = Trainer.train_step

    def preempted(self):
        out = step(self)
        if self.step == 3 and self.grid.rank == told:
            os.kill(os.getpid(), signal.SIGTERM)
        return out

    Trainer.train_step = preempted
    return _main(argv, {"ZEROTRON_FAULT": ""})


@pytest.mark.parametrize("save, layout, told", [
    ("none", [], 0), ("{run_dir}/checkpoints", [], 0),
    ("{run_dir}/checkpoints", ["--pp", "2"], 1),  # the last stage is told, the first logs
], ids=["dp2-nosave", "dp2-save", "pp2-save-last-stage-told"])
def test_sigterm_says_whether_a_checkpoint_was_written(save, layout, told, zerotron_cache, tmp_path):
    cmd = argv(zerotron_cache, tmp_path, 10, "--save", save, "--save-interval", "0", *layout)
    res = spawn(_sigterm_at_step_3, 2, cmd, told, timeout=55, collective_timeout=20)
    assert codes(res) == [0, 0], res[0][2]
    out = res[0][1]
    if save == "none":
        assert "SIGTERM: stopping at step 3; no checkpoint written (checkpoint.save is not set)" in out, out
        assert "checkpoint written" not in out.replace("no checkpoint written", "")
    else:
        assert f"SIGTERM: checkpoint written at step 3 ({tmp_path / 'checkpoints' / 'step_00000003'})" in out, out
        again = run(argv(zerotron_cache, tmp_path, 10, "--save", save, "--save-interval", "0", *layout))
        assert codes(again) == [0, 0], again[0][2]
        assert f"loaded {tmp_path / 'checkpoints' / 'step_00000003'} (step 3," in again[0][1], again[0][1]
    assert "[zerotron] stopped: step 3 of 10" in out, out
