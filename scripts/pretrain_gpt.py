"""Pretrain a GPT with zerotron: TP x PP x ZeRO-DP, on CPU (gloo) or GPUs (NCCL).

    torchrun --standalone --nproc_per_node 4 scripts/pretrain_gpt.py --config configs/tiny.yaml
    torchrun ... scripts/pretrain_gpt.py --config configs/tiny.yaml --tp 1 --zero-stage 3 --train-steps 50

Every field of the config can be overridden with --<section>.<field> VALUE; see --help.
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
    except ConfigError as e:
        print(f"[rank {rank}] config error: {e}", file=sys.stderr, flush=True)
        return 2
    from zerotron.parallel import init_distributed, shutdown
    from zerotron.training.trainer import Trainer, TrainingStopped

    env = init_distributed()
    try:
        trainer = Trainer(cfg, env)
        if env.rank == 0:
            run_dir = Path(cfg.logging.run_dir)
            run_dir.mkdir(parents=True, exist_ok=True)
            (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
        result = trainer.train()
    except (ConfigError, CheckpointError, TrainingStopped) as e:
        print(f"[rank {env.rank}] {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        return 2
    finally:
        shutdown()
    if env.rank == 0 and result:
        print(f"[zerotron] done: step {trainer.step}, loss {result.get('loss', float('nan')):.4f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
