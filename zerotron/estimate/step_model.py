"""A step's time from the config and the hardware's datasheet: compute, communication, optimizer,
pipeline bubble and host copies, each its own term.

    step = compute + bubble + exposed communication + optimizer + host copies

* **compute** (``estimate.kernels``): per micro-batch and layer, every GEMM by its roofline
  in whole waves of tiles (``kernels.wave_quantization``),
  the attention core by its kernel, element-wise and normalisation kernels by their HBM bytes;
  backward's GEMMs are twice the forward's, its element-wise bytes twice too; full recompute runs
  the forward once more ([Z] §6.1), selective recompute the attention core (Korthikanti et al.
  2022 §5); the last stage adds the logit GEMM and the cross-entropy. A context-parallel rank
  runs everything on its s/cp tokens and 1/cp of the attention scores.
* **ring attention** (``parallel.cp``): the K/V and dK/dV transfers (``comm_volumes.ring_comm``)
  run behind (cp − 1)/cp of the attention they feed (``ring_overlap``); the rest is exposed.
* **communication** (``estimate.step_time.predict_step``): each collective on its links, as
  measured by a dry run or counted from the config (``estimate.comm_volumes``), hidden behind
  backward where zerotron overlaps it (``default_overlap``) -- except the last gradient bucket,
  which has no backward left to hide behind, and at stage 3 the first unit's gather of each
  forward and backward pass, which has nothing ahead of it to run behind. A preset whose stack
  reduces stage 2's gradients per owner rank (``Hardware.grad_reduce``, the paper's DeepSpeed)
  has them timed as those reduces (``per_rank_reduces``); one that sends the model's 16-bit
  gradients (``Hardware.grad_dtype``) has their bytes so (``model_dtype_gradients``).
* **bubble**: 1F1B idles (p − 1) micro-batch slots of forward + backward per step, so the
  bubble is (p − 1)/(m + p − 1) of the pipelined time (Narayanan et al. 2021 §2.2); with v
  interleaved chunks per rank each slot is 1/v as long.
* **optimizer**: Adam streams its states over HBM (on the device) or over the host's memory
  with the gradients and weights crossing PCIe (ZeRO-Offload; ZeRO-Infinity's NVMe tier is
  timed as host memory, its disk bandwidth not modelled).
* **host copies**: Pa+cpu moves each layer's checkpoint to the host in forward and back before
  its recompute ([Z] §6.1), over PCIe, not overlapped.

What it still leaves out: contention between TP and DP on the same NVSwitch, NCCL's tree
algorithms, kernel launch gaps, the memory allocator's stalls near a full device, stage 3's
parameters fetched from host memory (``zero.offload_param_device``) and ZeRO++'s quantization
kernels (their collectives are timed when a dry run measured them).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from zerotron.estimate import kernels
from zerotron.estimate.comm_volumes import DTYPE_BYTES, analytic_comm, group_ranks, rank_params
from zerotron.estimate.hardware import Hardware
from zerotron.estimate.step_time import (BACKWARD_SHARE, collective_time, default_overlap,
                                         group_span, predict_step)
from zerotron.model.config import GPTConfig
from zerotron.model.flops import flops_per_iteration

# Adam per parameter of the partition, bytes over memory: fp32 weight, momentum and variance
# read and written (24), the fp32 gradient read for the norm and again for the update (8), the
# 16-bit weight written (2)
ADAM_BYTES_PER_PARAM = 24 + 8 + 2


@dataclass
class StepBreakdown:
    """One predicted step of one rank, seconds per term; ``comm_s``/``exposed_s`` per group."""

    hardware: str
    gemm_s: float
    attention_s: float
    elementwise_s: float
    compute_s: float
    bubble_s: float
    optimizer_s: float
    host_copy_s: float
    comm_s: dict[str, float]
    exposed_s: dict[str, float]
    exposed_comm_s: float
    step_s: float
    flops_per_gpu: float  # counted as the paper counts TFLOPs: recompute included
    model_flops_per_gpu: float  # MFU's numerator: no recompute
    tflops_per_gpu: float
    mfu: float
    detail: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return asdict(self)


def micro_batch_compute(cfg, mcfg: GPTConfig, hw: Hardware) -> dict[str, float]:
    """Seconds of one micro-batch's forward + backward (+ recompute) on the last stage's rank."""
    tp, pp, cp = cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.cp
    peak, eff = hw.peak(cfg.training.precision), hw.gemm_efficiency
    hbm, elem = hw.hbm_gbps * 1e9, DTYPE_BYTES[cfg.training.precision]
    b, s = cfg.training.micro_batch_size, mcfg.seq_length
    tokens, layers = b * s // cp, math.ceil(mcfg.num_layers / pp)  # a CP rank's s/cp tokens
    ac = cfg.activation_checkpointing
    forwards = 2 if ac.checkpoint_activations else 1
    core_again = 1 if ac.recompute_granularity == "selective" else 0  # attention core, once more

    def roof(g):
        return kernels.gemm_seconds(g, peak, eff, hbm, elem, hw.sm_count)

    fwd = kernels.layer_gemms(mcfg, tokens, tp)
    gemm = sum(roof(g) for g in fwd) * forwards + sum(roof(x) for g in fwd for x in g.backward())
    # a CP rank's queries against every key of the sequence: 1/cp of the s x s scores, balanced
    # by the two-chunk layout
    attn = kernels.attention_core_seconds(mcfg, b, s, tp, hw.attention, peak, eff, hbm, elem,
                                          hw.sm_count) / cp
    attention = attn * (forwards + core_again + 2)  # backward: 2 GEMMs per GEMM, twice the streams
    sp = cfg.parallel.sequence_parallel
    moved = kernels.layer_elementwise_elements(mcfg, tokens, tp, sp) * elem
    moved += kernels.dropout_mask_bytes(mcfg, tokens // tp if sp else tokens)
    elementwise = moved * (forwards + 2) / hbm
    vocab = mcfg.padded_vocab_size(tp) // tp
    logits = kernels.Gemm("logits", tokens, vocab, mcfg.hidden_size)
    head = roof(logits) + sum(roof(x) for x in logits.backward())
    head_bytes = tokens * vocab * (elem + 4 * 4)  # the logits written; fp32 softmax r+w, fwd+bwd
    return {"gemm": layers * gemm + head, "attention": layers * attention,
            "elementwise": layers * elementwise + head_bytes / hbm}


def optimizer_seconds(cfg, mcfg: GPTConfig, hw: Hardware) -> float:
    """Adam over this rank's partition: on the device by HBM, offloaded by host memory + PCIe."""
    par, z = cfg.parallel, cfg.zero
    params = rank_params(mcfg, par.tp, par.pp) / (par.dp * par.cp if z.stage >= 1 else 1)
    if z.optimizer_offload == "none":
        return params * ADAM_BYTES_PER_PARAM / (hw.hbm_gbps * 1e9)
    grad = DTYPE_BYTES[z.grad_accum(cfg.training.precision)]
    pcie = params * (grad + DTYPE_BYTES[cfg.training.precision]) / (hw.pcie_gbps * 1e9)
    return params * ADAM_BYTES_PER_PARAM / (hw.host_memory_gbps * 1e9) + pcie


