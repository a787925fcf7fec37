"""The run config's own sections: each field declared once, its type, default and help together.

The docstring under a field is its one line of ``--help`` and of the manual's configuration page;
a field that takes one of a fixed set of values has a ``Literal`` type, which the CLI, YAML and
DeepSpeed readers coerce to and check against (``zerotron.config.fields`` derives all of it; a
comment above a field says why it is so, for readers of this file only). The library's sections
(``ParallelDims``, ``ZeroConfig``, ``ActivationCheckpointConfig``) declare theirs the same way in
their own layers; the ``model`` section is generated from ``GPTConfig``'s declarations.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Literal

from zerotron.model.config import GPTConfig
from zerotron.model.presets import PRESETS
from zerotron.zero.config import Precision
from zerotron.zero.lr_schedule import Decay, LrScheduleFamily, WarmupType
from zerotron.config.fields import field_help

WandbMode = Literal["offline", "online", "disabled"]  # also scripts/run_ablations.py --wandb-mode
_PRESET_ONLY = ("name", "paper_mp")  # labels of a preset, not shape choices
_PRESET_HELP = "named shape to start from (tiny for CPU; the papers' shapes, listed at the end)"


def _model_overrides() -> type:
    """The ``model`` section: a preset name, and every ``GPTConfig`` field as an optional override
    (None: the preset's value; ``vocab_size`` None: the tokenizer's). Generated from GPTConfig, so
    a model field is settable from YAML and flags the moment it exists, with GPTConfig's type and
    help (carried in the field's metadata, as a generated class has no source to read)."""
    hints, helps = typing.get_type_hints(GPTConfig), field_help(GPTConfig)
    overrides = [(f.name, hints[f.name] | None,
                  field(default=None, metadata={"help": helps.get(f.name, "")}))
                 for f in dataclasses.fields(GPTConfig) if f.name not in _PRESET_ONLY]
    preset = field(default="tiny", metadata={"help": _PRESET_HELP})
    return dataclasses.make_dataclass("ModelOverrides", [("preset", Literal[tuple(PRESETS)], preset),
                                                         *overrides])


ModelOverrides = _model_overrides()


@dataclass
class DataSection:
    data_path: list[str] = field(default_factory=list)
    """token-file prefixes (.bin/.idx), comma-separated; empty: the built-in corpus"""
    data_weights: list[float] = field(default_factory=list)
    """sampling weight per data_path entry; empty: by size"""
    eval_path: list[str] = field(default_factory=list)
    """token-file prefixes for evaluation"""
    tokenizer: str | None = None
    """sentencepiece .model or Hugging Face tokenizer directory the token files were made with;
    without data.data_path: the built-in corpus is encoded with it"""
    cache_dir: str = ".cache/zerotron"
    """built-in corpus and sample-index cache"""
    default_corpus_vocab: int = 1024
    """vocabulary of the built-in corpus's tokenizer"""
    prefetch: int = 2
    """steps of micro-batches read ahead by a background thread; 0: none"""


@dataclass
class OptimizerSection:
    lr: float = 1e-3
    """peak learning rate"""
    min_lr: float = 1e-4
    """learning rate at the end of decay"""
    warmup_steps: int = 20
    """warm-up steps (onecycle: the rise from warmup_min_lr to lr)"""
    decay: Decay = "cosine"
    """learning-rate decay after warm-up"""
    weight_decay: float = 0.1
    """AdamW decoupled weight decay (not on biases and LayerNorms)"""
    beta1: float = 0.9
    """Adam beta1"""
    beta2: float = 0.95
    """Adam beta2"""
    eps: float = 1e-8
    """Adam epsilon"""
    clip_grad: float = 1.0
    """global gradient-norm clip; 0: off"""
    initial_loss_scale: float = 2.0**16
    """fp16: starting dynamic loss scale"""
    loss_scale_window: int = 1000
    """fp16: overflow-free steps before the scale doubles"""
    hysteresis: int = 2
    """fp16: overflows tolerated before the scale halves"""
    min_loss_scale: float = 1.0
    """fp16: lowest loss scale"""
    loss_scale: float = 0.0  # DeepSpeed's fp16.loss_scale
    """fp16: > 0 a static loss scale; 0 dynamic"""
    consecutive_hysteresis: bool = False
    """fp16: every clean step restores the hysteresis budget"""
    adam_w_mode: bool = True  # DeepSpeed's key
    """AdamW (decoupled decay); false: Adam with L2 decay in the gradient"""
    # the schedule family (zero/lr_schedule.py); deepspeed: DeepSpeed's lr_schedules, step for step
    schedule: LrScheduleFamily = "megatron"
    """learning-rate schedule family: megatron, deepspeed's lr_schedules, or its onecycle"""
    warmup_min_lr: float = 0.0
    """learning rate the warm-up starts from"""
    warmup_type: WarmupType = "linear"  # log is DeepSpeed's default
    """warm-up shape (deepspeed schedule only)"""
    schedule_steps: int | None = None
    """step where the decay ends; null: training.train_steps"""
    # schedule onecycle (DeepSpeed's OneCycle): lr is the cycle's top, warmup_min_lr its bottom
    cycle_down_steps: int | None = None
    """onecycle: steps of the fall from lr back to warmup_min_lr; null: warmup_steps"""
    decay_lr_rate: float = 0.0
    """onecycle: after the cycle, warmup_min_lr / (1 + rate x steps / decay_step_size)"""
    decay_step_size: int = 0
    """onecycle: steps per decay interval after the cycle; 0: no decay"""
    cycle_momentum: bool = False
    """onecycle: beta1 cycles inversely to the rate, from beta1 to cycle_min_beta1"""
    cycle_min_beta1: float = 0.8
    """onecycle: the cycle's lowest beta1 (beta1 is its highest)"""
    decay_beta1_rate: float = 0.0
    """onecycle: after the cycle, beta1 x (1 + rate x steps / decay_step_size)"""


@dataclass
class TrainingSection:
    train_steps: int = 300
    """optimizer steps (global batches) of the whole run (0: with checkpoint.init_from_hf, import
    and save)"""
    micro_batch_size: int = 8
    """samples per rank per forward/backward"""
    global_batch_size: int = 16
    """samples per optimizer step (micro_batch_size x dp x accumulation)"""
    # fp64 is the parity tests' precision: model, master weights, moments and every reduction in
    # float64, so two layouts differ by ~1e-16 round-off and nothing else
    precision: Precision = "fp32"
    """parameters' precision; 16-bit keeps fp32 masters; fp64 is the tests' reference"""
    seed: int = 1234
    """seed of init, dropout and data order"""
    compile: bool = False  # training/parallelize.compile_blocks
    """torch.compile each transformer block's forward (inductor); hooks stay eager"""
    skip_memory_check: bool = False
    """start although the memory model predicts that a rank cannot hold the run (the start-up fit
    check, training/fit_check.py)"""
    # parallel/runtime.use_deterministic_kernels; Megatron's --deterministic-mode
    deterministic: bool = False
    """deterministic kernels (torch.use_deterministic_algorithms, CUBLAS_WORKSPACE_CONFIG, no
    cuDNN attention): a GPU run then resumes bit for bit; slower. CPU kernels are deterministic
    already (the flag is set there too)"""


@dataclass
class LoggingSection:
    run_dir: str = "runs/tiny"
    """metrics.jsonl, config.yaml, wandb and tensorboard files"""
    log_interval: int = 10
    """steps per console/metrics line"""
    eval_interval: int = 100
    """steps between evaluations; 0: none"""
    eval_steps: int = 5
    """global batches per evaluation"""
    wandb_mode: WandbMode = "offline"
    """offline: files under run_dir (wandb sync uploads); online needs an account"""
    wandb_project: str = "zerotron"
    """wandb project name"""
    peak_tflops: float | None = None
    """per-device peak TFLOP/s for MFU; null: from the device table"""
    wall_clock_breakdown: bool = False
    """forward/backward/step seconds in each record (synchronizes the device)"""
    tensorboard: bool = False  # needs the tensorboard package
    """also write TensorBoard event files to run_dir/tensorboard"""
    profile_steps: list[int] = field(default_factory=list)
    """[A, B]: a torch.profiler trace of steps A to B in run_dir/profile"""
    straggler_factor: float = 1.2
    """at each log step, name a rank whose own compute time a step exceeds this x the median;
    0: off"""


@dataclass
class CheckpointSection:
    save: str | None = None
    """checkpoint directory ({run_dir} = logging.run_dir); null: none"""
    save_interval: int = 0
    """steps between checkpoints; 0: only at the end and on SIGTERM"""
    load: str | None = "auto"
    """auto: this run's newest in save; a directory; none: from scratch"""
    keep_last: int = 2  # another run's checkpoints are never pruned
    """this run's checkpoints kept"""
    fallback: bool = False
    """newest checkpoint corrupt: load the newest intact earlier one"""
    override_schedule: bool = False
    """resume although lr schedule, global batch or seed differ"""
    consolidated_16bit: bool = False  # DeepSpeed's gather_16bit_weights_on_model_save
    """each checkpoint also holds consolidated.safetensors (working dtype)"""
    async_save: bool = False  # Megatron's --async-save
    """copy the shard to host memory, write it on a thread as training goes on"""
    init_from_hf: str | None = None
    """a transformers Llama/Mistral/Qwen2/GPT-2 directory: its architecture and weights start the
    run (optimizer fresh; a resumable checkpoint wins); docs/huggingface.md"""
