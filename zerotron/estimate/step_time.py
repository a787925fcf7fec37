"""A predicted step time from FLOPs and the collectives one step records (ZeRO §7, §10).

A dry run counts, per rank and per process group, the calls and bytes of one step
(``parallel.comm_stats``: an all-reduce of Ψ elements counts 2Ψ, a reduce-scatter or all-gather
Ψ, a send or receive what it moves). This module turns those counts and the model FLOPs into
seconds: ``step = compute + exposed communication``. It is a roofline, not a simulator; what
it leaves out is listed at the end.

**Where a group's traffic goes.** Ranks fill nodes in order (node = rank // gpus_per_node) and
zerotron puts TP innermost (rank = tp_rank + tp·(dp_rank + dp·pp_rank), Megatron-LM App. B.1),
so a TP group of 16 fills one DGX-2 and a DP group takes one GPU from each of Nd nodes. For a
group of n members on k nodes, with m members on its least-populated node and c GPUs of each
node communicating in groups of the same kind at the same time (by default the whole node: the
grid is symmetric and every rank runs the same collective, so during the gradient
reduce-scatter all 16 DP groups on a DGX-2 use its NICs at once), the bandwidth a ring gets is

    B = intra_node_gbps                                    if k == 1
    B = min(intra_node_gbps, m · inter_node_gbps / c)      otherwise.

A ring that visits a node's m members in a row crosses the node boundary once per group, so the
node's c/m groups share its NICs and each crossing gets m·inter/c (NCCL spreads one ring over
several channels to use all the NICs; the sum is what counts). The intra-node hops of the same
ring run at NVSwitch speed and cap B.

**Time of a collective** (bytes as recorded; α_intra, α_inter the per-hop latencies on
NVLink/NVSwitch and between nodes; a pass is n − 1 hops, k − 1 of them between nodes when the
group spans k nodes -- ``ring_pass_latency``, NCCL's own cost model):

    ring (all_reduce, reduce_scatter, all_gather):
        t = calls·passes·((k−1)·α_inter + (n−k)·α_intra) + (n−1)/n · bytes / B
        passes = 2 for all_reduce, 1 for reduce_scatter and all_gather
    broadcast, reduce (pipelined chain, every link carries the tensor):
        t = calls·(n−1)·α + bytes / B, α = α_inter on every hop once the chain leaves a node
    all_to_all (recorded as the (n−1)/n that leaves the rank): every member sends across nodes,
        so t = calls·(n−1)·α + bytes · max(1/intra, (n−m)/(n−1) · c/inter) (1/intra on one node)
    send/recv (1F1B posts them together, ``parallel.p2p.batch``; links are full duplex):
        t = max(send calls, recv calls)·α + max(send bytes, recv bytes) / B

The recorded bytes are the paper's volumes (2Ψ for an all-reduce); a ring moves (n−1)/n of them
over each link, which is the explicit factor above. ``comm`` may be keyed ``"op/group"`` (the
``CommStats.snapshot()`` form, exact) or by group alone (the dry run's totals): a bare group is
taken as ring all-reduce traffic, except ``pp``, taken as half sends and half receives.

**Compute and overlap.** ``compute_s = flops_per_gpu / (peak · efficiency)``. ``overlap`` gives,
per ``"op/group"`` or group, the fraction of its time that can run behind compute; the total
hidden is capped by ``overlap_window · compute_s``: backward is 2/3 of forward + backward FLOPs
(the default), 3/4 with full recompute, whose extra forward runs inside backward.
``default_overlap`` encodes what zerotron does.

**Not here:** this module times the collectives; ``estimate.step_model`` builds the whole step
on it -- compute kernel by kernel (passed as ``compute_s``), the pipeline bubble, the optimizer
step, host-device copies, the last gradient bucket. Neither models contention between groups
of different kinds (TP and DP sharing NVSwitch) or NCCL's tree algorithms.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import asdict, dataclass, field

from zerotron.model.config import GPTConfig
from zerotron.model.flops import PEAK_TFLOPS, flops_per_iteration

GB = 1e9
RING_STEPS = {"all_reduce": 2, "reduce_scatter": 1, "all_gather": 1, "broadcast": 1, "reduce": 1,
              "all_to_all": 1}
CHAIN_OPS = ("broadcast", "reduce")  # pipelined along a chain: every link carries the whole tensor
P2P_OPS = ("send", "recv")
P2P_GROUPS = ("pp", "cp")  # pipeline sends, the context-parallel ring
V100_PEAK_TFLOPS = PEAK_TFLOPS["V100"]["float16"]
DEFAULT_EFFICIENCY = 0.5
BACKWARD_SHARE = 2 / 3


@dataclass(frozen=True)
class LinkModel:
    """The cluster's links. Defaults: the ZeRO paper's cluster, 25 V100 DGX-2 nodes (§10.1).

    Units: ``*_gbps`` are **gigabytes** per second, one direction.

    * ``gpus_per_node`` = 16: a DGX-2 holds 16 V100s.
    * ``intra_node_gbps`` = 150: NVSwitch, per GPU. The paper quotes 300 GB/s for NVSwitch
      (§10.2); V100's six NVLink2 links give 300 GB/s counting both directions, so 150 GB/s one
      way is what a ring's send uses. This is our reading of the figure, an assumption.
    * ``inter_node_gbps`` = 100: per node, shared by its GPUs. §10.1 gives "800 Gbps internode
      communication bandwidth": 8 EDR InfiniBand adapters × 100 Gb/s (12.5 GB/s each, §10.2)
      = 800 Gb/s = 100 GB/s per node, as Megatron-LM states for the same machines (§5).
    * ``intra_latency_us`` = 5, ``inter_latency_us`` = 10: per ring hop, the order of NCCL's
      small-message latency on NVLink and on InfiniBand. Assumptions; they matter for messages
      well under a megabyte and for long rings (a TP ring of 256 makes 510 hops an all-reduce).
    """

    gpus_per_node: int = 16
    intra_node_gbps: float = 150.0
    inter_node_gbps: float = 100.0
    intra_latency_us: float = 5.0
    inter_latency_us: float = 10.0

    def __post_init__(self):
        for name in ("gpus_per_node", "intra_node_gbps", "inter_node_gbps"):
            if getattr(self, name) <= 0:
                raise ValueError(f"LinkModel.{name}={getattr(self, name)}: must be > 0")
        for name in ("intra_latency_us", "inter_latency_us"):
            if getattr(self, name) < 0:
                raise ValueError(f"LinkModel.{name}={getattr(self, name)}: must be >= 0")


@dataclass(frozen=True)
class GroupSpan:
    """How a group's members sit on nodes: ``members_per_node`` is the least-populated node's count."""

    size: int
    nodes: int
    members_per_node: int

    @property
    def intra_node(self) -> bool:
        return self.nodes == 1


def group_span(ranks, gpus_per_node: int) -> GroupSpan:
    """Nodes a group of global ``ranks`` spans, with rank r on node r // gpus_per_node."""
    ranks = list(ranks)
    if not ranks:
        raise ValueError("group_span: a group needs at least one rank")
    per_node: dict[int, int] = defaultdict(int)
    for r in ranks:
        per_node[r // gpus_per_node] += 1
    return GroupSpan(len(ranks), len(per_node), min(per_node.values()))


def ring_bandwidth(span: GroupSpan, link: LinkModel, concurrent: int | None = None) -> float:
    """Bytes/s one ring edge of the group gets: NVSwitch inside a node, else its share of the NICs."""
    intra = link.intra_node_gbps * GB
    if span.intra_node:
        return intra
    c = link.gpus_per_node if concurrent is None else concurrent
    return min(intra, span.members_per_node * link.inter_node_gbps * GB / c)


def ring_pass_latency(span: GroupSpan, link: LinkModel, chain: bool = False) -> float:
    """Seconds of latency one pass of n − 1 hops around the group's ring adds.

    A ring that visits each node's members in a row crosses a node boundary on k − 1 of a
    pass's hops (k nodes) and stays on NVLink/NVSwitch for the other n − k, each hop adding
    its own link's latency: NCCL's cost model (``src/graph/tuning.cc``, ``ncclTopoTuneModel``:
    (nsteps − nInterSteps)·intraLat + nInterSteps·interLat, nInterSteps = nNodes − 1 a pass).
    A TP ring of 256 over 16 DGX-2s thus waits on 15 network hops and 240 NVSwitch hops a pass,
    not 255 network hops. A pipelined ``chain`` (reduce, broadcast) NCCL times at the network
    latency on every hop once it leaves the node, and so does this."""
    if span.intra_node:
        return (span.size - 1) * link.intra_latency_us * 1e-6
    if chain:
        return (span.size - 1) * link.inter_latency_us * 1e-6
    inter_hops, intra_hops = span.nodes - 1, span.size - span.nodes
    return (inter_hops * link.inter_latency_us + intra_hops * link.intra_latency_us) * 1e-6


def collective_time(op: str, calls: int, nbytes: float, span: GroupSpan, link: LinkModel,
                    concurrent: int | None = None) -> tuple[float, float]:
    """``(latency_s, bandwidth_s)`` of ``calls`` collectives ``op`` moving ``nbytes`` as recorded."""
    n = span.size
    if n == 1:
        return 0.0, 0.0
    if op in P2P_OPS:
        alpha = (link.intra_latency_us if span.intra_node else link.inter_latency_us) * 1e-6
        return calls * alpha, nbytes / ring_bandwidth(span, link, concurrent)
    if op not in RING_STEPS:
        raise ValueError(f"collective_time: unknown op {op!r}; "
                         f"use one of {sorted(RING_STEPS) + list(P2P_OPS)}")
    latency = calls * RING_STEPS[op] * ring_pass_latency(span, link, chain=op in CHAIN_OPS)
    if op == "all_to_all":
        per_byte = 1 / (link.intra_node_gbps * GB)
        if not span.intra_node:
            c = link.gpus_per_node if concurrent is None else concurrent
            per_byte = max(per_byte, (n - span.members_per_node) / (n - 1) * c / (link.inter_node_gbps * GB))
        return latency, nbytes * per_byte
    ring = 1.0 if op in CHAIN_OPS else (n - 1) / n
    return latency, ring * nbytes / ring_bandwidth(span, link, concurrent)


def default_overlap(overlap_comm: bool, stage: int, microbatches: int = 1, pipeline: bool = False) -> dict[str, float]:
    """Fraction of each ``"op/group"``'s time zerotron hides behind compute, for a ZeRO ``stage``.

    * TP all-reduces sit between the GEMMs that need their result (Megatron-LM §3: g after the
      row-parallel GEMM, f before the column-parallel one): 0. So do pipeline sends/receives
      (1F1B waits on them) and the tied-embedding and world reductions.
    * The DP gradient reduction (stage 0 all-reduce, stages 1-3 reduce-scatter, §5.1-5.2) runs
      asynchronously during backward when ``zero.overlap_comm`` is on (``zero.grad_reduce``): 1,
      else 0 (it waits for the bucket).
    * The stage 1-2 parameter all-gather after the optimizer step has no compute to hide behind
      (§5.1): 0. Stage 3's per-unit gathers are prefetched ahead of use (``zero.stage3``),
      whatever ``overlap_comm`` says, so 1 -- also for hpZ's node-local backward gather.
    * ZeRO++ qgZ's quantized all-to-all is synchronous: 0.

    A bare ``"dp"`` entry serves ``comm`` given as group totals: the share of the DP volume that
    is hideable with one micro-batch per step -- all of it at stages 0 and 3, the reduce-scatter's
    Ψ of the 2Ψ at stages 1-2 (§7.2.1). Per-op keys are exact; prefer them.

    Stages 0-1 reduce only in the last micro-batch's backward, so at most 1/``microbatches`` of
    the reduction has compute beside it (the window is the whole step's backward); in a pipeline
    they reduce after the schedule (``reduce_gradients``), with nothing to hide behind.
    """
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"zero.stage={stage!r}: must be 0, 1, 2 or 3")
    hide = 1.0 if overlap_comm else 0.0
    if stage <= 1:
        hide = 0.0 if pipeline else hide / max(1, microbatches)
    out = {"tp": 0.0, "pp": 0.0, "embedding": 0.0, "world": 0.0, "mp": 0.0, "all_gather/dp": 0.0}
    if stage == 0:
        out["all_reduce/dp"] = out["dp"] = hide
    else:
        out["reduce_scatter/dp"] = hide
        out["dp"] = hide / 2
    if stage == 3:
        out["all_gather/dp"] = out["all_gather/dp_inner"] = 1.0
        out["dp"] = (2 + hide) / 3
    return out


