"""Activation-checkpointing settings (ZeRO-R, ZeRO §6.1 and §6.3), named after DeepSpeed's keys.

The field names are DeepSpeed's ``activation_checkpointing`` keys, so the paper's
configurations C1-C5 (Table 3: CB + MD, + Pa, + Pa+cpu) are written exactly as a DeepSpeed user
would write them:

    checkpoint_activations          keep only each chunk's input, recompute the chunk in backward
    checkpoint_every                k: one checkpoint per k transformer layers (Megatron's
                                    --checkpoint-num-layers; k=1 is the paper's per-layer setting)
    partition_activations           Pa: each TP rank keeps 1/tp of every checkpoint (§6.1)
    cpu_checkpointing               Pa+cpu, or CPU offload of whole checkpoints without Pa (§6.1)
    contiguous_memory_optimization  MD: checkpoints live in one pre-allocated buffer (§6.3)
    number_checkpoints              slots of that buffer; None = one per chunk of the model
    synchronize_checkpoint_boundary DeepSpeed's debugging aid: device synchronize() per chunk

Unlike DeepSpeed, ``cpu_checkpointing`` works without ``partition_activations`` (it then moves
the whole checkpoint), and a flag that would have no effect is an error, not a silent no-op.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from zerotron.zero.deepspeed_json import deepspeed_section

# DeepSpeed keys we read. "profile" is accepted only as false: zerotron times steps, not chunks.
_DS_KEYS = {"partition_activations", "cpu_checkpointing", "contiguous_memory_optimization",
            "number_checkpoints", "synchronize_checkpoint_boundary", "profile"}
# Top-level keys that mark a whole DeepSpeed JSON (rather than its activation_checkpointing part).
_DS_TOP_LEVEL = {"zero_optimization", "train_batch_size", "train_micro_batch_size_per_gpu",
                 "gradient_accumulation_steps", "fp16", "bf16", "optimizer", "scheduler", "gradient_clipping"}
_BOOLS = ("checkpoint_activations", "partition_activations", "cpu_checkpointing",
          "contiguous_memory_optimization", "synchronize_checkpoint_boundary")


@dataclass
class ActivationCheckpointConfig:
    """Which activations are checkpointed, where the checkpoints live, and how they are stored."""

    checkpoint_activations: bool = False
    checkpoint_every: int = 1
    partition_activations: bool = False
    cpu_checkpointing: bool = False
    contiguous_memory_optimization: bool = False
    number_checkpoints: int | None = None
    synchronize_checkpoint_boundary: bool = False

    def validate(self) -> "ActivationCheckpointConfig":
        """Raise ``ValueError`` naming the key, the value and the fix; returns self."""
        def bad(key: str, fix: str):
            raise ValueError(f"activation_checkpointing.{key}={getattr(self, key)!r}: {fix}")

        for key in _BOOLS:
            if not isinstance(getattr(self, key), bool):
                bad(key, "must be true or false")
        k = self.checkpoint_every
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            bad("checkpoint_every", "must be a positive number of transformer layers per checkpoint, e.g. 1")
        n = self.number_checkpoints
        if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
            bad("number_checkpoints", "must be a positive integer, or null to size the buffer from the model")
        if not self.checkpoint_activations:
            for key in ("partition_activations", "cpu_checkpointing", "contiguous_memory_optimization",
                        "synchronize_checkpoint_boundary"):
                if getattr(self, key):
                    bad(key, "acts on activation checkpoints; set checkpoint_activations=true or turn it off")
            if n is not None:
                bad("number_checkpoints", "sizes the checkpoint buffer; set checkpoint_activations=true "
                                          "and contiguous_memory_optimization=true, or remove it")
        elif n is not None and not self.contiguous_memory_optimization:
            bad("number_checkpoints", "only sizes the contiguous buffer (MD); set "
                                      "contiguous_memory_optimization=true or remove it")
        return self

    @property
    def offload_activations(self) -> bool:
        """Plain-words alias of ``cpu_checkpointing`` (style guide: paper/DeepSpeed names in config)."""
        return self.cpu_checkpointing

    @classmethod
    def from_deepspeed(cls, ds: dict, **overrides) -> "ActivationCheckpointConfig":
        """Build from a DeepSpeed config: the whole JSON dict or its ``activation_checkpointing`` part.

        DeepSpeed has no key that turns checkpointing on (its users call
        ``deepspeed.checkpointing.checkpoint`` themselves), so a present ``activation_checkpointing``
        section means ``checkpoint_activations=True``; ``overrides`` (any field, e.g.
        ``checkpoint_every``) win over the dict. The result is validated.
        """
        if not isinstance(ds, dict):
            raise ValueError(f"activation_checkpointing must be a dict, got {type(ds).__name__}")
        whole = "activation_checkpointing" in ds or bool(set(ds) & _DS_TOP_LEVEL)
        section = ds.get("activation_checkpointing") if whole else ds
        kw = activation_fields_from_deepspeed(section) if section is not None else {}
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(overrides) - names)
        if unknown:
            raise ValueError(f"ActivationCheckpointConfig has no field {unknown[0]!r}; fields are {sorted(names)}")
        kw.update(overrides)
        return cls(**kw).validate()


def activation_fields_from_deepspeed(section: dict) -> dict:
    """ActivationCheckpointConfig fields from a DeepSpeed ``activation_checkpointing`` dict: its keys,
    plus ``checkpoint_activations=True`` (the section's presence is DeepSpeed's way of saying
    checkpoints are taken). Unknown keys are errors."""
    deepspeed_section(section, "activation_checkpointing", _DS_KEYS)
    if section.get("profile", False) is not False:
        raise ValueError("activation_checkpointing.profile=true: per-chunk profiling is not implemented; "
                         "remove the key (step times are in the trainer's metrics)")
    kw = {key: value for key, value in section.items() if key != "profile"}
    kw["checkpoint_activations"] = True
    return kw
