"""llm-d style prefill/decode proxy (`kvconnect proxy`). Never imports NIXL.

For each OpenAI request: the prefill leg goes to the next prefill worker (round robin) with
max_tokens=1, stream=false and kv_transfer_params={"do_remote_decode": true}; the kv_transfer_params it
returns are copied into the original request, which goes to the next decode worker, and the decode
answer (streamed or not) is relayed to the client. Both legs carry the same x-request-id. Clients cannot
choose destinations: their own kv_transfer_params are replaced. A failed leg returns a clear error (a
decode answer that breaks mid-stream ends with an error event). If the decode leg cannot be reached, or
the client goes away before the decode answer is complete, the prefill lease is released over the side
channel at once instead of waiting for its TTL. Outcomes are counted in /metrics.

Every answer relayed from a decode carries a `Server-Timing` header with the proxy's share of the handover
(milliseconds): `proxy-in` (request received to prefill leg sent: reading and checking the body), `prefill`
(the prefill leg, sent to answered), `handoff` (its answer to the decode leg sent: the params copied),
`decode-head` (the decode leg sent to its answer's headers; for a streamed answer, before the first token).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import httpx
import zmq
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from kvconnect.core.config import env_int, env_setting, secret_from_env
from kvconnect.core.errors import ConfigError, InvalidRequestError, KVConnectError
from kvconnect.core.plan.params import parse_kv_transfer_params
from kvconnect.core.plan.signing import Keyring
from kvconnect.core.wire import lease_client
from kvconnect.serving.bodies import BodyTooLargeError, decode_json, read_body
from kvconnect.serving.openai_api import error_body

log = logging.getLogger(__name__)


TIMING_PARTS = ("proxy-in", "prefill", "handoff", "decode-head")  # between consecutive instants of `_legs`


def _server_timing(marks: list[float]) -> str:
    """The `Server-Timing` value of the handover's parts (module doc) from its instants."""
    return ", ".join(
        f"{name};dur={1000 * (b - a):.3f}" for name, a, b in zip(TIMING_PARTS, marks, marks[1:], strict=False)
    )


class ClientGone(Exception):
    """The client disconnected while the proxy was waiting on a leg."""


class ProxyMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter(
            "kvconnect_proxy_requests",
            "requests by outcome: ok, bad_request, prefill_failed, decode_failed, client_aborted",
            ["outcome"],
            registry=r,
        )
        self.leg_errors = Counter(
            "kvconnect_proxy_leg_errors", "failed legs by leg and error class", ["leg", "reason"], registry=r
        )
        self.releases = Counter(
            "kvconnect_proxy_lease_releases", "prefill leases released by the proxy", ["reason", "state"], registry=r
        )
        self.in_flight = Gauge(
            "kvconnect_proxy_legs_in_flight", "legs waiting for a worker's answer", ["leg"], registry=r
        )


