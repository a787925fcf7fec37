"""scripts/dry_run.py's hardware flags: ``--gpu`` picks the preset the step model and the fit
check use; a bad figure exits 2 naming its flag before any rank is built.

The predicted step is checked against the model it reports: the terms add up to the step,
TFLOPs/GPU is the counted FLOPs over it, and the H100 preset fits against 80 GB, not 32.
"""

import importlib.util
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def dry_run(tmp_path, *flags):
    """``scripts/dry_run.py``'s ``main`` in this process (``--device cpu``: no re-execution)."""
    torch.set_num_threads(1)
    spec = importlib.util.spec_from_file_location("dry_run_script", ROOT / "scripts" / "dry_run.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main(["--config", str(ROOT / "configs" / "tiny.yaml"), "--gpus", "4",
                        "--ranks", "3", "--device", "cpu", "--out", str(tmp_path),
                        "--data.cache_dir", str(tmp_path / "cache"), *flags])


def test_h100_preset_prediction_adds_up(tmp_path, capsys):
    e = dry_run(tmp_path, "--gpu", "h100", "--json", "--training.precision", "bf16")["ranks"]["3"]
    p = e["predicted"]
    assert p["hardware"] == "H100 DGX"
    terms = (p["compute_s"] + p["bubble_s"] + p["exposed_comm_s"] + p["optimizer_s"]
             + p["host_copy_s"])
    assert p["step_s"] == pytest.approx(terms, rel=1e-12)
    assert p["tflops_per_gpu"] == pytest.approx(p["flops_per_gpu"] / p["step_s"] / 1e12, rel=1e-12)
    assert p["compute_s"] == pytest.approx(p["gemm_s"] + p["attention_s"] + p["elementwise_s"])
    assert e["fits"] and e["peak_bytes"] < 80e9
    # rank 3's groups (TP 2 x DP 2); a CPU dry run is a gloo run: no NCCL buffers
    assert e["nccl_groups"] == {"tp": 2, "dp": 2, "world": 4} and e["nccl_communicators"] == 0


@pytest.mark.parametrize("flags,message", [
    (["--gpu", "a100"], "argument --gpu: invalid choice: 'a100'"),
    (["--efficiency", "1.5"], "--efficiency 1.5: a fraction of peak in (0, 1]"),
    (["--gpus-per-node", "0"], "--gpus-per-node: Hardware.gpus_per_node=0: must be > 0"),
    (["--hbm-gbps", "-1"], "--hbm-gbps: Hardware.hbm_gbps=-1.0: must be > 0"),
    (["--sm-count", "-1"], "--sm-count: Hardware.sm_count=-1: must be >= 0"),
])
def test_bad_hardware_flag_exits_2(tmp_path, capsys, flags, message):
    with pytest.raises(SystemExit) as exit_:
        dry_run(tmp_path, *flags)
    assert exit_.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "tiny-4gpus").exists()  # before any rank was built
