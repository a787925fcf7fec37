"""DeepSpeed's ``zero_optimization``, ``fp16``/``bf16``, ``activation_checkpointing``,
``data_types``, monitor and AutoTP sections as assignments to the run config (``plan.Plan``).

The keys' *status* is ``keys.py``'s; this module turns the honoured and mapped ones into zerotron
fields, with DeepSpeed's reading of them: ``overlap_comm`` absent at stage 3 is true (DeepSpeed's
stage-dependent default; so are the two ``stage3_max_*`` keys, 1e9), ``cpu_offload`` is the older spelling of ``offload_optimizer: cpu``, a
present ``activation_checkpointing`` section turns checkpointing on, ``"enabled": "auto"`` follows
``training.precision``, and ``fp16.loss_scale > 0`` is a static scale. A stage or precision the
JSON leaves out stays the run config's, said at start-up where DeepSpeed's default (stage 0, fp32)
differs -- the convention of a missing ``gradient_clipping``.
"""

from __future__ import annotations

from typing import Callable

from zerotron.model.presets import get_preset
from zerotron.config.deepspeed.plan import Plan, flag, get, number, whole
from zerotron.config.deepspeed.schema import DeepSpeedKeyError

DTYPES = {"fp32": "fp32", "float32": "fp32", "float": "fp32", "torch.float32": "fp32",
          "bf16": "bf16", "bfloat16": "bf16", "torch.bfloat16": "bf16",
          "fp16": "fp16", "float16": "fp16", "half": "fp16", "torch.float16": "fp16"}
_ALIASES = (("stage3_prefetch_bucket_size", "prefetch_bucket_size"),
            ("stage3_param_persistence_threshold", "param_persistence_threshold"),
            ("stage3_max_live_parameters", "max_live_parameters"),
            ("stage3_max_reuse_distance", "max_reuse_distance"))
_STAGE3_DEFAULTS = {"stage3_max_live_parameters": int(1e9), "stage3_max_reuse_distance": int(1e9)}
_SAME = ("reduce_bucket_size", "allgather_bucket_size", "sub_group_size", "zero_hpz_partition_size",
         "zero_quantization_block_size", "zero_quantized_gradients_node_size")
_BOOLS = ("contiguous_gradients", "overlap_comm", "zero_quantized_weights", "zero_quantized_gradients")


def hidden_size(cfg) -> int:
    return cfg.model.hidden_size or get_preset(cfg.model.preset).hidden_size


def one_of(z: dict, names: tuple, where: str) -> tuple[str, object] | None:
    """The one spelling of a key that ``z`` gives (DeepSpeed aliases), or an error if it gives two."""
    given = [n for n in names if n in z]
    if len({repr(z[n]) for n in given}) > 1:
        raise DeepSpeedKeyError(f"{where}.{given[0]} and {where}.{given[1]} are the same key with different "
                                f"values; give one")
    return (given[0], z[given[0]]) if given else None


def zero(plan: Plan, z: dict | None) -> None:
    """``z`` None: no ``zero_optimization`` section, whose stage DeepSpeed would take as 0."""
    p = "zero_optimization"
    if z is None or "stage" not in z:
        what = f"{p}.stage" if z is not None else p
        plan.note(lambda cfg: _kept_stage(cfg, what), unless_flagged="zero.stage")
    if z is None:
        return
    if "stage" in z:
        plan.set(f"{p}.stage", "zero.stage", whole(f"{p}.stage", z["stage"]))
    for key in _BOOLS:
        if key in z:
            plan.set(f"{p}.{key}", f"zero.{key}", flag(f"{p}.{key}", z[key]))
    if "overlap_comm" not in z and z.get("stage") == 3:
        plan.set(f"{p}.overlap_comm", "zero.overlap_comm", True)
        plan.note(f"{p}.overlap_comm not given: true at stage 3, DeepSpeed's default there")
    h_rules = {"reduce_bucket_size": (lambda h: h * h, "hidden size squared"),
               "stage3_prefetch_bucket_size": (lambda h: int(0.9 * h * h), "0.9 x hidden size squared"),
               "stage3_param_persistence_threshold": (lambda h: 10 * h, "10 x hidden size")}
    for key in _SAME + tuple(a[0] for a in _ALIASES):
        names = next((a for a in _ALIASES if a[0] == key), (key,))
        found = one_of(z, names, p)
        if found is None:
            if key in _STAGE3_DEFAULTS and z.get("stage") == 3:  # unless a flag sets another stage
                plan.set(f"{p}.{key}", f"zero.{key}", lambda cfg, k=key: _STAGE3_DEFAULTS[k] if cfg.zero.stage == 3
                         else get(cfg, f"zero.{k}"))
                plan.note(lambda cfg, k=key: f"{p}.{k} not given: {_STAGE3_DEFAULTS[k]:.0e}, DeepSpeed's default"
                          if cfg.zero.stage == 3 else None)
            continue
        name, value = found
        if value == "auto":  # the Hugging Face Trainer's rule, from the model's hidden size
            rule, words = h_rules[key]
            plan.set(f"{p}.{name}", f"zero.{key}", lambda cfg, rule=rule: rule(hidden_size(cfg)),
                     auto=f"{words}, the Hugging Face Trainer's rule")
        else:
            plan.set(f"{p}.{name}", f"zero.{key}", whole(f"{p}.{name}", value))
    _offload(plan, z, p)
    found = one_of(z, ("stage3_gather_16bit_weights_on_model_save", "gather_16bit_weights_on_model_save",
                       "stage3_gather_fp16_weights_on_model_save"), p)
    if found is not None:
        plan.set(f"{p}.{found[0]}", "checkpoint.consolidated_16bit", flag(f"{p}.{found[0]}", found[1]))


