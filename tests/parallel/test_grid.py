"""Grid: group membership for every (tp, pp, dp) factorisation of 1, 2, 4, 8 ranks.

Reference: the Megatron rank order written out independently below (TP fastest, then DP, then
PP), and the members each torch group really has, found by all-reducing one-hot rank vectors.
"""

import re

import pytest
import torch

from tests.harness import spawn
from zerotron.parallel import Grid, ParallelDims
from zerotron.parallel import collectives as C


def factorisations(world):
    return [(tp, pp, world // (tp * pp)) for tp in (1, 2, 4, 8) for pp in (1, 2, 4, 8) if world % (tp * pp) == 0]


def expected_groups(rank, tp, pp, dp):
    """Megatron order, computed from coordinates without zerotron code."""
    coords = {r: (r % tp, (r // tp) % dp, r // (tp * dp)) for r in range(tp * pp * dp)}
    t, d, p = coords[rank]
    tp_g = sorted(r for r, c in coords.items() if c[1] == d and c[2] == p)
    dp_g = sorted(r for r, c in coords.items() if c[0] == t and c[2] == p)
    pp_g = sorted(r for r, c in coords.items() if c[0] == t and c[1] == d)
    mp_g = sorted(r for r, c in coords.items() if c[1] == d)
    emb = sorted({pp_g[0], pp_g[-1]}) if p in (0, pp - 1) else None
    return (t, d, p), tp_g, dp_g, pp_g, mp_g, emb


def members(group, world):
    """The global ranks the torch group really contains, learned by communicating."""
    onehot = torch.zeros(world)
    onehot[torch.distributed.get_rank()] = 1.0
    C.all_reduce(onehot, group)
    return [r for r in range(world) if onehot[r] == 1.0]


def check_all_layouts(world):
    import torch.distributed as dist

    rank = dist.get_rank()
    for tp, pp, dp in factorisations(world):
        for dims in (ParallelDims(tp, pp), ParallelDims(tp, pp, dp)):
            g = Grid(dims)
            (t, d, p), tp_g, dp_g, pp_g, mp_g, emb = expected_groups(rank, tp, pp, dp)
            where = f"world={world} tp={tp} pp={pp} dp={dp} rank={rank}"
            assert (g.tp_rank, g.dp_rank, g.pp_rank) == (t, d, p), where
            assert (g.tp_size, g.pp_size, g.dp_size, g.mp_size) == (tp, pp, dp, tp * pp), where
            for grp, want in ((g.tp_group, tp_g), (g.dp_group, dp_g), (g.pp_group, pp_g), (g.mp_group, mp_g)):
                assert list(grp.ranks) == want, f"{grp.name} {where}"
                assert members(grp, world) == want, f"{grp.name} membership {where}"
            assert g.mp_rank == mp_g.index(rank)
            if emb is None:
                assert g.embedding_group is None, where
            else:
                assert list(g.embedding_group.ranks) == emb, where
                assert members(g.embedding_group, world) == emb, where
            assert g.is_first_stage == (p == 0) and g.is_last_stage == (p == pp - 1), where
            assert g.next_pp_rank == (pp_g[p + 1] if p < pp - 1 else None), where
            assert g.prev_pp_rank == (pp_g[p - 1] if p > 0 else None), where
    return True


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_every_layout_matches_megatron_order(world):
    assert all(spawn(check_all_layouts, world, world, timeout=240))


def try_bad_grid(tp, pp, dp):
    try:
        Grid(ParallelDims(tp, pp, dp))
    except ValueError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("tp,pp,dp,needle", [
    (3, 1, None, "parallel.tp*parallel.pp=3*1=3"),
    (2, 4, None, "parallel.tp*parallel.pp=2*4=8"),
    (2, 1, 3, "dp=2"),
    (0, 1, None, "parallel.tp=0"),
    (1, -2, None, "parallel.pp=-2"),
    (1, 1, 0, "parallel.dp=0"),
])
def test_invalid_sizes_fail_on_every_rank_before_any_collective(tp, pp, dp, needle):
    # Every rank returns the same message; a rank that entered a collective would hang instead.
    messages = spawn(try_bad_grid, 4, tp, pp, dp, timeout=30)
    assert all(needle in m for m in messages), messages
    assert len(set(messages)) == 1


def test_resolve_infers_dp():
    assert ParallelDims(2, 2).resolve(8) == ParallelDims(2, 2, 2)
    assert ParallelDims(1, 1, -1).resolve(3) == ParallelDims(1, 1, 3)


def expected_cp_groups(rank, tp, cp, dp, pp):
    """Megatron-core's order with context parallelism (TP fastest, then CP, DP, PP), from
    coordinates without zerotron code: which ranks share every coordinate but the named ones."""
    coords = {}
    for r in range(tp * cp * dp * pp):
        coords[r] = {"tp": r % tp, "cp": (r // tp) % cp, "dp": (r // (tp * cp)) % dp, "pp": r // (tp * cp * dp)}

    def varying(*axes):
        return sorted(r for r, c in coords.items()
                      if all(c[a] == coords[rank][a] for a in ("tp", "cp", "dp", "pp") if a not in axes))

    return coords[rank], {"tp": varying("tp"), "cp": varying("cp"), "dp": varying("dp"),
                          "dp_cp": varying("dp", "cp"), "pp": varying("pp"), "mp": varying("tp", "pp")}


def check_cp_layouts(world):
    import torch.distributed as dist

    rank = dist.get_rank()
    for tp, cp, pp in ((1, 2, 1), (1, 4, 1), (2, 2, 1), (1, 2, 2)):
        dp = world // (tp * cp * pp)
        g = Grid(ParallelDims(tp=tp, pp=pp, cp=cp))
        where = f"world={world} tp={tp} cp={cp} dp={dp} pp={pp} rank={rank}"
        coords, want = expected_cp_groups(rank, tp, cp, dp, pp)
        assert (g.tp_rank, g.cp_rank, g.dp_rank, g.pp_rank) == tuple(coords.values()), where
        assert g.dp_cp_size == dp * cp and g.cp_size == cp, where
        for name in ("tp", "cp", "dp", "dp_cp", "pp", "mp"):
            grp = getattr(g, f"{name}_group")
            assert list(grp.ranks) == want[name], f"{name} {where}"
            if grp.size > 1:
                assert members(grp, world) == want[name], f"{name} membership {where}"
    g = Grid(ParallelDims(tp=2))  # cp = 1: the DP group is the data-parallel-with-CP group
    assert g.dp_cp_group is g.dp_group and g.cp_group.ranks == (rank,)
    return True


def test_cp_layouts_match_megatron_core_order():
    assert all(spawn(check_cp_layouts, 4, 4, timeout=240))


@pytest.mark.parametrize("dims,needle", [
    (dict(tp=2, cp=3), "parallel.tp*parallel.cp*parallel.pp=2*3*1=6 does not divide the 4"),
    (dict(cp=0), "parallel.cp=0: must be a positive integer"),
    (dict(cp=2, dp=4), "parallel.dp=4 but world_size/(tp*cp*pp)=2"),
])
def test_bad_cp_sizes_named(dims, needle):
    with pytest.raises(ValueError, match=re.escape(needle)):
        ParallelDims(**dims).resolve(4)
