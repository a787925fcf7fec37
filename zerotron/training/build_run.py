"""Every set-up step of a run, in the order it runs, after the process group and before the loop.

``build_run(cfg, env)`` is the one place a run is put together: the grid; the run's one
``Checkpointer`` (``checkpoint/checkpointer.py``), which takes the run and checkpoint directories'
locks and plans which checkpoint the run continues, so a refused or finished run stops in
seconds, before any data or model is built; the token files and tokenizer; the model through
``parallelize_gpt`` (stage, TP, recompute, ZeRO's optimizer); the datasets and their loaders;
and the load of the checkpoint (through the Checkpointer) or of a Hugging Face model. It returns
a ``Run``, what the loop needs; ``Trainer`` only loops over it and saves through the Run's
Checkpointer.

Nothing here reads the command line or checks the config: ``setup_run.before_any_group`` did
that on every rank before ``init_process_group``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from zerotron.checkpoint import hf_import
from zerotron.checkpoint.checkpointer import Checkpointer
from zerotron.config.run_config import RunConfig
from zerotron.data import GPTDataset, prepare_dataset_index
from zerotron.parallel import Grid
from zerotron.parallel import collectives as C
from zerotron.parallel import rng as rng_streams
from zerotron.parallel.runtime import DistEnv, use_deterministic_kernels
from zerotron.training.batches import BatchLoader
from zerotron.training.parallelize import parallelize_gpt
from zerotron.training.setup_run import DataBundle, build_grid, model_config, prepare_data
from zerotron.training.step_memory import StepMemory


@dataclass
class Run:
    """What the loop needs, built: the config and process grid, the Checkpointer (locks held,
    resume planned, model and optimizer tracked), data, model and optimizer, loaders, and where
    the run starts (``step``, ``consumed`` samples). ``hf_label``: the Hugging Face class for
    ``metadata.json``."""

    cfg: RunConfig
    env: DistEnv
    grid: Grid
    checkpointer: Checkpointer | None = None
    data: DataBundle | None = None
    mcfg: object = None  # the GPTConfig: preset, overrides, the tokenizer's vocabulary
    memory: StepMemory | None = None  # measured the construction; measures a step per log interval
    model: object = None
    opt: object = None
    activations: object = None  # ZeRO-R's handle, None without activation checkpointing
    train_ds: GPTDataset | None = None
    eval_ds: GPTDataset | None = None
    batches: BatchLoader | None = None
    eval_batches: BatchLoader | None = None
    step: int = 0
    consumed: int = 0
    hf_label: dict = field(default_factory=dict)

    def log(self, text: str) -> None:
        if self.grid.rank == 0:
            print(text, flush=True)

    def model_config_dict(self) -> dict:  # with the family (gpt2 | llama), for metadata.json
        mcfg = self.mcfg
        return {**dataclasses.asdict(mcfg), "architecture": mcfg.architecture, **self.hf_label}

    def release_lock(self) -> None:
        """Give the run and checkpoint directories back (rank 0; safe after a failed collective)."""
        if self.checkpointer is not None:
            self.checkpointer.release()

    def close_loaders(self) -> None:
        for loader in (self.batches, self.eval_batches):
            if loader is not None:
                loader.close()


def build_run(cfg: RunConfig, env: DistEnv) -> Run:
    """Set the run up, step by step (the module docstring). Collective: every rank calls it.
    On any failure the locks are given back and the grid closed before the error goes on."""
    if cfg.training.deterministic:  # here, whoever started the process group
        use_deterministic_kernels()  # before the model's first CUDA op
    run = Run(cfg, env, build_grid(cfg))
    if env.device.type == "cuda" and not cfg.training.deterministic:
        run.log("[zerotron] training.deterministic is false: on a GPU a resumed run may differ from"
                " the uninterrupted one in the last bits (docs/checkpoints.md)")
    try:  # the directories ours and the checkpoint to continue known, before data or model
        run.checkpointer = Checkpointer.for_run(cfg, run.grid, env.device, run.log)
        build_data(run)
        build_model(run)
        build_loaders(run)
        load(run)
    except BaseException:
        run.release_lock()
        run.grid.close()
        raise
    return run


# the data and the model -----------------------------------------------------------------------
def build_data(run: Run) -> None:
    """Token files and tokenizer (the built-in corpus built by rank 0), checked against the
    resumed checkpoint's tokenizer; then the model's configuration, vocabulary included."""
    run.data = prepare_data(run.cfg, run.grid, run.env.device)
    run.checkpointer.use_tokenizer(run.data.tokenizer_path, run.cfg)  # kept in each checkpoint
    run.mcfg = model_config(run.cfg, run.data.vocab_size, run.data.tokenizer_path)


def build_model(run: Run) -> None:
    """The parallel plan (``parallelize_gpt``: stage, TP, recompute, ZeRO), its memory measured."""
    run.memory = StepMemory(run.cfg.logging.log_interval, run.env.device.type)
    with run.memory.construction():
        plan = parallelize_gpt(run.cfg, run.mcfg, run.grid, device=run.env.device)
    run.model, run.opt, run.activations = plan.model, plan.optimizer, plan.activations
    run.memory.register(run.opt)


def build_loaders(run: Run) -> None:
    """The train and eval datasets (sample indices built once by rank 0 and cached) and their
    read-ahead loaders."""
    cfg, t, grid, resumed = run.cfg, run.cfg.training, run.grid, run.checkpointer.plan
    # from the checkpoint's count on: train_steps x G falls short after a resume that shrank G
    num_samples = resumed.consumed + max(1, t.train_steps - resumed.step) * t.global_batch_size
    run.train_ds = _dataset(run, run.data.train_prefixes, run.data.train_weights, num_samples)
    if run.data.eval_prefixes and cfg.logging.eval_interval > 0:
        n_eval = cfg.logging.eval_steps * t.global_batch_size
        run.eval_ds = _dataset(run, run.data.eval_prefixes, None, n_eval)
    run.batches, run.eval_batches = (
        BatchLoader(ds, t.micro_batch_size, t.global_batch_size, cfg.num_microbatches,
                    grid.dp_rank, grid.dp_size, run.env.device, depth=cfg.data.prefetch,
                    vocab_size=run.data.vocab_size)
        if ds is not None else None for ds in (run.train_ds, run.eval_ds))


def load(run: Run) -> None:
    """``checkpoint.init_from_hf``'s weights on a fresh run; the Checkpointer then tracks the
    model and optimizer (what its saves hold, what its load fills) and loads the checkpoint the
    run continues: its weights and optimizer state, step, data position and random streams."""
    run.hf_label = hf_import.start_run(run)
    run.checkpointer.track(run.model, run.opt, run.model_config_dict())
    state = run.checkpointer.load()
    if state is None:
        return
    run.step, run.consumed = state["step"], state["consumed_samples"]
    rng_streams.resume_streams(run.model.rng, state["rng"], run.cfg.training.seed + run.step,
                               run.grid, run.env.device)  # None: another layout; reseeded


def _dataset(run: Run, prefixes: list[str], weights, num_samples: int) -> GPTDataset:
    """Rank 0 builds the sample index (cached); the others wait for it, then read it."""
    args = dict(seq_length=run.mcfg.seq_length, seed=run.cfg.training.seed,
                cache_dir=run.cfg.data.cache_dir)
    if run.grid.rank == 0:
        prepare_dataset_index(prefixes, weights, num_samples=num_samples, **args)
    C.barrier(run.grid.world_group)
    return GPTDataset(prefixes, weights, num_samples=num_samples, **args)
