"""The environment variables a run reads, and the paths it is given, checked before any process
group: a bad value is a ``ConfigError`` (exit 2 on every rank) naming the variable and the fix,
where it used to be a traceback (exit 1) from deep inside start-up that named nothing.
"""

from __future__ import annotations

import math
import os

from zerotron.training.config import ConfigError

# variable: what it holds, for the message
NUMBERS = {"ZEROTRON_COLLECTIVE_TIMEOUT": "seconds a collective may wait before the rank fails",
           "ZEROTRON_PEAK_TFLOPS": "the device's peak TFLOP/s, for MFU"}
PATH_FIELDS = (("checkpoint", "save"), ("checkpoint", "load"), ("logging", "run_dir"),
               ("data", "cache_dir"), ("data", "tokenizer"))


def check_environment() -> None:
    """``ZEROTRON_COLLECTIVE_TIMEOUT`` / ``ZEROTRON_PEAK_TFLOPS`` positive numbers,
    ``ZEROTRON_DEVICE`` / ``ZEROTRON_BACKEND`` known names (``parallel.runtime`` decides)."""
    from zerotron.parallel.runtime import pick_backend, pick_device

    for name, holds in NUMBERS.items():
        raw = os.environ.get(name, "").strip()
        if not raw:
            continue
        try:
            value = float(raw)
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and value > 0):
            raise ConfigError(f"{name}={raw!r} must be a positive number ({holds}); fix or "
                              f"unset it")
    try:
        pick_backend(pick_device(int(os.environ.get("LOCAL_RANK", 0) or 0)))
    except (ValueError, RuntimeError) as e:
        raise ConfigError(f"{e} (an environment variable)") from None


def check_paths(cfg) -> None:
    """A path that starts with ``~`` was quoted past the shell, which expands it; zerotron does
    not, so ``--save '~/x'`` made a literal ``./~/x``. Refused naming the field."""
    paths = [(f"{s}.{f}", getattr(getattr(cfg, s), f)) for s, f in PATH_FIELDS]
    paths += [(f"data.data_path[{i}]", p) for i, p in enumerate(cfg.data.data_path)]
    paths += [(f"data.eval_path[{i}]", p) for i, p in enumerate(cfg.data.eval_path)]
    for field, value in paths:
        if isinstance(value, str) and value.startswith("~"):
            raise ConfigError(f"{field}={value}: '~' is not expanded here (a quoted path reaches "
                              f"zerotron as written); write {os.path.expanduser(value)} or leave "
                              f"the path unquoted for the shell to expand")
