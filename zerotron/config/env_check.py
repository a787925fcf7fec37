"""The environment variables a run reads, and the paths it is given, checked before any process
group: a bad value is a ``ConfigError`` (exit 2 on every rank) naming the variable and the fix,
where it used to be a traceback (exit 1) from deep inside start-up that named nothing.
"""

from __future__ import annotations

import os

from zerotron.config.run_config import ConfigError

PATH_FIELDS = (("checkpoint", "save"), ("checkpoint", "load"), ("logging", "run_dir"),
               ("data", "cache_dir"), ("data", "tokenizer"))


def check_environment() -> None:
    """``ZEROTRON_COLLECTIVE_TIMEOUT`` / ``ZEROTRON_PEAK_TFLOPS`` positive numbers,
    ``ZEROTRON_DEVICE`` / ``ZEROTRON_BACKEND`` known names: each read by the one function that
    uses it (``parallel.runtime``, ``model.flops``), whose error names the variable."""
    from zerotron.model.flops import peak_tflops
    from zerotron.parallel.runtime import collective_timeout, pick_backend, pick_device

    try:
        collective_timeout()
        peak_tflops("")  # no device name: only the variable is read
    except ValueError as e:
        raise ConfigError(str(e)) from None
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
