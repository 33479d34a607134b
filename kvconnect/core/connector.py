"""KVConnector: one worker's connector, serving both roles; this module only composes the halves.

Prefill role (`prefill/lender.py`): `lease()` reserves a finished request's blocks and returns the vLLM-named
kv_transfer_params; the side channel answers handshakes and lease requests, and NIXL notifications complete
leases. Decode role (`decode/puller.py`): `pull()` returns a `PullHandle` at once; the loop performs the
handshake on first contact, posts one transfer through the peer's link (`transports/`), and confirms the
lease.

Construction does every piece of start-up work on the calling thread (NIXL registration, every transport's
start: `transports/registry.py`) before the loop thread starts (`loop.py`); an engine may capture CUDA graphs
as soon as it returns.
"""

from __future__ import annotations

import logging
import select
import time
import uuid
from collections.abc import Callable, Sequence

import numpy as np
import zmq

from kvconnect.core.affinity import io_cpus, threads_started_on
from kvconnect.core.agent import AgentOptions, NixlAgent
from kvconnect.core.board import boot_id
from kvconnect.core.cache import KVCache
from kvconnect.core.config import ConnectorConfig
from kvconnect.core.decode.handle import PullHandle, PullStats
from kvconnect.core.decode.peers import PeerSet
from kvconnect.core.decode.pull import Pull
from kvconnect.core.decode.puller import Puller, trusted
from kvconnect.core.errors import InvalidRequestError, KVConnectError
from kvconnect.core.faults import FaultHooks
from kvconnect.core.loop import Loop
from kvconnect.core.plan.groups import GroupedBlocks
from kvconnect.core.plan.params import KVTransferParams
from kvconnect.core.prefill.lease import Lease
from kvconnect.core.prefill.lender import Lender
from kvconnect.core.snapshot import ConnectorSnapshot, Counters
from kvconnect.core.transports.base import Transport, TransportKind
from kvconnect.core.transports.registry import READY, Transports
from kvconnect.core.wire import protocol as p
from kvconnect.core.wire.handshake import SideChannelServer
from kvconnect.core.wire.logs import loggable

log = logging.getLogger(__name__)


def wait_readable(fds: list[int], timeout_s: float) -> bool:
    """Block up to `timeout_s` (at least a millisecond), the GIL released, until one of `fds` is readable; False
    if the wait failed (the caller then polls). `poll`, not `select`: a busy server's descriptors go past
    1023, which `select` refuses at once (the wait would have spun)."""
    poller = select.poll()
    for fd in fds:
        poller.register(fd, select.POLLIN)
    try:
        poller.poll(max(timeout_s * 1000, 1.0))
    except OSError:
        return False
    return True


