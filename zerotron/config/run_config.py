"""The run configuration: one tree of dataclasses, validated once, errors that name the field.

A run is one YAML file of these sections (see ``configs/tiny.yaml``) plus command-line overrides
(``zerotron.config.cli``). The parallel, ZeRO and activation-checkpointing sections are the
library's own ``ParallelDims``, ``ZeroConfig`` and ``ActivationCheckpointConfig``, the others are
declared in ``zerotron.config.sections``, so a key has one name, one default, one help line and one
check wherever it is read; a ``Literal`` field's choices are checked from its type
(``zerotron.config.fields``), here for values set in code as the readers do for theirs.
``validate(world_size)`` runs on every rank before ``init_process_group``-dependent work, so a bad
config stops every rank with the same message instead of leaving some of them waiting in a
collective.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import re
import types
import typing
from dataclasses import dataclass, field
from typing import Any

from zerotron.activation import ActivationCheckpointConfig
from zerotron.config.fields import first_refusal
from zerotron.config.sections import (CheckpointSection, DataSection, LoggingSection,  # noqa: F401
                                      ModelOverrides, OptimizerSection, TrainingSection)
from zerotron.parallel import ParallelDims, runtime
from zerotron.zero.lr_schedule import betas_at, check_schedule, min_lr_used
from zerotron.zero.config import ZeroConfig
from zerotron.zero.loss_scaler import check_loss_scaling
from zerotron.zero.zeropp.groups import check_node_local


RUN_DIR = "{run_dir}"  # in checkpoint.save: stands for logging.run_dir, so each run has its own checkpoints


class ConfigError(ValueError):
    """A config value is invalid; the message names ``section.field``, the value and the fix."""


@dataclass
class RunConfig:
    model: ModelOverrides = field(default_factory=ModelOverrides)
    parallel: ParallelDims = field(default_factory=ParallelDims)
    zero: ZeroConfig = field(default_factory=ZeroConfig)
    activation_checkpointing: ActivationCheckpointConfig = field(default_factory=ActivationCheckpointConfig)
    data: DataSection = field(default_factory=DataSection)
    optimizer: OptimizerSection = field(default_factory=OptimizerSection)
    training: TrainingSection = field(default_factory=TrainingSection)
    logging: LoggingSection = field(default_factory=LoggingSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    # which DeepSpeed JSON set which field ({"zero.grad_accum_dtype": "communication_data_type"}):
    # set per instance by the reader, so an error is named by the key the user wrote; not a section
    deepspeed_file: typing.ClassVar[str] = ""
    deepspeed_keys: typing.ClassVar[typing.Mapping[str, str]] = types.MappingProxyType({})  # read-only

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    # validation ----------------------------------------------------------------------------
    def validate(self, world_size: int, gpus_per_node: int | None = None) -> "RunConfig":
        """Check every field that can be checked without the model or data; returns self.

        The parallel sizes are checked against ``world_size`` and ``dp`` is filled in; ZeRO++'s
        node-local groups against ``gpus_per_node`` (default: the launcher's ``LOCAL_WORLD_SIZE``).
        An error about a field a DeepSpeed JSON set names that JSON and its key as well.
        """
        try:
            return self._check(world_size, gpus_per_node or runtime.gpus_per_node())
        except ConfigError as e:
            named = [(f, key) for f, key in self.deepspeed_keys.items() if re.search(rf"\b{re.escape(f)}\b", str(e))]
            if not named:
                raise
            keys = ", ".join(key if key == f else f"{key} (read as {f})" for f, key in named)
            raise ConfigError(f"--deepspeed-config {self.deepspeed_file}: {keys}: {e}") from None

    def _check(self, world_size: int, gpus_per_node: int | None) -> "RunConfig":
        _check_finite(self)
        if (why := first_refusal(self)) is not None:  # every Literal-typed field, set in code too
            raise ConfigError(why)
        try:
            self.parallel = self.parallel.resolve(world_size)
            self.zero.validate(dp_size=self.parallel.dp, precision=self.training.precision)
            check_node_local(self.zero, self.parallel, gpus_per_node)
            self.activation_checkpointing.validate()
        except ValueError as e:
            raise ConfigError(str(e)) from None
        dp = self.parallel.dp
        z = self.zero
        if self.parallel.cp > 1 and (z.zero_hpz_partition_size > 1 or z.zero_quantized_gradients):
            key = "zero_hpz_partition_size" if z.zero_hpz_partition_size > 1 else "zero_quantized_gradients"
            raise ConfigError(f"zero.{key}={getattr(z, key)} with parallel.cp={self.parallel.cp}: ZeRO++'s "
                              f"node-local groups split the DP group, not the data-parallel-with-CP group "
                              f"ZeRO partitions over under context parallelism; turn it off or set "
                              f"parallel.cp=1")
        t = self.training
        for name in ("train_steps", "micro_batch_size", "global_batch_size"):
            steps = name == "train_steps"
            _positive(f"training.{name}", getattr(t, name),
                      allow_zero=steps and self.checkpoint.init_from_hf is not None,
                      fix="0 only with checkpoint.init_from_hf (import and save)" if steps else "")
        if not 0 <= t.seed < 2**62:
            raise ConfigError(f"training.seed={t.seed} must be in [0, 2**62) (numpy refuses negative seeds); "
                              f"e.g. 1234")
        if t.global_batch_size % (t.micro_batch_size * dp):
            raise ConfigError(
                f"training.global_batch_size={t.global_batch_size} is not divisible by training.micro_batch_size*dp="
                f"{t.micro_batch_size}*{dp}; use a multiple of {t.micro_batch_size * dp}")
        if self.parallel.virtual_stages > 1 and self.num_microbatches % self.parallel.pp:
            raise ConfigError(f"parallel.virtual_stages={self.parallel.virtual_stages}: the interleaved schedule runs "
                              f"micro-batches in groups of parallel.pp={self.parallel.pp}, but there are "
                              f"{self.num_microbatches} (training.global_batch_size / (micro_batch_size * dp)); use a "
                              f"global_batch_size of a multiple of {self.parallel.pp * t.micro_batch_size * dp}")
        if self.activation_checkpointing.sequence_parallel_gather != "keep" and not self.parallel.sequence_parallel:
            raise ConfigError("activation_checkpointing.sequence_parallel_gather="
                              f"{self.activation_checkpointing.sequence_parallel_gather!r} acts on sequence "
                              "parallelism's gathers; set parallel.sequence_parallel=true or remove it")
        if self.parallel.pp > 1 and self.zero.stage == 3:
            raise ConfigError("zero.stage=3 with parallel.pp>1 is not supported (each stage would gather its "
                              "parameters once per micro-batch); use zero.stage<=2 with pipelines")
        o = self.optimizer
        _positive("optimizer.lr", o.lr, allow_zero=True)
        _positive("optimizer.eps", o.eps, fix="Adam's denominator guard; 1e-8 is the usual value")
        _positive("optimizer.weight_decay", o.weight_decay, allow_zero=True, fix="use 0 to disable it")
        if min_lr_used(o) and not 0 <= o.min_lr <= o.lr:
            raise ConfigError(f"optimizer.min_lr={o.min_lr} must be between 0 and optimizer.lr={o.lr} (the rate the "
                              f"{o.decay} decay ends at); lower it, e.g. --optimizer.min_lr {o.lr / 10:.3g}")
        _positive("optimizer.warmup_steps", o.warmup_steps, allow_zero=True)
        for name in ("beta1", "beta2"):
            if not 0 <= getattr(o, name) < 1:
                raise ConfigError(f"optimizer.{name}={getattr(o, name)} must be in [0, 1)")
        try:
            check_loss_scaling(o.initial_loss_scale, o.loss_scale_window, o.hysteresis, o.min_loss_scale,
                               o.loss_scale, o.consecutive_hysteresis)
        except ValueError as e:
            raise ConfigError(f"optimizer.{e}") from None
        try:
            check_schedule(o)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        last_beta1 = betas_at(t.train_steps - 1, o)[0]
        if not 0 <= last_beta1 < 1:
            raise ConfigError(f"optimizer.decay_beta1_rate={o.decay_beta1_rate}: OneCycle's beta1 reaches "
                              f"{last_beta1:.4g} by step {t.train_steps} (training.train_steps), outside Adam's "
                              f"[0, 1); lower the rate or raise optimizer.decay_step_size")
        _positive("optimizer.clip_grad", o.clip_grad, allow_zero=True)
        m = self.model
        for name in ("dropout", "attention_dropout"):
            if getattr(m, name) is not None and not 0 <= getattr(m, name) < 1:
                raise ConfigError(f"model.{name}={getattr(m, name)} must be in [0, 1)")
        if m.vocab_size is not None and (isinstance(m.vocab_size, bool) or m.vocab_size < 1):
            raise ConfigError(f"model.vocab_size={m.vocab_size!r} must be a positive integer, or null to take "
                              f"the tokenizer's")
        lg = self.logging
        if not lg.run_dir.strip():
            raise ConfigError("logging.run_dir is empty; name the run's directory (e.g. runs/exp1): metrics, the "
                              "config and {run_dir} checkpoints go there")
        for name in ("log_interval", "eval_interval", "eval_steps"):
            _positive(f"logging.{name}", getattr(lg, name), allow_zero=name != "log_interval")
        if (fix := check_profile_steps(lg.profile_steps, self.training.train_steps)) is not None:
            raise ConfigError(f"logging.profile_steps={lg.profile_steps}: {fix}")
        if lg.peak_tflops is not None:
            _positive("logging.peak_tflops", lg.peak_tflops, fix="the device's peak TFLOP/s, or null for the table")
        if lg.tensorboard and importlib.util.find_spec("tensorboard") is None:
            raise ConfigError("logging.tensorboard=true needs the tensorboard package (torch.utils.tensorboard "
                              "writes through it); pip install tensorboard, or set logging.tensorboard=false")
        _positive("checkpoint.save_interval", self.checkpoint.save_interval, allow_zero=True)
        _positive("checkpoint.keep_last", self.checkpoint.keep_last)
        if self.checkpoint.save:  # resolved once here, so every reader sees the same directory
            self.checkpoint.save = self.checkpoint.save.replace(RUN_DIR, self.logging.run_dir)
        _positive("data.default_corpus_vocab", self.data.default_corpus_vocab)
        if isinstance(self.data.prefetch, bool) or not isinstance(self.data.prefetch, int) or self.data.prefetch < 0:
            raise ConfigError(f"data.prefetch={self.data.prefetch!r} must be an integer >= 0 (steps read "
                              f"ahead; 0 reads each step when it starts)")
        for i, w in enumerate(self.data.data_weights):
            _positive(f"data.data_weights[{i}]", w, allow_zero=True, fix="weights are sampling proportions")
        if self.data.data_weights and not math.isfinite(sum(self.data.data_weights)):
            raise ConfigError(f"data.data_weights={self.data.data_weights} sum to infinity; "
                              f"weights are proportions: scale them down (e.g. 1,1)")
        if self.data.data_weights and not sum(self.data.data_weights) > 0:
            raise ConfigError(f"data.data_weights={self.data.data_weights} sum to 0; give at least one path a "
                              f"positive weight")
        if self.data.data_weights and len(self.data.data_weights) != len(self.data.data_path):
            raise ConfigError(f"data.data_weights has {len(self.data.data_weights)} entries but data.data_path has "
                              f"{len(self.data.data_path)}; give one weight per path or none")
        d = self.data
        if not d.data_path:  # the built-in corpus: its own eval split (a tokenizer: data.tokenizer's)
            for name in ("eval_path", "data_weights"):
                if getattr(d, name):
                    raise ConfigError(f"data.{name}={getattr(d, name)!r} is set but data.data_path is not, so the "
                                      f"built-in corpus (with its own eval split) is used and "
                                      f"data.{name} would be ignored; set data.data_path or remove data.{name}")
        if self.data.data_path and not self.data.tokenizer:
            raise ConfigError("data.data_path is set but data.tokenizer is not; name the sentencepiece model the "
                              "token files were made with")
        return self

    @property
    def num_microbatches(self) -> int:
        t = self.training
        return t.global_batch_size // (t.micro_batch_size * self.parallel.dp)


def _positive(name: str, value: Any, allow_zero: bool = False, fix: str = "") -> None:
    """A finite number, > 0 (``>= 0`` with ``allow_zero``); ``fix`` is appended to the error."""
    ok = (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
          and (value >= 0 if allow_zero else value > 0))
    if not ok:
        raise ConfigError(f"{name}={value!r} must be a finite number {'>= 0' if allow_zero else '> 0'}"
                          + (f"; {fix}" if fix else ""))


def _check_finite(cfg: "RunConfig") -> None:
    """No NaN or infinity anywhere in the tree: range checks such as ``lr >= 0`` let ``inf`` through
    and every comparison with NaN is false, so without this both would reach the optimizer."""
    for section in dataclasses.fields(cfg):
        sec = getattr(cfg, section.name)
        for f in dataclasses.fields(sec):
            value = getattr(sec, f.name)
            for item in value if isinstance(value, (list, tuple)) else [value]:
                if isinstance(item, float) and not math.isfinite(item):
                    default = f.default if f.default is not dataclasses.MISSING else None
                    hint = f" (the default is {default})" if isinstance(default, (int, float)) else ""
                    raise ConfigError(f"{section.name}.{f.name}={value!r} is not a finite number; give a "
                                      f"finite value{hint}")


def check_profile_steps(steps, train_steps: int) -> str | None:
    """The fix for a bad ``logging.profile_steps``; None when empty or ``[A, B]``, 1 <= A <= B."""
    if not steps:
        return None
    if len(steps) != 2 or not all(isinstance(s, int) and not isinstance(s, bool) for s in steps):
        return "give two step numbers A B (--profile-steps 3 4), or leave it empty"
    if not 1 <= steps[0] <= steps[1] <= train_steps:
        return f"need 1 <= A <= B <= training.train_steps={train_steps}"
    return None
