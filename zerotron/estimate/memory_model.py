"""Per-device memory of a GPT training run, term by term, and the largest model that fits.

Every term is derived from first principles (the ZeRO paper, arXiv 1910.02054) and checked
against what zerotron's own runs hold (``ZeroOptimizer.memory_report()`` and the activation
checkpointing handle's ``memory_report()``; see ``scripts/run_ablations.py``,
``tests/estimate/test_memory_model.py`` and, for the measured peak, ``scripts/bench/memory_grid.py``).
Bytes per rank, with Ψ the parameters a rank's model replica holds (its TP slice), Nd the ZeRO
partition degree (DP, times CP with context parallelism), t the MP (TP) degree, b the per-rank
micro-batch, s the sequence (s/cp on a CP rank), h the hidden size, L the layers:

* **context parallelism** (``estimate/context_parallel.py``): every activation term below is
  taken at the s/cp tokens a CP rank holds, the model states are split over DP x CP, and
  ring attention's buffers (K/V in flight, dK/dV, the partial outputs' merge) join the working
  memory of the layer whose attention runs.
* **model states** (§3.1, §5): 16-bit parameters and gradients plus K = 12 bytes of fp32 Adam
  state (master, momentum, variance) per parameter -- 16Ψ plain DP, 4Ψ + 12Ψ/Nd for Pos,
  2Ψ + 14Ψ/Nd for Pos+g, 16Ψ/Nd for Pos+g+p.
* **activation checkpoints** (§3.2, §6.1): one b·s·h 16-bit tensor per checkpoint (the input of
  every ``checkpoint_every`` layers). Pa keeps 1/t of each on every MP rank; Pa+cpu (and
  ``cpu_checkpointing``) moves them to host memory, so the device holds none.
* **layer activations** without checkpointing: Korthikanti et al. 2022 (arXiv 2205.05198) eq. 2
  with TP, s·b·h·(10 + 24/t + 5·a·s/(h·t)) bytes per layer (16-bit tensors, 1-byte dropout masks,
  a heads); the a·s² term is the attention probabilities, which a fused attention kernel (SDPA's
  flash / memory-efficient kernels on a GPU: ``fused_attention``) never stores, nor does
  selective recompute; sequence parallelism divides the replicated 10 by t as well (Table 2,
  ``estimate.activations``), and splits every checkpoint over TP as Pa would.
* **recompute working memory**: in backward one layer at a time is re-run with its graph, and
  the peak comes when its recomputed forward is complete: the tensors it saved for backward
  except its input (the checkpoint, counted below): LayerNorm outputs and the attention
  residual, 2 + 2 + 2 bytes per s·b·h, two dropout masks 1 + 1, the TP-split tensors 24/t (and
  the probabilities, unfused); plus what backward has in flight then: the gradient arriving from
  the layer above, the recomputed output, and the last residual branch's output, 2 each --
  s·b·h·(14 + 24/t) with a fused kernel, measured in zerotron by the dry run. The head (logits
  and cross-entropy) is b·s·V/t elements held as 16-bit logits plus fp32 log-softmax and fp32
  gradient, 10 bytes each, beside the last block's output and the final LayerNorm's, 2·b·s·h.
  The end of backward holds the tied embedding's two dense gradients and their sum, 3·V/t·h in
  the parameters' dtype, when the checkpoints are gone; on gloo (a CPU run) a
  reduce-scatter copies its bucket. Which of these coincide is ``working_memory.step_working_bytes``.
* **on a CPU device** (``Setup.device``) the host is the device: Pa+cpu's host checkpoints are
  in ``before_margin`` too (on a GPU they are host memory, reported as ``checkpoints_host``).
* **RNG snapshots**: each checkpoint keeps the generator states its recompute replays: 5056 bytes
  each on a CPU device (``working_memory.rng_snapshot_bytes``), host memory on a GPU.
* **NCCL communicators** (``estimate/nccl_memory.py``): each group's buffers, outside torch's
  allocator: in ``total``, not in ``before_margin``; 0 on gloo.
* **gathered parameters** (stage 3, §5.3): the root unit, the running block, the blocks the
  prefetch window holds ahead and the persistent small parameters, 16-bit, each unit sized by
  the group it all-gathers; the persistent group's own gradient buffer is a fixed buffer
  (``estimate/stage3_memory.py``).
* **fixed buffers** (CB, §6.2): zerotron's reduce buckets, the DP shard buffers, the fp32
  staging shard, the all-gather input and (with Pa) the one-checkpoint all-gather target. They
  depend on the bucket size, not on the model (``working_memory.fixed_buffer_bytes`` mirrors
  ``zero/grad_reduce.py``, ``zero/optimizer_state.py`` and ``zero/optimizer.py``).
* **fragmentation margin** (§3.2, §6.3): the paper reports OOM with over 30% of memory free
  when long- and short-lived tensors interleave; MD (contiguous checkpoints and gradients)
  removes most of it. The default margin is therefore 10% of the device with MD, 30% without.

On a CPU run the interpreter dominates RSS, so the figures compared there are the *accounted*
bytes: model states + device checkpoints + fixed buffers (``estimate(...)["accounted"]``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from zerotron.estimate.context_parallel import local_setup
from zerotron.estimate.nccl_memory import communicator_bytes
from zerotron.estimate.pipeline_memory import (checkpoints_alive, kept_input_bytes,
                                               layers_in_flight, stage_params)
from zerotron.estimate.stage3_memory import (block_param_numels, forward_head_gathered_bytes,
                                             gathered_param_bytes, largest_gathered_group,
                                             persistent_bucket_bytes, root_param_numels)
from zerotron.estimate.working_memory import (block_layer_bytes, fixed_buffer_bytes,
                                              rng_snapshot_bytes, step_working_bytes)
from zerotron.model.config import GPTConfig
from zerotron.zero.accounting import expected_model_state_bytes

BYTES = {"fp16": 2, "bf16": 2, "fp32": 4, "fp64": 8}
ADAM_K = 12  # fp32 master + momentum + variance (§3.1)

# The ZeRO configurations of Table 3 (§10.5). All use CB + MD; none uses Pos+g+p.
C_CONFIGS: dict[str, dict] = {
    "C1": dict(stage=1, partition_activations=False, cpu_checkpointing=False),
    "C2": dict(stage=1, partition_activations=True, cpu_checkpointing=False),
    "C3": dict(stage=2, partition_activations=False, cpu_checkpointing=False),
    "C4": dict(stage=2, partition_activations=True, cpu_checkpointing=False),
    "C5": dict(stage=2, partition_activations=True, cpu_checkpointing=True),
}

# (hidden, heads) of the paper's GPT-2 family (Tables 4, 5, 10; at most 212 layers): ``max_model``
# stops at 256 so Pa+cpu is not credited with a 3,000-layer, 1920-wide model nobody would train.
GPT_FAMILY = [(1536, 16), (1600, 16), (1920, 16), (2304, 24), (3072, 24), (4096, 32), (6144, 32), (8192, 64)]
MAX_FAMILY_LAYERS = 256


@dataclass
class Setup:
    """One run as the memory model sees it (a subset of ``RunConfig``, per rank)."""

    model: GPTConfig
    tp: int = 1
    dp: int = 1
    cp: int = 1  # parallel.cp: each rank holds s/cp tokens; ZeRO shards over dp x cp
    micro_batch: int = 1
    stage: int = 2
    checkpoint_activations: bool = True
    checkpoint_every: int = 1
    partition_activations: bool = False
    cpu_checkpointing: bool = False
    contiguous_memory: bool = True  # MD
    contiguous_gradients: bool = True  # zero.contiguous_gradients: stages 0-1 reduce from one flat buffer
    precision: str = "fp16"
    bucket_size: int = 500_000_000  # min(reduce_bucket_size, allgather_bucket_size), elements
    overlap_comm: bool = False
    fragmentation: float | None = None  # None: 0.10 with MD, 0.30 without (§3.2)
    fused_attention: bool = True  # a GPU's SDPA kernel; False: the CPU's math kernel keeps a·s² probabilities
    sequence_parallel: bool = False  # parallel.sequence_parallel (Korthikanti et al. 2022)
    recompute_granularity: str = "full"  # activation_checkpointing.recompute_granularity
    sequence_parallel_gather: str = "keep"  # activation_checkpointing.sequence_parallel_gather
    # bytes per accumulated gradient element: None = zerotron's default (fp32 accumulation,
    # ``zero.grad_accum_dtype``), 2 = the paper's 16-bit gradients (2 + 2 + K)
    grad_bytes: int | None = None
    # stage 3: elements gathered ahead of use (None: one unit), DeepSpeed's reuse distance (0:
    # released after use), the live cap and the persistence threshold (``stage3_memory.py``)
    prefetch_bucket_size: int | None = None
    max_reuse_distance: int = 0
    max_live_parameters: int = int(1e9)
    persistence_threshold: int = int(1e5)
    backend: str = "nccl"  # the DP collectives' library: gloo (a CPU run) copies what it reduce-scatters
    device: str = "cuda"  # where activations live: "cpu" (the host is the device) also holds RNG snapshots
    # the pipeline (``estimate/pipeline_memory.py``): stages, this setup's stage (0 holds the
    pp: int = 1  # embedding, pp - 1 the head), model chunks per rank, schedule, micro-batches
    pipeline_rank: int = 0
    virtual_stages: int = 1
    pipeline_schedule: str = "1f1b"
    microbatches: int = 1
    hpz_partition_size: int = 1  # ZeRO++ hpZ / qgZ node-local groups: their NCCL communicators
    qgz_node_size: int = 1

    def with_config(self, name: str, **overrides) -> "Setup":
        """This setup under ZeRO configuration ``name`` (C1..C5, Table 3), CB + MD on."""
        if name not in C_CONFIGS:
            raise ValueError(f"unknown ZeRO configuration {name!r}; use one of {sorted(C_CONFIGS)}")
        return dataclasses.replace(self, checkpoint_activations=True, contiguous_memory=True,
                                   **C_CONFIGS[name], **overrides)

    @property
    def zero_shards(self) -> int:
        """Nd of §5.4: ZeRO partitions over DP x CP (the parameters are replicated over CP)."""
        return self.dp * self.cp

    @property
    def margin(self) -> float:
        if self.fragmentation is not None:
            return self.fragmentation
        return 0.10 if self.contiguous_memory else 0.30


def setup_from_run_config(cfg, model: GPTConfig, gpus: int, backend: str = "nccl",
                          device: str = "cuda", pipeline_rank: int = 0) -> Setup:
    """The ``Setup`` of a validated ``RunConfig`` (``config.run_config``) on ``gpus`` GPUs: its model,
    MP and DP degrees, micro-batch, ZeRO stage, buckets, gradient dtype and checkpointing, and
    with a pipeline the stage ``pipeline_rank`` (the trainer's and the dry run's own)."""
    z, ac, t, par = cfg.zero, cfg.activation_checkpointing, cfg.training, cfg.parallel
    if z.optimizer_offload != "none" or z.offload_param_device != "none":
        raise ValueError("the memory model covers runs without ZeRO-Offload/Infinity (the paper's setups); this "
                         f"run has zero.offload_optimizer_device={z.optimizer_offload}, zero.offload_param_device="
                         f"{z.offload_param_device}")
    if not 0 <= pipeline_rank < par.pp:
        raise ValueError(f"pipeline_rank={pipeline_rank}: a stage of parallel.pp={par.pp} is in [0, {par.pp - 1}]")
    mp = par.tp * par.pp * par.cp
    if gpus % mp:
        raise ValueError(f"gpus={gpus} is not divisible by tp x cp x pp = {mp}; use a multiple of it")
    return Setup(model, tp=par.tp, dp=gpus // mp, cp=par.cp, micro_batch=t.micro_batch_size, stage=z.stage,
                 checkpoint_activations=ac.checkpoint_activations, checkpoint_every=ac.checkpoint_every,
                 partition_activations=ac.partition_activations, cpu_checkpointing=ac.cpu_checkpointing,
                 contiguous_memory=ac.contiguous_memory_optimization, precision=t.precision,
                 contiguous_gradients=z.contiguous_gradients,
                 bucket_size=z.bucket_elements(largest_param(model, cfg.parallel.tp)), overlap_comm=z.overlap_comm,
                 grad_bytes=BYTES[z.grad_accum(t.precision)], sequence_parallel=cfg.parallel.sequence_parallel,
                 recompute_granularity=ac.recompute_granularity, sequence_parallel_gather=ac.sequence_parallel_gather,
                 prefetch_bucket_size=z.stage3_prefetch_bucket_size, max_reuse_distance=z.stage3_max_reuse_distance,
                 max_live_parameters=z.stage3_max_live_parameters,
                 persistence_threshold=z.stage3_param_persistence_threshold,
                 backend=backend, device=device, pp=par.pp, pipeline_rank=pipeline_rank,
                 virtual_stages=par.virtual_stages, pipeline_schedule=par.pipeline_schedule,
                 microbatches=cfg.num_microbatches, hpz_partition_size=z.zero_hpz_partition_size,
                 qgz_node_size=z.qgz_node_size if z.zero_quantized_gradients else 1)


def fullest_stage_setup(cfg, model: GPTConfig, gpus: int, backend: str = "nccl",
                        device: str = "cuda") -> Setup:
    """``setup_from_run_config`` at the pipeline stage the model says holds the most (the first
    holds the most activations, the last the head); the only one without a pipeline. A figure
    for a whole run (the banner's, the fit check's) is its fullest rank's."""
    setups = [setup_from_run_config(cfg, model, gpus, backend, device, r) for r in range(cfg.parallel.pp)]
    return max(setups, key=lambda s: estimate(s)["before_margin"])


