"""One lease as the prefill's lease table keeps it, how its id is drawn, and how it holds its blocks (the
table itself, and the rules it keeps: `lease.py`)."""

from __future__ import annotations

import hmac
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from kvconnect.core.plan.groups import GroupedBlocks
from kvconnect.core.wire.protocol import LeaseState

LEASE_ID_BYTES = 18  # random bytes in a lease id (24 url-safe characters)
PROMPT_REFUSED = "prompt:"  # how a refusal for another prompt starts (the decode reads it: decode/confirm.py)


def grouped(ids: Sequence[int], groups: tuple[int, ...]) -> GroupedBlocks:
    return GroupedBlocks(np.asarray(ids, dtype=np.int64), groups or (len(ids),))


def new_lease_id() -> str:
    """A fresh, unguessable lease id."""
    return secrets.token_urlsafe(LEASE_ID_BYTES)


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
    groups: tuple[int, ...] = ()  # blocks per KV cache group, `block_ids` being the groups in turn (): one group

    @property
    def request_id(self) -> str:
        """What logs call this lease: its label, else the start of its id (the id itself is a secret)."""
        return self.label or self.lease_id[:8]

    def token_ok(self, reader: int, token: bytes) -> bool:
        """Whether `token` is the one that claimed `reader` (no claim: False)."""
        owner = self.tokens.get(reader)
        return owner is not None and hmac.compare_digest(owner, token)
