"""Benchmark zerotron ZeRO stages 0-3 against their peers on the same model and the same gloo ranks.

    DS_ACCELERATOR=cpu .venv/bin/python scripts/bench/zero.py --ranks 2 --layers 4 --hidden 256 \
        --vocab 8192 --seq 128 --micro-batch 4 --micro 2 --steps 6 --rounds 2 [--precision bf16]

Peers (goal: zerotron at or below each in time and memory): stage 0 <-> torch DDP, stages 1/2 <->
DeepSpeed ZeRO-1/2, stage 3 <-> torch FSDP2 ``fully_shard`` and DeepSpeed ZeRO-3. DeepSpeed is the
``bench`` extra (``pip install '.[bench]'``), never a dependency; without it its rows are skipped.
Each configuration runs in freshly *spawned* processes, so peak RSS is that configuration's own;
``--rounds`` repeats the whole list interleaved and reports medians (the machine is shared).
Printed per configuration: median step time (first step excluded; max over ranks), ratio to each
peer, peak RSS per rank (max over ranks), model-state bytes per rank (the most held after any
backward of the last step: zerotron's ``memory_report``; for peers their parameters, gradients,
fp32 master copies and optimizer state, DeepSpeed's reduce buckets excluded like zerotron's) and
the loss after N steps. A bad flag, an unknown ``--only`` name or an ``--only`` asking for
DeepSpeed where it is not installed exits 2 before any rank starts, so no run measures nothing.

Fairness: same GPT, seed, data, micro-batch, accumulation, AdamW hyper-parameters, clipping at
1.0, bucket sizes, overlap flag and stage-3 persistence threshold. Every peer uses zerotron's
parameter groups (weight decay on ndim >= 2 only). Differences that remain: DDP always overlaps
its all-reduce with backward; in bf16 DDP runs pure bf16 (parameters, gradients and AdamW state, no
fp32 master), FSDP2 uses MixedPrecisionPolicy (fp32 sharded parameters, bf16 compute and reduction),
DeepSpeed and zerotron keep bf16 parameters/gradients plus fp32 master weights.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time
from pathlib import Path

import torch

from zerotron.testing.bench_args import add_gpt_flags, check_gpt, gpt_config, nonnegative_int, positive_int
from zerotron.testing.launch import spawn

ROOT = Path(__file__).resolve().parents[2]
STORE = str(ROOT / "runs" / "bench")  # the ranks' rendezvous files: under the checkout, whatever the cwd

KINDS = ["ddp", "fsdp2", "deepspeed-1", "deepspeed-2", "deepspeed-3", "zerotron-0", "zerotron-1", "zerotron-2",
         "zerotron-3"]


def model_config(args):
    return gpt_config(args)


def build_zerotron(args, grid, zero):
    """zerotron's model and optimizer the way a run builds them: ``parallelize_gpt`` on a RunConfig."""
    from zerotron.config.run_config import RunConfig
    from zerotron.training.parallelize import parallelize_gpt

    run = RunConfig()
    run.zero, run.training.precision, run.training.seed = zero, args.precision, 1
    run.training.micro_batch_size = args.micro_batch
    run.training.global_batch_size = args.micro_batch * args.micro * grid.dp_size
    run.optimizer.lr, run.optimizer.beta1, run.optimizer.beta2, run.optimizer.eps = 1e-3, 0.9, 0.95, 1e-8
    run.optimizer.weight_decay, run.optimizer.clip_grad = 0.1, 1.0
    plan = parallelize_gpt(run.validate(grid.world_size), model_config(args), grid)
    return plan.model, plan.optimizer


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def groups(model):
    """zerotron's AdamW groups for every peer: decoupled decay on ndim >= 2 only (no biases, no LayerNorm)."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [{"params": [p for p in params if p.dim() >= 2]},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]


def ds_state_bytes(engine) -> int:
    """Model states DeepSpeed holds on this rank: parameters (ZeRO-3: their partitions and the persistent
    ones), fp32 master partitions, gradient partitions/buffers that persist across steps, and AdamW moments.
    Tensors are counted once by storage; DeepSpeed's reduce buckets (``ipg``) are fixed buffers and excluded."""
    seen, total = set(), 0

    def add(t):
        nonlocal total
        if not torch.is_tensor(t) or t.numel() == 0:
            return
        key = t.untyped_storage().data_ptr()
        if key in seen or key == 0:
            return
        seen.add(key)
        total += t.untyped_storage().nbytes()

    for p in engine.module.parameters():
        add(p.data)
        add(p.grad)
        add(getattr(p, "ds_tensor", None))
    opt = engine.optimizer

    def walk(obj, depth):
        if depth > 3:
            return
        if torch.is_tensor(obj):
            add(obj)
            add(obj.grad)
        elif isinstance(obj, (list, tuple)):
            for o in obj:
                walk(o, depth + 1)
        elif isinstance(obj, dict):
            for o in obj.values():
                walk(o, depth + 1)

    for name, value in vars(opt).items():
        if "ipg" not in name and "buffer" not in name:
            walk(value, 0)
    base = getattr(opt, "optimizer", None)
    if base is not None:
        for st in base.state.values():
            walk(st, 0)
    return total


