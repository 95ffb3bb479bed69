#!/usr/bin/env bash
# The Python packages bench/gpu_suite.py needs that a lent GPU machine lacks (scripts/gpu_wheels.txt), as wheels for
# its Python 3.12 (that machine has no network): trl, datasets, deepspeed and what they need beyond the machine's
# image (torch, transformers, accelerate, pyarrow, pandas, ... are there: /work/.library/device/KINDS.md lists them).
#   bash scripts/gpu_wheels.sh [DIR]     # default .whl (git-ignored through .git/info/exclude); about 7 MB
# then the device call carries it (carry: [".whl"]) and runs `bash bench/gpu_suite.sh`, which checks and installs it.
# deepspeed is published as a source archive only: it is built here into a pure-Python wheel (DS_BUILD_OPS=0, no
# compiled op; DeepSpeed detects CUDA at run time, and under ZeRO posttrain steps torch's own AdamW, so no op is built
# there either). PYARROW=1 adds pyarrow (about 45 MB) for an image whose pyarrow is older than datasets needs (the
# suite's preflight says so). Last, scripts/carry_size.sh prints what a device call then sends, and this script fails
# when that is over the 64 MiB a call may send.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-.whl}
PY=${PYTHON:-}
for candidate in .venv/bin/python python3; do
  [ -n "$PY" ] && break
  "$candidate" -c "import torch, setuptools" 2>/dev/null && PY=$candidate
done
[ -n "$PY" ] || { echo "gpu_wheels.sh: no Python with torch to build deepspeed's wheel (make setup, or PYTHON=...)" >&2; exit 2; }
mapfile -t PINS < <(grep -v '^#' scripts/gpu_wheels.txt | grep .)
WHEELS=() DEEPSPEED=
for pin in "${PINS[@]}"; do
  case "$pin" in deepspeed==*) DEEPSPEED=$pin ;; *) WHEELS+=("$pin") ;; esac
done
[ "${PYARROW:-0}" = 1 ] && WHEELS+=(pyarrow==26.0.1)
# What the image has (KINDS.md, 2026-11-17) under the names wheels require them by (lower case, '-' for '_').
IMAGE="accelerate aiohttp attrs certifi charset-normalizer click cloudpickle einops filelock fsspec hf-xet httpx
huggingface-hub idna jinja2 markupsafe msgpack ninja numpy packaging pandas pillow psutil py-cpuinfo pyarrow pyyaml
regex requests rich safetensors setuptools six sympy tokenizers torch tqdm transformers triton typing-extensions
urllib3 xxhash"

mkdir -p "$DIR"
quiet() { "$@" 2> >(grep -v 'is ignored: it is neither a file nor a directory' >&2); }  # this pip's local indexes
quiet "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$DIR" "${WHEELS[@]}"
DS_BUILD_OPS=0 quiet "$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$DIR" "$DEEPSPEED"

# every requirement of every wheel: carried here, or on the image; anything else is named
have=" $(echo $IMAGE) "  # one line: the list's line breaks become spaces
for w in "$DIR"/*.whl; do
  name=$(basename "$w" | cut -d- -f1 | tr 'A-Z_' 'a-z-'); have+=" $name "
done
missing=0
for w in "$DIR"/*.whl; do
  while read -r req; do
    name=$(echo "$req" | sed -E 's/^Requires-Dist: *([A-Za-z0-9_.-]+).*/\1/' | tr 'A-Z_.' 'a-z--')
    case "$have" in *" $name "*) ;; *) echo "gpu_wheels.sh: $(basename "$w") needs $name: neither carried nor on the image"; missing=1;; esac
  done < <(unzip -p "$w" '*.dist-info/METADATA' | grep '^Requires-Dist:' | grep -v 'extra ==' || true)
done
case "$(cd "$DIR" && pwd)" in
  "$(pwd)"/*) exclude=$(git rev-parse --git-path info/exclude 2>/dev/null || true)
              rel="/${DIR#./}/"
              [ -z "$exclude" ] || grep -qxF "$rel" "$exclude" 2>/dev/null || echo "$rel" >> "$exclude" ;;
esac
echo "gpu_wheels.sh: $(ls "$DIR"/*.whl | wc -l) wheels, $(du -sh "$DIR" | cut -f1) in $DIR"
bash scripts/carry_size.sh "$DIR" || missing=1
exit $missing