class Proxy:
    def __init__(
        self, prefill_urls: list[str], decode_urls: list[str], timeout_s: float = 300.0, secret: str = ""
    ) -> None:
        if not prefill_urls or not decode_urls:
            raise ConfigError("the proxy needs at least one --prefill and one --decode URL")
        self.prefill_urls = [u.rstrip("/") for u in prefill_urls]
        self.decode_urls = [u.rstrip("/") for u in decode_urls]
        self._prefill_rr = itertools.cycle(range(len(self.prefill_urls)))
        self._decode_rr = itertools.cycle(range(len(self.decode_urls)))
        self._timeout = httpx.Timeout(timeout_s, connect=5.0)
        self._secret = Keyring.parse(secret)
        self.client: httpx.AsyncClient | None = None
        self.metrics = ProxyMetrics()

    async def startup(self) -> None:
        limits = httpx.Limits(max_connections=512, max_keepalive_connections=128)
        self.client = httpx.AsyncClient(timeout=self._timeout, limits=limits)

    async def shutdown(self) -> None:
        if self.client is not None:
            await self.client.aclose()

    async def handle(self, request: Request, path: str) -> Response:
        assert self.client is not None
        marks = [time.perf_counter()]  # the handover's instants (`_server_timing`)
        request_id = request.headers.get("x-request-id") or f"cmpl-{uuid.uuid4().hex}"
        headers = {"x-request-id": request_id, "content-type": "application/json"}
        try:
            body = decode_json(await read_body(request))
            if not isinstance(body, dict):
                raise InvalidRequestError("body", "must be a JSON object")
        except InvalidRequestError as e:
            self.metrics.requests.labels("bad_request").inc()
            status = 413 if isinstance(e, BodyTooLargeError) else 400
            return JSONResponse(error_body(status, f"invalid body: {e.reason}", "body"), status_code=status)
        body.pop("kv_transfer_params", None)  # never let a client pick where workers connect
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            return await self._legs(request_id, path, body, headers, gone, marks)
        finally:
            gone.cancel()

    async def _legs(
        self,
        request_id: str,
        path: str,
        body: dict[str, Any],
        headers: dict[str, str],
        gone: asyncio.Future[None],
        marks: list[float],
    ) -> Response:
        assert self.client is not None
        prefill_url = self.prefill_urls[next(self._prefill_rr)]
        leg = {k: v for k, v in body.items() if k not in ("stream_options",)}
        leg.update(max_tokens=1, stream=False, kv_transfer_params={"do_remote_decode": True})
        if "max_completion_tokens" in leg:
            leg["max_completion_tokens"] = 1
        try:  # not raced with `gone`: a prefill answer leases blocks, which we must learn of to release them
            with self.metrics.in_flight.labels("prefill").track_inprogress():
                marks.append(time.perf_counter())
                resp = await self.client.post(prefill_url + path, json=leg, headers=headers)
                marks.append(time.perf_counter())
        except httpx.HTTPError as e:
            return self._leg_failed(request_id, "prefill", prefill_url, e)
        if resp.status_code != 200:
            return self._relay_error(request_id, "prefill", prefill_url, resp)
        try:
            params = resp.json().get("kv_transfer_params")
        except ValueError:
            return self._leg_failed(request_id, "prefill", prefill_url, "answer is not JSON")
        decode_body = dict(body)
        if params:
            decode_body["kv_transfer_params"] = params

        decode_url = self.decode_urls[next(self._decode_rr)]
        req = self.client.build_request("POST", decode_url + path, json=decode_body, headers=headers)
        if gone.done():
            return await self._client_aborted(request_id, params, "during the prefill leg")
        try:
            with self.metrics.in_flight.labels("decode").track_inprogress():
                marks.append(time.perf_counter())
                upstream = await _unless_gone(self.client.send(req, stream=True), gone)
                marks.append(time.perf_counter())
        except ClientGone:
            return await self._client_aborted(request_id, params, "before the decode leg answered")
        except httpx.HTTPError as e:
            await self._release(request_id, params, "decode_unreachable")
            return self._leg_failed(request_id, "decode", decode_url, e)
        if upstream.status_code != 200:  # (a body the decode refused would leave the lease held for its TTL)
            await upstream.aread()
            await upstream.aclose()
            await self._release(request_id, params, "decode_refused")
            return self._relay_error(request_id, "decode", decode_url, upstream)
        media = upstream.headers.get("content-type", "application/json")
        answer_headers = {"x-request-id": request_id, "server-timing": _server_timing(marks)}
        if not media.startswith("text/event-stream"):  # read it whole: a broken answer becomes a clear 502
            try:
                content = await _unless_gone(upstream.aread(), gone)
            except ClientGone:
                return await self._client_aborted(request_id, params, "during the decode answer")
            except httpx.HTTPError as e:
                return self._leg_failed(request_id, "decode", decode_url, e)
            finally:
                await upstream.aclose()
            self.metrics.requests.labels("ok").inc()
            return Response(content, media_type=media, headers=answer_headers)
        return StreamingResponse(
            self._relay(request_id, decode_url, upstream),
            media_type=media,
            headers=answer_headers,
            background=BackgroundTask(upstream.aclose),
        )

    async def _relay(self, request_id: str, url: str, upstream: httpx.Response) -> AsyncIterator[bytes]:
        try:
            async for chunk in upstream.aiter_raw():
                yield chunk
        except httpx.HTTPError as e:
            self._count_failure(request_id, "decode", url, e)
            err = error_body(502, f"decode worker failed mid-stream: {_unnamed(f'{type(e).__name__}: {e}', url)}")
            yield b"data: " + json.dumps(err).encode() + b"\n\n"
            return
        except (asyncio.CancelledError, GeneratorExit):
            self.metrics.requests.labels("client_aborted").inc()
            log.info("request %s: client went away during the decode stream from %s", request_id, url)
            raise
        self.metrics.requests.labels("ok").inc()

    async def _client_aborted(self, request_id: str, params: dict[str, Any] | None, when: str) -> Response:
        self.metrics.requests.labels("client_aborted").inc()
        log.info("request %s: client went away %s; releasing its prefill lease", request_id, when)
        await self._release(request_id, params, "client_aborted")
        return Response(status_code=499)

    async def _release(self, request_id: str, params: dict[str, Any] | None, reason: str) -> None:
        """Free a lease nobody will read, on every rank of the prefill's TP group, as a non-reader (so a decode
        reader's pin on it stays: its confirmation decides). Best effort, off the event loop."""
        try:
            kv = parse_kv_transfer_params(params)
        except KVConnectError as e:
            self.metrics.releases.labels(reason, "error").inc()
            log.warning("request %s: could not release its prefill lease: %s", request_id, e)
            return
        if kv is None or not lease_client.release_targets(kv):
            return
        answers = await asyncio.to_thread(
            lease_client.release_everywhere, zmq.Context.instance(), kv, "proxy", self._secret, 2.0
        )
        for rank, state in sorted(answers.items()):
            self.metrics.releases.labels(reason, state if not state.startswith("error") else "error").inc()
            log.info(
                "request %s: prefill lease %s rank %d released (%s): now %s",
                request_id,
                kv.remote_request_id,
                rank,
                reason,
                state,
            )

    def _count_failure(self, request_id: str, leg: str, url: str, error: object) -> str:
        reason = type(error).__name__ if isinstance(error, Exception) else "bad_answer"
        self.metrics.requests.labels(f"{leg}_failed").inc()
        self.metrics.leg_errors.labels(leg, reason).inc()
        log.warning(
            "request %s: %s leg to %s failed: %s",
            request_id,
            leg,
            url,
            f"{reason}: {error}" if isinstance(error, Exception) else error,
        )
        return f"{reason}: {error}" if isinstance(error, Exception) else str(error)

    def _leg_failed(self, request_id: str, leg: str, url: str, error: object) -> JSONResponse:
        reason = self._count_failure(request_id, leg, url, error)
        return JSONResponse(error_body(502, f"{leg} worker failed: {_unnamed(reason, url)}"), status_code=502)

    def _relay_error(self, request_id: str, leg: str, url: str, resp: httpx.Response) -> JSONResponse:
        try:
            inner = resp.json().get("error", {}).get("message") or resp.text
        except ValueError:
            inner = resp.text
        status = resp.status_code if resp.status_code < 500 else 502
        outcome = "bad_request" if status < 500 else f"{leg}_failed"
        self.metrics.requests.labels(outcome).inc()
        self.metrics.leg_errors.labels(leg, f"http_{resp.status_code}").inc()
        # (info: the worker that refused or failed the leg has logged it already)
        log.info("request %s: %s leg to %s answered %d: %s", request_id, leg, url, resp.status_code, inner)
        return JSONResponse(
            error_body(status, f"{leg} worker answered {resp.status_code}: {_unnamed(inner, url)}"), status_code=status
        )

    async def metrics_endpoint(self, request: Request) -> Response:
        return Response(generate_latest(self.metrics.registry), media_type="text/plain; version=0.0.4")

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
            return self._leg_failed("-", "decode", self.decode_urls[0], e)

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
                Route("/metrics", self.metrics_endpoint),
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


