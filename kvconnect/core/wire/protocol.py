"""Wire formats: side-channel messages (msgspec msgpack) and NIXL notifications.

Side-channel messages are one tagged union decoded by one decoder built once. Structs evolve by
adding fields with defaults at the end; unknown fields are ignored (no `forbid_unknown_fields`), so
rolling upgrades work. (`kv_transfer_params`, the HTTP-side format, lives in `params.py`.)

Authentication (optional shared secret): every request carries a fresh nonce, a timestamp and an
HMAC-SHA256 over its own encoding; the server answers with an HMAC bound to that nonce, so neither the
secret nor a replayable token ever crosses the wire, and the client knows the answer came from a peer
holding the secret.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
from collections.abc import Sequence
from typing import Any

import msgspec

from kvconnect.core.errors import LayoutError, ProtocolError
from kvconnect.core.plan.layout import CacheSpec
from kvconnect.core.plan.signing import Keyring

# Peers of another version are refused by version, naming both. 2: leases keyed by the prefill's random lease
# id and every PIN, CONFIRM, RELEASE and notification carrying its reader's read token; 3: the KV digest;
# 4: a handshake answer carries each transport's offer (`PeerInfo.offers`) instead of IPC fields of its own;
# leases bound to their prompt (`prompt_digest`), and a PIN's answer says how long the pin lasts (`pin_ms`)
PROTOCOL_VERSION = 5
MAX_MESSAGE_BYTES = 4 * 1024 * 1024  # a reply: agent metadata is the largest part (tens of KiB)
# a request (Hello, LeaseRequest) is bytes to KiB; 256 KiB holds ~87,000 block ids. A side-channel server drops
# a connection announcing a larger frame at once, before authentication: ZMQ allocates a frame's announced
# size while it waits for the rest, so a cap of MiB let unauthenticated half-sent frames hold MiB each
MAX_REQUEST_BYTES = 256 * 1024


class ErrorCode(str, enum.Enum):
    BAD_MESSAGE = "bad_message"
    VERSION = "version"
    AUTH = "auth"
    INTERNAL = "internal"


class LeaseState(str, enum.Enum):
    HELD = "held"  # blocks still reserved for the reader
    COMPLETED = "completed"  # the reader's notification arrived while held: the data it read is good
    RELEASED = "released"  # released without a completed read (abort)
    EXPIRED = "expired"  # TTL ran out: blocks went back to the allocator and may hold other data now
    UNKNOWN = "unknown"  # never seen, or forgotten
    CONSUMED = "consumed"  # another reader's: its slot was claimed by another read token, or it completed for one


class Refusal(str, enum.Enum):
    """Why a lease request was refused as a reader (`LeaseReply.refusal`; its `reason` says it in words)."""

    NONE = ""  # not refused for what it named (the state says the rest)
    BLOCKS = "blocks"  # it named blocks the lease does not hold (or not as their tail)
    PROMPT = "prompt"  # the lease holds another prompt's KV
    TOKEN = "read_token"  # a PIN or CONFIRM without a read token


class LeaseAction(str, enum.Enum):
    CONFIRM = "confirm"  # after a READ: was the data intact? finishes the lease (and the reader's pin)
    RELEASE = "release"  # give the blocks back now (client abort, decode gave up)
    PIN = "pin"  # with the READ: keep the blocks until this reader confirms, or for pin_ms at most
    # while the request waits in the decode's queue: hold the lease another TTL (never past the prefill's
    # lease_max_s from its grant). Claims no reader slot and reads nothing: the read's PIN or notification decides
    RENEW = "renew"


# --- side channel: requests ----------------------------------------------------------------------


class Hello(msgspec.Struct, tag="hello"):
    protocol_version: int
    engine_id: str
    nonce: bytes = b""
    ts_ms: int = 0
    mac: bytes = b""


class LeaseRequest(msgspec.Struct, tag="lease"):
    protocol_version: int
    engine_id: str
    lease_id: str  # the prefill's random lease id (kv_transfer_params.remote_lease_id)
    action: LeaseAction
    nonce: bytes = b""
    ts_ms: int = 0
    mac: bytes = b""
    reader: int = 0  # which of `readers` decode ranks reading this prefill rank confirms (heterogeneous TP)
    readers: int = 1
    pin_ms: int = 0  # PIN: how long at most
    # PIN / CONFIRM: the blocks the reader read; refused unless the lease holds each of them (a suffix of
    # the leased ids is fine: a decode-side prefix-cache hit reads fewer). Empty: not checked (old peers).
    block_ids: list[int] = []
    seq: int = 0  # the sender's number for this message, echoed in the reply (pairs replies with requests)
    read_token: bytes = b""  # PIN / CONFIRM (and a reader's RELEASE): the pull's own random token (lease.py)
    # PIN / CONFIRM: `prompt_digest` of the prompt the reader serves; a lease bound to a prompt refuses any other
    prompt_digest: bytes = b""
    group_sizes: list[int] = []  # `block_ids` per KV cache group (plan/groups.py); empty: one group


# --- side channel: replies -----------------------------------------------------------------------


class PeerInfo(msgspec.Struct, tag="peer_info"):
    """Everything a decode worker needs to pull from this worker."""

    protocol_version: int
    engine_id: str
    incarnation_id: str
    agent_name: str
    agent_metadata: bytes
    spec: CacheSpec
    base_addrs: list[int]
    device_id: int = 0
    mac: bytes = b""
    lease_grace_ms: int = 0  # a lease may be granted this long after its params left (config.lease_grace_s)
    # transport kind -> what a peer needs to open that path to this worker, in the transport's own encoding
    # (transports/: e.g. "ipc": where a same-host GPU peer maps the regions from). NIXL needs none.
    offers: dict[str, bytes] = {}
    lease_board: str = ""  # the name of its lease board in the host's shared memory ("": none; board.py)
    # it answers RENEW (a peer from before renewals would refuse one as malformed: a decode renews over the
    # channel of a peer that said so, and otherwise only over a channel of its own, whose answers nobody reads)
    renews: bool = False
    boot_id: str = ""  # its kernel's boot id: a decode opens its board only where its own is the same


class LeaseReply(msgspec.Struct, tag="lease_reply"):
    lease_id: str
    state: LeaseState
    incarnation_id: str = ""
    mac: bytes = b""
    reason: str = ""  # why a request was refused (the state is then UNKNOWN, or the lease's own state)
    seq: int = 0  # the request's `seq`
    kv_digest: bytes = b""  # a held or completed lease's digest of the blocks named (kv_digest; digest.py)
    pin_ms: int = 0  # a PIN answered HELD: how long the prefill keeps it, from when it got the PIN (capped by its TTL)
    refusal: Refusal = Refusal.NONE  # refused as a reader: for what (`reason` in words)
    held_ms: int = 0  # a RENEW answered HELD: how long from now the prefill holds the lease (0: not renewed)


class ErrorReply(msgspec.Struct, tag="error"):
    code: ErrorCode
    message: str
    protocol_version: int = PROTOCOL_VERSION
    ref: str = ""  # correlation key of the refused request (see `ref_of`), empty if undecodable
    mac: bytes = b""  # with a secret: bound to the refused request's nonce, like every reply


def ref_of(msg: Hello | LeaseRequest | PeerInfo | LeaseReply) -> str:
    """Correlation key shared by a request and its reply."""
    if isinstance(msg, (Hello, PeerInfo)):
        return "hello"
    return f"lease:{msg.lease_id}:{msg.seq}"


Request = Hello | LeaseRequest
Reply = PeerInfo | LeaseReply | ErrorReply

_encoder = msgspec.msgpack.Encoder()
_request_decoder = msgspec.msgpack.Decoder(Request)
_reply_decoder = msgspec.msgpack.Decoder(Reply)


def encode(msg: msgspec.Struct) -> bytes:
    return _encoder.encode(msg)


def _decode(decoder: msgspec.msgpack.Decoder, data: bytes, what: str) -> Any:
    if len(data) > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"{what} of {len(data)} bytes exceeds {MAX_MESSAGE_BYTES}")
    try:
        return decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError, LayoutError, ValueError, TypeError) as e:
        raise ProtocolError(f"malformed {what}: {e}") from e


def decode_request(data: bytes) -> Request:
    if len(data) > MAX_REQUEST_BYTES:
        raise ProtocolError(f"request of {len(data)} bytes exceeds {MAX_REQUEST_BYTES}")
    msg = _decode(_request_decoder, data, "request")
    if msg.protocol_version != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {msg.protocol_version} != {PROTOCOL_VERSION}")
    return msg  # type: ignore[no-any-return]


def decode_reply(data: bytes) -> Reply:
    return _decode(_reply_decoder, data, "reply")  # type: ignore[no-any-return]


# --- authentication ------------------------------------------------------------------------------


def _mac(secret: bytes, *parts: bytes) -> bytes:
    h = hmac.new(secret, digestmod=hashlib.sha256)
    for part in parts:
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.digest()


def sign_request(keys: Keyring | bytes, msg: Hello | LeaseRequest) -> Hello | LeaseRequest:
    """`msg` signed under the signing key (the first of the keyring)."""
    key = Keyring.of(keys).signing
    return msgspec.structs.replace(msg, mac=_mac(key, encode(msgspec.structs.replace(msg, mac=b""))))


def request_key(keys: Keyring | bytes, msg: Hello | LeaseRequest) -> bytes | None:
    """The key of the keyring `msg` is signed under (None: none of them): its answer is signed under the same."""
    body = encode(msgspec.structs.replace(msg, mac=b""))
    return next((k for k in Keyring.of(keys).keys if hmac.compare_digest(_mac(k, body), msg.mac)), None)


def request_mac_ok(keys: Keyring | bytes, msg: Hello | LeaseRequest) -> bool:
    return request_key(keys, msg) is not None


def sign_reply(key: bytes, nonce: bytes, msg: Reply) -> Reply:
    return msgspec.structs.replace(msg, mac=_mac(key, nonce, encode(msgspec.structs.replace(msg, mac=b""))))


def reply_mac_ok(keys: Keyring | bytes, nonce: bytes, msg: Reply) -> bool:
    """Whether `msg` answers the request that carried `nonce` and is signed under a key of the keyring."""
    body = encode(msgspec.structs.replace(msg, mac=b""))
    return any(hmac.compare_digest(_mac(k, nonce, body), msg.mac) for k in Keyring.of(keys).keys)


# --- NIXL notification ---------------------------------------------------------------------------


class PullNotif(msgspec.Struct, tag="pulled", array_like=True):
    """Sent with the READ; reaches the prefill side after the data was read."""

    lease_id: str
    incarnation_id: str  # the prefill incarnation the reader believes it read from
    reader: int = 0  # see LeaseRequest
    readers: int = 1
    blocks_digest: bytes = b""  # `blocks_digest` of the remote block ids read (a lease completes only if it
    num_blocks: int = 0  # holds exactly those, as a suffix of its own; see lease.py)
    read_token: bytes = b""  # the reader's token (see LeaseRequest)
    prompt_digest: bytes = b""  # see LeaseRequest
    group_sizes: list[int] = []  # see LeaseRequest


_notif_decoder = msgspec.msgpack.Decoder(PullNotif)


def blocks_digest(block_ids: Sequence[int]) -> bytes:
    """A short digest of block ids (in order): what a notification carries instead of the ids themselves."""
    h = hashlib.blake2b(digest_size=16)
    for b in block_ids:
        h.update(int(b).to_bytes(8, "little", signed=True))
    return h.digest()


def encode_notif(
    lease_id: str,
    incarnation_id: str,
    reader: int = 0,
    readers: int = 1,
    block_ids: Sequence[int] = (),
    read_token: bytes = b"",
    prompt_digest: bytes = b"",
    group_sizes: Sequence[int] = (),
) -> bytes:
    digest = blocks_digest(block_ids) if len(block_ids) else b""
    return _encoder.encode(
        PullNotif(
            lease_id,
            incarnation_id,
            reader,
            readers,
            digest,
            len(block_ids),
            read_token,
            prompt_digest,
            list(group_sizes) if len(group_sizes) > 1 else [],
        )
    )


def decode_notif(data: bytes) -> PullNotif:
    return _decode(_notif_decoder, data, "notification")  # type: ignore[no-any-return]
