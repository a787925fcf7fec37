"""The default size of stage 3's prefetch window: one unit ahead, as FSDP2's forward prefetch.

The window (``ParamGatherer._prefetch``) bounds the groups gathered or in flight ahead of the
running unit. DeepSpeed's default, 5e7 elements, is a fixed number that means 7 blocks of a
768-wide GPT and a third of one at 12288: what it holds depends on the model. One unit ahead is
what overlap needs -- the next unit's all-gather runs while the current one computes -- and
costs one unit's gathered parameters whatever the model, which the memory model can predict.
"""

from __future__ import annotations


def unit_gathered_numel(layout, unit_groups: list[list[int]], u: int,
                        skip: set[int] = frozenset()) -> int:
    """Elements unit ``u`` gathers when it runs: its non-persistent groups, padded as they are
    all-gathered (``partition.Layout``: chunks padded to the shards), less those in ``skip``."""
    return sum(layout.groups[g].numel for g in unit_groups[u]
               if not layout.groups[g].persistent and g not in skip)


def one_unit_window(layout, units: list, unit_groups: list[list[int]], model) -> int:
    """The largest unit a prefetch can reach: every unit but the root (the model itself, gathered
    by its own pre-hook before any other unit runs), less the groups it shares with the root (a
    tied weight stays gathered with the root). 0 when the root is the only unit."""
    root = next((u for u, m in enumerate(units) if m is model), None)
    held = set(unit_groups[root]) if root is not None else set()
    sizes = [unit_gathered_numel(layout, unit_groups, u, held)
             for u in range(len(units)) if u != root]
    return max(sizes, default=0)
