#!/usr/bin/env bash
# kvconnect on the NIXL path under load, on one GPU (issue #49 item 4): `kvconnect-nixl` (transport: nixl,
# lease_board: false: every pull a NIXL READ that waits for its PIN's answer, as pods on two nodes run it) against
# NixlConnector (`nixl`), NixlPushConnector (`push`) and kvconnect's same-host path (`kvconnect-samehost`: the CUDA
# IPC gather and the lease board, the path of every published kvconnect lead), with a plain vLLM server for the
# inter-token baseline; `vllm bench serve` at 4, 8 and 16 requests/s and a cap of 16 in flight on Poisson arrivals
# at 20 requests/s, 8 s of requests per cell, 3 runs. Every NIXL server runs with UCX_PROTO_INFO=y.
#
#   [PAIRS=a,b,...] bash benchmarks/gpu_nixl_path.sh OUT [STEP [BACK]]
#
# In steps: one run per invocation. The device machine allows 10 minutes per command and 30 minutes per session;
# one run is 9 servers started together (~2 min, run9 of results/gpu/serve: 7 in 99 s) and 20 client runs of
# ~11 s with the resident client (~4 min), so ~6-7 min. STEP = 0, 1 or 2 measures run STEP into OUT (the servers
# start afresh for each run); without STEP, all 3 runs in one invocation (~16 min: only where no limit applies).
# BACK: a folder for the step's tarball (`gpu-nixl-run<STEP>.tar.gz`, OUT without the model), e.g. the device
# tool's $OUT. Here, afterwards: untar every step's tarball into one folder, then
#   python3 benchmarks/vllm_serve_gpu.py FOLDER --replot      # serve.json, serve.txt (min-max), plots
#
# The device session (~25 of its 30 minutes), each call right after the one before (files under /tmp survive only
# while the machine is warm; a call that finds them gone stops with COLD: then start again from call 1):
#   here, once: the carry of ../shared/gpu-vllm/README.md (.vc/a, .vc/b, .vc/c) and the NIXL wheels in .whl/
#     (nixl-cu13 and nixl, 1.5.1 as results/gpu/serve ran; the device tool's README says how)
#   calls 1-3: that README's calls 1-3 (carry .vc/a, .vc/c, .vc/b)                    ~1-2 min start, ~2 min
#     (.vc/a's vllm_C.zip, 55 MiB, and a tree of 10 MiB exceed the 64 MiB a call carries: split it, e.g.
#     `split -b 40M .vc/a/vllm_C.zip` into .vc/a1 and .vc/a2 with the small wheels, copy the first part to /tmp
#     in one call and `cat` both parts in the next; results/gpu/nixl-path-h100 ran so)
#   call 4 (carry .whl: the nixl wheel and nixl-cu13's wheel repacked without its nixl_ep_cu13/ folder as
#     nixl_cu13_min.zip, 30 MiB; the whole wheel, 57 MiB, and the tree exceed the 64 MiB a call carries):
#     ls /tmp/site26/vllm >/dev/null || { echo COLD; exit 3; }; python3 -m zipfile -e .whl/nixl_cu13_min.zip \
#     /tmp/site26 && python3 -m pip install -q \
#     --no-index --no-deps --no-compile --target /tmp/site26 .whl/*.whl && \
#     bash benchmarks/gpu_nixl_path.sh /tmp/gpu-nixl 0 $OUT                               ~7 min
#   call 5: bash benchmarks/gpu_nixl_path.sh /tmp/gpu-nixl 1 $OUT                         ~7 min
#   call 6: bash benchmarks/gpu_nixl_path.sh /tmp/gpu-nixl 2 $OUT                         ~7 min
# Each step interrupts the benchmark at 540 s (SIGINT: the servers stop; a cut run keeps the rows it measured) so
# that its tarball still comes back within the 10 minutes.
set -uo pipefail
out=${1:?usage: gpu_nixl_path.sh OUT [STEP [BACK]]}
step=${2:-}
back=${3:-}
ls /tmp/site26/vllm >/dev/null 2>&1 || { echo "COLD: /tmp/site26 (the carried vLLM) is gone; carry again"; exit 3; }
export PYTHONPATH=/tmp/site26:$PWD HF_HUB_OFFLINE=1 VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1 \
  NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# 9 servers of 8 GiB of KV each fit an H200 (~139 GiB); on an H100 (~78 GiB) each gets 6 GiB (printed in the log)
mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
kv=8G
[ "${mib:-0}" -lt 120000 ] && kv=6G
echo "GPU: $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), ${mib} MiB; KV per server: $kv"
# PAIRS: the pairs to start (kvconnect/bench/gpu_pd.py), e.g. PAIRS=kvconnect-nixl,kvconnect-nixl-xl,nixl
pairs=${PAIRS:-kvconnect-nixl,nixl,push,kvconnect-samehost}
echo "pairs: $pairs (and a plain server)"
if [ -n "$step" ]; then runs="--runs 1 --run-index $step"; else runs="--runs 3"; fi
[ -z "$step" ] && limit=1800 || limit=540
mkdir -p "$out"
# shellcheck disable=SC2086
timeout -s INT -k 30 "$limit" python3 benchmarks/vllm_serve_gpu.py "$out" $runs --pairs "$pairs" \
  --rates 4,8,16 --concurrency 16 --concurrency-rate 20 --prompts-per-rate 8 --client resident \
  --gpu-args "--gpu-memory-utilization 0.1 --kv-cache-memory-bytes $kv" 2>&1 | tee -a "$out/serve${step}.out"
rc=${PIPESTATUS[0]}
if [ -n "$back" ]; then
  mkdir -p "$back"
  tar czf "$back/gpu-nixl-run${step:-all}.tar.gz" -C "$out" --exclude=./model .
  ls -l "$back"
fi
exit "$rc"
