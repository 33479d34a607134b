#!/usr/bin/env bash
# Two GPUs of one host (prefill on cuda:0, decode on cuda:1):
#  - the Llama-3-8B and -70B cross_layer rows with pinned leases (total_ms is requested -> usable: the
#    confirmation round trip is not in it);
#  - heterogeneous pairs (TP 1:2 and 2:1, NHD/HND, decode block 64) in VRAM.
#   bash benchmarks/gpu_two_devices_pinned_hetero.sh OUTDIR
set -uo pipefail
out=${1:?usage: gpu_two_devices_pinned_hetero.sh OUTDIR}
kv="timeout 300 python3 -m kvconnect.cli --log-level WARNING bench"
gpus="--prefill-device cuda:0 --decode-device cuda:1 --no-progress"
pinned="--tokens 4096 --block-size 16 --layouts cross_layer --pattern scattered,contiguous --reps 10 --warmup 2 $gpus"
hetero="--model llama-3-8b --tokens 4096 --layouts cross_layer --transport nixl --reps 5 --warmup 1 $gpus"
run() { local name=$1; shift; echo "\$ kvconnect bench $*" | tee "$out/$name.txt"; $kv "$@" 2>&1 | tee -a "$out/$name.txt"; }
run h200-8b-pinned --model llama-3-8b $pinned --transport nixl,ipc --json "$out/h200-8b-pinned.json"
run h200-70b-pinned --model llama-3-70b $pinned --transport nixl,ipc --json "$out/h200-70b-pinned.json"
run h200-8b-hetero $hetero --tp 1:1,1:2,2:1 --token-layouts NHD:NHD,HND:HND,NHD:HND --hetero-path auto \
  --json "$out/h200-8b-hetero.json" --plot "$out/h200-8b-hetero.png"
run h200-8b-hetero-block64 $hetero --decode-block-size 64 --tp 1:1,2:1 --token-layouts NHD:NHD,HND:HND \
  --hetero-path auto,direct,staging --json "$out/h200-8b-hetero-block64.json"
