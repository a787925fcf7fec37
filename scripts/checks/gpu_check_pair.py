"""``gpu_check``'s two-process row: two ranks on the one GPU, so collectives reach a process group.

With one process every collective returns before it reaches torch (a group of one), so the
single-GPU rows never run ``zerotron/parallel/collectives.py`` on device tensors, the health
tracker's queue of synchronous device collectives (``parallel/stream_ops.py``), the TP layers'
all-reduces or ZeRO's gradient all-reduce. NCCL refuses two ranks on one GPU ("duplicate GPU"),
so the two processes join a gloo group and hand it the device's tensors: gloo all-reduces and
broadcasts CUDA tensors (through the host) -- the collectives of TP 2 without sequence
parallelism and of ZeRO stage 0 over DP 2. Its other collectives take host tensors only, so
those paths still wait for two GPUs.

Each rank runs, in strict fp32 (TF32 off) on the same host-drawn weights and batches: TP 2, DP 2
at stage 0 (both ranks get the same batches, so the DP mean of their gradients is one process's
gradient) and, as the reference, one process alone (a ``Grid`` of one inside the pair). Each
pair's losses must be the reference's, relative difference <= ``PAIR_RTOL``: fp32's rounding
over a few steps (the TP split changes the order of the GEMMs' sums, nothing else).
"""

from __future__ import annotations

import os
import time

import torch

PAIR_RTOL = 1e-4  # the fp32 parity row's: reduction order only
LAYOUTS = (("one", 1, 1), ("tp2", 2, 1), ("dp2", 1, 2))  # name, tp, dp


def _losses(mcfg, tp: int, dp: int, steps: int, micro: int, micro_batch: int,
            device) -> list[float]:
    import torch.distributed as dist

    from zerotron.parallel import Grid
    from zerotron.config.run_config import RunConfig
    from zerotron.training.parallelize import parallelize_gpt
    from zerotron.training.step import run_step

    world = tp * dp
    cfg = RunConfig()
    cfg.parallel.tp, cfg.zero.stage, cfg.training.precision = tp, 0, "fp32"
    cfg.training.seed, cfg.training.micro_batch_size = 1, micro_batch
    cfg.training.global_batch_size = micro_batch * micro * dp
    cfg.optimizer.lr = 1e-4
    cfg = cfg.validate(world)
    # the reference: a grid of one inside the pair (its groups are all of size one: no collective)
    grid = Grid(cfg.parallel, rank=0 if world == 1 else dist.get_rank(), world_size=world)
    try:
        plan = parallelize_gpt(cfg, mcfg, grid, device=device, layout_independent_init=True)
        g = torch.Generator().manual_seed(7)  # the same batches on every rank and layout
        tokens = [torch.randint(0, mcfg.vocab_size, (micro_batch, mcfg.seq_length + 1), generator=g)
                  for _ in range(micro)]
        batches = [(x[:, :-1].contiguous().to(device), x[:, 1:].contiguous().to(device))
                   for x in tokens]
        return [float(run_step(plan.model, plan.optimizer, batches, grid).loss_sum)
                for _ in range(steps)]
    finally:
        grid.close()


def pair_losses(kind: str, sizes: dict, steps: int, micro: int, micro_batch: int) -> dict:
    """On each rank of the pair (``zerotron.testing.launch``'s gloo group): losses per layout and
    the seconds the pair's runs took. ``kind``: the device type the ranks compute on."""
    import torch.distributed as dist

    from zerotron.model import GPTConfig
    from zerotron.parallel.runtime import pick_device

    os.environ["ZEROTRON_DEVICE"] = kind  # the launcher pins its ranks to the CPU
    device = pick_device(dist.get_rank())  # both ranks on cuda:0 with one GPU
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    mcfg = GPTConfig(**sizes).validate()
    out, t0 = {}, time.perf_counter()
    for name, tp, dp in LAYOUTS:
        out[name] = _losses(mcfg, tp, dp, steps, micro, micro_batch, device)
    out["seconds"] = time.perf_counter() - t0
    out["device"] = str(device)
    return out


def pair_row(device: torch.device, sizes: dict, steps: int, micro: int, micro_batch: int,
             store_dir: str) -> tuple[dict, list[str]]:
    """Run the pair; its rank-0 figures and the failures (a crash is one, with its reason)."""
    from zerotron.testing.launch import RankFailure, spawn

    try:  # fresh interpreters: a fork would inherit this process's group (and its CUDA context)
        ranks = spawn(pair_losses, 2, device.type, sizes, steps, micro, micro_batch, timeout=300,
                      start_method="spawn", store_dir=store_dir, collective_timeout=120)
    except RankFailure as e:
        return {}, [f"two processes on one {device.type} device (gloo): {str(e).strip()[-1500:]}"]
    failures = []
    for rank, r in enumerate(ranks):
        for name in ("tp2", "dp2"):
            worst = max(abs(a - b) / abs(b) for a, b in zip(r[name], r["one"]))
            r[f"{name}_worst"] = worst
            if worst > PAIR_RTOL:
                failures.append(f"two processes, {name} on rank {rank}: losses {r[name]} vs one "
                                f"process {r['one']} (worst relative {worst:.1e} > {PAIR_RTOL:.0e})")
    return ranks[0], failures
