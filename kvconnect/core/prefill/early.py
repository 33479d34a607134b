"""RELEASEs of leases not granted yet (an engine that grants a little after its params left): remembered until
their grace ends, and a grant they precede ends at once, RELEASED, if the release named a suffix of its
blocks."""

from __future__ import annotations

from collections.abc import Sequence

from kvconnect.core.wire.protocol import blocks_digest

MAX_EARLY_RELEASES = 4096  # releases of leases not granted yet that are remembered at once (oldest dropped)
MAX_EARLY_ID = 256  # longer lease ids are not remembered (a peer's message may be 4 MiB of id)


class EarlyReleases:
    """Bounded whatever a peer sends (`MAX_EARLY_RELEASES`, ids of `MAX_EARLY_ID` at most), each kept as a count
    and a digest of the blocks it named. Callers hold the table's lock."""

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
