"""DeepSpeed's ``optimizer``, ``scheduler`` and ``gradient_clipping`` as the trainer's optimizer section.

A present ``optimizer`` / ``scheduler`` section *constructs* a DeepSpeed object, so a parameter it
leaves out takes DeepSpeed's default (FusedAdam: betas (0.9, 0.999), eps 1e-8, weight decay 0;
WarmupLR / WarmupDecayLR: warmup_max_lr 0.001 -- whatever ``optimizer.params.lr`` says, the
warm-up ends there --, warmup_min_lr 0, warmup_num_steps 1000, log warm-up; WarmupCosineLR, which
has no peak of its own, peaks at the optimizer's rate), each printed at start-up. The
schedulers map onto ``optimizer.schedule=deepspeed`` (``zero/lr_schedule.py``), which is
DeepSpeed's arithmetic step for step, including its one-iteration offset. ``"auto"`` takes the
run config's value (the Hugging Face Trainer's convention).
"""

from __future__ import annotations

from zerotron.config.deepspeed.plan import Plan, flag, number, whole
from zerotron.config.deepspeed.schema import DeepSpeedKeyError
from zerotron.zero.lr_schedule import ONE_CYCLE_FIELDS, OTHER_SCHEDULES_FIELDS, field_default

ADAM_DEFAULTS = {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0}  # FusedAdam's
_SCHEDULERS = {  # DeepSpeed's lr_schedules: decay, the parameters each constructor takes, their defaults
    "WarmupLR": ("constant", {"warmup_min_lr": 0.0, "warmup_max_lr": 0.001, "warmup_num_steps": 1000,
                              "warmup_type": "log", "last_batch_iteration": -1}),
    "WarmupDecayLR": ("linear", {"total_num_steps": None, "warmup_min_lr": 0.0, "warmup_max_lr": 0.001,
                                 "warmup_num_steps": 1000, "warmup_type": "log", "last_batch_iteration": -1}),
    "WarmupCosineLR": ("cosine", {"total_num_steps": None, "warmup_min_ratio": 0.0, "warmup_num_steps": 1000,
                                  "cos_min_ratio": 0.0001, "warmup_type": "log", "last_batch_iteration": -1}),
}
_NOT_MAPPED = {"LRRangeTest": "a learning-rate range test is not a training schedule"}
# OneCycle's constructor: DeepSpeed key -> (zerotron field, default; None: required)
_ONE_CYCLE = {"cycle_min_lr": ("warmup_min_lr", None), "cycle_max_lr": ("lr", None),
              "cycle_first_step_size": ("warmup_steps", 2000), "cycle_second_step_size": ("cycle_down_steps", None),
              "decay_lr_rate": ("decay_lr_rate", 0.0), "decay_step_size": ("decay_step_size", 0),
              "cycle_momentum": ("cycle_momentum", True), "cycle_min_mom": ("cycle_min_beta1", 0.8),
              "cycle_max_mom": ("beta1", 0.9), "decay_mom_rate": ("decay_beta1_rate", 0.0)}
_MOMENTUM = ("cycle_min_mom", "cycle_max_mom", "decay_mom_rate")  # read only with cycle_momentum
_STAIRS = ("cycle_first_stair_count", "cycle_second_stair_count")  # no effect (keys.py): OneCycle never reads them


def optimizer(plan: Plan, sec: dict) -> None:
    kind = sec.get("type")
    if not isinstance(kind, str) or kind.lower() not in ("adam", "adamw"):
        raise DeepSpeedKeyError(f"optimizer.type={kind!r}: zerotron trains with Adam or AdamW (its ZeRO "
                                f"optimizer's own); use \"Adam\" or \"AdamW\"")
    params = sec.get("params") or {}
    p = "optimizer.params"
    for key, default in ADAM_DEFAULTS.items():
        value = params.get(key, default)
        path = f"{p}.{key}"
        if key not in params:
            plan.note(f"{path} not given: {default} (DeepSpeed's FusedAdam default)")
        if value == "auto":
            if key == "betas":
                plan.set(path, "optimizer.beta1", lambda cfg: cfg.optimizer.beta1)  # printed once, with beta2
                plan.set(path, "optimizer.beta2", lambda cfg: cfg.optimizer.beta2, auto="optimizer.beta1, "
                         "optimizer.beta2", show=lambda cfg: f"[{cfg.optimizer.beta1}, {cfg.optimizer.beta2}]")
            else:
                plan.set(path, f"optimizer.{key}", lambda cfg, key=key: getattr(cfg.optimizer, key),
                         auto=f"optimizer.{key}")
        elif key == "betas":
            if not (isinstance(value, (list, tuple)) and len(value) == 2):
                raise DeepSpeedKeyError(f"{path}={value!r}: give two numbers, e.g. [0.9, 0.95]")
            plan.set(path, "optimizer.beta1", number(path, value[0]))
            plan.set(path, "optimizer.beta2", number(path, value[1]))
        else:
            plan.set(path, f"optimizer.{key}", number(path, value))
    # DeepSpeed: "Adam" is AdamW unless adam_w_mode is false; "AdamW" always decouples the decay
    w_mode = flag(f"{p}.adam_w_mode", params.get("adam_w_mode", True))
    if kind.lower() == "adamw" and not w_mode:
        plan.note(f"accepted, no effect here: {p}.adam_w_mode=false (DeepSpeed's AdamW decouples weight decay "
                  f"whatever it says; use type Adam for L2)")
        w_mode = True
    plan.set(f"{p}.adam_w_mode" if "adam_w_mode" in params else "optimizer.type", "optimizer.adam_w_mode", w_mode)


