"""Experiment trackers behind ``MetricsLogger``: wandb (default, offline) and TensorBoard (optional).

wandb works with no account: the default mode is ``offline`` (files under ``<run-dir>/wandb``,
``wandb sync`` uploads them later); ``online`` without credentials falls back to offline with a
warning instead of prompting for a login on a cluster node. Everything wandb writes stays in the
run directory: besides the run files, wandb-core writes its debug logs to ``WANDB_CACHE_DIR``
(``~/.cache/wandb`` by default, shared by every run of every user's job on a node) and artifacts
to ``WANDB_DATA_DIR`` / ``WANDB_ARTIFACT_DIR``; those default here to ``<run-dir>/wandb/...``
unless the environment already sets them (wandb starts one service per process, so the first run
of a process places them). ``WANDB_CONFIG_DIR`` (login settings) is left alone.

TensorBoard (``logging.tensorboard: true``) writes the same scalars to ``<run-dir>/tensorboard``
through ``torch.utils.tensorboard.SummaryWriter``, for users who prefer it to wandb; it needs the
``tensorboard`` package, which ``RunConfig.validate`` checks before any process group.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

# wandb's locations outside its run directory, and where zerotron puts them (under <run-dir>/wandb)
WANDB_DIRS = {"WANDB_CACHE_DIR": "cache", "WANDB_DATA_DIR": "data", "WANDB_ARTIFACT_DIR": "artifacts"}


def wandb_has_credentials() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    netrc = Path(os.environ.get("NETRC", Path.home() / ".netrc"))
    return netrc.exists() and "api.wandb.ai" in netrc.read_text(errors="ignore")


def start_wandb(run_dir: Path, config: dict, mode: str, project: str):
    """A wandb run writing under ``run_dir``, or None when wandb is not installed."""
    if mode == "online" and not wandb_has_credentials():
        print("[zerotron] wandb: no account configured (WANDB_API_KEY / ~/.netrc); logging offline instead",
              file=sys.stderr)
        mode = "offline"
    try:
        import wandb
    except ImportError:
        print("[zerotron] wandb is not installed; metrics go to metrics.jsonl only", file=sys.stderr)
        return None
    os.environ.setdefault("WANDB_SILENT", "true")
    for var, sub in WANDB_DIRS.items():  # read when wandb starts its service, so set before init
        os.environ.setdefault(var, str((run_dir / "wandb" / sub).resolve()))
    return wandb.init(project=project, mode=mode, dir=str(run_dir), config=config, name=run_dir.name,
                      reinit="finish_previous")


class TensorBoard:
    """Scalars to ``<run-dir>/tensorboard`` (one event file per run; the step is the optimizer step)."""

    def __init__(self, run_dir: Path, purge_step: int | None = None):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:  # validate() checks first; this is the message if it was bypassed
            raise RuntimeError(f"logging.tensorboard=true needs the tensorboard package ({e}); "
                               f"pip install tensorboard, or set logging.tensorboard=false") from None
        # purge_step: a resumed run hides what an earlier attempt logged from that step on
        self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"), purge_step=purge_step)

    def log(self, scalars: dict[str, float], step: int) -> None:
        for name, value in scalars.items():
            if name != "step":
                self.writer.add_scalar(name, value, step)
        self.writer.flush()  # a preempted job keeps what it logged

    def close(self) -> None:
        self.writer.close()
