#!/bin/bash
# benchmarks/pull_drift.py in 5 configurations x 3 runs, the order shuffled per run (seeded), 1000 pulls each:
# bash benchmarks/pull_drift_matrix.sh [OUT]   (results/cpu/pull-drift/README.md, "A busy Python thread")
cd "$(dirname "$0")/.."
out=${1:-results/cpu/pull-drift/gil}
mkdir -p "$out"
declare -A opts=( [loop]="" [loop-busy]="--busy" [loop-busy-switch0.5]="--busy --switch-ms 0.5" [engine]="--engine" [engine-busy]="--engine --busy" )
for run in 1 2 3; do
  order=$(python3 -c "import random; n=['loop','loop-busy','loop-busy-switch0.5','engine','engine-busy']; random.Random($run).shuffle(n); print(' '.join(n))")
  echo "run $run order: $order"
  for name in $order; do
    PYTHONPATH=$PWD .venv/bin/python benchmarks/pull_drift.py --pulls 1000 --windows 1 --seed $run ${opts[$name]} 2>&1 | grep -v "NIXL INFO" > $out/run$run-$name.txt
    grep -E "^ +0-" $out/run$run-$name.txt | sed "s/^/$name /"
  done
done