def host_copy_seconds(cfg, mcfg: GPTConfig, hw: Hardware) -> float:
    """Pa+cpu: each layer's checkpoint to the host and back, per micro-batch, over PCIe."""
    ac, par = cfg.activation_checkpointing, cfg.parallel
    if not (ac.checkpoint_activations and ac.cpu_checkpointing):
        return 0.0
    tokens = cfg.training.micro_batch_size * mcfg.seq_length
    share = par.tp if ac.partition_activations else 1  # Pa keeps 1/MP of each checkpoint
    per_layer = tokens * mcfg.hidden_size * DTYPE_BYTES[cfg.training.precision] / share
    layers = math.ceil(mcfg.num_layers / par.pp)
    return 2 * cfg.num_microbatches * layers * per_layer / (hw.pcie_gbps * 1e9)


def ring_overlap(comm: dict, ranks: dict[str, list[int]], hw: Hardware,
                 attention_s: float) -> dict[str, float]:
    """The share of ring attention's transfers hidden behind the attention they feed.

    The ring posts the next K/V (or dK/dV) pair's transfer before computing on the current one
    (``parallel.p2p.batch``), so each of a pass's cp − 1 transfers runs beside one of its cp
    attention steps: at most (cp − 1)/cp of the step's attention time (``attention_s``, every
    pass) hides them; the rest of the transfer time is exposed."""
    ops = {k: v for k, v in comm.items() if k.endswith("/cp")}
    if not ops:
        return {}
    if "cp" not in ranks:
        raise ValueError(f"ring_overlap: comm has the CP ring's {sorted(ops)} but ranks has no "
                         f"'cp' group ({sorted(ranks)}); pass the CP group's global ranks")
    cp = len(ranks["cp"])
    span = group_span(ranks["cp"], hw.link().gpus_per_node)
    worst = max(ops.values(), key=lambda c: c["bytes"])  # sends and receives run together
    ring_s = sum(collective_time("send", worst["calls"], worst["bytes"], span, hw.link()))
    hidden = min(1.0, attention_s * (cp - 1) / cp / ring_s) if ring_s > 0 else 1.0
    return {"send/cp": hidden, "recv/cp": hidden}


