"""The run configuration: one dataclass per concern, validated once, errors that name the field.

A run is one YAML file of these sections (see ``configs/tiny.yaml``) plus command-line
overrides (``zerotron.training.cli``). ``validate(world_size)`` runs on every rank before
``init_process_group``-dependent work, so a bad config stops every rank with the same message
instead of leaving some of them waiting in a collective.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from zerotron.zero.config import PRECISIONS


class ConfigError(ValueError):
    """A config value is invalid; the message names ``section.field``, the value and the fix."""


@dataclass
class ModelSection:
    preset: str = "tiny"
    num_layers: int | None = None  # None: take the preset's value
    hidden_size: int | None = None
    num_heads: int | None = None
    vocab_size: int | None = None  # None: the tokenizer's vocabulary
    seq_length: int | None = None
    dropout: float = 0.0
    attention_dropout: float = 0.0
    make_vocab_size_divisible_by: int = 128


@dataclass
class ParallelSection:
    tp: int = 1
    pp: int = 1
    dp: int | None = None  # None: world_size / (tp * pp)
    pipeline_schedule: str = "1f1b"  # or "afab" (all-forward-all-backward)


@dataclass
class ZeroSection:
    """DeepSpeed's ``zero_optimization`` keys (ZeRO §5): stage 0 = DDP, 1 = Pos, 2 = Pos+g, 3 = Pos+g+p."""

    stage: int = 0
    overlap_comm: bool = False
    contiguous_gradients: bool = True
    reduce_bucket_size: int = 500_000_000
    allgather_bucket_size: int = 500_000_000
    stage3_prefetch_bucket_size: int = 50_000_000
    stage3_param_persistence_threshold: int = 100_000
    offload_optimizer: bool = False  # = offload_optimizer_device "cpu"
    # ZeRO++ (arXiv 2306.10209): qwZ, qgZ, hpZ; block = elements per fp32 scale of the int8 quantization
    zero_quantized_weights: bool = False
    zero_quantized_gradients: bool = False
    zero_hpz_partition_size: int = 1
    zero_quantization_block_size: int = 256
    zero_quantized_gradients_node_size: int = 0  # 0: zero_hpz_partition_size
    # ZeRO-Infinity (arXiv 2104.07857): DeepSpeed's offload_optimizer {device, nvme_path, buffer_count}
    offload_optimizer_device: str = "none"  # none | cpu | nvme
    nvme_path: str | None = None
    buffer_count: int = 4
    sub_group_size: int = 1_000_000_000
    # ZeRO-Infinity parameter offload: DeepSpeed's offload_param {device, nvme_path, buffer_count} (stage 3)
    offload_param_device: str = "none"  # none | nvme
    offload_param_nvme_path: str | None = None
    offload_param_buffer_count: int = 5


@dataclass
class ActivationCheckpointSection:
    """DeepSpeed's ``activation_checkpointing`` keys (ZeRO-R §6: Pa, Pa+cpu, MD)."""

    checkpoint_activations: bool = False
    checkpoint_every: int = 1  # a checkpoint every k transformer layers
    partition_activations: bool = False  # Pa
    cpu_checkpointing: bool = False  # Pa+cpu (or CPU offload alone without partitioning)
    contiguous_memory_optimization: bool = False  # MD
    number_checkpoints: int | None = None


@dataclass
class DataSection:
    data_path: list[str] = field(default_factory=list)  # token-file prefixes; empty = built-in corpus
    data_weights: list[float] = field(default_factory=list)
    eval_path: list[str] = field(default_factory=list)
    tokenizer: str | None = None  # sentencepiece model; None with the built-in corpus
    cache_dir: str = ".cache/zerotron"
    default_corpus_vocab: int = 1024


@dataclass
class OptimizerSection:
    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup_steps: int = 20
    decay: str = "cosine"  # cosine | linear | constant
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    clip_grad: float = 1.0
    initial_loss_scale: float = 2.0**16
    loss_scale_window: int = 1000
    hysteresis: int = 2
    min_loss_scale: float = 1.0


@dataclass
class TrainingSection:
    train_steps: int = 300
    micro_batch_size: int = 8
    global_batch_size: int = 16
    # fp32 | fp16 | bf16 | fp64; fp64 is the parity tests' precision: model, master weights, moments
    # and every reduction in float64, so two layouts differ by ~1e-16 round-off and nothing else
    precision: str = "fp32"
    seed: int = 1234


@dataclass
class LoggingSection:
    run_dir: str = "runs/tiny"
    log_interval: int = 10
    eval_interval: int = 100
    eval_steps: int = 5
    wandb_mode: str = "offline"  # offline | online | disabled
    wandb_project: str = "zerotron"
    peak_tflops: float | None = None  # per-device peak for MFU; None: from the device table


@dataclass
class CheckpointSection:
    save: str | None = None  # directory; None: no checkpoints
    save_interval: int = 0  # steps; 0: only at the end (when save is set)
    load: str | None = None
    keep_last: int = 2


