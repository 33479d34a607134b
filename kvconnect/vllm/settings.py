"""The plug-in's settings: `kv_connector_extra_config` over `KVCONNECT_*` variables over defaults.

Every `ConnectorConfig` field is accepted as an extra-config key (`secret_file`, `lease_ttl_s`,
`side_channel_host`, `advertise_host`, `pull_timeout_s`, `transport`, ...) except `secret` (vLLM prints
the extra config in its start-up log: the secret comes from a file or a variable); a key that is none of
them is refused by name. What vLLM already decides is taken from vLLM and cannot be set here: the engine id
(`kv_transfer_config.engine_id`, shared by the scheduler and every worker of an engine) and the failure
policy (`kv_transfer_config.kv_load_failure_policy`: vLLM's own recompute or fail). `side_channel_port`
is the TP group's base port: worker rank r listens on base + r; 0 (the default) picks a free port,
allowed only without tensor parallelism. With data parallelism each DP rank is an engine of its own (vLLM
appends `_dp<rank>` to its engine id) and its TP group's base is `side_channel_port + dp_rank * tp_size`.

Plug-in keys (not `ConnectorConfig` fields): `cross_layer_blocks` (vLLM 0.26: one tensor for every layer)
and `kv_cache_layout`: "HND" (default) asks vLLM for pages with heads outermost, so that a prefill and a
decode of different TP sizes exchange runs of whole heads, or "vllm" to keep the attention backend's choice
(then only equal TP sizes pair on the GPU; the default with `cross_layer_blocks`, `required_layout`).
NixlConnector's keys and variables are read as `nixl_compat.py` says.

`lease_grace_s` defaults to `LEASE_GRACE_S` here (not 0): the scheduler returns a request's params before
its workers grant the lease (they do so when the next step's orders are bound, which can be a forward
later), so decodes are told to ask again about a lease not granted yet. vLLM holds the blocks meanwhile.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

import msgspec

from kvconnect.core.config import ConnectorConfig, connector_config, env_overrides
from kvconnect.core.errors import ConfigError
from kvconnect.vllm.nixl_compat import side_channel_fallback, translate_keys

log = logging.getLogger(__name__)

DECIDED_BY_VLLM = ("engine_id", "failure_policy")
PLUGIN_ONLY = ("cross_layer_blocks", "kv_cache_layout")  # extra-config keys of the plug-in's own
LAYOUTS = ("HND", "vllm")  # kv_cache_layout
LEASE_GRACE_S = 10.0  # how long after request_finished a lease may still be granted (one engine step, or two)


class VllmSettings(msgspec.Struct, frozen=True):
    """What the scheduler and the workers of one vLLM engine agree on."""

    config: ConnectorConfig  # engine id from vLLM, side_channel_port = the TP group's base port
    tp_size: int
    block_size: int  # vLLM's (scheduler) block size, in tokens
    role: str  # kv_producer, kv_consumer or kv_both
    # where vLLM offers it (0.26), ask for one KV tensor for every layer, a block's layers side by side: one
    # descriptor per block for every layer. kv_connector_extra_config `cross_layer_blocks` (plug-in only)
    cross_layer_blocks: bool = False


def _cross_layer(extra: Mapping[str, Any]) -> bool:
    """The `cross_layer_blocks` key's value (ConfigError unless a boolean or its spelling)."""
    cross = extra.get(PLUGIN_ONLY[0], False)
    if not isinstance(cross, bool) and str(cross).lower() not in ("true", "false", "1", "0"):
        raise ConfigError(f"kv_connector_extra_config.{PLUGIN_ONLY[0]} must be true or false, got {cross!r}")
    return cross is True or str(cross).lower() in ("true", "1")


def required_layout(vllm_config: Any) -> str | None:
    """The KV cache layout the plug-in asks vLLM for: "HND" unless `kv_cache_layout` is "vllm" (None), or
    `cross_layer_blocks` is set: then vLLM's own (None). vLLM 0.26 allocates a cross-layer tensor asked for HND
    with a block's heads outside its layers (B, H, L, N, C), which no page format here describes, while its own
    order keeps each layer's page whole (B, L, N, H, C); asking for both is refused by name."""
    kvt = getattr(vllm_config, "kv_transfer_config", None)
    extra = dict(getattr(kvt, "kv_connector_extra_config", None) or {})
    cross = _cross_layer(extra)
    layout = extra.get("kv_cache_layout", "vllm" if cross else "HND")
    if layout not in LAYOUTS:
        raise ConfigError(f"kv_connector_extra_config.kv_cache_layout must be one of {list(LAYOUTS)}, got {layout!r}")
    if cross and layout == "HND":
        raise ConfigError(
            "kv_connector_extra_config: cross_layer_blocks with kv_cache_layout HND: vLLM then puts a block's "
            "heads outside its layers, a page format kvconnect does not read; leave kv_cache_layout unset (vLLM's "
            "own layout; a decode of another TP size then pairs only on CPU) or turn cross_layer_blocks off"
        )
    return None if layout == "vllm" else layout


