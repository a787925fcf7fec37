"""A training step with no host synchronisation: the budget of host reads (``parallel.host_sync``).

On a GPU every host read of a device value drains the queue, so the step is held to a count:
none per micro-batch; none per step in bf16 besides the trainer's SIGTERM agreement
(``"stop"``), and that one only at steps that read anyway or once per 10 s of steps
(``training/stop_cadence.py``; here step 1, before any step time is known, and the last step);
in fp16 exactly one more, the overflow decision (``"overflow"``). The NaN check
(``"nan"``) and the metrics (``"log"``) are read at the log interval only, the run summary
(``"summary"``) once at the end. Counted on 2 gloo ranks (DP 2, and PP 2) with the trainer of
configs/tiny.yaml shortened to seq 16, micro-batch 1.

Clipping with a tensor coefficient must leave the parameters bit for bit where the host-float
coefficient left them: the reference run swaps in the previous host arithmetic (``.tolist()`` of
the reduced squared norms, ``math.sqrt``, ``min(1, max_norm / (norm + 1e-6)) / scale``).

Everything runs in one spawn (one start-up, one import of torch._dynamo) so the module stays fast.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch._dynamo  # noqa: F401 - imported once here, not in every forked rank (start-up dominates)

from tests.harness import spawn

ROOT = Path(__file__).resolve().parents[2]
MICRO = 4  # micro-batches per rank and step
STEPS = 2  # steps counted one by one with train_step, then as many through the loop
SCENARIOS = {"bf16": ["--precision", "bf16"], "fp16": ["--precision", "fp16"],
             "bf16-pp2": ["--precision", "bf16", "--pp", "2"]}


def _config(cache: str, run_dir: str, *flags):
    import torch.distributed as dist

    from zerotron.config.cli import last_wins, parse_config

    world = dist.get_world_size()
    pp = int(flags[flags.index("--pp") + 1]) if "--pp" in flags else 1
    base = ["--config", str(ROOT / "configs" / "tiny.yaml"), "--tp", "1", "--seq-length", "16",
            "--micro-batch-size", "1", "--global-batch-size", str(MICRO * world // pp),
            "--train-steps", str(2 * STEPS), "--wandb-mode", "disabled", "--log-interval", "100",
            "--eval-interval", "0", "--run-dir", run_dir, "--data.cache_dir", cache, "--save", "none",
            "--optimizer.warmup_steps", "2"]
    return parse_config(last_wins(base + [str(f) for f in flags])).validate(world)


def _counts(cache: str, run_dir: str, flags: list[str]) -> dict:
    """Host reads of ``run_step`` on synthetic batches, of each ``train_step``, and of the loop."""
    from zerotron.parallel import host_sync
    from zerotron.parallel.runtime import init_distributed
    from zerotron.training.step import run_step
    from zerotron.training.build_run import build_run
    from zerotron.training.trainer import Trainer

    cfg = _config(cache, run_dir, *flags)
    trainer = Trainer(build_run(cfg, init_distributed()))
    try:
        g = torch.Generator().manual_seed(0)
        shape = (cfg.training.micro_batch_size, trainer.mcfg.seq_length)
        batches = [(torch.randint(0, trainer.mcfg.vocab_size, shape, generator=g),
                    torch.randint(0, trainer.mcfg.vocab_size, shape, generator=g)) for _ in range(MICRO)]
        with host_sync.counting() as syncs:
            res = run_step(trainer.model, trainer.opt, batches, trainer.grid, memory=None)
        out = {"run_step": dict(syncs.by_reason), "loss_is_tensor": isinstance(res.loss_sum, torch.Tensor),
               "grad_norm_is_tensor": isinstance(res.info["grad_norm"], torch.Tensor), "train_step": []}
        for _ in range(STEPS):
            with host_sync.counting() as syncs:
                trainer.train_step()
            out["train_step"].append(dict(syncs.by_reason))
        with host_sync.counting() as syncs:
            last = trainer.train()
        out["loop"], out["logged_loss"] = dict(syncs.by_reason), last["loss"]
        return out
    finally:
        trainer.grid.close()


def _nan_run(cache: str, run_dir: str, save: str) -> str:
    """bf16, a weight poisoned at step 2, logging every 100 steps, a checkpoint due at step 3."""
    import os

    from zerotron.parallel.runtime import init_distributed
    from zerotron.training.build_run import build_run
    from zerotron.training.trainer import Trainer, TrainingStopped

    cfg = _config(cache, run_dir, "--precision", "bf16", "--save", save, "--save-interval", "3")
    os.environ["ZEROTRON_FAULT"] = "nan@step=2"
    trainer = Trainer(build_run(cfg, init_distributed()))
    try:
        trainer.train()
        return "no TrainingStopped"
    except TrainingStopped as e:
        return f"{e} | steps run {trainer.step}"
    finally:
        del os.environ["ZEROTRON_FAULT"]
        trainer.grid.close()


def _legacy_global_norm(counted, uncounted, group):
    """The host arithmetic the device norm replaced (norm and overflow as Python values)."""
    from zerotron.parallel import collectives as C

    both = torch.stack([counted, uncounted])
    C.all_reduce(both, group)
    total, other = both.tolist()
    overflow = not (math.isfinite(total) and math.isfinite(other))
    norm = total if not math.isfinite(total) else (other if overflow else math.sqrt(total))
    return torch.tensor(norm, dtype=torch.float64), torch.tensor(not overflow)


def _legacy_clip_coef(norm, max_norm, scale=1.0):
    return (1.0 if not max_norm or max_norm <= 0 else min(1.0, max_norm / (float(norm) + 1e-6))) / scale


def _clip_bitwise() -> list[str]:
    """Mismatches between the device coefficient and the host one: the function, then whole runs."""
    import zerotron.zero.optimizer as zopt
    from tests.zero.common import HYPER, batches, zero_train
    from tests.zero.models import TinyLM
    from zerotron.parallel import Grid, ParallelDims
    from zerotron.zero import ZeroConfig, ZeroOptimizer
    from zerotron.zero.clip import clip_coef, global_norm

    grid = Grid(ParallelDims())
    bad = []
    g = torch.Generator().manual_seed(1)
    norms = (torch.rand(300, generator=g, dtype=torch.float64) * 3).tolist() + [0.0, 0.5, 1.0, 1.0 - 1e-6, 2.0]
    for max_norm in (1.0, 0.3):
        for scale in (1.0, 2.0 ** 12):
            for n in norms:
                got = clip_coef(torch.tensor(n, dtype=torch.float64), max_norm, scale).item()
                if got != _legacy_clip_coef(n, max_norm, scale):
                    bad.append(f"clip_coef({n!r}, {max_norm}, {scale})")
    for counted, uncounted in ((3.7, 0.2), (float("inf"), 1.0), (2.0, float("nan")), (float("nan"), float("inf"))):
        args = (torch.tensor(counted * (grid.rank + 1)), torch.tensor(uncounted), grid.world_group)
        (norm, finite), (ref, ref_finite) = global_norm(*args), _legacy_global_norm(*args)
        if not (torch.equal(norm, ref) or (norm.isnan() and ref.isnan())) or bool(finite) != bool(ref_finite):
            bad.append(f"global_norm({counted}, {uncounted}): {norm.item()} vs {ref.item()}")
    data = batches(2, 2, grid.dp_size)
    for precision, stage, offload in (("fp32", 0, False), ("bf16", 1, False), ("fp32", 3, False), ("bf16", 2, True)):
        finals = []
        for legacy in (False, True):
            cfg = ZeroConfig(stage=stage, reduce_bucket_size=400, allgather_bucket_size=400,
                             stage3_param_persistence_threshold=0, offload_optimizer=offload)
            model = TinyLM()
            opt = ZeroOptimizer(model, grid, cfg, clip_grad=0.05, precision=precision, **HYPER)
            saved = zopt.global_norm, zopt.clip_coef
            if legacy:
                zopt.global_norm, zopt.clip_coef = _legacy_global_norm, _legacy_clip_coef
            try:
                infos, _ = zero_train(model, opt, data, grid.dp_rank)
            finally:
                zopt.global_norm, zopt.clip_coef = saved
            if not all(float(i["grad_norm"]) > 0.05 for i in infos):
                bad.append(f"{precision} stage {stage}: the clip never acted")
            finals.append(dict(opt.full_params()))
        for name, value in finals[0].items():
            if not torch.equal(value, finals[1][name]):
                bad.append(f"{precision} stage {stage} offload {offload}: {name} differs")
    return bad


def measure(cache: str, tmp: str) -> dict:
    out = {name: _counts(cache, f"{tmp}/{name}", flags) for name, flags in SCENARIOS.items()}
    out["nan"] = _nan_run(cache, f"{tmp}/nan", f"{tmp}/nan_ck")
    out["clip"] = _clip_bitwise()
    return out


@pytest.fixture(scope="module")
def measured(zerotron_cache, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("host_syncs")
    return spawn(measure, 2, zerotron_cache, str(tmp), timeout=120), tmp


@pytest.mark.parametrize("name", ["bf16", "bf16-pp2"])
def test_bf16_step_reads_nothing_per_micro_batch_and_at_most_the_stop_per_step(measured, name):
    for rank, res in enumerate(measured[0]):
        r = res[name]
        assert r["loss_is_tensor"] and r["grad_norm_is_tensor"]
        assert r["run_step"] == {}, (rank, r["run_step"])  # MICRO micro-batches, then the optimizer step
        assert r["train_step"] == [{}] * STEPS, (rank, r["train_step"])  # no log step among them
        # nan, log, stragglers (every rank's busy time): the last step, a log step; summary: the
        # end-of-run peak memory over ranks (training/run_log.py)
        # stop: step 1 (no step time measured yet) and the last step (STEPS = 2)
        want = {"stop": STEPS, "nan": 1, "log": 1, "stragglers": 1, "summary": 1}
        assert r["loop"] == want, (rank, r["loop"])
        assert math.isfinite(r["logged_loss"]) and r["logged_loss"] == measured[0][0][name]["logged_loss"]


def test_fp16_step_reads_only_its_overflow_decision(measured):
    for rank, res in enumerate(measured[0]):
        r = res["fp16"]
        assert r["run_step"] == {"overflow": 1}, (rank, r["run_step"])
        assert r["train_step"] == [{"overflow": 1}] * STEPS, (rank, r["train_step"])
        want = {"overflow": STEPS, "stop": STEPS, "nan": 1, "log": 1, "stragglers": 1, "summary": 1}
        assert r["loop"] == want, (rank, r["loop"])


def test_tensor_clip_coefficient_gives_the_host_coefficients_parameters_bitwise(measured):
    for rank, res in enumerate(measured[0]):
        assert res["clip"] == [], (rank, res["clip"][:10])


def test_nan_loss_stops_at_the_next_check_with_its_step_and_writes_no_checkpoint(measured):
    results, tmp = measured
    for rank, res in enumerate(r["nan"] for r in results):
        assert res.startswith(f"loss is nan at step 2 (consumed samples {MICRO * 2})"), (rank, res)
        assert res.endswith("steps run 3"), (rank, res)  # found before the step-3 checkpoint, not per step
    saved = sorted(p.name for p in (tmp / "nan_ck").iterdir()) if (tmp / "nan_ck").exists() else []
    assert not [n for n in saved if n.startswith("step_")], saved
