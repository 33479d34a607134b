"""A prefill worker in a process of its own, driven over a pipe (real NIXL, real ZMQ): the one harness the
tests and `kvconnect bench` share.

The process owns one `KVConnector` over a cache it allocates; `setup` replaces both (a fresh spec, seed
and side-channel port), so one process can serve many benchmark cases. Every command is answered with
("ok", value) or ("error", text); `PrefillProcess.ask` raises `KVConnectError` on the latter. Commands:

- `setup(spec, seed, port)`: a new cache filled from `seed`, a new connector; answers its side-channel port
  and incarnation id; `setup_views(shape, geometry, seed, port)`: the same over vLLM-shaped tensors;
- leases: `lease(request_id, block_ids, num_tokens, lease_id)` (the params as JSON; the ranks of a TP group
  pass one lease id), `state(key)`, `settle(key, timeout_s)` (wait until it is no longer held),
  `release(key)` (its final state and the blocks still leased once drained), `expire(key)`, `held`,
  `freed`; a key is a lease id, or the request id of this process's latest lease under that label;
- the cache: `block(id)` (its bytes), `randn(seed)`, `kv(layer, ids)`, `fill_ref(seed, num_tokens, ids)`,
  `tokens(ids, num_tokens)`, `overwrite(ids)`;
- `pull(params_json, local_ids)`: this process as a decode worker: ("ok", stats) or ("failed", class, text).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import threading
import time
from dataclasses import dataclass
from typing import Any

import msgspec

from kvconnect.core.errors import KVConnectError
from kvconnect.core.plan.layout import CacheSpec
from kvconnect.core.plan.params import KVTransferParams
from kvconnect.core.wire.protocol import LeaseAction

log = logging.getLogger(__name__)

UCX_VARS = ("UCX_TLS", "UCX_NET_DEVICES", "NIXL_LOG_LEVEL", "UCX_CUDA_IPC_MAX_STREAMS")
START_TIMEOUT_S = 120.0
RELEASE_WAIT_S = 10.0
POLL_S = 0.0005


def reference_kv(seed: int, num_tokens: int, spec: CacheSpec) -> Any:
    """The whole model's KV for `num_tokens` tokens, (tokens, layers, 2, model KV heads, head_dim): what every
    rank of a TP group holds its slice of (deterministic in `seed`)."""
    import torch

    from kvconnect.core.cache import TORCH_DTYPES

    gen = torch.Generator(device="cpu").manual_seed(seed)
    shape = (num_tokens, spec.num_layers, 2, spec.model_kv_heads, spec.head_dim)
    return torch.randn(shape, generator=gen).to(TORCH_DTYPES[spec.dtype])


def rank_tokens(cache: Any, block_ids: list[int], num_tokens: int) -> Any:
    """Tokens [0, n) of this rank's cache in `block_ids`, as (tokens, layers, 2, H, D) on the CPU."""
    import torch

    spec = cache.spec
    layers = []
    for layer in range(spec.num_layers):
        halves = [
            view[block_ids].reshape(-1, spec.num_kv_heads, spec.head_dim)[:num_tokens].cpu() for view in cache.kv(layer)
        ]
        layers.append(torch.stack(halves, dim=1))
    return torch.stack(layers, dim=1)


