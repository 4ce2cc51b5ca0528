#!/usr/bin/env bash
# The whole GPU suite with the embedded model's GGUF, in six pytest processes side by side on one
# device (tests/test_gpu.py apart from the other files since 2026-12-02: together they ran past
# 560 s on a slower host, bench/RESULTS.md set Y; the quantized GEMV files apart too, later that day:
# with them the first process ran past 480 s, set AG):
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
Q="tests/test_qplanar.py tests/test_qruns.py tests/test_quant_cuda.py tests/test_quant_kernels.py"
(timeout "$T" $P --ignore=tests/test_gpu_real.py --ignore=tests/test_replay_devices.py \
   --ignore=tests/test_constraints_gpu.py --ignore=tests/test_gpu.py $(printf -- '--ignore=%s ' $Q) tests/ \
   > "$logs/gpu-1.txt" 2>&1; echo "rc $?" >> "$logs/gpu-1.txt") &
(timeout "$T" $P $Q > "$logs/gpu-6.txt" 2>&1; echo "rc $?" >> "$logs/gpu-6.txt") &
(timeout "$T" $P tests/test_gpu.py > "$logs/gpu-5.txt" 2>&1; echo "rc $?" >> "$logs/gpu-5.txt") &
(timeout "$T" $P tests/test_gpu_real.py -k "capital or piped" > "$logs/gpu-2.txt" 2>&1
 echo "rc $?" >> "$logs/gpu-2.txt") &
(timeout "$T" $P tests/test_gpu_real.py tests/test_constraints_gpu.py -k "run_then_replay or test_constraints_gpu" \
   > "$logs/gpu-3.txt" 2>&1; echo "rc $?" >> "$logs/gpu-3.txt") &
(timeout "$T" $P tests/test_replay_devices.py > "$logs/gpu-4.txt" 2>&1; echo "rc $?" >> "$logs/gpu-4.txt") &
wait
status=0
for f in "$logs"/gpu-[1-6].txt; do
  echo "== $(basename "$f"): $(grep -E '(passed|failed|error)' "$f" | tail -1)"
  grep -E '^(FAILED|ERROR) ' "$f"
  [ "$(tail -1 "$f")" = "rc 0" ] || status=1
done
exit $status
