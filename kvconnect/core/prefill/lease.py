"""One lease as the prefill's lease table keeps it (the table and the rules it keeps: `table.py`)."""

from __future__ import annotations

import hmac
from collections.abc import Callable
from dataclasses import dataclass, field

from kvconnect.core.wire.logs import loggable
from kvconnect.core.wire.protocol import LeaseState


@dataclass
class Lease:
    lease_id: str
    block_ids: tuple[int, ...]
    granted_s: float
    expires_s: float
    label: str = ""  # the request's own id (logs, callbacks); never a key
    state: LeaseState = LeaseState.HELD
    ended_s: float = 0.0
    readers_done: frozenset[int] = frozenset()  # decode ranks done reading, when several read it
    pins: dict[int, float] = field(default_factory=dict)  # reader -> pinned until (clock time)
    tokens: dict[int, bytes] = field(default_factory=dict)  # reader -> the read token that claimed it
    deferred: bool = False  # ended while pinned: blocks go back when the last pin ends
    deferred_scrub: Callable[[list[int]], None] | None = None
    content: tuple[int, ...] = ()  # per block, its content sum at grant (kv_digest; digest.py), or nothing
    prompt: bytes = b""  # the digest of the prompt whose KV the blocks hold (b"": not bound)
    # blocks per KV cache group, `block_ids` being the groups in turn (): one group
    groups: tuple[int, ...] = ()
    renewals: int = 0  # renewals a decode sent while its request waited
    active_s: float = 0.0  # its grant or its last renewal, whichever came later (the bound evicts by it)

    @property
    def request_id(self) -> str:
        """What logs call this lease: its label, else the start of its id (the id itself is a secret)."""
        return loggable(self.label) if self.label else self.lease_id[:8]

    def token_ok(self, reader: int, token: bytes) -> bool:
        """Whether `token` is the one that claimed `reader` (no claim: False)."""
        owner = self.tokens.get(reader)
        return owner is not None and hmac.compare_digest(owner, token)

    def ended_answer(self, reader: int, token: bytes) -> LeaseState:
        """What this ended lease tells `reader`: COMPLETED only to a token that read under it."""
        if self.state is LeaseState.COMPLETED and not self.token_ok(reader, token):
            return LeaseState.CONSUMED
        return self.state
