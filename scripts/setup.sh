#!/usr/bin/env bash
# Set up ./.venv for zerotron: torch only when it is missing (pinned, so pip takes the local CPU
# wheel here instead of a multi-GB CUDA build), then zerotron in editable mode.
#   bash scripts/setup.sh          runtime dependencies
#   bash scripts/setup.sh --dev    plus the test dependencies
# The venv sees system site-packages, so a cluster image's own CUDA torch is used as it is.
set -euo pipefail
cd "$(dirname "$0")/.."
extras=""
[ "${1:-}" = "--dev" ] && extras="[dev]"
python=${PYTHON:-python3}
"$python" -c 'import sys; sys.exit(sys.version_info < (3, 10))' \
  || { echo "zerotron needs Python >= 3.10 (found $("$python" --version)); set PYTHON=python3.X" >&2; exit 1; }
[ -x .venv/bin/python ] || "$python" -m venv --system-site-packages .venv
pip=(.venv/bin/python -m pip install --disable-pip-version-check -q)
if ! .venv/bin/python -c 'import torch' 2>/dev/null; then
  echo "[setup] installing torch==${ZEROTRON_TORCH_VERSION:-2.13.0}"
  "${pip[@]}" "torch==${ZEROTRON_TORCH_VERSION:-2.13.0}"
fi
# torch from the system site-packages (a cluster image's, or one installed before) brings no
# .venv/bin/torchrun; the commands in the README call that one, so give the venv its own
if [ ! -x .venv/bin/torchrun ]; then
  printf '#!/bin/sh\nexec "$(dirname "$0")/python" -m torch.distributed.run "$@"\n' > .venv/bin/torchrun
  chmod +x .venv/bin/torchrun
fi
stamp=".venv/.zerotron-$(cat pyproject.toml | sha1sum | cut -c1-12)${extras:+-dev}"
if [ ! -f "$stamp" ]; then
  echo "[setup] installing zerotron${extras} (editable)"
  "${pip[@]}" -e ".${extras}"
  touch "$stamp"
fi
echo "[setup] ready: $(.venv/bin/python -c 'import torch, zerotron; print("torch", torch.__version__, "| zerotron", zerotron.__version__)')"
