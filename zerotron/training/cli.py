"""Build a ``RunConfig`` from a YAML file, an optional DeepSpeed JSON, and command-line overrides.

Precedence: dataclass defaults < ``--config`` YAML < ``--deepspeed-config`` JSON (only its
``zero_optimization`` and ``activation_checkpointing`` sections) < flags. Every field can be set
as ``--<section>.<field> VALUE``; the common ones also have Megatron-style short flags
(``--tp``, ``--zero-stage``, ``--lr`` ...). Unknown keys are errors that name the key.
"""

from __future__ import annotations

import argparse
import dataclasses
import decimal
import json
import typing
from pathlib import Path
from typing import Any

import yaml

from zerotron.activation.config import activation_fields_from_deepspeed
from zerotron.training.config import ConfigError, RunConfig
from zerotron.zero.deepspeed_json import grad_accum_from_deepspeed, precision_from_deepspeed, zero_fields_from_deepspeed

# short flag -> (section, field)
SHORT_FLAGS = {
    "tp": ("parallel", "tp"),
    "pp": ("parallel", "pp"),
    "zero-stage": ("zero", "stage"),
    "precision": ("training", "precision"),
    "micro-batch-size": ("training", "micro_batch_size"),
    "global-batch-size": ("training", "global_batch_size"),
    "seq-length": ("model", "seq_length"),
    "train-steps": ("training", "train_steps"),
    "lr": ("optimizer", "lr"),
    "seed": ("training", "seed"),
    "dropout": ("model", "dropout"),
    "checkpoint-activations": ("activation_checkpointing", "checkpoint_activations"),
    "partition-activations": ("activation_checkpointing", "partition_activations"),
    "cpu-offload-activations": ("activation_checkpointing", "cpu_checkpointing"),
    "offload-optimizer": ("zero", "offload_optimizer"),
    "run-dir": ("logging", "run_dir"),
    "save": ("checkpoint", "save"),
    "save-interval": ("checkpoint", "save_interval"),
    "load": ("checkpoint", "load"),
    "log-interval": ("logging", "log_interval"),
    "eval-interval": ("logging", "eval_interval"),
    "wandb-mode": ("logging", "wandb_mode"),
}
BOOL_FLAGS = {"checkpoint-activations", "partition-activations", "cpu-offload-activations", "offload-optimizer"}
def _field_types(section_obj) -> dict[str, Any]:
    hints = typing.get_type_hints(type(section_obj))
    return {f.name: hints[f.name] for f in dataclasses.fields(section_obj)}


def _coerce(name: str, tp: Any, value: Any) -> Any:
    """Convert ``value`` (from YAML or a string flag) to the field's type, or raise naming the field."""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    optional = type(None) in typing.get_args(tp)
    if optional and (value is None or (isinstance(value, str) and value.lower() in ("none", "null"))):
        return None
    base = args[0] if optional and args else tp
    origin = typing.get_origin(base)
    try:
        if origin is list:
            (inner,) = typing.get_args(base)
            items = value.split(",") if isinstance(value, str) else list(value)
            return [_coerce(f"{name}[{i}]", inner, x) for i, x in enumerate(x for x in items if x != "")]
        if base is bool:
            if isinstance(value, str):
                low = value.lower()
                if low not in ("true", "false", "1", "0", "yes", "no"):
                    raise ValueError(value)
                return low in ("true", "1", "yes")
            if not isinstance(value, bool):
                raise ValueError(value)
            return value
        if base is int:
            return _whole(name, value)
        if base is float:
            if isinstance(value, bool):  # YAML's true/yes would otherwise become 1.0
                raise ValueError(value)
            return float(value)
        if base is str:
            return str(value)
    except ConfigError:
        raise
    except (TypeError, ValueError):
        raise ConfigError(f"{name}={value!r} is not a valid {getattr(base, '__name__', base)}") from None
    return value


