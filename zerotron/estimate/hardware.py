"""The GPUs and nodes the step-time model runs on: datasheet numbers, plus one tuned constant.

Each preset is a node of a real machine. Peak FLOP/s, SM count, memory, HBM, NVLink,
InfiniBand, PCIe and host-memory bandwidths are datasheet numbers (NVIDIA's V100, H100, DGX-2
and DGX H100 datasheets; the ZeRO paper §10.1-10.2 for the DGX-2 cluster). Two entries are not:
the per-step latencies, assumptions of the order of NCCL's small-message latency (they matter only for small messages or very long rings), and
``gemm_efficiency``, the one tuned constant. ``attention``, ``grad_reduce`` and ``grad_dtype``
name the software stack modelled:

* ``v100``: the ZeRO paper's cluster (§10.1), DGX-2 nodes of 16 V100 SXM3 32 GB on NVSwitch,
  8 x 100 Gb/s EDR InfiniBand per node (800 Gb/s = 100 GB/s), PCIe 3.0 x16 to the host; the
  2019 Megatron-LM attention (unfused) and DeepSpeed's stage-2 gradient reduction (one
  ``dist.reduce`` per owner rank, ``step_model.per_rank_reduces``) of fp16 gradients
  (``step_model.model_dtype_gradients``), as the paper ran.
* ``h100``: a DGX H100, 8 H100 SXM 80 GB on NVLink4 (900 GB/s total, 450 per direction),
  8 x 400 Gb/s NDR InfiniBand per node (400 GB/s), PCIe 5.0 x16 to the host; flash attention.

**The one tuned constant**, ``gemm_efficiency``: the fraction of the dense peak a large GEMM
sustains inside a training step, once its tiles are counted in whole waves
(``kernels.wave_quantization``). V100: 0.456, so that the model gives Megatron-LM's published
one-GPU baseline (1.2B: 40 x 1536, batch 8, seq 1024, checkpointed; 39 TFLOPs = 30 % of peak,
Megatron-LM §5) 30 % of peak -- a run outside every table the model is validated against
(``tests/estimate/test_step_model.py`` holds it). H100: 0.551, so that Megatron-core's GPT-175B
on 96 H100s (its README's strong-scaling run; the layout assumed in
``scripts/bench/step_time_table.py``) comes out at its published 47 % MFU; the same run on 4,608
GPUs (42 %) is then a prediction. It absorbs what the model leaves out on that run, such as
the TP all-reduces Megatron-core hides and the model exposes.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from zerotron.estimate.kernels import SCORE_PASSES
from zerotron.estimate.step_time import LinkModel

# how a stack's Pos+g (ZeRO stage 2) sends each gradient bucket to the ranks that own it
GRAD_REDUCE = {
    "reduce_scatter": "one reduce-scatter per bucket (zerotron)",
    "per_rank_reduce": "one dist.reduce per owner rank's slice of a bucket (DeepSpeed's stage 2 "
                       "as the paper ran it, stage2.py average_tensor)",
}

# the dtype a stack's data-parallel collectives carry the gradients in (16-bit runs)
GRAD_DTYPE = {
    "accumulate": "zero.grad_accum_dtype's (fp32 for 16-bit runs: zerotron, Megatron-core)",
    "model": "the model's 16-bit dtype, as the paper's stacks sent them (Megatron-LM 2019's DDP "
             "without --fp32-allreduce, torch DDP on an fp16 model, DeepSpeed's stage 2 without "
             "allreduce_always_fp32)",
}


@dataclass(frozen=True)
class Hardware:
    """One GPU and its node. Bandwidths in GB/s (10⁹ bytes), one direction; latencies in µs."""

    name: str
    peak_tflops: dict  # dense tensor-core peak per dtype name ("float16", "bfloat16", "float32")
    memory_gb: float  # device memory a rank must fit
    hbm_gbps: float  # device memory bandwidth: what element-wise kernels and thin GEMMs stream at
    gpus_per_node: int
    intra_node_gbps: float  # NVLink/NVSwitch per GPU per direction
    inter_node_gbps: float  # InfiniBand per node, all its NICs together
    intra_latency_us: float
    inter_latency_us: float
    pcie_gbps: float  # host <-> device per GPU (offload, Pa+cpu)
    host_memory_gbps: float  # CPU memory bandwidth per GPU of the node (the offloaded Adam step)
    gemm_efficiency: float  # the tuned constant (see the module docstring)
    sm_count: int  # streaming multiprocessors: the width of a GEMM's wave of tiles (kernels)
    attention: str = "math"  # the attention kernel of the stack modelled (kernels.SCORE_PASSES)
    grad_reduce: str = "reduce_scatter"  # how the stack's Pos+g reduces gradients (GRAD_REDUCE)
    grad_dtype: str = "accumulate"  # the dtype its DP collectives carry gradients in (GRAD_DTYPE)

    def __post_init__(self):
        for name in ("memory_gb", "hbm_gbps", "gpus_per_node", "intra_node_gbps",
                     "inter_node_gbps", "pcie_gbps", "host_memory_gbps"):
            if not getattr(self, name) > 0:
                raise ValueError(f"Hardware.{name}={getattr(self, name)}: must be > 0")
        if self.sm_count < 0:
            raise ValueError(f"Hardware.sm_count={self.sm_count}: must be >= 0 "
                             "(0: no wave quantization)")
        if not 0 < self.gemm_efficiency <= 1:
            raise ValueError(f"Hardware.gemm_efficiency={self.gemm_efficiency}: "
                             "a fraction in (0, 1]")
        if self.attention not in SCORE_PASSES:
            raise ValueError(f"Hardware.attention={self.attention!r}: "
                             f"use one of {sorted(SCORE_PASSES)}")
        if self.grad_reduce not in GRAD_REDUCE:
            raise ValueError(f"Hardware.grad_reduce={self.grad_reduce!r}: "
                             f"use one of {sorted(GRAD_REDUCE)}")
        if self.grad_dtype not in GRAD_DTYPE:
            raise ValueError(f"Hardware.grad_dtype={self.grad_dtype!r}: "
                             f"use one of {sorted(GRAD_DTYPE)}")

    def peak(self, precision: str) -> float:
        """Dense peak FLOP/s for a run's ``training.precision`` (fp16, bf16, fp32). A bf16 run on a
        part without bf16 (Volta) is timed at its fp16 tensor-core peak, as the dry run always did:
        the question it answers is the 16-bit run's speed, not whether Volta can run bf16."""
        dtype = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}.get(precision, precision)
        value = self.peak_tflops.get(dtype, 0.0)
        if dtype == "bfloat16" and not value > 0:
            value = self.peak_tflops.get("float16", 0.0)
        if not value > 0:
            raise ValueError(f"training.precision={precision!r}: a {self.name} has no dense "
                             f"{dtype} "
                             f"peak; use {', '.join(k for k, v in self.peak_tflops.items() if v)}")
        return value * 1e12

    def link(self) -> LinkModel:
        return LinkModel(gpus_per_node=self.gpus_per_node,
                         intra_node_gbps=self.intra_node_gbps,
                         inter_node_gbps=self.inter_node_gbps,
                         intra_latency_us=self.intra_latency_us,
                         inter_latency_us=self.inter_latency_us)

    def with_overrides(self, **fields) -> "Hardware":
        """This preset with some fields replaced (``None`` keeps the preset's)."""
        return replace(self, **{k: v for k, v in fields.items() if v is not None})

    def as_dict(self) -> dict:
        return asdict(self)


