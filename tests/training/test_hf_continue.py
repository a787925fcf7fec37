"""Continued pretraining of an imported model: it learns, any layout gives the same losses, and a
resume is bit-identical.

The model is ``hf_models.py``'s random Llama (GQA, Llama-3.1 rope scaling, untied, sharded),
trained on the built-in corpus with ``tests/training/test_trainer.py``'s shortened run
(``run_steps``: seq 32, global batch 8). In bf16 at TP 2 x DP 2 with ZeRO-2 it learns, and
steps 5-8 after a resume from step 4 are bit-identical to the run that went on. In float64 (the
tier of ``tests/parity.py``) 10 steps at TP 2 x PP 2 give the single process's losses to
``FP64_TP_PP``: the reference is that single process (one rank, no partition, no collective).
"""

from __future__ import annotations

import pytest

from tests.harness import spawn
from tests.parity import FP64_TP_PP, assert_fp64
from tests.training.hf_models import build
from tests.training.test_trainer import fp64, run_steps


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> list[str]:
    out = str(tmp_path_factory.mktemp("hf") / "llama")
    return ["--init-from-hf", spawn(build, 1, "llama", out, 0, "100KB", timeout=240)[0]]


def test_bf16_tp2_dp2_zero2_learns_and_resumes_bit_identically(llama, zerotron_cache, tmp_path):
    flags = llama + ["--tp", "2", "--zero-stage", "2", "--precision", "bf16",
                     "--save", tmp_path / "ck", "--save-interval", "4"]
    full = spawn(run_steps, 4, tmp_path / "a", zerotron_cache, 8, flags, timeout=300)
    resumed = spawn(run_steps, 4, tmp_path / "b", zerotron_cache, 8,
                    flags + ["--load", tmp_path / "ck" / "step_00000004"], timeout=300)
    losses = full[0]
    assert losses[-1] < losses[0] - 0.2, f"continued pretraining does not learn: {losses}"
    for a, b in zip(full, resumed):
        assert b == a[4:], "steps 5-8 after a resume must be bit-identical"


def test_tp2_pp2_gives_the_single_process_losses_in_float64(llama, zerotron_cache, tmp_path):
    flags = llama + ["--precision", "fp64"]
    single = spawn(run_steps, 1, tmp_path / "one", zerotron_cache, 10, flags, timeout=300)[0]
    layout = flags + ["--tp", "2", "--pp", "2", "--zero-stage", "1"]
    for rank, losses in enumerate(spawn(run_steps, 4, tmp_path / "four", zerotron_cache, 10,
                                        layout, timeout=300)):
        assert_fp64(fp64(losses), fp64(single), FP64_TP_PP, f"tp2 pp2 rank {rank} losses")
