"""How the suite runs, and the fixtures every directory shares.

The suite runs on pytest-xdist workers (``-n auto --dist loadfile`` in pyproject.toml), one per
usable CPU, each worker pinned to its own CPU with the gloo ranks it forks. The ranks of one job
hand every collective to each other, and on a virtual machine waking a peer on another vCPU
costs about a millisecond (a 1-float all_reduce between 2 ranks: 0.8-2.6 ms across vCPUs, 0.3-0.4
ms on one), so most multi-rank tests are faster on one core than spread over two -- and the
other cores run other files meanwhile (the suite here: 460 s serial, 330-350 s on 2 workers).
Files, not tests, are the unit of distribution: module fixtures and ``Overlap``'s prefetch stay
inside a worker. They are handed out heaviest first (``HEAVY_FIRST``, with xdist's own reorder by
test count turned off in pyproject.toml), so no long file starts last. ``-n 0`` runs everything in one process, unpinned.

``zerotron_cache``: the trainer and reliability tests' data cache (the built-in corpus and its
sample indices), outside the checkout. Built once per worker (about 5 s) under pytest's base temp
directory; built in a forked process, because the pytest process must not start torch's OpenMP
threads before the tests fork their ranks. Each test still gets its own run and checkpoint
directories (``tmp_path``). ``overlap`` (``tests.harness.Overlap``): fault drills that overlap
their idle waits.

Hypothesis runs derandomized (the ``zerotron`` profile): each property test draws the same
examples on every run, so a run's verdict does not depend on the draw, and no example database
is written; its other files (a cache of the constants it reads from our sources) go under
pytest's base temp directory, not into the checkout's ``.hypothesis/``. ``--hypothesis-profile
fuzz`` draws afresh each run, to search.
"""

from __future__ import annotations

import os
import tempfile

import pytest
from hypothesis import settings
from hypothesis.configuration import set_hypothesis_home_dir

from tests.harness import Overlap, spawn

settings.register_profile("zerotron", derandomize=True, database=None)
settings.register_profile("fuzz", database=None)
settings.load_profile("zerotron")  # before the test modules' @settings read it as their default


def _build(cache: str) -> None:
    from zerotron.data import build_default_corpus
    from zerotron.config.run_config import DataSection

    build_default_corpus(cache, vocab_size=DataSection.default_corpus_vocab)


@pytest.fixture(scope="session", autouse=True)
def system_temp_dir(tmp_path_factory):
    """The system temp dir of the tests, of the ranks they fork and of the programs they start
    (torchrun's ``torchelastic_*`` logs, wandb's folders, the launcher's rendezvous files) is a
    folder under pytest's base temp dir: a rank killed or ended by ``os._exit`` leaves its debris
    there, which pytest removes a few runs later, not in the machine's ``/tmp``."""
    path = tmp_path_factory.getbasetemp() / "tmp"
    path.mkdir(exist_ok=True)
    before = os.environ.get("TMPDIR"), tempfile.tempdir
    os.environ["TMPDIR"] = tempfile.tempdir = str(path)
    yield
    if before[0] is None:
        os.environ.pop("TMPDIR", None)
    else:
        os.environ["TMPDIR"] = before[0]
    tempfile.tempdir = before[1]


@pytest.fixture(scope="session", autouse=True)
def hypothesis_home(tmp_path_factory) -> None:
    """Hypothesis' own files in this run's temp directory, not in the checkout."""
    set_hypothesis_home_dir(str(tmp_path_factory.getbasetemp() / "hypothesis"))


@pytest.fixture(scope="session")
def zerotron_cache(tmp_path_factory) -> str:
    path = tmp_path_factory.getbasetemp() / "zerotron-cache"
    path.mkdir(exist_ok=True)
    spawn(_build, 1, str(path), timeout=300)  # returns at once when the corpus is already there
    return str(path)


@pytest.fixture(scope="module")
def overlap():
    o = Overlap()
    try:
        yield o
    finally:
        o.close()


def _usable_cpus() -> int:
    """CPUs this process may run on: its affinity mask, capped by a cgroup v2 CPU quota
    (``docker --cpus``, Kubernetes limits), which the mask does not show."""
    n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    try:
        quota, period = open("/sys/fs/cgroup/cpu.max").read().split()
        if quota != "max":
            n = min(n, max(1, int(quota) // int(period)))
    except (OSError, ValueError):
        pass
    return n


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config) -> int | None:
    """``-n auto``: one worker per usable CPU (not per CPU of the host), at most 8 (each runs jobs
    of up to 16 ranks). With ``PYTEST_XDIST_AUTO_NUM_WORKERS`` set, xdist's own hook reads it."""
    if "PYTEST_XDIST_AUTO_NUM_WORKERS" in os.environ:
        return None
    return min(8, _usable_cpus())


def pytest_configure(config) -> None:
    """Pin an xdist worker, and so every rank it forks, to one of the CPUs it was given."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if worker.startswith("gw") and hasattr(os, "sched_setaffinity"):
        cpus = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cpus[int(worker[2:]) % len(cpus)]})


# The most expensive files, heaviest first (``--durations`` on a 2-core machine): xdist's loadfile
# scheduler hands files out in collection order, so these start first and the suite does not end
# on one long file while the other workers idle. A stale entry only costs time, never a result.
HEAVY_FIRST = (
    "tests/estimate/test_memory_grid.py", "tests/training/test_trainer.py", "tests/training/test_compile.py",
    "tests/zero/test_zeropp.py", "tests/parallel/test_pipeline_interleaved.py", "tests/test_ablations.py",
    "tests/reliability/test_run_ownership.py", "tests/training/test_dry_run.py",
    "tests/training/test_deepspeed_configs.py", "tests/reliability/test_faults.py", "tests/training/test_slurm.py",
    "tests/zero/test_grad_accumulation.py", "tests/parallel/test_pipeline.py",
)


def pytest_collection_modifyitems(config, items) -> None:
    """Heaviest files first (``HEAVY_FIRST``); a stable sort, so each file's tests stay together
    and in their order (module fixtures and ``Overlap`` rely on that)."""
    rank = {name: i for i, name in enumerate(HEAVY_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(HEAVY_FIRST)))