def clipping(plan: Plan, ds: dict) -> None:
    if "gradient_clipping" not in ds:
        plan.set("gradient_clipping", "optimizer.clip_grad", lambda cfg: cfg.optimizer.clip_grad)
        plan.note("gradient_clipping not given: optimizer.clip_grad stays the run config's (DeepSpeed's default "
                  "0 would not clip; give gradient_clipping: 0 for that)")
        return
    value = ds["gradient_clipping"]
    if value == "auto":
        plan.set("gradient_clipping", "optimizer.clip_grad", lambda cfg: cfg.optimizer.clip_grad,
                 auto="optimizer.clip_grad")
    else:
        plan.set("gradient_clipping", "optimizer.clip_grad", number("gradient_clipping", value))


def _replace_schedule_fields(plan: Plan, kind: str, names) -> None:
    """DeepSpeed reads only its JSON: its scheduler replaces the run config's fields of the other
    schedule family, which go back to their defaults."""
    for name in names:
        plan.set(f"scheduler.type={kind} (replacing the run config's schedule)", f"optimizer.{name}",
                 lambda cfg, name=name: field_default(cfg.optimizer, name))


def scheduler(plan: Plan, sec: dict) -> None:
    kind = sec.get("type")
    if kind in _NOT_MAPPED:
        raise DeepSpeedKeyError(f"scheduler.type={kind!r} is not implemented: {_NOT_MAPPED[kind]}; use "
                                f"WarmupLR, WarmupDecayLR or WarmupCosineLR")
    if kind == "OneCycle":
        return one_cycle(plan, sec.get("params") or {})
    if kind not in _SCHEDULERS:
        raise DeepSpeedKeyError(f"scheduler.type={kind!r}: use one of {sorted(_SCHEDULERS) + ['OneCycle']}")
    decay, defaults = _SCHEDULERS[kind]
    params = sec.get("params") or {}
    p = "scheduler.params"
    for key in params:
        if key not in defaults:
            raise DeepSpeedKeyError(f"{p}.{key}: {kind} takes no such parameter (DeepSpeed would fail on it); "
                                    f"its parameters are {sorted(defaults)}")
    for key, default in defaults.items():
        if key not in params and default is None and key == "total_num_steps":
            raise DeepSpeedKeyError(f"{p}.total_num_steps is required by {kind}; give the steps of the decay "
                                    f"(or \"auto\": training.train_steps)")
        if key not in params and key != "last_batch_iteration" and default is not None:
            peak = "; the warm-up ends there whatever optimizer.params.lr says" if key == "warmup_max_lr" else ""
            plan.note(f"{p}.{key} not given: {default} ({kind}'s default{peak})")
    value = {k: params.get(k, d) for k, d in defaults.items()}
    plan.set("scheduler.type", "optimizer.schedule", "deepspeed")
    _replace_schedule_fields(plan, kind, ONE_CYCLE_FIELDS)
    plan.set("scheduler.type", "optimizer.decay", decay)
    plan.set(f"{p}.warmup_type", "optimizer.warmup_type", _warmup_type(value["warmup_type"]))
    _steps(plan, value)
    if kind == "WarmupCosineLR":  # ratios of the optimizer's rate, the peak
        for key, target in (("warmup_min_ratio", "warmup_min_lr"), ("cos_min_ratio", "min_lr")):
            ratio = number(f"{p}.{key}", value[key])
            plan.set(f"{p}.{key}", f"optimizer.{target}", lambda cfg, r=ratio: r * cfg.optimizer.lr)
        return
    peak = value["warmup_max_lr"]
    if peak == "auto":
        plan.set(f"{p}.warmup_max_lr", "optimizer.lr", lambda cfg: cfg.optimizer.lr, auto="optimizer.lr")
    else:
        plan.set(f"{p}.warmup_max_lr", "optimizer.lr", number(f"{p}.warmup_max_lr", peak))
    low = value["warmup_min_lr"]
    if low == "auto":  # the Hugging Face Trainer fills 0
        plan.set(f"{p}.warmup_min_lr", "optimizer.warmup_min_lr", 0.0, auto="0, the Hugging Face Trainer's value")
    else:
        plan.set(f"{p}.warmup_min_lr", "optimizer.warmup_min_lr", number(f"{p}.warmup_min_lr", low))
    if decay == "linear":  # WarmupDecayLR decays back to warmup_min_lr
        plan.set(f"{p}.warmup_min_lr", "optimizer.min_lr", lambda cfg: cfg.optimizer.warmup_min_lr)


