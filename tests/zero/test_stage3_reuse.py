"""Stage 3's gathered parameters: what forward leaves alive, what a checkpointed step all-gathers,
and DeepSpeed's reuse keys, on 2 gloo ranks.

All-gathered elements are counted by a wrapper around the torch.distributed call itself (not the
optimizer's counters), and what stays alive of its output buffers by a weak reference to each
storage. Before saved views were packed as handles, forward kept every gathered unit alive
(autograd's ``addmm`` saves ``weight.t()``), and a checkpointed step gathered each block three
times (forward, recompute, backward) -- 3x the parameters where ZeRO §7.2.2 says 2x.
"""

from __future__ import annotations

import math

import pytest

from tests.harness import spawn

SHAPE = dict(num_layers=4, hidden_size=64, num_heads=4, vocab_size=64, seq_length=16)


def _run(stage: int, checkpoint: bool = False, bound_forward: bool = False, **zero_kw) -> dict:
    import gc
    import time
    import weakref

    import torch

    from zerotron.model.config import GPTConfig
    from zerotron.parallel import Grid, ParallelDims
    from zerotron.parallel import collectives as C
    from zerotron.config.run_config import RunConfig
    from zerotron.training.parallelize import parallelize_gpt

    gathered = {"elements": 0}
    outputs = []  # (weak reference to the storage an all-gather filled, its bytes)

    def alive_bytes(at_most: int | None = None) -> int:
        """Bytes of gathered storages still alive. gloo's worker thread drops its reference to a
        finished collective (and so its output) a moment after ``wait()`` returns -- a moment
        that a loaded machine can stretch past any fixed pause -- so the count is read again
        until it is within ``at_most`` (what the test will assert), for up to 5 s: a buffer our
        code keeps stays alive however long this waits. ``None``: one read (for a lower bound,
        which a late release can only help)."""
        deadline = time.monotonic() + 5.0
        while True:
            gc.collect()
            now = sum(n for ref, n in outputs if ref() is not None)
            if at_most is None or now <= at_most or time.monotonic() > deadline:
                return now
            time.sleep(0.01)

    real = C._all_gather_single

    def counting(output, input, group=None, async_op=False):
        gathered["elements"] += output.numel()
        storage = output.untyped_storage()
        outputs.append((weakref.ref(storage), storage.nbytes()))
        return real(output, input, group=group, async_op=async_op)

    C._all_gather_single = counting
    try:
        grid = Grid(ParallelDims())
        cfg = GPTConfig(**SHAPE)
        run = RunConfig()
        run.zero.stage, run.zero.stage3_param_persistence_threshold = stage, 0
        for k, v in zero_kw.items():
            setattr(run.zero, k, v)
        run.activation_checkpointing.checkpoint_activations = checkpoint
        run.training.micro_batch_size, run.training.global_batch_size = 2, 2 * grid.dp_size
        run.optimizer.clip_grad = 0.0  # a norm summed by partitions differs in its last bits from stage 0's
        plan = parallelize_gpt(run.validate(grid.world_size), cfg, grid)
        model, opt = plan.model, plan.optimizer
        shapes = dict(zip(opt.names, opt.layout.shapes))
        numel = {n: math.prod(shapes[n]) for n in shapes}
        units = [sum(numel[n] for n in numel if n.startswith(f"blocks.{i}.")) for i in range(len(model.blocks))]
        root = sum(numel.values()) - sum(units)
        element_size = torch.empty(0, dtype=opt.dtype).element_size()
        # the forward's bound that test_forward_leaves_no_gathered_unit_behind asserts on this run
        forward_at_most = (root + max(units)) * element_size if bound_forward else None
        g = torch.Generator().manual_seed(3 + grid.dp_rank)
        out = {"losses": []}
        for step in range(3):
            ids = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length + 1), generator=g)
            before = gathered["elements"]
            outputs.clear()
            loss = model(ids[:, :-1], labels=ids[:, 1:])
            alive = alive_bytes(forward_at_most)
            opt.backward(loss)
            opt.step()
            out["losses"].append(loss.item())
            if step == 2:
                out.update(gathered=gathered["elements"] - before, alive_after_forward=alive)
        outputs.clear()
        with torch.no_grad():  # an evaluation: no backward will come for what it gathers
            model.eval()
            model(ids[:, :-1], labels=ids[:, 1:])
            model.train()
        out["alive_after_eval"] = alive_bytes(at_most=0)
        out.update(full=opt.layout.full_numel, units=units, root=root, element_size=element_size,
                   params={n: p.clone() for n, p in opt.full_params()})
        return out
    finally:
        C._all_gather_single = real


