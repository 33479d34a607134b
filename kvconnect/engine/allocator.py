"""Thread-safe allocator of paged-cache block ids.

The engine thread allocates; any thread may free (a prefill-side lease hands blocks back when the
decode side has read them or the lease expired). Frees are all-or-nothing: a list with an unknown,
free or repeated id raises and changes nothing. Listeners are told after every free (the engine uses
this to wake a request that waits for memory).
"""

from __future__ import annotations

import operator
import threading
from collections import deque
from collections.abc import Callable, Iterable

from kvconnect.core.errors import LocalError


class BlockAllocationError(LocalError):
    """A block id was freed twice, never allocated, or is outside the cache."""


class OutOfBlocksError(BlockAllocationError):
    """Fewer free blocks than asked for; nothing was allocated."""


class BlockAllocator:
    def __init__(self, num_blocks: int) -> None:
        if type(num_blocks) is not int or num_blocks < 1:
            raise BlockAllocationError(f"num_blocks must be a positive integer, got {num_blocks!r}")
        self._num_total = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._allocated: set[int] = set()
        self._lock = threading.Lock()
        self._listeners: list[Callable[[], None]] = []

    @property
    def num_total(self) -> int:
        return self._num_total

    @property
    def num_free(self) -> int:
        with self._lock:
            return len(self._free)

    @property
    def num_allocated(self) -> int:
        with self._lock:
            return len(self._allocated)

    def add_free_listener(self, callback: Callable[[], None]) -> None:
        """`callback()` runs after every successful free, on the freeing thread, outside the lock."""
        with self._lock:
            self._listeners.append(callback)

    def is_allocated(self, block_id: int) -> bool:
        with self._lock:
            return block_id in self._allocated

    def allocate(self, num_blocks: int) -> list[int]:
        """`num_blocks` distinct free ids (lowest-recently-freed first), or OutOfBlocksError."""
        if type(num_blocks) is not int or num_blocks < 0:
            raise BlockAllocationError(f"cannot allocate {num_blocks!r} blocks")
        with self._lock:
            if num_blocks > len(self._free):
                raise OutOfBlocksError(f"asked for {num_blocks} blocks, {len(self._free)} of {self._num_total} free")
            ids = [self._free.popleft() for _ in range(num_blocks)]
            self._allocated.update(ids)
        return ids

    def free(self, block_ids: Iterable[int]) -> None:
        """Return blocks to the pool; raises BlockAllocationError (and frees nothing) on a bad id."""
        try:
            ids = [operator.index(b) for b in block_ids]
        except TypeError as e:
            raise BlockAllocationError(f"block ids must be integers: {e}") from e
        if not ids:
            return
        with self._lock:
            seen: set[int] = set()
            for b in ids:
                if not 0 <= b < self._num_total:
                    raise BlockAllocationError(f"block id {b!r} is outside the cache [0, {self._num_total})")
                if b in seen:
                    raise BlockAllocationError(f"block id {b} appears twice in one free")
                if b not in self._allocated:
                    raise BlockAllocationError(f"block id {b} is not allocated (double free?)")
                seen.add(b)
            self._allocated.difference_update(ids)
            self._free.extend(ids)
            listeners = list(self._listeners)
        for callback in listeners:
            callback()
