"""Settings that do nothing in the run they are set in, said at start-up.

A tuning value for a feature that is off -- a loss-scale window in a bf16 run, a stage-3 prefetch
size at stage 2, a save interval with no checkpoint directory -- is harmless and common (one
YAML serves many runs; ``--save none`` should not need ``--save-interval 0`` too), so refusing it
would be hostile; but a user who set it believes it acted. DeepSpeed and Megatron accept such
values in silence. zerotron accepts them and says so, once, on rank 0, before any process group:
``no effect here: zero.stage3_max_live_parameters=5 (stage-3 parameter partitioning is off: zero.stage=2)``.
A switch turned *on* under a feature that is off (Pa without checkpointing) is a contradiction
instead, and the section's own ``validate`` refuses it.
"""

from __future__ import annotations

from typing import Any, Callable

from zerotron.config.fields import section_fields

# (field, True when the field acts in this run, why it does not otherwise)
Rule = tuple[str, Callable[[Any], bool], Callable[[Any], str]]

_STAGE3 = ("stage3_prefetch_bucket_size", "stage3_param_persistence_threshold", "stage3_max_live_parameters",
           "stage3_max_reuse_distance")
_LOSS_SCALING = ("initial_loss_scale", "loss_scale_window", "hysteresis", "min_loss_scale", "loss_scale",
                 "consecutive_hysteresis")
_NO_HELD_OUT = "there is no held-out data: data.data_path is set without data.eval_path"


def _held_out(c) -> bool:
    """Evaluation has data: the built-in corpus's held-out split, or ``data.eval_path``."""
    return not c.data.data_path or bool(c.data.eval_path)


def _rules() -> list[Rule]:
    rules: list[Rule] = []
    rules += [(f"zero.{k}", lambda c: c.zero.stage == 3,
               lambda c: f"stage-3 parameter partitioning is off: zero.stage={c.zero.stage}") for k in _STAGE3]
    rules += [(f"zero.{k}", lambda c: c.zero.offload_optimizer_device == "nvme",
               lambda c: f"the optimizer is not on NVMe: zero.offload_optimizer_device="
                         f"{c.zero.offload_optimizer_device}")
              for k in ("offload_optimizer_nvme_path", "offload_optimizer_buffer_count", "sub_group_size")]
    rules += [(f"zero.{k}", lambda c: c.zero.offload_param_device == "nvme",
               lambda c: f"parameters are not on NVMe: zero.offload_param_device={c.zero.offload_param_device}")
              for k in ("offload_param_nvme_path", "offload_param_buffer_count")]
    rules += [("zero.zero_quantization_block_size",
               lambda c: c.zero.zero_quantized_weights or c.zero.zero_quantized_gradients,
               lambda c: "neither qwZ nor qgZ is on (zero.zero_quantized_weights / zero_quantized_gradients)"),
              ("zero.zero_quantized_gradients_node_size", lambda c: c.zero.zero_quantized_gradients,
               lambda c: "qgZ is off: zero.zero_quantized_gradients=false"),
              ("zero.contiguous_gradients", lambda c: c.zero.stage <= 1,
               lambda c: f"stages 2-3 always reduce into the contiguous gradient partition: zero.stage="
                         f"{c.zero.stage}")]
    rules += [(f"optimizer.{k}", lambda c: c.training.precision == "fp16",
               lambda c: f"loss scaling is fp16's: training.precision={c.training.precision}") for k in _LOSS_SCALING]
    rules += [("optimizer.min_lr", lambda c: c.optimizer.decay != "constant",  # OneCycle refuses it instead
               lambda c: "the rate does not decay: optimizer.decay=constant")]
    rules += [("parallel.pipeline_schedule", lambda c: c.parallel.pp > 1,
               lambda c: "there is no pipeline: parallel.pp=1"),
              ("activation_checkpointing.checkpoint_every", lambda c: c.activation_checkpointing.checkpoint_activations,
               lambda c: "activation checkpointing is off: activation_checkpointing.checkpoint_activations=false"),
              ("logging.eval_interval", lambda c: c.logging.eval_interval <= 0 or _held_out(c),  # 0: off, as it is
               lambda c: _NO_HELD_OUT),
              ("logging.eval_steps", lambda c: c.logging.eval_interval > 0 and _held_out(c),
               lambda c: "evaluation is off: logging.eval_interval=0" if c.logging.eval_interval <= 0
               else _NO_HELD_OUT)]
    rules += [("data.default_corpus_vocab", lambda c: not (c.data.data_path or c.data.tokenizer),
               lambda c: "data.data_path replaces the built-in corpus; model.vocab_size sizes the model"
               if c.data.data_path else "the built-in corpus is encoded with data.tokenizer, "
               "whose vocabulary it keeps")]
    rules += [(f"checkpoint.{k}", lambda c: bool(c.checkpoint.save),
               lambda c: "no checkpoint is written: checkpoint.save is unset")
              for k in ("save_interval", "keep_last", "async_save")]
    rules += [(f"checkpoint.{k}", lambda c: c.checkpoint.load is not None,
               lambda c: "nothing is loaded: checkpoint.load=none") for k in ("fallback", "override_schedule")]
    return rules


RULES = _rules()


def no_effect(cfg) -> list[str]:
    """One line per field set away from its default that does nothing in ``cfg`` (validated)."""
    lines = []
    for target, acts, why in RULES:
        section_name, name = target.split(".")
        section = getattr(cfg, section_name)
        value = getattr(section, name)
        declared = section_fields(type(section), section_name)[name].default  # the field's own
        if value != declared and not acts(cfg):
            lines.append(f"no effect here: {target}={value!r} ({why(cfg)})")
    return lines
