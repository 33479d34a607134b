"""Scheduler side of the plug-in (vLLM's EngineCore process): which requests load, which lease, and the
orders each step sends to the workers.

Prefill (`do_remote_decode`): when a request finishes by length or stop, `request_finished` keeps its
blocks (vLLM frees them once every worker reports the request in `finished_sending`, i.e. once its lease
ended), orders the workers to lease them, and returns the vLLM-named `kv_transfer_params`. The workers
grant the lease as the next step's orders are bound, before that step's forward.

Decode (`do_remote_prefill`): while a request waits in the queue (vLLM looks at it only once a run slot is
free), its lease is renewed every `lease_renew_s`, so a queue longer than the prefill's `lease_ttl_s` loses no
lease (the prefill bounds renewals by its `lease_max_s`). Once scheduled, the prompt's KV is loaded
asynchronously (the request waits in WAITING_FOR_REMOTE_KVS while vLLM schedules others), into the blocks the
local prefix cache did not already fill; one pull order per request. A request aborted before it was
scheduled, or one whose whole prompt the local prefix cache holds, gets its remote lease released instead.
The client's params are parsed here once; invalid ones never raise here (the scheduler must not): the order
carries the refusal, the worker fails the load naming the field, and vLLM's own failure policy applies.

A model with Mamba / linear-attention state (`groups.py`) cannot rewind its state by a token: its prefill
computes all but the prompt's last token (`on_new_request` shortens the prompt, as NixlConnector does), the
lease and the prompt digest cover those tokens, and the decode loads them and computes the last one itself.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec
from vllm.v1.request import RequestStatus

from kvconnect.core.errors import InvalidRequestError
from kvconnect.core.plan.groups import GroupedBlocks
from kvconnect.core.plan.params import KVTransferParams, lease_params, new_lease_id, parse_kv_transfer_params
from kvconnect.core.plan.signing import params_expiry_ms, sign_params
from kvconnect.core.wire.protocol import PROTOCOL_VERSION
from kvconnect.vllm.binding import prompt_binding
from kvconnect.vllm.groups import NULL_BLOCK_ID, GroupMove, backoff
from kvconnect.vllm.metadata import LeaseOrder, PullOrder, StepOrders, WorkerHello
from kvconnect.vllm.settings import VllmSettings

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

_LEASED_ENDS = (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)


def _unhashed(blocks: KVCacheBlocks) -> list[list[int]]:
    """Per KV cache group, the blocks allocated for the request that the local prefix cache did not fill
    (null placeholders of a sliding window dropped)."""
    if hasattr(blocks, "get_unhashed_block_ids_all_groups"):
        groups = blocks.get_unhashed_block_ids_all_groups()
    else:  # (vLLM 0.26: the same, read from its per-group block lists)
        groups = [[b.block_id for b in group if getattr(b, "block_hash", None) is None] for group in blocks.blocks]
    return [[int(b) for b in g if int(b) != NULL_BLOCK_ID] for g in groups]


def _shorten(request: Request, backoff: int) -> bool:
    """Drop the prompt's last `backoff` tokens from a prefill leg (never twice, never below one token)."""
    token_ids = getattr(request, "prompt_token_ids", None)
    if not backoff or token_ids is None or request.num_prompt_tokens <= backoff:
        return False
    del token_ids[-backoff:]
    del request._all_token_ids[-backoff:]
    request.num_prompt_tokens -= backoff
    request.max_tokens = 1
    return True


def _parsed(raw: dict[str, Any]) -> tuple[KVTransferParams | None, tuple[str, str] | None]:
    """The client's params, or the (field, reason) they are refused for: the scheduler must not raise."""
    try:
        return parse_kv_transfer_params(raw), None
    except InvalidRequestError as e:
        return None, (e.field, e.reason)


@dataclass
class _Queued:
    """A decode leg waiting in the queue: its lease is renewed at `due_s`."""

    params: KVTransferParams
    binding: bytes  # its prompt's (a renewal of a lease bound to another prompt is refused)
    due_s: float


