#!/usr/bin/env bash
# One prepared GPU check for a lent single-GPU machine (device tool: 15 minutes of device time in
# all). Installs nothing: it uses the machine's own torch and runs zerotron from this checkout.
# ~1.3B GPT (24 layers, hidden 2048, seq 1024) in bf16: ZeRO stages 0-3, activation checkpointing,
# Pa+cpu offload; prints TFLOP/s, MFU, peak memory and pinned host<->device bandwidth. ~5-8 min.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.cuda.is_available())'
exec timeout 480 python3 scripts/checks/gpu_check.py "$@"
