"""Scheduler side of the plug-in (vLLM's EngineCore process): which requests load, which lease, and the
orders each step sends to the workers.

Prefill (`do_remote_decode`): when a request finishes by length or stop, `request_finished` keeps its
blocks (vLLM frees them once every worker reports the request in `finished_sending`, i.e. once its lease
ended), orders the workers to lease them, and returns the vLLM-named `kv_transfer_params`. The workers
grant the lease as the next step's orders are bound, before that step's forward.

Decode (`do_remote_prefill`): the prompt's KV is loaded asynchronously (the request waits in
WAITING_FOR_REMOTE_KVS while vLLM schedules others), into the blocks the local prefix cache did not
already fill; one pull order per request. A request aborted before it was scheduled, or one whose whole
prompt the local prefix cache holds, gets its remote lease released instead. The client's params are
parsed here once; invalid ones never raise here (the scheduler must not): the order carries the refusal,
the worker fails the load naming the field, and vLLM's own failure policy applies.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import msgspec
from vllm.v1.request import RequestStatus

from kvconnect.core.errors import InvalidRequestError
from kvconnect.core.plan.params import KVTransferParams, lease_params, parse_kv_transfer_params, prompt_digest
from kvconnect.core.prefill.record import new_lease_id
from kvconnect.vllm.metadata import LeaseOrder, PullOrder, StepOrders, WorkerHello
from kvconnect.vllm.settings import VllmSettings

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

_LEASED_ENDS = (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)


def _prompt_digest(request: Request) -> bytes:
    """The digest binding a lease to the request's prompt and cache salt (b"": a prompt without token ids)."""
    token_ids = getattr(request, "prompt_token_ids", None)
    if token_ids is None:
        return b""
    return prompt_digest(token_ids, getattr(request, "cache_salt", None))


def _parsed(raw: dict[str, Any]) -> tuple[KVTransferParams | None, tuple[str, str] | None]:
    """The client's params, or the (field, reason) they are refused for: the scheduler must not raise."""
    try:
        return parse_kv_transfer_params(raw), None
    except InvalidRequestError as e:
        return None, (e.field, e.reason)


class SchedulerSide:
    def __init__(self, settings: VllmSettings) -> None:
        self._settings = settings
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

    # --- decode ------------------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens to load from the remote prefill (asynchronously), beyond the local prefix-cache hit."""
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill") or not self._may("do_remote_prefill", request):
            return 0, False
        count = request.num_prompt_tokens - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill") or self._settings.role == "kv_producer":
            return  # (a producer's refusal was logged by get_num_new_matched_tokens)
        parsed, refused = _parsed(params)
        params["do_remote_prefill"] = False  # one load per request (this is called again once it is scheduled)
        if num_external_tokens > 0:
            local = [int(b) for b in blocks.get_unhashed_block_ids()]
            self._orders.pulls.append(
                PullOrder(
                    request.request_id,
                    parsed,
                    local,
                    request.num_prompt_tokens,
                    request.num_prompt_tokens - num_external_tokens,
                    refused,
                    _prompt_digest(request),
                )
            )
        elif parsed is not None:  # the local prefix cache holds the whole prompt: nothing to read
            self._orders.releases.append(parsed)

    # --- both --------------------------------------------------------------------------------------

    def build_connector_meta(self, num_scheduled_tokens: int) -> StepOrders:
        orders, self._orders = self._orders, StepOrders()
        orders.idle = num_scheduled_tokens == 0 and not (orders.leases or orders.pulls or orders.releases)
        return orders

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        params = request.kv_transfer_params
        if not params:
            return False, None
        if params.get("do_remote_prefill") and self._settings.role != "kv_producer":  # aborted before scheduled:
            parsed, _ = _parsed(params)  # free the prefill's blocks now
            if parsed is not None:  # (invalid params name no lease we could release)
                self._orders.releases.append(parsed)
            params["do_remote_prefill"] = False
            return False, None
        if not params.get("do_remote_decode") or request.status not in _LEASED_ENDS or not block_ids:
            return False, None
        if not self._may("do_remote_decode", request):
            return False, None
        hello = self._hello.get(0)
        config = self._settings.config
        ids = [int(b) for b in block_ids]
        num_tokens = int(request.num_computed_tokens)
        lease_id = new_lease_id()
        self._orders.leases.append(LeaseOrder(request.request_id, ids, num_tokens, lease_id, _prompt_digest(request)))
        port = hello.side_channel_port if hello is not None else config.side_channel_port
        return True, msgspec.to_builtins(
            lease_params(
                engine_id=config.engine_id,
                host=config.advertise_host,
                base_port=port,
                tp_size=self._settings.tp_size,
                incarnation_id=hello.incarnation_id if hello is not None else None,
                request_id=request.request_id,
                lease_id=lease_id,
                block_ids=ids,
                num_tokens=num_tokens,
            )
        )