def bubble_fraction(pp: int, microbatches: int, virtual_stages: int = 1) -> float:
    """Idle share of the pipelined time: (p − 1)/v ÷ (m + (p − 1)/v) (1F1B, interleaved)."""
    idle = (pp - 1) / virtual_stages
    return idle / (microbatches + idle)


def per_rank_reduces(comm: dict, overlap: dict, dp: int, passes: int) -> dict:
    """The gradient reduce-scatter as DeepSpeed's stage 2 issued it when the paper ran ZeRO-100B.

    DeepSpeed's ``average_tensor`` (``runtime/zero/stage2.py``) sends each bucket's gradients to
    the ranks that own them with one ``dist.reduce`` per owner's slice, all queued on one NCCL
    communicator, so they run one after another. A bucket boundary splits at most one rank's
    partition, so a pass over the gradients in b buckets issues b + n − 1 reduces; each is a
    pipelined chain (``step_time.CHAIN_OPS``): (n − 1) latency steps and every byte once over each
    link. The bytes are the reduce-scatter's; the latency grows as n²: the model's account of the
    paper's ZeRO-1.5B on 400 GPUs (Figure 2, 30.3 TFLOPs/GPU) running slower than its 1.5B on 128
    (Figure 4, 40.3). ``passes``: how many times a step reduces all its gradients (once per
    micro-batch under a pipeline at stage 2)."""
    rs = comm.get("reduce_scatter/dp")
    if rs is None or dp <= 1:
        return comm
    out = {k: v for k, v in comm.items() if k != "reduce_scatter/dp"}
    out["reduce/dp"] = {"calls": rs["calls"] + passes * (dp - 1), "bytes": rs["bytes"]}
    if "reduce_scatter/dp" in overlap:
        overlap["reduce/dp"] = overlap["reduce_scatter/dp"]
    return out


# the collectives that carry gradients (the rest carry parameters, activations or scalars)
GRADIENT_KEYS = ("all_reduce/dp", "all_reduce/dp_cp", "reduce_scatter/dp", "reduce_scatter/dp_cp",
                 "all_reduce/embedding")


def model_dtype_gradients(comm: dict, cfg) -> dict:
    """The gradient collectives as a stack that sends the model's 16-bit gradients carries them.

    zerotron accumulates and reduces a 16-bit run's gradients in ``zero.grad_accum_dtype``
    (fp32); the stacks the ZeRO paper measured sent the fp16 ``param.grad`` itself: DeepSpeed's
    stage 2 reduces its fp16 bucket (``allreduce_always_fp32`` off), Megatron-LM 2019's DDP
    all-reduces the flattened fp16 gradients (``--fp32-allreduce`` off), and so does torch DDP
    on an fp16 model. Their bytes shrink by 16-bit ÷ accumulation bytes; the calls stay (a
    loss or norm scalar riding on the same key shrinks with them, a few bytes)."""
    precision = cfg.training.precision
    share = DTYPE_BYTES[precision] / DTYPE_BYTES[cfg.zero.grad_accum(precision)]
    if share == 1:
        return comm
    return {k: {**v, "bytes": v["bytes"] * share} if k in GRADIENT_KEYS else v
            for k, v in comm.items()}


