"""Block allocator: counts, typed errors, all-or-nothing frees, listeners, thread safety."""

from __future__ import annotations

import threading

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvconnect.core.errors import LocalError
from kvconnect.engine import BlockAllocationError, BlockAllocator, OutOfBlocksError


def test_allocate_and_free() -> None:
    a = BlockAllocator(8)
    assert (a.num_total, a.num_free, a.num_allocated) == (8, 8, 0)
    ids = a.allocate(5)
    assert len(set(ids)) == 5 and all(0 <= i < 8 for i in ids)
    assert (a.num_free, a.num_allocated) == (3, 5)
    assert all(a.is_allocated(i) for i in ids)
    a.free(ids[:2])
    assert a.num_free == 5
    assert not a.is_allocated(ids[0])
    assert a.allocate(0) == []
    a.free([])


def test_out_of_blocks_allocates_nothing() -> None:
    a = BlockAllocator(4)
    a.allocate(3)
    with pytest.raises(OutOfBlocksError):
        a.allocate(2)
    assert a.num_free == 1
    assert issubclass(OutOfBlocksError, LocalError)


@pytest.mark.parametrize("bad", [[99], [-1], ["x"]])
def test_free_of_unknown_ids_raises(bad: list) -> None:
    a = BlockAllocator(4)
    with pytest.raises(BlockAllocationError):
        a.free(bad)


def test_double_free_raises_and_changes_nothing() -> None:
    a = BlockAllocator(4)
    ids = a.allocate(3)
    a.free([ids[0]])
    with pytest.raises(BlockAllocationError, match="not allocated"):
        a.free([ids[1], ids[0]])  # ids[1] is valid, but the whole free is refused
    assert a.is_allocated(ids[1]) and a.num_free == 2
    with pytest.raises(BlockAllocationError, match="twice"):
        a.free([ids[2], ids[2]])
    assert a.is_allocated(ids[2])


def test_bad_sizes() -> None:
    with pytest.raises(BlockAllocationError):
        BlockAllocator(0)
    with pytest.raises(BlockAllocationError):
        BlockAllocator(4).allocate(-1)


def test_free_listener_runs_after_each_free() -> None:
    a = BlockAllocator(4)
    calls = []
    a.add_free_listener(lambda: calls.append(a.num_free))
    ids = a.allocate(2)
    a.free(ids[:1])
    a.free(ids[1:])
    assert calls == [3, 4]


@given(st.lists(st.tuples(st.booleans(), st.integers(0, 6)), max_size=60))
def test_matches_a_set_model(ops: list[tuple[bool, int]]) -> None:
    a = BlockAllocator(16)
    held: list[int] = []
    for is_alloc, n in ops:
        if is_alloc:
            if n > 16 - len(held):
                with pytest.raises(OutOfBlocksError):
                    a.allocate(n)
            else:
                got = a.allocate(n)
                assert not set(got) & set(held)
                held += got
        else:
            a.free(held[:n])
            held = held[n:]
        assert a.num_free == 16 - len(held)
        assert a.num_allocated == len(held)


def test_concurrent_allocate_and_free() -> None:
    a = BlockAllocator(64)
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            for _ in range(500):
                try:
                    ids = a.allocate(3)
                except OutOfBlocksError:
                    continue
                a.free(ids)
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors
    assert a.num_free == 64 and a.num_allocated == 0
