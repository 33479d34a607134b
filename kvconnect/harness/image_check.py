"""The build-time check of an image that adds kvconnect to vLLM (docker/Dockerfile.vllm-gpu runs
`python3 -m kvconnect.harness.image_check` right after installing the package): the build stops, naming the
problem, unless

- `kvconnect.vllm` imports next to the image's vLLM, and vLLM's connector factory finds `KVConnectConnector`
  by its name once the package's plug-in entry point (`vllm.general_plugins`) has run;
- the NIXL build kvconnect loads is the one for the image's CUDA: torch built for CUDA 12 needs `nixl-cu12`
  (the package's `cu12` extra), CUDA 13 `nixl-cu13` (the default dependency). kvconnect falls back to
  whichever build imports, and a build for another CUDA imports fine without a GPU but fails when it first
  registers GPU memory: at start-up, on the GPU host, not at build time.

A torch without CUDA fails the check unless `--allow-cpu` is given (then any NIXL build does: DRAM only).
"""

from __future__ import annotations

import argparse
import logging
import sys

log = logging.getLogger(__name__)

BUILDS = {"12": "nixl_cu12", "13": "nixl_cu13"}  # CUDA major -> the NIXL module built for it
EXTRA_OF = {"nixl_cu12": "kvconnect[cu12] (nixl-cu12)", "nixl_cu13": "kvconnect (nixl-cu13, the default)"}


def nixl_problem(torch_cuda: str | None, nixl_name: str, allow_cpu: bool = False) -> str | None:
    """Why NIXL module `nixl_name` does not fit a torch built for `torch_cuda` (None: no CUDA), or None."""
    if torch_cuda is None:
        return None if allow_cpu else "torch has no CUDA (torch.version.cuda is None): not a GPU image"
    major = torch_cuda.split(".")[0]
    want = BUILDS.get(major)
    if want is None:
        return f"torch is built for CUDA {torch_cuda}; kvconnect has NIXL builds for CUDA {sorted(BUILDS)} only"
    if nixl_name != want:
        return (
            f"torch is built for CUDA {torch_cuda} but kvconnect loads {nixl_name}: install {EXTRA_OF[want]} "
            f"(Dockerfile.vllm-gpu: --build-arg KVCONNECT_SPEC={'.[cu12]' if major == '12' else '.'})"
        )
    return None


def loaded_by_name() -> str:
    """The class vLLM's factory gives for `"kv_connector": "KVConnectConnector"` after loading the plug-ins."""
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    config = KVTransferConfig(kv_connector="KVConnectConnector", kv_role="kv_both")
    cls = KVConnectorFactory.get_connector_class(config)
    return f"{cls.__module__}.{cls.__qualname__}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="check that kvconnect fits this vLLM image")
    parser.add_argument("--allow-cpu", action="store_true", help="accept a torch without CUDA (DRAM only)")
    args = parser.parse_args(argv)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("image_check: %(levelname)s %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    problems = []
    try:
        import kvconnect.vllm  # noqa: F401  (the plug-in package; the connector itself loads below)

        name = loaded_by_name()
        if name != "kvconnect.vllm.connector.KVConnectConnector":
            problems.append(f"vLLM loads {name} for the name KVConnectConnector")
    except Exception as e:  # an import error names the missing piece; anything else too
        problems.append(f"kvconnect.vllm does not load in vLLM by name: {type(e).__name__}: {e}")
    import torch

    from kvconnect.core.agent import nixl_module

    try:
        api, _ = nixl_module()
        nixl_name = api.__name__.split(".")[0]
    except Exception as e:
        problems.append(f"no NIXL build imports: {e}")
    else:
        problem = nixl_problem(torch.version.cuda, nixl_name, args.allow_cpu)
        if problem:
            problems.append(problem)
        log.info("torch %s (CUDA %s), NIXL module %s", torch.__version__, torch.version.cuda, nixl_name)
    for problem in problems:
        log.error("%s", problem)
    if not problems:
        log.info("kvconnect.vllm loads in vLLM by the name KVConnectConnector; the NIXL build fits the CUDA")
    return 1 if problems else 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
