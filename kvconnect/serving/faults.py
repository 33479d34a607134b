"""Fault-injection admin endpoints of a worker, mounted only when KVCONNECT_FAULT_INJECTION=1.

Tests and soak runs use them to do to a prefill worker's leases what production faults do:

- `GET /admin/leases`: the leases held (request id, block ids, age).
- `POST /admin/leases/expire` `{"request_ids": [...], "poison": true}`: expire those leases now (all
  held ones when `request_ids` is absent). `poison` overwrites their blocks with noise after the lease
  ended and before the blocks go back to the allocator, as reuse by another request would: a reader that
  used such blocks would produce a wrong completion, so fail-closed handling becomes visible.
- `POST /admin/leases/expire-on-read` `{"count": n}`: the next n reads to finish (or to be pinned,
  whichever reaches the prefill first) find their lease expired, as if the TTL had run out mid-read.

Never enable this in production: any HTTP client could then break other clients' requests.
"""

from __future__ import annotations

import json
import time
import zlib
from typing import Any

import torch
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from kvconnect.core.cache import KVCache
from kvconnect.core.config import env_setting
from kvconnect.core.connector import KVConnector


def enabled() -> bool:
    return (env_setting("FAULT_INJECTION", "") or "").strip().lower() in ("1", "true", "yes", "on")


def poison_blocks(cache: KVCache, block_ids: list[int], seed: int) -> None:
    """Overwrite every layer's K and V of `block_ids` with large seeded noise."""
    if not block_ids:
        return
    gen = torch.Generator(device="cpu").manual_seed(seed)
    for layer in range(cache.spec.num_layers):
        for t in cache.kv(layer):
            view = t[block_ids]
            noise = torch.randn(view.shape, generator=gen, dtype=torch.float32) * 50.0
            t[block_ids] = noise.to(device=t.device, dtype=t.dtype)


async def _body(request: Request) -> dict[str, Any]:
    raw = await request.body()
    if not raw:
        return {}
    obj = json.loads(raw)
    if not isinstance(obj, dict):
        raise ValueError("body must be a JSON object")
    return obj


def routes(connector: KVConnector, cache: KVCache) -> list[Route]:
    """The admin routes over `connector`'s leases (built with `FaultHooks`); `cache` is where poisoned blocks
    live."""
    hooks = connector.faults
    if hooks is None:
        raise RuntimeError("fault-injection routes need a connector built with FaultHooks")

    async def list_leases(request: Request) -> Response:
        now = time.monotonic()
        return JSONResponse(
            {
                "held": [
                    {"request_id": x.request_id, "block_ids": list(x.block_ids), "age_s": round(now - x.granted_s, 3)}
                    for x in connector.held_leases()
                ]
            }
        )

    async def expire(request: Request) -> Response:
        try:
            body = await _body(request)
        except ValueError as e:
            return JSONResponse({"error": str(e)}, status_code=400)
        wanted = body.get("request_ids")
        held = connector.held_leases()
        names = [x.request_id for x in held] if wanted is None else [str(r) for r in wanted]
        poison = bool(body.get("poison", False))
        out = {}
        for rid in names:  # (leases are named by their request's label here; their ids stay secret)

            def scrub(blocks: list[int], seed: int = zlib.crc32(rid.encode())) -> None:
                poison_blocks(cache, blocks, seed)

            states = [
                hooks.expire_lease(x.lease_id, scrub if poison else None).value for x in held if x.request_id == rid
            ]
            out[rid] = states[0] if states else "unknown"
        return JSONResponse({"expired": out})

    async def expire_on_read(request: Request) -> Response:
        try:
            count = int((await _body(request)).get("count", 1))
        except (ValueError, TypeError) as e:
            return JSONResponse({"error": str(e)}, status_code=400)
        hooks.expire_next_reads(count)
        return JSONResponse({"armed": count})

    return [
        Route("/admin/leases", list_leases),
        Route("/admin/leases/expire", expire, methods=["POST"]),
        Route("/admin/leases/expire-on-read", expire_on_read, methods=["POST"]),
    ]
