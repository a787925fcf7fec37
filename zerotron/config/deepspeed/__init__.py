"""The one DeepSpeed JSON reader, used by ``--deepspeed-config`` and by library code alike.

It knows DeepSpeed's whole top-level schema (``keys.py``): every key is honoured (same meaning,
a zerotron field), mapped (translated onto a zerotron mechanism), accepted with no effect -- then
printed once at start-up as ``accepted, no effect here: <key> (<why>)`` -- or refused with the
reason; an unknown or misspelled key or section is an error with the closest valid key. Each
``"auto"`` is resolved from the run config and printed. Precedence: YAML < DeepSpeed JSON <
command-line flags, so the JSON is applied after the flags and skips what they set (``plan.py``).

    cfg, lines = from_deepspeed({"zero_optimization": {"stage": 3}, "bf16": {"enabled": True},
                                 "train_micro_batch_size_per_gpu": 4}, world_size=8)
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Callable

from zerotron.config.deepspeed import batch, mapping, optim, plan
from zerotron.config.deepspeed.keys import TOP
from zerotron.config.deepspeed.schema import DeepSpeedKeyError, check, markdown_table

__all__ = ["DeepSpeedKeyError", "PRECEDENCE", "apply_deepspeed", "from_deepspeed", "load_json", "markdown_table"]

PRECEDENCE = "precedence: YAML (--config) < DeepSpeed JSON (--deepspeed-config) < command-line flags"


def load_json(path: str) -> dict:
    """The JSON object in ``path``; a missing file, invalid JSON or a non-object is a ``DeepSpeedKeyError``."""
    try:
        data = json.loads(Path(path).read_text(), object_pairs_hook=_no_duplicates)
    except FileNotFoundError:
        raise DeepSpeedKeyError("file not found") from None
    except (IsADirectoryError, UnicodeDecodeError) as e:
        raise DeepSpeedKeyError(f"not a readable JSON file ({e})") from None
    except json.JSONDecodeError as e:
        raise DeepSpeedKeyError(f"invalid JSON ({e})") from None
    if not isinstance(data, dict):
        raise DeepSpeedKeyError(f"expected a JSON object of DeepSpeed sections, got {type(data).__name__}")
    return data


def _no_duplicates(pairs):
    """DeepSpeed refuses a key given twice (``dict_raise_error_on_duplicate_keys``); so do we."""
    out = {}
    for k, v in pairs:
        if k in out:
            raise DeepSpeedKeyError(f"{k}: given twice in one object; keep one")
        out[k] = v
    return out


def read(data: dict) -> plan.Plan:
    """Check ``data`` against DeepSpeed's schema and turn it into assignments (not yet applied).
    A copy is normalized as DeepSpeed reads it (legacy spellings, pydantic's coercions) first."""
    if not isinstance(data, dict):
        raise DeepSpeedKeyError(f"expected a JSON object of DeepSpeed sections, got {type(data).__name__}")
    data, p = copy.deepcopy(data), plan.Plan()
    _legacy_zero(data, p)
    p.notes.extend(check(data, TOP))
    mapping.zero(p, data.get("zero_optimization"))
    mapping.precision(p, data)
    if data.get("activation_checkpointing") is not None:
        mapping.activation(p, data["activation_checkpointing"])
    mapping.data_types(p, data)
    mapping.monitors(p, data)
    if data.get("tensor_parallel") is not None:
        mapping.tensor_parallel(p, data["tensor_parallel"])
    if data.get("optimizer") is not None:
        optim.optimizer(p, data["optimizer"])
    optim.clipping(p, data)
    if data.get("scheduler") is not None:
        optim.scheduler(p, data["scheduler"])
    elif data.get("optimizer") is not None:
        p.note("no scheduler section: the run config's schedule runs (optimizer.schedule, warmup_steps, decay), "
               "as under Megatron-DeepSpeed or the Hugging Face Trainer; DeepSpeed alone keeps the rate constant")
    return p


def _legacy_zero(data: dict, p: plan.Plan) -> None:
    """``"zero_optimization": true / false`` is DeepSpeed's deprecated spelling of stage 1 / 0, whose
    all-gather bucket is then the top-level ``allgather_size`` (``read_zero_config_deprecated``);
    DeepSpeed reads ``allgather_size`` nowhere else."""
    legacy = data.get("zero_optimization")
    if isinstance(legacy, bool):
        data["zero_optimization"] = {"stage": int(legacy)}
        p.note(f"zero_optimization: {str(legacy).lower()} is DeepSpeed's deprecated spelling of {{\"stage\": "
               f"{int(legacy)}}}; read as that (write the section out to set other keys)")
        if legacy and "allgather_size" in data:
            data["zero_optimization"]["allgather_bucket_size"] = data.pop("allgather_size")
    if "allgather_size" in data:
        data.pop("allgather_size")
        p.note("accepted, no effect here: allgather_size (DeepSpeed reads it only with the deprecated "
               "\"zero_optimization\": true; use zero_optimization.allgather_bucket_size)")


def apply_deepspeed(data: dict, cfg, set_field: Callable, flagged: set[str], world_size: int,
                    origins: dict | None = None) -> list[str]:
    """Apply a whole DeepSpeed config to ``cfg`` (after the YAML and the flags; ``flagged`` holds the
    ``section.field`` names the flags set, which the JSON does not touch). ``set_field(cfg, section,
    name, value)`` coerces a value to its field's type. Returns the start-up lines; ``origins``
    (when given) receives ``field -> DeepSpeed key`` for what the JSON set. Raises
    ``DeepSpeedKeyError`` naming the DeepSpeed key."""
    origins = {} if origins is None else origins
    lines = [PRECEDENCE] + plan.apply(read(data), cfg, set_field, flagged, origins)
    lines += mapping.stage3_only_below_stage3(cfg, set_field, origins)
    try:
        dp = cfg.parallel.resolve(world_size).dp
    except ValueError as e:
        raise DeepSpeedKeyError(f"the batch triple needs the data-parallel size: {e}") from None
    sizes, batch_lines = batch.resolve(data, cfg, dp, flagged)
    for target, value in sizes.items():
        set_field(cfg, *target.split("."), value)
    return lines + batch_lines


def from_deepspeed(data: dict, world_size: int = 1, base=None) -> tuple:
    """``(RunConfig, start-up lines)`` for a DeepSpeed config dict on ``world_size`` processes, on top
    of ``base`` (default ``RunConfig()``); not yet validated (``cfg.validate(world_size)``)."""
    from zerotron.config.run_config import RunConfig
    from zerotron.config.values import set_field

    cfg = base if base is not None else RunConfig()
    return cfg, apply_deepspeed(data, cfg, set_field, set(), world_size)
