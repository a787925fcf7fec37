"""The scripts' flags: each says what it does, and a bad one stops the script before it starts work.

The parser each script builds is caught at ``parse_args`` (nothing runs), so the help check covers
the flags as they are, not a list kept beside them. The bad-flag cases call ``main(argv)`` with
everything that would start work (forking ranks, a process group, a child process, a disk probe)
replaced by a function that fails the test: a flag the ranks would have refused must exit 2 in
the parent, naming the flag, before any of it. What the benchmarks write (the ranks' rendezvous
files, ZeRO-Infinity's offload directory) lies under the checkout's runs/, never the system temp
dir or the caller's cwd, and what a script made for itself is removed when it is done.
"""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ["scripts/train_tokenizer.py", "scripts/preprocess_data.py", "scripts/bench/zeropp.py",
           "scripts/bench/infinity.py", "scripts/convert_checkpoint.py", "scripts/estimate_memory.py",
           "scripts/generate.py"]
STARTS_WORK = ("spawn", "init_distributed", "run_measured", "make_corpus", "measure_bandwidth", "ThreadPoolExecutor",
               "Drill")
BAD_FLAGS = [  # script under scripts/, argv, what the message must name
    ("bench/activation_memory.py", ["--heads", "3"], "--hidden=256 is not divisible by --heads=3"),
    ("bench/activation_memory.py", ["--hidden", "0"], "argument --hidden: 0 is not a positive integer"),
    ("bench/activation_memory.py", ["--heads", "5", "--hidden", "320"], "--heads=5 is not divisible by parallel.tp=2"),
    ("bench/infinity.py", ["--steps", "1"], "--steps 1: give at least 2"),
    ("bench/infinity.py", ["--buffer-count", "1"], "--buffer-count=1: need >= 2"),
    ("bench/infinity.py", ["--nvme-path", "no/such/dir"], "--nvme-path no/such/dir: not a directory"),
    ("bench/memory_grid.py", ["--hidden", "200"], "--hidden=200 is not divisible by --heads=3"),
    ("bench/memory_grid.py", ["--tolerance", "0"], "argument --tolerance: 0 is not a finite number > 0"),
    ("bench/overhead.py", ["--steps", "0"], "argument --steps: 0 is not a positive integer"),
    ("bench/overhead.py", ["--hidden", "200"], "--hidden=200 is not divisible by --heads=3"),
    ("bench/pipeline.py", ["--steps", "0"], "argument --steps: 0 is not a positive integer"),
    ("bench/pipeline.py", ["--forward-ms", "-5"], "argument --forward-ms: -5 is not a finite number > 0"),
    ("bench/pipeline.py", ["--virtual", "3"], "--layers-per-stage 4 does not split into --virtual [3]"),
    ("bench/pipeline.py", ["--micro", "5", "6"], "needs a --micro that is a multiple of --pp 4"),
    ("bench/zeropp.py", ["--node", "3"], "--node=3: must divide the data-parallel size 4"),
    ("bench/memory.py", ["--ranks", "0"], "argument --ranks: 0 is not a positive integer"),
    ("bench/memory.py", ["--stages", "5"], "argument --stages: invalid choice: 5"),
    ("bench/zero.py", ["--only", "nosuch"], "--only nosuch: unknown; choose from ['ddp', 'fsdp2',"),
    ("bench/zero.py", ["--hidden", "200"], "--hidden=200 is not divisible by --heads=3"),
    ("bench/dry_run_sweep.py", ["--jobs", "0", "--out", "{tmp}"], "argument --jobs: 0 is not a positive integer"),
    ("bench/dry_run_sweep.py", ["--only", "nosuch", "--out", "{tmp}"], "--only 'nosuch' matches no setup; give table"),
    ("bench/step_time_table.py", ["--dry-run", "nosuch", "--out", "{tmp}"],
     "--dry-run ['nosuch']: not a setup"),
    ("bench/preprocess.py", ["--size-mb", "0", "--out", "{tmp}"], "argument --size-mb: 0 is not a finite number > 0"),
    ("bench/preprocess.py", ["--workers", "0", "--out", "{tmp}"], "argument --workers: 0 is not a positive integer"),
    ("checks/smoke_grid.py", ["--tp", "0"], "argument --tp: 0 is not a positive integer"),
    ("checks/smoke_grid.py", ["--tp", "3"], "--tp*--pp=3*1=3 does not divide the 1 processes"),
    ("checks/gpu_check.py", ["--heads", "5"], "--hidden=2048 is not divisible by --heads=5"),
    ("checks/gpu_check.py", ["--tiny", "--only", "s9"], "argument --only: invalid choice: 's9'"),
    ("bench/async_save.py", ["--hidden", "500", "--out", "{tmp}"], "--hidden=500 is not divisible by the model's 8"),
    ("bench/async_save.py", ["--steps", "2", "--out", "{tmp}"], "--steps 2 leaves no interval save before the last"),
    ("drill.py", ["--nproc", "1", "--out", "{tmp}"], "--nproc 1: the DP layout needs at least 2 ranks"),
    ("drill.py", ["--timeout", "-1", "--out", "{tmp}"], "argument --timeout: -1 is not a finite number > 0"),
]