async def _disconnected(request: Request) -> None:
    """Returns when the client has gone away (the body must already have been read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _unless_gone(aw: Any, gone: asyncio.Future[None]) -> Any:
    """Await `aw`, or raise ClientGone (cancelling it) if the client disconnects first."""
    task = asyncio.ensure_future(aw)
    await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, httpx.HTTPError):
        await task
    raise ClientGone


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default=env_setting("PROXY_HOST", "127.0.0.1"))
    p.add_argument("--port", type=int, default=env_int("PROXY_PORT", 8080, 1, 65535))
    p.add_argument("--prefill", action="append", default=None, help="prefill worker URL (repeatable)")
    p.add_argument("--decode", action="append", default=None, help="decode worker URL (repeatable)")
    p.add_argument("--timeout-s", type=float, default=300.0)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    prefill = args.prefill or [u for u in (env_setting("PREFILL_URLS", "") or "").split(",") if u]
    decode = args.decode or [u for u in (env_setting("DECODE_URLS", "") or "").split(",") if u]
    for flag, urls in (("--prefill (KVCONNECT_PREFILL_URLS)", prefill), ("--decode (KVCONNECT_DECODE_URLS)", decode)):
        if not urls:
            raise ConfigError(f"the proxy needs at least one worker URL: {flag}")
        for url in urls:
            if not url.startswith(("http://", "https://")):
                raise ConfigError(f"{flag}: {url!r} is not an http(s) URL")
    proxy = Proxy(prefill, decode, args.timeout_s, secret_from_env())
    uvicorn.run(proxy.app(), host=args.host, port=args.port, log_level="warning")
    return 0


def _unnamed(text: str, url: str) -> str:
    """`text` for a client: without the worker's address (clients need not learn the deployment's layout;
    the proxy's log names it)."""
    netloc = httpx.URL(url).netloc.decode()
    return text.replace(url, "<worker>").replace(netloc, "<worker>") if netloc else text
