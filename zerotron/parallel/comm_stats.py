"""Counters of every collective: calls, elements and bytes per (operation, group).

Volumes are counted the way the ZeRO paper counts them (§7): a reduce-scatter or an all-gather
of a Ψ-element tensor moves Ψ elements per rank, an all-reduce 2Ψ (a reduce-scatter followed by
an all-gather), a broadcast Ψ, a send or a receive the elements sent or received, an all-to-all
the elements that leave the rank ((n-1)/n of the tensor: its own block stays local). With these
rules plain data parallelism costs 2Ψ per step, Pos and Pos+g 2Ψ and Pos+g+p 3Ψ, which the ZeRO
tests check against these counters.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from zerotron.parallel.wait_clock import WaitClock

# How many "Ψ" a rank moves per element of the full tensor, per operation (ZeRO §7).
VOLUME_FACTOR = {
    "all_reduce": 2,
    "reduce_scatter": 1,
    "all_gather": 1,
    "broadcast": 1,
    "all_to_all": 1,  # recorded with the elements that leave the rank: (n-1)/n of the tensor
    "send": 1,
    "recv": 1,
}


@dataclass
class OpCount:
    calls: int = 0
    elements: int = 0
    bytes: int = 0


class CommStats:
    """Accumulates counts per ``(op, group_name)``; read a window with ``since(snapshot())``.

    The grid's counters are shared by the optimizer, the trainer and the tests, so they are
    only ever differenced; ``reset()`` is for a ``CommStats`` its caller owns alone."""

    def __init__(self) -> None:
        self._counts: dict[tuple[str, str], OpCount] = defaultdict(OpCount)
        self.waits = WaitClock()  # time blocked in these collectives (straggler detection)

    def record(self, op: str, group_name: str, numel: int, element_size: int) -> None:
        """Record one call; ``numel`` is the full tensor the paper's Ψ refers to."""
        factor = VOLUME_FACTOR[op]
        entry = self._counts[(op, group_name)]
        entry.calls += 1
        entry.elements += factor * numel
        entry.bytes += factor * numel * element_size

    def get(self, op: str, group_name: str) -> OpCount:
        return self._counts.get((op, group_name), OpCount())

    def total(self, group_name: str | None = None, op: str | None = None) -> OpCount:
        """Sum over every entry matching the given group and/or op (None matches all)."""
        out = OpCount()
        for (o, g), c in self._counts.items():
            if (group_name is None or g == group_name) and (op is None or o == op):
                out.calls += c.calls
                out.elements += c.elements
                out.bytes += c.bytes
        return out

    def snapshot(self) -> dict[str, dict[str, int]]:
        """``{"<op>/<group>": {"calls", "elements", "bytes"}}``, ready for JSON logging."""
        return {f"{o}/{g}": vars(c).copy() for (o, g), c in sorted(self._counts.items())}

    def bytes_by_group(self) -> dict[str, int]:
        out: dict[str, int] = defaultdict(int)
        for (_, g), c in self._counts.items():
            out[g] += c.bytes
        return dict(out)

    def since(self, mark: dict[str, dict[str, int]]) -> "CommStats":
        """The counts recorded after ``mark`` (an earlier ``snapshot()``). Readers measure their own
        window this way, so no reader clears counters another one is differencing."""
        out = CommStats()
        for key, now in self.snapshot().items():
            before = mark.get(key, {})
            delta = {k: v - before.get(k, 0) for k, v in now.items()}
            if delta["calls"]:
                op, group_name = key.split("/", 1)
                out._counts[(op, group_name)] = OpCount(**delta)
        return out

    def reset(self) -> None:
        self._counts.clear()
