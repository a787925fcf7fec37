"""How the optimizer's parameters are grouped into its flat layout (``partition.Layout``)."""

from __future__ import annotations

from zerotron.zero.stage3 import default_units, unit_params


def plan_groups(model, params, names, grid, cfg, stage3_units=None):
    """The layout groups: ``(groups, persistent, units, unit_groups)`` for ``partition.Layout`` and stage 3.

    Stages 0-2: one group in reverse parameter order, so buckets fill in the order backward
    produces gradients (the pipeline's tied weight first, alone). Stage 3 (ZeRO §5.3): one group
    per unit -- the parameters a unit owns and no enclosing unit does -- gathered while the unit
    runs; parameters at or below ``stage3_param_persistence_threshold`` form one persistent group.
    """
    n = len(params)
    if cfg.stage < 3:  # reverse order: buckets fill in the order backward produces gradients
        order, tied = list(reversed(range(n))), tied_index(model, params, grid)
        if tied is None:
            return [order], [False], [], []
        return [[tied], [i for i in order if i != tied]], [False, False], [], []
    units = list(stage3_units) if stage3_units is not None else default_units(model)
    if not any(u is model for u in units):
        units.insert(0, model)  # the root covers whatever the given units leave out
    per_unit = unit_params(units, params)
    owner = [-1] * n
    for u, members in enumerate(per_unit):
        for p in members:
            if owner[p] < 0:
                owner[p] = u
    missing = [names[i] for i in range(n) if owner[i] < 0]
    if missing:
        raise ValueError(f"stage3_units: parameter(s) {missing[:3]} belong to no unit; pass units that "
                         f"cover every trainable parameter (or the model itself)")
    threshold = cfg.stage3_param_persistence_threshold
    small = [params[i].numel() <= threshold for i in range(n)]
    groups = []
    for u in range(len(units)):
        members = [p for p in per_unit[u] if owner[p] == u and not small[p]]
        if members:
            groups.append(members)
    persistent = [False] * len(groups)
    if any(small):
        groups.append([i for i in range(n) if small[i]])
        persistent.append(True)
    param_group = {}
    for gi, members in enumerate(groups):
        for p in members:
            param_group[p] = gi
    unit_groups = [sorted({param_group[p] for p in per_unit[u] if not small[p]}) for u in range(len(units))]
    return groups, persistent, units, unit_groups

def tied_index(model, params, grid) -> int | None:
    """The pipeline's tied weight (``model.word_embedding_weight`` on a rank of ``grid.embedding_group``).
    It is a layout group of its own, the first: every stage then partitions it alike, so the
    shards stage 2 reduced per micro-batch line up across the group (``tied_grad``)."""
    group = grid.embedding_group
    tied = getattr(getattr(model, "config", None), "tied", True)
    if group is None or group.size == 1 or not tied:
        return None  # an untied output layer is no copy of the embedding
    try:
        weight = model.word_embedding_weight
    except (AttributeError, RuntimeError):
        return None
    return next((i for i, p in enumerate(params) if p is weight), None)
