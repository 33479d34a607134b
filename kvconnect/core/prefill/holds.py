"""Which blocks the leases hold, counted per block: several live leases may hold one block (prefix caching), and
an end hands back only the blocks no other lease holds. Also the bound on them: which leases end to make room.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kvconnect.core.prefill.lease import Lease
from kvconnect.core.wire.protocol import LeaseState


class Holds:
    """Block id -> how many leases (held, or ended and pinned) hold it. Callers hold the table's lock."""

    def __init__(self) -> None:
        self._count: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self._count)

    def take(self, block_ids: Iterable[int]) -> None:
        for b in block_ids:
            self._count[b] = self._count.get(b, 0) + 1

    def let_go(self, block_ids: Sequence[int]) -> list[int]:
        """Drop one lease's hold on `block_ids`; returns those nobody holds now."""
        freed = []
        for b in block_ids:
            left = self._count.get(b, 0) - 1
            if left > 0:
                self._count[b] = left
            else:
                self._count.pop(b, None)
                freed.append(b)
        return freed

    def room_for(
        self,
        ids: tuple[int, ...],
        leases: Iterable[Lease],
        max_blocks: int | None,
        now: float = 0.0,
        min_idle_s: float = 0.0,
    ) -> list[Lease]:
        """The oldest leases nobody has pinned that end so that, with a grant of `ids`, the leases hold at most
        `max_blocks` (`leases`: the held ones), least recently granted or renewed first (prefill legs whose decode
        never came go before leases a decode's queue still renews), of those idle at least `min_idle_s` at `now`
        (a younger lease is most likely on its way to its decode). A grant is never refused: the request is the
        engine's to serve. Pinned leases are being read and stay, as do younger ones, so what they and the
        grant hold may exceed the bound."""
        held = len(self._count) + sum(1 for b in ids if b not in self._count)
        if max_blocks is None or held <= max_blocks:
            return []
        left, victims = dict(self._count), []
        ordered = sorted(leases, key=lambda lease: lease.active_s)
        for lease in ordered:
            if held <= max_blocks:
                break
            if now - lease.active_s < min_idle_s:
                break  # (sorted by activity: every lease after it is younger)
            if lease.state is LeaseState.HELD and not lease.pins:
                victims.append(lease)
                for b in lease.block_ids:
                    left[b] -= 1
                    if left[b] == 0 and b not in ids:  # (a block the new lease holds too stays held)
                        held -= 1
        return victims
