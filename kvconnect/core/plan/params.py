"""`kv_transfer_params`, the one place they are validated (pure, no I/O).

The struct carries the field names of vLLM's NixlConnector and llm-d, so either side's proxy can hand
them over; unknown fields are ignored. Two checks, one module:

- `parse_kv_transfer_params`: the HTTP edge, JSON already decoded. Types are strict, and a field that is
  missing or malformed is named in the `InvalidRequestError` (a 400 naming it).
- `validated_pull`: everything a decode worker must know before it dials a peer or posts a READ: required
  fields, ports, block ids (integers, unique, in range locally, non-negative remotely), the prefill TP
  size, the token count. It returns a `PullTarget` of checked values.

Whether the remote blocks are the ones the prefill leased to this request is checked where the lease is
(lease.py), since only the prefill side knows.
"""

from __future__ import annotations

import hashlib
import ipaddress
import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass

import msgspec
import numpy as np

from kvconnect.core.errors import InvalidRequestError
from kvconnect.core.plan.groups import GroupedBlocks
from kvconnect.core.plan.layout import tp_problem

FIELD = "kv_transfer_params"
PULL_FIELDS = (
    "remote_engine_id",
    "remote_block_ids",
    "remote_host",
    "remote_port",
    "remote_request_id",
    "remote_lease_id",
)
MAX_TP_SIZE = 64  # a client-sent tp_size above this is refused before any peer is dialled (one per rank)
MAX_ID_CHARS = 256  # remote_request_id / remote_lease_id / remote_engine_id: ids, not payloads
LEASE_ID_BYTES = 18  # random bytes in a lease id (24 url-safe characters)
TRANSFER_MODE = "pull"  # what kvconnect's params say in vLLM's `transfer_mode`: the decode READs the prefill's KV
MAX_REMOTE_BLOCK_ID = 2**62  # remote ids are bounded by the remote spec at planning; this only keeps int64 sane
_PRINTABLE = re.compile(r"[\x20-\x7e]*")  # printable ASCII, spaces included
_TOKEN = re.compile(r"[\x21-\x7e]*")  # ... and without spaces
_ID_FIELDS = {
    "remote_engine_id": _TOKEN,
    "remote_request_id": _PRINTABLE,  # (a client's x-request-id may hold spaces)
    "remote_lease_id": _TOKEN,
    "remote_incarnation_id": _TOKEN,
    "remote_host": _TOKEN,
    "remote_prompt_digest": re.compile(r"[0-9a-f]*"),
    "remote_key_id": _TOKEN,
    "remote_mac": _TOKEN,
    "transfer_mode": _TOKEN,
}
_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_HOSTNAME = re.compile(rf"(?=.{{1,253}}$){_LABEL}(?:\.{_LABEL})*\.?")


class KVTransferParams(msgspec.Struct):
    """vLLM/llm-d `kv_transfer_params`; unknown fields are ignored."""

    do_remote_decode: bool = False
    do_remote_prefill: bool = False
    remote_engine_id: str | None = None
    remote_block_ids: list[int] | None = None
    remote_host: str | None = None
    remote_port: int | None = None
    remote_request_id: str | None = None
    tp_size: int = 1  # the prefill's TP size; its rank r listens on remote_port + r (vLLM's convention)
    # kvconnect additions (ignored by vLLM):
    remote_incarnation_id: str | None = None
    remote_num_tokens: int | None = None  # tokens of KV the remote blocks hold (lets block sizes differ)
    # the prefill's random id of the lease that holds the blocks: the key every PIN, CONFIRM, RELEASE and
    # notification names (`remote_request_id` is only the request's label for logs)
    remote_lease_id: str | None = None
    # hybrid models (several KV cache groups: plan/groups.py): blocks per group, `remote_block_ids` being the
    # groups one after the other; absent for a single group
    remote_group_sizes: list[int] | None = None
    # the binding of the lease to its prompt (`prompt_digest`, hex): a decode serving another prompt refuses them
    remote_prompt_digest: str | None = None
    # signed params (plan/signing.py): until when (wall clock, ms), under which key, and the MAC
    remote_expires_ms: int | None = None
    remote_key_id: str | None = None
    remote_mac: str | None = None
    # the wire contract, readable before anything is dialled: vLLM's `transfer_mode` ("pull": the decode READs;
    # vLLM's NixlPushConnector says "push") and the prefill's kvconnect wire version (`wire.protocol`)
    transfer_mode: str | None = None
    remote_wire_version: int | None = None


PROMPT_DIGEST_BYTES = 16


