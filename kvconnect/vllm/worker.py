"""Worker side of the plug-in (each vLLM worker process): one `KVConnector` over the KV tensors vLLM
allocated, driven by the scheduler's step orders. By vLLM hook:

- `register_kv_caches`: the tensors become a kvconnect cache (`layout.describe`, by their strides; a
  hybrid's state layers: `state.py`) registered with NIXL; this rank's side channel listens on the group's
  base port + TP rank.
- `bind_connector_metadata` (before each step's forward): grant leases, release leases nobody will read,
  start pulls. A pull reads only the blocks the local prefix cache missed: the tail of the prefill's list.
- both drive the connector (`KVConnector.drive`) while this rank has pulls or leases: this thread, which
  holds the GIL while vLLM steps, posts and finishes the pulls itself, and answers the decodes' lease
  requests (PINs), rather than waiting for the interpreter to switch to the loop thread.
- `transfer_results` (behind `get_finished` / `get_transfer_results`, after each step): on a step with
  nothing to compute (vLLM keeps stepping while a transfer or a lease is pending) it first waits up to
  `IDLE_WAIT_S` for one to end, driving the connector meanwhile (on a CPU cache every `DRIVE_EVERY_S`, so a
  waiting engine polls instead of spinning two processes at 100 %; on a GPU cache with pulls in flight, tick
  after tick); then it reports pulls that are usable, or failed and settled (their blocks go to
  `get_block_ids_with_load_errors` so vLLM's failure policy applies; a failed pull whose READ may still land
  is held back until it cannot, so vLLM never reuses or recomputes into blocks a late write could hit), and
  leases that ended (their requests' blocks may be freed). A request vLLM finished while its pull ran
  (abort) has the pull cancelled; it is reported once its blocks are safe.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

import numpy as np
import torch

from kvconnect.core.config import ConnectorConfig
from kvconnect.core.connector import KVConnector
from kvconnect.core.decode.handle import PullHandle, PullStats
from kvconnect.core.errors import InvalidRequestError, KVConnectError
from kvconnect.core.faults import FaultHooks
from kvconnect.core.plan.groups import GroupedBlocks, tail_pairs
from kvconnect.core.plan.params import KVTransferParams
from kvconnect.core.plan.state import StateSpec
from kvconnect.core.wire.lease_client import release_after_failure
from kvconnect.core.wire.protocol import LeaseState
from kvconnect.vllm.metadata import PullOrder, StepOrders, WorkerHello
from kvconnect.vllm.state import describe_with_state
from kvconnect.vllm.stats import KVConnectStats, failure_reason, timeline

log = logging.getLogger(__name__)

IDLE_WAIT_S = 0.005  # an idle step's wait for a lease or pull to end (it returns as soon as one does)
DRIVE_EVERY_S = 0.0002  # ... during which it drives the connector this often; a GPU cache's pulls: tick after tick,
# yielding the GIL between them (a gather ends in well under a millisecond, and a coarser poll adds its own period
# to the pull). Leases alone are never driven that way: a lease may be held for seconds, and a spinning engine
# thread keeps the process's other threads (the loop thread answering PINs) from the GIL; polled, the wait's own
# ticks answer a PIN within DRIVE_EVERY_S. What each choice measured: results/gpu/pin-trace/.
ANSWER_WAIT_S = 0.0005  # ... while a decode's pulls wait only for the prefill's lease answers, it blocks on their
# sockets this long at most, waking as one comes (a spinning wait reads an answer later: results/gpu/pin-trace/)


@dataclass
class _Load:
    order: PullOrder
    params: KVTransferParams | None
    handle: PullHandle | None  # None: refused before it started (error set)
    error: KVConnectError | None = None
    requested_at: float = 0.0  # wall clock: the worker asked for the pull
    answered: bool = False  # its blocks reported as failed while a given-up READ may still write them


class KVConnectWorker:
    def __init__(
        self,
        config: ConnectorConfig,
        tp_rank: int,
        total_kv_heads: int,
        faults: FaultHooks | None = None,
        failed_requests: bool = False,
        state_groups: tuple[int, ...] = (),
    ) -> None:
        """`failed_requests`: the running vLLM takes failed loads as failed requests (`get_transfer_results`);
        then a hybrid model's failed load is reported so, never as block ids (vLLM refuses those for models of
        several KV cache groups). `state_groups`: the KV cache groups that hold Mamba / linear-attention state."""
        self._state_groups = state_groups
        self._config = config
        self._failed_requests = failed_requests
        self._faults = faults  # (tests only: the vLLM connector never passes any)
        self._tp_rank = tp_rank
        self._total_kv_heads = total_kv_heads
        self.connector: KVConnector | None = None
        self._loads: dict[str, _Load] = {}
        self._load_errors: set[int] = set()
        self._lock = threading.Lock()  # the lease-end callback runs on the connector's loop thread
        self._ended: set[str] = set()  # leases that ended, not yet reported
        self._leased: set[str] = set()  # requests this rank leased blocks for, until reported
        self._seen_finished: set[str] = set()  # ... of which vLLM already told us they finished
        self._stats = KVConnectStats()
        self._changed = threading.Event()  # set when a lease ends or a pull finishes
        self._usable_at: dict[str, float] = {}  # request -> wall clock its pull became usable (loop thread)
        self._idle = False
        self._drive_every_s = DRIVE_EVERY_S  # (0 on a GPU cache: register_kv_caches)

    def register_kv_caches(
        self,
        kv_caches: dict[str, torch.Tensor],
        num_blocks: int,
        block_size: int,
        tp_size: int,
        page: str,
        latent: bool = False,
        state_layers: frozenset[str] = frozenset(),
        state: StateSpec | None = None,
    ) -> None:
        described = describe_with_state(
            kv_caches,
            state_layers,
            state,
            num_blocks=num_blocks,
            block_size=block_size,
            tp_size=tp_size,
            tp_rank=self._tp_rank,
            total_kv_heads=self._total_kv_heads,
            page=page,
            latent=latent,
        )
        self.connector = KVConnector(
            described.cache,
            self._config,
            on_pull_done=self._pull_done,
            on_lease_ended=self._lease_ended,
            faults=self._faults,
        )
        spec = described.cache.spec
        self._drive_every_s = 0.0 if spec.device == "cuda" else DRIVE_EVERY_S
        first = kv_caches[described.layer_names[0]]
        log.info(
            "kvconnect: rank %d registered %d layers (%s, %s, %d blocks of %d tokens, %.1f MiB; vLLM's tensor "
            "%s %s strides %s on %s); side channel port %d",
            self._tp_rank,
            spec.num_layers,
            described.layout,
            spec.kind.value,
            spec.num_blocks,
            spec.block_size,
            spec.cache_bytes / 2**20,
            tuple(first.shape),
            str(first.dtype).removeprefix("torch."),
            tuple(first.stride()),
            first.device,
            self.connector.side_channel_port,
        )

    def get_handshake_metadata(self) -> WorkerHello:
        conn = self._require()
        return WorkerHello(self._tp_rank, conn.side_channel_port, conn.incarnation_id)

    def _require(self) -> KVConnector:
        if self.connector is None:
            raise KVConnectError("kvconnect: the KV caches were not registered")
        return self.connector

    # --- orders ------------------------------------------------------------------------------------

    def bind_connector_metadata(self, orders: StepOrders) -> None:
        conn = self._require()
        self._idle = orders.idle
        for lease in orders.leases:
            self._leased.add(lease.request_id)
            try:
                conn.lease(
                    lease.request_id,
                    lease.block_ids,
                    lease.num_tokens,
                    lease_id=lease.lease_id,
                    prompt_digest=lease.prompt_digest,
                    group_sizes=lease.group_sizes,
                )
            except KVConnectError as e:  # nobody can read it: give the blocks back at once
                log.error("kvconnect: request %s: cannot lease its blocks: %s", lease.request_id, e)
                self._lease_ended(lease.request_id, LeaseState.UNKNOWN)
        for raw in orders.releases:
            self._release(raw)
        if self._tp_rank == 0 and orders.renewals:  # (one rank renews on every prefill rank)
            conn.renew_remote(orders.renewals)
            log.debug("kvconnect: renewing %d queued requests' leases", len(orders.renewals))
        for order in orders.pulls:
            self._start(order)
        if orders.pulls:
            conn.drive()  # post the new pulls now, on this thread (see KVConnector.drive)

    def _release(self, params: KVTransferParams) -> None:
        self._require().release_remote(params)

    def _start(self, order: PullOrder) -> None:
        requested_s = time.monotonic()  # (the pull's stats count from here: its checks below are part of it)
        load = _Load(order, None, None, requested_at=time.time())
        self._loads[order.request_id] = load
        try:
            if order.params is None or order.refused is not None:
                field, reason = order.refused or ("kv_transfer_params", "missing")
                raise InvalidRequestError(field, reason)
            load.params = params = order.params
            if not params.do_remote_prefill or params.remote_block_ids is None:
                raise InvalidRequestError("kv_transfer_params.do_remote_prefill", "must be true to pull")
            if params.remote_num_tokens is not None and params.remote_num_tokens != order.num_prompt_tokens:
                raise InvalidRequestError(
                    "kv_transfer_params.remote_num_tokens",
                    f"the remote blocks hold {params.remote_num_tokens} tokens, the prompt "
                    f"has {order.num_prompt_tokens}",
                )
            field = "kv_transfer_params.remote_block_ids"
            remote = GroupedBlocks.flat(params.remote_block_ids, params.remote_group_sizes, field)
            state_ids = None
            if remote.num_groups == 1:
                # the local prefix cache holds the first tokens: the connector reads the prefill's blocks from the
                # one past them once the handshake said their size (which may differ from ours)
                local, tail, skip = GroupedBlocks.of(order.local_block_ids), None, order.num_local_hit_tokens
            else:  # the local prefix cache filled each group's first blocks: read the tail of the prefill's
                (local, tail), skip = tail_pairs(GroupedBlocks.of(order.local_block_ids), remote, field), 0
                if self._state_groups:  # (a prefill of another TP size splits state blocks apart from the rest)
                    groups = local.groups()
                    state_ids = np.concatenate([groups[g] for g in self._state_groups if g < len(groups)])
            load.handle = self._require().pull(
                params,  # (as the prefill signed them; the connector reads `tail` of their blocks)
                local.ids,  # (an array: the connector checks it as one)
                order.request_id,
                order.prompt_digest,
                driven=True,
                requested_s=requested_s,
                tail=tail,
                skip_tokens=skip,
                state_ids=state_ids,
            )  # (bind_connector_metadata drives right after)
        except KVConnectError as e:
            self._failed(load, e)

    def _failed(self, load: _Load, error: KVConnectError) -> None:
        if load.error is not None:
            return
        load.error = error
        reason = failure_reason(error)
        with self._lock:
            self._stats.count("failed", reason)
        log.warning(
            "kvconnect: request %s: KV load failed (%s: %s); vLLM's kv_load_failure_policy applies",
            load.order.request_id,
            type(error).__name__,
            error,
        )
        if load.params is not None and release_after_failure(error):
            self._require().release_remote(load.params)

    # --- results -----------------------------------------------------------------------------------

    def transfer_results(self, finished_req_ids: set[str]) -> tuple[set[str], set[str], set[str]]:
        """(finished_sending, finished_recving, failed_recving) since the last call."""
        conn = self.connector
        if conn is not None and (self._loads or self._leased):
            conn.drive()
            if self._idle and not finished_req_ids:  # wait a little for one to end, driving it meanwhile
                deadline = time.monotonic() + IDLE_WAIT_S
                every_s = self._drive_every_s if self._loads else DRIVE_EVERY_S
                while not self._changed.is_set() and time.monotonic() < deadline:
                    if not conn.await_answers(ANSWER_WAIT_S):  # (only lease answers awaited: woken as one comes)
                        if self._changed.wait(every_s):
                            break
                        time.sleep(0)  # (lets this process's other threads take the GIL between ticks)
                    conn.drive()  # (a tick that makes a pull usable is reported at once: no GIL handed away first)
        self._changed.clear()
        self._seen_finished |= finished_req_ids & self._leased
        recving, failed = set(), set()
        for rid, load in list(self._loads.items()):
            if rid in finished_req_ids and load.handle is not None and not load.handle.done():
                load.handle.cancel()  # vLLM finished it (abort): stop reading; report once its blocks are safe
            if load.handle is not None and load.error is None:
                try:
                    if not load.handle.poll():
                        continue
                except KVConnectError as e:
                    self._failed(load, e)
            single_group = len(load.order.local_block_ids) == 1
            if load.error is not None and load.handle is not None and not load.handle.settled():
                # A given-up READ may still write into these blocks: the request is not reported finished
                # receiving until it ends. With one KV cache group its blocks are reported invalid now, so
                # vLLM answers the request at the deadline (policy "fail") while it keeps the blocks: a request
                # finished before its receive is reported keeps them until then.
                if single_group and not load.answered:
                    load.answered = True
                    self._load_errors.update(load.order.local_block_ids[0])
                continue
            del self._loads[rid]
            recving.add(rid)
            self._report_timeline(load)
            if load.error is not None:
                failed.add(rid)
                if (single_group or not self._failed_requests) and not load.answered:
                    self._load_errors.update(b for group in load.order.local_block_ids for b in group)
        with self._lock:
            sending = self._ended & self._seen_finished
            self._ended -= sending
        self._seen_finished -= sending
        self._leased -= sending
        return sending, recving, failed

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def stats(self) -> KVConnectStats | None:
        with self._lock:
            if self._stats.is_empty():
                return None
            out, self._stats = self._stats, KVConnectStats()
        return out

    def _report_timeline(self, load: _Load) -> None:
        """The pull's stages into the stats, and one DEBUG line (ms from the request's arrival at vLLM)."""
        with self._lock:
            usable = self._usable_at.pop(load.order.request_id, 0.0)
        if load.error is not None or load.handle is None or not usable:
            return
        stats, now, arrival = load.handle.stats, time.time(), load.order.arrival_time
        stages = timeline(arrival, load.requested_at, stats, usable, now)
        with self._lock:
            self._stats.record_timeline(stages)
        if log.isEnabledFor(logging.DEBUG):
            start = arrival or load.requested_at
            marks, t = [], load.requested_at - start
            marked = (("picked up", "pull_to_pickup_s"), ("posted", "pickup_to_post_s"), ("read", "read_s"))
            for name, key in (*marked, ("usable", "read_to_usable_s")):
                t += stages[key]
                marks.append(f"{name} {1e3 * t:.2f}")
            parts = (stats.validate_s, stats.pin_s, stats.launch_s, stats.post_s)
            held = (
                "held on the lease board" if stats.on_board else f"the PIN's answer after {1e3 * stats.pin_rtt_s:.3f}"
            )
            log.debug(
                "kvconnect: request %s timeline, ms from %s: pull %.2f, %s, reported %.2f "
                "(post: checks %.3f, pin %.3f, launch %.3f of %.3f; %s)",
                load.order.request_id,
                "arrival" if arrival else "the pull",
                1e3 * (load.requested_at - start),
                ", ".join(marks),
                1e3 * (now - start),
                *(1e3 * x for x in parts),
                held,
            )

    def _pull_done(self, stats: PullStats, error: KVConnectError | None) -> None:  # (loop thread)
        if error is None:
            with self._lock:
                self._stats.record_pull(stats)
                self._usable_at[stats.request_id] = time.time()
        self._changed.set()

    def _lease_ended(self, request_id: str, state: LeaseState) -> None:  # (loop thread, or this one)
        with self._lock:
            self._ended.add(request_id)
            self._stats.count("leases_ended", state.value)
        self._changed.set()

    def close(self) -> None:
        if self.connector is not None:
            self.connector.close()
            self.connector = None