class KVConnector:
    def __init__(
        self,
        cache: KVCache,
        config: ConnectorConfig,
        on_blocks_freed: Callable[[list[int]], None] | None = None,
        on_pull_done: Callable[[PullStats, KVConnectError | None], None] | None = None,  # (once per request)
        clock: Callable[[], float] = time.monotonic,
        on_lease_ended: Callable[[str, p.LeaseState], None] | None = None,
        faults: FaultHooks | None = None,
        transports: Sequence[type[Transport]] = (),
    ) -> None:
        """`transports`: the transports to take, in order of preference (default `registry.TRANSPORTS`; NIXL's
        READ is added last if they lack it; tests put a fake there)."""
        cache.verify()
        self.cache = cache
        self.spec = cache.spec
        self.config = config
        self.engine_id = config.engine_id
        self.incarnation_id = uuid.uuid4().hex
        self._counters = Counters()
        self._on_pull_done = on_pull_done
        self.faults = faults  # None unless fault injection was asked for (faults.py)
        self._lender = Lender(
            cache,
            config,
            self.incarnation_id,
            self._counters,
            on_blocks_freed or (lambda ids: None),
            on_lease_ended or (lambda request_id, state: None),
            clock,
            faults.take_read_expiry if faults is not None else None,
        )
        self._leases = self._lender.leases
        if faults is not None:
            faults.bind(self._leases.force_expire)
        # NIXL's UCX and ZMQ start threads of their own here: not on the cores an engine pinned this thread to
        with threads_started_on(io_cpus(config.loop_cpu_set)):
            self._agent = NixlAgent(
                f"{self.engine_id}-{self.incarnation_id[:12]}",
                AgentOptions(
                    num_threads=config.nixl_threads, telemetry=config.telemetry, merge_descs=config.merge_descs
                ),
            )
            self._transports = Transports.start(cache, self._agent, config.transport, transports)  # (this thread)
            self._lender.serve(self._agent)
            self._peer_info = self._hello_answer()
            self._ctx = zmq.Context()
            secret = config.keyring
            self._server = SideChannelServer(
                self._ctx, config.side_channel_host, config.side_channel_port, self._handle, secret
            )
            self.side_channel_port = self._server.port
            peers = PeerSet(self._transports, cache, config, self._ctx, secret)
            self._decode = Puller(peers, cache, config, self.engine_id, self._counters, self._pull_done)
            self._loop = Loop(
                f"kvc-loop-{self.engine_id}",
                self._tick,
                self._server.sock,
                lambda: self._server.poll(0),
                self._decode.busy,
                config.poll_interval_s,
                io_cpus(config.loop_cpu_set),
                cache.regions[0].device if self.spec.device == "cuda" else None,
                faults.gate if faults is not None else None,
                quiet=lambda: self._leases.num_held == 0 and self._decode.quiet(),
            )
            self._decode.on_loop_thread = self._loop.on_loop_thread
            self._loop.start()
        if not config.confirm_reads:
            log.warning(
                "confirm_reads is off: a pull is trusted without asking the prefill whether its lease held "
                "until the read ended, so a lease that expired mid-read goes unnoticed (not fail-closed)"
            )
        log.info(
            "kvconnect %s (incarnation %s) side channel on %s:%d, %s cache %.1f MiB; transports: %s",
            self.engine_id,
            self.incarnation_id[:12],
            config.side_channel_host,
            self.side_channel_port,
            self.spec.kind.value,
            self.spec.cache_bytes / 2**20,
            self._transports.describe(),
        )

    def _hello_answer(self) -> p.PeerInfo:
        """The handshake answer: the agent, the cache's spec and regions, what each transport offers, and the
        name of the lease board (`board.py`; "": none)."""
        cache, board = self.cache, self._lender.board
        return p.PeerInfo(
            protocol_version=p.PROTOCOL_VERSION,
            engine_id=self.engine_id,
            incarnation_id=self.incarnation_id,
            agent_name=self._agent.name,
            agent_metadata=self._agent.metadata(),
            spec=cache.spec,
            base_addrs=cache.base_addrs(),
            device_id=cache.device_id,
            lease_grace_ms=round(self.config.lease_grace_s * 1000),
            offers=dict(self._transports.offers),
            lease_board=board.name if board is not None else "",
            boot_id=boot_id() if board is not None else "",
            renews=True,
        )

    # --- prefill role ------------------------------------------------------------------------------

    def lease(
        self,
        request_id: str,
        block_ids: Sequence[int],
        num_tokens: int | None = None,
        lease_id: str | None = None,
        prompt_digest: bytes = b"",
        group_sizes: Sequence[int] = (),
    ) -> KVTransferParams:
        """Hold `block_ids` for a remote reader; returns the kv_transfer_params to hand to decode.

        `request_id` only labels the lease (logs, `on_lease_ended`); the lease's key is `lease_id`, random
        unless given. Ranks of a TP group lease the same ids under one lease id (the caller draws it with
        `new_lease_id()`) and listen on consecutive side channel ports (rank r on base + r); the params name
        the base port, so rank 0's params serve all. Blocks other live leases hold may be leased again.
        `prompt_digest` (`params.prompt_digest` of the prompt's token ids) binds the lease to its prompt: a
        reader serving another prompt is refused. `group_sizes`: a hybrid model's blocks per KV cache group,
        `block_ids` being the groups one after the other (plan/groups.py)."""
        return self._lender.lend(
            request_id, block_ids, num_tokens, lease_id, prompt_digest, group_sizes, self.side_channel_port
        )

    def release(self, lease_id: str) -> p.LeaseState:
        """End a lease now without a read (the request was aborted); returns the state it ended in."""
        return self._leases.release(lease_id)

    def lease_state(self, lease_id: str) -> p.LeaseState:
        return self._leases.state(lease_id)

    def held_leases(self) -> list[Lease]:  # copies (operator tooling, fault injection)
        return self._leases.held()

    def _handle(self, msg: p.Request) -> p.Reply:
        """Side-channel requests, on the loop thread."""
        return self._peer_info if isinstance(msg, p.Hello) else self._lender.answer(msg)

    # --- decode role -------------------------------------------------------------------------------

    def pull(
        self,
        params: KVTransferParams,
        local_block_ids: Sequence[int] | np.ndarray,
        request_id: str | None = None,
        prompt_digest: bytes = b"",
        driven: bool = False,
        requested_s: float | None = None,
        tail: GroupedBlocks | None = None,
        skip_tokens: int = 0,
        state_ids: Sequence[int] | np.ndarray | None = None,
    ) -> PullHandle:
        """Start pulling `params.remote_block_ids` into `local_block_ids`; never blocks on the peer.
        InvalidRequestError (naming the field) when the params or ids are invalid, or cannot be trusted (signed
        params: `plan/signing.py`): nothing is started, nothing dialled. `prompt_digest`: the binding of the prompt
        this decode serves; params or a lease bound to another prompt refuse the read and nothing of it is used.
        `driven`: the caller calls `drive()` right after, which then starts the pull on its thread (the loop thread
        is not woken for it). `requested_s`: when the caller was asked for the pull (`time.monotonic()`, default
        now): the pull's stats count from there. `tail`: read only these blocks, a tail of each group of the params'
        blocks (the caller's own prefix-cache hit holds the rest), into `local_block_ids`; default: all of them.
        `skip_tokens` (one KV cache group, block sizes that may differ): the caller's prefix-cache hit holds the
        lease's first `skip_tokens` tokens (whole local blocks); read the rest into `local_block_ids`. `state_ids`
        (a Mamba2 hybrid): which of `local_block_ids` hold state, for a prefill of another TP size."""
        try:
            handle, start = self._decode.prepare(
                params, local_block_ids, request_id, prompt_digest, requested_s, tail, skip_tokens, state_ids
            )
        except KVConnectError as e:  # refused before anything started: counted and reported like any failed pull
            self._counters.failed(e)
            if self._on_pull_done is not None:
                stats = PullStats(request_id or params.remote_request_id or "", params.remote_engine_id or "")
                try:
                    self._on_pull_done(stats, e)
                except Exception:
                    log.exception("pull %s: the pull-done callback failed", loggable(stats.request_id))
            raise
        self._loop.call(start, driver=driven)
        return handle

    def release_remote(self, params: KVTransferParams) -> None:
        """Tell the prefill side to free a lease we will not read (best effort, non-blocking). Params this decode
        cannot trust (`plan/signing.py`) are dropped: a release dials the host they name."""
        try:
            trusted(params, self.config.keyring, None)
        except InvalidRequestError as e:
            log.debug("release not sent: %s", e)
            return
        self._loop.call(lambda: self._decode.release.for_params(params))

    def renew_remote(self, leases: Sequence[tuple[KVTransferParams, bytes]]) -> None:
        """Ask the prefill sides to keep the leases whose requests wait in this decode's queue (best effort,
        non-blocking): each (params, binding of the prompt this decode will serve) held another TTL there, never
        past its `lease_max_s`. Params this decode cannot trust, or bound to another prompt, are dropped: a
        renewal dials the host they name."""
        kept = []
        for params, binding in leases:
            try:
                trusted(params, self.config.keyring, binding)
            except KVConnectError as e:
                log.debug("renewal not sent: %s", e)
                continue
            kept.append((params, binding))
        if kept:
            self._loop.call(lambda: self._decode.release.renew(kept))

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
            ipc_gather_unavailable=int(
                self._transports.status.get(TransportKind.IPC.value, READY).startswith("unavailable here")
            ),
            unknown_lease_requests=c.unknown_lease_requests,
            claims_refused=self._decode.claims.refused,
            lease_renewals=leases.renewals,
        )

    # --- loop --------------------------------------------------------------------------------------

    def _tick(self) -> None:
        """Notifications, the pulls' progress and lease expiry (inside a loop tick: `loop.py`)."""
        self._lender.drain_notifs()
        self._decode.progress()
        self._leases.expire()

    def drive(self) -> bool:
        """Run one tick on the calling thread, unless a tick is running now; never blocks, never raises.

        An engine calls this from its own step loop (the vLLM plug-in does, at each step while it has pulls
        or leases): the pulls it started are then posted, polled and confirmed by the thread that holds the
        GIL anyway, instead of waiting for the interpreter to hand it to the loop thread (up to its 5 ms
        switch interval while the engine runs Python). See `Loop.drive`. Returns whether a tick ran."""
        return self._loop.drive()

    def await_answers(self, timeout_s: float) -> bool:
        """Block up to `timeout_s`, the GIL released, while all this connector's pulls wait for is a prefill's
        lease answer, returning as soon as one may have come (the next `drive` handles it). False at once when
        anything else is pending (a transfer runs: the caller polls it) or a tick runs now. An engine's idle
        wait calls this between its ticks: an answer is then handled when it comes, not a tick later."""
        if not self._loop.lock.acquire(blocking=False):
            return False
        try:
            fds = self._decode.answer_fds()
        finally:
            self._loop.lock.release()
        return bool(fds) and wait_readable(fds, timeout_s)

    def wait_idle(self, timeout_s: float = 5.0) -> None:
        """Block until the loop has processed everything queued so far (tests, shutdown)."""
        self._loop.wait_idle(timeout_s)

    def close(self) -> None:
        if not self._loop.stop():
            return
        with self._loop.lock:  # (a driving thread may be in a tick)
            self._decode.close()
            self._server.close()
            self._transports.close()
            self._agent.close()
            self._ctx.term()
            self._lender.close()
        self._loop.close()

    def __enter__(self) -> KVConnector:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