class KVConnectScheduler:
    def __init__(
        self,
        settings: VllmSettings,
        moves: tuple[GroupMove, ...] = (GroupMove("FullAttentionSpec"),),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._settings = settings
        self._clock = clock
        self._queued: dict[str, _Queued] = {}  # decode: requests waiting to be scheduled, by request id
        self._next_look = 0.0  # when `_renewals` looks at them next
        self._moves = moves  # per KV cache group, which of its blocks move (groups.py)
        self._backoff = backoff(moves)  # prompt tokens a prefill leaves to the decode (a model with state)
        self._shortened: set[str] = set()  # prefill legs whose prompt on_new_request shortened
        self._orders = StepOrders()
        self._hello: dict[int, WorkerHello] = {}  # by TP rank
        self._refusals = 0  # requests that asked for what this engine's kv_role does not do

    def _may(self, what: str, request: Request) -> bool:
        """Whether this engine's kv_role lets a client ask it for `what`: a kv_consumer leases nothing for a
        remote decode (its blocks are its own requests'), a kv_producer pulls from no other prefill."""
        refused = {"do_remote_decode": "kv_consumer", "do_remote_prefill": "kv_producer"}[what]
        if self._settings.role != refused:
            return True
        if self._refusals < 3 or self._refusals % 1000 == 0:
            log.warning(
                "kvconnect: request %r asks a %s for %s; ignored (served as a plain request)",
                str(request.request_id)[:64],
                refused,
                what,
            )
        self._refusals += 1
        return False

    def set_xfer_handshake_metadata(self, hello: dict[Any, Any]) -> None:
        """The workers' start-up hellos, keyed by (pp_rank, tp_rank) or tp_rank."""
        for value in hello.values():
            if isinstance(value, WorkerHello):
                self._hello[value.tp_rank] = value
        ports = {rank: h.side_channel_port for rank, h in sorted(self._hello.items())}
        log.info("kvconnect: workers' side channels %s", ports)

    # --- prefill -----------------------------------------------------------------------------------

    def on_new_request(self, request: Request) -> None:
        """A decode leg's lease is renewed while the request waits (`_queue`). A prefill leg of a model with state
        computes all but the prompt's last `backoff` tokens: the state the decode pulls must be the one before the
        token it computes itself."""
        params = request.kv_transfer_params
        if params and params.get("do_remote_prefill"):
            self._queue(request)
        if not self._backoff or not params or not params.get("do_remote_decode"):
            return
        if self._settings.role == "kv_consumer":  # (it leases nothing: request_finished logs the refusal)
            return
        if request.request_id not in self._shortened and _shorten(request, self._backoff):
            self._shortened.add(request.request_id)

    # --- decode ------------------------------------------------------------------------------------

    def _queue(self, request: Request) -> None:
        """Renew this decode leg's lease while it waits (not invalid params: the load fails on them anyway)."""
        period = self._settings.config.lease_renew_s
        if self._settings.role == "kv_producer" or period <= 0:
            return
        parsed, refused = _parsed(request.kv_transfer_params or {})
        if parsed is not None and refused is None and parsed.remote_lease_id:
            due = self._clock() + period
            self._queued[request.request_id] = _Queued(parsed, prompt_binding(request, self._backoff), due)

    def _renewals(self) -> list[tuple[KVTransferParams, bytes]]:
        """The queued requests' leases due for renewal: each every `lease_renew_s` from when it arrived (a
        request scheduled at once never renews). The queue is looked at four times a period at most."""
        now, period = self._clock(), self._settings.config.lease_renew_s
        if not self._queued or now < self._next_look:
            return []
        self._next_look = now + period / 4
        due = [q for q in self._queued.values() if q.due_s <= now]
        for q in due:
            q.due_s = now + period
        return [(q.params, q.binding) for q in due]

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens to load from the remote prefill (asynchronously), beyond the local prefix-cache hit (a model
        with state: all but the last `backoff` prompt tokens, which the decode computes from the pulled state)."""
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill") or not self._may("do_remote_prefill", request):
            return 0, False
        count = request.num_prompt_tokens - self._backoff - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill") or self._settings.role == "kv_producer":
            return  # (a producer's refusal was logged by get_num_new_matched_tokens)
        self._queued.pop(request.request_id, None)  # scheduled: the pull's PIN keeps the lease from here
        parsed, refused = _parsed(params)
        params["do_remote_prefill"] = False  # one load per request (this is called again once it is scheduled)
        if num_external_tokens > 0:
            local = _unhashed(blocks)
            if len(local) == len(self._moves):  # (a state group receives into its state block only)
                local = [move.trim(g) if move.state else g for move, g in zip(self._moves, local, strict=True)]
            if len(local) != len(self._moves) and refused is None:  # (the worker fails the load naming it)
                refused = ("kv_transfer_params", f"{len(local)} KV cache groups allocated, {len(self._moves)} known")
            self._orders.pulls.append(
                PullOrder(
                    request.request_id,
                    parsed,
                    local,
                    request.num_prompt_tokens - self._backoff,
                    request.num_prompt_tokens - self._backoff - num_external_tokens,
                    refused,
                    prompt_binding(request, self._backoff),
                    float(getattr(request, "arrival_time", 0.0) or 0.0),
                )
            )
        elif parsed is not None:  # the local prefix cache holds the whole prompt: nothing to read
            self._orders.releases.append(parsed)

    # --- both --------------------------------------------------------------------------------------

    def build_connector_meta(self, num_scheduled_tokens: int) -> StepOrders:
        orders, self._orders = self._orders, StepOrders()
        orders.renewals = self._renewals()
        # (a step that only starts pulls is idle too: its workers then wait for them right away, instead of a
        # step later, after a round of vLLM's own scheduling, which is most of a short pull's time)
        orders.idle = num_scheduled_tokens == 0
        return orders

    def request_finished(
        self, request: Request, block_ids: Sequence[Sequence[int]]
    ) -> tuple[bool, dict[str, Any] | None]:
        """`block_ids`: per KV cache group (one list for a model of one group)."""
        params = request.kv_transfer_params
        self._shortened.discard(request.request_id)
        self._queued.pop(request.request_id, None)
        if not params:
            return False, None
        if params.get("do_remote_prefill") and self._settings.role != "kv_producer":  # aborted before scheduled:
            parsed, _ = _parsed(params)  # free the prefill's blocks now
            if parsed is not None:  # (invalid params name no lease we could release)
                self._orders.releases.append(parsed)
            params["do_remote_prefill"] = False
            return False, None
        if not params.get("do_remote_decode") or request.status not in _LEASED_ENDS:
            return False, None
        # (prompt embeddings: the leg was not shortened, so its state covers the last token too; the decode
        # then computes the whole prompt itself)
        if self._backoff and getattr(request, "prompt_token_ids", None) is None:
            log.warning(
                "kvconnect: request %r has no prompt token ids; a model with state leases nothing for it",
                str(request.request_id)[:64],
            )
            return False, None
        if len(block_ids) != len(self._moves):  # (never seen: vLLM names the groups it was configured with)
            log.error(
                "kvconnect: request %r: %d KV cache groups, %d known",
                request.request_id,
                len(block_ids),
                len(self._moves),
            )
            return False, None
        groups = GroupedBlocks.of([move.trim(g) for move, g in zip(self._moves, block_ids, strict=True)])
        if not groups.ids.size or not self._may("do_remote_decode", request):
            return False, None
        binding = prompt_binding(request)
        if not binding:  # (what its KV was computed from cannot be named: a lease of it would bind nothing)
            log.warning(
                "kvconnect: request %r: its prompt cannot be bound; nothing leased", str(request.request_id)[:64]
            )
            return False, None
        hello = self._hello.get(0)
        config = self._settings.config
        ids = groups.ids.tolist()
        num_tokens = int(request.num_computed_tokens)
        lease_id = new_lease_id()
        self._orders.leases.append(LeaseOrder(request.request_id, ids, num_tokens, lease_id, binding, groups.sizes))
        port = hello.side_channel_port if hello is not None else config.side_channel_port
        granted = lease_params(
            engine_id=config.engine_id,
            host=config.advertise_host,
            base_port=port,
            tp_size=self._settings.tp_size,
            incarnation_id=hello.incarnation_id if hello is not None else None,
            request_id=request.request_id,
            lease_id=lease_id,
            block_ids=ids,
            num_tokens=num_tokens,
            group_sizes=groups.wire_sizes(),
            prompt=binding,
            wire_version=PROTOCOL_VERSION,
        )
        signed = sign_params(granted, config.keyring, params_expiry_ms(config.lease_max_s))
        return True, msgspec.to_builtins(signed)
