"""What a NixlConnector deployment already sets, read the way kvconnect means it (a drop-in for llm-d).

- `VLLM_NIXL_SIDE_CHANNEL_HOST` / `VLLM_NIXL_SIDE_CHANNEL_PORT` (llm-d sets the host from the pod's IP) stand
  in for `side_channel_host` / `side_channel_port` where neither the extra config nor a `KVCONNECT_*`
  variable sets them. The port is the data-parallel rank's base, as for NixlConnector; kvconnect's TP rank r
  listens on base + r (NixlConnector serves its TP ranks on one port), so give a TP group tp_size ports.
- Where that host is set to an address of the pod's own (not loopback) and no port is set anywhere, the base
  port is NixlConnector's default, 5600 (`NIXL_DEFAULT_PORT`): llm-d sets only the host, and its pods declare
  port `nixl` 5600. On loopback (several servers on one machine) kvconnect's own default, a free port, stays.
- NixlConnector's `kv_connector_extra_config` keys with a kvconnect meaning are renamed
  (`kv_lease_duration` -> `lease_ttl_s`, `num_threads` -> `nixl_threads`) or accepted where kvconnect
  already behaves so (`backends: ["UCX"]`, `enforce_handshake_compat`); the rest are refused by name with
  what to use instead, NIXL's LIBFABRIC backend (llm-d's AWS EFA variant) among them.

Pure: takes the extra config and the environment, returns what to use and what to log.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvconnect.core.allowlist import is_loopback
from kvconnect.core.config import WILDCARD_HOSTS
from kvconnect.core.errors import ConfigError

RENAMED = {"kv_lease_duration": "lease_ttl_s", "num_threads": "nixl_threads"}
# NixlConnector keys kvconnect refuses, each with what to do instead
NO_MEANING = {
    "bidirectional_kv_xfer": "kvconnect moves KV one way, decode pulls from prefill; drop the key",
    "decoder_kv_blocks_ttl": "a decode never holds blocks for a peer; the prefill's lease_ttl_s bounds leases",
    "engine_ttl": "peers are forgotten when their incarnation changes or their handshake fails; drop the key",
    "kv_recompute_threshold": "use kv_transfer_config.kv_load_failure_policy (recompute or fail)",
    "push_registration_timeout": "kvconnect does not push; the decode's handshake_timeout_s bounds first contact",
}
ENV_HOST, ENV_PORT = "VLLM_NIXL_SIDE_CHANNEL_HOST", "VLLM_NIXL_SIDE_CHANNEL_PORT"
NIXL_DEFAULT_PORT = 5600  # NixlConnector's VLLM_NIXL_SIDE_CHANNEL_PORT when unset (vLLM's envs.py)
LIBFABRIC_REFUSED = (
    "NIXL's LIBFABRIC backend (AWS EFA) is not supported yet: kvconnect creates its NIXL agents with the UCX "
    'backend only. Use backends ["UCX"] (UCX has no EFA transport, so the KV then crosses the pod network over '
    "TCP: correct, slower than LIBFABRIC), or keep NixlConnector on that pool until kvconnect supports LIBFABRIC"
)


def translate_keys(extra: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """(the extra config in kvconnect's keys, one log line per NixlConnector key taken). ConfigError for a
    NixlConnector key kvconnect has no meaning for, or one given together with its kvconnect name."""
    out = dict(extra)
    notes: list[str] = []
    for old, new in RENAMED.items():
        if old not in out:
            continue
        if new in out:
            raise ConfigError(f"kv_connector_extra_config sets both {old} (NixlConnector's) and {new}; keep {new}")
        out[new] = out.pop(old)
        notes.append(f"NixlConnector's {old}={out[new]!r} read as {new}")
    if "backends" in out:
        backends = out.pop("backends")
        if isinstance(backends, (list, tuple)) and "LIBFABRIC" in [str(b).upper() for b in backends]:
            raise ConfigError(f"kv_connector_extra_config.backends={backends!r}: {LIBFABRIC_REFUSED}")
        if not isinstance(backends, (list, tuple)) or [str(b).upper() for b in backends] != ["UCX"]:
            raise ConfigError(
                f"kv_connector_extra_config.backends={backends!r}: kvconnect moves KV over NIXL's UCX backend "
                '(or its same-host IPC path); use ["UCX"] or drop the key'
            )
        notes.append('NixlConnector\'s backends=["UCX"] accepted (kvconnect uses UCX)')
    if "enforce_handshake_compat" in out:
        value = out.pop("enforce_handshake_compat")
        if value not in (True, "true", "True", 1, "1"):
            raise ConfigError(
                f"kv_connector_extra_config.enforce_handshake_compat={value!r}: kvconnect always checks that both "
                "sides' caches are compatible at the handshake; it cannot be turned off"
            )
        notes.append("NixlConnector's enforce_handshake_compat accepted (kvconnect always checks)")
    refused = sorted(set(out) & set(NO_MEANING))
    if refused:
        raise ConfigError(
            "kv_connector_extra_config: NixlConnector key(s) without a kvconnect meaning: "
            + "; ".join(f"{k}: {NO_MEANING[k]}" for k in refused)
        )
    return out, notes


def side_channel_fallback(
    extra: Mapping[str, Any], kvconnect_env: Mapping[str, str], environ: Mapping[str, str]
) -> tuple[dict[str, Any], list[str]]:
    """The side-channel host and port from NixlConnector's variables, for the fields neither `extra` nor a
    `KVCONNECT_*` variable (`kvconnect_env`, by field name) sets; with one log line each. With the host on an
    address of the pod's own and no port anywhere, the port is NixlConnector's default (NIXL_DEFAULT_PORT)."""
    out: dict[str, Any] = {}
    notes: list[str] = []
    host = environ.get(ENV_HOST, "").strip()
    port_set = (
        "side_channel_port" in extra or "side_channel_port" in kvconnect_env or bool(environ.get(ENV_PORT, "").strip())
    )
    if host and not port_set and not is_loopback(host):
        out["side_channel_port"] = NIXL_DEFAULT_PORT
        notes.append(
            f"{ENV_HOST} set without {ENV_PORT}: side_channel_port {NIXL_DEFAULT_PORT}, NixlConnector's default "
            f"(TP rank r listens on {NIXL_DEFAULT_PORT} + r; set side_channel_port to choose another)"
        )
    for var, field in ((ENV_HOST, "side_channel_host"), (ENV_PORT, "side_channel_port")):
        raw = environ.get(var, "").strip()
        if not raw or field in extra or field in kvconnect_env:
            continue
        if field == "side_channel_port":
            if not raw.isdigit() or not 0 < int(raw) < 65536:
                raise ConfigError(f"{var}={raw!r} is not a port number (1-65535)")
            out[field] = int(raw)
        else:
            out[field] = raw
            advertised = "advertise_host" in extra or "advertise_host" in kvconnect_env
            if raw not in WILDCARD_HOSTS and not advertised:
                out["advertise_host"] = raw  # (NixlConnector advertises the address it binds)
        notes.append(f"{var}={raw} read as {field} (set kvconnect's own to silence this)")
    return out, notes
