"""``docs/architecture.md``'s walk of one run from ``main`` to the first step, held to the code.

The walk names modules (``config/cli.py``, ``training/build_run.py`` ...) in the order a run
enters them. The reference is the run itself, not a list of ours: one gloo rank runs
``scripts/pretrain_gpt.py: main`` on ``configs/tiny.yaml`` under a ``sys.setprofile`` hook that
records the first function each source file runs (not counting an import's own module code),
and stops the run at the first
``Trainer.train_step``. Every module the walk names must exist, be entered on the way, and be
named in the order it is first entered.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from tests.harness import spawn

ROOT = Path(__file__).resolve().parents[2]
SECTION = "## One run, from `main` to the first step"
MODULE = re.compile(r"`((?:scripts|config|training|checkpoint|parallel|data|model|zero|activation|"
                    r"estimate)/[\w/]+\.py)")
CONDITIONAL = {  # named in the walk, entered only when a setting asks for it (not in tiny.yaml)
    "checkpoint/hf_import.py": "checkpoint.init_from_hf (check_directory before any group)",
    "training/phase_times.py": "logging.wall_clock_breakdown",
    "checkpoint/distributed.py": "a resume: Checkpointer.load of the planned checkpoint",
}


class FirstStep(BaseException):
    """Raised by the hook at the first ``Trainer.train_step``: the walk ends there."""


def walk_modules() -> list[str]:
    """The modules the walk names, each at its first mention, as repository paths."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    body = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    names = []
    for name in MODULE.findall(body):
        path = name if name.startswith("scripts/") else f"zerotron/{name}"
        if path not in names:
            names.append(path)
    return names


def _first_entries(cache: str, run_dir: str) -> list[str]:
    import importlib.util

    script_path = ROOT / "scripts" / "pretrain_gpt.py"
    spec = importlib.util.spec_from_file_location("pretrain_gpt", script_path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    root, order, here = str(ROOT) + "/", [], sys._getframe().f_code

    def hook(frame, event, arg):
        code = frame.f_code
        if event != "call" or not code.co_flags & 1:  # CO_OPTIMIZED: a function, not an import
            return
        if code.co_qualname == "Trainer.train_step":
            sys.setprofile(None)
            raise FirstStep
        path = code.co_filename.removeprefix(root)
        if not code.co_filename.startswith(root) or path in order:
            return
        caller = frame.f_back
        while caller is not None and caller.f_code is not here:  # called while importing: not yet
            if caller.f_code.co_name == "<module>":
                return
            caller = caller.f_back
        order.append(path)

    argv = ["--config", str(ROOT / "configs" / "tiny.yaml"), "--tp", "1", "--seq-length", "16",
            "--micro-batch-size", "2", "--global-batch-size", "2", "--train-steps", "1",
            "--run-dir", run_dir, "--save", f"{run_dir}/checkpoints", "--data.cache_dir", cache]
    sys.setprofile(hook)
    try:
        script.main(argv)
    except FirstStep:
        pass
    finally:
        sys.setprofile(None)
    return order


def test_walk_names_modules_in_the_order_a_run_enters_them(zerotron_cache, tmp_path):
    named = walk_modules()
    assert len(named) > 30, f"the walk names only {named}"
    missing = [p for p in named if not (ROOT / p).is_file()]
    assert not missing, f"docs/architecture.md's walk names modules that do not exist: {missing}"
    entered = spawn(_first_entries, 1, zerotron_cache, str(tmp_path / "run"))[0]
    assert "zerotron/training/trainer.py" in entered, "the run never reached the Trainer"
    always = [p for p in named if p.removeprefix("zerotron/") not in CONDITIONAL]
    skipped = [p for p in always if p not in entered]
    assert not skipped, f"the walk names modules a run does not enter before step 1: {skipped}"
    walked = [p for p in always if p in entered]
    ran = sorted(walked, key=entered.index)
    assert walked == ran, ("the walk names modules out of the order the run enters them:\n"
                           + "\n".join(f"  named {a:45} entered {b}"
                                       for a, b in zip(walked, ran) if a != b))
