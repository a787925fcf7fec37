"""ZeRO-DP settings: one validated dataclass, its fields named after DeepSpeed's ``zero_optimization`` keys
(a DeepSpeed JSON is read by ``zerotron.config.deepspeed``, the one reader).

The stages are the paper's cumulative partitions (ZeRO §5): 0 = plain data parallelism,
1 = Pos (optimizer states), 2 = Pos+g (+ gradients), 3 = Pos+g+p (+ parameters). Bucket sizes are
ZeRO-R's constant buffers (CB, §6.2): they bound the temporary buffers whatever the model size.
``contiguous_gradients`` is MD (§6.3): gradients live in one pre-allocated flat buffer.

ZeRO++ (arXiv 2306.10209) keys cut the communication of Pos+g+p: ``zero_quantized_weights`` (qwZ:
int8 block-quantized parameter all-gather), ``zero_hpz_partition_size`` (hpZ: a secondary parameter
partition inside a node so the backward all-gather never leaves it) and ``zero_quantized_gradients``
(qgZ: int8 hierarchical all-to-all reduce-scatter). ZeRO-Infinity (arXiv 2104.07857) keys put the
optimizer state on NVMe: ``offload_optimizer_device="nvme"`` with its ``nvme_path`` and
``buffer_count``, the step done in ``sub_group_size`` tiles; ``offload_param_device="nvme"`` puts the
stage-3 parameter partition there too (read per unit just before its all-gather), and
``offload_param_device="cpu"`` in host memory (``host_params``).

``grad_accum_dtype`` is the dtype gradients are accumulated over micro-batches, reduced over DP
and held in (the flat buffer, the buckets, the Pos+g partition): fp32 by default for 16-bit runs,
like Megatron-LM's fp32 ``main_grad`` and DeepSpeed's ``data_types.grad_accum_dtype`` -- summing
bf16 gradients in bf16 loses ~0.2% at 2 micro-batches and ~0.65% at 16. It costs 4 bytes of
gradient per parameter instead of 2 (split by Nd from stage 2 on, ZeRO §5.2). One exception:
stages 0-1 with ``contiguous_gradients: false`` (no flat buffer to accumulate into, the Megatron
baselines' "no MD") leave the micro-batches' sum in autograd's ``.grad``, in the parameters'
dtype, until the last one; it is converted to ``grad_accum_dtype`` when it is reduced.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

# The choices, declared once as types: validate() reads them here, the run config's --help, choice
# checks and CLI coercion read them from the fields (zerotron/config/fields.py).
# fp64 runs parameters, masters, moments and reductions in float64: the reference tier of the
# parity tests (float64 against float64 leaves no round-off to hide a bug behind); 2x fp32 memory.
Precision = Literal["fp32", "fp16", "bf16", "fp64"]
GradAccumDtype = Literal["fp32", "bf16", "fp16"]
Stage = Literal[0, 1, 2, 3]  # ZeRO §5: plain DP, Pos, Pos+g, Pos+g+p
OffloadDevice = Literal["none", "cpu", "nvme"]
PRECISIONS = get_args(Precision)
GRAD_ACCUM_DTYPES = get_args(GradAccumDtype)


def _is_int(value, at_least: int) -> bool:
    """A real int (bool is not one, whatever Python says) no smaller than ``at_least``."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= at_least


