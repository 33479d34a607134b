"""KVConnector: one worker's NIXL agent, side channel and I/O loop, serving both roles.

Prefill role: `lease()` reserves a finished request's blocks and returns the vLLM-named
kv_transfer_params; the side channel answers handshakes and lease confirmations, and NIXL
notifications complete leases. Decode role: `pull()` returns a `PullHandle` at once; the loop performs
the handshake on first contact, posts one READ over prepared lists, and confirms the lease.

Threading: one loop thread owns the NIXL agent and every ZMQ socket; other threads only enqueue work
(`_call`) or read thread-safe state (lease table, handles). The loop never blocks on a peer.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import zmq

from kvconnect.core import protocol as p
from kvconnect.core.agent import AgentOptions, MemKind, NixlAgent
from kvconnect.core.cache import KVCache
from kvconnect.core.config import ConnectorConfig
from kvconnect.core.decode import DecodeSide
from kvconnect.core.errors import InvalidRequestError, KVConnectError
from kvconnect.core.handshake import SideChannelServer
from kvconnect.core.lease import LeaseTable
from kvconnect.core.pull import PullHandle, PullStats

log = logging.getLogger(__name__)


@dataclass
class Counters:
    """Monotonic counters for /metrics; written by the loop thread only."""

    pulls_ok: int = 0
    pull_failures: dict[str, int] = field(default_factory=dict)
    bytes_pulled: int = 0
    descs_posted: int = 0
    handshakes: int = 0
    handshake_failures: int = 0
    notifs: int = 0
    stale_notifs: int = 0

    def failed(self, error: BaseException) -> None:
        name = type(error).__name__
        self.pull_failures[name] = self.pull_failures.get(name, 0) + 1


class KVConnector:
    def __init__(
        self,
        cache: KVCache,
        config: ConnectorConfig,
        on_blocks_freed: Callable[[list[int]], None] | None = None,
        on_pull_done: Callable[[PullStats, KVConnectError | None], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        cache.verify()
        self.cache = cache
        self.spec = cache.spec
        self.config = config
        self.engine_id = config.engine_id
        self.incarnation_id = uuid.uuid4().hex
        self.counters = Counters()
        self._on_blocks_freed = on_blocks_freed or (lambda ids: None)
        self._clock = clock
        self.leases = LeaseTable(config.lease_ttl_s, clock, self._blocks_freed)
        self.agent = NixlAgent(
            f"{self.engine_id}-{self.incarnation_id[:12]}",
            AgentOptions(num_threads=config.nixl_threads, telemetry=config.telemetry),
        )
        self.mem = MemKind.for_device(self.spec.device)
        regions = np.array(
            [[addr, self.spec.region_bytes, cache.device_id] for addr in cache.base_addrs()], dtype=np.int64
        )
        self.agent.register(regions, self.mem)
        ipc_handles, ipc_offsets, host = [], [], ""
        if self.spec.device == "cuda" and config.transport != "nixl":
            from kvconnect.core.transports import ipc_gather as peer_copy

            try:
                exported = [peer_copy.export_region(addr) for addr in cache.base_addrs()]
                ipc_handles, ipc_offsets = [h for h, _ in exported], [o for _, o in exported]
                host = peer_copy.host_id()
            except peer_copy.PeerCopyError as e:
                log.warning("CUDA IPC export unavailable, peers will use NIXL: %s", e)
        self._peer_info = p.PeerInfo(
            protocol_version=p.PROTOCOL_VERSION,
            engine_id=self.engine_id,
            incarnation_id=self.incarnation_id,
            agent_name=self.agent.name,
            agent_metadata=self.agent.metadata(),
            spec=self.spec,
            base_addrs=cache.base_addrs(),
            device_id=cache.device_id,
            host_id=host,
            ipc_handles=ipc_handles,
            ipc_offsets=ipc_offsets,
        )
        self._ctx = zmq.Context()
        secret = config.secret_bytes
        self._server = SideChannelServer(
            self._ctx, config.side_channel_host, config.side_channel_port, self._handle, secret
        )
        self.side_channel_port = self._server.port
        self.decode = DecodeSide(self, self._ctx, secret)
        self._inbox: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"kvc-loop-{self.engine_id}", daemon=True)
        self.on_pull_done = on_pull_done
        self._thread.start()
        log.info(
            "kvconnect %s (incarnation %s) side channel on %s:%d, %s cache %.1f MiB",
            self.engine_id, self.incarnation_id[:12], config.side_channel_host, self.side_channel_port,
            self.spec.kind.value, self.spec.cache_bytes / 2**20,
        )

    # --- prefill role ------------------------------------------------------------------------------

    def lease(self, request_id: str, block_ids: Sequence[int], num_tokens: int | None = None) -> p.KVTransferParams:
        """Hold `block_ids` for a remote reader; returns the kv_transfer_params to hand to decode.

        Ranks of a TP group lease the same ids under the same request id and listen on consecutive side
        channel ports (rank r on base + r); the params name the base port, so rank 0's params serve all."""
        ids = [int(b) for b in block_ids]
        bad = [b for b in ids if not 0 <= b < self.spec.num_blocks]
        if bad or not ids:
            raise InvalidRequestError("block_ids", f"block ids {bad[:8]} outside [0, {self.spec.num_blocks})"
                                      if bad else "is empty")
        self.leases.grant(request_id, ids)
        return p.KVTransferParams(
            do_remote_prefill=True,
            remote_engine_id=self.engine_id,
            remote_block_ids=ids,
            remote_host=self.config.advertise_host,
            remote_port=self.side_channel_port - self.spec.tp_rank,
            remote_request_id=request_id,
            tp_size=self.spec.tp_size,
            remote_incarnation_id=self.incarnation_id,
            remote_num_tokens=num_tokens,
        )

    def release(self, request_id: str) -> p.LeaseState:
        return self.leases.release(request_id)

    def _blocks_freed(self, block_ids: list[int]) -> None:
        try:
            self._on_blocks_freed(block_ids)
        except Exception:
            log.exception("on_blocks_freed callback failed for %d blocks", len(block_ids))

    def _handle(self, msg: p.Request) -> p.Reply:
        """Side-channel requests, on the loop thread."""
        if isinstance(msg, p.Hello):
            return self._peer_info
        self._drain_notifs()  # a notification may be queued behind this request
        if msg.action is p.LeaseAction.CONFIRM:
            state = self.leases.complete(msg.request_id, msg.reader, msg.readers)
        elif msg.action is p.LeaseAction.PIN:
            state = self.leases.pin(msg.request_id, msg.reader, msg.pin_ms / 1000)
        else:
            state = self.leases.release(msg.request_id, msg.reader)
            if state is p.LeaseState.RELEASED:
                log.info("lease %s released by %s", msg.request_id, msg.engine_id)
        return p.LeaseReply(msg.request_id, state, self.incarnation_id)

    def _drain_notifs(self) -> None:
        for agent_name, messages in self.agent.notifs().items():
            for raw in messages:
                try:
                    notif = p.decode_notif(raw)
                except KVConnectError as e:
                    log.warning("ignoring malformed notification from %s: %s", agent_name, e)
                    continue
                if notif.incarnation_id != self.incarnation_id:
                    self.counters.stale_notifs += 1
                    continue
                self.counters.notifs += 1
                self.leases.complete(notif.request_id, notif.reader, notif.readers)

    # --- decode role -------------------------------------------------------------------------------

    def pull(
        self,
        params: p.KVTransferParams,
        local_block_ids: Sequence[int],
        request_id: str | None = None,
    ) -> PullHandle:
        """Start pulling `params.remote_block_ids` into `local_block_ids`; never blocks on the peer."""
        return self.decode.pull(params, local_block_ids, request_id)

    def release_remote(self, params: p.KVTransferParams) -> None:
        """Tell the prefill side to free a lease we will not read (best effort, non-blocking)."""
        self._call(lambda: self.decode.send_release(params))

    # --- loop --------------------------------------------------------------------------------------

    def _call(self, fn: Callable[[], None]) -> None:
        if self._stop.is_set():
            raise KVConnectError("connector is closed")
        self._inbox.put(fn)
        try:
            os.write(self._wake_w, b"\0")  # wake the loop now, not at its next tick
        except BlockingIOError:  # the pipe is full: a wake-up is pending anyway
            pass

    def _run(self) -> None:
        if self.spec.device == "cuda":  # NIXL and the IPC path need this device's context on this thread
            import torch

            torch.cuda.set_device(self.cache.regions[0].device)
            if self.config.transport != "nixl":
                self._warm_up_gather()
        tick_ms = max(int(self.config.poll_interval_s * 1000), 1)
        poller = zmq.Poller()
        poller.register(self._server.sock, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        while not self._stop.is_set():
            try:
                ready = dict(poller.poll(0 if self.decode.busy() else tick_ms))
                if self._wake_r in ready:
                    try:
                        os.read(self._wake_r, 4096)
                    except BlockingIOError:
                        pass
                if self._server.sock in ready:
                    self._server.poll(0)
                while True:
                    try:
                        self._inbox.get_nowait()()
                    except queue.Empty:
                        break
                self._drain_notifs()
                self.decode.progress()
                self.leases.expire()
            except Exception:  # keep serving; the failing pull or message was already answered
                log.exception("kvconnect loop iteration failed")

    def _warm_up_gather(self) -> None:
        from kvconnect.core.transports import ipc_gather as peer_copy

        t0 = time.monotonic()
        try:
            peer_copy.warm_up(self.cache.regions[0].device)
        except Exception as e:  # no triton, no GPU support: peers fall back to NIXL at handshake
            log.info("IPC gather not compiled ahead (%s: %s)", type(e).__name__, e)
            return
        log.info("IPC gather compiled in %.0f ms", (time.monotonic() - t0) * 1e3)

    def wait_idle(self, timeout_s: float = 5.0) -> None:
        """Block until the loop has processed everything queued so far (tests, shutdown)."""
        done = threading.Event()
        self._call(done.set)
        if not done.wait(timeout_s):
            raise KVConnectError(f"connector loop did not answer within {timeout_s}s")

    def close(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(timeout=10)
        self.decode.close()
        self._server.close()
        self.agent.close()
        self._ctx.term()
        os.close(self._wake_r)
        os.close(self._wake_w)

    def __enter__(self) -> KVConnector:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
