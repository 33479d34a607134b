"""kvconnect: move a prompt's paged KV cache from a prefill worker to a decode worker over NVIDIA NIXL.

What an engine needs is exported here, and only here is it promised to stay: describe the cache
(`CacheSpec`, `LayoutKind`), wrap its tensors (`KVCache`), start one `KVConnector` per worker (settings
from `connector_config`), `lease` finished prefills, `pull` on the decode side and poll the `PullHandle`.
Every error raised derives from `KVConnectError`. See the README's engine example and docs/architecture.md.
"""

from kvconnect.core.cache import KVCache
from kvconnect.core.config import (
    ConnectorConfig,
    FailurePolicy,
    HeteroPathChoice,
    TransportChoice,
    connector_config,
)
from kvconnect.core.connector import KVConnector
from kvconnect.core.decode.handle import PullHandle, PullStats
from kvconnect.core.errors import (
    AuthError,
    ConfigError,
    HandshakeError,
    HandshakeTimeoutError,
    InvalidRequestError,
    KVConnectError,
    LayoutError,
    LayoutMismatchError,
    LeaseError,
    LeaseLostError,
    LocalError,
    NixlError,
    PeerGoneError,
    ProtocolError,
    RemoteError,
    TransferError,
    TransferTimeoutError,
)
from kvconnect.core.plan.layout import CacheSpec, LayoutKind
from kvconnect.core.plan.params import KVTransferParams, new_lease_id, parse_kv_transfer_params
from kvconnect.core.snapshot import ConnectorSnapshot
from kvconnect.core.wire.protocol import LeaseState

__all__ = [
    "AuthError",
    "CacheSpec",
    "ConfigError",
    "ConnectorConfig",
    "ConnectorSnapshot",
    "FailurePolicy",
    "HandshakeError",
    "HandshakeTimeoutError",
    "HeteroPathChoice",
    "InvalidRequestError",
    "KVCache",
    "KVConnectError",
    "KVConnector",
    "KVTransferParams",
    "LayoutError",
    "LayoutKind",
    "LayoutMismatchError",
    "LeaseError",
    "LeaseLostError",
    "LeaseState",
    "LocalError",
    "NixlError",
    "PeerGoneError",
    "ProtocolError",
    "PullHandle",
    "PullStats",
    "RemoteError",
    "TransferError",
    "TransferTimeoutError",
    "TransportChoice",
    "connector_config",
    "new_lease_id",
    "parse_kv_transfer_params",
]
