"""One lease as the prefill's lease table keeps it, how its id is drawn, and how it holds its blocks (the
table itself, and the rules it keeps: `lease.py`)."""

from __future__ import annotations

import heapq
import hmac
import secrets
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from kvconnect.core.plan.groups import GroupedBlocks
from kvconnect.core.wire.protocol import LeaseState, blocks_digest

MAX_EARLY_RELEASES = 4096  # releases of leases not granted yet that are remembered at once (oldest dropped)
MAX_EARLY_ID = 256  # longer request ids are not remembered (a peer's message may be 4 MiB of id)
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

    def ended_answer(self, reader: int, token: bytes) -> LeaseState:
        """What this ended lease tells `reader`: COMPLETED only to a token that read under it."""
        if self.state is LeaseState.COMPLETED and not self.token_ok(reader, token):
            return LeaseState.CONSUMED
        return self.state


def let_go(holders: dict[int, int], block_ids: Sequence[int]) -> list[int]:
    """Drop one lease's hold on `block_ids` (`holders`: leases per block); returns those nobody holds now."""
    freed = []
    for b in block_ids:
        left = holders.get(b, 0) - 1
        if left > 0:
            holders[b] = left
        else:
            holders.pop(b, None)
            freed.append(b)
    return freed


def next_due(lease: Lease, tombstone_s: float, now_s: float) -> float:
    """When the lease table's `expire` must look at `lease` next: a held lease at its TTL, or at its first pin's
    deadline while pinned (a TTL that ran out under a pin matters only once the pins go: their deadlines, or the
    unpin, which reschedules); an ended one still pinned at that deadline; else when its tombstone goes."""
    if lease.pins:
        first_pin = min(lease.pins.values())
        held = lease.state is LeaseState.HELD and lease.expires_s > now_s
        return min(first_pin, lease.expires_s) if held else first_pin
    if lease.state is LeaseState.HELD:
        return lease.expires_s
    return lease.ended_s + tombstone_s


class DueTimes:
    """Lease ids by when something of theirs is due, a heap. One lease may have several entries (each change
    adds one): an entry that finds nothing to do is harmless, the table reschedules the lease after looking."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, str]] = []

    def push(self, lease: Lease, tombstone_s: float, now_s: float) -> None:
        heapq.heappush(self._heap, (next_due(lease, tombstone_s, now_s), lease.lease_id))

    def pop_due(self, now_s: float) -> list[str]:
        """The ids with an entry due by `now_s`, each once, in due order (their entries removed)."""
        due: dict[str, None] = {}
        while self._heap and self._heap[0][0] <= now_s:
            due[heapq.heappop(self._heap)[1]] = None
        return list(due)


class EarlyReleases:
    """RELEASEs of leases not granted yet, remembered until their grace ends (an engine that grants a little
    after its params left): bounded whatever a peer sends (`MAX_EARLY_RELEASES`, ids of `MAX_EARLY_ID` at
    most), each kept as a count and a digest of the blocks it named. Callers hold the table's lock."""

    def __init__(self) -> None:
        self._by_id: dict[str, tuple[float, int, bytes]] = {}  # lease id -> (forget at, blocks named, digest)

    def remember(self, lease_id: str, block_ids: Sequence[int], until_s: float) -> None:
        if len(lease_id) > MAX_EARLY_ID or not block_ids:
            return
        self._by_id.pop(lease_id, None)  # (re-inserted last: the oldest goes first)
        if len(self._by_id) >= MAX_EARLY_RELEASES:
            del self._by_id[next(iter(self._by_id))]
        self._by_id[lease_id] = (until_s, len(block_ids), blocks_digest(block_ids))

    def take(self, lease_id: str, block_ids: Sequence[int], now_s: float) -> bool:
        """Whether a release of a suffix of `block_ids` came before this grant, within its grace."""
        early = self._by_id.pop(lease_id, None)
        if early is None or early[0] <= now_s or not 0 < early[1] <= len(block_ids):
            return False
        return blocks_digest(block_ids[len(block_ids) - early[1] :]) == early[2]

    def forget_before(self, now_s: float) -> None:
        """Forget the releases whose grace ended: the oldest first, stopping at the first still in its grace
        (every tick calls this: it never walks the others; one of a clock that went back goes later)."""
        while self._by_id:
            lease_id = next(iter(self._by_id))
            if self._by_id[lease_id][0] > now_s:
                return
            del self._by_id[lease_id]


def room_for(
    ids: tuple[int, ...], leases: Iterable[Lease], holders: dict[int, int], max_blocks: int | None
) -> list[Lease]:
    """The oldest leases nobody has pinned that end so that, with a grant of `ids`, the leases hold at most
    `max_blocks` (`holders`: leases per block now). A grant is never refused: the request is the engine's to
    serve. Pinned leases are being read and stay, so what they and the grant hold may exceed the bound."""
    held = len(holders) + sum(1 for b in ids if b not in holders)
    if max_blocks is None or held <= max_blocks:
        return []
    left, victims = dict(holders), []
    for lease in leases:  # (oldest first)
        if held <= max_blocks:
            break
        if lease.state is LeaseState.HELD and not lease.pins:
            victims.append(lease)
            for b in lease.block_ids:
                left[b] -= 1
                if left[b] == 0 and b not in ids:  # (a block the new lease holds too stays held)
                    held -= 1
    return victims
