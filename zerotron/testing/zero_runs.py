"""A tiny GPT trained under a given ZeroConfig on the current gloo ranks: shared by the ZeRO++ /
ZeRO-Infinity tests and by the ZeRO++ / Infinity benchmarks (which run the full length).

Data: fresh sequences every step from a fixed random bigram (Markov) source, so the loss falls
towards the source's entropy rate and plateaus there instead of memorising to ~0 -- a relative
loss gap between two configurations after N steps is then meaningful."""

from __future__ import annotations

import time

import torch

HYPER = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)

GPT_SHAPE = dict(num_layers=2, hidden_size=64, num_heads=4, vocab_size=128, seq_length=32)


def markov_batches(vocab: int, n: int, length: int, seed: int, sharpness: float = 3.0):
    """Yield ``[n, length]`` token batches from one fixed random bigram source (same on every rank)."""
    g = torch.Generator().manual_seed(seed)
    trans = torch.softmax(torch.randn(vocab, vocab, generator=g) * sharpness, dim=1)
    while True:
        x = torch.empty(n, length, dtype=torch.long)
        x[:, 0] = torch.randint(0, vocab, (n,), generator=g)
        for t in range(1, length):
            x[:, t] = torch.multinomial(trans[x[:, t - 1]], 1, generator=g).squeeze(1)
        yield x


def train_gpt(zero_kw: dict, steps: int, per_rank: int = 4, seed: int = 11,
              want_params: bool = False, shape: dict | None = None) -> dict:
    """Train on every rank; returns per-step losses (DP-mean), the last step's comm counters, the
    memory report, step times and (``want_params``) the full fp32 parameters."""
    from zerotron.model.config import GPTConfig
    from zerotron.parallel import Grid, ParallelDims
    from zerotron.parallel import collectives as C
    from zerotron.parallel import host_sync
    from zerotron.config.run_config import RunConfig
    from zerotron.training.parallelize import parallelize_gpt
    from zerotron.zero import ZeroConfig, accounting

    grid = Grid(ParallelDims())
    cfg = GPTConfig(**(shape or GPT_SHAPE))
    run = RunConfig()
    run.zero = ZeroConfig(**{"stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": 10**6,
                             **zero_kw})
    t = run.training
    t.seed, t.micro_batch_size, t.global_batch_size = seed, per_rank, per_rank * grid.dp_size
    o = run.optimizer
    o.lr, (o.beta1, o.beta2), o.eps, o.weight_decay, o.clip_grad = (HYPER["lr"], HYPER["betas"], HYPER["eps"],
                                                                     HYPER["weight_decay"], 1.0)
    plan = parallelize_gpt(run.validate(grid.world_size), cfg, grid)
    model, opt = plan.model, plan.optimizer
    data = markov_batches(cfg.vocab_size, grid.dp_size * per_rank, cfg.seq_length + 1, seed)
    sl = slice(grid.dp_rank * per_rank, (grid.dp_rank + 1) * per_rank)
    losses, times = [], []
    for step in range(steps):
        t0 = time.perf_counter()
        batch = next(data)[sl]
        loss = model(batch[:, :-1], labels=batch[:, 1:])
        opt.backward(loss)
        opt.step()
        times.append(time.perf_counter() - t0)
        losses.append(loss.detach())
    comm = opt.comm_per_step  # the last step's own traffic: taken before the reporting all-reduce
    mean = C.all_reduce(torch.stack(losses), grid.dp_cp_group) / grid.dp_cp_group.size
    values = host_sync.read(mean, "log", placeholder=[0.0] * steps)  # once, after the run
    losses = values if isinstance(values, list) else [values]
    out = {"losses": losses, "comm": comm, "memory": opt.memory_report(), "times": times,
           "full_numel": opt.layout.full_numel, "part_numel": opt.layout.part_numel, "psi": opt.num_params}
    if opt.gatherer is not None:  # stage 3: the root unit stays gathered from forward into backward
        out["root_numel"] = sum(opt.layout.groups[g].numel for g in opt.gatherer.unit_groups[0])
    if want_params:
        out["params"] = dict(opt.full_params())
    out.update(accounting.io_report(opt))  # ZeRO-Infinity: disk traffic of the state and the parameters
    return out


def tail_loss(losses: list[float], k: int = 5) -> float:
    return sum(losses[-k:]) / len(losses[-k:])


def comm_bytes(comm: dict, op: str, groups: tuple[str, ...] | None = None) -> int:
    return sum(v["bytes"] for key, v in comm.items()
               if key.split("/")[0] == op and (groups is None or key.split("/")[1] in groups))
