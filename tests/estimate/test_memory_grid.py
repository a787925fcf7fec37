"""The memory model predicts the measured peak within 5% over the ablation grid: ZeRO stages 0-3 x checkpointing off / on / Pa / Pa+cpu at TP 2 x DP 2 and TP 1 x DP 4,
through ``scripts/bench/memory_grid.py``. The peak is ``MemoryTracker``'s (live storages, the
allocator's side), never the optimizer's own sizes; storage sizes do not depend on the machine,
so the tolerance holds anywhere."""

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _script():
    spec = importlib.util.spec_from_file_location("memory_grid", ROOT / "scripts" / "bench" / "memory_grid.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# 24 configurations x 2 bf16 steps on 4 ranks sharing the one CPU their xdist worker is pinned
# to, at hidden 128 (the script's default is 256): where torch emulates bf16 (an AMD EPYC without
# AVX512-BF16: a 256x768x256 bf16 matmul takes 50 ms there, fp32 1.7 ms) hidden 256 took 233 s
# of the suite's 10 minutes, hidden 128 takes 40 s. Activations are still 15 % of the peak
# (checkpointing off against on, TP 2 x DP 2, stage 0), three times the tolerance.
@pytest.mark.timeout(900)
def test_the_grid_is_within_five_percent(capsys, tmp_path):
    code = _script().main(["--tolerance", "0.05", "--windows", "2", "--hidden", "128",
                           "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert "24 of 24 within 5%" in out, out
    assert code == 0
