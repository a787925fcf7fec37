"""Every key of DeepSpeed's config JSON (``deepspeed/runtime/config.py``, ``runtime/zero/config.py``,
``runtime/zero/offload_config.py``, ``runtime/precision_config.py``, ``monitor/config.py``, the
config-json docs) and what it is to zerotron: the one table the reader, the start-up notes and
the manual's key table (docs/deepspeed.md) are made from (``schema.py``). Where a value is
mapped, ``mapping.py`` / ``optim.py`` / ``batch.py`` do it; this file only says what happens and why.
"""

from __future__ import annotations

from zerotron.config.deepspeed.pydantic_fields import declare_pydantic_fields
from zerotron.config.deepspeed.schema import (HONOURED as H, MAPPED as M, NO_EFFECT as N, REFUSED as R, Key,
                                                refuse_enabled, refuse_true, refuse_unless)

_IMPL = "an implementation detail of DeepSpeed's own kernels or engine"
_OFF = "disabled, so nothing to do"
_ALWAYS_PIN = "zerotron pins host buffers whenever the accelerator is CUDA"

OFFLOAD_PARAM = {
    "device": Key(H, "zero.offload_param_device: none | cpu (pinned host partition, gathered per unit) | nvme"),
    "nvme_path": Key(H, "zero.offload_param_nvme_path"),
    "buffer_count": Key(H, "zero.offload_param_buffer_count (NVMe read-ahead / write-behind slots)"),
    "buffer_size": Key(N, "zerotron sizes each NVMe buffer to the largest stage-3 unit it reads"),
    "max_in_cpu": Key(N, "zerotron keeps no host cache of NVMe parameters beyond its buffers"),
    "pin_memory": Key(N, _ALWAYS_PIN),
}
OFFLOAD_OPTIMIZER = {
    "device": Key(H, "zero.offload_optimizer_device: none | cpu (ZeRO-Offload) | nvme (ZeRO-Infinity)"),
    "nvme_path": Key(H, "zero.offload_optimizer_nvme_path"),
    "buffer_count": Key(H, "zero.offload_optimizer_buffer_count"),
    "pin_memory": Key(N, _ALWAYS_PIN),
    "pipeline_read": Key(N, "zerotron's NVMe tier always reads the next tile ahead"),
    "pipeline_write": Key(N, "zerotron's NVMe tier always writes the last tile behind"),
    "fast_init": Key(N, "zerotron writes the NVMe files once, at construction"),
    "ratio": Key(H, "1.0: the whole optimizer state is offloaded", refused_when="below 1.0",
                 refuse=lambda v: None if v == 1 else "partial optimizer offload is not implemented; use 1.0 "
                                                      "(all of it) or device none"),
    "super_offload": Key(N, _OFF, refuse=refuse_true("SuperOffload is not implemented; remove it"),
                         refused_when="when true"),
    "cpuadam_cores_perc": Key(N, "zerotron's host AdamW uses torch's intra-op threads"),
}
ZERO = {
    "stage": Key(H, "zero.stage: 0, 1 (Pos), 2 (Pos+g), 3 (Pos+g+p)"),
    "contiguous_gradients": Key(H, "zero.contiguous_gradients (MD)"),
    "reduce_scatter": Key(N, "zerotron always reduce-scatters (ZeRO §7); false would all-reduce the same "
                             "gradients"),
    "reduce_bucket_size": Key(H, "zero.reduce_bucket_size (CB); 0: one parameter at a time, the largest "
                                 "parameter bounds the bucket", auto=True),
    "use_multi_rank_bucket_allreduce": Key(N, _IMPL),
    "allgather_partitions": Key(N, "zerotron always all-gathers the updated partitions; false would broadcast "
                                   "the same values"),
    "allgather_bucket_size": Key(H, "zero.allgather_bucket_size (CB); 0 as for reduce_bucket_size"),
    "overlap_comm": Key(H, "zero.overlap_comm; absent at stage 3: true, DeepSpeed's stage-dependent default"),
    "load_from_fp32_weights": Key(N, "zerotron checkpoints always hold and load the fp32 master"),
    "elastic_checkpoint": Key(N, "zerotron checkpoints load into any layout anyway"),
    "offload_param": Key(H, "stage-3 parameter partition on the host or NVMe; below stage 3, as in DeepSpeed, "
                            "accepted with no effect", keys=OFFLOAD_PARAM),
    "offload_optimizer": Key(H, "optimizer state on the host or NVMe", keys=OFFLOAD_OPTIMIZER),
    "zenflow": Key(N, _OFF, refuse=lambda v: "ZenFlow is not implemented; remove it" if v else None,
                   refused_when="when set"),
    "sub_group_size": Key(H, "zero.sub_group_size: the tile of the NVMe optimizer step (no effect unless the "
                             "optimizer is on NVMe); 0: the largest parameter's partition, as DeepSpeed's one "
                             "parameter per sub-group"),
    "cpu_offload": Key(M, "true: zero.offload_optimizer_device=cpu (DeepSpeed's older spelling)"),
    "cpu_offload_param": Key(M, "true: zero.offload_param_device=cpu (DeepSpeed's older spelling)"),
    "cpu_offload_use_pin_memory": Key(N, _ALWAYS_PIN),
    "prefetch_bucket_size": Key(H, "zero.stage3_prefetch_bucket_size (0: no prefetch)", auto=True),
    "stage3_prefetch_bucket_size": Key(H, "zero.stage3_prefetch_bucket_size (0: no prefetch, nor NVMe read-ahead)",
                                       auto=True),
    "param_persistence_threshold": Key(H, "zero.stage3_param_persistence_threshold", auto=True),
    "stage3_param_persistence_threshold": Key(H, "zero.stage3_param_persistence_threshold", auto=True),
    "model_persistence_threshold": Key(N, "zerotron puts no total cap on persistent parameters"),
    "stage3_model_persistence_threshold": Key(N, "zerotron puts no total cap on persistent parameters"),
    "max_live_parameters": Key(H, "zero.stage3_max_live_parameters: gathered elements kept for reuse or "
                                  "prefetched at most; absent: 1e9, DeepSpeed's default"),
    "stage3_max_live_parameters": Key(H, "zero.stage3_max_live_parameters; absent: 1e9, DeepSpeed's default"),
    "max_reuse_distance": Key(H, "zero.stage3_max_reuse_distance: a unit reused within this many elements "
                                 "stays gathered; absent: 1e9, DeepSpeed's default"),
    "stage3_max_reuse_distance": Key(H, "zero.stage3_max_reuse_distance; absent: 1e9, DeepSpeed's default"),
    "gather_16bit_weights_on_model_save": Key(M, "checkpoint.consolidated_16bit: each checkpoint also holds "
                                                 "consolidated.safetensors, the model in its working dtype"),
    "stage3_gather_16bit_weights_on_model_save": Key(M, "checkpoint.consolidated_16bit: each checkpoint also "
                                                        "holds consolidated.safetensors"),
    "stage3_gather_fp16_weights_on_model_save": Key(M, "checkpoint.consolidated_16bit (the older name)"),
    "module_granularity_threshold": Key(N, "zerotron's stage-3 units are the transformer blocks"),
    "stage3_module_granularity_threshold": Key(N, "zerotron's stage-3 units are the transformer blocks"),
    "use_all_reduce_for_fetch_params": Key(N, "zerotron gathers with all-gather; the parameters are the same"),
    "stage3_use_all_reduce_for_fetch_params": Key(N, "zerotron gathers with all-gather; the parameters are the "
                                                     "same"),
    "allgather_sequential": Key(N, _IMPL),
    "stage3_allgather_sequential": Key(N, _IMPL),
    "ignore_unused_parameters": Key(N, "the GPT has no unused parameters"),
    "legacy_stage1": Key(N, "zerotron has one stage-1 implementation"),
    "round_robin_gradients": Key(N, "an ordering of DeepSpeed's CPU-offload gradient copies"),
    "zero_hpz_partition_size": Key(H, "zero.zero_hpz_partition_size (ZeRO++ hpZ; 0 or 1: off); stage 3 only, as "
                                      "in DeepSpeed: below it, accepted with no effect"),
    "zero_quantized_weights": Key(H, "zero.zero_quantized_weights (ZeRO++ qwZ); stage 3 only, as in DeepSpeed"),
    "zero_quantized_nontrainable_weights": Key(N, "the GPT has no frozen weights"),
    "zero_quantized_gradients": Key(H, "zero.zero_quantized_gradients (ZeRO++ qgZ); stage 3 only, as in DeepSpeed "
                                       "(zerotron's own zero.zero_quantized_gradients also runs at stages 1-2)"),
    "zero_quantization_block_size": Key(H, "zerotron's own key: zero.zero_quantization_block_size"),
    "zero_quantized_gradients_node_size": Key(H, "zerotron's own key: zero.zero_quantized_gradients_node_size"),
    "zeropp_loco_param": Key(N, _OFF, refuse=lambda v: "LoCo error feedback is not implemented; remove it"
                             if v else None, refused_when="when set"),
    "mics_shard_size": Key(N, _OFF, refuse=lambda v: "MiCS is not implemented; use -1 (off)" if v not in
                           (-1, None) else None, refused_when="when > 0"),
    "mics_hierarchical_params_gather": Key(N, _OFF, refuse=refuse_true("MiCS is not implemented"),
                                           refused_when="when true"),
    "memory_efficient_linear": Key(N, _IMPL),
    "pipeline_loading_checkpoint": Key(N, "zerotron loads checkpoints shard by shard anyway"),
    "override_module_apply": Key(N, _IMPL),
    "log_trace_cache_warnings": Key(N, _IMPL),
    "enable_sanity_checks": Key(N, _IMPL),
    "save_muon_momentum_buffer_in_memory": Key(N, "zerotron has no Muon optimizer"),
    "leaf_module": Key(N, "zerotron's stage-3 units are the transformer blocks", loose=True),
}
FP16 = {
    "enabled": Key(H, "training.precision=fp16; \"auto\": training.precision", auto=True),
    "auto_cast": Key(N, "the GPT's inputs are token ids, nothing to cast"),
    "loss_scale": Key(H, "0: dynamic scaling; > 0: optimizer.loss_scale, a static scale (overflowed steps "
                         "are still skipped, as DeepSpeed does)"),
    "initial_scale_power": Key(H, "optimizer.initial_loss_scale = 2**power"),
    "loss_scale_window": Key(H, "optimizer.loss_scale_window (the scale doubles after that many clean steps, "
                                "Megatron's count: one step before DeepSpeed's)"),
    "hysteresis": Key(H, "optimizer.hysteresis"),
    "consecutive_hysteresis": Key(H, "optimizer.consecutive_hysteresis"),
    "min_loss_scale": Key(H, "optimizer.min_loss_scale"),
    "fp16_master_weights_and_grads": Key(N, _OFF, refuse=refuse_true("zerotron keeps fp32 master weights; "
                                                                      "remove it"), refused_when="when true"),
}
BF16 = {
    "enabled": Key(H, "training.precision=bf16; \"auto\": training.precision", auto=True),
    "immediate_grad_update": Key(N, _IMPL),
    "check_grad_overflow": Key(M, "whatever its value, a non-finite bf16 gradient norm stops the run at zerotron's "
                                  "next check (each log interval, each checkpoint); DeepSpeed's true, its default, "
                                  "skips the step instead, false applies it"),
    "bf16_master_weights_and_grads": Key(N, _OFF, refuse=refuse_true("zerotron keeps fp32 master weights"),
                                         refused_when="when true"),
    "bf16_optimizer_states": Key(N, _OFF, refuse=refuse_true("zerotron keeps fp32 Adam moments"),
                                 refused_when="when true"),
}
OPTIMIZER_PARAMS = {
    "lr": Key(H, "optimizer.lr (the peak rate; under WarmupLR / WarmupDecayLR their warmup_max_lr wins, "
                 "0.001 when not given, as in DeepSpeed)", auto=True),
    "betas": Key(H, "optimizer.beta1, optimizer.beta2", auto=True),
    "eps": Key(H, "optimizer.eps", auto=True),
    "weight_decay": Key(H, "optimizer.weight_decay (on matrices, not biases and norms: the grouping Megatron "
                           "and the Hugging Face Trainer pass DeepSpeed)", auto=True),
    "torch_adam": Key(N, "zerotron's AdamW is torch.optim.AdamW's arithmetic whichever kernel runs"),
    "adam_w_mode": Key(H, "optimizer.adam_w_mode (false: L2 weight decay through the moments)"),
    "bias_correction": Key(H, "true", refuse=lambda v: None if v is True else "Adam without bias correction is "
                           "not implemented; remove it", refused_when="when false"),
    "amsgrad": Key(H, "false", refuse=lambda v: "AMSGrad is not implemented (DeepSpeed's FusedAdam refuses it "
                   "too)" if v else None, refused_when="when true"),
    "max_grad_norm": Key(R, "DeepSpeed refuses it too: use the top-level gradient_clipping",
                         refuse=lambda v: "not an optimizer parameter (DeepSpeed refuses it too); use the "
                                          "top-level gradient_clipping"),
}
SCHEDULER_PARAMS = {name: Key(M, "see scheduler", auto=True) for name in (
    "warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "total_num_steps")}
SCHEDULER_PARAMS.update({
    "warmup_type": Key(M, "optimizer.warmup_type (log, DeepSpeed's default, or linear)"),
    "warmup_min_ratio": Key(M, "WarmupCosineLR: optimizer.warmup_min_lr = ratio * lr"),
    "cos_min_ratio": Key(M, "WarmupCosineLR: optimizer.min_lr = ratio * lr"),
    "cycle_min_lr": Key(M, "OneCycle: optimizer.warmup_min_lr (the cycle's bottom)"),
    "cycle_max_lr": Key(M, "OneCycle: optimizer.lr (the cycle's top)"),
    "cycle_first_step_size": Key(M, "OneCycle: optimizer.warmup_steps (the rise)"),
    "cycle_second_step_size": Key(M, "OneCycle: optimizer.cycle_down_steps (the fall)"),
    "decay_lr_rate": Key(M, "OneCycle: optimizer.decay_lr_rate"),
    "decay_step_size": Key(M, "OneCycle: optimizer.decay_step_size"),
    "cycle_momentum": Key(M, "OneCycle: optimizer.cycle_momentum (and beta2 = 0.99, as DeepSpeed sets it)"),
    "cycle_min_mom": Key(M, "OneCycle: optimizer.cycle_min_beta1"),
    "cycle_max_mom": Key(M, "OneCycle: optimizer.beta1 (the cycle's top momentum)"),
    "decay_mom_rate": Key(M, "OneCycle: optimizer.decay_beta1_rate"),
    "cycle_first_stair_count": Key(N, "DeepSpeed's OneCycle stores it and never reads it"),
    "cycle_second_stair_count": Key(N, "DeepSpeed's OneCycle stores it and never reads it"),
    "last_batch_iteration": Key(H, "-1", refuse=refuse_unless((-1,), "a resumed schedule comes from the "
                                "checkpoint's step; remove it"), refused_when="unless -1"),
})
ACTIVATION = {
    "partition_activations": Key(H, "activation_checkpointing.partition_activations (Pa)"),
    "cpu_checkpointing": Key(H, "activation_checkpointing.cpu_checkpointing (Pa+cpu)"),
    "contiguous_memory_optimization": Key(H, "activation_checkpointing.contiguous_memory_optimization (MD)"),
    "number_checkpoints": Key(H, "activation_checkpointing.number_checkpoints: every slot of the MD buffer, "
                                 "over all forwards in flight (DeepSpeed's counts one forward); too few for a "
                                 "pipeline rank is refused at start-up"),
    "synchronize_checkpoint_boundary": Key(H, "activation_checkpointing.synchronize_checkpoint_boundary"),
    "profile": Key(N, "zerotron times whole steps (logging.wall_clock_breakdown), not checkpoints"),
}
MONITOR = {"enabled": Key(M, "see the section"), "output_path": Key(N, "zerotron writes under logging.run_dir"),
           "job_name": Key(N, "zerotron names the run after logging.run_dir")}
WANDB = {"enabled": Key(M, "true: logging.wandb_mode=online (offline without an account); false: disabled"),
         "project": Key(H, "logging.wandb_project"),
         "group": Key(N, "zerotron does not group wandb runs"), "team": Key(N, "wandb's default entity is used")}
DATA_TYPES = {
    "grad_accum_dtype": Key(H, "zero.grad_accum_dtype (fp32 by default for 16-bit runs; DeepSpeed's default is "
                               "the model dtype)"),
    "param_dtype": Key(H, "must be training.precision's dtype"),
    "buffer_dtype": Key(N, "the GPT has no buffers"),
}
TENSOR_PARALLEL = {"autotp_size": Key(M, "parallel.tp (zerotron's GPT is tensor-parallel by construction)"),
                   "tp_size": Key(M, "parallel.tp"), "tp": Key(N, "inference settings", loose=True)}
TENSOR_PARALLEL.update({k: Key(N, "AutoTP's layer matching; zerotron's layers are its own") for k in (
    "tp_grain_size", "dtype", "tp_overlap_comm", "injection_policy_tuple", "partition_config", "preset_model",
    "keep_module_on_host", "replace_with_kernel_inject", "kernel_inject")})

_NOT_HERE = "not implemented in zerotron"
TOP = {
    "train_batch_size": Key(H, "training.global_batch_size; with the other two: batch = micro x GA x dp; \"auto\" "
                               "beside a numeric micro batch or GA: micro x GA x dp (the HF Trainer's rule)",
                            auto=True),
    "train_micro_batch_size_per_gpu": Key(H, "training.micro_batch_size", auto=True),
    "gradient_accumulation_steps": Key(H, "training.global_batch_size / (micro batch x dp)", auto=True),
    "gradient_clipping": Key(H, "optimizer.clip_grad (0: none)", auto=True),
    "optimizer": Key(H, "type Adam / AdamW: zerotron's AdamW", keys={
        "type": Key(H, "Adam (adam_w_mode true unless false) or AdamW"),
        "params": Key(H, "see below", keys=OPTIMIZER_PARAMS), "legacy_fusion": Key(N, _IMPL)}),
    "scheduler": Key(M, "optimizer.schedule=deepspeed: WarmupLR / WarmupDecayLR / WarmupCosineLR step for step; "
                        "optimizer.schedule=onecycle: OneCycle",
                     keys={"type": Key(M, "WarmupLR: decay constant; WarmupDecayLR: linear; WarmupCosineLR: cosine; "
                                          "OneCycle: onecycle (LRRangeTest refused)"),
                           "params": Key(M, "warmup_max_lr: optimizer.lr (not given: 0.001, DeepSpeed's default), "
                                            "warmup_num_steps: optimizer.warmup_steps,"
                                            " total_num_steps: optimizer.schedule_steps, warmup_min_lr: "
                                            "optimizer.warmup_min_lr (and min_lr)", keys=SCHEDULER_PARAMS)}),
    "fp16": Key(H, "training.precision=fp16 and its loss scaling", keys=FP16),
    "bf16": Key(H, "training.precision=bf16", keys=BF16),
    "bfloat16": Key(H, "the older name of bf16", keys=BF16),
    "zero_optimization": Key(H, "the zero section (ZeroConfig); true / false, DeepSpeed's deprecated spelling: "
                                "stage 1 / 0", keys=ZERO),
    "allgather_size": Key(M, "with \"zero_optimization\": true, zero.allgather_bucket_size (DeepSpeed reads it "
                             "nowhere else)"),
    "activation_checkpointing": Key(H, "the section's presence turns checkpointing on (DeepSpeed's users "
                                       "checkpoint when they configure it)", keys=ACTIVATION),
    "data_types": Key(H, "see below", keys=DATA_TYPES),
    "communication_data_type": Key(M, "zero.grad_accum_dtype: zerotron reduces gradients in the dtype it "
                                      "accumulates them in"),
    "steps_per_print": Key(M, "logging.log_interval"),
    "wall_clock_breakdown": Key(M, "logging.wall_clock_breakdown: forward / backward / step seconds in each "
                                   "metrics record"),
    "tensorboard": Key(M, "enabled: logging.tensorboard (under logging.run_dir)", keys=MONITOR),
    "wandb": Key(M, "the wandb logging", keys=WANDB),
    "csv_monitor": Key(M, "enabled: the same records go to logging.run_dir/metrics.jsonl (JSON lines)", keys=MONITOR),
    "comet": Key(N, "zerotron logs to metrics.jsonl, wandb and TensorBoard", loose=True),
    "comms_logger": Key(N, "zerotron logs communication bytes per group in every metrics record", loose=True),
    "flops_profiler": Key(N, "zerotron logs TFLOP/s and MFU in every metrics record", loose=True),
    "memory_breakdown": Key(N, "zerotron measures memory by category once per log interval anyway"),
    "autotuning": Key(N, "zerotron does not autotune; scripts/estimate_memory.py sizes a run", loose=True),
    "elasticity": Key(N, _OFF, loose=True, refuse=refuse_enabled("elastic training is " + _NOT_HERE),
                      refused_when="when enabled"),
    "tensor_parallel": Key(M, "AutoTP: zerotron's tensor parallelism", keys=TENSOR_PARALLEL),
    "pipeline": Key(N, "zerotron's pipeline is parallel.pp and parallel.pipeline_schedule", loose=True),
    "checkpoint": Key(N, "zerotron checkpoints are verified on every rank and load into any layout", loose=True),
    "aio": Key(N, "zerotron's NVMe tier has its own reader / writer threads", loose=True),
    "nebula": Key(N, "an engine saving through Azure's Nebula service; zerotron writes its own atomic "
                     "checkpoints (in the background with checkpoint.async_save, which this does not set)",
                  loose=True),
    "datastates": Key(N, "DeepSpeed's asynchronous checkpoint engine (the DataStates-LLM library); "
                         "zerotron's is checkpoint.async_save, which this does not set", loose=True),
    "compile": Key(N, _OFF, loose=True, refuse=lambda v: "DeepCompile is " + _NOT_HERE if isinstance(v, dict)
                   and v.get("deepcompile") else None, refused_when="with deepcompile true"),
    "timers": Key(N, "zerotron times every step (step_time_s in the metrics)", loose=True),
    "amp": Key(N, _OFF, loose=True, refuse=refuse_enabled("apex AMP is not used; use fp16 or bf16"),
               refused_when="when enabled"),
    "torch_autocast": Key(N, _OFF, loose=True, refuse=refuse_enabled("autocast is not used: the model runs in "
                          "training.precision; use fp16 or bf16"), refused_when="when enabled"),
    "prescale_gradients": Key(N, "zerotron averages gradients over DP in zero.grad_accum_dtype, where "
                                 "pre-dividing changes nothing"),
    "gradient_predivide_factor": Key(N, "zerotron averages gradients over DP in zero.grad_accum_dtype, where "
                                        "pre-dividing changes nothing"),
    "gradient_allreduce_op": Key(H, "mean", refuse=refuse_unless(("mean",), "zerotron averages gradients over "
                                 "DP; use \"mean\""), refused_when="unless \"mean\""),
    "sparse_gradients": Key(N, "the GPT's embedding gradients are dense"),
    "disable_allgather": Key(N, "a DeepSpeed debugging switch"),
    "seq_parallel_communication_data_type": Key(N, "zerotron has no Ulysses sequence parallelism"),
    "sequence_parallel_size": Key(N, "1: no sequence parallelism, nothing to do", refuse=lambda v: "Ulysses sequence parallelism is " + _NOT_HERE
                                  if v not in (1, None) else None, refused_when="when > 1"),
    "zero_allow_untested_optimizer": Key(N, "zerotron's ZeRO runs only its own AdamW"),
    "zero_force_ds_cpu_optimizer": Key(N, "ZeRO-Offload always steps zerotron's AdamW on the host"),
    "dump_state": Key(N, "a DeepSpeed engine debug print"),
    "dataloader_drop_last": Key(N, "zerotron's sampler only yields whole global batches"),
    "log_level": Key(N, "zerotron prints its own start-up lines and metrics"),
    "vocabulary_size": Key(N, "DeepSpeed only warns with it; the vocabulary is the tokenizer's"),
    "graph_harvesting": Key(N, _IMPL),
    "managed_gradient_accumulation": Key(N, "zerotron's trainer owns the accumulation boundary"),
    "use_data_before_expert_parallelism": Key(N, "zerotron has no expert parallelism"),
    "expert_parallel": Key(R, "mixture of experts is " + _NOT_HERE, loose=True,
                           refuse=lambda v: "mixture of experts is " + _NOT_HERE),
    "hybrid_engine": Key(N, _OFF, loose=True, refuse=refuse_enabled("the RLHF hybrid engine is " + _NOT_HERE),
                         refused_when="when enabled"),
    "sparse_attention": Key(R, "sparse attention is " + _NOT_HERE, loose=True,
                            refuse=lambda v: "sparse attention is " + _NOT_HERE),
    "curriculum_learning": Key(N, _OFF, loose=True, refuse=refuse_enabled("curriculum learning is " + _NOT_HERE),
                               refused_when="when enabled"),
    "data_efficiency": Key(N, _OFF, loose=True, refuse=refuse_enabled("data efficiency (sampling, routing) is "
                           + _NOT_HERE), refused_when="when enabled"),
    "eigenvalue": Key(N, _OFF, loose=True, refuse=refuse_enabled("eigenvalue tracking is " + _NOT_HERE),
                      refused_when="when enabled"),
    "progressive_layer_drop": Key(N, _OFF, loose=True, refuse=refuse_enabled("progressive layer drop is "
                                  + _NOT_HERE), refused_when="when enabled"),
    "quantize_training": Key(N, _OFF, loose=True, refuse=refuse_enabled("MoQ quantized training is " + _NOT_HERE),
                             refused_when="when enabled"),
    "compression_training": Key(N, _OFF, loose=True, refuse=refuse_enabled("compression (pruning, quantization,"
                                " layer reduction) is " + _NOT_HERE), refused_when="when any part is enabled"),
    "weight_quantization": Key(R, "inference weight quantization is " + _NOT_HERE, loose=True,
                               refuse=lambda v: "inference weight quantization is " + _NOT_HERE),
}


declare_pydantic_fields(TOP)
