"""The grid of process groups: tensor (TP) x context (CP) x data (DP) x pipeline (PP) parallelism.

Rank order follows Megatron-LM: TP ranks are adjacent (fastest varying), then CP, then DP, then PP,

    rank = tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank))

so a TP group -- which all-reduces twice per transformer block forward and twice backward
(Megatron-LM §3) -- stays inside one node, the CP ring (K/V passed every attention) next to it,
and a DP group takes the GPUs at the same position in each model-parallel group (ZeRO §10.1's
MP x DP layout). Parameters are replicated over CP as over DP, so their gradients are reduced,
and ZeRO partitions, over the data-parallel-with-CP group (Megatron's ``dp_cp``: the ranks
sharing tp_rank and pp_rank); with cp = 1 that group is the DP group itself and every rank's
mapping is the 3D grid's.

Every group is created once, by every rank, in the same order, and cached by its tuple of ranks
(identical tuples share one torch group). Every group gets the default group's collective timeout
(``runtime.group_timeout``): a rank frozen inside a TP, DP or PP group must fail its peers as
fast as one in the world group, or the heartbeats that name it never get asked. Code receives
the ``Grid``; there are no module-level group globals.
"""

from __future__ import annotations

import dataclasses
import datetime
from dataclasses import dataclass, field

import torch.distributed as dist

from zerotron.parallel.comm_stats import CommStats
from zerotron.parallel.health import Health
from zerotron.parallel.pipeline_schedules import PipelineSchedule
from zerotron.parallel.runtime import group_timeout


@dataclass
class ParallelDims:
    """Sizes of the parallel axes; ``dp=None`` (or -1) means "whatever the world leaves".

    ``cp`` (context parallelism, Megatron's ``--context-parallel-size``) splits every sequence
    into 2·cp chunks, rank i of the CP group holding chunks i and 2·cp-1-i
    (``parallel.context_parallel``); 1: none.

    ``pipeline_schedule`` ("1f1b" or "afab", see ``parallel.pipeline``) travels with the sizes: it
    is part of the same plan (it sets how many micro-batches a stage holds), not of the grid; so
    does ``sequence_parallel`` (the TP group also splits the sequence outside its GEMMs;
    Korthikanti et al. 2022, ``parallel.sequence_parallel``), which needs tp > 1; and
    ``virtual_stages`` (model chunks per pipeline rank: v > 1 is the interleaved 1F1B schedule,
    ``parallel.pipeline_schedules``), which needs pp > 1. The docstring under each field is its
    one line of the run config's ``--help`` (``zerotron.config.fields``)."""

    tp: int = 1
    """tensor-parallel size (Megatron; keep it inside a node)"""
    pp: int = 1
    """pipeline-parallel stages"""
    dp: int | None = None
    """data-parallel size; null or -1: world / (tp x cp x pp)"""
    cp: int = 1
    """context-parallel size: each sequence split over cp ranks, ring attention; 1: none"""
    pipeline_schedule: PipelineSchedule = "1f1b"
    """1f1b (PipeDream-Flush) or afab (all forward, all backward)"""
    sequence_parallel: bool = False
    """split LayerNorm/dropout/residual along the sequence over TP (tp > 1)"""
    virtual_stages: int = 1
    """model chunks per pipeline rank: > 1 is interleaved 1F1B (pp >= 2); 1: none"""

    def resolve(self, world_size: int) -> "ParallelDims":
        """Validate the sizes against ``world_size`` and fill in ``dp``; raises before any collective."""
        for name in ("tp", "pp", "cp"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"parallel.{name}={value!r}: must be a positive integer")
        if world_size < 1:
            raise ValueError(f"world_size={world_size}: must be >= 1")
        v = self.virtual_stages
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"parallel.virtual_stages={v!r}: must be a positive integer (1: no interleaving)")
        if v > 1 and (self.pp < 2 or self.pipeline_schedule != "1f1b"):
            raise ValueError(f"parallel.virtual_stages={v} is the interleaved 1F1B schedule: it needs parallel.pp >= 2 "
                             f"and parallel.pipeline_schedule=1f1b (got pp={self.pp}, "
                             f"{self.pipeline_schedule}); set those or virtual_stages=1")
        if not isinstance(self.sequence_parallel, bool):
            raise ValueError(f"parallel.sequence_parallel={self.sequence_parallel!r}: must be true or false")
        if self.sequence_parallel and self.tp == 1:
            raise ValueError("parallel.sequence_parallel=true with parallel.tp=1: there is no TP group to split "
                             "the sequence over; set parallel.tp > 1 or turn sequence_parallel off")
        mp = self.tp * self.cp * self.pp
        if world_size % mp:
            if self.cp == 1:
                raise ValueError(f"parallel.tp*parallel.pp={self.tp}*{self.pp}={mp} does not divide the "
                                 f"{world_size} processes; pick tp and pp whose product divides the world size")
            raise ValueError(f"parallel.tp*parallel.cp*parallel.pp={self.tp}*{self.cp}*{self.pp}={mp} does not "
                             f"divide the {world_size} processes; pick tp, cp and pp whose product divides "
                             f"the world size")
        dp = world_size // mp
        if self.dp not in (None, -1):
            if not isinstance(self.dp, int) or self.dp < 1:
                raise ValueError(f"parallel.dp={self.dp!r}: must be a positive integer or -1 (infer)")
            if self.dp != dp:
                sizes = "tp*pp" if self.cp == 1 else "tp*cp*pp"
                raise ValueError(f"parallel.dp={self.dp} but world_size/({sizes})={dp}; set dp={dp} or leave it "
                                 f"unset")
        return dataclasses.replace(self, dp=dp)