def worker(args, kind):
    """One rank of one configuration: (median step s, peak RSS, model-state bytes, final loss)."""
    import logging
    import warnings

    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    rank = dist.get_rank()
    from zerotron.parallel import Grid, ParallelDims

    grid = Grid(ParallelDims())
    hyper = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)  # the peers'; build_zerotron's too
    if not kind.startswith("zerotron"):  # the peers get the same GPT, same seed, as parallelize_gpt builds
        from zerotron.model.gpt import GPT

        model = GPT(model_config(args), grid, seed=1)
    measured: list[int] = []
    g = torch.Generator().manual_seed(100 + rank)
    data = [torch.randint(0, args.vocab, (args.micro_batch, args.seq + 1), generator=g) for _ in range(args.micro)]
    if kind.startswith("zerotron"):
        from zerotron.zero import ZeroConfig

        stage = int(kind.split("+")[0][-1])  # "zerotron-1+ov": that stage with overlap_comm (A/B runs)
        zcfg = ZeroConfig(stage=stage, reduce_bucket_size=args.bucket, allgather_bucket_size=args.bucket,
                          stage3_prefetch_bucket_size=args.bucket, overlap_comm=args.overlap or kind.endswith("+ov"),
                          stage3_param_persistence_threshold=args.persist)
        model, opt = build_zerotron(args, grid, zcfg)

        def step(probe=False):
            for i, b in enumerate(data):
                loss = model(b[:, :-1], labels=b[:, 1:])
                opt.backward(loss / len(data), last_microbatch=i == len(data) - 1)
                if probe:
                    measured.append(opt.memory_report()["total_model_states"])
            opt.step()
            return float(loss.detach())
    elif kind.startswith("deepspeed"):
        import deepspeed

        stage = int(kind[-1])
        ds_cfg = {
            "train_micro_batch_size_per_gpu": args.micro_batch,
            "gradient_accumulation_steps": args.micro,
            "gradient_clipping": 1.0,
            "steps_per_print": 10**9,
            "zero_allow_untested_optimizer": True,
            "zero_optimization": {
                "stage": stage, "overlap_comm": args.overlap, "contiguous_gradients": True,
                "reduce_bucket_size": args.bucket, "allgather_bucket_size": args.bucket,
                "stage3_prefetch_bucket_size": args.bucket,
                "stage3_param_persistence_threshold": args.ds_persist,
            },
        }
        if args.precision == "bf16":
            ds_cfg["bf16"] = {"enabled": True}
        # the client optimizer is torch's AdamW with zerotron's parameter groups (no decay on ndim < 2)
        engine, dopt, _, _ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(groups(model), **hyper),
                                                  config=ds_cfg)

        def step(probe=False):
            for i, b in enumerate(data):
                loss = engine(b[:, :-1], labels=b[:, 1:])
                engine.backward(loss)  # DeepSpeed divides by gradient_accumulation_steps itself
                if probe:
                    measured.append(ds_state_bytes(engine))
                engine.step()          # steps only at the accumulation boundary
            return float(loss.detach())
    else:
        if args.precision != "fp32" and kind == "ddp":
            model.to(torch.bfloat16)  # pure bf16 (params, grads, AdamW state): DDP has no master copy
        if kind == "ddp":
            from torch.nn.parallel import DistributedDataParallel

            wrapped = DistributedDataParallel(model, bucket_cap_mb=args.bucket * 4 / 2**20, gradient_as_bucket_view=True)
        elif kind == "fsdp2":
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh("cpu", (dist.get_world_size(),))
            kw = {}
            if args.precision != "fp32":
                from torch.distributed.fsdp import MixedPrecisionPolicy

                kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
            for block in model.blocks:
                fully_shard(block, mesh=mesh, **kw)
            wrapped = fully_shard(model, mesh=mesh, **kw)
        else:
            raise ValueError(kind)
        topt = torch.optim.AdamW(groups(wrapped), **hyper)

        def states():
            ps = [getattr(p, "_local_tensor", p) for p in wrapped.parameters()]
            gs = [getattr(p.grad, "_local_tensor", p.grad) for p in wrapped.parameters()]
            st = [getattr(v, "_local_tensor", v) for s in topt.state.values() for v in s.values()
                  if torch.is_tensor(v) and v.dim() > 0]
            return tensor_bytes(ps) + tensor_bytes(gs) + tensor_bytes(st)

        def step(probe=False):
            for i, b in enumerate(data):
                loss = wrapped(b[:, :-1], labels=b[:, 1:])
                (loss / len(data)).backward()
                if probe:
                    measured.append(states())
            torch.nn.utils.clip_grad_norm_(wrapped.parameters(), 1.0)
            topt.step()
            topt.zero_grad(set_to_none=False)
            return float(loss.detach())

    times, loss = [], float("nan")
    for k in range(args.steps):
        t0 = time.perf_counter()
        # model states: the most held after any backward of the last step (gradients + optimizer state alive)
        loss = step(probe=k == args.steps - 1)
        times.append(time.perf_counter() - t0)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return statistics.median(times[1:] or times), rss, max(measured), loss


