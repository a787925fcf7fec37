"""``pretrain_gpt.py --help``, generated from the config tree: every ``--section.field`` with its
type, default, choices and one line of help.

Names, types and defaults are read from the dataclasses themselves (``RunConfig`` and the library
sections it holds), so --help cannot drift from what the parser accepts; only the one-line
descriptions live here, in ``HELP``, and ``tests/training/test_config_help.py`` fails when a field
has none. A ``model`` field's default is "the preset's": the tiny preset's value is shown with it.
"""

from __future__ import annotations

import dataclasses
import textwrap
import typing
from typing import Any

from zerotron.model.presets import PRESETS
from zerotron.parallel.pipeline import SCHEDULES
from zerotron.zero.config import GRAD_ACCUM_DTYPES, PRECISIONS

CHOICES: dict[str, tuple] = {
    "model.preset": tuple(PRESETS),
    "model.gelu_approximate": ("tanh", "none"),
    "model.position_embedding_type": ("learned", "rope"),
    "model.normalization": ("LayerNorm", "RMSNorm"),
    "model.activation": ("gelu", "swiglu"),
    "parallel.pipeline_schedule": SCHEDULES,
    "zero.stage": (0, 1, 2, 3),
    "zero.offload_optimizer_device": ("none", "cpu", "nvme"),
    "zero.offload_param_device": ("none", "cpu", "nvme"),
    "zero.grad_accum_dtype": GRAD_ACCUM_DTYPES,
    "training.precision": PRECISIONS,
    "optimizer.decay": ("cosine", "linear", "constant"),
    "optimizer.schedule": ("megatron", "deepspeed", "onecycle"),
    "optimizer.warmup_type": ("linear", "log"),
    "activation_checkpointing.recompute_granularity": ("full", "selective"),
    "activation_checkpointing.sequence_parallel_gather": ("keep", "regather"),
    "logging.wandb_mode": ("offline", "online", "disabled"),
}

