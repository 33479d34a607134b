"""The plug-in's settings: `kv_connector_extra_config` over `KVCONNECT_*` variables over defaults.

Every `ConnectorConfig` field is accepted as an extra-config key (`secret_file`, `lease_ttl_s`,
`side_channel_host`, `advertise_host`, `pull_timeout_s`, `transport`, ...) except `secret` (vLLM prints
the extra config in its start-up log: the secret comes from a file or a variable); a key that is none of
them is refused by name. What vLLM already decides is taken from vLLM and cannot be set here: the engine id
(`kv_transfer_config.engine_id`, shared by the scheduler and every worker of an engine) and the failure
policy (`kv_transfer_config.kv_load_failure_policy`: vLLM's own recompute or fail). `side_channel_port`
is the TP group's base port: worker rank r listens on base + r; 0 (the default) picks a free port,
allowed only without tensor parallelism.

`lease_grace_s` defaults to `LEASE_GRACE_S` here (not 0): the scheduler returns a request's params before
its workers grant the lease (they do so when the next step's orders are bound, which can be a forward
later), so decodes are told to ask again about a lease not granted yet. vLLM holds the blocks meanwhile.
"""

from __future__ import annotations

import logging
from typing import Any

import msgspec

from kvconnect.core.config import ConnectorConfig, connector_config, env_overrides
from kvconnect.core.errors import ConfigError

log = logging.getLogger(__name__)

DECIDED_BY_VLLM = ("engine_id", "failure_policy")
PLUGIN_ONLY = "cross_layer_blocks"  # an extra-config key of the plug-in's own, not a ConnectorConfig field
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


def read_settings(vllm_config: Any) -> VllmSettings:
    """Settings of the engine `vllm_config` describes; ConfigError names a bad key or value."""
    kvt = vllm_config.kv_transfer_config
    extra = dict(kvt.kv_connector_extra_config or {})
    cross = extra.pop(PLUGIN_ONLY, False)
    if not isinstance(cross, bool) and str(cross).lower() not in ("true", "false", "1", "0"):
        raise ConfigError(f"kv_connector_extra_config.{PLUGIN_ONLY} must be true or false, got {cross!r}")
    fields = set(ConnectorConfig.__struct_fields__)
    unknown = sorted(set(extra) - fields)
    if unknown:
        raise ConfigError(
            f"kv_connector_extra_config: unknown key(s) {unknown}; allowed: {sorted(fields | {PLUGIN_ONLY})}"
        )
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
        {} if "lease_grace_s" in extra or env_overrides(None, ("lease_grace_s",)) else {"lease_grace_s": LEASE_GRACE_S}
    )
    config = connector_config(None, **grace, **extra, engine_id=str(kvt.engine_id))
    if tp_size > 1 and config.side_channel_port == 0:
        raise ConfigError(
            f"tensor_parallel_size {tp_size}: set kv_connector_extra_config.side_channel_port (or "
            "KVCONNECT_SIDE_CHANNEL_PORT) to the group's base port; rank r listens on base + r"
        )
    if config.side_channel_port and config.side_channel_port + tp_size > 65536:
        raise ConfigError(f"side_channel_port {config.side_channel_port} + {tp_size} ranks leaves the port range")
    crossed = cross is True or str(cross).lower() in ("true", "1")
    return VllmSettings(config, tp_size, int(vllm_config.cache_config.block_size), str(kvt.kv_role), crossed)


def rank_config(settings: VllmSettings, tp_rank: int) -> ConnectorConfig:
    """The connector config of worker `tp_rank`: its own side-channel port."""
    base = settings.config.side_channel_port
    return msgspec.structs.replace(settings.config, side_channel_port=base + tp_rank if base else 0)
