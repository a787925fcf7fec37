"""What the tests, the benchmarks and the ablation runner share: one process launcher
(``launch.spawn``: N gloo ranks that never hang) and the small ZeRO training runs
(``zero_runs``) whose figures the ZeRO++ / Infinity tests assert and the benchmarks print, and the
benchmarks' flag checks (``bench_args``), run before any rank starts."""