HELP: dict[str, str] = {
    "model.preset": "named shape to start from (tiny for CPU; the papers' shapes, listed at the end)",
    "model.num_layers": "transformer blocks",
    "model.hidden_size": "hidden size h",
    "model.num_heads": "attention heads (divisible by parallel.tp)",
    "model.vocab_size": "vocabulary; null: the tokenizer's (padded at run time for TP)",
    "model.seq_length": "tokens per sample",
    "model.dropout": "hidden/residual and embedding dropout",
    "model.attention_dropout": "dropout on attention probabilities",
    "model.make_vocab_size_divisible_by": "pad the vocabulary to a multiple of this x tp (Megatron: 128)",
    "model.init_std": "std of the normal weight init (GPT-2: 0.02)",
    "model.layernorm_eps": "LayerNorm epsilon",
    "model.ffn_hidden_size": "MLP width; null: 4 x hidden_size",
    "model.max_position_embeddings": "position table size; null: seq_length",
    "model.gelu_approximate": "GeLU form: tanh (GPT-2's gelu_new) or none (erf)",
    "model.position_embedding_type": "learned (GPT-2's table) or rope (rotary, the Llama family)",
    "model.rotary_base": "RoPE's theta (Llama-3: 500000; Qwen2.5, Mistral: 1e6)",
    "model.rope_scaling": "Llama-3.1's RoPE frequency scaling, with the rope_scaling_* fields",
    "model.rope_scaling_factor": "how much long wavelengths are stretched (Llama-3.1: 8, 3.2: 32)",
    "model.rope_scaling_low_freq_factor": "Llama-3.1's low-frequency factor (1)",
    "model.rope_scaling_high_freq_factor": "Llama-3.1's high-frequency factor (4)",
    "model.rope_scaling_original_max_position_embeddings": "the context RoPE was trained at (8192)",
    "model.normalization": "LayerNorm (GPT-2) or RMSNorm (Llama); epsilon: layernorm_eps",
    "model.activation": "gelu, or swiglu: down(silu(gate(x)) * up(x)) of width ffn_hidden_size",
    "model.num_query_groups": "K/V heads of grouped-query attention (divisible by tp); null: num_heads",
    "model.add_bias_linear": "biases in every linear layer (GPT-2: true, Llama: false)",
    "model.add_qkv_bias": "q/k/v biases when add_bias_linear is false (Qwen2)",
    "model.untie_embeddings_and_output_weights": "the output layer its own weight, vocab-parallel",
    "model.qk_layernorm": "normalise each head's q and k before RoPE (Qwen3)",
    "model.reset_attention_mask": "document masking: attention never crosses an end-of-document token",
    "model.reset_position_ids": "positions restart after each end-of-document token",
    "model.eod_token_id": "end-of-document token for document masking; null: the tokenizer's",
    "parallel.tp": "tensor-parallel size (Megatron; keep it inside a node)",
    "parallel.pp": "pipeline-parallel stages",
    "parallel.dp": "data-parallel size; null or -1: world / (tp x cp x pp)",
    "parallel.cp": "context-parallel size: each sequence split over cp ranks, ring attention; 1: none",
    "parallel.pipeline_schedule": "1f1b (PipeDream-Flush) or afab (all forward, all backward)",
    "parallel.sequence_parallel": "split LayerNorm/dropout/residual along the sequence over TP (tp > 1)",
    "parallel.virtual_stages": "model chunks per pipeline rank: > 1 is interleaved 1F1B (pp >= 2); 1: none",
    "zero.stage": "ZeRO-DP stage: 0 plain DP, 1 Pos, 2 Pos+g, 3 Pos+g+p",
    "zero.overlap_comm": "overlap gradient reduction with backward (two buckets in flight)",
    "zero.contiguous_gradients": "stages 0-1: gradients as views of one flat buffer (MD)",
    "zero.reduce_bucket_size": "elements per gradient reduction bucket (CB)",
    "zero.allgather_bucket_size": "elements per parameter all-gather bucket (CB)",
    "zero.stage3_prefetch_bucket_size": "stage 3: elements gathered or in flight ahead of the "
                                        "running unit (unset: one unit ahead; 0: none)",
    "zero.stage3_param_persistence_threshold": "stage 3: parameters this small stay unpartitioned",
    "zero.stage3_max_live_parameters": "stage 3: cap on gathered elements kept for reuse or prefetched",
    "zero.stage3_max_reuse_distance": "stage 3: keep a unit gathered if reused within this many elements",
    "zero.offload_optimizer": "ZeRO-Offload: fp32 optimizer state and step on the CPU (stage >= 1)",
    "zero.zero_quantized_weights": "ZeRO++ qwZ: int8 stage-3 parameter all-gathers",
    "zero.zero_quantized_gradients": "ZeRO++ qgZ: int8 hierarchical gradient reduce-scatter",
    "zero.zero_hpz_partition_size": "ZeRO++ hpZ: ranks of the secondary parameter partition (a node)",
    "zero.zero_quantization_block_size": "elements per quantization block (qwZ, qgZ)",
    "zero.zero_quantized_gradients_node_size": "qgZ node size; 0: zero_hpz_partition_size",
    "zero.offload_optimizer_device": "where optimizer state lives; none: follows offload_optimizer",
    "zero.offload_optimizer_nvme_path": "ZeRO-Infinity: directory for the optimizer-state files",
    "zero.offload_optimizer_buffer_count": "ZeRO-Infinity: optimizer tiles in memory at once",
    "zero.sub_group_size": "ZeRO-Infinity: elements per optimizer tile",
    "zero.offload_param_device": "stage 3: the parameter partition in host memory (cpu) or a file (nvme)",
    "zero.offload_param_nvme_path": "directory for the parameter-partition files",
    "zero.offload_param_buffer_count": "parameter shards in memory at once (read-ahead)",
    "zero.grad_accum_dtype": "gradient accumulation/reduction dtype; null: fp32 for 16-bit runs",
    "activation_checkpointing.checkpoint_activations": "keep only chunk inputs, recompute in backward",
    "activation_checkpointing.checkpoint_every": "transformer layers per checkpoint",
    "activation_checkpointing.partition_activations": "Pa: each TP rank keeps 1/tp of every checkpoint",
    "activation_checkpointing.cpu_checkpointing": "checkpoints in host memory (Pa+cpu with Pa)",
    "activation_checkpointing.contiguous_memory_optimization": "MD: checkpoints in one pre-allocated buffer",
    "activation_checkpointing.number_checkpoints": "slots of the MD buffer; null: one per chunk",
    "activation_checkpointing.synchronize_checkpoint_boundary": "device synchronize per chunk (debugging)",
    "activation_checkpointing.recompute_granularity": "full: checkpointed chunks; selective: every layer's attention core",
    "activation_checkpointing.sequence_parallel_gather": "SP recompute: keep the gathered GEMM inputs, or regather (Megatron)",
    "data.data_path": "token-file prefixes (.bin/.idx), comma-separated; empty: the built-in corpus",
    "data.data_weights": "sampling weight per data_path entry; empty: by size",
    "data.eval_path": "token-file prefixes for evaluation",
    "data.tokenizer": "sentencepiece .model or Hugging Face tokenizer directory the token files "
                      "were made with; without data.data_path: the built-in corpus is encoded "
                      "with it",
    "data.cache_dir": "built-in corpus and sample-index cache",
    "data.default_corpus_vocab": "vocabulary of the built-in corpus's tokenizer",
    "data.prefetch": "steps of micro-batches read ahead by a background thread; 0: none",
    "optimizer.lr": "peak learning rate",
    "optimizer.min_lr": "learning rate at the end of decay",
    "optimizer.warmup_steps": "warm-up steps (onecycle: the rise from warmup_min_lr to lr)",
    "optimizer.decay": "learning-rate decay after warm-up",
    "optimizer.weight_decay": "AdamW decoupled weight decay (not on biases and LayerNorms)",
    "optimizer.beta1": "Adam beta1",
    "optimizer.beta2": "Adam beta2",
    "optimizer.eps": "Adam epsilon",
    "optimizer.clip_grad": "global gradient-norm clip; 0: off",
    "optimizer.initial_loss_scale": "fp16: starting dynamic loss scale",
    "optimizer.loss_scale_window": "fp16: overflow-free steps before the scale doubles",
    "optimizer.hysteresis": "fp16: overflows tolerated before the scale halves",
    "optimizer.min_loss_scale": "fp16: lowest loss scale",
    "optimizer.loss_scale": "fp16: > 0 a static loss scale; 0 dynamic",
    "optimizer.consecutive_hysteresis": "fp16: every clean step restores the hysteresis budget",
    "optimizer.adam_w_mode": "AdamW (decoupled decay); false: Adam with L2 decay in the gradient",
    "optimizer.schedule": "learning-rate schedule family: megatron, deepspeed's lr_schedules, or its onecycle",
    "optimizer.warmup_min_lr": "learning rate the warm-up starts from",
    "optimizer.warmup_type": "warm-up shape (deepspeed schedule only)",
    "optimizer.schedule_steps": "step where the decay ends; null: training.train_steps",
    "optimizer.cycle_down_steps": "onecycle: steps of the fall from lr back to warmup_min_lr; null: warmup_steps",
    "optimizer.decay_lr_rate": "onecycle: after the cycle, warmup_min_lr / (1 + rate x steps / decay_step_size)",
    "optimizer.decay_step_size": "onecycle: steps per decay interval after the cycle; 0: no decay",
    "optimizer.cycle_momentum": "onecycle: beta1 cycles inversely to the rate, from beta1 to cycle_min_beta1",
    "optimizer.cycle_min_beta1": "onecycle: the cycle's lowest beta1 (beta1 is its highest)",
    "optimizer.decay_beta1_rate": "onecycle: after the cycle, beta1 x (1 + rate x steps / decay_step_size)",
    "training.train_steps": "optimizer steps (global batches) of the whole run (0: with "
                            "checkpoint.init_from_hf, import and save)",
    "training.micro_batch_size": "samples per rank per forward/backward",
    "training.global_batch_size": "samples per optimizer step (micro_batch_size x dp x accumulation)",
    "training.precision": "parameters' precision; 16-bit keeps fp32 masters; fp64 is the tests' reference",
    "training.seed": "seed of init, dropout and data order",
    "training.compile": "torch.compile each transformer block's forward (inductor); hooks stay eager",
    "training.skip_memory_check": "start although the memory model predicts that a rank cannot "
                                  "hold the run (the start-up fit check, training/fit_check.py)",
    "logging.run_dir": "metrics.jsonl, config.yaml, wandb and tensorboard files",
    "logging.log_interval": "steps per console/metrics line",
    "logging.eval_interval": "steps between evaluations; 0: none",
    "logging.eval_steps": "global batches per evaluation",
    "logging.wandb_mode": "offline: files under run_dir (wandb sync uploads); online needs an account",
    "logging.wandb_project": "wandb project name",
    "logging.peak_tflops": "per-device peak TFLOP/s for MFU; null: from the device table",
    "logging.wall_clock_breakdown": "forward/backward/step seconds in each record (synchronizes the device)",
    "logging.tensorboard": "also write TensorBoard event files to run_dir/tensorboard",
    "logging.profile_steps": "[A, B]: a torch.profiler trace of steps A to B in run_dir/profile",
    "logging.straggler_factor": "at each log step, name a rank whose own compute time a step "
                                "exceeds this x the median; 0: off",
    "checkpoint.save": "checkpoint directory ({run_dir} = logging.run_dir); null: none",
    "checkpoint.save_interval": "steps between checkpoints; 0: only at the end and on SIGTERM",
    "checkpoint.load": "auto: this run's newest in save; a directory; none: from scratch",
    "checkpoint.keep_last": "this run's checkpoints kept",
    "checkpoint.fallback": "newest checkpoint corrupt: load the newest intact earlier one",
    "checkpoint.consolidated_16bit": "each checkpoint also holds consolidated.safetensors (working dtype)",
    "checkpoint.override_schedule": "resume although lr schedule, global batch or seed differ",
    "checkpoint.async_save": "copy the shard to host memory, write it on a thread as training goes on",
    "checkpoint.init_from_hf": "a transformers Llama/Mistral/Qwen2/GPT-2 directory: its architecture "
                               "and weights start the run (optimizer fresh; a resumable checkpoint "
                               "wins); docs/huggingface.md",
}


