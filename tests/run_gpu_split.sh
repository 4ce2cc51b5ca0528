#!/usr/bin/env bash
# The whole GPU suite with the embedded model's GGUF in one device call: the gpu-marked tests in
# fifteen pytest processes side by side on one device, sharded by test file (the broad set in
# four, the quantized GEMV files in four, tests/engine/test_graphs.py in two) and test_replay_devices.py by
# test function (its two recording tests are the longest single items):
#   tests/run_gpu_split.sh MODEL.gguf [seconds each may take, 530 by default]
# Each process writes its output to $OUT/NAME.txt (or gpu-logs/ where OUT is unset); the last
# lines of each are printed at the end, and the exit status is 1 where any process failed.
set -u
cd "$(dirname "$0")/.."
[ $# -ge 1 ] && [[ "$1" == *.gguf ]] && [ -f "$1" ] || { echo "usage: tests/run_gpu_split.sh MODEL.gguf [SECONDS]" >&2; exit 2; }
bash tests/run_gpu.sh "$1" --co -q tests/e2e/test_gpu_real.py > /dev/null  # wheels installed, the model linked
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 CHAT_TEST_GGUF=$(realpath "$1")
logs=${OUT:-gpu-logs}; mkdir -p "$logs"
T=${2:-530}
P="python3 -m pytest -q -m gpu -p no:cacheprovider -rfE"
Q="tests/kernels/test_qplanar.py tests/kernels/test_qruns.py tests/formats/test_quant.py tests/kernels/test_quant_kernels.py"
APART="tests/e2e/test_gpu_real.py tests/e2e/test_replay_devices.py tests/engine/test_constraint_masks.py tests/engine/test_graphs.py $Q"

run() {  # run NAME PYTEST-ARGS...: one process, its log and its exit status in $logs/NAME.txt
  local name=$1; shift
  (timeout "$T" $P "$@" > "$logs/$name.txt" 2>&1; echo "rc $?" >> "$logs/$name.txt") &
}

shard() {  # shard NAME N PYTEST-ARGS...: the files holding gpu-marked tests, round-robin over N processes
  local name=$1 n=$2; shift 2
  local files part
  files=$($P --co "$@" 2>/dev/null | grep '::' | cut -d: -f1 | uniq)
  for ((i = 0; i < n; i++)); do
    part=$(echo "$files" | awk -v n="$n" -v i="$i" 'NF && (NR - 1) % n == i')
    # An empty part would hand pytest no paths, and it would run the whole suite again beside
    # the others (the shard of one file over two processes did, and the suite ran past its time).
    [ -n "$part" ] && run "$name-$i" $part
  done
}

shard_tests() {  # shard_tests NAME N FILE: the gpu-marked tests of one file, round-robin over N processes
  local name=$1 n=$2 file=$3 part
  local -a ids
  mapfile -t ids < <($P --co "$file" 2>/dev/null | grep '::')
  for ((i = 0; i < n; i++)); do
    part=()
    for ((j = i; j < ${#ids[@]}; j += n)); do part+=("${ids[j]}"); done
    [ ${#part[@]} -gt 0 ] && run "$name-$i" "${part[@]}"
  done
}

shard gpu-1 4 $(printf -- '--ignore=%s ' $APART) tests/
shard gpu-6 4 $Q
shard_tests gpu-5 2 tests/engine/test_graphs.py
run gpu-2 tests/e2e/test_gpu_real.py -k "capital or piped"
run gpu-3 tests/e2e/test_gpu_real.py tests/engine/test_constraint_masks.py -k "run_then_replay or test_constraint_masks"
for k in same_logits bf16_recording cpu_recordings; do
  run "gpu-4-$k" tests/e2e/test_replay_devices.py -k "$k"
done
wait
status=0
for f in "$logs"/gpu-*.txt; do
  echo "== $(basename "$f"): $(grep -E '(passed|failed|error)' "$f" | tail -1)"
  grep -E '^(FAILED|ERROR) ' "$f"
  [ "$(tail -1 "$f")" = "rc 0" ] || status=1
done
exit $status
