"""Pretrain a GPT with zerotron: TP x PP x ZeRO-DP, on CPU (gloo) or GPUs (NCCL).

    torchrun --standalone --nproc_per_node 4 scripts/pretrain_gpt.py --config configs/tiny.yaml
    torchrun ... scripts/pretrain_gpt.py --config configs/tiny.yaml --tp 1 --zero-stage 3 --train-steps 50

Every field of the config can be overridden with --<section>.<field> VALUE; see --help.

Exit codes: 0 done; 2 bad input (config, data, checkpoint) or a run that cannot go on (NaN loss,
overflow storm) -- the message names the field/file/step and the fix; 3 a collective failed (a
peer rank died or is stuck; the message names it) -- torchrun then stops the remaining ranks.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import yaml

from zerotron.training.checkpoint_io import CheckpointError
from zerotron.training.cli import parse_config
from zerotron.training.config import ConfigError


def main(argv: list[str] | None = None) -> int:
    rank = int(os.environ.get("RANK", 0))
    try:
        cfg = parse_config(argv)
        cfg.validate(int(os.environ.get("WORLD_SIZE", 1)))  # on every rank, before any process group
        from zerotron.training.setup_run import preflight

        preflight(cfg)  # model shape, pipeline split, ZeRO settings, the user's token files: still no group
    except ConfigError as e:
        print(f"[rank {rank}] config error: {e}", file=sys.stderr, flush=True)
        return 2
    from zerotron.parallel import init_distributed, shutdown
    from zerotron.parallel.health import CollectiveError
    from zerotron.training.trainer import Trainer, TrainingStopped

    env = init_distributed()
    trainer = None

    def close() -> None:  # heartbeat thread first, then the process group
        if trainer is not None:
            trainer.grid.close()
        shutdown()

    try:
        trainer = Trainer(cfg, env)
        if env.rank == 0:
            run_dir = Path(cfg.logging.run_dir)
            run_dir.mkdir(parents=True, exist_ok=True)
            (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
        result = trainer.train()
    except (ConfigError, CheckpointError, TrainingStopped) as e:
        print(f"[rank {env.rank}] {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        close()
        return 2
    except CollectiveError as e:  # a peer died or is stuck: say which, exit at once (no group teardown,
        print(f"[rank {env.rank}] {type(e).__name__}: {e}", file=sys.stderr, flush=True)  # it could block)
        return COLLECTIVE_FAILED
    else:
        close()
    if env.rank == 0 and result:
        print(f"[zerotron] done: step {trainer.step}, loss {result.get('loss', float('nan')):.4f}", flush=True)
    return 0


COLLECTIVE_FAILED = 3

if __name__ == "__main__":
    code = main()
    if code == COLLECTIVE_FAILED:  # skip interpreter teardown: destroying a broken group can hang
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
