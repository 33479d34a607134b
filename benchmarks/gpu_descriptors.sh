#!/usr/bin/env bash
# Descriptors as a measured cause on GPUs (the CPU run: results/cpu/descriptors): the same 512 MiB read as 1 to
# 16,384 NIXL descriptors (layout x block ids x NIXL's merging on/off, counted by NIXL's telemetry), three runs
# in seeded case orders, then the table and plot of time against descriptors. VRAM to VRAM between two processes:
# on one GPU (cuda:0 -> cuda:0, UCX's cuda_ipc) or, with TWO=1, between two GPUs of one host.
#   bash benchmarks/gpu_descriptors.sh OUTDIR          # ~3 min per run on an H200
#   TWO=1 bash benchmarks/gpu_descriptors.sh OUTDIR
#   SEEDS="2 3" bash benchmarks/gpu_descriptors.sh OUTDIR   # some runs only (the table covers every runN there)
# UCX's cuda_ipc GET needs UCX_CUDA_IPC_ENABLE_GET_ZCOPY=on: without it a READ between two processes on one GPU
# fell back to TCP (0.5 GB/s, results/gpu/vllm-shapes).
# Each run's UCX protocol lines (UCX_PROTO_INFO=y) stay in runN/stderr.txt: the READ's line names the path.
set -uo pipefail
out=${1:?usage: gpu_descriptors.sh OUTDIR}
decode=cuda:0
[ "${TWO:-0}" = 1 ] && decode=cuda:1
for seed in ${SEEDS:-1 2 3}; do
  d="$out/run$seed"
  mkdir -p "$d"
  args=(--model llama-3-8b --tokens 4096 --block-size 16 --pattern contiguous,runs:16,runs:4,scattered --layouts same
    --merge on,off --telemetry --reps 5 --warmup 1 --seed "$seed" --shuffle --ucx UCX_PROTO_INFO=y
    --ucx UCX_CUDA_IPC_ENABLE_GET_ZCOPY=on
    --prefill-device cuda:0 --decode-device "$decode" --transport nixl --no-progress
    --json "$d/descriptors.json" --plot "$d/descriptors.png")
  python3 -m kvconnect.cli --log-level WARNING bench "${args[@]}" > "$d/descriptors.txt" 2> "$d/stderr.txt"
  grep -v '^\[' "$d/descriptors.txt" > "$d/table.txt"
done
PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} python3 benchmarks/descriptors_vs_time.py "$out"/run*/descriptors.json --plot "$out/time-vs-descriptors.png" \
  | tee "$out/time-vs-descriptors.txt"
