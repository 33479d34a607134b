"""Keys and signed params: who may make a decode act (pure, no I/O).

`kv_transfer_params` travel through clients, proxies and sidecars, and every field of them makes a decode do
something: dial a host and port, handshake with an engine, pin and read a lease's blocks, trust an incarnation.
Unsigned, they are a bearer capability anyone can forge. So a prefill holding the side-channel secret signs the
params it hands out, and a decode holding it refuses params it cannot verify before it dials, claims,
handshakes or pulls anything: they cost it nothing.

- **Keys.** A `Keyring` holds the side-channel secrets, one per line of `secret` / `secret_file`: the first signs,
  every one verifies, so a secret rotates without a flag day (add the new one on a second line everywhere, then
  move it first, then drop the old one). A key is named by its id, a digest of it (`key_id`), never by itself.
- **What is signed.** An HMAC-SHA256 (`remote_mac`, under the key `remote_key_id`) over everything a decode acts on:
  the engine, its incarnation, host, port and TP size, the request's label, the lease id, the blocks per KV cache
  group, the tokens they hold, the prompt binding (`remote_prompt_digest`), the expiry (`remote_expires_ms`,
  wall-clock milliseconds), the transfer mode and the wire version. A field changed, added or left out fails the
  check.
- **Without a secret** (one host, loopback side channels) params are neither signed nor checked.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import time
from collections.abc import Sequence

import msgspec

from kvconnect.core.errors import InvalidRequestError
from kvconnect.core.plan.params import FIELD, KVTransferParams

MAC_VERSION = b"kvc-params-2"
CLOCK_SKEW_MS = 30_000  # hosts' clocks may differ this much: params expire this much later than they say


class Keyring:
    """The side-channel secrets a worker holds: the first signs, any verifies."""

    __slots__ = ("keys",)

    def __init__(self, keys: Sequence[bytes] = ()) -> None:
        self.keys = tuple(bytes(k) for k in keys if k)

    @classmethod
    def parse(cls, text: str) -> Keyring:
        """One secret per line (blank lines and surrounding spaces ignored)."""
        return cls([line.strip().encode() for line in text.splitlines() if line.strip()])

    @classmethod
    def of(cls, secret: bytes | Keyring) -> Keyring:
        return secret if isinstance(secret, Keyring) else cls([secret])

    def __bool__(self) -> bool:
        return bool(self.keys)

    def __repr__(self) -> str:  # (never a key in a log line)
        return f"Keyring({', '.join(key_id(k) for k in self.keys)})"

    @property
    def signing(self) -> bytes:
        return self.keys[0]

    def find(self, kid: str) -> bytes | None:
        return next((k for k in self.keys if hmac.compare_digest(key_id(k), kid)), None)


def key_id(key: bytes) -> str:
    """A key's public name: 8 hex digits of a digest of it (what it tells of a key, a MAC made with it tells too)."""
    return hashlib.blake2b(key, digest_size=4, person=b"kvc-key-id").hexdigest()


def _message(params: KVTransferParams) -> bytes:
    return msgspec.msgpack.encode(
        [
            MAC_VERSION,
            params.remote_engine_id or "",
            params.remote_incarnation_id or "",
            params.remote_host or "",
            params.remote_port if params.remote_port is not None else -1,
            params.tp_size,
            params.remote_request_id or "",
            params.remote_lease_id or "",
            list(params.remote_block_ids or []),
            list(params.remote_group_sizes or []),
            params.remote_num_tokens if params.remote_num_tokens is not None else -1,
            params.remote_prompt_digest or "",
            params.remote_expires_ms if params.remote_expires_ms is not None else -1,
            params.remote_key_id or "",
            params.transfer_mode or "",
            params.remote_wire_version if params.remote_wire_version is not None else -1,
        ]
    )


def _mac(key: bytes, params: KVTransferParams) -> str:
    digest = hmac.new(key, _message(params), hashlib.sha256).digest()
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


def params_expiry_ms(lease_ttl_s: float, now_s: float | None = None) -> int:
    """When params granted now stop being worth a dial: when their lease's TTL would have ended it unread."""
    return int(((time.time() if now_s is None else now_s) + lease_ttl_s) * 1000)


def sign_params(params: KVTransferParams, keys: Keyring, expires_ms: int) -> KVTransferParams:
    """`params` signed under the signing key, valid until `expires_ms` (unchanged without a key)."""
    if not keys:
        return params
    signed = msgspec.structs.replace(
        params, remote_key_id=key_id(keys.signing), remote_expires_ms=int(expires_ms), remote_mac=None
    )
    return msgspec.structs.replace(signed, remote_mac=_mac(keys.signing, signed))


def verify_params(params: KVTransferParams, keys: Keyring, now_ms: int) -> None:
    """Refuse params this decode cannot trust: with keys, unsigned, signed under a key it does not hold, altered, or
    expired ones (InvalidRequestError naming the field). Without keys, nothing is checked."""
    if not keys:
        return
    if not params.remote_mac or not params.remote_key_id:
        raise InvalidRequestError(
            f"{FIELD}.remote_mac", "required: this decode holds a side-channel secret and takes only signed params"
        )
    key = keys.find(params.remote_key_id)
    if key is None:
        raise InvalidRequestError(
            f"{FIELD}.remote_key_id", "the params are signed under a key this decode does not hold"
        )
    if not hmac.compare_digest(_mac(key, params).encode(), params.remote_mac.encode()):
        raise InvalidRequestError(f"{FIELD}.remote_mac", "does not match the params: they were altered or forged")
    if params.remote_expires_ms is None or now_ms > params.remote_expires_ms + CLOCK_SKEW_MS:
        ago_s = (now_ms - (params.remote_expires_ms or 0)) / 1000
        raise InvalidRequestError(f"{FIELD}.remote_expires_ms", f"the params expired {ago_s:.0f} s ago")
