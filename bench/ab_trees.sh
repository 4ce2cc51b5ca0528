#!/usr/bin/env bash
# Decode and prefill of two trees of this repository in one device command, alternating rounds, so
# that a refactor's speed is compared on one machine: BASE (a checkout or `git archive` of the
# commit before, e.g. `mkdir -p .out/base && git archive COMMIT models engine bench chat | tar -x
# -C .out/base`, carried in a git-ignored folder) and this tree.
#
#   bash bench/ab_trees.sh BASE [decode|quant] [ROUNDS]
#
# decode: decode_bench.py on a dense, a DeltaNet-hybrid and a Mamba2-MoE shape (bf16); quant:
# quant_bench.py's small shapes in Q4_K. Each run prints its table; compare the rows of one round.
set -u
base=${1:?usage: bench/ab_trees.sh BASE [decode|quant] [ROUNDS]}
kind=${2:-decode}
cd "$(dirname "$0")/.."
root=$PWD
for round in $(seq 1 "${3:-2}"); do
  for tree in "$base" .; do
    echo "== round $round tree $tree"
    if [ "$kind" = quant ]; then
      (cd "$root/$tree" && timeout 150 python3 bench/quant_bench.py --big "" --small smollm2-135m,qwen3.5-0.8b \
        --small-formats Q4_K --new 128 --prefill 2048 2>&1 | tail -3)
    else
      (cd "$root/$tree" && timeout 130 python3 bench/decode_bench.py smollm2-135m qwen3.5-0.8b granite-4.0-h-tiny \
        --new 128 --prefill 2048 2>&1 | tail -4)
    fi
  done
done
