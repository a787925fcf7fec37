"""Flat, padded partitions of the parameters and the index that describes them (ZeRO §5).

The parameters are concatenated into one *full* flat space, in ``groups`` (one group for stages
0-2; one per gather unit for Pos+g+p, so a unit is gathered by all-gathering its own chunks).
Each group is cut into *chunks* of at most ``chunk_size`` elements (CB, §6.2: the reduce and
all-gather buckets never grow with the model), and every chunk is padded to a multiple of the
number of shards. Rank ``r`` owns shard ``r`` of every chunk; its *partition* is the
concatenation of those shards, so every DP rank holds exactly the same number of elements and a
chunk's gradient is reduce-scattered straight into the owners' shards (Pos+g, §5.2).

Stage 0 uses one shard (every rank owns everything), which keeps one code path for all stages.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Piece:
    """Elements ``[start, end)`` of flattened parameter ``param`` placed at ``offset`` inside a chunk."""

    param: int
    start: int
    end: int
    offset: int


@dataclass
class Chunk:
    index: int
    group: int
    offset: int        # first element in the full flat space
    numel: int         # padded: a multiple of the shard count
    shard: int         # elements each rank owns = numel // shards
    part_offset: int   # where this rank's shard starts in its partition
    pieces: list[Piece] = field(default_factory=list)


@dataclass
class Group:
    index: int
    params: list[int]
    offset: int
    numel: int
    chunks: list[int]
    persistent: bool = False


class Layout:
    """Where every parameter element lives in the full flat space and in each rank's partition."""

    def __init__(self, shapes: list[torch.Size], groups: list[list[int]], shards: int, rank: int,
                 chunk_size: int, persistent: list[bool] | None = None):
        if chunk_size < shards:
            raise ValueError(f"bucket size {chunk_size} is smaller than the DP size {shards}; raise "
                             f"reduce_bucket_size / allgather_bucket_size")
        self.shapes, self.shards, self.rank = list(shapes), shards, rank
        self.numels = [int(torch.Size(s).numel()) for s in shapes]
        chunk_size -= chunk_size % shards
        self.param_offset = [0] * len(shapes)
        self.param_group = [0] * len(shapes)
        self.param_chunks: list[list[int]] = [[] for _ in shapes]
        self.groups: list[Group] = []
        self.chunks: list[Chunk] = []
        offset = part = 0
        for gi, members in enumerate(groups):
            group = Group(gi, list(members), offset, 0, [], bool(persistent and persistent[gi]))
            local = 0  # position inside the group
            for p in members:
                self.param_offset[p], self.param_group[p] = offset + local, gi
                local += self.numels[p]
            n_chunks = max(1, -(-local // chunk_size))
            for k in range(n_chunks):
                lo = k * chunk_size
                hi = min(local, lo + chunk_size)
                numel = -(-(hi - lo) // shards) * shards if hi > lo else shards
                c = Chunk(len(self.chunks), gi, offset + lo, numel, numel // shards, part)
                part += c.shard
                group.chunks.append(c.index)
                self.chunks.append(c)
            # pieces: intersect each parameter with each chunk of its group
            for p in members:
                a, b = self.param_offset[p], self.param_offset[p] + self.numels[p]
                for ci in group.chunks:
                    c = self.chunks[ci]
                    lo, hi = max(a, c.offset), min(b, c.offset + c.numel)
                    if lo < hi:
                        c.pieces.append(Piece(p, lo - a, hi - a, lo - c.offset))
                        self.param_chunks[p].append(ci)
            last = self.chunks[group.chunks[-1]]
            group.numel = last.offset + last.numel - offset
            offset += group.numel
            self.groups.append(group)
        self.full_numel, self.part_numel = offset, part

    # ranges ---------------------------------------------------------------------------------------
    def gather_pairs(self, g: int, buf: torch.Tensor, src: torch.Tensor, base: int):
        """``(full chunk view in buf, this rank's shard in src)`` per chunk of group ``g``: what a
        stage-3 all-gather of the group fills and sends (``src`` holds the partition from ``base``)."""
        group = self.groups[g]
        for ci in group.chunks:
            c = self.chunks[ci]
            yield (buf[c.offset - group.offset:c.offset - group.offset + c.numel],
                   src[c.part_offset - base:c.part_offset - base + c.shard])

    def own_range(self, chunk: Chunk, rank: int | None = None) -> tuple[int, int]:
        """This rank's shard of ``chunk``, in full-flat coordinates."""
        r = self.rank if rank is None else rank
        lo = chunk.offset + r * chunk.shard
        return lo, lo + chunk.shard

    def shard_pieces(self, chunk: Chunk, rank: int | None = None):
        """Yield ``(param, start, end, shard_offset)`` for parameter elements inside this rank's shard."""
        r = self.rank if rank is None else rank
        lo, hi = r * chunk.shard, (r + 1) * chunk.shard
        for pc in chunk.pieces:
            a, b = max(lo, pc.offset), min(hi, pc.offset + pc.end - pc.start)
            if a < b:
                yield pc.param, pc.start + a - pc.offset, pc.start + b - pc.offset, a - lo

    def segments(self, chunk: Chunk, keep) -> list[tuple[int, int]]:
        """Merged ``[a, b)`` ranges of this rank's shard whose parameter satisfies ``keep(param)``."""
        out: list[list[int]] = []
        for p, s, e, off in self.shard_pieces(chunk):
            if keep(p):
                if out and out[-1][1] == off:
                    out[-1][1] = off + e - s
                else:
                    out.append([off, off + e - s])
        return [(a, b) for a, b in out]

    def partition_index(self, names: list[str]) -> list[tuple[str, int, int, int]]:
        """``(param_name, start, end, flat_offset)``: element range of a parameter at an offset of this partition."""
        out = []
        for c in self.chunks:
            for p, s, e, off in self.shard_pieces(c):
                out.append((names[p], s, e, c.part_offset + off))
        return out

    def param_view(self, flat: torch.Tensor, p: int) -> torch.Tensor:
        """Parameter ``p`` as a view of a full flat buffer (or of a group buffer starting at its group)."""
        start = self.param_offset[p]
        if flat.numel() != self.full_numel:
            start -= self.groups[self.param_group[p]].offset
        return flat.narrow(0, start, self.numels[p]).view(self.shapes[p])  # narrow: no index parsing
