"""KVConnector: one worker's NIXL agent, side channel and I/O loop, serving both roles.

Prefill role: `lease()` reserves a finished request's blocks and returns the vLLM-named
kv_transfer_params; the side channel answers handshakes and lease confirmations, and NIXL
notifications complete leases. Decode role: `pull()` returns a `PullHandle` at once; the loop performs
the handshake on first contact, posts one READ over prepared lists, and confirms the lease.

Threading: the loop thread owns the side-channel server; the NIXL agent and the peers' sockets are used
only inside a tick, and ticks are serialised by one lock. The loop thread runs them; the engine's own thread
may run one too (`drive`) when the loop is not in one, so that a pull is posted and finished without
waiting for the interpreter to switch threads (a Python engine loop holds the GIL between its waits).
Other threads only enqueue work (`_call`) or read thread-safe state (lease table, handles). No tick
blocks on a peer.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
import uuid
from collections.abc import Callable, Sequence

import numpy as np
import zmq

from kvconnect.core.affinity import io_cpus, place_current_thread, threads_started_on
from kvconnect.core.agent import AgentOptions, MemKind, NixlAgent
from kvconnect.core.cache import KVCache
from kvconnect.core.config import ConnectorConfig, TransportChoice
from kvconnect.core.decode.peers import PeerSet, TransportFactory
from kvconnect.core.decode.pull import Pull, PullHandle, PullStats
from kvconnect.core.decode.side import DecodeSide
from kvconnect.core.digest import block_sums
from kvconnect.core.errors import KVConnectError
from kvconnect.core.faults import FaultHooks
from kvconnect.core.plan.params import KVTransferParams, validate_block_ids
from kvconnect.core.prefill.lease import Lease, LeaseTable, new_lease_id
from kvconnect.core.prefill.side import PrefillSide, peer_info
from kvconnect.core.snapshot import ConnectorSnapshot, Counters
from kvconnect.core.wire import protocol as p
from kvconnect.core.wire.handshake import SideChannelServer

log = logging.getLogger(__name__)

DRIVEN_S = 0.05  # a caller that drove within this long is still driving: the loop thread leaves the ticks to it
DRIVEN_TICK_MS = 10  # ... and wakes this often to see whether it still does (or at once for the side channel)


class KVConnector:
    def __init__(
        self,
        cache: KVCache,
        config: ConnectorConfig,
        on_blocks_freed: Callable[[list[int]], None] | None = None,
        on_pull_done: Callable[[PullStats, KVConnectError | None], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        on_lease_ended: Callable[[str, p.LeaseState], None] | None = None,
        faults: FaultHooks | None = None,
        transports: TransportFactory | None = None,
    ) -> None:
        cache.verify()
        self.cache = cache
        self.spec = cache.spec
        self.config = config
        self.engine_id = config.engine_id
        self.incarnation_id = uuid.uuid4().hex
        self._counters = Counters()
        self._on_blocks_freed = on_blocks_freed or (lambda ids: None)
        self._on_lease_ended = on_lease_ended or (lambda request_id, state: None)
        self._on_pull_done = on_pull_done
        self.faults = faults  # None unless fault injection was asked for (faults.py)
        expire_read = faults.take_read_expiry if faults is not None else None
        self._leases = LeaseTable(
            config.lease_ttl_s, clock, self._blocks_freed, grace_s=config.lease_grace_s, expire_read=expire_read
        )
        if faults is not None:
            faults.bind(self._leases.force_expire)
        # NIXL's UCX and ZMQ start threads of their own here: not on the cores an engine pinned this thread to
        with threads_started_on(io_cpus(config.loop_cpu_set)):
            self._agent = NixlAgent(
                f"{self.engine_id}-{self.incarnation_id[:12]}",
                AgentOptions(num_threads=config.nixl_threads, telemetry=config.telemetry),
            )
            regions = np.array(
                [[addr, self.spec.region_bytes, cache.device_id] for addr in cache.base_addrs()], dtype=np.int64
            )
            self._agent.register(regions, MemKind.for_device(self.spec.device))
            self._peer_info = peer_info(self.engine_id, self.incarnation_id, self._agent, cache, config)
            self._prefill = PrefillSide(self._leases, self._agent, self._counters, self.incarnation_id)
            self._ctx = zmq.Context()
            secret = config.secret_bytes
            self._server = SideChannelServer(
                self._ctx, config.side_channel_host, config.side_channel_port, self._handle, secret
            )
            self.side_channel_port = self._server.port
            self._ipc_problem = ""  # why the IPC gather cannot run here ("" = it can, as far as we know)
            self._decode = DecodeSide(
                PeerSet(self._agent, cache, config, self._ctx, secret, lambda: self._ipc_problem, transports),
                cache,
                config,
                self.engine_id,
                self._counters,
                self._pull_done,
            )
            self._inbox: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
            self._wake_r, self._wake_w = os.pipe()
            os.set_blocking(self._wake_r, False)
            os.set_blocking(self._wake_w, False)
            self._stop = threading.Event()
            self._tick_lock = threading.Lock()  # one tick at a time, on the loop thread or a driving thread
            self._driven_until = 0.0  # until then a caller is driving: the loop thread leaves the ticks to it
            self._device_index = cache.regions[0].device.index if self.spec.device == "cuda" else None
            self._thread = threading.Thread(target=self._run, name=f"kvc-loop-{self.engine_id}", daemon=True)
            self._thread.start()
        if not config.confirm_reads:
            log.warning(
                "confirm_reads is off: a pull is trusted without asking the prefill whether its lease held "
                "until the read ended, so a lease that expired mid-read goes unnoticed (not fail-closed)"
            )
        log.info(
            "kvconnect %s (incarnation %s) side channel on %s:%d, %s cache %.1f MiB",
            self.engine_id,
            self.incarnation_id[:12],
            config.side_channel_host,
            self.side_channel_port,
            self.spec.kind.value,
            self.spec.cache_bytes / 2**20,
        )

    # --- prefill role ------------------------------------------------------------------------------

    def lease(
        self, request_id: str, block_ids: Sequence[int], num_tokens: int | None = None, lease_id: str | None = None
    ) -> KVTransferParams:
        """Hold `block_ids` for a remote reader; returns the kv_transfer_params to hand to decode.

        `request_id` only labels the lease (logs, `on_lease_ended`); the lease's key is `lease_id`, random
        unless given. Ranks of a TP group lease the same ids under one lease id (the caller draws it with
        `new_lease_id()`) and listen on consecutive side channel ports (rank r on base + r); the params name
        the base port, so rank 0's params serve all. Blocks other live leases hold may be leased again."""
        ids = validate_block_ids("block_ids", block_ids, self.spec.num_blocks).tolist()
        lease_id = lease_id or new_lease_id()
        content = block_sums(self.cache, ids) if self.config.kv_digest else ()
        self._leases.grant(lease_id, ids, label=request_id, content=content)
        return KVTransferParams(
            do_remote_prefill=True,
            remote_engine_id=self.engine_id,
            remote_block_ids=ids,
            remote_host=self.config.advertise_host,
            remote_port=self.side_channel_port - self.spec.tp_rank,
            remote_request_id=request_id,
            tp_size=self.spec.tp_size,
            remote_incarnation_id=self.incarnation_id,
            remote_num_tokens=num_tokens,
            remote_lease_id=lease_id,
        )

    def release(self, lease_id: str) -> p.LeaseState:
        """End a lease now without a read (the request was aborted); returns the state it ended in."""
        return self._leases.release(lease_id)

    def lease_state(self, lease_id: str) -> p.LeaseState:
        return self._leases.state(lease_id)

    def held_leases(self) -> list[Lease]:  # copies (operator tooling, fault injection)
        return self._leases.held()

    def _blocks_freed(self, lease: Lease, block_ids: list[int]) -> None:
        try:
            if block_ids:
                self._on_blocks_freed(block_ids)
            self._on_lease_ended(lease.label, lease.state)
        except Exception:
            log.exception("lease %s: the freed-blocks callback failed for %d blocks", lease.request_id, len(block_ids))

    def _handle(self, msg: p.Request) -> p.Reply:
        """Side-channel requests, on the loop thread."""
        return self._peer_info if isinstance(msg, p.Hello) else self._prefill.answer(msg)

    # --- decode role -------------------------------------------------------------------------------

    def pull(
        self,
        params: KVTransferParams,
        local_block_ids: Sequence[int],
        request_id: str | None = None,
    ) -> PullHandle:
        """Start pulling `params.remote_block_ids` into `local_block_ids`; never blocks on the peer.
        InvalidRequestError (naming the field) when the params or ids are invalid: nothing is started."""
        handle, start = self._decode.prepare(params, local_block_ids, request_id)
        self._call(start)
        return handle

    def release_remote(self, params: KVTransferParams) -> None:
        """Tell the prefill side to free a lease we will not read (best effort, non-blocking)."""
        self._call(lambda: self._decode.release.for_params(params))

    def _pull_done(self, pull: Pull, error: KVConnectError | None) -> None:
        if self._on_pull_done is not None:
            self._on_pull_done(pull.handle.stats, error)

    # --- state -------------------------------------------------------------------------------------

    def snapshot(self) -> ConnectorSnapshot:
        """Counters and gauges for /health and /metrics (any thread; values may be a tick old)."""
        c, leases, abandoned = self._counters, self._leases, self._decode.abandoned
        return ConnectorSnapshot(
            engine_id=self.engine_id,
            incarnation_id=self.incarnation_id,
            side_channel_port=self.side_channel_port,
            pulls_ok=c.pulls_ok,
            pull_failures=dict(c.pull_failures),
            bytes_pulled=c.bytes_pulled,
            handshakes=c.handshakes,
            handshake_failures=c.handshake_failures,
            notifs=c.notifs,
            stale_notifs=c.stale_notifs,
            side_channel_refused=self._server.num_refused,
            abandoned_reads=len(abandoned),
            quarantined_blocks=abandoned.num_blocks,
            leases_held=leases.num_held,
            lease_blocks_held=leases.num_blocks_held,
            leases_ended={state.value: count for state, count in leases.counts.items()},
            ipc_gather_unavailable=int(bool(self._ipc_problem)),
            unknown_lease_requests=c.unknown_lease_requests,
        )

    # --- loop --------------------------------------------------------------------------------------

    def _call(self, fn: Callable[[], None]) -> None:
        if self._stop.is_set():
            raise KVConnectError("connector is closed")
        self._inbox.put(fn)
        if time.monotonic() < self._driven_until:
            return  # the driving thread runs it at its next `drive` (the loop thread at its next tick)
        try:
            os.write(self._wake_w, b"\0")  # wake the loop now, not at its next tick
        except BlockingIOError:  # the pipe is full: a wake-up is pending anyway
            pass

    def _run(self) -> None:
        place_current_thread(io_cpus(self.config.loop_cpu_set), "connector loop")  # (see affinity.py)
        if self.spec.device == "cuda":  # NIXL and the IPC path need this device's context on this thread
            import torch

            torch.cuda.set_device(self.cache.regions[0].device)
            if self.config.transport is not TransportChoice.NIXL:
                self._warm_up_gather()
        tick_ms = max(int(self.config.poll_interval_s * 1000), 1)
        gate = self.faults.gate if self.faults is not None else contextlib.nullcontext()  # (faults.py)
        poller = zmq.Poller()
        poller.register(self._server.sock, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        while not self._stop.is_set():
            try:
                driven = time.monotonic() < self._driven_until
                ready = dict(poller.poll(DRIVEN_TICK_MS if driven else 0 if self._decode.busy() else tick_ms))
                if self._wake_r in ready:
                    try:
                        os.read(self._wake_r, 4096)
                    except BlockingIOError:
                        pass
                if self._server.sock not in ready and time.monotonic() < self._driven_until:
                    continue  # the driving thread ticks: a tick here would hold the lock while it waits for the GIL
                with gate, self._tick_lock:
                    if self._server.sock in ready:
                        self._server.poll(0)
                    self._tick()
            except Exception:  # keep serving; the failing pull or message was already answered
                log.exception("kvconnect loop iteration failed")

    def _tick(self) -> None:
        """Queued work, notifications, the pulls' progress and lease expiry (under `_tick_lock`)."""
        while True:
            try:
                self._inbox.get_nowait()()
            except queue.Empty:
                break
        self._prefill.drain_notifs()
        self._decode.progress()
        self._leases.expire()

    def drive(self) -> bool:
        """Run one tick on the calling thread, unless a tick is running now; never blocks, never raises.

        An engine calls this from its own step loop (the vLLM plug-in does, at each step while it has pulls
        or leases): the pulls it started are then posted, polled and confirmed by the thread that holds the
        GIL anyway, instead of waiting for the interpreter to hand it to the loop thread (up to its 5 ms
        switch interval while the engine runs Python). While a caller drives (it did within `DRIVEN_S`), the
        loop thread ticks only to serve the side channel, and takes over again once the caller stops. A CUDA
        cache is driven only from a thread whose current device is the cache's. Returns whether a tick ran."""
        if self._stop.is_set() or not self._on_cache_device() or not self._tick_lock.acquire(blocking=False):
            return False
        try:
            self._driven_until = time.monotonic() + DRIVEN_S
            self._tick()
        except Exception:
            log.exception("kvconnect tick failed on a driving thread")
        finally:
            self._tick_lock.release()
        return True

    def _on_cache_device(self) -> bool:
        if self._device_index is None:
            return True
        import torch

        return bool(torch.cuda.current_device() == self._device_index)

    def _warm_up_gather(self) -> None:
        """Compile the IPC gather now (Triton needs a C compiler and Python headers at first use). If it
        cannot be, same-host GPU peers use NIXL (`transport=ipc` peers are refused) and the snapshot says so."""
        from kvconnect.core.transports import ipc_gather

        t0 = time.monotonic()
        try:
            ipc_gather.warm_up(self.cache.regions[0].device)
        except Exception as e:
            self._ipc_problem = f"{type(e).__name__}: {e}"[:300]
            log.warning("IPC gather unavailable (%s); same-host GPU peers will use NIXL", self._ipc_problem)
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
        with self._tick_lock:  # (a driving thread may be in a tick)
            self._decode.close()
            self._server.close()
            self._agent.close()
            self._ctx.term()
        os.close(self._wake_r)
        os.close(self._wake_w)

    def __enter__(self) -> KVConnector:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
