"""ZeRO-DP settings: one validated dataclass, plus a reader for DeepSpeed ``zero_optimization`` dicts.

The stages are the paper's cumulative partitions (ZeRO §5): 0 = plain data parallelism,
1 = Pos (optimizer states), 2 = Pos+g (+ gradients), 3 = Pos+g+p (+ parameters). Bucket sizes are
ZeRO-R's constant buffers (CB, §6.2): they bound the temporary buffers whatever the model size.
``contiguous_gradients`` is MD (§6.3): gradients live in one pre-allocated flat buffer.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

PRECISIONS = ("fp32", "fp16", "bf16")

# DeepSpeed keys we understand; anything else in a zero_optimization dict is an error, not a no-op.
_DS_KEYS = {
    "stage", "overlap_comm", "contiguous_gradients", "reduce_bucket_size", "allgather_bucket_size",
    "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold", "offload_optimizer",
    # Accepted because zerotron always behaves this way (documented, not silently ignored):
    "reduce_scatter", "allgather_partitions",
}


@dataclass
class ZeroConfig:
    """What the ZeRO optimizer partitions, in which precision, and with which buffer sizes.

    contiguous_gradients: stages 0-1 keep every gradient as a view of one flat buffer (MD) when
    True, and pack autograd's own gradient tensors into the bucket at reduction time when False.
    Stages 2-3 always reduce into the contiguous gradient *partition*, which is what Pos+g is.
    """

    stage: int = 0
    precision: str = "fp32"
    overlap_comm: bool = False
    contiguous_gradients: bool = True
    reduce_bucket_size: int = int(5e8)
    allgather_bucket_size: int = int(5e8)
    stage3_prefetch_bucket_size: int = int(5e7)
    stage3_param_persistence_threshold: int = int(1e5)
    offload_optimizer: bool = False
    initial_loss_scale: float = 2.0 ** 16
    loss_scale_window: int = 1000
    hysteresis: int = 2
    min_loss_scale: float = 1.0

    def validate(self) -> "ZeroConfig":
        """Raise ``ValueError`` naming the key, the value and the fix; returns self."""
        def bad(key: str, fix: str):
            raise ValueError(f"zero.{key}={getattr(self, key)!r}: {fix}")

        if not isinstance(self.stage, int) or isinstance(self.stage, bool) or self.stage not in (0, 1, 2, 3):
            bad("stage", "use 0 (plain DP), 1 (Pos), 2 (Pos+g) or 3 (Pos+g+p)")
        if self.precision not in PRECISIONS:
            bad("precision", f"use one of {PRECISIONS}")
        for key in ("overlap_comm", "contiguous_gradients", "offload_optimizer"):
            if not isinstance(getattr(self, key), bool):
                bad(key, "must be true or false")
        for key in ("reduce_bucket_size", "allgather_bucket_size", "stage3_prefetch_bucket_size"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                bad(key, "must be a positive number of elements, e.g. 500000000")
        value = self.stage3_param_persistence_threshold
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            bad("stage3_param_persistence_threshold", "must be a number of elements >= 0 (0 partitions everything)")
        if self.offload_optimizer and self.stage == 0:
            bad("offload_optimizer", "CPU offload (ZeRO-Offload) needs stage 1, 2 or 3; set stage >= 1 or turn it off")
        if not (isinstance(self.initial_loss_scale, (int, float)) and self.initial_loss_scale > 0):
            bad("initial_loss_scale", "must be > 0, e.g. 65536")
        if not (isinstance(self.min_loss_scale, (int, float)) and 0 < self.min_loss_scale <= self.initial_loss_scale):
            bad("min_loss_scale", "must be > 0 and <= initial_loss_scale")
        for key in ("loss_scale_window", "hysteresis"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                bad(key, "must be a positive integer")
        return self

    @classmethod
    def from_deepspeed(cls, ds: dict, **overrides) -> "ZeroConfig":
        """Build from a DeepSpeed config: either the whole JSON dict or its ``zero_optimization`` part.

        Precision and loss scaling come from the whole dict's ``fp16``/``bf16`` sections when present
        (``initial_scale_power``, ``loss_scale_window``, ``hysteresis``, ``min_loss_scale``).
        ``overrides`` are ZeroConfig fields that win over the dict.
        """
        if not isinstance(ds, dict):
            raise ValueError(f"zero_optimization must be a dict, got {type(ds).__name__}")
        zero = ds.get("zero_optimization", ds)
        if not isinstance(zero, dict):
            raise ValueError("zero_optimization must be a dict of DeepSpeed ZeRO keys")
        unknown = sorted(set(zero) - _DS_KEYS)
        if unknown:
            raise ValueError(f"zero_optimization.{unknown[0]}: not supported by zerotron; supported keys are "
                             f"{sorted(_DS_KEYS)} (remove it or file an issue)")
        kw: dict = {}
        for key in ("stage", "overlap_comm", "contiguous_gradients"):
            if key in zero:
                kw[key] = zero[key]
        for key in ("reduce_bucket_size", "allgather_bucket_size", "stage3_prefetch_bucket_size",
                    "stage3_param_persistence_threshold"):
            if key in zero:
                value = zero[key]
                if isinstance(value, float) and value.is_integer():
                    value = int(value)  # DeepSpeed JSON commonly writes 5e8
                kw[key] = value
        for key in ("reduce_scatter", "allgather_partitions"):
            if zero.get(key, True) is not True:
                raise ValueError(f"zero_optimization.{key}=false: zerotron always uses reduce-scatter / all-gather "
                                 f"(ZeRO §7); remove the key or set it to true")
        if "overlap_comm" not in zero and kw.get("stage") == 3:
            kw["overlap_comm"] = True  # DeepSpeed's code default for stage 3
        off = zero.get("offload_optimizer")
        if off is not None:
            if not isinstance(off, dict):
                raise ValueError("zero_optimization.offload_optimizer must be a dict like {\"device\": \"cpu\"}")
            device = off.get("device", "none")
            if device not in ("none", "cpu"):
                raise ValueError(f"zero_optimization.offload_optimizer.device={device!r}: zerotron supports "
                                 f"'cpu' or 'none' (NVMe offload is not implemented)")
            kw["offload_optimizer"] = device == "cpu"
        for section, precision in (("fp16", "fp16"), ("bf16", "bf16")):
            sec = ds.get(section)
            if isinstance(sec, dict) and sec.get("enabled", False):
                kw["precision"] = precision
                if precision == "fp16":
                    if "initial_scale_power" in sec:
                        kw["initial_loss_scale"] = 2.0 ** sec["initial_scale_power"]
                    for src, dst in (("loss_scale_window", "loss_scale_window"), ("hysteresis", "hysteresis"),
                                     ("min_loss_scale", "min_loss_scale")):
                        if src in sec:
                            kw[dst] = sec[src]
        names = {f.name for f in fields(cls)}
        for key in overrides:
            if key not in names:
                raise ValueError(f"ZeroConfig has no field {key!r}; fields are {sorted(names)}")
        kw.update(overrides)
        return cls(**kw).validate()
