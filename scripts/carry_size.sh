#!/usr/bin/env bash
# What a device call sends: the working tree (tracked and untracked-not-ignored files) plus the carried paths given,
# against the device tool's 64 MiB limit. Prints the total; exits 1 over the limit (the call would be refused).
#   bash scripts/carry_size.sh .whl          # CARRY_LIMIT_MIB=64 by default
set -euo pipefail
cd "$(dirname "$0")/.."
LIMIT_MIB=${CARRY_LIMIT_MIB:-64}
tree=$(git ls-files -z --cached --others --exclude-standard | du -cb --files0-from=- 2>/dev/null | tail -1 | cut -f1)
carried=0
for path in "$@"; do
  [ -e "$path" ] || { echo "carry_size.sh: $path: no such file or folder (make it first, e.g. scripts/gpu_wheels.sh)" >&2; exit 2; }
  carried=$((carried + $(du -sb "$path" | cut -f1)))
done
total=$((tree + carried))
mib() { awk -v b="$1" 'BEGIN { printf "%.1f MiB", b / 1048576 }'; }
echo "carry_size.sh: $(mib "$total") sent ($(mib "$tree") working tree + $(mib "$carried") carried: ${*:-nothing}); limit ${LIMIT_MIB} MiB"
if [ "$total" -gt $((LIMIT_MIB * 1048576)) ]; then
  echo "carry_size.sh: over the ${LIMIT_MIB} MiB a device call sends: carry less (PYARROW=0), or ignore large untracked files" >&2
  exit 1
fi