def layout(dims: ParallelDims) -> dict[str, list[tuple[int, ...]]]:
    """All groups of each kind, as tuples of global ranks; pure arithmetic, no torch.distributed."""
    tp, pp, dp, cp = dims.tp, dims.pp, dims.dp, dims.cp
    assert dp is not None, "resolve() the dims first"

    def rank(t: int, c: int, d: int, p: int) -> int:
        return t + tp * (c + cp * (d + dp * p))

    # (d, c) pairs in rank order: a data-parallel-with-CP group's members, CP fastest
    dcs = [(d, c) for d in range(dp) for c in range(cp)]
    return {
        "tp": [tuple(rank(t, c, d, p) for t in range(tp)) for p in range(pp) for d, c in dcs],
        "cp": [tuple(rank(t, c, d, p) for c in range(cp)) for p in range(pp) for d in range(dp)
               for t in range(tp)],
        "dp": [tuple(rank(t, c, d, p) for d in range(dp)) for p in range(pp) for c in range(cp)
               for t in range(tp)],
        "dp_cp": [tuple(rank(t, c, d, p) for d, c in dcs) for p in range(pp) for t in range(tp)],
        "pp": [tuple(rank(t, c, d, p) for p in range(pp)) for d, c in dcs for t in range(tp)],
        "mp": [tuple(rank(t, c, d, p) for p in range(pp) for t in range(tp)) for d, c in dcs],
        # First and last stage share the tied word embedding (Megatron's embedding group).
        "embedding": [tuple(sorted({rank(t, c, d, 0), rank(t, c, d, pp - 1)})) for d, c in dcs
                      for t in range(tp)],
        "world": [tuple(range(tp * cp * pp * dp))],
    }


def split_blocks(ranks: tuple[int, ...], inner_size: int) -> list[tuple[int, ...]]:
    """``ranks`` cut into consecutive blocks of ``inner_size``: ``split_group``'s inner groups."""
    return [ranks[i:i + inner_size] for i in range(0, len(ranks), inner_size)]


@dataclass
class Group:
    """One process group as this rank sees it: name, member ranks, this rank's index, counters."""

    name: str
    ranks: tuple[int, ...]
    pg: object  # torch ProcessGroup (None for the default world group)
    stats: CommStats = field(repr=False)
    health: Health | None = field(default=None, repr=False)

    @property
    def size(self) -> int:
        return len(self.ranks)

    def rank_of(self, global_rank: int) -> int:
        return self.ranks.index(global_rank)