def _kept_stage(cfg, what: str) -> str | None:
    if cfg.zero.stage == 0:
        return None
    return (f"{what} not given: zero.stage stays the run config's {cfg.zero.stage} (DeepSpeed's default 0 would "
            f"not partition; give \"stage\": 0 for that)")


def _offload(plan: Plan, z: dict, p: str) -> None:
    for old, new, target in (("cpu_offload", "offload_optimizer", "optimizer"),
                             ("cpu_offload_param", "offload_param", "param")):
        if old in z and z.get(new) is not None:
            raise DeepSpeedKeyError(f"{p}.{old} and {p}.{new} both given; {old} is the older spelling of "
                                    f"{new}: {{\"device\": \"cpu\"}} -- give one")
        if old in z:
            device = "cpu" if flag(f"{p}.{old}", z[old]) else "none"
            _device(plan, f"{p}.{old}", target, device)
    for section, target in (("offload_optimizer", "optimizer"), ("offload_param", "param")):
        sub = z.get(section)
        if sub is None:
            continue
        where = f"{p}.{section}"
        _device(plan, f"{where}.device", target, sub.get("device", "none"))
        if "nvme_path" in sub:
            plan.set(f"{where}.nvme_path", f"zero.{section}_nvme_path", sub["nvme_path"])
        if "buffer_count" in sub:
            plan.set(f"{where}.buffer_count", f"zero.{section}_buffer_count",
                     whole(f"{where}.buffer_count", sub["buffer_count"]))


def _device(plan: Plan, path: str, what: str, device) -> None:
    device = "none" if device is None else device
    if device not in ("none", "cpu", "nvme"):
        raise DeepSpeedKeyError(f"{path}={device!r}: use \"none\", \"cpu\" or \"nvme\"")
    if what == "optimizer":
        plan.set(path, "zero.offload_optimizer", device != "none")
    plan.set(path, f"zero.offload_{what}_device", device)


_ZEROPP = "DeepSpeed runs ZeRO++ (qwZ, hpZ, qgZ) at stage 3 only"
# field (prefix) -> (its main field, whether that asks anything of stage 3, why it does nothing below)
_STAGE3_ONLY = {"zero.offload_param_": ("offload_param_device", lambda v: v != "none",
                                        "DeepSpeed offloads parameters at stage 3 only"),
                "zero.zero_quantized_weights": ("zero_quantized_weights", bool, _ZEROPP),
                "zero.zero_hpz_partition_size": ("zero_hpz_partition_size", lambda v: v > 1, _ZEROPP),
                "zero.zero_quantized_gradients": ("zero_quantized_gradients", bool, _ZEROPP)}


def stage3_only_below_stage3(cfg, set_field: Callable, origins: dict) -> list[str]:
    """DeepSpeed reads ``offload_param`` and the ZeRO++ keys only at stage 3 (``stage_1_and_2.py``
    never looks at them), so a JSON's values for them at stage 0-2 go back to the run config's
    defaults with an ``accepted, no effect here`` line, instead of being refused (qwZ, hpZ) or
    quantizing stage-2 gradients (qgZ) as zerotron's own ``zero.*`` fields would."""
    from zerotron.zero.config import ZeroConfig

    if cfg.zero.stage == 3:
        return []
    lines = []
    for prefix, (main, asks, why) in _STAGE3_ONLY.items():
        set_here = [t for t in origins if t.startswith(prefix)]
        if not set_here:
            continue
        key = origins.get(f"zero.{main}", origins[set_here[0]])  # as the JSON spells it
        asked = asks(getattr(cfg.zero, main))  # {"device": "none"}, false, hpZ 0 or 1: nothing was asked
        for target in set_here:
            name = target.split(".")[1]
            set_field(cfg, "zero", name, getattr(ZeroConfig(), name))
            del origins[target]
        if asked:
            lines.append(f"accepted, no effect here: {key} ({why}: zero.stage={cfg.zero.stage})")
    return lines