@dataclass
class RunConfig:
    model: ModelSection = field(default_factory=ModelSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)
    zero: ZeroSection = field(default_factory=ZeroSection)
    activation_checkpointing: ActivationCheckpointSection = field(default_factory=ActivationCheckpointSection)
    data: DataSection = field(default_factory=DataSection)
    optimizer: OptimizerSection = field(default_factory=OptimizerSection)
    training: TrainingSection = field(default_factory=TrainingSection)
    logging: LoggingSection = field(default_factory=LoggingSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    # validation ----------------------------------------------------------------------------
    def validate(self, world_size: int) -> "RunConfig":
        """Check every field that can be checked without the model or data; returns self.

        The parallel sizes are checked against ``world_size`` and ``dp`` is filled in.
        """
        _choice("training.precision", self.training.precision, PRECISIONS)
        _choice("optimizer.decay", self.optimizer.decay, ("cosine", "linear", "constant"))
        _choice("logging.wandb_mode", self.logging.wandb_mode, ("offline", "online", "disabled"))
        _choice("parallel.pipeline_schedule", self.parallel.pipeline_schedule, ("1f1b", "afab"))
        _choice("zero.stage", self.zero.stage, (0, 1, 2, 3))
        for name in ("tp", "pp"):
            _positive(f"parallel.{name}", getattr(self.parallel, name))
        mp = self.parallel.tp * self.parallel.pp
        if world_size % mp:
            raise ConfigError(f"parallel.tp*parallel.pp={self.parallel.tp}*{self.parallel.pp}={mp} does not divide "
                              f"the {world_size} processes; pick tp and pp whose product divides the world size")
        dp = world_size // mp
        if self.parallel.dp not in (None, -1) and self.parallel.dp != dp:
            raise ConfigError(f"parallel.dp={self.parallel.dp} but world_size/(tp*pp)={dp}; set dp={dp} or leave it unset")
        self.parallel.dp = dp
        t = self.training
        for name in ("train_steps", "micro_batch_size", "global_batch_size"):
            _positive(f"training.{name}", getattr(t, name))
        if t.global_batch_size % (t.micro_batch_size * dp):
            raise ConfigError(
                f"training.global_batch_size={t.global_batch_size} is not divisible by training.micro_batch_size*dp="
                f"{t.micro_batch_size}*{dp}; use a multiple of {t.micro_batch_size * dp}")
        if self.parallel.pp > 1 and self.zero.stage == 3:
            raise ConfigError("zero.stage=3 with parallel.pp>1 is not supported (each stage would gather its "
                              "parameters once per micro-batch); use zero.stage<=2 with pipelines")
        o = self.optimizer
        _positive("optimizer.lr", o.lr, allow_zero=True)
        if not 0 <= o.min_lr <= o.lr:
            raise ConfigError(f"optimizer.min_lr={o.min_lr} must be between 0 and optimizer.lr={o.lr}")
        _positive("optimizer.warmup_steps", o.warmup_steps, allow_zero=True)
        for name in ("beta1", "beta2"):
            if not 0 <= getattr(o, name) < 1:
                raise ConfigError(f"optimizer.{name}={getattr(o, name)} must be in [0, 1)")
        _positive("optimizer.clip_grad", o.clip_grad, allow_zero=True)
        m = self.model
        for name in ("dropout", "attention_dropout"):
            if not 0 <= getattr(m, name) < 1:
                raise ConfigError(f"model.{name}={getattr(m, name)} must be in [0, 1)")
        ac = self.activation_checkpointing
        _positive("activation_checkpointing.checkpoint_every", ac.checkpoint_every)
        for name in ("partition_activations", "cpu_checkpointing", "contiguous_memory_optimization"):
            if getattr(ac, name) and not ac.checkpoint_activations:
                raise ConfigError(f"activation_checkpointing.{name}=true needs activation_checkpointing."
                                  f"checkpoint_activations=true (it acts on the checkpoints); set both")
        lg = self.logging
        for name in ("log_interval", "eval_interval", "eval_steps"):
            _positive(f"logging.{name}", getattr(lg, name), allow_zero=name != "log_interval")
        _positive("checkpoint.save_interval", self.checkpoint.save_interval, allow_zero=True)
        _positive("checkpoint.keep_last", self.checkpoint.keep_last)
        if self.data.data_weights and len(self.data.data_weights) != len(self.data.data_path):
            raise ConfigError(f"data.data_weights has {len(self.data.data_weights)} entries but data.data_path has "
                              f"{len(self.data.data_path)}; give one weight per path or none")
        if self.data.data_path and not self.data.tokenizer:
            raise ConfigError("data.data_path is set but data.tokenizer is not; name the sentencepiece model the "
                              "token files were made with")
        return self

    @property
    def num_microbatches(self) -> int:
        t = self.training
        return t.global_batch_size // (t.micro_batch_size * self.parallel.dp)


def _choice(name: str, value: Any, allowed: tuple) -> None:
    if value not in allowed:
        raise ConfigError(f"{name}={value!r} is not one of {list(allowed)}")


def _positive(name: str, value: Any, allow_zero: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and (value >= 0 if allow_zero else value > 0)
    if not ok:
        raise ConfigError(f"{name}={value!r} must be {'>= 0' if allow_zero else '> 0'}")