def largest_param(cfg: GPTConfig, tp: int = 1) -> int:
    """Elements of the largest parameter one TP rank holds (a bucket size of 0 comes to it)."""
    h, fc1 = cfg.hidden_size, (2 if cfg.gated else 1) * cfg.ffn_size
    return max(cfg.padded_vocab_size(tp) * h // tp, (h + 2 * cfg.kv_size) * h // tp, h * fc1 // tp)


def params_per_rank(cfg: GPTConfig, tp: int = 1) -> int:
    """Parameters one TP rank holds (Ψ of its replica): split GEMMs and vocab, replicated LN/biases.

    Megatron-LM §3 splits QKV and fc1 by columns (weights and biases) and proj and fc2 by rows
    (weights only: their biases, LayerNorms and the position table are replicated), and the word
    embedding (and an untied output layer) over the vocabulary. Equals ``ZeroOptimizer.num_params``
    for a ``GPT``, of either architecture.
    """
    return cfg.num_layers * block_params_per_rank(cfg, tp) + root_params_per_rank(cfg, tp)


def block_params_per_rank(cfg: GPTConfig, tp: int = 1) -> int:
    """One transformer block's parameters on a TP rank (a stage-3 unit): the sum of
    ``stage3_memory.block_param_numels``, the one list of a block's parameters."""
    return sum(block_param_numels(cfg, tp))


def root_params_per_rank(cfg: GPTConfig, tp: int = 1) -> int:
    """What is not in a block: word-embedding slice (and an untied output layer's), a learned
    position table, final norm (the root unit; ``stage3_memory.root_param_numels``)."""
    return sum(root_param_numels(cfg, tp))


def model_state_bytes(psi: float, nd: int, stage: int, param_bytes: int = 2, grad_bytes: int | None = None) -> float:
    """(2 + 2 + K)Ψ split by the stage (§5.4); ``param_bytes`` 2 for fp16/bf16 runs; ``grad_bytes``
    the accumulated gradient's (default ``param_bytes``, the paper's; 4 with fp32 accumulation).
    An fp32 run's parameters are its masters, so its K is the two moments' 8: (4 + 4 + 8)Ψ."""
    k = ADAM_K if param_bytes < 4 else ADAM_K - 4
    return expected_model_state_bytes(psi, nd, stage, param_bytes, k, grad_bytes)


def checkpoint_bytes(b: int, s: int, h: int, layers: int, tp: int = 1, every: int = 1, pa: bool = False,
                     cpu: bool = False, act_bytes: int = 2) -> dict[str, int]:
    """Bytes of the checkpoints alive after forward: one b·s·h input per ``every`` layers (§6.1).

    Pa stores ceil(b·s·h/t) elements per checkpoint (the last slice is padded so the all-gather
    is even); Pa+cpu / offload puts them in host memory instead of on the device.
    """
    n = -(-layers // every)
    piece = -(-b * s * h // tp) if pa and tp > 1 else b * s * h
    total = n * piece * act_bytes
    return {"device": 0 if cpu else total, "host": total if cpu else 0}


def estimate(setup: Setup) -> dict:
    """Per-rank bytes of every term (see the module docstring) and their sum with the margin.

    With context parallelism the activation terms are those of sequence s/cp (``local``) and
    the model states are partitioned over DP x CP (``estimate.context_parallel``)."""
    local = local_setup(setup)  # what one CP rank's activations see: s/cp tokens
    cfg, t, nd, b = setup.model, setup.tp, setup.zero_shards, setup.micro_batch
    pb = BYTES[setup.precision]
    gb = setup.grad_bytes if setup.grad_bytes is not None else max(pb, 4)  # fp32 accumulation for 16-bit
    s, h = local.model.seq_length, cfg.hidden_size  # s/cp: one CP rank's tokens
    psi = params_per_rank(cfg, t) if setup.pp == 1 else stage_params(setup)
    states = model_state_bytes(psi, nd, setup.stage, pb, gb)
    sp, sel = setup.sequence_parallel and t > 1, setup.recompute_granularity == "selective"
    pa = setup.partition_activations and t > 1 and not sp  # with SP the checkpoint is already 1/t
    layer = block_layer_bytes(local, pb)  # Table 2, and the Llama block's own tensors
    largest_group = psi if setup.stage < 3 else largest_gathered_group(setup)
    alive = checkpoints_alive(setup)  # every chunk-forward in flight's, with a pipeline
    if setup.checkpoint_activations:
        ckpt = checkpoint_bytes(b, s, h, alive, t, 1, pa or sp, setup.cpu_checkpointing, pb)
        ckpt["device"] += kept_input_bytes(local, pb)
    else:  # every layer's activations stay alive until its backward
        ckpt = {"device": int(layer * layers_in_flight(setup)), "host": 0}
    gathered = gathered_param_bytes(setup, pb)
    working = step_working_bytes(local, psi=psi, largest_group=largest_group, kept=ckpt["device"], layer=layer,
                                 gathered=gathered, root=forward_head_gathered_bytes(setup, pb),
                                 head_gathered=gathered_param_bytes(setup, pb, head=True),
                                 param_bytes=pb, grad_bytes=gb)
    fixed = fixed_buffer_bytes(setup.stage, setup.bucket_size, nd, largest_group, pb, setup.overlap_comm, gb,
                               setup.contiguous_gradients) + persistent_bucket_bytes(setup, gb)
    if setup.stage == 1 and not setup.contiguous_gradients:  # 16-bit .grad until the last micro-batch
        states += pb * psi - gb * psi + gb * -(-psi // nd)
    pa_gather = -(-b * s * h // t) * t * pb if pa and setup.checkpoint_activations else 0
    snapshots = alive if setup.checkpoint_activations else (layers_in_flight(setup) if sel else 0)
    rng = rng_snapshot_bytes(setup, snapshots)
    host_on_device = ckpt["host"] if setup.device == "cpu" else 0  # a CPU run's host checkpoints are in its memory
    used = states + ckpt["device"] + host_on_device + working + fixed + pa_gather + gathered + rng
    nccl = communicator_bytes(setup)["bytes"]  # not torch's: outside the margin the allocator needs
    return {
        "params_total": cfg.exact_num_params(t),
        "params_per_rank": psi,
        "model_states": states,
        "checkpoints_device": ckpt["device"],
        "checkpoints_host": ckpt["host"],
        "working": working,
        "fixed_buffers": fixed + pa_gather,
        "gathered_params": gathered,
        "rng_states": rng,
        "fragmentation_margin": setup.margin,
        "accounted": states + ckpt["device"] + fixed + pa_gather,
        "before_margin": used,
        "nccl_communicators": nccl,
        "total": used / (1 - setup.margin) + nccl,
    }


def fits(setup: Setup, device_bytes: float, accounted_only: bool = False, basis: str | None = None) -> bool:
    """``basis``: the sum that must fit: ``total`` (margin and NCCL, the default), ``accounted``
    (``accounted_only``) or ``before_margin`` (what a live-storage tracker measures)."""
    e = estimate(setup)
    return e[basis or ("accounted" if accounted_only else "total")] <= device_bytes


def max_layers(setup: Setup, device_bytes: float, accounted_only: bool = False, limit: int = 100_000,
               basis: str | None = None) -> int:
    """Most layers of ``setup.model``'s width that fit in ``device_bytes`` (0 if none).

    Every term grows monotonically with L, so a bisection over L is exact.
    """
    def ok(layers: int) -> bool:  # a pipeline needs a layer per virtual stage: fewer count as that
        layers = max(layers, setup.pp * setup.virtual_stages)
        return fits(dataclasses.replace(setup, model=dataclasses.replace(setup.model, num_layers=layers)),
                    device_bytes, accounted_only, basis)

    if not ok(1):
        return 0
    lo, hi = 1, 2
    while hi < limit and ok(hi):
        lo, hi = hi, hi * 2
    if hi >= limit and ok(limit):
        return limit
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo


def max_model(setup: Setup, device_bytes: float, family=GPT_FAMILY, layer_limit: int = MAX_FAMILY_LAYERS) -> dict:
    """The largest GPT (by parameters) of ``family`` widths that fits: layers, hidden, heads, params.

    Only widths the MP degree can split are tried (hidden, heads and 4h divisible by t).
    """
    best = {"layers": 0, "hidden": 0, "heads": 0, "params": 0}
    for hidden, heads in family:
        if hidden % setup.tp or heads % setup.tp:
            continue
        m = dataclasses.replace(setup.model, hidden_size=hidden, num_heads=heads, ffn_hidden_size=None)
        layers = max_layers(dataclasses.replace(setup, model=m), device_bytes, limit=layer_limit)
        params = dataclasses.replace(m, num_layers=layers).exact_num_params(setup.tp) if layers else 0
        if params > best["params"]:
            best = {"layers": layers, "hidden": hidden, "heads": heads, "params": params}
    return best
