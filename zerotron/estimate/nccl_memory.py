"""Device memory of the NCCL communicators a rank builds: buffers outside torch's allocator.

Every process group a rank is a member of becomes one NCCL communicator on its GPU, and each
communicator allocates its own transfer buffers (identical rank tuples share one group:
``Grid._new_group`` caches them). ``torch.cuda.memory_allocated`` never sees these bytes, so
they are a line of their own in the memory model (``nccl_communicators``), counted in what must
fit the device (``total``) but not in ``before_margin``, the figure the allocator and the dry
run's tracker measure. On gloo (a CPU run) there are none.

Per connection (one peer, one channel) NCCL holds a buffer per protocol, at its defaults:
``LL`` 512 KiB, ``LL128`` 4,915,200 B (120-byte lines) and ``Simple`` ``NCCL_BUFFSIZE`` = 4 MiB,
9.19 MiB together (each channel has its own buffers for collectives: NVIDIA/nccl#1450; 9.19 MiB
per proxy connection, in pinned host memory for a network peer, is what a vLLM deployment
measured: tonyd2wild/DeepSeek-V4.1-Flash-vLLM-DGX-Spark#8). A collective communicator
connects, per channel, its ring neighbour and its tree neighbours: ring 1, tree 2 (1 for a
2-rank group, where the tree is the ring's one peer). Memory grows linearly with the
channels and, for rings, not with the group's size (sjeaugey, NVIDIA/nccl#986). ``CHANNELS`` is
24: with it a >2-rank group comes to 3 x 24 x 9.19 MiB = 694 MB against the 688 MB measured per
group on 4 NVLink A100s (NVIDIA/nccl#964; 462 MB against 544 MB for 2-rank groups).
Point-to-point (the pipeline's and the CP ring's ``batch_isend_irecv``) uses one shared Simple
buffer per peer per p2p channel (NVIDIA/nccl#1450), ``P2P_CHANNELS`` of them per peer
(``NCCL_NCHANNELS_PER_NET_PEER``'s default 2), each way.
The figure is an estimate of the buffers at NCCL's defaults: ``NCCL_BUFFSIZE``,
``NCCL_MIN/MAX_NCHANNELS``, NVLS/CollNet and ``ncclCommSplit`` resource sharing all move it.
"""

from __future__ import annotations

LL_BYTES = 512 << 10         # NCCL's DEFAULT_LL_BUFFSIZE: 8 lines x 512 threads x 8 steps x 16 B
LL128_BYTES = 4_915_200      # DEFAULT_LL128_BUFFSIZE: 120 elements x 640 threads x 8 steps x 8 B
SIMPLE_BYTES = 4 << 20       # NCCL_BUFFSIZE's default (docs: "Environment Variables")
CONNECTION_BYTES = LL_BYTES + LL128_BYTES + SIMPLE_BYTES  # 9.19 MiB: one peer on one channel
CHANNELS = 24                # collective channels per communicator (see the docstring)
P2P_CHANNELS = 2             # p2p channels per peer (NCCL_NCHANNELS_PER_NET_PEER's default)


def member_group_sizes(tp: int, cp: int, dp: int, pp: int, pipeline_rank: int = 0,
                       hpz: int = 1, qgz: int = 1) -> dict[str, int]:
    """Size of each distinct group (size > 1) a rank of the TP x CP x DP x PP grid is a member of.

    Groups whose rank tuples coincide are one communicator: mp is tp without a pipeline, the
    embedding group (first and last stage) is the pp group at pp = 2, mp is pp without TP,
    dp_cp is dp without CP and cp with dp = 1,
    and any group holding the whole world is the default one. hpZ / qgZ split the DP group into
    node-local blocks of ``hpz`` / ``qgz`` members and the groups across them (only for
    1 < k < dp; equal sizes share the groups)."""
    world = tp * cp * dp * pp
    sizes = {"tp": tp, "dp": dp, "dp_cp": dp * cp if cp > 1 and dp > 1 else 1, "pp": pp,
             "mp": tp * pp if tp > 1 and pp > 1 else 1, "cp": cp,
             "embedding": 2 if pp > 2 and pipeline_rank in (0, pp - 1) else 1}
    for name, k in (("hpz", hpz), ("qgz", qgz if qgz != hpz else 1)):
        if 1 < k < dp:
            sizes[f"{name}_inner"], sizes[f"{name}_outer"] = k, dp // k
    out = {name: n for name, n in sizes.items() if 1 < n < world}
    if world > 1:
        out["world"] = world
    return out


def collective_bytes(size: int, channels: int = CHANNELS) -> int:
    """Buffers of one communicator of ``size`` ranks: ring and tree peers on every channel."""
    if size < 2:
        return 0
    return channels * (1 + (1 if size == 2 else 2)) * CONNECTION_BYTES


def p2p_bytes(size: int, position: int) -> int:
    """Point-to-point buffers for the neighbours a member at ``position`` of a chain of ``size``
    exchanges with (a pipeline: the previous and next stage; a CP ring: both ring neighbours)."""
    peers = 0 if size < 2 else 1 if size == 2 or position in (0, size - 1) else 2
    return peers * P2P_CHANNELS * SIMPLE_BYTES * 2  # send and receive


def communicator_bytes(setup) -> dict:
    """``{"groups": {name: size}, "bytes": total}`` for a memory-model ``Setup``; 0 off NCCL."""
    return grid_communicators(setup.tp, setup.cp, setup.dp, setup.pp, setup.pipeline_rank,
                              setup.hpz_partition_size, setup.qgz_node_size,
                              nccl=setup.backend == "nccl" and setup.device == "cuda")


def run_communicators(cfg, gpus: int, rank: int, nccl: bool = True) -> dict:
    """``grid_communicators`` of global ``rank`` for a validated ``RunConfig`` on ``gpus`` GPUs
    (the dry run's: it covers offloaded runs, which ``Setup`` does not)."""
    par, z = cfg.parallel, cfg.zero
    per_stage = gpus // par.pp  # PP is the outermost axis: tp x cp x dp ranks a stage
    qgz = z.qgz_node_size if z.zero_quantized_gradients else 1
    return grid_communicators(par.tp, par.cp, per_stage // (par.tp * par.cp), par.pp,
                              rank // per_stage, z.zero_hpz_partition_size, qgz, nccl)


def grid_communicators(tp: int, cp: int, dp: int, pp: int, pipeline_rank: int = 0, hpz: int = 1,
                       qgz: int = 1, nccl: bool = True) -> dict:
    """The groups of ``member_group_sizes`` and their buffers' bytes (0 unless ``nccl``)."""
    groups = member_group_sizes(tp, cp, dp, pp, pipeline_rank, hpz, qgz)
    if not nccl:
        return {"groups": groups, "bytes": 0}
    total = sum(collective_bytes(n) for n in groups.values())
    total += p2p_bytes(pp, pipeline_rank)
    total += p2p_bytes(cp, 1 if cp > 2 else 0)  # a ring: every member has two peers
    return {"groups": groups, "bytes": total}
