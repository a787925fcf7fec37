"""The DeepSpeed keys DeepSpeed reads through pydantic models, and their declared types.

DeepSpeed validates these sections with pydantic in lax mode (``runtime/zero/config.py``,
``zero/offload_config.py``, ``runtime/precision_config.py``, ``monitor/config.py``,
``runtime/tensor_parallel/config.py``): ``"stage": "2"`` is stage 2, ``"overlap_comm": "true"`` is
true, and an ``Optional`` field set to null is one left out. So the reader coerces exactly these
keys the same way (``schema.coerce``) and no others: the activation-checkpointing section, the
optimizer's and scheduler's params and the top-level scalars DeepSpeed reads as given.
``fp16.min_loss_scale`` (an int there) is read as a number, as zerotron always has.
"""

from __future__ import annotations

import dataclasses

_OFFLOAD = {"nullable": "nvme_path", int: "buffer_count", bool: "pin_memory"}
FIELDS = {  # section path -> {bool / int / float: the keys of that type, "nullable": the Optional ones}
    "zero_optimization": {
        bool: "contiguous_gradients reduce_scatter use_multi_rank_bucket_allreduce allgather_partitions overlap_comm "
              "load_from_fp32_weights elastic_checkpoint cpu_offload_param cpu_offload_use_pin_memory cpu_offload "
              "gather_16bit_weights_on_model_save stage3_gather_16bit_weights_on_model_save "
              "use_all_reduce_for_fetch_params stage3_use_all_reduce_for_fetch_params allgather_sequential "
              "stage3_allgather_sequential stage3_gather_fp16_weights_on_model_save ignore_unused_parameters "
              "legacy_stage1 round_robin_gradients zero_quantized_weights zero_quantized_nontrainable_weights "
              "zero_quantized_gradients mics_hierarchical_params_gather memory_efficient_linear "
              "pipeline_loading_checkpoint override_module_apply log_trace_cache_warnings enable_sanity_checks "
              "save_muon_momentum_buffer_in_memory",
        int: "stage reduce_bucket_size allgather_bucket_size sub_group_size prefetch_bucket_size "
             "stage3_prefetch_bucket_size param_persistence_threshold stage3_param_persistence_threshold "
             "model_persistence_threshold stage3_model_persistence_threshold max_live_parameters "
             "stage3_max_live_parameters max_reuse_distance stage3_max_reuse_distance module_granularity_threshold "
             "stage3_module_granularity_threshold zero_hpz_partition_size mics_shard_size",
        "nullable": "overlap_comm offload_param offload_optimizer zenflow cpu_offload_param cpu_offload_use_pin_memory "
                    "cpu_offload zeropp_loco_param"},
    "zero_optimization.offload_param": {**_OFFLOAD, int: "buffer_count buffer_size max_in_cpu"},
    "zero_optimization.offload_optimizer": {**_OFFLOAD, bool: "pin_memory pipeline_read pipeline_write fast_init "
                                                              "super_offload", float: "ratio cpuadam_cores_perc"},
    "fp16": {bool: "enabled auto_cast consecutive_hysteresis fp16_master_weights_and_grads",
             int: "initial_scale_power loss_scale_window hysteresis", float: "loss_scale min_loss_scale"},
    "bf16": {bool: "enabled immediate_grad_update check_grad_overflow bf16_master_weights_and_grads "
                   "bf16_optimizer_states"},
    "tensorboard": {bool: "enabled"}, "csv_monitor": {bool: "enabled"},
    "wandb": {bool: "enabled", "nullable": "group team"},
    "tensor_parallel": {int: "autotp_size", bool: "tp_overlap_comm keep_module_on_host replace_with_kernel_inject "
                                                  "kernel_inject"},
}


def declare_pydantic_fields(top: dict) -> None:
    """Mark ``top``'s keys (``keys.TOP``) with their pydantic type (``Key.lax``) and ``Optional``
    (``Key.nullable``); ``bfloat16`` shares ``bf16``'s table."""
    for path, kinds in FIELDS.items():
        table = top
        for part in path.split("."):
            table = table[part].keys
        for kind, names in kinds.items():
            for name in names.split():
                change = {"nullable": True} if kind == "nullable" else {"lax": kind}
                table[name] = dataclasses.replace(table[name], **change)
