#!/usr/bin/env bash
# The one prepared check for a lent single-GPU machine (device time is short: one run, <= 8 min).
# Installs nothing: it uses the machine's own torch and runs zerotron from this checkout.
# scripts/checks/gpu_check.py: fp32 GPU-vs-CPU loss parity, then a ~1.3B GPT in bf16 through ZeRO
# stages 0-3 with and without activation checkpointing, Pa+cpu and optimizer offload; one table of
# step time, TFLOP/s, MFU, HFU, peak vs predicted memory and the SDPA kernel, then pinned
# host<->device bandwidth. Exits 1 on any mismatch (the reasons are printed as FAIL lines), 2 on a bad
# flag or where torch sees no CUDA device (--tiny is the CPU smoke mode).
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.cuda.is_available())'
exec timeout 480 python3 scripts/checks/gpu_check.py "$@"
