"""OpenAI-compatible worker (`kvconnect serve`): engine + connector behind Starlette.

Roles follow vLLM's kv_role: `prefill` answers `do_remote_decode` requests by computing the prompt,
leasing its blocks and returning kv_transfer_params; `decode` answers `do_remote_prefill` requests by
pulling those blocks and generating; `both` does either, and plain requests too.

A failed pull ends the request with a 502 naming the error, or under `failure_policy=recompute` the
prompt is computed locally. A pull abandoned while its READ may still land keeps its blocks quarantined
until that READ ends, so the request is aborted in the engine and, under recompute, computed again in
fresh blocks. KVCONNECT_FAULT_INJECTION=1 mounts the admin endpoints of `faults.py`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from kvconnect.core.config import (
    ConnectorConfig,
    FailurePolicy,
)
from kvconnect.core.connector import KVConnector
from kvconnect.core.errors import InvalidRequestError, KVConnectError, LeaseLostError, LocalError
from kvconnect.core.faults import FaultHooks
from kvconnect.core.plan.params import parse_kv_transfer_params, prompt_digest
from kvconnect.core.snapshot import ConnectorSnapshot
from kvconnect.engine.config import EngineConfig
from kvconnect.engine.engine import Engine
from kvconnect.engine.sampling import SamplingParams
from kvconnect.engine.sequence import TokenEvent
from kvconnect.serving import faults
from kvconnect.serving import openai_api as api
from kvconnect.serving.bodies import BodyTooLargeError, raw_kv_params, read_body
from kvconnect.serving.metrics import WorkerMetrics
from kvconnect.serving.pd import LeaseKeeper, PullLoader, check_remote_blocks
from kvconnect.verdict.probe import startup_verdict
from kvconnect.verdict.ucx_tables import TransportVerdict

log = logging.getLogger(__name__)
ROLES = ("prefill", "decode", "both")
MODEL_NAME = "kvconnect-tiny-llama"
# what a client hears about any lease the prefill would not let it read: never which of unknown, ended, read
# by another decode or not holding those blocks (that would let a client probe other requests' leases)
LEASE_NOT_READABLE = (
    "KV transfer from the prefill worker failed: LeaseLostError: the prefill holds no lease "
    "these kv_transfer_params may read (never granted, ended, or read by another decode)"
)


class Worker:
    """One engine, one connector, and the HTTP handlers that join them."""

    def __init__(self, role: str, engine_config: EngineConfig, conn_config: ConnectorConfig) -> None:
        if role not in ROLES:
            raise InvalidRequestError("role", f"must be one of {ROLES}")
        self.role = role
        self.verdict: TransportVerdict | None = None
        if role != "prefill" and (conn_config.verdict or conn_config.refuse_tcp):  # before the cache takes memory
            self.verdict = startup_verdict(engine_config.device, conn_config)  # ConfigError: TCP refused
        self.engine = Engine(engine_config)
        self.metrics = WorkerMetrics()
        if self.verdict is not None:
            self.metrics.on_verdict(self.verdict)
        self.connector = KVConnector(
            self.engine.cache,
            conn_config,
            on_blocks_freed=self.engine.allocator.free,
            on_pull_done=self.metrics.on_pull_done,
            faults=FaultHooks() if faults.enabled() else None,  # (the admin routes of faults.py need them)
        )
        self.metrics.bind(self._snapshot)
        self.block_size = engine_config.block_size
        self.engine.start()

    def _snapshot(self) -> ConnectorSnapshot:
        return self.connector.snapshot()

    def _on_pull_failed(self, request_id: str, error: KVConnectError, quarantined: bool) -> None:
        """A pull failed (engine thread). The connector already logged it with the request id and peer."""
        if quarantined:  # the blocks stay with the engine until the READ ends; end the request meanwhile
            self.metrics.quarantined.inc()
            log.info("request %s: its abandoned READ may still land; blocks held until it ends", request_id)
            self.engine.abort(request_id)
        elif self.connector.config.failure_policy is FailurePolicy.RECOMPUTE:
            if not isinstance(error, InvalidRequestError):  # (PullLoader.policy: a bad request is refused)
                self.metrics.recomputed.inc()  # the engine computes the prompt in the same blocks

    def _submit(
        self,
        request_id: str,
        prompt_ids: list[int],
        sampling: SamplingParams,
        loader: PullLoader | None,
        keeper: LeaseKeeper | None,
    ) -> asyncio.Queue[TokenEvent]:
        events: asyncio.Queue[TokenEvent] = asyncio.Queue()
        loop = asyncio.get_running_loop()

        def on_event(ev: TokenEvent) -> None:  # engine thread -> this request's event loop
            loop.call_soon_threadsafe(events.put_nowait, ev)

        self.engine.add_request(request_id, prompt_ids, sampling, on_event, kv_loader=loader, kv_keeper=keeper)
        return events

    def close(self) -> None:
        self.engine.stop()
        self.connector.close()

    # --- request handling --------------------------------------------------------------------------

    async def generate(self, request: Request, chat: bool) -> Response:
        request_id = request.headers.get("x-request-id") or f"cmpl-{uuid.uuid4().hex}"
        kv = raw = None
        try:
            raw = await read_body(request)
            body = api.parse_body(raw, chat)
            kv = parse_kv_transfer_params(body.kv_transfer_params)
            prompt_ids = self._tokenize(body)
            sampling = SamplingParams(
                max_tokens=body.limit,
                temperature=body.temperature,
                top_p=body.top_p,
                seed=body.seed,
                ignore_eos=body.ignore_eos,
            )
            keeper = loader = None
            if kv is not None and kv.do_remote_decode:
                if self.role == "decode":
                    raise InvalidRequestError("kv_transfer_params.do_remote_decode", "this worker's role is decode")
                keeper = LeaseKeeper(
                    self.connector, self.engine.allocator.free, self.block_size, prompt_digest(prompt_ids)
                )
            elif kv is not None and kv.do_remote_prefill:
                if self.role == "prefill":
                    raise InvalidRequestError("kv_transfer_params.do_remote_prefill", "this worker's role is prefill")
                check_remote_blocks(kv, len(prompt_ids), self.block_size)
                loader = PullLoader(
                    self.connector,
                    kv,
                    self.connector.config.failure_policy,
                    self.block_size,
                    on_failed=self._on_pull_failed,
                    prompt_digest=prompt_digest(prompt_ids),
                )
            events = self._submit(request_id, prompt_ids, sampling, loader, keeper)
        except LocalError as e:
            if kv is None and raw is not None:
                kv = raw_kv_params(raw)  # the body was refused, but its params may still name a lease
            if kv is not None and kv.do_remote_prefill:
                self.connector.release_remote(kv)  # refused: free the prefill's blocks now
            self.metrics.requests.labels("rejected").inc()
            return self._error(413 if isinstance(e, BodyTooLargeError) else 400, e)
        engine_rid = request_id
        first = await events.get()
        if first.finished and loader is not None and loader.quarantined:
            if loader.policy is not FailurePolicy.RECOMPUTE:
                return self._failed(first, loader)
            engine_rid = f"{request_id}:recompute"  # fresh blocks: the old ones wait for their READ to end
            try:
                events = self._submit(engine_rid, prompt_ids, sampling, None, None)
            except LocalError as e:
                return self._error(503, e)
            self.metrics.recomputed.inc()
            first = await events.get()
        if first.finished and first.finish_reason == "error":
            return self._failed(first, loader)
        tail = self._stream(request, engine_rid, body, first, events, keeper, loader, chat, len(prompt_ids))
        if body.stream:
            return StreamingResponse(tail, media_type="text/event-stream")
        text, ids, finish = "", [], None
        async for ev in self._events(request, engine_rid, first, events, loader):
            if ev.token_id is not None:
                ids.append(ev.token_id)
            finish = ev.finish_reason.value if ev.finish_reason else finish
            if finish == "error":
                return self._failed(ev, loader)
        text = self.engine.tokenizer.decode(ids)
        self.metrics.requests.labels(finish or "unknown").inc()
        out = api.completion_response(
            request_id,
            MODEL_NAME,
            text,
            ids,
            finish,
            len(prompt_ids),
            chat,
            self._params_out(keeper),
            body.return_token_ids,
        )
        if loader is not None and loader.handle is not None and loader.handle.done() and loader.error is None:
            out["kvconnect_transfer"] = msgspec.to_builtins(loader.handle.stats)
        return JSONResponse(out)

    async def _events(
        self,
        request: Request,
        request_id: str,
        first: TokenEvent,
        events: asyncio.Queue[TokenEvent],
        loader: PullLoader | None,
    ) -> AsyncIterator[TokenEvent]:
        ev = first
        try:
            while True:
                yield ev
                if ev.finished:
                    return
                ev = await events.get()
        except (asyncio.CancelledError, GeneratorExit):  # client went away
            self.metrics.requests.labels("abort").inc()
            self.engine.abort(request_id)
            if loader is not None:
                loader.abandon()
            raise

    async def _stream(
        self,
        request: Request,
        request_id: str,
        body: api.GenerateBody,
        first: TokenEvent,
        events: asyncio.Queue[TokenEvent],
        keeper: LeaseKeeper | None,
        loader: PullLoader | None,
        chat: bool,
        num_prompt: int,
    ) -> AsyncIterator[bytes]:
        decoder = self.engine.tokenizer.incremental_decoder()
        out_id = request_id.removesuffix(":recompute")
        is_first = True
        async for ev in self._events(request, request_id, first, events, loader):
            if ev.token_id is not None:
                chunk = api.stream_chunk(
                    out_id,
                    MODEL_NAME,
                    decoder.feed(ev.token_id),
                    [ev.token_id],
                    None,
                    chat,
                    body.return_token_ids,
                    first=is_first,
                )
                is_first = False
                yield b"data: " + json.dumps(chunk).encode() + b"\n\n"
            if ev.finished:
                reason = ev.finish_reason.value if ev.finish_reason else None
                self.metrics.requests.labels(reason or "unknown").inc()
                if reason == "error":
                    err = api.error_body(502, ev.error or "generation failed")
                    yield b"data: " + json.dumps(err).encode() + b"\n\n"
                else:
                    chunk = api.stream_chunk(
                        out_id, MODEL_NAME, decoder.flush(), [], reason, chat, body.return_token_ids, first=is_first
                    )
                    chunk["kv_transfer_params"] = self._params_out(keeper)
                    chunk["usage"] = {
                        "prompt_tokens": num_prompt,
                        "completion_tokens": ev.num_output_tokens,
                        "total_tokens": num_prompt + ev.num_output_tokens,
                    }
                    yield b"data: " + json.dumps(chunk).encode() + b"\n\n"
        yield b"data: [DONE]\n\n"

    def _tokenize(self, body: api.GenerateBody) -> list[int]:
        tok = self.engine.tokenizer
        if body.messages is not None:
            return tok.encode(tok.apply_chat_template([{"role": m.role, "content": m.content} for m in body.messages]))
        if isinstance(body.prompt, str):
            return tok.encode(body.prompt)
        return list(body.prompt or [])

    def _params_out(self, keeper: LeaseKeeper | None) -> dict[str, Any] | None:
        if keeper is None or keeper.params is None:
            return None
        return msgspec.to_builtins(keeper.params)  # type: ignore[no-any-return]

    def _failed(self, ev: TokenEvent, loader: PullLoader | None) -> Response:
        self.metrics.requests.labels("error").inc()
        error = loader.error if loader is not None else None
        if isinstance(error, InvalidRequestError):
            return self._error(400, error)
        if isinstance(error, LeaseLostError):  # one answer whatever the prefill said (the log has it)
            return JSONResponse(api.error_body(502, LEASE_NOT_READABLE, "kv_transfer_params"), status_code=502)
        if error is not None:
            return self._error(502, error, prefix="KV transfer from the prefill worker failed: ")
        return JSONResponse(api.error_body(500, ev.error or "generation failed"), status_code=500)

    @staticmethod
    def _error(status: int, error: KVConnectError, prefix: str = "") -> JSONResponse:
        field = getattr(error, "field", None)
        return JSONResponse(
            api.error_body(status, prefix + f"{type(error).__name__}: {error}", field), status_code=status
        )

    # --- small endpoints ---------------------------------------------------------------------------

    async def health(self, request: Request) -> Response:
        snap = self.connector.snapshot()
        return JSONResponse(
            {
                "status": "ok",
                "role": self.role,
                "engine_id": snap.engine_id,
                "incarnation_id": snap.incarnation_id,
                "free_blocks": self.engine.allocator.num_free,
                "total_blocks": self.engine.allocator.num_total,
                "leased_blocks": snap.lease_blocks_held,
                "allocated_blocks": self.engine.allocator.num_allocated,
                "quarantined_blocks": snap.quarantined_blocks,
                "loading": self.engine.num_loading,
                "running": self.engine.num_running,
                "side_channel_port": snap.side_channel_port,
                "transport_verdict": msgspec.to_builtins(self.verdict),
            }
        )

    async def models(self, request: Request) -> Response:
        return JSONResponse(
            {"object": "list", "data": [{"id": MODEL_NAME, "object": "model", "owned_by": "kvconnect"}]}
        )

    async def metrics_endpoint(self, request: Request) -> Response:
        m = self.metrics
        m.free_blocks.set(self.engine.allocator.num_free)
        m.running.set(self.engine.num_running)
        m.waiting.set(self.engine.num_waiting)
        return Response(m.render(), media_type="text/plain; version=0.0.4")

    def app(self) -> Starlette:
        async def completions(request: Request) -> Response:
            return await self.generate(request, chat=False)

        async def chat(request: Request) -> Response:
            return await self.generate(request, chat=True)

        routes = [
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/chat/completions", chat, methods=["POST"]),
            Route("/v1/models", self.models),
            Route("/health", self.health),
            Route("/metrics", self.metrics_endpoint),
        ]
        if faults.enabled():
            log.warning("fault-injection admin endpoints are enabled (KVCONNECT_FAULT_INJECTION)")
            routes += faults.routes(self.connector, self.engine.cache)
        return Starlette(routes=routes)
