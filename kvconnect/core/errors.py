"""The kvconnect exception tree: one family, local faults apart from remote ones.

Every error kvconnect raises derives from `KVConnectError`. `LocalError` means this process was asked to
do something invalid (bad input, bad configuration, a misuse of the API); `RemoteError` means a peer
misbehaved, disappeared or refused us. Foreign exceptions (NIXL, ZMQ, msgspec) are wrapped at the
boundary with `raise ... from e` so callers only ever catch this family.
"""

from __future__ import annotations


class KVConnectError(Exception):
    """Base of every kvconnect error."""


class LocalError(KVConnectError):
    """This process made or was handed an invalid request."""


class RemoteError(KVConnectError):
    """A peer failed, refused, or answered something we cannot accept."""


# --- local ---------------------------------------------------------------------------------------


class ConfigError(LocalError):
    """A setting (CLI flag or KVCONNECT_* variable) is invalid."""


class LayoutError(LocalError):
    """A cache spec or tensor does not describe a valid paged KV cache."""


class LayoutMismatchError(LayoutError):
    """Two cache specs cannot exchange blocks; `fields` names every field that differs."""

    def __init__(self, fields: dict[str, tuple[object, object]], reason: str = "") -> None:
        self.fields = dict(fields)
        parts = [f"{name}: local={lv!r} remote={rv!r}" for name, (lv, rv) in self.fields.items()]
        msg = "incompatible KV cache layouts (" + "; ".join(parts) + ")"
        if reason:
            msg += f": {reason}"
        super().__init__(msg)


class InvalidRequestError(LocalError):
    """A request's parameters are invalid; `field` names the offending field."""

    def __init__(self, field: str, reason: str) -> None:
        self.field = field
        self.reason = reason
        super().__init__(f"{field}: {reason}")


class CapacityError(LocalError):
    """A bound on what peers and clients may make this process hold was reached (peers, handshakes, claims);
    the request is refused by name rather than the process running out of sockets or memory."""


class LeaseError(LocalError):
    """A lease operation was invalid (unknown lease, double lease of a block)."""


class NixlError(KVConnectError):
    """NIXL raised or returned an error that has no more specific meaning."""


class TransportUnavailableError(NixlError):
    """A transport cannot serve this peer or this process (another host, no kernel compiler, a plan it cannot
    move); the caller falls back to NIXL unless that transport was required."""


# --- remote --------------------------------------------------------------------------------------


class ProtocolError(RemoteError):
    """A peer sent bytes that are not a valid kvconnect message, or a wrong protocol version."""


class HandshakeError(RemoteError):
    """The handshake with a peer failed."""


class HandshakeTimeoutError(HandshakeError):
    """The peer did not answer the handshake before its deadline."""


class AuthError(HandshakeError):
    """The side channel refused us (wrong or missing secret), or the peer failed to prove it holds it."""


class TransferError(RemoteError):
    """A pull failed after it was posted."""


class TransferTimeoutError(TransferError):
    """A pull did not complete before its deadline; its NIXL handle was released."""


class PeerGoneError(TransferError):
    """The remote agent disconnected (killed, restarted) during or before a pull."""


class DigestError(TransferError):
    """The blocks a pull wrote do not hold what the prefill leased (kv_digest): the data must not be used."""


class LeaseLostError(TransferError):
    """The prefill side no longer held the blocks when the pull finished: the data must not be used."""
