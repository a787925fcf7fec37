"""DeepSpeed JSON, read once: the ``zero_optimization``, ``fp16``/``bf16`` and ``data_types``
sections as ``ZeroConfig`` fields and ``ZeroOptimizer`` arguments.

The CLI (``--deepspeed-config``) and the library (``ZeroConfig.from_deepspeed``) call these same
functions, so one JSON has one meaning. A key zerotron does not know is an error naming it, not a
silent no-op.
"""

from __future__ import annotations

_DS_DTYPES = {"fp32": "fp32", "float32": "fp32", "float": "fp32", "torch.float32": "fp32",
              "bf16": "bf16", "bfloat16": "bf16", "bfloat": "bf16", "torch.bfloat16": "bf16",
              "fp16": "fp16", "float16": "fp16", "half": "fp16", "torch.float16": "fp16"}

# DeepSpeed keys we understand; anything else in a zero_optimization dict is an error, not a no-op.
_DS_KEYS = {
    "stage", "overlap_comm", "contiguous_gradients", "reduce_bucket_size", "allgather_bucket_size",
    "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold", "offload_optimizer",
    "offload_param", "sub_group_size", "zero_quantized_weights", "zero_quantized_gradients",
    "zero_hpz_partition_size", "zero_quantization_block_size", "zero_quantized_gradients_node_size",
    # Accepted because zerotron always behaves this way (documented, not silently ignored):
    "reduce_scatter", "allgather_partitions",
}



def deepspeed_section(section, name: str, known: set[str]) -> dict:
    """A DeepSpeed JSON section checked once: a dict whose keys zerotron knows, else a named error."""
    if not isinstance(section, dict):
        raise ValueError(f"{name} must be a dict of DeepSpeed keys, got {type(section).__name__}")
    unknown = sorted(set(section) - known)
    if unknown:
        raise ValueError(f"{name}.{unknown[0]}: not supported by zerotron; supported keys are {sorted(known)} "
                         f"(remove it or file an issue)")
    return section


def zero_fields_from_deepspeed(ds: dict) -> dict:
    """ZeroConfig fields from a DeepSpeed ``zero_optimization`` dict (or a whole config holding one):
    only the keys present, so the caller decides what they override. Unknown keys are errors."""
    if not isinstance(ds, dict):
        raise ValueError(f"zero_optimization must be a dict, got {type(ds).__name__}")
    zero = deepspeed_section(ds.get("zero_optimization", ds), "zero_optimization", _DS_KEYS)
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
    kw.update(offload_from_deepspeed(zero))
    for key in ("zero_quantized_weights", "zero_quantized_gradients", "zero_hpz_partition_size",
                "zero_quantization_block_size", "zero_quantized_gradients_node_size", "sub_group_size"):
        if key in zero:
            value = zero[key]
            kw[key] = int(value) if isinstance(value, float) and value.is_integer() else value
    return kw


def grad_accum_from_deepspeed(ds: dict) -> dict:
    """``{"grad_accum_dtype": ...}`` from a whole DeepSpeed config's top-level ``data_types`` section
    (``{"data_types": {"grad_accum_dtype": "fp32"}}``); empty when the section or the key is absent
    or null. DeepSpeed's spellings (``float32``, ``torch.bfloat16``, ``half``, ...) are accepted."""
    if not isinstance(ds, dict):
        raise ValueError(f"the DeepSpeed config must be a dict, got {type(ds).__name__}")
    sec = ds.get("data_types")
    if sec is None:
        return {}
    sec = deepspeed_section(sec, "data_types", {"grad_accum_dtype"})
    value = sec.get("grad_accum_dtype")
    if value is None:
        return {}
    name = _DS_DTYPES.get(value.lower()) if isinstance(value, str) else None
    if name is None:
        raise ValueError(f"data_types.grad_accum_dtype={value!r}: use 'fp32', 'bf16' or 'fp16' (or remove it: "
                         f"fp32 for fp16/bf16 runs)")
    return {"grad_accum_dtype": name}


