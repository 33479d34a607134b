#!/usr/bin/env bash
# The layout ladder on two GPUs of one host (one process per GPU): NIXL per layout, UCX stream tuning,
# then the CUDA IPC gather, for Llama-3-8B and -70B shapes, scattered and contiguous ids.
#   bash benchmarks/gpu_two_devices_layouts.sh OUTDIR
set -uo pipefail
out=${1:?usage: gpu_two_devices_layouts.sh OUTDIR}
kv="python3 -m kvconnect.cli --log-level WARNING bench"
common="--tokens 4096 --block-size 16 --layouts same --pattern scattered,contiguous --reps 10 --warmup 2 \
  --prefill-device cuda:0 --decode-device cuda:1 --no-progress"
run() { local name=$1; shift; echo "\$ kvconnect bench $*" | tee "$out/$name.txt"; $kv "$@" 2>&1 | tee -a "$out/$name.txt"; }
run h200-8b --model llama-3-8b $common --transport nixl,ipc --json "$out/h200-8b.json" --plot "$out/h200-8b.png"
run h200-8b-ucx-streams --model llama-3-8b $common --transport nixl --ucx UCX_CUDA_IPC_MAX_STREAMS=4
run h200-70b --model llama-3-70b $common --transport nixl,ipc --json "$out/h200-70b.json" --plot "$out/h200-70b.png"
