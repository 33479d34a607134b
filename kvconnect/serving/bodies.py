"""Request bodies at the HTTP edge: bounded in size, decoded without a crash, and the lease they name
found even when the rest of them is refused.

- `read_body`: at most `max_body_bytes()` (`KVCONNECT_MAX_BODY_BYTES`, default 8 MiB); more is a 413;
- `decode_json`: JSON decoded by msgspec; malformed or too deeply nested input (which raised
  RecursionError, a 500) is an `InvalidRequestError` naming the body (a 400);
- `raw_kv_params`: the `kv_transfer_params` of a body the worker refused, if they parse on their own, so
  that the prefill's lease they name is released at once rather than at its TTL.
"""

from __future__ import annotations

from typing import Any

import msgspec
from starlette.requests import Request

from kvconnect.core.config import env_int
from kvconnect.core.errors import InvalidRequestError
from kvconnect.core.plan.params import KVTransferParams, parse_kv_transfer_params

DEFAULT_MAX_BODY_BYTES = 8 * 2**20


class BodyTooLargeError(InvalidRequestError):
    """The request body is larger than the server accepts (HTTP 413)."""


def max_body_bytes() -> int:
    return env_int("MAX_BODY_BYTES", DEFAULT_MAX_BODY_BYTES, low=1024)


async def read_body(request: Request, limit: int | None = None) -> bytes:
    limit = max_body_bytes() if limit is None else limit
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise BodyTooLargeError("body", f"{declared} bytes is more than the {limit} this server accepts")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise BodyTooLargeError("body", f"more than the {limit} bytes this server accepts")
        chunks.append(chunk)
    return b"".join(chunks)


def decode_json(raw: bytes) -> Any:
    try:
        return msgspec.json.decode(raw)
    except msgspec.DecodeError as e:
        raise InvalidRequestError("body", f"not valid JSON: {e}") from e
    except RecursionError as e:
        raise InvalidRequestError("body", "JSON nested too deeply") from e


def raw_kv_params(raw: bytes) -> KVTransferParams | None:
    """The body's kv_transfer_params on their own, or None where they do not parse either."""
    try:
        obj = decode_json(raw)
        return parse_kv_transfer_params(obj.get("kv_transfer_params")) if isinstance(obj, dict) else None
    except InvalidRequestError:
        return None