class Grid:
    """This rank's place in the TP x CP x DP x PP grid and the process groups along each axis."""

    def __init__(self, dims: ParallelDims, rank: int | None = None, world_size: int | None = None,
                 timeout: datetime.timedelta | float | None = None):
        """``timeout`` (seconds or a timedelta) bounds every collective of the groups made here and
        arms the health watchdog; None: the default group's (``ZEROTRON_COLLECTIVE_TIMEOUT``
        under ``init_distributed``)."""
        world_size = dist.get_world_size() if world_size is None else world_size
        self.dims = dims.resolve(world_size)
        self.rank = dist.get_rank() if rank is None else rank
        self.world_size = world_size
        if timeout is None:
            timeout = group_timeout()
        self.timeout = timeout if isinstance(timeout, datetime.timedelta) else datetime.timedelta(seconds=timeout)
        self.stats = CommStats()
        self.health = Health(self.rank, world_size, timeout_s=self.timeout.total_seconds())
        tp, dp, cp = self.dims.tp, self.dims.dp, self.dims.cp
        self.tp_rank = self.rank % tp
        self.cp_rank = (self.rank // tp) % cp
        self.dp_rank = (self.rank // (tp * cp)) % dp
        self.pp_rank = self.rank // (tp * cp * dp)
        self._cache: dict[tuple[int, ...], object] = {}
        self._split_cache: dict[tuple[str, int], tuple[Group, Group]] = {}
        groups = {}
        for kind, all_groups in layout(self.dims).items():
            if cp == 1 and kind in ("cp", "dp_cp"):
                continue  # without CP no group is made for it: the 3D grid's groups, unchanged
            for ranks in all_groups:  # every rank creates every group, in the same order
                pg = self._new_group(ranks)
                if self.rank in ranks:
                    groups[kind] = Group(kind, ranks, pg, self.stats, self.health)
        self.tp_group: Group = groups["tp"]
        self.dp_group: Group = groups["dp"]
        # the ring of context parallelism; without it this rank alone, a group no collective
        # reaches torch with (a size-1 group returns at once in ``collectives``)
        self.cp_group: Group = groups["cp"] if cp > 1 else Group("cp", (self.rank,), None, self.stats,
                                                                   self.health)
        # gradients' reduction and ZeRO's partition: DP x CP (Megatron's data-parallel-with-CP
        # group); the DP group itself when cp = 1, so its counters keep the name "dp"
        self.dp_cp_group: Group = groups["dp_cp"] if cp > 1 else self.dp_group
        self.pp_group: Group = groups["pp"]
        self.mp_group: Group = groups["mp"]
        self.world_group: Group = groups["world"]
        # Only first/last-stage ranks are members of an embedding group.
        self.embedding_group: Group | None = groups.get("embedding")
        if self.embedding_group is not None and not (self.is_first_stage or self.is_last_stage):
            self.embedding_group = None
        if self.pp_group.size > 1:
            # NCCL requires every member of a group in its first call when that call is a batched
            # p2p (the pipeline's first exchange involves two stages only): meet once here.
            dist.barrier(group=self.pp_group.pg)

    def close(self) -> None:
        """Stop this grid's heartbeat thread (call before ``destroy_process_group``)."""
        self.health.close()

    def split_group(self, kind: str, inner_size: int) -> tuple[Group, Group]:
        """Split every group of ``kind`` (e.g. ``"dp"``) into consecutive blocks of ``inner_size``.

        Returns this rank's ``(inner, outer)`` groups: ``inner`` holds the ``inner_size`` members
        next to it (the GPUs of one node when ``inner_size`` = GPUs per node, as ZeRO++ hpZ/qgZ
        assume), ``outer`` the members at the same position of every block. Collective: every
        rank must call it with the same arguments; groups are created once and cached.
        """
        all_groups = layout(self.dims)[kind]
        size = len(all_groups[0])
        if inner_size < 1 or size % inner_size:
            raise ValueError(f"cannot split {kind} groups of size {size} into blocks of {inner_size}; "
                             f"use a divisor of {size}")
        key = (kind, inner_size)
        if key not in self._split_cache:
            mine = None
            for ranks in all_groups:
                blocks = split_blocks(ranks, inner_size)
                inner = [(f"{kind}_inner", b) for b in blocks]
                outer = [(f"{kind}_outer", tuple(b[j] for b in blocks)) for j in range(inner_size)]
                for name, members in inner + outer:  # every rank creates every group, same order
                    pg = self._new_group(members)
                    if self.rank in members:
                        mine = mine or {}
                        mine[name] = Group(name, members, pg, self.stats, self.health)
            self._split_cache[key] = (mine[f"{kind}_inner"], mine[f"{kind}_outer"])
        return self._split_cache[key]

    def _new_group(self, ranks: tuple[int, ...]):
        if len(ranks) == self.world_size:
            return None  # the default group
        if ranks not in self._cache:
            self._cache[ranks] = dist.new_group(list(ranks), timeout=self.timeout)
        return self._cache[ranks]

    # sizes and coordinates -------------------------------------------------------------------
    @property
    def tp_size(self) -> int:
        return self.dims.tp

    @property
    def pp_size(self) -> int:
        return self.dims.pp

    @property
    def dp_size(self) -> int:
        return self.dims.dp

    @property
    def cp_size(self) -> int:
        return self.dims.cp

    @property
    def dp_cp_size(self) -> int:
        """Replicas of every parameter: dp x cp, the size ZeRO partitions over."""
        return self.dims.dp * self.dims.cp

    @property
    def mp_size(self) -> int:
        return self.dims.tp * self.dims.pp

    @property
    def mp_rank(self) -> int:
        return self.mp_group.rank_of(self.rank)

    @property
    def coords(self) -> dict[str, int]:
        if self.dims.cp == 1:
            return {"tp": self.tp_rank, "dp": self.dp_rank, "pp": self.pp_rank}
        return {"tp": self.tp_rank, "cp": self.cp_rank, "dp": self.dp_rank, "pp": self.pp_rank}

    # pipeline neighbours ---------------------------------------------------------------------
    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.dims.pp - 1

    @property
    def next_pp_rank(self) -> int | None:
        """Global rank of the next pipeline stage, None on the last stage."""
        return None if self.is_last_stage else self.pp_group.ranks[self.pp_rank + 1]

    @property
    def prev_pp_rank(self) -> int | None:
        """Global rank of the previous pipeline stage, None on the first stage."""
        return None if self.is_first_stage else self.pp_group.ranks[self.pp_rank - 1]

    def __repr__(self) -> str:
        cp = f", cp={self.cp_size}" if self.cp_size > 1 else ""
        return (f"Grid(rank={self.rank}, tp={self.tp_size}{cp}, pp={self.pp_size}, dp={self.dp_size}, "
                f"coords={self.coords})")
