"""``scripts/checks/gpu_check.py --tiny`` on CPU: the one-GPU check's own code runs and can fail.

The GPU figures themselves are only meaningful on a GPU (``bash scripts/gpu_check.sh``); here
the script's path through parity, every ZeRO row, the FLOP/MFU arithmetic and its exit code is
exercised, so a broken check is found before the one device run it gets. The passing run is a
process of its own (as ``gpu_check.sh`` starts it): its two-process row starts two more.
"""

import contextlib
import io

import pytest
import torch

from tests.harness import spawn


def run_check(*argv):
    from scripts.checks.gpu_check import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(["--tiny", *argv])
    return rc, out.getvalue(), err.getvalue()


def failing():
    # a peak a million times too low makes MFU > 100%, which the check must refuse
    return run_check("--only", "s0+ckpt", "--peak-tflops", "1e-12")


def test_tiny_check_passes_on_cpu_and_fails_on_an_impossible_mfu(tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "ZEROTRON_DEVICE": "cpu"}
    done = subprocess.run([sys.executable, str(root / "scripts" / "checks" / "gpu_check.py"), "--tiny",
                           "--nvme-path", str(tmp_path / "nvme")], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=400)
    rc, out, err = done.returncode, done.stdout, done.stderr
    assert rc == 0, err[-3000:]
    rows = [line.split()[0] for line in out.splitlines() if line.startswith(("s0", "s1", "s2", "s3", "2proc"))]
    assert rows == ["s0", "s1", "s2", "s3", "s0+ckpt", "s1+ckpt", "s2+ckpt", "s3+ckpt", "s2+ckpt+Pa+cpu",
                    "s2+offload", "s3+nvme", "s3+param-cpu", "s2+fp16", "s3+qwZ+qgZ", "s1+debug", "2proc"]
    assert "worst rel. diff to CPU 0.0e+00" in out and "all checks passed" in out
    pair = next(line for line in out.splitlines() if line.startswith("2proc"))
    assert "gloo on cpu" in pair and "dp2 0.0e+00" in pair, pair  # DP 2 of equal batches: exact
    bad_rc, bad_out, bad_err = spawn(failing, 1, timeout=180)[0]
    assert bad_rc == 1 and "MFU" in bad_err and "impossible" in bad_err and "FAILED" in bad_out


def test_without_a_gpu_only_tiny_runs(monkeypatch, capsys):
    """No CUDA device: exit 2 naming --tiny, before any process group (not a CPU-vs-CPU "parity")."""
    import scripts.checks.gpu_check as check

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is visible: the refusal is for machines without one")

    def no_group(*args, **kwargs):
        raise AssertionError("gpu_check started a process group before refusing")

    monkeypatch.setattr(check, "init_distributed", no_group)
    with pytest.raises(SystemExit) as exit_:
        check.main([])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "no CUDA device is visible" in err and "--tiny" in err


def test_a_size_flag_beside_tiny_holds(monkeypatch, capsys):
    """``--tiny`` sets the sizes' defaults, not the sizes: ``--heads 3`` (64 hidden do not split
    into 3 heads) is refused naming the flag, before any process group."""
    import scripts.checks.gpu_check as check

    def no_group(*args, **kwargs):
        raise AssertionError("gpu_check started a process group: --heads was overridden by --tiny")

    monkeypatch.setattr(check, "init_distributed", no_group)
    with pytest.raises(SystemExit) as exit_:
        check.main(["--tiny", "--heads", "3"])
    assert exit_.value.code == 2 and "--heads" in capsys.readouterr().err


def test_the_wrapper_without_torch_exits_2_saying_so(tmp_path):
    """``gpu_check.sh`` runs the machine's own ``python3``; where that has no torch (a clone whose
    torch is only in ``.venv``) it says so and exits 2, not 1 (a failed check) with a traceback."""
    import os
    import subprocess
    from pathlib import Path

    shim = tmp_path / "python3"  # a python3 without torch, whatever this machine's has
    shim.write_text("#!/bin/sh\necho \"ModuleNotFoundError: No module named 'torch'\" >&2\nexit 1\n")
    shim.chmod(0o755)
    script = Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.sh"
    env = {**os.environ, "PATH": f"{tmp_path}:/usr/bin:/bin"}
    done = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert "python3 has no torch" in done.stderr and ".venv/bin" in done.stderr, done.stderr
