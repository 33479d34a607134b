"""The engine-facing halves of the connector: a lease keeper for prefill, a pull loader for decode.

Token accounting (shared by both sides, so disaggregated equals aggregated): the engine computes a
prompt of n tokens as a prefill of tokens [0, n-1) followed by a decode step on token n-1. So the
decode side needs the KV of the first n-1 tokens, which live in `blocks_for(n - 1)` blocks; it
recomputes the last prompt token itself. A one-token prompt has nothing to transfer.

Failed pulls: the loader tells the prefill side to free the lease at once (unless it already ended),
refuses to recompute a request that was invalid (a 400 stays a 400), and holds on to blocks an
abandoned READ may still write into ("quarantine", see `transfer.AbandonedReads`) until that READ ends;
its owner is told at once so the request itself need not wait.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from kvconnect.core.config import FailurePolicy
from kvconnect.core.connector import KVConnector
from kvconnect.core.decode.handle import PullHandle
from kvconnect.core.errors import InvalidRequestError, KVConnectError
from kvconnect.core.plan.params import KVTransferParams
from kvconnect.core.wire.lease_client import release_after_failure

log = logging.getLogger(__name__)


def blocks_to_transfer(num_prompt_tokens: int, block_size: int) -> int:
    return -(-(num_prompt_tokens - 1) // block_size) if num_prompt_tokens > 1 else 0


def check_remote_blocks(params: KVTransferParams, num_prompt_tokens: int, block_size: int) -> None:
    """InvalidRequestError unless the remote blocks are what this prompt needs.

    With `remote_num_tokens` (what our prefill side sends: the tokens its blocks hold) the remote block size
    may differ from ours, so the count is checked against the remote size when the pull is planned."""
    ids = params.remote_block_ids or []
    field = "kv_transfer_params.remote_block_ids"
    if any(b < 0 for b in ids):
        raise InvalidRequestError(field, f"negative block ids {[b for b in ids if b < 0][:8]}")
    if len(set(ids)) != len(ids):
        raise InvalidRequestError(field, "duplicated block ids")
    if params.remote_num_tokens is not None:
        if params.remote_num_tokens != num_prompt_tokens - 1:
            raise InvalidRequestError(
                "kv_transfer_params.remote_num_tokens",
                f"the blocks hold {params.remote_num_tokens} tokens, but a {num_prompt_tokens}-"
                f"token prompt needs the KV of {num_prompt_tokens - 1}",
            )
        return
    need = blocks_to_transfer(num_prompt_tokens, block_size)
    have = len(ids)
    if have != need:
        raise InvalidRequestError(
            field,
            f"{have} blocks given, but a {num_prompt_tokens}-token prompt needs {need} (block size {block_size})",
        )


class LeaseKeeper:
    """KVKeeper: lease a finished prefill's prompt blocks, free the rest, remember the params."""

    def __init__(
        self,
        connector: KVConnector,
        free_blocks: Callable[[list[int]], None],
        block_size: int,
        prompt_digest: bytes = b"",
    ) -> None:
        """`prompt_digest` (`params.prompt_digest` of the prompt) binds the lease to the prompt it was computed for."""
        self._connector = connector
        self._free = free_blocks
        self._block_size = block_size
        self._prompt_digest = prompt_digest
        self.params: KVTransferParams | None = None
        self.error: KVConnectError | None = None

    def keep(self, request_id: str, block_ids: list[int], num_prompt_tokens: int) -> bool:
        k = blocks_to_transfer(num_prompt_tokens, self._block_size)
        if k == 0:
            return False
        try:
            self.params = self._connector.lease(
                request_id, block_ids[:k], num_prompt_tokens - 1, prompt_digest=self._prompt_digest
            )
        except KVConnectError as e:
            log.error("request %s: cannot lease its blocks: %s", request_id, e)
            self.error = e
            return False
        if block_ids[k:]:
            self._free(block_ids[k:])
        return True


# pull-level names of fields that come from the request's kv_transfer_params
_REQUEST_FIELDS = {"remote_block_ids": "kv_transfer_params.remote_block_ids"}

# on_failed(request_id, error, quarantined): called once per failed pull, on the engine thread
FailureCallback = Callable[[str, KVConnectError, bool], None]


class PullLoader:
    """KVLoader: pull the remote prompt blocks into the blocks the engine allocated."""

    def __init__(
        self,
        connector: KVConnector,
        params: KVTransferParams,
        policy: FailurePolicy,
        block_size: int,
        on_failed: FailureCallback | None = None,
        prompt_digest: bytes = b"",
    ) -> None:
        """`prompt_digest`: of the prompt this decode serves (a prefill's lease bound to another refuses it)."""
        self._connector = connector
        self._prompt_digest = prompt_digest
        self._params = params
        self._policy = policy
        self._block_size = block_size
        self._on_failed = on_failed
        self._request_id = ""
        self.handle: PullHandle | None = None
        self.error: KVConnectError | None = None
        self.quarantined = False  # failed, but an abandoned READ may still land in its blocks

    @property
    def policy(self) -> FailurePolicy:
        """The configured policy, except that an invalid request is refused, never recomputed."""
        return FailurePolicy.FAIL if isinstance(self.error, InvalidRequestError) else self._policy

    def start(self, request_id: str, block_ids: list[int], num_prompt_tokens: int) -> PullLoader:
        self._request_id = request_id
        try:
            check_remote_blocks(self._params, num_prompt_tokens, self._block_size)
            k = blocks_to_transfer(num_prompt_tokens, self._block_size)
            self.handle = self._connector.pull(self._params, block_ids[:k], request_id, self._prompt_digest)
        except KVConnectError as e:
            raise self._failed(e, quarantined=False) from None
        return self

    def poll(self) -> bool:
        """Whether the KV is loaded (False while in flight, or failed with blocks a READ may still write into);
        raises the load's error once its blocks are safe."""
        assert self.handle is not None
        try:
            return self.handle.poll()
        except KVConnectError as e:
            if not self.handle.settled():  # keep the blocks (the engine holds a loading request's) for now
                if not self.quarantined:
                    self.quarantined = True
                    self._failed(e, quarantined=True)
                return False
            if self.error is None:
                self._failed(e, quarantined=False)
            assert self.error is not None
            raise self.error from None

    def _failed(self, error: KVConnectError, quarantined: bool) -> KVConnectError:
        field = getattr(error, "field", None)
        if isinstance(error, InvalidRequestError) and field in _REQUEST_FIELDS:
            error = InvalidRequestError(_REQUEST_FIELDS[field], error.reason)
        self.error = error
        if release_after_failure(error):
            try:  # nobody will read this lease now: let the prefill side free it at once
                self._connector.release_remote(self._params)
            except KVConnectError as e:
                log.debug("request %s: lease release not sent: %s", self._request_id, e)
        if self._on_failed is not None:
            try:
                self._on_failed(self._request_id, error, quarantined)
            except Exception:
                log.exception("request %s: on_failed callback raised", self._request_id)
        return error

    def abandon(self) -> None:
        """The request went away: stop the pull, or free the remote lease if it never started."""
        if self.handle is not None:
            self.handle.cancel()
        else:
            self._connector.release_remote(self._params)
