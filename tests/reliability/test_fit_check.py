"""A run that cannot fit is refused at start-up, on every rank, before any process group (issue 46).

References: the memory model's own prediction (``estimate/memory_model.py``) and what the host
reports (``/proc/meminfo``; a 6 GiB container's ``memory.max`` faked through the one function
that reads the cgroup's files, ``runtime._cgroup_file``). The end-to-end cases go through
scripts/pretrain_gpt.py's ``main`` on 2 gloo ranks. That the refusal comes before the process
group (so before the model is built) is held by the mechanism, not by a clock: ``init_distributed``
raises if it is reached. scripts/drill.py reports the seconds.
"""

from __future__ import annotations

import pytest

from tests.reliability.common import forbid_process_group, run, tiny
from zerotron.parallel import runtime
from zerotron.config.run_config import ConfigError

GIB = 2**30
HUGE = ["--model.hidden_size", "16384", "--model.num_layers", "48", "--model.num_heads", "128"]
BILLION = ["--model.hidden_size", "1536", "--model.num_layers", "40", "--model.num_heads", "16",
           "--seq-length", "1024"]


def _cfg(*flags):
    from zerotron.config.cli import last_wins, parse_config

    base = ["--config", "configs/tiny.yaml", "--tp", "1", "--save", "none"]
    return parse_config(last_wins(base + list(flags))).validate(2)


@pytest.fixture
def no_process_group(monkeypatch):
    forbid_process_group(monkeypatch)


def _container(monkeypatch, limit: int, usage: int) -> None:
    """A cgroup v2 memory limit of ``limit`` bytes with ``usage`` in use, on a 100 GiB host."""
    files = {"memory.max": str(limit), "memory.current": str(usage)}
    monkeypatch.setattr(runtime, "_cgroup_file", files.get)
    monkeypatch.setattr(runtime, "_meminfo_available", lambda: 100 * GIB)


def test_a_model_far_too_big_is_refused_on_every_rank_before_any_process_group(
        zerotron_cache, no_process_group):
    res = run(tiny(zerotron_cache) + HUGE, timeout=60)
    for code, _, err, _ in res:
        assert code == 2, err
        assert "config error: the run cannot fit: the memory model predicts at least" in err, err
        assert "--training.skip_memory_check true" in err, err


def test_a_billion_parameters_in_a_6_gib_container_exits_2_on_every_rank(
        zerotron_cache, no_process_group, monkeypatch):
    _container(monkeypatch, 6 * GIB, 256 * 2**20)
    res = run(tiny(zerotron_cache) + BILLION, env={"LOCAL_WORLD_SIZE": "2"}, timeout=60)
    for code, _, err, _ in res:
        assert code == 2, err
        assert "config error: the run cannot fit" in err, err
        assert "but 2.88 GiB is available (the cgroup limit /sys/fs/cgroup/memory.max less its " \
               "usage, shared by 2 ranks on this host)" in err, err  # (6 GiB - 256 MiB) / 2


def test_a_billion_parameters_in_a_6_gib_cgroup_is_refused_naming_limit_and_fix(monkeypatch):
    from zerotron.training.fit_check import check_fit, predicted_bytes
    from zerotron.training.setup_run import validate_model

    _container(monkeypatch, 6 * GIB, 0)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    cfg = _cfg(*BILLION)
    mcfg = validate_model(cfg)
    need = predicted_bytes(cfg, mcfg, 2, "cpu", "gloo")
    assert 3 * GIB < need < 100 * GIB  # more than each rank's half of 6 GiB, less than the host
    with pytest.raises(ConfigError) as err:
        check_fit(cfg, mcfg, 2)
    text = str(err.value)
    assert f"at least {need / GIB:.2f} GiB per rank" in text and "3.00 GiB is available" in text
    assert "the cgroup limit /sys/fs/cgroup/memory.max less its usage, shared by 2 ranks" in text
    assert "nearest fix: " in text
    check_fit(_cfg(*BILLION, "--training.skip_memory_check", "true"), mcfg, 2)  # the user knows
    monkeypatch.setattr(runtime, "_cgroup_file", lambda name: None)  # no container
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
