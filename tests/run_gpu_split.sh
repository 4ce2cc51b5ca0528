#!/usr/bin/env bash
# The whole GPU suite with the embedded model's GGUF, in five pytest processes side by side on one
# device (tests/test_gpu.py apart from the other files since 2026-12-02: together they ran past
# 560 s on a slower host, bench/RESULTS.md set Y):
#   tests/run_gpu_split.sh MODEL.gguf [seconds each may take, 300 by default]
# Each process writes its output to $OUT/gpu-N.txt (or gpu-logs/ where OUT is unset); the last
# lines of each are printed at the end, and the exit status is 1 where any process failed.
set -u
cd "$(dirname "$0")/.."
[ $# -ge 1 ] && [[ "$1" == *.gguf ]] && [ -f "$1" ] || { echo "usage: tests/run_gpu_split.sh MODEL.gguf [SECONDS]" >&2; exit 2; }
bash tests/run_gpu.sh "$1" --co -q tests/test_gpu_real.py > /dev/null  # wheels installed, the model linked
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 CHAT_TEST_GGUF=$(realpath "$1")
logs=${OUT:-gpu-logs}; mkdir -p "$logs"
T=${2:-300}
P="python3 -m pytest -q -m gpu -p no:cacheprovider -rfE"
(timeout "$T" $P --ignore=tests/test_gpu_real.py --ignore=tests/test_replay_devices.py \
   --ignore=tests/test_constraints_gpu.py --ignore=tests/test_gpu.py tests/ > "$logs/gpu-1.txt" 2>&1
 echo "rc $?" >> "$logs/gpu-1.txt") &
(timeout "$T" $P tests/test_gpu.py > "$logs/gpu-5.txt" 2>&1; echo "rc $?" >> "$logs/gpu-5.txt") &
(timeout "$T" $P tests/test_gpu_real.py -k "capital or piped" > "$logs/gpu-2.txt" 2>&1
 echo "rc $?" >> "$logs/gpu-2.txt") &
(timeout "$T" $P tests/test_gpu_real.py tests/test_constraints_gpu.py -k "run_then_replay or test_constraints_gpu" \
   > "$logs/gpu-3.txt" 2>&1; echo "rc $?" >> "$logs/gpu-3.txt") &
(timeout "$T" $P tests/test_replay_devices.py > "$logs/gpu-4.txt" 2>&1; echo "rc $?" >> "$logs/gpu-4.txt") &
wait
status=0
for f in "$logs"/gpu-[1-5].txt; do
  echo "== $(basename "$f"): $(grep -E '(passed|failed|error)' "$f" | tail -1)"
  grep -E '^(FAILED|ERROR) ' "$f"
  [ "$(tail -1 "$f")" = "rc 0" ] || status=1
done
exit $status