def prompt_digest(
    token_ids: Sequence[int] | np.ndarray, cache_salt: str | None = None, extras: Sequence[tuple[str, bytes]] = ()
) -> bytes:
    """What binds a lease to its prompt: a digest of everything the KV was computed from, as the engine's prefix
    cache keys it: the prompt's token ids, the request's cache salt (which keeps tenants' prefix caches apart), and
    `extras`, tagged parts such as prompt embeddings, multimodal items and their places, a LoRA adapter
    (vllm/binding.py gathers them from a vLLM request). The prefill grants a lease under the digest of the prompt
    it computed; a decode names the digest of the prompt it serves, and a lease refuses any other."""
    h = hashlib.blake2b(digest_size=PROMPT_DIGEST_BYTES, person=b"kvc-prompt")
    salt = (cache_salt or "").encode()
    h.update(len(salt).to_bytes(8, "little"))
    h.update(salt)
    h.update(np.asarray(token_ids, dtype="<i8").tobytes())
    for tag, part in extras:  # (each part length-prefixed: no two lists of parts share an encoding)
        for piece in (tag.encode(), part):
            h.update(len(piece).to_bytes(8, "little"))
            h.update(piece)
    return h.digest()


def canonical_host(host: str, field: str = f"{FIELD}.remote_host") -> str:
    """`host` in its one spelling: an IP address as `ipaddress` writes it (IPv6 compressed and without brackets, an
    IPv4-mapped IPv6 address as IPv4), a host name in lower case without its trailing dot. InvalidRequestError for
    anything else: brackets around an IPv4 address or a name, or a name whose last label is all digits (what
    resolvers take for an IPv4 address in another spelling: `127.000.000.001`, `2130706433`)."""
    bracketed = host.startswith("[") and host.endswith("]")
    bare = host[1:-1] if bracketed else host
    try:
        addr = ipaddress.ip_address(bare)
    except ValueError:
        name = bare.lower().rstrip(".")
        if bracketed or not _HOSTNAME.fullmatch(bare) or name.rsplit(".", 1)[-1].isdigit():
            raise InvalidRequestError(field, f"{bare[:64]!r} is neither an IP address nor a host name") from None
        return name
    if bracketed and addr.version == 4:
        raise InvalidRequestError(field, "brackets hold only an IPv6 address")
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        return str(addr.ipv4_mapped)
    return str(addr)


def new_lease_id() -> str:
    """A fresh, unguessable lease id (`remote_lease_id`; the ranks of a TP group share one)."""
    return secrets.token_urlsafe(LEASE_ID_BYTES)


def lease_params(
    *,
    engine_id: str,
    host: str,
    base_port: int,
    tp_size: int,
    incarnation_id: str | None,
    request_id: str,
    lease_id: str,
    block_ids: list[int],
    num_tokens: int | None,
    group_sizes: list[int] | None = None,
    prompt: bytes = b"",
    wire_version: int | None = None,
) -> KVTransferParams:
    """What a prefill hands a decode for one lease: the one place these params are assembled (the connector's
    `lease`, and the vLLM scheduler, which answers before its workers grant). `base_port` is TP rank 0's
    side channel: rank r listens on base + r."""
    return KVTransferParams(
        do_remote_prefill=True,
        remote_engine_id=engine_id,
        remote_block_ids=block_ids,
        remote_host=host,
        remote_port=base_port,
        remote_request_id=request_id,
        tp_size=tp_size,
        remote_incarnation_id=incarnation_id,
        remote_num_tokens=num_tokens,
        remote_lease_id=lease_id,
        remote_group_sizes=group_sizes,
        remote_prompt_digest=prompt.hex() if prompt else None,
        transfer_mode=TRANSFER_MODE,
        remote_wire_version=wire_version,
    )


@dataclass(frozen=True)
class PullTarget:
    """A pull's checked remote side."""

    engine_id: str
    host: str
    port: int
    request_id: str  # the prefill request's label (logs)
    lease_id: str
    remote_block_ids: np.ndarray  # int64, in token order
    local_block_ids: np.ndarray  # int64
    tp_size: int
    incarnation_id: str | None
    num_tokens: int | None
    group_sizes: tuple[int, ...]  # the remote (and local) blocks per KV cache group


_PATH = re.compile(r"at `\$\.?([^`]*)`")


def parse_kv_transfer_params(obj: object) -> KVTransferParams | None:
    """Validate the JSON-decoded `kv_transfer_params`; InvalidRequestError names the bad field."""
    if obj is None:
        return None
    if not isinstance(obj, dict):
        raise InvalidRequestError(FIELD, f"must be an object, got {type(obj).__name__}")
    try:
        params = msgspec.convert(obj, KVTransferParams, strict=True)
    except msgspec.ValidationError as e:
        m = _PATH.search(str(e))
        field = FIELD + (f".{m.group(1)}" if m and m.group(1) else "")
        raise InvalidRequestError(field, str(e).split(" - at ")[0]) from e
    if params.do_remote_prefill:
        _check_pull_fields(params)
    if not 1 <= params.tp_size <= MAX_TP_SIZE:
        raise InvalidRequestError(f"{FIELD}.tp_size", f"must be in [1, {MAX_TP_SIZE}], got {params.tp_size}")
    _check_ids(params)
    return params


