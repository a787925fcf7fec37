"""``training.deterministic`` reaches torch inside the rank, and false leaves torch as it was.

The reference is torch's own state (``torch.are_deterministic_algorithms_enabled``, the
``CUBLAS_WORKSPACE_CONFIG`` variable cuBLAS reads, ``torch.backends.cuda.cudnn_sdp_enabled``),
read after ``build_run`` -- the one set-up every entry point goes through -- in a gloo rank on
CPU. That the flag makes a GPU run resume bit for bit is ``gpu_check.py``'s ``resume`` row.
"""

from __future__ import annotations

from pathlib import Path

from tests.harness import spawn

ROOT = Path(__file__).resolve().parents[2]


def _built_with(run_dir, cache, deterministic: bool) -> dict:
    import os

    import torch

    from zerotron.config.cli import last_wins, parse_config
    from zerotron.parallel.runtime import init_distributed
    from zerotron.training.build_run import build_run

    argv = ["--config", str(ROOT / "configs" / "tiny.yaml"), "--tp", "1", "--seq-length", "32",
            "--micro-batch-size", "2", "--global-batch-size", "2", "--train-steps", "1",
            "--wandb-mode", "disabled", "--eval-interval", "0", "--save", "none",
            "--run-dir", str(run_dir), "--data.cache_dir", cache,
            "--training.deterministic", str(deterministic).lower()]
    cfg = parse_config(last_wins(argv)).validate(1)
    run = build_run(cfg, init_distributed())  # as the tests' runs start: their own group
    try:
        return {"algorithms": torch.are_deterministic_algorithms_enabled(),
                "cublas": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
                "cudnn_sdp": torch.backends.cuda.cudnn_sdp_enabled()}
    finally:
        run.close_loaders()
        run.release_lock()
        run.grid.close()


def _false_then_true(run_dir, cache) -> tuple[dict, dict]:
    """Deterministic mode is process-wide and never undone, so false is read first."""
    import os

    os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
    off = _built_with(Path(run_dir) / "off", cache, False)
    on = _built_with(Path(run_dir) / "on", cache, True)
    return off, on


def test_the_field_reaches_torch_and_false_changes_nothing(zerotron_cache, tmp_path):
    off, on = spawn(_false_then_true, 1, tmp_path, zerotron_cache, timeout=120)[0]
    assert off == {"algorithms": False, "cublas": None, "cudnn_sdp": True}, off
    assert on == {"algorithms": True, "cublas": ":4096:8", "cudnn_sdp": False}, on


def test_the_drill_asks_for_deterministic_kernels_only_on_a_gpu(monkeypatch, tmp_path):
    """The drill compares losses bit for bit: on CUDA its jobs get the flag, on CPU nothing new."""
    import torch

    import zerotron.testing.drill_run as drill_run
    from zerotron.testing.drill_job import layouts

    for device, wanted in (("cuda", ["--training.deterministic", "true"]), ("cpu", [])):
        monkeypatch.setattr(drill_run, "pick_device", lambda device=device: torch.device(device))
        d = drill_run.Drill(tmp_path / device, "dp", layouts(2)["dp"], 30.0, tmp_path / "tmp")
        argv = d.argv("base", 12, None)
        flag = [a for i, a in enumerate(argv) if "deterministic" in a or
                (i and "deterministic" in argv[i - 1])]
        assert flag == wanted, argv