def precision(plan: Plan, ds: dict) -> None:
    """``fp16`` / ``bf16`` (or its older name ``bfloat16``): the precision and fp16's loss scaling."""
    if "bf16" in ds and "bfloat16" in ds:
        raise DeepSpeedKeyError("bf16 and bfloat16 are the same section (bfloat16 is the older name); give one")
    sections = {"fp16": ds.get("fp16"), "bf16": ds.get("bf16", ds.get("bfloat16"))}
    enabled = {k: (s or {}).get("enabled", False) for k, s in sections.items()}
    for k, v in enabled.items():
        if v != "auto":
            flag(f"{k}.enabled", v)
    if enabled["fp16"] is True and enabled["bf16"] is True:
        raise DeepSpeedKeyError("fp16.enabled and bf16.enabled are both true; enable one of them "
                                "(DeepSpeed refuses both too)")
    on = next((k for k, v in enabled.items() if v is True), None)
    off = [k for k, s in sections.items() if s is not None and enabled[k] is False]
    if on is not None:
        plan.set(f"{on}.enabled", "training.precision", on)
    elif off:  # DeepSpeed would train this in fp32
        plan.set(" and ".join(f"{k}.enabled=false" for k in off), "training.precision",
                 lambda cfg: "fp32" if cfg.training.precision in off else cfg.training.precision)
    for k, v in enabled.items():
        if v == "auto":
            plan.set(f"{k}.enabled", "training.precision", lambda cfg: cfg.training.precision,
                     auto="training.precision={}", show=lambda cfg, k=k: str(cfg.training.precision == k).lower())
    if on is None and "auto" not in enabled.values():
        plan.note(_kept_precision, unless_flagged="training.precision")
    bf16 = sections["bf16"] or {}
    if "check_grad_overflow" in bf16:
        plan.note(lambda cfg, v=bf16["check_grad_overflow"]: _overflow_line(cfg, v))
    fp16 = sections["fp16"] or {}
    _loss_scaling(plan, fp16)


def _overflow_line(cfg, check: bool) -> str:
    """zerotron never skips a bf16 step: a non-finite gradient norm reaches the weights and the trainer
    stops the run at its next finiteness check. DeepSpeed's ``true`` (its default) skips the step
    and trains on; ``false`` applies it and trains on."""
    key = f"bf16.check_grad_overflow={str(check).lower()}"
    if cfg.training.precision != "bf16":
        return f"accepted, no effect here: {key} (not a bf16 run: training.precision={cfg.training.precision})"
    deepspeed = "instead of skipping the step as DeepSpeed does" if check else "where DeepSpeed would apply the step " \
        "and train on"
    return (f"{key}: a non-finite bf16 gradient norm stops the run at zerotron's next check (each log interval and "
            f"checkpoint), {deepspeed}")


def _kept_precision(cfg) -> str | None:
    """With no section enabled, DeepSpeed trains in fp32; a run config's 16-bit (or fp64) precision
    stays, said. (A present ``"enabled": false`` for it already made it fp32.)"""
    p = cfg.training.precision
    if p == "fp32":
        return None
    what, fix = (p, f'give "{p}": {{"enabled": false}}') if p in ("fp16", "bf16") else \
        ("fp16 / bf16", "pass --precision fp32")
    return (f"{what} not given: training.precision stays the run config's {p} (DeepSpeed's default would train in "
            f"fp32; {fix} for that)")


def _loss_scaling(plan: Plan, fp16: dict) -> None:
    p = "fp16"
    static = number(f"{p}.loss_scale", fp16.get("loss_scale", 0))
    if "loss_scale" in fp16:
        plan.set(f"{p}.loss_scale", "optimizer.loss_scale", static)
    if static > 0:  # a static scale is its own floor (min <= initial must hold)
        plan.set(f"{p}.loss_scale", "optimizer.initial_loss_scale", static)
        plan.set(f"{p}.loss_scale", "optimizer.min_loss_scale", static)
        for key in ("initial_scale_power", "loss_scale_window", "hysteresis", "consecutive_hysteresis",
                    "min_loss_scale"):
            if key in fp16:
                plan.note(f"accepted, no effect here: {p}.{key} (fp16.loss_scale={static:g} is static)")
        return
    if "initial_scale_power" in fp16:
        power = whole(f"{p}.initial_scale_power", fp16["initial_scale_power"])
        plan.set(f"{p}.initial_scale_power", "optimizer.initial_loss_scale", 2.0 ** power)
    for key, target in (("loss_scale_window", "loss_scale_window"), ("hysteresis", "hysteresis")):
        if key in fp16:
            plan.set(f"{p}.{key}", f"optimizer.{target}", whole(f"{p}.{key}", fp16[key], at_least=1))
    if "min_loss_scale" in fp16:
        plan.set(f"{p}.min_loss_scale", "optimizer.min_loss_scale",
                 number(f"{p}.min_loss_scale", fp16["min_loss_scale"]))
    if "consecutive_hysteresis" in fp16:
        plan.set(f"{p}.consecutive_hysteresis", "optimizer.consecutive_hysteresis",
                 flag(f"{p}.consecutive_hysteresis", fp16["consecutive_hysteresis"]))