def _check_all():
    results = {}
    for name, stage, ckpt, kw in (("s2", 2, False, {}), ("s3", 3, False, {"bound_forward": True}),
                                  ("s3_ckpt", 3, True, {}),
                                  ("s3_reuse", 3, False, {"stage3_max_reuse_distance": 10**9}),
                                  ("s3_reuse_capped", 3, False, {"stage3_max_reuse_distance": 10**9,
                                                                 "stage3_max_live_parameters": 1}),
                                  ("s0_ckpt", 0, True, {})):
        results[name] = _run(stage, ckpt, **kw)
    return results


@pytest.fixture(scope="module")
def runs():
    return spawn(_check_all, 2, timeout=240)[0]


def test_forward_leaves_no_gathered_unit_behind(runs):
    """After forward only the root unit (embeddings, final LN: used first in backward) is still
    gathered; autograd holds handles, not the blocks' gathered buffers. DeepSpeed's reuse distance
    keeps everything gathered, by request."""
    r = runs["s3"]
    assert r["alive_after_forward"] <= (r["root"] + max(r["units"])) * r["element_size"], \
        (r["alive_after_forward"], r["root"], r["units"])
    assert runs["s3_reuse"]["alive_after_forward"] >= sum(r["units"]) * r["element_size"]


def test_evaluation_leaves_nothing_gathered(runs):
    """A no-grad forward releases every unit it gathered, the root included (the model's post-hook
    runs after the root unit's, which would keep it for a backward that never comes)."""
    for name in ("s3", "s3_ckpt", "s3_reuse"):
        assert runs[name]["alive_after_eval"] == 0, (name, runs[name]["alive_after_eval"], runs[name]["root"])


def test_step_gathers_twice_with_or_without_checkpointing(runs):
    """One all-gather in forward, one in backward (ZeRO §7.2.2); a recompute reuses its backward's."""
    for name in ("s3", "s3_ckpt"):
        r = runs[name]
        assert r["gathered"] <= 2.05 * r["full"], (name, r["gathered"], r["full"])
        assert r["gathered"] >= 2 * r["full"] - r["root"], (name, r["gathered"], r["full"])


def test_reuse_distance_keeps_units_for_backward(runs):
    """stage3_max_reuse_distance 1e9 (DeepSpeed's default): nothing is gathered twice; the live cap
    undoes it; the arithmetic is the same whatever is kept."""
    full = runs["s3"]["full"]
    assert runs["s3_reuse"]["gathered"] <= 1.05 * full, runs["s3_reuse"]["gathered"]
    assert runs["s3_reuse_capped"]["gathered"] >= 2 * full - runs["s3"]["root"]
    base = runs["s3"]
    for name in ("s3_reuse", "s3_reuse_capped"):
        assert runs[name]["losses"] == base["losses"], name
        for k, v in base["params"].items():
            assert (runs[name]["params"][k] == v).all(), (name, k)


def test_checkpointed_stage3_equals_stage0(runs):
    """Recompute under stage 3 with saved handles: the same arithmetic as stage 0 with checkpointing."""
    a, b = runs["s3_ckpt"], runs["s0_ckpt"]
    assert a["losses"] == b["losses"]
    for k, v in b["params"].items():
        assert (a["params"][k] == v).all(), k
