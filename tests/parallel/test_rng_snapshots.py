"""The run's RNG snapshots have one home, ``parallel/rng.py`` (issue 45).

Recompute replays a snapshot and a resumed run continues from one, so both must put back every
stream exactly; the draws torch makes after a restore are compared with the draws it made after
the snapshot (torch is the reference). The home is held by reading every module of the package:
a generator state read or set anywhere else fails the test.
"""

from __future__ import annotations

import ast
from pathlib import Path
from types import SimpleNamespace

import torch

from zerotron.parallel import rng as rng_streams
from zerotron.parallel.rng import TPRNG

PACKAGE = Path(rng_streams.__file__).resolve().parents[1]
HOME = Path(rng_streams.__file__).resolve()
# torch's generator-state calls, and TPRNG's own snapshot methods
STATE_CALLS = {"get_rng_state", "set_rng_state", "fork_rng", "get_state", "set_state",
               "get_states", "set_states"}
GRID = SimpleNamespace(pp_rank=1, tp_rank=0)  # all that seeding reads of a Grid


def _draws(rng: TPRNG) -> list[torch.Tensor]:
    """One draw from each stream dropout can use: shared, TP region, sequence-parallel region."""
    shared = torch.rand(5)
    with rng.fork("tp"):
        tp = torch.rand(5)
    with rng.fork("sp"):
        sp = torch.rand(5)
    return [shared, tp, sp]


def _assert_same(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_a_checkpoint_snapshot_resumes_every_stream():
    rng = TPRNG()
    rng.seed(7, GRID)
    _draws(rng)  # move every stream off its seed
    states = rng_streams.checkpoint_states(rng, torch.device("cpu"))
    after_save = _draws(rng)
    rng_streams.resume_streams(rng, dict(states), 999, GRID, torch.device("cpu"))
    _assert_same(_draws(rng), after_save)


def test_a_recompute_snapshot_replays_and_the_streams_go_on():
    rng = TPRNG()
    rng.seed(3, GRID)
    taken = rng_streams.capture_rng(rng)
    first = _draws(rng)
    now = rng_streams.capture_rng(rng)
    rng_streams.restore_rng(rng, taken)
    _assert_same(_draws(rng), first)  # the recompute draws the forward's masks
    rng_streams.restore_rng(rng, now)
    second = _draws(rng)
    assert not torch.equal(second[0], first[0])  # and the run continues past them
    plain = rng_streams.capture_rng(None)  # no TPRNG: torch's default generator alone
    x = torch.rand(3)
    rng_streams.restore_rng(None, plain)
    assert torch.equal(torch.rand(3), x)


def test_another_layout_reseeds_from_the_given_seed():
    rng = TPRNG()
    rng.seed(11, GRID)
    _draws(rng)
    rng_streams.resume_streams(rng, None, 11 + 40, GRID, torch.device("cpu"))
    # Megatron's shared seed: seed + 100 * pp_rank, on torch's default generator
    plain = torch.Generator().manual_seed(11 + 40 + 100 * GRID.pp_rank)
    assert torch.equal(torch.rand(5), torch.rand(5, generator=plain))


def test_no_module_but_parallel_rng_reads_or_sets_a_generator_state():
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.resolve() == HOME:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            name = (node.attr if isinstance(node, ast.Attribute)
                    else node.id if isinstance(node, ast.Name) else None)
            if name in STATE_CALLS:
                offenders.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {name}")
    assert not offenders, ("RNG snapshots belong in zerotron/parallel/rng.py: "
                           + ", ".join(offenders))