def model_flops_per_gpu(cfg: GPTConfig, global_batch: int, world_size: int, seq: int | None = None,
                        recompute: bool = False, tp: int = 1) -> float:
    """FLOPs one GPU does per step: ``flops_per_iteration`` of the global batch over the world."""
    if world_size < 1:
        raise ValueError(f"world_size={world_size}: must be >= 1")
    return flops_per_iteration(cfg, global_batch, seq, recompute, tp) / world_size


@dataclass
class StepTime:
    """One predicted step. ``comm_s``/``exposed_s``: seconds per group; ``detail``: per group, the
    span, bandwidth and bytes behind its time."""

    flops_per_gpu: float
    compute_s: float
    comm_s: dict[str, float]
    exposed_s: dict[str, float]
    exposed_comm_s: float
    step_s: float
    tflops_per_gpu: float
    detail: dict[str, dict] = field(default_factory=dict)

    @property
    def total_comm_s(self) -> float:
        return sum(self.comm_s.values())

    def rows(self) -> list[list[str]]:
        """A table, header first: term, seconds, exposed seconds, note."""
        out = [["term", "seconds", "exposed", "note"],
               ["compute", f"{self.compute_s:.3f}", f"{self.compute_s:.3f}",
                f"{self.flops_per_gpu / 1e12:.1f} TFLOP per GPU"]]
        for g in sorted(self.comm_s):
            d = self.detail[g]
            where = "intra-node" if d["nodes"] == 1 else f"{d['nodes']} nodes, {d['members_per_node']}/node"
            out.append([g, f"{self.comm_s[g]:.3f}", f"{self.exposed_s[g]:.3f}",
                        f"{d['bytes'] / GB:.2f} GB in {d['calls']} calls, {d['size']} GPUs {where}, "
                        f"{d['bandwidth_gbps']:.2f} GB/s"])
        out.append(["step", f"{self.step_s:.3f}", f"{self.exposed_comm_s:.3f}",
                    f"{self.tflops_per_gpu:.1f} TFLOPs/GPU"])
        return out

    def as_dict(self) -> dict:
        return asdict(self) | {"total_comm_s": self.total_comm_s}