def run(kind, args, ranks):
    """``kind`` in freshly spawned ranks, so the peak RSS is that configuration's own."""
    out = spawn(worker, ranks, args, kind, start_method="spawn", threads=max(1, args.threads),
                collective_timeout=600.0, timeout=1800.0, store_dir=STORE)
    return {"time": max(o[0] for o in out), "rss": max(o[1] for o in out), "states": out[0][2], "loss": out[0][3]}


# zerotron stage -> the peers it must match or beat (time and memory)
PEERS = {"zerotron-0": ["ddp"], "zerotron-1": ["deepspeed-1"], "zerotron-2": ["deepspeed-2"],
         "zerotron-3": ["fsdp2", "deepspeed-3"]}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=positive_int, nargs="+", default=[2], help="one table per DP size, e.g. 2 4")
    ap.add_argument("--steps", type=positive_int, default=6)
    ap.add_argument("--micro", type=positive_int, default=2, help="micro-batches per step")
    ap.add_argument("--micro-batch", type=positive_int, default=4)
    add_gpt_flags(ap, layers=4, hidden=256, vocab=8192, seq=64)
    ap.add_argument("--bucket", type=positive_int, default=int(5e6), help="reduce/all-gather bucket, elements")
    ap.add_argument("--overlap", action="store_true")
    ap.add_argument("--persist", type=nonnegative_int, default=0,
                    help="zerotron stage-3 persistence threshold, elements (0: small params ride with their unit)")
    ap.add_argument("--ds-persist", type=nonnegative_int, default=int(1e5),
                    help="DeepSpeed ZeRO-3 persistence threshold (its default; it fetches per parameter)")
    ap.add_argument("--precision", default="fp32", choices=("fp32", "bf16"))
    ap.add_argument("--rounds", type=positive_int, default=1, help="interleaved repeats of the whole list; medians")
    ap.add_argument("--threads", type=positive_int, default=1)
    ap.add_argument("--only", nargs="+", metavar="CONFIG",
                    help=f"subset of {KINDS}; zerotron-N+ov is stage N with overlap_comm")
    args = ap.parse_args(argv)
    check_gpt(ap, args)
    import importlib.util

    kinds = list(KINDS)
    if importlib.util.find_spec("deepspeed") is None:
        kinds = [k for k in kinds if not k.startswith("deepspeed")]
    if args.only:
        overlap = [f"{k}+ov" for k in KINDS if k.startswith("zerotron")]
        unknown = [k for k in args.only if k not in KINDS + overlap]
        if unknown:
            ap.error(f"--only {' '.join(unknown)}: unknown; choose from {KINDS + overlap}")
        missing = [k for k in args.only if k in KINDS and k not in kinds]
        if missing:
            ap.error(f"--only {' '.join(missing)}: deepspeed is not installed (pip install '.[bench]')")
        kinds = [k for k in kinds if k in args.only] + [k for k in args.only if k in overlap]
    elif len(kinds) < len(KINDS):
        print("deepspeed not installed (pip install '.[bench]'): its configurations are skipped")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # inherited by the spawned ranks
    PEERS.update({f"{k}+ov": v for k, v in list(PEERS.items())})
    for ranks in args.ranks:
        table(kinds, args, ranks)