class _Parsed(Exception):
    def __init__(self, parser):
        self.parser = parser


def _load(script: str):
    spec = importlib.util.spec_from_file_location(Path(script).stem + "_flags", ROOT / script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _parser_of(script: str) -> argparse.ArgumentParser:
    module = _load(script)

    def catch(self, *args, **kwargs):
        raise _Parsed(self)

    original = argparse.ArgumentParser.parse_args
    argparse.ArgumentParser.parse_args = catch
    try:
        module.main()
    except _Parsed as parsed:
        return parsed.parser
    finally:
        argparse.ArgumentParser.parse_args = original
    raise AssertionError(f"{script}: main() never parsed its arguments")


def without_work(monkeypatch, script: str):
    """The script's module, every entry point in ``STARTS_WORK`` it holds failing the test."""
    module = _load(script)

    def started(*args, **kwargs):
        raise AssertionError(f"{script} started work before refusing its flags")

    for name in STARTS_WORK:
        if hasattr(module, name):
            monkeypatch.setattr(module, name, started)
    return module


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_flag_has_help_text(script):
    parser = _parser_of(script)
    flags = [a for a in parser._actions if not isinstance(a, argparse._HelpAction)]
    assert flags, f"{script} defines no flags"
    silent = [a.option_strings[0] if a.option_strings else a.dest for a in flags
              if not a.help or a.help == argparse.SUPPRESS]
    assert not silent, f"{script}: flags without help text: {silent}"


@pytest.mark.parametrize("script,argv,needle", BAD_FLAGS, ids=[f"{s} {' '.join(a)}" for s, a, _ in BAD_FLAGS])
def test_a_bad_flag_exits_2_naming_it_before_any_work(script, argv, needle, monkeypatch, capsys, tmp_path):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    module = without_work(monkeypatch, f"scripts/{script}")
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exit_:
        module.main([str(out) if a == "{tmp}" else a for a in argv])
    err = capsys.readouterr().err
    assert exit_.value.code == 2, err
    assert needle in err, err
    assert not out.exists(), f"{script} wrote {out} before refusing its flags"


@pytest.mark.parametrize("script,argv", [("drill.py", ["--only", "kill9", "--layouts", "dp"]),
                                         ("run_ablations.py", ["--configs", "C1"])])
@pytest.mark.parametrize("below", ["", "sub"], ids=["the file", "below the file"])
def test_an_out_that_is_a_file_exits_2_naming_it(script, argv, below, monkeypatch, capsys, tmp_path):
    taken = tmp_path / "results.txt"
    taken.write_text("kept")
    out = taken / below if below else taken
    module = without_work(monkeypatch, f"scripts/{script}")
    with pytest.raises(SystemExit) as exit_:
        module.main([*argv, "--out", str(out)])
    err = capsys.readouterr().err
    assert exit_.value.code == 2, err
    assert f"--out {out}: not a directory ({taken} is a file)" in err, err
    assert taken.read_text() == "kept"


def test_a_failed_stage3_check_exits_1_naming_it(monkeypatch, capsys):
    module = _load("scripts/bench/memory.py")
    mib = 1 << 20

    def ranks(worker, world, args, stage, window, **kwargs):  # stage 3's forward peak far too high
        peak = (1000 if stage == 3 else 10) * mib
        row = {f"mem_{p}_peak_bytes": peak for p in ("construction", "forward", "backward", "step")}
        return [{**row, "mem_peak_bytes": peak, "rss_bytes": 300 * mib, "model_states": mib, "psi": 1000}] * world

    monkeypatch.setattr(module, "spawn", ranks)
    code = module.main(["--ranks", "2", "--layers", "1", "--hidden", "64", "--vocab", "256", "--seq", "16",
                        "--stages", "2", "3"])
    captured = capsys.readouterr()
    assert code == 1 and ": NO" in captured.out
    assert "FAILED check(s): stage 3 (--prefetch 1) forward peak" in captured.err


def test_a_failed_dry_run_fails_the_sweep(monkeypatch, capsys, tmp_path):
    module = _load("scripts/bench/dry_run_sweep.py")
    monkeypatch.setattr(module, "dry_run_env", lambda: None)
    monkeypatch.setattr(module, "run", lambda job, out_dir, env: {**job, "seconds": 0.0, "error": "boom"})
    with pytest.raises(SystemExit) as exit_:
        module.main(["--only", "C5 40B", "--out", str(tmp_path)])
    assert exit_.value.code == 1
    assert "1 of 1 dry runs failed: C5 40B" in capsys.readouterr().err


def test_preprocess_shows_the_refusal_of_the_script_it_measures(monkeypatch, capsys, tmp_path):
    module = _load("scripts/bench/preprocess.py")
    def no_documents(path, size_mb):
        Path(path).write_text("")
        return 0

    monkeypatch.setattr(module, "make_corpus", no_documents)
    monkeypatch.setattr(module, "build_default_corpus", lambda directory: (None, "tokenizer.model", None))

    def refused(name, cmd, log):
        raise module.ChildFailed(name, 2, "preprocess_data.py: error: the input holds no documents")

    monkeypatch.setattr(module, "run_measured", refused)
    assert module.main(["--out", str(tmp_path)]) == 2
    assert "exited 2:\npreprocess_data.py: error: the input holds no documents" in capsys.readouterr().err
    assert not list(tmp_path.iterdir()), "the work directory is left behind"


class _Spawned(Exception):
    pass


@pytest.mark.parametrize("script", ["activation_memory.py", "infinity.py", "memory.py", "overhead.py", "pipeline.py",
                                    "zero.py", "zeropp.py"])
def test_the_ranks_rendezvous_under_the_checkouts_runs_from_any_cwd(script, monkeypatch, tmp_path):
    """Not the system temp dir (spawn's default), not a runs/ of whatever directory it is run from."""
    module = _load(f"scripts/bench/{script}")
    seen = {}

    def spawn(*args, store_dir=None, **kwargs):
        seen["store_dir"] = store_dir
        raise _Spawned

    monkeypatch.setattr(module, "spawn", spawn)
    monkeypatch.setattr(module, "measure_bandwidth", lambda path, mb: {"write_GiBps": 1.0, "read_GiBps": 1.0},
                        raising=False)
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")  # zero.py sets it for its ranks; restored after the test
    monkeypatch.chdir(tmp_path)
    with pytest.raises(_Spawned):
        module.main(["--nvme-path", str(tmp_path)] if script == "infinity.py" else [])
    assert seen["store_dir"] is not None and Path(seen["store_dir"]) == ROOT / "runs" / "bench"


def test_infinity_removes_the_offload_directory_it_made(monkeypatch, tmp_path):
    module = _load("scripts/bench/infinity.py")
    monkeypatch.setattr(module, "ROOT", tmp_path)
    made = []

    def measure(a, path, shape):
        made.append(Path(path))
        (Path(path) / "optimizer.bin").write_bytes(b"x")  # what a run leaves there when it stops early
        raise _Spawned

    monkeypatch.setattr(module, "measure", measure)
    with pytest.raises(_Spawned):
        module.main([])
    assert made and made[0].parent == tmp_path / "runs" / "bench" / "infinity"
    assert not (tmp_path / "runs" / "bench" / "infinity").exists()
