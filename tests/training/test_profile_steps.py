"""``--profile-steps A B``: a torch.profiler trace of those steps under the run dir, per rank."""

from __future__ import annotations

import json

import pytest

from tests.harness import spawn
from tests.training.test_trainer import make_config


def profiled_run(run_dir, cache):
    import torch.distributed as dist

    from zerotron.parallel.runtime import init_distributed
    from zerotron.training.build_run import build_run
    from zerotron.training.trainer import Trainer

    cfg = make_config(run_dir, cache, "--profile-steps", "3", "4", "--train-steps", "5")
    trainer = Trainer(build_run(cfg.validate(dist.get_world_size()), init_distributed()))
    trainer.train()
    return str(trainer.profiler.trace)


def test_profile_steps_write_a_trace_of_those_steps(zerotron_cache, tmp_path):
    """The Chrome trace-event JSON Perfetto and TensorBoard's profiler plugin read: a
    ``ProfilerStep#3`` and ``#4`` span and the operators that ran inside them, no other step."""
    traces = spawn(profiled_run, 2, tmp_path / "run", zerotron_cache, timeout=240)
    assert traces == [str(tmp_path / "run" / "profile" / f"rank_{r}.pt.trace.json") for r in (0, 1)]
    trace = tmp_path / "run" / "profile" / "rank_1.pt.trace.json"
    events = json.loads(trace.read_text())["traceEvents"]
    steps = {e["name"]: e for e in events if e.get("name", "").startswith("ProfilerStep#")}
    assert sorted(steps) == ["ProfilerStep#3", "ProfilerStep#4"], sorted(steps)
    step4 = steps["ProfilerStep#4"]
    ops = [e for e in events if e.get("ph") == "X" and e.get("name", "").startswith("aten::")]
    inside = [e["name"] for e in ops if step4["ts"] <= e["ts"] <= step4["ts"] + step4["dur"]]
    assert "aten::mm" in inside or "aten::addmm" in inside, sorted(set(inside))[:20]


@pytest.mark.parametrize("steps,fix", [(["4", "3"], "need 1 <= A <= B"),
                                       (["3", "9"], "training.train_steps=5")])
def test_bad_profile_steps_name_the_field(steps, fix, tmp_path):
    from zerotron.config.run_config import ConfigError

    cfg = make_config(tmp_path, str(tmp_path), "--profile-steps", *steps, "--train-steps", "5")
    want = rf"logging.profile_steps=\[{steps[0]}, {steps[1]}\]: .*{fix}"
    with pytest.raises(ConfigError, match=want):
        cfg.validate(1)
