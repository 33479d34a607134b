"""llm-d style prefill/decode proxy (`kvconnect proxy`). Never imports NIXL.

For each OpenAI request: the prefill leg goes to the next prefill worker (round robin) with
max_tokens=1, stream=false and kv_transfer_params={"do_remote_decode": true}; the kv_transfer_params it
returns are copied into the original request, which goes to the next decode worker, and the decode
answer (streamed or not) is relayed to the client. Both legs carry the same x-request-id. Clients cannot
choose destinations: their own kv_transfer_params are replaced. A failed leg returns a clear error; if
the decode leg cannot be reached, the prefill lease is released over the side channel at once.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any

import httpx
import zmq
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from kvconnect import protocol as p
from kvconnect.config import env_setting
from kvconnect.errors import KVConnectError
from kvconnect.handshake import request as side_request
from kvconnect.openai_api import error_body

log = logging.getLogger(__name__)


class Proxy:
    def __init__(self, prefill_urls: list[str], decode_urls: list[str], timeout_s: float = 300.0,
                 secret: str = "") -> None:
        if not prefill_urls or not decode_urls:
            raise KVConnectError("the proxy needs at least one --prefill and one --decode URL")
        self.prefill_urls = [u.rstrip("/") for u in prefill_urls]
        self.decode_urls = [u.rstrip("/") for u in decode_urls]
        self._prefill_rr = itertools.cycle(range(len(self.prefill_urls)))
        self._decode_rr = itertools.cycle(range(len(self.decode_urls)))
        self._timeout = httpx.Timeout(timeout_s, connect=5.0)
        self._secret = secret.encode()
        self.client: httpx.AsyncClient | None = None

    async def startup(self) -> None:
        limits = httpx.Limits(max_connections=512, max_keepalive_connections=128)
        self.client = httpx.AsyncClient(timeout=self._timeout, limits=limits)

    async def shutdown(self) -> None:
        if self.client is not None:
            await self.client.aclose()

    async def handle(self, request: Request, path: str) -> Response:
        assert self.client is not None
        request_id = request.headers.get("x-request-id") or f"cmpl-{uuid.uuid4().hex}"
        headers = {"x-request-id": request_id, "content-type": "application/json"}
        try:
            body = json.loads(await request.body())
            if not isinstance(body, dict):
                raise ValueError("the body must be a JSON object")
        except ValueError as e:
            return JSONResponse(error_body(400, f"invalid JSON body: {e}", "body"), status_code=400)
        body.pop("kv_transfer_params", None)  # never let a client pick where workers connect

        prefill_url = self.prefill_urls[next(self._prefill_rr)]
        leg = {k: v for k, v in body.items() if k not in ("stream_options",)}
        leg.update(max_tokens=1, stream=False, kv_transfer_params={"do_remote_decode": True})
        if "max_completion_tokens" in leg:
            leg["max_completion_tokens"] = 1
        try:
            resp = await self.client.post(prefill_url + path, json=leg, headers=headers)
        except httpx.HTTPError as e:
            return self._leg_failed("prefill", prefill_url, f"{type(e).__name__}: {e}")
        if resp.status_code != 200:
            return self._relay_error("prefill", prefill_url, resp)
        try:
            params = resp.json().get("kv_transfer_params")
        except ValueError:
            return self._leg_failed("prefill", prefill_url, "answer is not JSON")
        decode_body = dict(body)
        if params:
            decode_body["kv_transfer_params"] = params

        decode_url = self.decode_urls[next(self._decode_rr)]
        req = self.client.build_request("POST", decode_url + path, json=decode_body, headers=headers)
        try:
            upstream = await self.client.send(req, stream=True)
        except httpx.HTTPError as e:
            if params:
                await self._release(params)
            return self._leg_failed("decode", decode_url, f"{type(e).__name__}: {e}")
        if upstream.status_code != 200:
            await upstream.aread()
            await upstream.aclose()
            return self._relay_error("decode", decode_url, upstream)
        media = upstream.headers.get("content-type", "application/json")
        return StreamingResponse(self._relay(upstream), media_type=media,
                                 headers={"x-request-id": request_id}, background=BackgroundTask(upstream.aclose))

    @staticmethod
    async def _relay(upstream: httpx.Response) -> AsyncIterator[bytes]:
        async for chunk in upstream.aiter_raw():
            yield chunk

    async def _release(self, params: dict[str, Any]) -> None:
        """Free a lease nobody will read (best effort, off the event loop)."""
        try:
            kv = p.parse_kv_transfer_params(params)
            if kv is None or not (kv.remote_host and kv.remote_port and kv.remote_request_id):
                return
            msg = p.LeaseRequest(p.PROTOCOL_VERSION, "proxy", kv.remote_request_id, p.LeaseAction.RELEASE)
            await asyncio.to_thread(side_request, zmq.Context.instance(), kv.remote_host, kv.remote_port, msg,
                                    2.0, self._secret)
        except KVConnectError as e:
            log.warning("could not release prefill lease: %s", e)

    @staticmethod
    def _leg_failed(leg: str, url: str, reason: str) -> JSONResponse:
        log.warning("%s leg to %s failed: %s", leg, url, reason)
        return JSONResponse(error_body(502, f"{leg} worker {url} failed: {reason}"), status_code=502)

    @staticmethod
    def _relay_error(leg: str, url: str, resp: httpx.Response) -> JSONResponse:
        try:
            inner = resp.json().get("error", {}).get("message") or resp.text
        except ValueError:
            inner = resp.text
        status = resp.status_code if resp.status_code < 500 else 502
        log.warning("%s leg to %s answered %d: %s", leg, url, resp.status_code, inner)
        return JSONResponse(error_body(status, f"{leg} worker {url} answered {resp.status_code}: {inner}"),
                            status_code=status)

    async def health(self, request: Request) -> Response:
        assert self.client is not None
        out: dict[str, Any] = {}
        for url in self.prefill_urls + self.decode_urls:
            try:
                r = await self.client.get(url + "/health", timeout=2.0)
                out[url] = r.status_code == 200
            except httpx.HTTPError:
                out[url] = False
        ok = all(out.values())
        return JSONResponse({"status": "ok" if ok else "degraded", "workers": out}, status_code=200 if ok else 503)

    async def models(self, request: Request) -> Response:
        assert self.client is not None
        try:
            r = await self.client.get(self.decode_urls[0] + "/v1/models")
            return Response(r.content, status_code=r.status_code, media_type="application/json")
        except httpx.HTTPError as e:
            return self._leg_failed("decode", self.decode_urls[0], str(e))

    def app(self) -> Starlette:
        async def completions(request: Request) -> Response:
            return await self.handle(request, "/v1/completions")

        async def chat(request: Request) -> Response:
            return await self.handle(request, "/v1/chat/completions")

        return Starlette(
            routes=[
                Route("/v1/completions", completions, methods=["POST"]),
                Route("/v1/chat/completions", chat, methods=["POST"]),
                Route("/v1/models", self.models),
                Route("/health", self.health),
            ],
            lifespan=self._lifespan,
        )

    @contextlib.asynccontextmanager
    async def _lifespan(self, app: Starlette) -> AsyncIterator[None]:
        await self.startup()
        try:
            yield
        finally:
            await self.shutdown()


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default=env_setting("PROXY_HOST", "127.0.0.1"))
    p.add_argument("--port", type=int, default=int(env_setting("PROXY_PORT", "8080") or 8080))
    p.add_argument("--prefill", action="append", default=None, help="prefill worker URL (repeatable)")
    p.add_argument("--decode", action="append", default=None, help="decode worker URL (repeatable)")
    p.add_argument("--timeout-s", type=float, default=300.0)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    prefill = args.prefill or [u for u in (env_setting("PREFILL_URLS", "") or "").split(",") if u]
    decode = args.decode or [u for u in (env_setting("DECODE_URLS", "") or "").split(",") if u]
    proxy = Proxy(prefill, decode, args.timeout_s, env_setting("SECRET", "") or "")
    uvicorn.run(proxy.app(), host=args.host, port=args.port, log_level="warning")
    return 0
