"""One-GPU check: a ~1.3B GPT in bf16 with ZeRO stages 0-3, activation checkpointing and Pa+cpu.

    bash scripts/gpu_check.sh            # on the lent GPU machine; installs nothing
    python scripts/checks/gpu_check.py --tiny   # the same code path on CPU with a tiny model (smoke test)

Prints, per configuration: step time, TFLOP/s per device, MFU, peak allocated/reserved memory
and model-state bytes; then the measured host<->device bandwidth of pinned copies (what Pa+cpu
and optimizer offload move). With one GPU the DP degree is 1, so stages 1-3 partition over one
rank: the figures show their overheads, not their savings (those need DP > 1).
"""

from __future__ import annotations

import argparse
import gc
import time

import torch

from zerotron.model import GPTConfig
from zerotron.model.flops import flops_per_iteration, peak_tflops
from zerotron.parallel import Grid, ParallelDims, init_distributed, shutdown
from zerotron.training.config import RunConfig
from zerotron.training.parallelize import parallelize_gpt

CONFIGS = [  # (name, zero stage, activation checkpointing, Pa+cpu)
    ("stage0", 0, False, False),
    ("stage1", 1, False, False),
    ("stage2", 2, False, False),
    ("stage3", 3, False, False),
    ("stage2+ckpt", 2, True, False),
    ("stage2+ckpt+cpu", 2, True, True),
]


def bandwidth(device: torch.device, mbytes: int) -> dict[str, float]:
    if device.type != "cuda":
        return {}
    host = torch.empty(mbytes << 20, dtype=torch.uint8).pin_memory()
    dev = torch.empty_like(host, device=device)
    out = {}
    for name, dst, src in (("h2d_GBps", dev, host), ("d2h_GBps", host, dev)):
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(5):
            dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        out[name] = 5 * mbytes / 1024 / (time.perf_counter() - t0)
    return out


def run(name, stage, ckpt, offload, cfg, grid, device, args) -> dict:
    run_cfg = RunConfig()
    run_cfg.zero.stage = stage
    run_cfg.activation_checkpointing.checkpoint_activations = ckpt
    run_cfg.activation_checkpointing.cpu_checkpointing = offload
    t, o = run_cfg.training, run_cfg.optimizer
    t.precision, t.seed = ("bf16" if device.type == "cuda" else "fp32"), 1
    t.micro_batch_size, t.global_batch_size = args.micro_batch, args.micro_batch * grid.dp_size
    o.lr, o.beta1, o.beta2, o.weight_decay, o.clip_grad = 1e-4, 0.9, 0.95, 0.1, 1.0
    plan = parallelize_gpt(run_cfg.validate(grid.world_size), cfg, grid, device=device,
                           layout_independent_init=False)
    model, opt = plan.model, plan.optimizer
    ids = torch.randint(0, cfg.vocab_size, (args.micro_batch, cfg.seq_length), device=device)
    times = []
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for step in range(args.warmup + args.steps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = model(ids, labels=ids)
        opt.backward(loss, last_microbatch=True)
        opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if step >= args.warmup:
            times.append(time.perf_counter() - t0)
    step_s = sorted(times)[len(times) // 2]
    tflops = flops_per_iteration(cfg, args.micro_batch, cfg.seq_length, recompute=ckpt) / step_s / 1e12
    peak = args.peak_tflops or peak_tflops(torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu")
    row = {"config": name, "step_s": step_s, "tflops": tflops, "mfu": tflops / peak if peak else None,
           "loss": float(loss.detach()), "model_states_GB": opt.memory_report()["total_model_states"] / 2**30}
    if device.type == "cuda":
        row["peak_alloc_GB"] = torch.cuda.max_memory_allocated(device) / 2**30
        row["peak_reserved_GB"] = torch.cuda.max_memory_reserved(device) / 2**30
    del model, opt
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="tiny model (CPU smoke test of the same code)")
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--peak-tflops", type=float, default=None)
    p.add_argument("--only", nargs="*", help="run only these configurations")
    args = p.parse_args()
    if args.tiny:
        args.layers, args.hidden, args.heads, args.seq, args.micro_batch = 2, 64, 4, 32, 2
    env = init_distributed(timeout_s=600)
    grid = Grid(ParallelDims())
    cfg = GPTConfig(num_layers=args.layers, hidden_size=args.hidden, num_heads=args.heads, vocab_size=50257,
                    seq_length=args.seq)
    print(f"[gpu_check] device={env.device} params={cfg.num_params() / 1e9:.2f}B "
          f"({args.layers} layers, hidden {args.hidden}, seq {args.seq}, micro-batch {args.micro_batch})", flush=True)
    print(f"{'config':<18}{'step s':>8}{'TFLOP/s':>9}{'MFU':>7}{'peak GB':>9}{'rsvd GB':>9}{'states GB':>10}{'loss':>8}")
    for name, stage, ckpt, offload in CONFIGS:
        if args.only and name not in args.only:
            continue
        r = run(name, stage, ckpt, offload, cfg, grid, env.device, args)
        mfu = f"{r['mfu']:.1%}" if r["mfu"] else "-"
        print(f"{name:<18}{r['step_s']:>8.3f}{r['tflops']:>9.1f}{mfu:>7}{r.get('peak_alloc_GB', 0):>9.1f}"
              f"{r.get('peak_reserved_GB', 0):>9.1f}{r['model_states_GB']:>10.2f}{r['loss']:>8.3f}", flush=True)
    for k, v in bandwidth(env.device, 1024).items():
        print(f"[gpu_check] pinned {k}: {v:.1f} GB/s", flush=True)
    shutdown()


if __name__ == "__main__":
    main()
