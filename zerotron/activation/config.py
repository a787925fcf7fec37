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
    number_checkpoints              slots of that buffer, for every forward in flight (DeepSpeed's
                                    counts one forward); None = sized from the model and schedule
    synchronize_checkpoint_boundary DeepSpeed's debugging aid: device synchronize() per chunk
    recompute_granularity           Megatron's name: "full" (the chunks above, when
                                    checkpoint_activations is on) or "selective": the attention
                                    core of every layer is recomputed (Korthikanti et al. 2022
                                    §5), alone or inside full recompute's chunks
    sequence_parallel_gather        with parallel.sequence_parallel: "keep" (the recompute's
                                    all-gathered GEMM inputs serve the weight gradients: SP
                                    moves the all-reduce bytes) or "regather" (Megatron's:
                                    gathered again in backward, 2(1 - 1/t)·s·b·h values less
                                    per recomputed layer)

Unlike DeepSpeed, ``cpu_checkpointing`` works without ``partition_activations`` (it then moves
the whole checkpoint), and a flag that would have no effect is an error, not a silent no-op. A
DeepSpeed JSON's section is read by ``zerotron.config.deepspeed`` (the one reader): its presence
turns ``checkpoint_activations`` on, since DeepSpeed has no key for that.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

Granularity = Literal["full", "selective"]  # Megatron's --recompute-granularity
SpGather = Literal["keep", "regather"]
GRANULARITIES = get_args(Granularity)  # the choices, read from the declared types
SP_GATHERS = get_args(SpGather)
_BOOLS = ("checkpoint_activations", "partition_activations", "cpu_checkpointing",
          "contiguous_memory_optimization", "synchronize_checkpoint_boundary")


@dataclass
class ActivationCheckpointConfig:
    """Which activations are checkpointed, where the checkpoints live, and how they are stored.

    The docstring under each field is its one line of ``--help`` (``zerotron.config.fields``)."""

    checkpoint_activations: bool = False
    """keep only chunk inputs, recompute in backward"""
    checkpoint_every: int = 1
    """transformer layers per checkpoint"""
    partition_activations: bool = False
    """Pa: each TP rank keeps 1/tp of every checkpoint"""
    cpu_checkpointing: bool = False
    """checkpoints in host memory (Pa+cpu with Pa)"""
    contiguous_memory_optimization: bool = False
    """MD: checkpoints in one pre-allocated buffer"""
    number_checkpoints: int | None = None
    """slots of the MD buffer; null: one per chunk"""
    synchronize_checkpoint_boundary: bool = False
    """device synchronize per chunk (debugging)"""
    recompute_granularity: Granularity = "full"
    """full: checkpointed chunks; selective: every layer's attention core"""
    sequence_parallel_gather: SpGather = "keep"
    """SP recompute: keep the gathered GEMM inputs, or regather (Megatron)"""

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
        if self.recompute_granularity not in GRANULARITIES:
            bad("recompute_granularity", f"use one of {list(GRANULARITIES)}: full recomputes checkpointed chunks "
                                         f"(checkpoint_activations), selective the attention core of every layer")
        if self.sequence_parallel_gather not in SP_GATHERS:
            bad("sequence_parallel_gather", f"use one of {list(SP_GATHERS)}: keep the recompute's gathered inputs "
                                            f"for the weight gradients, or gather them again (Megatron)")
        n = self.number_checkpoints
        if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
            bad("number_checkpoints", "must be a positive integer, or null to size the buffer from the model")
        if not self.checkpoint_activations:
            for key in ("partition_activations", "cpu_checkpointing", "contiguous_memory_optimization",
                        "synchronize_checkpoint_boundary"):
                if getattr(self, key):
                    bad(key, "acts on activation checkpoints; set checkpoint_activations=true or turn it off")
            if self.sequence_parallel_gather != "keep":
                bad("sequence_parallel_gather", "acts on the recompute of checkpointed chunks; set "
                                                "checkpoint_activations=true or remove it")
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