def _check_ids(params: KVTransferParams) -> None:
    """Ids are short printable ASCII (a newline in one would forge a log line wherever it is logged); every
    id but the request's own label, and the host, hold no space either."""
    for name, chars in _ID_FIELDS.items():
        value = getattr(params, name)
        if value is None:
            continue
        if len(value) > MAX_ID_CHARS:
            raise InvalidRequestError(f"{FIELD}.{name}", f"longer than {MAX_ID_CHARS} characters")
        if not chars.fullmatch(value):
            what = "printable ASCII" if chars is _PRINTABLE else "printable ASCII without spaces"
            raise InvalidRequestError(f"{FIELD}.{name}", f"must be {what}")


def _check_pull_fields(params: KVTransferParams) -> None:
    for name in PULL_FIELDS:
        if getattr(params, name) in (None, ""):
            raise InvalidRequestError(f"{FIELD}.{name}", "required when do_remote_prefill is true")
    _check_ids(params)
    port = params.remote_port
    if port is not None and not 0 < port < 65536:
        raise InvalidRequestError(f"{FIELD}.remote_port", f"{port} is not a TCP port")
    if not params.remote_block_ids:
        raise InvalidRequestError(f"{FIELD}.remote_block_ids", "is empty")
    if params.remote_num_tokens is not None and params.remote_num_tokens < 1:
        raise InvalidRequestError(f"{FIELD}.remote_num_tokens", f"must be positive, got {params.remote_num_tokens}")
    if params.remote_group_sizes is not None:
        GroupedBlocks.flat(params.remote_block_ids, params.remote_group_sizes, f"{FIELD}.remote_group_sizes")


def validate_block_ids(field: str, ids: Sequence[int] | np.ndarray, num_blocks: int) -> np.ndarray:
    """Block ids as int64, or InvalidRequestError naming `field` (empty, out of range, duplicated)."""
    try:
        arr = np.asarray(ids)
    except (TypeError, ValueError) as e:
        raise InvalidRequestError(field, f"not a list of integers ({e})") from e
    if arr.ndim != 1:
        raise InvalidRequestError(field, f"must be a flat list, got shape {arr.shape}")
    if arr.size == 0:
        raise InvalidRequestError(field, "is empty")
    if arr.dtype.kind not in "iu":  # (signed or unsigned integers; not bool)
        raise InvalidRequestError(field, f"must hold integers, got {arr.dtype}")
    arr = arr.astype(np.int64, copy=False)
    if arr.min() < 0 or arr.max() >= num_blocks:  # (each check the cheap way first: this runs on every pull)
        bad = arr[(arr < 0) | (arr >= num_blocks)]
        raise InvalidRequestError(field, f"block ids {bad[:8].tolist()} outside [0, {num_blocks})")
    ordered = np.sort(arr)
    if (ordered[1:] == ordered[:-1]).any():
        uniq, counts = np.unique(arr, return_counts=True)
        raise InvalidRequestError(field, f"duplicated block ids {uniq[counts > 1][:8].tolist()}")
    return arr


def validated_pull(
    params: KVTransferParams, local_block_ids: Sequence[int] | np.ndarray, num_local_blocks: int, model_kv_heads: int
) -> PullTarget:
    """The checked remote side of a pull into `local_block_ids`; InvalidRequestError names the field."""
    if not params.do_remote_prefill:
        raise InvalidRequestError(f"{FIELD}.do_remote_prefill", "must be true to pull")
    _check_pull_fields(params)
    local = validate_block_ids("local_block_ids", local_block_ids, num_local_blocks)
    remote = validate_block_ids(f"{FIELD}.remote_block_ids", params.remote_block_ids or [], MAX_REMOTE_BLOCK_ID)
    groups = GroupedBlocks.flat(remote, params.remote_group_sizes, f"{FIELD}.remote_group_sizes")
    problem = (
        tp_problem(model_kv_heads, params.tp_size)
        if 1 <= params.tp_size <= MAX_TP_SIZE
        else f"tp_size must be in [1, {MAX_TP_SIZE}]"
    )
    if problem:
        raise InvalidRequestError(f"{FIELD}.tp_size", f"prefill {problem}")
    assert params.remote_engine_id and params.remote_host and params.remote_port and params.remote_request_id
    assert params.remote_lease_id
    return PullTarget(
        params.remote_engine_id,
        canonical_host(params.remote_host),
        params.remote_port,
        params.remote_request_id,
        params.remote_lease_id,
        remote,
        local,
        params.tp_size,
        params.remote_incarnation_id,
        params.remote_num_tokens,
        groups.sizes,
    )