def config_fields(cfg=None) -> list[tuple[str, Any, Any]]:
    """``(section.field, type, default)`` of every field of the run config tree, in its order."""
    if cfg is None:
        from zerotron.config.run_config import RunConfig

        cfg = RunConfig()
    out = []
    for section in dataclasses.fields(cfg):
        sec = getattr(cfg, section.name)
        hints = typing.get_type_hints(type(sec))
        out += [(f"{section.name}.{f.name}", hints[f.name], getattr(sec, f.name)) for f in dataclasses.fields(sec)]
    return out


def type_name(tp: Any) -> str:
    """``int``, ``float?`` (null allowed), ``list[str]`` ..."""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if type(None) in typing.get_args(tp):
        return type_name(args[0]) + "?"
    if typing.get_origin(tp) is list:
        return f"list[{type_name(typing.get_args(tp)[0])}]"
    return getattr(tp, "__name__", str(tp))


def _default(key: str, value: Any) -> str:
    if key == "model.vocab_size":
        return "null (the tokenizer's vocabulary)"
    if key.startswith("model.") and key != "model.preset" and value is None:
        tiny = getattr(PRESETS["tiny"], key.split(".", 1)[1], None)
        return f"the preset's (tiny: {_show(tiny)})"
    return _show(value)


def _show(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return ",".join(map(str, value)) or "[]"
    if isinstance(value, float) and value.is_integer() and abs(value) >= 1e4:
        return f"{value:.0f}"
    return str(value)


def describe(key: str, tp: Any, default: Any) -> str:
    """``TYPE, default D[, one of ...]: help`` for one field (also the help of its short flag)."""
    choices = CHOICES.get(key)
    text = f"{type_name(tp)}, default {_default(key, default)}"
    if choices and key != "model.preset":
        text += f", one of {'|'.join(map(str, choices))}"
    return f"{text}: {HELP.get(key, '(undocumented)')}"


def short_flag_help(section: str, name: str, switch: bool = False) -> str:
    """Help of a short flag: the field it sets, then the field's description; ``switch``: a flag
    that takes no value and sets the boolean field to true."""
    key = f"{section}.{name}"
    tp, default = next((t, d) for k, t, d in config_fields() if k == key)
    return f"{'sets ' if switch else ''}--{key}{' true' if switch else ''} ({describe(key, tp, default)})"


def epilog(exit_codes: str = "") -> str:
    """Every config field, section by section, then ``exit_codes``."""
    lines = ["config fields: --section.field VALUE (or --section.field=VALUE) on the command line, or",
             "'section: {field: value}' in the --config YAML; flags win over the YAML, and the defaults",
             "below are the built-in ones a YAML replaces. Lists are comma-separated; null/none clears",
             "an optional (TYPE?) field.", ""]
    section = None
    for key, tp, default in config_fields():
        if key.split(".")[0] != section:
            section = key.split(".")[0]
            lines.append(f"{section}:")
        lines.append(f"  --{key}")
        lines.append(f"      {describe(key, tp, default)}")
    lines += textwrap.wrap(f"model.preset is one of: {', '.join(PRESETS)}", 100, subsequent_indent="  ", break_on_hyphens=False)
    if exit_codes:
        lines += ["", exit_codes]
    return "\n".join(lines)
