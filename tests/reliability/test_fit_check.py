"""A run that cannot fit is refused at start-up, on every rank, before any process group (issue 46).

References: the memory model's own prediction (``estimate/memory_model.py``) and what the host
reports (``/proc/meminfo``; a cgroup limit substituted where the test needs a 6 GiB container).
The end-to-end case goes through scripts/pretrain_gpt.py's ``main`` on 2 gloo ranks.
"""

from __future__ import annotations

import pytest

from tests.reliability.common import run, tiny
from zerotron.parallel import runtime
from zerotron.training.config import ConfigError

GIB = 2**30
HUGE = ["--model.hidden_size", "16384", "--model.num_layers", "48", "--model.num_heads", "128"]
BILLION = ["--model.hidden_size", "1536", "--model.num_layers", "40", "--model.num_heads", "16",
           "--seq-length", "1024"]


def _cfg(*flags):
    from zerotron.training.cli import last_wins, parse_config

    base = ["--config", "configs/tiny.yaml", "--tp", "1", "--save", "none"]
    return parse_config(last_wins(base + list(flags))).validate(2)


def test_a_model_far_too_big_is_refused_on_every_rank_in_seconds(zerotron_cache):
    res = run(tiny(zerotron_cache) + HUGE, timeout=60)
    for code, _, err, seconds in res:
        assert code == 2, err
        assert "config error: the run cannot fit: the memory model predicts at least" in err, err
        assert "--training.skip_memory_check true" in err and seconds < 10, (err, seconds)


def test_a_billion_parameters_in_a_6_gib_cgroup_is_refused_naming_limit_and_fix(monkeypatch):
    from zerotron.training.fit_check import check_fit, predicted_bytes
    from zerotron.training.setup_run import validate_model

    monkeypatch.setattr(runtime, "_cgroup_room", lambda: (6 * GIB, "the cgroup limit memory.max"))
    monkeypatch.setattr(runtime, "_meminfo_available", lambda: 100 * GIB)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    cfg = _cfg(*BILLION)
    mcfg = validate_model(cfg)
    need = predicted_bytes(cfg, mcfg, 2, "cpu", "gloo")
    assert 3 * GIB < need < 100 * GIB  # more than each rank's half of 6 GiB, less than the host
    with pytest.raises(ConfigError) as err:
        check_fit(cfg, mcfg, 2)
    text = str(err.value)
    assert f"at least {need / GIB:.2f} GiB per rank" in text and "3.00 GiB is available" in text
    assert "the cgroup limit memory.max, shared by 2 ranks on this host" in text
    assert "nearest fix: " in text
    check_fit(_cfg(*BILLION, "--training.skip_memory_check", "true"), mcfg, 2)  # the user knows
    monkeypatch.setattr(runtime, "_cgroup_room", lambda: None)
    check_fit(cfg, mcfg, 2)  # the same run on the 100 GiB host starts


def test_the_nearest_fix_is_one_the_model_says_fits(monkeypatch):
    from zerotron.training.fit_check import check_fit, predicted_bytes
    from zerotron.training.setup_run import validate_model

    cfg = _cfg(*BILLION, "--zero-stage", "0", "--micro-batch-size", "1")
    mcfg = validate_model(cfg)
    need = predicted_bytes(cfg, mcfg, 2, "cpu", "gloo")
    partitioned = _cfg(*BILLION, "--zero-stage", "1", "--micro-batch-size", "1")
    stage1 = predicted_bytes(partitioned, mcfg, 2, "cpu", "gloo")
    assert stage1 < need
    room = int((need + stage1) / 2)  # stage 0 does not fit; partitioning the optimizer state does
    monkeypatch.setattr(runtime, "memory_available", lambda device, local: (room, "a budget"))
    with pytest.raises(ConfigError, match=r"nearest fix: zero.stage=1 \(predicted"):
        check_fit(cfg, mcfg, 2)
