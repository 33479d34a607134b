"""The engine's prefill/decode hooks, as Protocols the connector implements.

`KVKeeper` (prefill side, vLLM's do_remote_decode): when a request finishes with "stop" or "length",
the engine offers its blocks to `keep(...)` instead of freeing them. True hands ownership over: the
caller must later call `engine.allocator.free(block_ids)` (thread-safe) itself. False, or an exception,
means the engine frees them as usual. Requests that end in "abort" or "error" are never offered.

`KVLoader` (decode side, do_remote_prefill): when the request is admitted the engine allocates blocks
for the whole prompt and calls `start(...)`; every scheduler step it calls `poll()` on the handle:
None (or False) while loading, True once the KV of prompt tokens [0, n-1) is in those blocks, or an
exception (a kvconnect error) on failure. On failure, `FailurePolicy.RECOMPUTE` makes the engine compute
the prompt itself; any other policy finishes the request with "error". An aborted request's blocks are
only freed once its handle has stopped writing (poll returned or raised).

Both hooks run on the engine thread, between steps: they must return quickly and never block.
"""

from __future__ import annotations

from typing import Protocol

from kvconnect.core.config import FailurePolicy


class KVLoadHandle(Protocol):
    def poll(self) -> bool | None:
        """None while in flight; True when done; raise a kvconnect error when it failed."""


class KVLoader(Protocol):
    @property
    def policy(self) -> FailurePolicy:
        """What the engine does when the load fails."""

    def start(self, request_id: str, block_ids: list[int], num_prompt_tokens: int) -> KVLoadHandle:
        """Begin filling `block_ids` (they cover all `num_prompt_tokens`) with the KV of tokens [0, n-1)."""


class KVKeeper(Protocol):
    def keep(self, request_id: str, block_ids: list[int], num_prompt_tokens: int) -> bool:
        """Take ownership of a finished request's blocks (all of them, prompt blocks first)."""
