"""vLLM prefill/decode across two containers: the compose file's `vllm` profile (vLLM's CPU build from the
`kvconnect:vllm-cpu` image, one container per server on the project's network, kvconnect's proxy in front),
with the KV connector of your choice, extra environment for both servers (UCX settings, say) and an
aggregated vLLM server from the same image as the reference. For tests and for benchmarks of the NIXL path
between network namespaces (no shared memory, no lease board: what pods on two nodes have).

    with VllmPair("kvconnect", model_dir, log_dir, env={"UCX_TLS": "tcp,self"}) as pair:
        pair.urls["proxy"], pair.urls["prefill"], pair.urls["decode"], pair.urls["aggregated"]

Connectors: `kvconnect` (KVConnectConnector, loaded by name through the package's vLLM plug-in entry
point), `nixl` (vLLM's NixlConnector as shipped) and `nixl-fair` (NixlConnector with its CPU thread pinning
and NIXL progress thread undone: kvconnect.bench.nixl_fair). Each server is bound to its own cores
(`VLLM_CPU_OMP_THREADS_BIND`); on a 2-core machine prefill and the aggregated server share core 0, decode
has core 1. Servers run with `--enforce-eager` by default: compiling the model (inductor, a C++ build)
costs minutes per start on a small CPU machine.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvconnect.harness.containers import ComposeProject, shipped_services

log = logging.getLogger(__name__)

# name -> (kv_connector, kv_connector_module_path or None: loaded by its registered name)
CONNECTORS: dict[str, tuple[str, str | None]] = {
    "kvconnect": ("KVConnectConnector", None),
    "nixl": ("NixlConnector", None),
    "nixl-fair": ("FairNixlConnector", "kvconnect.bench.nixl_fair"),
}
SERVICES = {"prefill": "vllm-prefill", "decode": "vllm-decode", "aggregated": "vllm-aggregated"}
ROLES = {"prefill": "kv_producer", "decode": "kv_consumer"}
SERVED_MODEL_NAME = "model"
VLLM_UP_TIMEOUT_S = 900.0  # three engines starting together on two busy cores, plus a first request's handshake


def kv_transfer_config(connector: str, role: str, engine_id: str, failure_policy: str = "") -> str:
    """The `--kv-transfer-config` JSON of one server."""
    if connector not in CONNECTORS:
        raise ValueError(f"connector must be one of {sorted(CONNECTORS)}, not {connector!r}")
    name, module = CONNECTORS[connector]
    cfg: dict[str, Any] = {"kv_connector": name, "kv_role": role, "engine_id": engine_id}
    if module:
        cfg["kv_connector_module_path"] = module
    if failure_policy:
        cfg["kv_load_failure_policy"] = failure_policy
    cfg["kv_connector_extra_config"] = {}
    return json.dumps(cfg)


def with_kv_config(command: list[str], kv_config: str | None, extra_args: list[str]) -> list[str]:
    """A shipped vLLM command with its `--kv-transfer-config` value replaced (None: removed) and args added."""
    out = list(command)
    if "--kv-transfer-config" in out:
        i = out.index("--kv-transfer-config")
        del out[i : i + 2]
    if kv_config is not None:
        out += ["--kv-transfer-config", kv_config]
    return out + extra_args


@dataclass
class VllmPair:
    """A vLLM P/D pair in containers (plus an aggregated server and the proxy). A context manager."""

    connector: str
    model_dir: Path
    log_dir: Path
    env: dict[str, str] = field(default_factory=dict)  # added to every vLLM server's environment
    aggregated: bool = True
    eager: bool = True
    kv_cache_gib: int = 1
    max_model_len: int = 2048
    max_num_seqs: int = 8
    dtype: str = "float32"  # (VLLM_DTYPE; vLLM's "auto" serves a float32 checkpoint in bfloat16 on CPU)
    failure_policy: str = "recompute"  # the decode's kv_load_failure_policy ("fail" ends the request)
    cpus: dict[str, str] = field(default_factory=lambda: {"prefill": "0", "decode": "1", "aggregated": "0"})
    project: ComposeProject | None = None
    urls: dict[str, str] = field(default_factory=dict)

    def override(self) -> dict[str, Any]:
        shipped = shipped_services()
        extra_args = ["--seed", "0", "--max-num-seqs", str(self.max_num_seqs)]
        if self.eager:
            extra_args.append("--enforce-eager")
        services: dict[str, Any] = {}
        for side in ("prefill", "decode"):
            name = SERVICES[side]
            policy = self.failure_policy if side == "decode" else ""
            kv = kv_transfer_config(self.connector, ROLES[side], f"{name}-0", policy)
            env = {
                **shipped[name]["environment"],
                "VLLM_CPU_OMP_THREADS_BIND": self.cpus[side],
                # NixlConnector's side channel: bound on, and advertised as, the service's name on the network
                "VLLM_NIXL_SIDE_CHANNEL_HOST": side,
                **self.env,
            }
            services[name] = {"command": with_kv_config(shipped[name]["command"], kv, extra_args), "environment": env}
        if self.aggregated:
            agg = dict(shipped["vllm-prefill"])
            agg.pop("healthcheck", None)
            agg["hostname"] = "aggregated"
            agg["networks"] = {"kvnet": {"aliases": ["aggregated"]}}
            agg["environment"] = {
                **agg["environment"],
                "VLLM_CPU_OMP_THREADS_BIND": self.cpus["aggregated"],
                **self.env,
            }
            agg["command"] = with_kv_config(agg["command"], None, extra_args)
            services[SERVICES["aggregated"]] = agg
        return {"services": services}

    def variables(self) -> dict[str, str]:
        return {
            "MODEL_DIR": str(Path(self.model_dir).resolve()),
            "SERVED_MODEL_NAME": SERVED_MODEL_NAME,
            "VLLM_CPU_KVCACHE_SPACE": str(self.kv_cache_gib),
            "VLLM_MAX_MODEL_LEN": str(self.max_model_len),
            "VLLM_DTYPE": self.dtype,
        }

    def up(self) -> VllmPair:
        sides = ["prefill", "decode", *(["aggregated"] if self.aggregated else [])]
        self.project = ComposeProject(
            "vllm", self.log_dir, self.variables(), self.override(), up_timeout_s=VLLM_UP_TIMEOUT_S
        )
        self.project.up(health=[SERVICES[s] for s in sides])
        self.urls = {s: self.project.url(SERVICES[s]) for s in sides}
        self.urls["proxy"] = self.project.proxy_url
        log.info("vLLM P/D in containers (%s): %s", self.connector, self.urls)
        return self

    def down(self) -> list[str]:
        """Everything stopped and removed; what compose itself left behind (see ComposeProject.down)."""
        return self.project.down() if self.project is not None else []

    def __enter__(self) -> VllmPair:
        return self.up()

    def __exit__(self, *exc: object) -> None:
        self.down()