def _wait_until(read: Any, done: Any, timeout_s: float) -> Any:
    """Poll `read()` until `done(value)` or the deadline; returns the last value."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = read()
        if done(value) or time.monotonic() >= deadline:
            return value
        time.sleep(POLL_S)


class _Server:
    """The process's state: one cache and connector at a time, replaced by each `setup`."""

    def __init__(self, device: str, config: dict[str, Any]) -> None:
        self.device = device
        self.config = config
        self.connector: Any = None
        self.cache: Any = None
        self.raw: Any = None  # the engine-shaped memory under `cache` (setup_views)
        self.freed: list[int] = []
        self.lease_ids: dict[str, str] = {}  # request id -> its latest lease's id
        self.pins_go = threading.Event()  # (hold_pins)

    def lease_id(self, key: str) -> str:
        return self.lease_ids.get(key, key)

    def setup(self, spec_raw: bytes, seed: int, port: int) -> tuple[int, str]:
        from kvconnect.core.cache import KVCache

        self.close()  # release NIXL's hold, then the old cache's memory
        spec = msgspec.msgpack.decode(spec_raw, type=CacheSpec)
        self.cache = KVCache.allocate(spec, self.device)
        self.cache.fill_pattern(seed)
        return self._serve(port)

    def setup_views(self, shape: str, geometry: dict[str, Any], seed: int, port: int) -> tuple[int, str]:
        """Like `setup`, over tensors shaped as vLLM's backends allocate them (`vllm_shapes.make_views`),
        registered through the vLLM plug-in's `describe` (`geometry`: layers, blocks, heads per rank, tokens,
        head_dim, and optionally page, tp and rank)."""
        from kvconnect.harness.vllm_shapes import make_views
        from kvconnect.vllm.layout import describe

        self.close()
        g = geometry
        views, self.raw = make_views(
            shape, g["layers"], g["blocks"], g["heads"], g["tokens"], g["head_dim"], seed=seed, device=self.device
        )
        self.cache = describe(
            views,
            num_blocks=g["blocks"],
            block_size=g["tokens"],
            tp_size=int(g.get("tp", 1)),
            tp_rank=int(g.get("rank", 0)),
            total_kv_heads=g["heads"] * int(g.get("tp", 1)),
            page=str(g.get("page", "vllm:cuda")),
            latent=shape.startswith("latent:"),
        ).cache
        return self._serve(port)

    def _serve(self, port: int) -> tuple[int, str]:
        """A fresh connector over `self.cache` (side channel on `port`, 0 = any): its port and incarnation."""
        import torch

        from kvconnect.core.config import connector_config
        from kvconnect.core.connector import KVConnector
        from kvconnect.core.faults import FaultHooks

        if self.device.startswith("cuda"):
            torch.cuda.synchronize(torch.device(self.device))
        self.freed = []
        config = connector_config(None, **{**self.config, **({"side_channel_port": port} if port else {})})
        self.connector = KVConnector(self.cache, config, on_blocks_freed=self.freed.extend, faults=FaultHooks())
        return self.connector.side_channel_port, self.connector.incarnation_id

    def handle(self, cmd: str, args: list[Any]) -> Any:
        import torch

        if cmd == "setup":
            return self.setup(*args)
        if cmd == "setup_views":
            return self.setup_views(*args)
        conn, cache = self.connector, self.cache
        if conn is None:
            raise KVConnectError(f"{cmd!r} before setup")
        spec = cache.spec
        if cmd == "lease":  # (request id, block ids[, num_tokens[, lease id]])
            params = conn.lease(*args)
            self.lease_ids[args[0]] = params.remote_lease_id
            return msgspec.json.encode(params)
        if cmd == "state":
            return conn.lease_state(self.lease_id(args[0])).value
        if cmd == "settle":  # (key, timeout): its state once it is no longer held
            key = self.lease_id(args[0])
            return _wait_until(lambda: conn.lease_state(key).value, lambda s: s != "held", args[1])
        if cmd == "release":  # end the lease if still held: (its final state, blocks this rank still leases)
            state = conn.release(self.lease_id(args[0])).value
            return state, _wait_until(lambda: conn.snapshot().lease_blocks_held, lambda n: n == 0, RELEASE_WAIT_S)
        if cmd == "expire":
            assert conn.faults is not None
            return conn.faults.expire_lease(self.lease_id(args[0])).value
        if cmd == "held":
            return conn.snapshot().lease_blocks_held
        if cmd == "sizes":  # every container the connector keeps (growth.py), and this process's memory
            from kvconnect.harness.growth import rss_bytes, sizes

            return sizes(conn, "prefill"), rss_bytes()
        if cmd == "unknown":  # lease requests that named a lease not granted here
            return conn.snapshot().unknown_lease_requests
        if cmd == "freed":
            return sorted(self.freed)
        if cmd == "block":
            return cache.block_bytes(args[0])
        if cmd == "randn":  # finite values, for attention checks
            gen = torch.Generator(device="cpu").manual_seed(args[0])
            for t in cache.regions:
                t.copy_(torch.randn(t.shape, generator=gen).to(t.dtype))
            return "ok"
        if cmd == "kv":  # one layer's K and V of the given blocks, as CPU tensors
            k, v = cache.kv(args[0])
            return k[args[1]].cpu(), v[args[1]].cpu()
        if cmd == "fill_ref":  # (seed, num_tokens, block_ids): this rank's heads of the reference, in token order
            seed, num_tokens, ids = args
            ref = reference_kv(seed, num_tokens, spec)
            lo, hi = spec.head_range()
            t = torch.arange(num_tokens)
            blk, slot = torch.as_tensor(ids)[t // spec.block_size], t % spec.block_size
            for layer in range(spec.num_layers):
                for kv, view in enumerate(cache.kv(layer)):
                    view[blk, slot] = ref[:, layer, kv, lo:hi].to(view.device)
            return "ok"
        if cmd == "tokens":  # (block_ids, num_tokens)
            return rank_tokens(cache, *args)
        if cmd == "pull":  # (kv_transfer_params as JSON, local block ids)
            params = msgspec.json.decode(args[0], type=KVTransferParams)
            try:
                stats = conn.pull(params, args[1]).wait(60)
            except KVConnectError as e:
                return "failed", type(e).__name__, str(e)
            return "ok", msgspec.to_builtins(stats)
        if cmd == "hold_pins":  # answer no PIN until "answer_pins" (tests of a decode waiting for the answer)
            self.pins_go = threading.Event()  # ("and_notifs": nor complete a lease by a READ's notification)
            answer = conn._lender.answer
            if args and args[0] == "and_notifs":
                conn._agent.notifs = self._notifs_held(conn._agent.notifs, self.pins_go)

            def held(msg: Any) -> Any:  # (the tick waits here, still draining NIXL: a READ over UCX needs this side)
                while getattr(msg, "action", None) is LeaseAction.PIN and not self.pins_go.wait(0.001):
                    conn._lender.drain_notifs()
                return answer(msg)

            conn._lender.answer = held
            return "ok"
        if cmd == "answer_pins":
            self.pins_go.set()
            return "ok"
        if cmd == "overwrite":
            for layer in range(spec.num_layers):
                for t in cache.kv(layer):
                    t[args[0]].view(torch.uint8).fill_(0xAB)
            return "ok"
        raise KVConnectError(f"unknown command {cmd!r}")

    @staticmethod
    def _notifs_held(notifs: Any, go: threading.Event) -> Any:
        """`notifs` that takes NIXL's notifications in (a READ over UCX needs this side's progress) but hands
        them on only once `go` is set."""
        kept: dict[str, list[bytes]] = {}

        def held() -> dict[str, list[bytes]]:
            for name, messages in notifs().items():
                kept.setdefault(name, []).extend(messages)
            if not go.is_set():
                return {}
            out = dict(kept)
            kept.clear()
            return out

        return held

    def close(self) -> None:
        if self.connector is not None:
            self.connector.close()
        self.connector = self.cache = self.raw = None


def _main(pipe: Any, env: dict[str, str], device: str, config: dict[str, Any]) -> None:
    """Entry point of the spawned process: serve commands until `stop` or a closed pipe."""
    os.environ.update(env)  # before anything loads NIXL/UCX
    import torch

    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    server = _Server(device, config)
    pipe.send(("ok", os.getpid()))
    try:
        while True:
            try:
                cmd, *args = pipe.recv()
            except EOFError:
                break
            if cmd == "stop":
                break
            try:
                pipe.send(("ok", server.handle(cmd, args)))
            except Exception as e:  # report to the driver instead of dying
                pipe.send(("error", f"{type(e).__name__}: {e}"))
    finally:
        server.close()


@dataclass
class PrefillProcess:
    """The driver's handle on one prefill process."""

    proc: Any
    pipe: Any
    port: int = 0
    incarnation_id: str = ""

    @classmethod
    def launch(cls, env: dict[str, str] | None = None, device: str = "cpu", **config: Any) -> PrefillProcess:
        """Spawn the process (UCX settings inherited, `env` on top; `config`: ConnectorConfig fields, the side
        channel on loopback unless told). Call `wait_started`; launch several first to start them together."""
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        child_env = {**{k: os.environ[k] for k in UCX_VARS if k in os.environ}, **(env or {})}
        config.setdefault("side_channel_host", "127.0.0.1")
        proc = ctx.Process(target=_main, args=(child, child_env, device, config), daemon=True, name="kvconnect-prefill")
        proc.start()
        child.close()
        return cls(proc, parent)

    @classmethod
    def start(
        cls, spec: CacheSpec, seed: int = 1, env: dict[str, str] | None = None, device: str | None = None, **config: Any
    ) -> PrefillProcess:
        """Launch, wait, and set up one cache: a ready prefill worker."""
        peer = cls.launch(env, device or spec.device, **config)
        try:
            peer.wait_started()
            peer.setup(spec, seed)
            peer.wait_setup()
        except BaseException:
            peer.stop()
            raise
        return peer

    def wait_started(self) -> None:
        self.answer("start", START_TIMEOUT_S)

    def answer(self, what: str, timeout_s: float) -> Any:
        """The answer to the command sent last; KVConnectError if it failed or did not come in time."""
        if not self.pipe.poll(timeout_s):
            raise KVConnectError(f"prefill process did not answer {what!r} within {timeout_s:.0f}s")
        try:
            tag, value = self.pipe.recv()
        except EOFError as e:
            raise KVConnectError(f"prefill process exited during {what!r} (exit code {self.proc.exitcode})") from e
        if tag != "ok":
            raise KVConnectError(f"prefill process failed {what!r}: {value}")
        return value

    def send(self, *cmd: Any) -> None:
        """Send a command without waiting (several processes can then work at once); see `answer`."""
        self.pipe.send(cmd)

    def ask(self, *cmd: Any, timeout_s: float = 60.0) -> Any:
        self.send(*cmd)
        return self.answer(cmd[0], timeout_s)

    def setup(self, spec: CacheSpec, seed: int, port: int = 0) -> None:
        """Send a new cache spec (side channel on `port`, 0 = any); `wait_setup` for the answer."""
        self.send("setup", msgspec.msgpack.encode(spec), seed, port)

    def setup_views(self, shape: str, geometry: dict[str, Any], seed: int, port: int = 0) -> None:
        """Send a vLLM-shaped cache (see `_Server.setup_views`); `wait_setup` for the answer."""
        self.send("setup_views", shape, geometry, seed, port)

    def wait_setup(self) -> None:
        self.port, self.incarnation_id = self.answer("setup", START_TIMEOUT_S)

    def lease(
        self, request_id: str, block_ids: list[int], num_tokens: int | None = None, lease_id: str | None = None
    ) -> KVTransferParams:
        return msgspec.json.decode(
            self.ask("lease", request_id, block_ids, num_tokens, lease_id), type=KVTransferParams
        )

    def settle(self, request_id: str, timeout_s: float) -> str:
        return str(self.ask("settle", request_id, timeout_s, timeout_s=timeout_s + 10))

    def release(self, request_id: str) -> tuple[str, int]:
        """Release the lease if it is still held: (its final state, blocks this rank still leases)."""
        state, held = self.ask("release", request_id)
        return str(state), int(held)

    def stop(self) -> None:
        if self.proc.is_alive():
            try:
                self.pipe.send(("stop",))
            except (BrokenPipeError, OSError):
                pass
            self.proc.join(20)
        if self.proc.is_alive():
            log.warning("prefill process did not stop; killing pid %s", self.proc.pid)
            self.proc.kill()
            self.proc.join(5)
        self.pipe.close()
