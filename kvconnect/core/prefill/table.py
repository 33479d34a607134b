"""The lease table (sans-I/O, injected clock): a finished request's blocks held for the decode that will read them,
by the rules of the prefill half (the package docstring, `kvconnect.core.prefill`)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Sequence

from kvconnect.core.errors import LeaseError
from kvconnect.core.prefill import checks
from kvconnect.core.prefill.due import DueTimes
from kvconnect.core.prefill.early import EarlyReleases
from kvconnect.core.prefill.holds import Holds
from kvconnect.core.prefill.lease import Lease
from kvconnect.core.wire.protocol import LeaseState

log = logging.getLogger(__name__)


class LeaseTable:
    def __init__(
        self,
        ttl_s: float,
        clock: Callable[[], float],
        on_free: Callable[[Lease, list[int]], None],
        tombstone_s: float | None = None,
        grace_s: float = 0.0,
        expire_read: Callable[[], bool] | None = None,
        max_blocks: int | None = None,
        on_state: Callable[[Lease], None] = lambda lease: None,
        max_s: float | None = None,
        share_min_idle_s: float = 0.0,
    ) -> None:
        """`max_blocks`, `share_min_idle_s`: the bound on what leases hold at once (the rules, "Bounded").
        `max_s`: the longest renewals may hold a lease from its grant (default: the TTL, i.e. renewals add nothing).
        `on_state(lease)`: a grant, and an end before any block goes back (the same-host lease board,
        board.py), under the table's lock."""
        if ttl_s <= 0:
            raise LeaseError(f"lease ttl must be positive, got {ttl_s}")
        self.ttl_s = ttl_s
        self.max_s = max(ttl_s, max_s if max_s is not None else ttl_s)
        self.renewals = 0  # renewals that extended a lease
        self.tombstone_s = tombstone_s if tombstone_s is not None else max(60.0, 2 * ttl_s)
        self._clock = clock
        self._on_free, self._on_state = on_free, on_state
        self._lock = threading.Lock()
        self._leases: dict[str, Lease] = {}
        # the held ones, oldest first (`_leases` also keeps the ended a while)
        self._held: dict[str, Lease] = {}
        self._holds = Holds()  # which blocks the leases (held, or ended and pinned) hold
        self._expire_read = expire_read or (lambda: False)  # fault injection (faults.py): this read fails
        self.grace_s = grace_s
        self._early = EarlyReleases()
        self.max_blocks, self.share_min_idle_s = max_blocks, share_min_idle_s
        self.counts = {state: 0 for state in LeaseState}
        self._due = DueTimes()
        self.looked_at = 0  # leases `expire` has looked at (what it costs: only those with something due)

    # --- queries -----------------------------------------------------------------------------------

    def state(self, lease_id: str) -> LeaseState:
        with self._lock:
            lease = self._leases.get(lease_id)
            return lease.state if lease else LeaseState.UNKNOWN

    @property
    def num_held(self) -> int:
        with self._lock:  # (the loop thread asks at every wait: never a walk over the tombstones)
            return len(self._held)

    @property
    def num_blocks_held(self) -> int:
        with self._lock:
            return len(self._holds)

    def blocks_problem(self, lease_id: str, block_ids: Sequence[int], group_sizes: Sequence[int] = ()) -> str:
        """Why `block_ids` (per KV cache group, `group_sizes`) may not be named for lease `lease_id` ("" when
        they may: `checks.blocks_problem`)."""
        return checks.blocks_problem(self._get(lease_id), block_ids, group_sizes)

    def prompt_problem(self, lease_id: str, prompt: bytes) -> str:
        """Why a reader naming the prompt digest `prompt` may not read lease `lease_id` ("" when it may)."""
        return checks.prompt_problem(self._get(lease_id), prompt)

    def digest_matches(self, lease_id: str, num_blocks: int, digest: bytes, group_sizes: Sequence[int] = ()) -> bool:
        """Whether a notification's (count, digest) names a suffix of the lease's blocks (`checks.digest_matches`)."""
        return checks.digest_matches(self._get(lease_id), num_blocks, digest, group_sizes)

    def content_of(self, lease_id: str, block_ids: Sequence[int]) -> list[int] | None:
        """The content sums the grant recorded for `block_ids` of the lease (None: it recorded none)."""
        return checks.content_of(self._get(lease_id), block_ids)

    def _get(self, lease_id: str) -> Lease | None:
        with self._lock:
            return self._leases.get(lease_id)

    def held(self) -> list[Lease]:
        """Snapshot of the leases still held."""
        with self._lock:
            return [Lease(**{**vars(x), "pins": dict(x.pins), "tokens": dict(x.tokens)}) for x in self._held.values()]

    # --- transitions -------------------------------------------------------------------------------

    def grant(
        self,
        lease_id: str,
        block_ids: Iterable[int],
        label: str = "",
        content: Sequence[int] = (),
        prompt: bytes = b"",
        group_sizes: Sequence[int] = (),
    ) -> Lease:
        """Lease `block_ids` under the lease id `lease_id` (`new_lease_id()`; a TP group's ranks share one).
        Blocks other live leases hold may be leased again (shared prefix blocks); an id the table still
        remembers, held or ended, is refused: its blocks might otherwise never be handed back."""
        ids = tuple(int(b) for b in block_ids)
        with self._lock:
            if lease_id in self._leases:
                raise LeaseError(f"lease id {lease_id[:8]}... is already in use (lease {label or '?'})")
            if len(set(ids)) != len(ids):
                raise LeaseError(f"lease {label or lease_id[:8]}: duplicated block ids")
            groups = tuple(int(n) for n in group_sizes) if len(group_sizes) > 1 else ()
            if groups and (sum(groups) != len(ids) or min(groups) < 0):
                raise LeaseError(f"lease {label or lease_id[:8]}: group sizes {list(groups)} do not split its blocks")
            now = self._clock()
            making_room = self._holds.room_for(ids, self._held.values(), self.max_blocks, now, self.share_min_idle_s)
            lease = Lease(
                lease_id,
                ids,
                now,
                now + self.ttl_s,
                label=label,
                content=tuple(int(x) for x in content),
                prompt=prompt,
                groups=groups,
                active_s=now,
            )
            self._leases[lease_id] = self._held[lease_id] = lease
            self._schedule(lease)
            self._on_state(lease)
            self._holds.take(ids)
            self.counts[LeaseState.HELD] += 1
            released_early = self._early.take(lease_id, ids, now)
        for old in making_room:
            log.warning(
                "lease %s expired early: leases would hold more than %d blocks (lease_cache_share)",
                old.request_id,
                self.max_blocks,
            )
            self._end(old.lease_id, LeaseState.EXPIRED)
        if released_early:
            log.info("lease %s: released before it was granted; its %d blocks go back now", lease.request_id, len(ids))
            self._end(lease_id, LeaseState.RELEASED)
        return lease

    def pin(self, lease_id: str, reader: int, pin_s: float, token: bytes = b"") -> LeaseState:
        """Keep a held lease's blocks for `reader` (speaking with `token`) for up to `pin_s` (see the rules,
        "Pins"). Returns HELD when pinned, COMPLETED when this reader's own notification already completed it,
        else the state that forbids the read (CONSUMED: another reader's lease)."""
        with self._lock:
            lease = self._leases.get(lease_id)
            if lease is None:
                return LeaseState.UNKNOWN
            if lease.state is not LeaseState.HELD:
                return lease.ended_answer(reader, token)
            if not self._claim(lease, reader, token):
                return LeaseState.CONSUMED
            if not self._expire_read():  # (fault injection, faults.py: as if the TTL ran out before the pin)
                lease.pins[reader] = max(lease.pins.get(reader, 0.0), self._clock() + pin_s)
                self._schedule(lease)
                return LeaseState.HELD
        log.warning("lease %s expired as its read was pinned (fault injection)", lease.request_id)
        return self._end(lease_id, LeaseState.EXPIRED)

    def renew(self, lease_id: str) -> tuple[LeaseState, float]:
        """A decode still waits to read `lease_id`: hold it until a TTL from now, but never past `max_s` from its
        grant (the rules, "Renewals"). Returns its state and, while HELD, how long from now it is held."""
        with self._lock:
            lease = self._leases.get(lease_id)
            if lease is None:
                return LeaseState.UNKNOWN, 0.0
            if lease.state is not LeaseState.HELD:
                return lease.state, 0.0
            now = self._clock()
            late = now >= lease.expires_s and not lease.pins  # (its TTL ran out before this tick could end it)
            if not late:
                # (no new due entry: the one at its old expiry finds it held and schedules the new one)
                until = min(now + self.ttl_s, lease.granted_s + self.max_s)
                if until > lease.expires_s:
                    lease.expires_s = until
                    self.renewals += 1
                lease.renewals += 1
                lease.active_s = now
                return LeaseState.HELD, max(0.0, lease.expires_s - now)
        log.warning("lease %s expired unread: renewed after its TTL ran out", lease.request_id)
        return self._end(lease_id, LeaseState.EXPIRED), 0.0

    def unpin(self, lease_id: str, reader: int, token: bytes = b"") -> None:
        """`reader` no longer reads: drop its pin (and hand back the blocks of a lease that ended meanwhile).
        Only the token that pinned may unpin."""
        with self._lock:
            lease = self._leases.get(lease_id)
            if lease is None or reader not in lease.pins or not lease.token_ok(reader, token):
                return
            del lease.pins[reader]
            # a held lease past its TTL ends at the next tick, as it would have unpinned
            self._schedule(lease)
            freeing = self._take_deferred(lease)
        if freeing is not None:
            self._free(*freeing)

    def complete(self, lease_id: str, reader: int = 0, readers: int = 1, token: bytes = b"") -> LeaseState:
        """Reader `reader` of `readers` (speaking with `token`) finished (notification or confirmation).
        Returns COMPLETED when its read happened under the lease (or under its pin); the lease itself ends
        when the last reader is done. CONSUMED: the slot or the completed lease is another reader's."""
        injected = after_end = False
        freeing = None
        with self._lock:
            lease = self._leases.get(lease_id)
            if lease is None:
                return LeaseState.UNKNOWN
            if lease.state is LeaseState.HELD:
                if not self._claim(lease, reader, token):
                    return LeaseState.CONSUMED
            elif not lease.token_ok(reader, token):
                return lease.ended_answer(reader, token)
            pinned = reader in lease.pins
            if pinned:
                del lease.pins[reader]  # this reader is done either way
                self._schedule(lease)
            if lease.state is not LeaseState.HELD:
                if not pinned:
                    return lease.state
                ended = lease.state  # ended while pinned: the pin kept the blocks, so the read was good
                freeing, after_end = self._take_deferred(lease), True
            elif not pinned and self._expire_read():
                injected = True
            elif readers > 1:
                lease.readers_done = lease.readers_done | {reader}
                if len(lease.readers_done) < readers:
                    return LeaseState.COMPLETED  # this reader's data is good; the others still read
        if after_end:
            if freeing is not None:
                self._free(*freeing)
            log.info("lease %s: pinned read completed after the lease ended %s", lease.request_id, ended.value)
            return LeaseState.COMPLETED
        if injected:  # as if the TTL had run out while the reader was reading
            log.warning("lease %s expired as its read finished (fault injection)", lease.request_id)
            return self._end(lease_id, LeaseState.EXPIRED)
        return self._end(lease_id, LeaseState.COMPLETED)

    def release(
        self, lease_id: str, reader: int = -1, block_ids: Sequence[int] | None = None, token: bytes = b""
    ) -> LeaseState:
        """Give the blocks back now without a completed read (`reader`, when it is one and `token` is its own,
        also drops its pin). A release naming `block_ids` of a lease not granted yet is remembered for the
        grace (the rules, "Early releases")."""
        with self._lock:
            if lease_id not in self._leases and block_ids is not None and self.grace_s > 0:
                self._early.remember(lease_id, block_ids, self._clock() + self.grace_s)
                return LeaseState.UNKNOWN
        state = self._end(lease_id, LeaseState.RELEASED)
        if reader >= 0:
            self.unpin(lease_id, reader, token)
        return state

    def expire(self) -> list[Lease]:
        """End every lease past its TTL and forget old tombstones; returns the leases that expired. Looks only at
        the leases with something due (the rules, "Work by what is due")."""
        now = self._clock()
        expired: list[Lease] = []
        unpinned: list[tuple[Lease, list[int], Callable[[list[int]], None] | None]] = []
        tomb = self.tombstone_s
        with self._lock:
            due = self._due_ids(now)
            self.looked_at += len(due)
            for rid in due:
                lease = self._leases.get(rid)
                if lease is None:
                    continue
                if lease.pins:
                    for reader, until in list(lease.pins.items()):
                        if now >= until:
                            del lease.pins[reader]
                    freeing = self._take_deferred(lease)
                    if freeing is not None:
                        unpinned.append(freeing)
                if lease.state is LeaseState.HELD and now >= lease.expires_s and not lease.pins:
                    expired.append(lease)
                elif lease.state is not LeaseState.HELD and not lease.deferred and now - lease.ended_s >= tomb:
                    del self._leases[rid]
                else:
                    self._schedule(lease)
            self._early.forget_before(now)
        for freeing in unpinned:
            self._free(*freeing)
        ended = [x for x in expired if self._end(x.lease_id, LeaseState.EXPIRED) is LeaseState.EXPIRED]
        for lease in ended:
            age, n = now - lease.granted_s, len(lease.block_ids)
            log.warning(
                "lease %s expired unread after %.3gs: %d blocks back to the allocator", lease.request_id, age, n
            )
        return ended

    # the leases `expire` looks at: those with something due (lock held)
    def _due_ids(self, now: float) -> list[str]:
        return self._due.pop_due(now)

    def force_expire(self, lease_id: str, scrub: Callable[[list[int]], None] | None = None) -> LeaseState:
        """Expire one lease now (operator tooling; fault injection, faults.py). `scrub(block_ids)` runs after the
        lease has ended but before its blocks are freed, so it may overwrite them safely (only the blocks no
        other lease still holds)."""
        with self._lock:
            lease = self._leases.get(lease_id)
        state = self._end(lease_id, LeaseState.EXPIRED, scrub)
        if state is LeaseState.EXPIRED and lease is not None:
            log.warning("lease %s force-expired", lease.request_id)  # (its label: the id is a secret)
        return state

    def _end(self, lease_id: str, how: LeaseState, scrub: Callable[[list[int]], None] | None = None) -> LeaseState:
        with self._lock:
            lease = self._leases.get(lease_id)
            if lease is None:
                return LeaseState.UNKNOWN
            if lease.state is not LeaseState.HELD:
                return lease.state
            lease.state, lease.ended_s = how, self._clock()
            self._on_state(lease)
            del self._held[lease_id]
            self.counts[how] += 1
            self.counts[LeaseState.HELD] -= 1
            self._schedule(lease)
            if lease.pins:  # a pinned read is in flight: the blocks go back when it is done
                lease.deferred, lease.deferred_scrub = True, scrub
                return how
            blocks = self._holds.let_go(lease.block_ids)
        self._free(lease, blocks, scrub)
        return how

    def _claim(self, lease: Lease, reader: int, token: bytes) -> bool:
        """`token` claims `reader`'s slot of a held lease, or already has it (lock held)."""
        if reader not in lease.tokens:
            lease.tokens[reader] = bytes(token)
            return True
        return lease.token_ok(reader, token)

    def _take_deferred(self, lease: Lease) -> tuple[Lease, list[int], Callable[[list[int]], None] | None] | None:
        """(lease, blocks freed, scrub) to hand back now that `lease` has no pins, if it ended while pinned
        (lock held)."""
        if lease.pins or not lease.deferred:
            return None
        lease.deferred = False
        self._schedule(lease)  # (its tombstone)
        scrub, lease.deferred_scrub = lease.deferred_scrub, None
        return lease, self._holds.let_go(lease.block_ids), scrub

    def _schedule(self, lease: Lease) -> None:
        """Note when `expire` must look at `lease` next (lock held; `due.py`)."""
        self._due.push(lease, self.tombstone_s, self._clock())

    def _free(self, lease: Lease, blocks: list[int], scrub: Callable[[list[int]], None] | None = None) -> None:
        if scrub is not None and blocks:
            scrub(blocks)
        self._on_free(lease, blocks)