def table(kinds, args, ranks):
    rounds: dict[str, list] = {k: [] for k in kinds}
    for _ in range(args.rounds):  # configurations interleaved, so load changes hit all of them alike
        for k in kinds:
            rounds[k].append(run(k, args, ranks))
            print(f"  ranks={ranks} {k}: {rounds[k][-1]['time']:.3f} s/step", file=sys.stderr, flush=True)
    results = {k: {"time": statistics.median(r["time"] for r in rs), "rss": max(r["rss"] for r in rs),
                   "states": rs[0]["states"], "loss": rs[0]["loss"]} for k, rs in rounds.items()}
    print(f"ranks={ranks} layers={args.layers} hidden={args.hidden} vocab={args.vocab} seq={args.seq} "
          f"micro_batch={args.micro_batch}x{args.micro} steps={args.steps} rounds={args.rounds} "
          f"precision={args.precision} bucket={args.bucket} overlap={args.overlap} persist={args.persist}/{args.ds_persist}")
    print(f"{'config':12s} {'step s':>8s} {'peer':>12s} {'x time':>7s} {'peak RSS MiB':>13s} {'x RSS':>6s} "
          f"{'states MiB':>11s} {'x states':>8s} {'loss':>8s}")
    for k, r in results.items():
        peers = [p for p in PEERS.get(k, []) if p in results] or [None]
        for j, pk in enumerate(peers):
            peer = results.get(pk) if pk else None
            rt = f"{r['time'] / peer['time']:.2f}" if peer else "-"
            rr = f"{r['rss'] / peer['rss']:.2f}" if peer else "-"
            rs = f"{r['states'] / peer['states']:.3f}" if peer else "-"
            head = (f"{k:12s} {r['time']:8.3f}" if j == 0 else f"{'':12s} {'':8s}")
            tail = (f"{r['rss'] / 2**20:13.1f}" if j == 0 else f"{'':13s}")
            tail2 = (f"{r['states'] / 2**20:11.2f}" if j == 0 else f"{'':11s}")
            loss = f"{r['loss']:8.4f}" if j == 0 else ""
            print(f"{head} {pk or '-':>12s} {rt:>7s} {tail} {rr:>6s} {tail2} {rs:>8s} {loss}", flush=True)


if __name__ == "__main__":
    main()
