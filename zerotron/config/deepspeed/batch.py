"""DeepSpeed's batch triple: ``train_batch_size = train_micro_batch_size_per_gpu x
gradient_accumulation_steps x dp``, any two determining the third (``DeepSpeedConfig.
_set_batch_related_parameters``), a contradiction an error that shows the arithmetic.

``dp`` is the data-parallel size (DeepSpeed's ``world_size`` with an ``mpu``): the world over
``parallel.tp x parallel.cp x parallel.pp``, known only once the command line is read, which is why the triple
is resolved last. ``"auto"`` is the run config's value (the Hugging Face Trainer's convention),
except ``train_batch_size: "auto"`` beside a micro batch and an accumulation count of which one at
least is a number: that is their product with dp, the Trainer's own rule
(``train_batch_size = world_size x micro x gas``), not a global batch that would contradict them.
A field a flag set wins over the triple, with a start-up line saying so.
"""

from __future__ import annotations

from zerotron.config.deepspeed.plan import whole
from zerotron.config.deepspeed.schema import DeepSpeedKeyError

BATCH, MICRO, GA = "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"


def resolve(ds: dict, cfg, dp: int, flagged: set[str]) -> tuple[dict, list[str]]:
    """``{"training.global_batch_size": n, "training.micro_batch_size": m}`` (only what the JSON
    determines) and the start-up lines."""
    t = cfg.training
    lines: list[str] = []
    given = {k: ds[k] for k in (BATCH, MICRO, GA) if k in ds}
    if not given:
        return {}, lines
    run_ga = t.global_batch_size // max(1, t.micro_batch_size * dp)
    sources = {BATCH: ("training.global_batch_size", t.global_batch_size),
               MICRO: ("training.micro_batch_size", t.micro_batch_size),
               GA: ("training.global_batch_size / (micro batch x dp)", run_ga)}
    value = {}
    for key, v in given.items():
        if v == "auto":
            value[key] = sources[key][1]
        else:
            value[key] = whole(key, v, at_least=1)
    hf_rule = given.get(BATCH) == "auto" and MICRO in given and GA in given and not given[MICRO] == given[GA] == "auto"
    if hf_rule:
        value[BATCH] = value[MICRO] * value[GA] * dp
        sources[BATCH] = (f"{MICRO} x {GA} x dp = {value[MICRO]} x {value[GA]} x {dp}, the Hugging Face Trainer's "
                          f"rule", value[BATCH])
    lines += [f"{key}: auto -> {value[key]} ({sources[key][0]})" for key, v in given.items() if v == "auto"]
    batch, micro, ga = value.get(BATCH), value.get(MICRO), value.get(GA)
    if batch is not None and micro is not None and ga is not None:
        pass
    elif batch is not None and micro is not None:
        ga = batch // micro // dp
    elif batch is not None and ga is not None:
        micro = batch // dp // ga
    elif micro is not None and ga is not None:
        batch = micro * ga * dp
    elif batch is not None:
        ga, micro = 1, batch // dp
    elif micro is not None:
        batch, ga = micro * dp, 1
    else:
        raise DeepSpeedKeyError(f"{GA} alone does not determine the batch; give {BATCH} or {MICRO} too "
                                f"(DeepSpeed asks the same)")
    if micro < 1 or ga < 1 or batch != micro * ga * dp:
        raise DeepSpeedKeyError(
            f"{BATCH} != {MICRO} x {GA} x dp: {batch} != {micro} x {ga} x {dp} = {micro * ga * dp} "
            f"(given: {', '.join(f'{k}={given[k]}' for k in given)}; dp = world size / (tp x cp x pp) = {dp}); "
            f"make them agree")
    out, derived = {}, {}
    for target, v in (("training.global_batch_size", batch), ("training.micro_batch_size", micro)):
        if target in flagged:
            lines.append(f"the DeepSpeed batch gives {target}={v}, overridden by the command line: "
                         f"{target}={_get(cfg, target)}")
        else:
            out[target] = v
    derived = {BATCH: batch, MICRO: micro, GA: ga}
    implied = [f"{k}={derived[k]}" for k in (BATCH, MICRO, GA) if k not in given]
    if implied:
        lines.append(f"batch: {', '.join(implied)} (DeepSpeed's rule: {BATCH} = {MICRO} x {GA} x dp, dp={dp})")
    return out, lines


def _get(cfg, target: str):
    section, name = target.split(".")
    return getattr(getattr(cfg, section), name)
