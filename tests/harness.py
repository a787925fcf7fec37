"""The test suite's launcher is the package's own (``zerotron.testing.launch``), shared with the
benchmarks and the ablation runner."""

from zerotron.testing.launch import DEFAULT_TIMEOUT_S, RankFailure, spawn  # noqa: F401