def _split_key(key: str) -> tuple[str | None, str]:
    if "/" in key:
        op, group = key.split("/", 1)
        return op, group
    return None, key


def predict_step(flops_per_gpu: float, comm: dict[str, dict[str, int]], group_ranks: dict[str, list[int]],
                 link: LinkModel = LinkModel(), peak_tflops: float = V100_PEAK_TFLOPS,
                 efficiency: float = DEFAULT_EFFICIENCY, overlap: dict[str, float] | None = None,
                 overlap_window: float = BACKWARD_SHARE, concurrent: dict[str, int] | None = None,
                 compute_s: float | None = None) -> StepTime:
    """Predict one step of one rank from its FLOPs and its recorded collectives.

    ``comm``: ``{"group" or "op/group": {"calls", "bytes"}}``; ``group_ranks``: this rank's
    groups as global ranks. ``efficiency`` is the fraction of ``peak_tflops`` the step's GEMMs
    sustain; the default 0.5 is a large-GEMM figure (fp16 cuBLAS GEMMs of these widths reach
    60-70% of V100 peak, less the softmax, GeLU, LayerNorm and dropout kernels the FLOP count
    leaves out). Megatron-LM's whole-step 39 TF on one V100 (30% of peak, h = 1536) is the low
    end; calibrate it to a measured single-GPU step where one exists. ``overlap`` (default
    nothing hidden; see ``default_overlap``) and ``overlap_window`` as in the module docstring;
    ``concurrent`` overrides, per group, how many GPUs of a node share its NICs. ``compute_s``,
    when given, replaces the FLOPs-over-peak compute time (``estimate.step_model`` times each
    kernel by its own roofline and passes the sum).
    """
    if flops_per_gpu < 0 or peak_tflops <= 0 or not 0 < efficiency <= 1:
        raise ValueError(f"predict_step: flops_per_gpu={flops_per_gpu} must be >= 0, peak_tflops={peak_tflops} "
                         f"> 0 and efficiency={efficiency} in (0, 1]")
    if overlap_window < 0:
        raise ValueError(f"predict_step: overlap_window={overlap_window} must be >= 0")
    overlap, concurrent = overlap or {}, concurrent or {}
    if compute_s is None:
        compute_s = flops_per_gpu / (peak_tflops * 1e12 * efficiency)

    by_group: dict[str, dict[str, dict[str, float]]] = defaultdict(dict)
    for key, count in comm.items():
        op, group = _split_key(key)
        if group not in group_ranks:
            raise ValueError(f"predict_step: comm has group {group!r} but group_ranks has only "
                             f"{sorted(group_ranks)}; pass that group's global ranks")
        if op is None:
            op = "p2p" if group in P2P_GROUPS else "all_reduce"
        if op in by_group[group]:
            raise ValueError(f"predict_step: {op}/{group} is counted twice in comm; key a group either by "
                             f"its name (totals) or by 'op/{group}', not both")
        by_group[group][op] = {"calls": count.get("calls", 0), "bytes": count.get("bytes", 0)}

    comm_s, want_hidden, detail = {}, {}, {}
    for group, ops in by_group.items():
        span = group_span(group_ranks[group], link.gpus_per_node)
        conc = concurrent.get(group)
        calls = sum(c["calls"] for c in ops.values())
        nbytes = sum(c["bytes"] for c in ops.values())
        if "p2p" in ops:
            total = ops.pop("p2p")
            ops["send"] = ops["recv"] = {"calls": total["calls"] / 2, "bytes": total["bytes"] / 2}
        timed = [(op, c["calls"], c["bytes"]) for op, c in ops.items() if op not in P2P_OPS]
        p2p = [ops[o] for o in P2P_OPS if o in ops]
        if p2p:
            timed.append(("send", max(c["calls"] for c in p2p), max(c["bytes"] for c in p2p)))
        t_group = hidden = 0.0
        for op, n_calls, n_bytes in timed:
            t = sum(collective_time(op, n_calls, n_bytes, span, link, conc))
            f = overlap.get(f"{op}/{group}", overlap.get(group, 0.0))
            if op == "send":
                f = min(overlap.get(f"send/{group}", f), overlap.get(f"recv/{group}", f))
            if not 0 <= f <= 1:
                raise ValueError(f"predict_step: overlap for {op}/{group} is {f}; must be in [0, 1]")
            t_group += t
            hidden += t * f
        comm_s[group], want_hidden[group] = t_group, hidden
        detail[group] = {"size": span.size, "nodes": span.nodes, "members_per_node": span.members_per_node,
                         "bandwidth_gbps": ring_bandwidth(span, link, conc) / GB, "calls": calls, "bytes": nbytes}

    total_want = sum(want_hidden.values())
    cap = overlap_window * compute_s
    scale = 1.0 if total_want <= cap else cap / total_want
    exposed_s = {g: comm_s[g] - want_hidden[g] * scale for g in comm_s}
    exposed = sum(exposed_s.values())
    step_s = compute_s + exposed
    tflops = flops_per_gpu / step_s / 1e12 if step_s > 0 else 0.0
    return StepTime(flops_per_gpu, compute_s, comm_s, exposed_s, exposed, step_s, tflops, detail)