def predict(cfg, mcfg: GPTConfig, world_size: int, hw: Hardware, comm: dict | None = None,
            ranks: dict[str, list[int]] | None = None,
            overlap: dict[str, float] | None = None) -> StepBreakdown:
    """The step of the slowest (last-stage) rank. ``comm``/``ranks``: a dry run's measured
    collectives and this rank's groups; by default counted from the config. ``overlap``:
    per ``"op/group"``, the share hidden behind compute, replacing zerotron's own (for a peer
    that overlaps what zerotron does not, e.g. Megatron-core's ``--overlap-param-gather``)."""
    par = cfg.parallel
    if comm is None:
        comm, ranks = analytic_comm(cfg, mcfg), group_ranks(par.tp, par.pp, par.dp, par.cp)
    micro = micro_batch_compute(cfg, mcfg, hw)
    per_micro = sum(micro.values())
    m = cfg.num_microbatches
    compute = m * per_micro
    bubble = compute * bubble_fraction(par.pp, m, par.virtual_stages) / (
        1 - bubble_fraction(par.pp, m, par.virtual_stages))
    recompute = cfg.activation_checkpointing.checkpoint_activations
    given = overlap or {}
    overlap = default_overlap(cfg.zero.overlap_comm, cfg.zero.stage, microbatches=m,
                              pipeline=par.pp > 1)
    if par.cp > 1:  # ZeRO's collectives run over DP x CP, hidden as the DP group's would be
        overlap |= {k.replace("/dp", "/dp_cp"): f for k, f in overlap.items() if k.endswith("/dp")}
        overlap |= ring_overlap(comm, ranks, hw, m * micro["attention"])
    overlap |= given
    params = rank_params(mcfg, par.tp, par.pp)
    bucket = cfg.zero.reduce_bucket_size or params
    last_bucket = ("reduce_scatter/dp", "all_reduce/dp", "reduce_scatter/dp_cp", "all_reduce/dp_cp")
    for key in last_bucket:  # the last bucket has no backward after it
        if key in overlap:
            overlap[key] *= max(0.0, 1 - bucket / params)
    if cfg.zero.stage == 3:  # one unit a layer (and the embedding): the first of each pass waits
        units = math.ceil(mcfg.num_layers / par.pp) + 1
        for key in ("all_gather/dp", "all_gather/dp_inner", "all_gather/dp_cp"):
            overlap[key] = overlap.get(key, 0.0) * (1 - 1 / units)
    if hw.grad_dtype == "model":
        comm = model_dtype_gradients(comm, cfg)
    if hw.grad_reduce == "per_rank_reduce" and cfg.zero.stage == 2:
        passes = m if par.pp > 1 else 1  # Pos+g under a pipeline reduces every micro-batch
        comm = per_rank_reduces(comm, overlap, len(ranks.get("dp", [0])), passes)
    window = 0.75 if recompute else BACKWARD_SHARE  # recompute's forward runs inside backward
    comm_part = predict_step(0.0, comm, ranks, link=hw.link(), overlap=overlap,
                             overlap_window=window, compute_s=compute)
    optimizer = optimizer_seconds(cfg, mcfg, hw)
    host = host_copy_seconds(cfg, mcfg, hw)
    step = compute + bubble + comm_part.exposed_comm_s + optimizer + host
    t = cfg.training
    batch, seq = t.global_batch_size, mcfg.seq_length
    selective = cfg.activation_checkpointing.recompute_granularity == "selective"
    flops = flops_per_iteration(mcfg, batch, seq, recompute=recompute, tp=par.tp,
                                selective=selective) / world_size
    model_flops = flops_per_iteration(mcfg, batch, seq, tp=par.tp) / world_size
    peak = hw.peak(t.precision)
    return StepBreakdown(
        hardware=hw.name, gemm_s=m * micro["gemm"], attention_s=m * micro["attention"],
        elementwise_s=m * micro["elementwise"], compute_s=compute, bubble_s=bubble,
        optimizer_s=optimizer, host_copy_s=host, comm_s=comm_part.comm_s,
        exposed_s=comm_part.exposed_s, exposed_comm_s=comm_part.exposed_comm_s, step_s=step,
        flops_per_gpu=flops, model_flops_per_gpu=model_flops, tflops_per_gpu=flops / step / 1e12,
        mfu=model_flops / step / peak, detail=comm_part.detail)
