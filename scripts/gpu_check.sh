#!/usr/bin/env bash
# The one prepared check for a lent single-GPU machine (device time is short: one run, <= 8 min).
# Installs nothing: it uses the machine's own torch and runs zerotron from this checkout.
# scripts/checks/gpu_check.py: fp32 GPU-vs-CPU loss parity, then a ~1.3B GPT in bf16 through ZeRO
# stages 0-3 with and without activation checkpointing, Pa+cpu and optimizer offload; one table of
# step time, TFLOP/s, MFU, HFU, peak vs predicted memory and the SDPA kernel, then pinned
# host<->device bandwidth. Exits 1 on any mismatch (the reasons are printed as FAIL lines), 2 on a bad
# flag, where python3 has no torch, or where torch sees no CUDA device (--tiny is the CPU smoke mode).
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
if ! probe=$(python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.cuda.is_available())' 2>&1); then
    echo "gpu_check.sh: python3 has no torch (${probe##*$'\n'}); this check uses the machine's own torch and" \
         "installs nothing: run it where python3 imports torch, or put a set-up .venv first" \
         "(PATH=\$PWD/.venv/bin:\$PATH)" >&2
    exit 2
fi
echo "$probe"
exec timeout 480 python3 scripts/checks/gpu_check.py "$@"