def one_cycle(plan: Plan, params: dict) -> None:
    """OneCycle onto ``optimizer.schedule=onecycle``. With ``cycle_momentum`` DeepSpeed sets the
    optimizer's betas to ``(momentum, 0.99)`` every step, so beta2 becomes 0.99 here too."""
    p = "scheduler.params"
    for key in params:
        if key not in _ONE_CYCLE and key not in _STAIRS and key != "last_batch_iteration":
            raise DeepSpeedKeyError(f"{p}.{key}: OneCycle takes no such parameter (DeepSpeed would fail on it); its "
                                    f"parameters are {sorted([*_ONE_CYCLE, *_STAIRS, 'last_batch_iteration'])}")
    _fresh_start(params.get("last_batch_iteration", -1))
    plan.set("scheduler.type", "optimizer.schedule", "onecycle")
    _replace_schedule_fields(plan, "OneCycle", OTHER_SCHEDULES_FIELDS)
    momentum = flag(f"{p}.cycle_momentum", params.get("cycle_momentum", True))
    for key, (target, default) in _ONE_CYCLE.items():
        path = f"{p}.{key}"
        if key in _MOMENTUM and not momentum:  # DeepSpeed leaves the optimizer's betas alone then
            if key in params:
                plan.note(f"accepted, no effect here: {path} (cycle_momentum is false, so OneCycle keeps the "
                          f"optimizer's betas)")
            continue
        if key not in params and default is None and key != "cycle_second_step_size":
            raise DeepSpeedKeyError(f"{path} is required by OneCycle (DeepSpeed's constructor has no default)")
        value = params.get(key, default)
        if key not in params and default is not None:
            plan.note(f"{path} not given: {default} (OneCycle's default)")
        if key == "cycle_momentum":
            value = flag(path, value)
        elif key in ("cycle_first_step_size", "cycle_second_step_size", "decay_step_size"):
            value = None if value is None else whole(path, value, 1 if key == "cycle_first_step_size" else 0)
        else:
            value = number(path, value)
        plan.set(path, f"optimizer.{target}", value)
    if momentum:
        plan.set(f"{p}.cycle_momentum", "optimizer.beta2", 0.99)
        plan.note(f"{p}.cycle_momentum: optimizer.beta2 = 0.99, as DeepSpeed's OneCycle sets the betas to "
                  f"(momentum, 0.99) every step")


def _steps(plan: Plan, value: dict) -> None:
    p = "scheduler.params"
    _fresh_start(value["last_batch_iteration"])
    warm = value["warmup_num_steps"]
    if warm == "auto":
        plan.set(f"{p}.warmup_num_steps", "optimizer.warmup_steps", lambda cfg: cfg.optimizer.warmup_steps,
                 auto="optimizer.warmup_steps")
    else:
        # 0 and 1 are DeepSpeed's too: its warm-up schedulers clamp the count to max(2, n), as ours does
        plan.set(f"{p}.warmup_num_steps", "optimizer.warmup_steps", whole(f"{p}.warmup_num_steps", warm, 0))
    if "total_num_steps" in value:
        total = value["total_num_steps"]
        if total == "auto":
            plan.set(f"{p}.total_num_steps", "optimizer.schedule_steps", None,
                     auto="training.train_steps", show=lambda cfg: str(cfg.training.train_steps))
        else:
            plan.set(f"{p}.total_num_steps", "optimizer.schedule_steps", whole(f"{p}.total_num_steps", total, 1))


def _fresh_start(last_batch_iteration) -> None:
    if last_batch_iteration != -1:
        raise DeepSpeedKeyError(f"scheduler.params.last_batch_iteration={last_batch_iteration!r}: a resumed "
                                f"schedule comes from the checkpoint's step; remove it")


def _warmup_type(value) -> str:
    if value not in ("log", "linear"):  # DeepSpeed warns and falls back to log; a typo should not train
        raise DeepSpeedKeyError(f"scheduler.params.warmup_type={value!r}: use \"log\" or \"linear\"")
    return value
