#!/usr/bin/env bash
# Create .venv with posttrain and its test/engine extras. Picks the torch build for the machine:
#   NVIDIA GPU present -> the normal (CUDA) build from PyPI;
#   no NVIDIA GPU      -> a CPU-only build (never several GB of CUDA libraries on a machine that cannot use them).
# Re-running is cheap: an installed torch that fits is kept.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
EXTRAS=${POSTTRAIN_EXTRAS:-dev}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
if ! python -c "import torch, sys; v = torch.__version__.split('+')[0].split('.'); sys.exit(not ((2, 4) <= (int(v[0]), int(v[1])) < (2, 14)))" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    echo "setup: NVIDIA GPU found -> installing the CUDA build of torch"
    python -m pip install "torch>=2.4,<2.14"
  else
    echo "setup: no NVIDIA GPU -> installing the CPU build of torch"
    python -m pip install "torch==2.13.0+cpu" 2>/dev/null \
      || python -m pip install "torch>=2.4,<2.14" --index-url https://download.pytorch.org/whl/cpu
  fi
fi
python -m pip install -q -e ".[${EXTRAS}]"
python -c "import torch, posttrain; print(f'setup: posttrain {posttrain.__version__}, torch {torch.__version__}, cuda={torch.cuda.is_available()}')"