V100_DGX2 = Hardware(
    name="V100 DGX-2", peak_tflops={"float16": 125.0, "bfloat16": 0.0, "float32": 15.7},
    memory_gb=32.0, hbm_gbps=900.0, gpus_per_node=16, intra_node_gbps=150.0,
    inter_node_gbps=100.0, intra_latency_us=5.0, inter_latency_us=10.0,
    pcie_gbps=16.0,  # PCIe 3.0 x16: 15.75 GB/s per direction
    host_memory_gbps=16.0,  # 2 Xeon 8168 sockets x 6 DDR4-2666 channels = 256 GB/s, over 16 GPUs
    gemm_efficiency=0.456, sm_count=80,  # V100 SXM: 80 SMs
    attention="unfused",  # the paper's 2019 Megatron-LM attention
    grad_reduce="per_rank_reduce",  # the paper's ZeRO-100B: DeepSpeed's stage-2 reduction
    grad_dtype="model")  # its DeepSpeed, Megatron-LM and torch DDP sent fp16 gradients

H100_DGX = Hardware(
    name="H100 DGX", peak_tflops={"float16": 989.0, "bfloat16": 989.0, "float32": 67.0},
    memory_gb=80.0, hbm_gbps=3350.0, gpus_per_node=8, intra_node_gbps=450.0,
    inter_node_gbps=400.0, intra_latency_us=3.0, inter_latency_us=6.0,
    pcie_gbps=64.0,  # PCIe 5.0 x16: 63 GB/s per direction
    host_memory_gbps=77.0,  # 2 Xeon 8480C sockets x 8 DDR5-4800 channels = 614 GB/s, over 8 GPUs
    gemm_efficiency=0.551,  # Megatron-core GPT-175B, 96 GPUs: 47 % MFU
    sm_count=132, attention="flash")  # H100 SXM: 132 SMs

HARDWARE = {"v100": V100_DGX2, "h100": H100_DGX}


def get_hardware(name: str) -> Hardware:
    try:
        return HARDWARE[name.lower()]
    except KeyError:
        raise ValueError(f"--gpu {name!r}: unknown; use one of {sorted(HARDWARE)}") from None
