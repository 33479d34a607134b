#!/usr/bin/env bash
# Builds the virtual environment that the kvconnect container images ship, from this repository.
#
#   docker/install.sh VENV [SRC]      (SRC: the repository or a copy of it; default: this script's repo)
#
# Both Dockerfiles run it in their build stage, and tests/test_deploy.py runs the very same script on a
# CI machine (no container engine there), so the image's install steps are exercised by CI.
#
# Environment:
#   TORCH_VERSION      torch release to install first (default 2.13.0)
#   TORCH_INDEX_URL    index holding the wanted torch build, e.g. PyTorch's CPU wheel index (a plain
#                      `torch` from the default index is a multi-GB CUDA build). Empty: pip's own configuration.
#   KVCONNECT_EXTRAS   extras of the package, e.g. "cu12" or "flash" (default: none)
#   PYTHON             interpreter for the venv (default python3)
set -euo pipefail
venv=${1:?usage: install.sh VENV [SRC]}
src=${2:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}
torch_version=${TORCH_VERSION:-2.13.0}
torch_index=${TORCH_INDEX_URL:-}
extras=${KVCONNECT_EXTRAS:-}

"${PYTHON:-python3}" -m venv "$venv"
pip=("$venv/bin/python" -m pip)

# 1. torch, from the index of the wanted build (CPU or CUDA), before anything can pull another build
if [ -n "$torch_index" ]; then
  "${pip[@]}" install --index-url "$torch_index" "torch==$torch_version"
else
  "${pip[@]}" install "torch==$torch_version"
fi

# 2. kvconnect as a wheel built from the repository (not an editable install), with its dependencies;
#    the torch installed above satisfies `torch>=...` and stays
wheels=$(mktemp -d)
trap 'rm -rf "$wheels"' EXIT
"${pip[@]}" wheel --no-deps --wheel-dir "$wheels" "$src"
wheel=$(find "$wheels" -name 'kvconnect-*.whl' | head -n 1)
"${pip[@]}" install "$wheel${extras:+[$extras]}"

# 3. fail the build, not the first request: dependencies consistent, entry point and modules importable
"${pip[@]}" check
"$venv/bin/kvconnect" --help >/dev/null
"$venv/bin/python" -c "import kvconnect.serving.server, kvconnect.serving.proxy; from kvconnect.core.agent import nixl_module; nixl_module()"
