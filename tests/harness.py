"""The test suite's launcher is the package's own (``zerotron.testing.launch``), shared with the
benchmarks and the ablation runner; ``Overlap`` lets idle fault drills wait out their timeouts two
at a time."""

from __future__ import annotations

from typing import Callable

import pytest

from zerotron.testing.launch import DEFAULT_TIMEOUT_S, RankFailure, Ranks, spawn  # noqa: F401


class Overlap:
    """Start the next selected case of a parametrized drill together with this one.

    A fault drill spends its seconds idle, its survivors blocked in a collective until the timeout
    fires. ``ranks(request, start)`` returns this case's ``Ranks`` -- already running if the
    previous case started them -- and starts the next selected case of the same test function
    with ``start(params)``, which must build the job from the case's parameters alone (it is
    called from another case's test). Two jobs at a time, not all: under xdist both share the
    worker's one CPU, and a drill's start-up must stay well inside its own collective timeout.
    Each case still asserts on its own ranks only; ``close`` kills a job whose case never came to
    take it (skipped, errored before ``ranks``, or a run stopped early)."""

    def __init__(self) -> None:
        self._started: dict[str, Ranks] = {}

    def ranks(self, request: pytest.FixtureRequest, start: Callable[[dict], Ranks]) -> Ranks:
        node = request.node
        if getattr(request.config.option, "dist", "no") not in ("no", "loadfile", "loadscope"):
            return start(node.callspec.params)  # the next case may run on another worker: no prefetch
        cases = [i for i in request.session.items if i.parent is node.parent and hasattr(i, "callspec")
                 and getattr(i, "originalname", None) == node.originalname]
        if node not in cases:
            raise TypeError(f"{node.nodeid}: Overlap is for the cases of a parametrized test")
        at = cases.index(node)
        for case in cases[at:at + 2]:
            if case.nodeid not in self._started:
                self._started[case.nodeid] = start(case.callspec.params)
        return self._started.pop(node.nodeid)

    def close(self) -> None:
        for ranks in self._started.values():
            ranks.close()
        self._started.clear()