@dataclass
class ZeroConfig:
    """What the ZeRO optimizer partitions, in which precision, and with which buffer sizes.

    contiguous_gradients: stages 0-1 keep every gradient as a view of one flat buffer (MD) when
    True, and pack autograd's own gradient tensors into the bucket at reduction time when False.
    Stages 2-3 always reduce into the contiguous gradient *partition*, which is what Pos+g is.
    The docstring under each field is its one line of ``--help`` (``zerotron.config.fields``).
    """

    stage: Stage = 0
    """ZeRO-DP stage: 0 plain DP, 1 Pos, 2 Pos+g, 3 Pos+g+p"""
    overlap_comm: bool = False
    """overlap gradient reduction with backward (two buckets in flight)"""
    contiguous_gradients: bool = True
    """stages 0-1: gradients as views of one flat buffer (MD)"""
    reduce_bucket_size: int = int(5e8)
    """elements per gradient reduction bucket (CB)"""
    allgather_bucket_size: int = int(5e8)
    """elements per parameter all-gather bucket (CB)"""
    # stage3.py; None is one unit ahead as FSDP2 does, 0 no prefetch (nor NVMe read-ahead) as
    # DeepSpeed does
    stage3_prefetch_bucket_size: int | None = None
    """stage 3: elements gathered or in flight ahead of the running unit (unset: one unit ahead;
    0: none)"""
    stage3_param_persistence_threshold: int = int(1e5)
    """stage 3: parameters this small stay unpartitioned"""
    stage3_max_live_parameters: int = int(1e9)
    """stage 3: cap on gathered elements kept for reuse or prefetched"""
    stage3_max_reuse_distance: int = 0  # 0: each unit released after use (DeepSpeed's default is 1e9)
    """stage 3: keep a unit gathered if reused within this many elements"""
    offload_optimizer: bool = False
    """ZeRO-Offload: fp32 optimizer state and step on the CPU (stage >= 1)"""
    # ZeRO++
    zero_quantized_weights: bool = False
    """ZeRO++ qwZ: int8 stage-3 parameter all-gathers"""
    zero_quantized_gradients: bool = False
    """ZeRO++ qgZ: int8 hierarchical gradient reduce-scatter"""
    zero_hpz_partition_size: int = 1  # 0 or 1: no secondary partition (DeepSpeed's "> 1")
    """ZeRO++ hpZ: ranks of the secondary parameter partition (a node)"""
    zero_quantization_block_size: int = 256
    """elements per quantization block (qwZ, qgZ)"""
    zero_quantized_gradients_node_size: int = 0  # flat all-to-all when the hpZ size is 1 too
    """qgZ node size; 0: zero_hpz_partition_size"""
    # ZeRO-Infinity: "none" follows offload_optimizer (True means "cpu")
    offload_optimizer_device: OffloadDevice = "none"
    """where optimizer state lives; none: follows offload_optimizer"""
    offload_optimizer_nvme_path: str | None = None
    """ZeRO-Infinity: directory for the optimizer-state files"""
    offload_optimizer_buffer_count: int = 4
    """ZeRO-Infinity: optimizer tiles in memory at once"""
    sub_group_size: int = int(1e9)  # 0: one parameter's partition a tile (DeepSpeed: a parameter)
    """ZeRO-Infinity: elements per optimizer tile"""
    # ZeRO-Infinity parameter offload (stage 3): host memory (zero.host_params) or a file
    # (infinity.disk_params)
    offload_param_device: OffloadDevice = "none"
    """stage 3: the parameter partition in host memory (cpu) or a file (nvme)"""
    offload_param_nvme_path: str | None = None
    """directory for the parameter-partition files"""
    offload_param_buffer_count: int = 5
    """parameter shards in memory at once (read-ahead)"""
    # None: fp32 for fp16/bf16 runs, the precision itself otherwise
    grad_accum_dtype: GradAccumDtype | None = None
    """gradient accumulation/reduction dtype; null: fp32 for 16-bit runs"""

    @property
    def optimizer_offload(self) -> str:
        """Where the fp32 optimizer state lives: "none", "cpu" (ZeRO-Offload) or "nvme" (ZeRO-Infinity)."""
        if self.offload_optimizer_device != "none":
            return self.offload_optimizer_device
        return "cpu" if self.offload_optimizer else "none"

    def grad_accum(self, precision: str) -> str:
        """The gradient dtype a run in ``precision`` uses: ``grad_accum_dtype``, or its default."""
        if self.grad_accum_dtype is not None:
            return self.grad_accum_dtype
        return "fp32" if precision in ("fp16", "bf16") else precision

    def bucket_elements(self, largest_param: int) -> int:
        """The flat layout's chunk, i.e. bucket, size (CB): the smaller of the reduce and all-gather
        buckets, where 0 -- DeepSpeed's "one parameter at a time" -- is the largest parameter's size."""
        return min(self.reduce_bucket_size or largest_param, self.allgather_bucket_size or largest_param)

    def optimizer_tile(self, largest_param: int, dp: int) -> int:
        """Elements per NVMe optimizer tile: ``sub_group_size``, where 0 -- DeepSpeed's one parameter
        per sub-group -- is the largest parameter's share of the partition, which bounds DeepSpeed's
        sub-groups' buffers (zerotron's tiles cut the flat partition, not parameters)."""
        return self.sub_group_size or -(-largest_param // dp)

    @property
    def qgz_node_size(self) -> int:
        return self.zero_quantized_gradients_node_size or self.zero_hpz_partition_size

    def validate(self, dp_size: int | None = None, precision: str | None = None) -> "ZeroConfig":
        """Raise ``ValueError`` naming the key, the value and the fix; returns self, unchanged.

        ``dp_size`` (when known) is checked against the ZeRO++ group sizes, ``precision`` (the
        run's, one of ``PRECISIONS``) against the keys that store fp32 whatever the precision."""
        def bad(key: str, fix: str):
            raise ValueError(f"zero.{key}={getattr(self, key)!r}: {fix}")

        stage = self.stage
        if not isinstance(stage, int) or isinstance(stage, bool) or stage not in get_args(Stage):
            bad("stage", "use 0 (plain DP), 1 (Pos), 2 (Pos+g) or 3 (Pos+g+p)")
        if precision is not None and precision not in PRECISIONS:
            raise ValueError(f"precision={precision!r}: use one of {list(PRECISIONS)}")
        for key in ("overlap_comm", "contiguous_gradients", "offload_optimizer"):
            if not isinstance(getattr(self, key), bool):
                bad(key, "must be true or false")
        for key in ("reduce_bucket_size", "allgather_bucket_size"):
            if not _is_int(getattr(self, key), at_least=0):
                bad(key, "must be a number of elements, e.g. 500000000 (0: one parameter at a time, as DeepSpeed)")
        window = self.stage3_prefetch_bucket_size
        if window is not None and not _is_int(window, at_least=0):
            bad("stage3_prefetch_bucket_size", "must be a number of elements >= 0, e.g. 50000000 "
                                               "(0: no prefetch), or null (one unit ahead)")
        for key in ("stage3_max_live_parameters", "stage3_max_reuse_distance"):
            if not _is_int(getattr(self, key), at_least=0):
                bad(key, "must be a number of elements >= 0, e.g. 1000000000 (DeepSpeed's default)")
        value = self.stage3_param_persistence_threshold
        if not _is_int(value, at_least=0):
            bad("stage3_param_persistence_threshold", "must be a number of elements >= 0 (0 partitions everything)")
        if self.offload_optimizer and self.stage == 0:
            bad("offload_optimizer", "CPU offload (ZeRO-Offload) needs stage 1, 2 or 3; set stage >= 1 or turn it off")
        self._validate_grad_accum(bad, precision)
        self._validate_zeropp_infinity(bad, dp_size, precision)
        return self

    def _validate_grad_accum(self, bad, precision: str | None) -> None:
        value = self.grad_accum_dtype
        if value is not None and value not in GRAD_ACCUM_DTYPES:
            bad("grad_accum_dtype", f"use one of {list(GRAD_ACCUM_DTYPES)}, or null (fp32 for fp16/bf16 runs, "
                                    f"the precision itself otherwise)")
        if value is None or precision is None or (value in ("fp32", precision) and precision != "fp64"):
            return
        if precision in ("fp32", "fp64"):
            keep = " or set 'fp32'" if precision == "fp32" else ""
            bad("grad_accum_dtype", f"gradients of {precision} parameters accumulate in {precision}; "
                                    f"remove the key{keep}")
        bad("grad_accum_dtype", f"a {value} accumulator for {precision} gradients mixes two 16-bit formats; use "
                                f"'fp32' (the default) or '{precision}'")

    def _validate_zeropp_infinity(self, bad, dp_size: int | None, precision: str | None) -> None:
        for key in ("zero_quantized_weights", "zero_quantized_gradients"):
            if not isinstance(getattr(self, key), bool):
                bad(key, "must be true or false")
        for key in ("zero_quantization_block_size", "offload_optimizer_buffer_count"):
            if not _is_int(getattr(self, key), at_least=1):
                bad(key, "must be a positive integer")
        if not _is_int(self.zero_hpz_partition_size, at_least=0):
            bad("zero_hpz_partition_size", "must be an integer >= 0 (0 or 1: no secondary partition)")
        if not _is_int(self.sub_group_size, at_least=0):
            bad("sub_group_size", "must be a number of elements >= 0 (0: one parameter per tile)")
        value = self.zero_quantized_gradients_node_size
        if not _is_int(value, at_least=0):
            bad("zero_quantized_gradients_node_size", "must be >= 0 (0: use zero_hpz_partition_size)")
        if self.zero_quantized_weights and self.stage != 3:
            bad("zero_quantized_weights", "qwZ quantizes the stage-3 parameter all-gather; set stage=3 or turn it off")
        if self.zero_hpz_partition_size > 1 and self.stage != 3:
            bad("zero_hpz_partition_size", "hpZ partitions the stage-3 parameters; set stage=3 or use 1")
        if self.zero_quantized_gradients and self.stage < 1:
            bad("zero_quantized_gradients", "qgZ quantizes the gradient reduce-scatter of stages 1-3; set stage>=1")
        if dp_size is not None:
            for key in ("zero_hpz_partition_size", "zero_quantized_gradients_node_size"):
                k = getattr(self, key)
                if k > 1 and dp_size % k:
                    bad(key, f"must divide the data-parallel size {dp_size} (e.g. the GPUs per node)")
        if self.offload_optimizer_device not in get_args(OffloadDevice):
            bad("offload_optimizer_device", "use 'none', 'cpu' or 'nvme'")
        if self.offload_optimizer_device in ("cpu", "nvme") and self.stage == 0:
            bad("offload_optimizer_device", "optimizer offload needs stage 1, 2 or 3")
        if self.offload_optimizer_device == "nvme":
            if self.stage != 3:
                bad("offload_optimizer_device", "NVMe offload (ZeRO-Infinity) needs stage=3, as in DeepSpeed; "
                                                "use device 'cpu' for stages 1-2")
            if not self.offload_optimizer_nvme_path:
                bad("offload_optimizer_nvme_path", "set it to a directory on local NVMe (e.g. /local_nvme)")
            if self.offload_optimizer_buffer_count < 2:
                bad("offload_optimizer_buffer_count", "need >= 2 (one tile updating, one read ahead)")
        if precision == "fp64":
            for key in ("zero_quantized_weights", "zero_quantized_gradients"):
                if getattr(self, key):
                    bad(key, "int8 quantization has fp32 scales; with it use precision fp32, fp16 or bf16")
            for key in ("offload_optimizer_device", "offload_param_device"):
                if getattr(self, key) == "nvme":
                    bad(key, "the NVMe files hold fp32 and the precision is fp64; use precision fp32, fp16 or "
                             "bf16 with NVMe offload")
        if self.offload_param_device not in get_args(OffloadDevice):
            bad("offload_param_device", "use 'none', 'cpu' (host memory) or 'nvme' (a file)")
        if self.offload_param_device == "cpu" and self.stage != 3:
            bad("offload_param_device", "parameter offload needs stage=3 (only Pos+g+p partitions parameters)")
        if self.offload_param_device == "nvme":
            if self.stage != 3:
                bad("offload_param_device", "parameter offload needs stage=3 (only Pos+g+p partitions parameters)")
            if not self.offload_param_nvme_path:
                bad("offload_param_nvme_path", "set it to a directory on local NVMe (e.g. /local_nvme)")
            value = self.offload_param_buffer_count
            if not _is_int(value, at_least=2):
                bad("offload_param_buffer_count", "need an integer >= 2 (one unit read ahead, one written behind)")
