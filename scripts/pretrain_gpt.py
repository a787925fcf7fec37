"""Pretrain a GPT with zerotron: TP x PP x ZeRO-DP, on CPU (gloo) or GPUs (NCCL).

    torchrun --standalone --nproc_per_node 4 scripts/pretrain_gpt.py --config configs/tiny.yaml
    torchrun ... scripts/pretrain_gpt.py --config configs/tiny.yaml --tp 1 --zero-stage 3 --train-steps 50

Every field of the config can be overridden with --<section>.<field> VALUE; see --help.

Exit codes: ``EXIT_CODES`` below (also the end of --help).

Checkpoints: ``checkpoint.load=auto`` (the default) resumes this run's newest checkpoint in
``checkpoint.save`` when there is one, so ``torchrun --max-restarts N`` continues a crashed job.
"""

from __future__ import annotations

import os
import signal
import sys

from zerotron.checkpoint.files import CheckpointError
from zerotron.config.cli import parse_config
from zerotron.config.run_config import ConfigError

EXIT_CODES = """exit codes:
  0  done; also a run stopped by SIGTERM after writing its checkpoint (or saying it had none to
     write), and a run whose checkpoint to resume is already at training.train_steps
  2  bad input (config, data, checkpoint), a checkpoint directory another run holds, or a run that
     cannot go on (NaN loss, overflow storm): the message names the field/file/step and the fix
  3  a collective failed (a peer rank died or is stuck; the message names it); torchrun then
     stops the remaining ranks"""


def main(argv: list[str] | None = None) -> int:
    rank = int(os.environ.get("RANK", 0))
    try:
        cfg = parse_config(argv, EXIT_CODES)
        from zerotron.training.setup_run import before_any_group

        before_any_group(cfg)  # on every rank, before any process group: exit 2 naming the field
    except ConfigError as e:
        print(f"[rank {rank}] config error: {e}", file=sys.stderr, flush=True)
        return 2
    from zerotron.parallel import init_distributed, shutdown
    from zerotron.parallel.health import CollectiveError
    from zerotron.parallel.runtime import keep_compiler_cache_in

    keep_compiler_cache_in(cfg.data.cache_dir)  # before torch._dynamo is imported (not in the system temp dir)
    from zerotron.checkpoint.resume import AlreadyComplete
    from zerotron.training.build_run import build_run
    from zerotron.training.trainer import Trainer, TrainingStopped

    env = init_distributed()
    run = trainer = None

    def close() -> None:  # the checkpoint directory's lock, the heartbeat thread, then the process group
        if run is not None:
            run.release_lock()
            run.grid.close()
        shutdown()

    try:
        run = build_run(cfg, env)  # grid, locks, resume plan, data, model, optimizer, loaders, load
        trainer = Trainer(run)
        result = trainer.train()
    except AlreadyComplete as e:
        if env.rank == 0:
            print(f"[zerotron] {e}", flush=True)
        close()
        return 0
    except (ConfigError, CheckpointError, TrainingStopped) as e:
        print(f"[rank {env.rank}] {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        close()
        return 2
    except CollectiveError as e:  # a peer died or is stuck: say which, exit at once (no group teardown,
        print(f"[rank {env.rank}] {type(e).__name__}: {e}", file=sys.stderr, flush=True)  # it could block)
        if run is not None:
            run.release_lock()
        return COLLECTIVE_FAILED
    except BaseException:  # anything unforeseen still gives the checkpoint directory back
        if run is not None:
            run.release_lock()
        raise
    else:
        close()
    if env.rank == 0 and result:
        what = "stopped" if trainer.stopped else "done"
        print(f"[zerotron] {what}: step {trainer.step} of {cfg.training.train_steps}, "
              f"loss {result.get('loss', float('nan')):.4f}", flush=True)
    return 0


COLLECTIVE_FAILED = 3

if __name__ == "__main__":
    # a launcher may hand SIGTERM down ignored (scripts/slurm/pretrain_gpt.sbatch keeps torchrun out
    # of it); until the trainer installs its checkpoint-and-exit handler, SIGTERM ends the process
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    code = main()
    if code == COLLECTIVE_FAILED:  # skip interpreter teardown: destroying a broken group can hang
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