def read_settings(vllm_config: Any, environ: Mapping[str, str] | None = None) -> VllmSettings:
    """Settings of the engine `vllm_config` describes; ConfigError names a bad key or value."""
    kvt = vllm_config.kv_transfer_config
    extra, notes = translate_keys(kvt.kv_connector_extra_config or {})
    crossed = _cross_layer(extra)
    required_layout(vllm_config)  # (checks the value, and that it goes with cross_layer_blocks)
    extra.pop(PLUGIN_ONLY[0], None)
    extra.pop(PLUGIN_ONLY[1], None)
    fields = set(ConnectorConfig.__struct_fields__)
    unknown = sorted(set(extra) - fields)
    if unknown:
        raise ConfigError(
            f"kv_connector_extra_config: unknown key(s) {unknown}; allowed: {sorted(fields | set(PLUGIN_ONLY))}"
        )
    env = os.environ if environ is None else environ
    fallback, env_notes = side_channel_fallback(extra, env_overrides(env, tuple(fields)), env)
    extra.update(fallback)
    for note in notes + env_notes:
        log.info("kvconnect: %s", note)
    decided = sorted(set(extra) & set(DECIDED_BY_VLLM))
    if decided:
        raise ConfigError(
            f"kv_connector_extra_config: {decided} are vLLM's to decide (kv_transfer_config.engine_id,"
            " kv_transfer_config.kv_load_failure_policy)"
        )
    if "secret" in extra:  # (the value is never echoed)
        raise ConfigError(
            "kv_connector_extra_config.secret: vLLM logs kv_connector_extra_config in clear at start-up; give "
            "the secret as secret_file (a mounted file), KVCONNECT_SECRET_FILE or KVCONNECT_SECRET instead"
        )
    if not kvt.engine_id:
        raise ConfigError("kv_transfer_config.engine_id is empty")
    tp_size = int(vllm_config.parallel_config.tensor_parallel_size)
    grace = (
        {} if "lease_grace_s" in extra or env_overrides(env, ("lease_grace_s",)) else {"lease_grace_s": LEASE_GRACE_S}
    )
    config = connector_config(env, **grace, **extra, engine_id=str(kvt.engine_id))
    if tp_size > 1 and config.side_channel_port == 0:
        raise ConfigError(
            f"tensor_parallel_size {tp_size}: set kv_connector_extra_config.side_channel_port (or "
            "KVCONNECT_SIDE_CHANNEL_PORT) to the group's base port; rank r listens on base + r"
        )
    if config.side_channel_port and config.side_channel_port + tp_size > 65536:
        raise ConfigError(f"side_channel_port {config.side_channel_port} + {tp_size} ranks leaves the port range")
    return VllmSettings(config, tp_size, int(vllm_config.cache_config.block_size), str(kvt.kv_role), crossed)


def data_parallel_index(parallel_config: Any) -> int:
    """This engine's data-parallel rank, as NixlConnector offsets its port by it (`data_parallel_index`; vLLM
    releases without it: `data_parallel_rank`; 0 without data parallelism)."""
    for name in ("data_parallel_index", "data_parallel_rank"):
        value = getattr(parallel_config, name, None)
        if isinstance(value, int) and value >= 0:
            return value
    return 0


def rank_config(settings: VllmSettings, tp_rank: int, dp_rank: int = 0) -> ConnectorConfig:
    """The connector config of worker `tp_rank` of data-parallel rank `dp_rank`: its own side-channel port,
    base + dp_rank * tp_size + tp_rank."""
    base = settings.config.side_channel_port
    port = base + dp_rank * settings.tp_size + tp_rank if base else 0
    if port > 65535:
        raise ConfigError(
            f"side_channel_port {base} + data-parallel rank {dp_rank} x tp_size {settings.tp_size} + rank {tp_rank} "
            "leaves the port range"
        )
    return msgspec.structs.replace(settings.config, side_channel_port=port)
