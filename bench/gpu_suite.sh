#!/usr/bin/env bash
# bench/gpu_suite.py on a lent GPU machine, in one command of at most 8 minutes (docs/performance.md, "GPU suite"):
# first the device and the carried pieces (seconds; what is missing is named and nothing else runs), then the wheels
# carried in .whl/ (made here by scripts/gpu_wheels.sh) into /tmp/site, then the suite, which writes results.json,
# results.md and logs.tar.gz into $OUT after every row.
#   bash bench/gpu_suite.sh [--commit SHA]     # the device call: carry [".whl"], timeout 540 s
#   bash bench/gpu_suite.sh --dry-run          # anywhere: the check's findings and the plan with each row's budget
set -uo pipefail
cd "$(dirname "$0")/.."
export GPU_SUITE_T0=${GPU_SUITE_T0:-$(date +%s.%N)}  # the suite's minutes count from here, the install included
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
PY=${PYTHON:-python3}
"$PY" bench/gpu_suite.py --check "$@" || exit $?
case " $* " in *" --dry-run "*) dry=1 ;; *) dry=0 ;; esac
if [ "$dry" = 0 ] && compgen -G ".whl/*.whl" >/dev/null; then  # cp312 wheels: the lent machine's Python
  timeout 90 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/*.whl || { echo "gpu_suite.sh: installing the carried wheels (.whl/) failed" >&2; exit 1; }
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
out=()
[ -n "${OUT:-}" ] && out=(--out "$OUT")
exec "$PY" bench/gpu_suite.py "${out[@]}" "$@"