def precision_from_deepspeed(ds: dict) -> dict:
    """The precision and fp16 loss-scaling settings of a whole DeepSpeed config, as keyword arguments
    of ``ZeroOptimizer`` / ``make_loss_scaler``: ``{"precision": "bf16"}``, or for fp16 also
    ``initial_loss_scale`` (2**``initial_scale_power``), ``loss_scale_window``, ``hysteresis`` and
    ``min_loss_scale`` when present. Empty when neither section is enabled (fp32)."""
    kw: dict = {}
    for precision in ("fp16", "bf16"):
        sec = ds.get(precision)
        if sec is None:
            continue
        if not isinstance(sec, dict):
            raise ValueError(f"{precision} must be a dict like {{\"enabled\": true}}, got {type(sec).__name__}")
        if not sec.get("enabled", False):
            continue
        if kw:
            raise ValueError("fp16.enabled and bf16.enabled are both true; enable one of them")
        kw["precision"] = precision
        if precision == "fp16":
            if "initial_scale_power" in sec:
                kw["initial_loss_scale"] = 2.0 ** sec["initial_scale_power"]
            for key in ("loss_scale_window", "hysteresis", "min_loss_scale"):
                if key in sec:
                    kw[key] = sec[key]
    return kw


def offload_from_deepspeed(zero: dict) -> dict:
    """ZeroConfig fields from DeepSpeed's nested ``offload_optimizer`` / ``offload_param`` dicts.

    ``offload_param`` supports device "none" and "nvme" (ZeRO-Infinity, stage 3); "cpu" is refused
    here rather than silently training with the parameters on the accelerator."""
    kw: dict = {}
    par = zero.get("offload_param")
    if par is not None:
        if not isinstance(par, dict):
            raise ValueError("zero_optimization.offload_param must be a dict like {\"device\": \"nvme\", "
                             "\"nvme_path\": \"/local_nvme\"}")
        unknown = sorted(set(par) - {"device", "nvme_path", "buffer_count", "buffer_size", "max_in_cpu", "pin_memory"})
        if unknown:
            raise ValueError(f"zero_optimization.offload_param.{unknown[0]}: not supported; use device, nvme_path, "
                             f"buffer_count (buffer_size/max_in_cpu/pin_memory are accepted and ignored)")
        device = par.get("device", "none") or "none"
        if device not in ("none", "nvme"):
            raise ValueError(f"zero_optimization.offload_param.device={device!r}: use 'none' or 'nvme' (parameter "
                             f"offload to cpu is not implemented in zerotron)")
        kw["offload_param_device"] = device
        for src in ("nvme_path", "buffer_count"):
            if src in par:
                kw[f"offload_param_{src}"] = par[src]
    off = zero.get("offload_optimizer")
    if off is None:
        return kw
    if not isinstance(off, dict):
        raise ValueError("zero_optimization.offload_optimizer must be a dict like {\"device\": \"cpu\"}")
    unknown = sorted(set(off) - {"device", "nvme_path", "buffer_count", "pin_memory", "ratio", "fast_init"})
    if unknown:
        raise ValueError(f"zero_optimization.offload_optimizer.{unknown[0]}: not supported; use device, nvme_path, "
                         f"buffer_count (pin_memory/ratio/fast_init are accepted and ignored)")
    device = off.get("device", "none")
    if device not in ("none", "cpu", "nvme"):
        raise ValueError(f"zero_optimization.offload_optimizer.device={device!r}: use 'none', 'cpu' or 'nvme'")
    kw["offload_optimizer"] = device != "none"
    kw["offload_optimizer_device"] = device
    if "nvme_path" in off:
        kw["offload_optimizer_nvme_path"] = off["nvme_path"]
    if "buffer_count" in off:
        kw["offload_optimizer_buffer_count"] = off["buffer_count"]
    return kw