def _whole(name: str, value: Any) -> int:
    """An int field's value: an int, or a number written another way that is exactly whole
    ("5e8", 1e3, "2_000"); "2.5e0" or 2.5 is an error rather than silently 2."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(value)
    if isinstance(value, int):
        return value
    try:
        exact = decimal.Decimal(value.strip().replace("_", "") if isinstance(value, str) else value)
    except decimal.InvalidOperation:
        raise ValueError(value) from None
    if not exact.is_finite():
        raise ValueError(value)
    if exact != exact.to_integral_value():
        raise ConfigError(f"{name}={value!r} is not a whole number; {name.split('[')[0]} takes an integer, "
                          f"e.g. {int(exact)}")
    if abs(exact) >= 2**63:
        raise ConfigError(f"{name}={value!r} does not fit a 64-bit integer; give a smaller value")
    return int(exact)


def set_field(cfg: RunConfig, section: str, name: str, value: Any) -> None:
    if not hasattr(cfg, section) or not dataclasses.is_dataclass(getattr(cfg, section)):
        sections = [f.name for f in dataclasses.fields(cfg)]
        raise ConfigError(f"unknown config section {section!r}; sections are {sections}")
    sec = getattr(cfg, section)
    types = _field_types(sec)
    if name not in types:
        raise ConfigError(f"unknown config key {section}.{name}; keys of {section} are {sorted(types)}")
    setattr(sec, name, _coerce(f"{section}.{name}", types[name], value))


def apply_mapping(cfg: RunConfig, data: dict, source: str) -> None:
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a mapping of sections, got {type(data).__name__}")
    for section, values in data.items():
        if not isinstance(values, dict):
            raise ConfigError(f"{source}: section {section!r} must be a mapping of keys")
        for name, value in values.items():
            set_field(cfg, section, name, value)


def apply_deepspeed(cfg: RunConfig, path: str) -> None:
    """Read a DeepSpeed JSON the way the library reads it (``ZeroConfig.from_deepspeed``,
    ``ActivationCheckpointConfig.from_deepspeed``, ``precision_from_deepspeed``): its keys win over
    the YAML's, flags win over both."""
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigError(f"--deepspeed-config {path}: file not found") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"--deepspeed-config {path}: invalid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"--deepspeed-config {path}: expected a JSON object, got {type(data).__name__}")
    try:
        if "zero_optimization" in data:
            cfg.zero = dataclasses.replace(cfg.zero, **zero_fields_from_deepspeed(data["zero_optimization"]))
        if "activation_checkpointing" in data:
            cfg.activation_checkpointing = dataclasses.replace(
                cfg.activation_checkpointing, **activation_fields_from_deepspeed(data["activation_checkpointing"]))
        cfg.zero = dataclasses.replace(cfg.zero, **grad_accum_from_deepspeed(data))
        precision = precision_from_deepspeed(data)
    except ValueError as e:
        raise ConfigError(f"--deepspeed-config {path}: {e}") from None
    if "precision" in precision:
        cfg.training.precision = precision.pop("precision")
    for name, value in precision.items():  # fp16 loss scaling
        set_field(cfg, "optimizer", name, value)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Pretrain a GPT with zerotron (TP x PP x ZeRO-DP).")
    p.add_argument("--config", help="YAML run config (see configs/)")
    p.add_argument("--deepspeed-config", help="DeepSpeed JSON: zero_optimization and activation_checkpointing are read")
    for flag, (section, name) in SHORT_FLAGS.items():
        if flag in BOOL_FLAGS:
            p.add_argument(f"--{flag}", dest=f"{section}.{name}", action="store_const", const="true",
                           help=f"sets {section}.{name}=true")
        else:
            p.add_argument(f"--{flag}", dest=f"{section}.{name}", metavar="V", help=f"sets {section}.{name}")
    return p


def parse_config(argv: list[str] | None = None) -> RunConfig:
    """Parse flags into a ``RunConfig`` (not yet validated against a world size)."""
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    cfg = RunConfig()
    if args.config:
        try:
            data = yaml.safe_load(Path(args.config).read_text())
        except FileNotFoundError:
            raise ConfigError(f"--config {args.config}: file not found") from None
        except (IsADirectoryError, UnicodeDecodeError) as e:
            raise ConfigError(f"--config {args.config}: not a readable YAML file ({e})") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"--config {args.config}: invalid YAML ({e})") from None
        if data is None:  # an empty file (or only comments) is a mistake, not "all defaults"
            raise ConfigError(f"--config {args.config}: the file is empty (no sections); write the run's "
                              f"sections (see configs/tiny.yaml) or drop --config to run on the defaults")
        apply_mapping(cfg, data, args.config)
    if args.deepspeed_config:
        apply_deepspeed(cfg, args.deepspeed_config)
    for dest, value in vars(args).items():
        if "." in dest and value is not None:
            set_field(cfg, *dest.split(".", 1), value)
    i = 0
    while i < len(rest):  # generic --section.field VALUE (or --section.field=VALUE)
        token = rest[i]
        if not token.startswith("--") or "." not in token:
            raise ConfigError(f"unknown argument {token!r}; use --section.field VALUE or see --help")
        key, _, value = token[2:].partition("=")
        if not _:
            if i + 1 >= len(rest):
                raise ConfigError(f"{token} needs a value")
            value, i = rest[i + 1], i + 1
        section, name = key.split(".", 1)
        set_field(cfg, section.replace("-", "_"), name.replace("-", "_"), value)
        i += 1
    return cfg