def activation(plan: Plan, section: dict) -> None:
    """DeepSpeed reads this section as given (``get_scalar_param``, no pydantic), so a string where a
    switch belongs is refused: ``"false"`` would be a true value there."""
    p = "activation_checkpointing"
    plan.set(p, f"{p}.checkpoint_activations", True)
    for key in ("partition_activations", "cpu_checkpointing", "contiguous_memory_optimization",
                "synchronize_checkpoint_boundary"):
        if key in section:
            flag(f"{p}.{key}", section[key])
    md = section.get("contiguous_memory_optimization", False)
    for key, value in section.items():
        if key == "number_checkpoints" and not md:  # DeepSpeed reads the count only for that buffer
            if value not in (None, False, 0):
                plan.note(f"accepted, no effect here: {p}.number_checkpoints (it sizes the contiguous "
                          f"checkpoint buffer, which {p}.contiguous_memory_optimization leaves off)")
            continue
        if key != "profile":
            plan.set(f"{p}.{key}", f"{p}.{key}", value)


def data_types(plan: Plan, ds: dict) -> None:
    """``data_types.grad_accum_dtype`` and ``communication_data_type``: zerotron accumulates and
    reduces gradients in one dtype, so a communication dtype is that dtype."""
    sec = ds.get("data_types") or {}
    accum = _dtype("data_types.grad_accum_dtype", sec.get("grad_accum_dtype"))
    comm = _dtype("communication_data_type", ds.get("communication_data_type"))
    if accum is not None and comm is not None and accum != comm:
        raise DeepSpeedKeyError(f"data_types.grad_accum_dtype={accum} and communication_data_type={comm}: zerotron "
                                f"reduces gradients in the dtype it accumulates them in; give one dtype")
    for path, value in (("data_types.grad_accum_dtype", accum), ("communication_data_type", comm)):
        if value is not None:
            plan.set(path, "zero.grad_accum_dtype", value)
    param = _dtype("data_types.param_dtype", sec.get("param_dtype"))
    if param is not None:
        plan.set("data_types.param_dtype", "training.precision", lambda cfg: _same_dtype(cfg, param))


def _same_dtype(cfg, param: str) -> str:
    if cfg.training.precision != param:
        raise DeepSpeedKeyError(f"data_types.param_dtype={param} but the run trains in training.precision="
                                f"{cfg.training.precision}; make them agree (or enable fp16 / bf16)")
    return param


def _dtype(path: str, value) -> str | None:
    if value is None:
        return None
    name = DTYPES.get(value.lower()) if isinstance(value, str) else None
    if name is None:
        raise DeepSpeedKeyError(f"{path}={value!r}: use \"fp32\", \"bf16\" or \"fp16\" (or remove it)")
    return name


def monitors(plan: Plan, ds: dict) -> None:
    if "steps_per_print" in ds:
        plan.set("steps_per_print", "logging.log_interval", whole("steps_per_print", ds["steps_per_print"], 1))
    if "wall_clock_breakdown" in ds:
        plan.set("wall_clock_breakdown", "logging.wall_clock_breakdown",
                 flag("wall_clock_breakdown", ds["wall_clock_breakdown"]))
    tb = ds.get("tensorboard") or {}
    if "enabled" in tb:
        plan.set("tensorboard.enabled", "logging.tensorboard", flag("tensorboard.enabled", tb["enabled"]))
    wb = ds.get("wandb") or {}
    if "enabled" in wb:
        on = flag("wandb.enabled", wb["enabled"])
        plan.set("wandb.enabled", "logging.wandb_mode", "online" if on else "disabled")
    if "project" in wb:
        plan.set("wandb.project", "logging.wandb_project", wb["project"])
    csv = ds.get("csv_monitor") or {}
    if flag("csv_monitor.enabled", csv.get("enabled", False)):
        plan.note("csv_monitor.enabled: the records DeepSpeed's CSV monitor writes (loss, lr, loss scale per "
                  "step) go to logging.run_dir/metrics.jsonl as JSON lines")


def tensor_parallel(plan: Plan, sec: dict) -> None:
    found = one_of(sec, ("autotp_size", "tp_size"), "tensor_parallel")
    size = whole(f"tensor_parallel.{found[0]}", found[1]) if found is not None else 0
    if size > 0:  # 0: AutoTP off, the run config's parallel.tp stands
        plan.set(f"tensor_parallel.{found[0]}", "parallel.tp", size)
