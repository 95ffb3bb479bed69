#!/usr/bin/env bash
# bench/gpu_suite.py on a lent GPU machine (docs/performance.md, "GPU suite"): installs the wheels carried in .whl/
# (made here by scripts/gpu_wheels.sh) into /tmp/site, runs the suite with the arguments given, then copies
# results.json, results.md and the rows' logs into $OUT, which the device tool brings back.
#   bash bench/gpu_suite.sh --part 1 --minutes 8
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if compgen -G ".whl/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "gpu_suite.sh: installing the carried wheels (.whl/) failed" >&2; exit 1; }
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
"$PY" bench/gpu_suite.py "$@"
code=$?
if [ -n "${OUT:-}" ] && [ -d "${OUT}" ]; then
  cp bench/results/gpu-suite/results.json bench/results/gpu-suite/results.md "$OUT"/ 2>/dev/null
  [ -d runs/gpu-suite/logs ] && tar czf "$OUT/logs.tar.gz" -C runs/gpu-suite logs
fi
exit $code
