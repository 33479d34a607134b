"""Lease table with an injected clock."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvconnect.core.errors import LeaseError
from kvconnect.core.faults import FaultHooks
from kvconnect.core.prefill.table import LeaseTable
from kvconnect.core.wire.protocol import LeaseState


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def table(ttl: float = 10.0):
    clock, freed = Clock(), []
    return LeaseTable(ttl, clock, lambda rid, ids: freed.extend(ids), tombstone_s=30.0), clock, freed


def test_complete_frees_once_and_is_remembered() -> None:
    t, clock, freed = table()
    t.grant("a", [1, 2, 3])
    assert t.num_blocks_held == 3 and t.num_held == 1
    assert t.complete("a") is LeaseState.COMPLETED
    assert t.complete("a") is LeaseState.COMPLETED  # idempotent: a late confirmation learns the outcome
    assert t.release("a") is LeaseState.COMPLETED
    assert freed == [1, 2, 3] and t.num_blocks_held == 0


def test_unread_lease_expires_after_ttl() -> None:
    t, clock, freed = table(ttl=10)
    t.grant("a", [5])
    clock.now += 9.9
    assert t.expire() == [] and freed == []
    clock.now += 0.2
    assert [lease.request_id for lease in t.expire()] == ["a"]
    assert freed == [5]
    assert t.complete("a") is LeaseState.EXPIRED  # a read that finishes after expiry is refused
    clock.now += 31
    t.expire()
    assert t.state("a") is LeaseState.UNKNOWN  # tombstone forgotten


def test_release_and_double_grant() -> None:
    t, clock, freed = table()
    t.grant("a", [1, 2])
    with pytest.raises(LeaseError, match="already in use"):
        t.grant("a", [7])
    with pytest.raises(LeaseError, match="duplicated"):
        t.grant("c", [4, 4])
    assert t.release("a") is LeaseState.RELEASED
    with pytest.raises(LeaseError, match="already in use"):  # ended, but remembered: never granted again
        t.grant("a", [2, 3])
    t.grant("b", [2, 3])
    assert t.release("nope") is LeaseState.UNKNOWN
    assert t.counts[LeaseState.RELEASED] == 1 and t.counts[LeaseState.HELD] == 1
    assert freed == [1, 2]


def test_regranting_an_id_whose_pinned_lease_ended_is_refused_and_its_blocks_go_back() -> None:
    """A lease that ended while pinned frees its blocks when the pin goes; a grant of the same id meanwhile
    used to overwrite it, and its blocks were never handed back."""
    t, clock, freed = table()
    t.grant("a", [1, 2, 3])
    assert t.pin("a", 0, 5, token=b"t") is LeaseState.HELD
    assert t.release("a") is LeaseState.RELEASED and freed == []
    with pytest.raises(LeaseError, match="already in use"):
        t.grant("a", [4])
    clock.now += 6  # the pin's deadline
    t.expire()
    assert freed == [1, 2, 3] and t.num_blocks_held == 0


def test_leases_may_share_blocks_and_a_block_goes_back_with_its_last_holder() -> None:
    """Prefix caching gives concurrent requests the same prefix blocks: each lease holds them, and one lease's
    end (release, expiry, completion, a force-expire's scrub) never frees what another still holds."""
    t, clock, freed = table(ttl=10)
    scrubbed: list[int] = []
    t.grant("a", [1, 2, 3])
    t.grant("b", [1, 2, 4])
    t.grant("c", [1, 5])
    assert t.num_blocks_held == 5 and t.num_held == 3
    assert t.complete("a", token=b"ta") is LeaseState.COMPLETED
    assert freed == [3]  # 1 and 2 are b's too
    assert t.force_expire("b", scrub=scrubbed.extend) is LeaseState.EXPIRED
    assert freed == [3, 2, 4] and scrubbed == [2, 4]  # never block 1: c still holds it
    assert t.blocks_problem("c", [1, 5]) == "" and t.state("c") is LeaseState.HELD
    clock.now += 11
    assert [x.request_id for x in t.expire()] == ["c"]
    assert sorted(freed) == [1, 2, 3, 4, 5] and t.num_blocks_held == 0


def test_a_lease_completed_by_one_reader_is_consumed_for_every_other() -> None:
    """Params replayed to a second decode: its token is not the one that read under the lease, so neither its
    PIN nor its CONFIRM passes, whatever the prefill has put into those blocks since."""
    t, clock, freed = table()
    t.grant("a", [1, 2])
    assert t.pin("a", 0, 5, token=b"A") is LeaseState.HELD
    assert t.pin("a", 0, 5, token=b"B") is LeaseState.CONSUMED  # the slot is A's while it is held
    assert t.complete("a", 0, token=b"B") is LeaseState.CONSUMED and t.state("a") is LeaseState.HELD
    assert t.complete("a", 0, token=b"A") is LeaseState.COMPLETED and freed == [1, 2]
    assert t.complete("a", 0, token=b"A") is LeaseState.COMPLETED  # A's late confirmation learns its outcome
    for reader in (0, 1):  # anyone else, in any reader slot, after the lease completed
        assert t.pin("a", reader, 5, token=b"B") is LeaseState.CONSUMED
        assert t.complete("a", reader, 2, token=b"B") is LeaseState.CONSUMED
    t.release("a", reader=0, token=b"B")  # a stranger's release changes nothing
    assert t.state("a") is LeaseState.COMPLETED and freed == [1, 2]


def test_a_readers_pin_is_dropped_only_with_its_own_token() -> None:
    t, clock, freed = table()
    t.grant("a", [3])
    assert t.pin("a", 0, 5, token=b"A") is LeaseState.HELD
    t.release("a", reader=0, token=b"B")  # ends the lease, but cannot drop A's pin
    assert freed == [] and t.state("a") is LeaseState.RELEASED
    t.unpin("a", 0, token=b"B")
    assert freed == []
    t.release("a", reader=0, token=b"A")
    assert freed == [3]


def test_ttl_must_be_positive() -> None:
    with pytest.raises(LeaseError):
        LeaseTable(0, Clock(), lambda rid, ids: None)


def test_a_pinned_lease_outlives_its_ttl_until_the_pin_ends() -> None:
    t, clock, freed = table(ttl=10)
    t.grant("a", [5, 6])
    clock.now += 9
    assert t.pin("a", reader=0, pin_s=5) is LeaseState.HELD
    clock.now += 3  # past the TTL, inside the pin
    assert t.expire() == [] and t.state("a") is LeaseState.HELD and freed == []
    clock.now += 2.5  # the pin's own deadline passed (the reader vanished): the TTL applies again
    assert [x.request_id for x in t.expire()] == ["a"] and freed == [5, 6]


def test_ending_a_pinned_lease_defers_freeing_and_scrubbing_to_the_pin() -> None:
    """Release or force-expire while a pinned READ is in flight: the state changes at once, but the blocks
    (and the scrub that would overwrite them) wait for the reader, whose read is therefore good."""
    for end in ("release", "force"):
        t, clock, freed = table()
        scrubbed: list[int] = []
        t.grant("a", [1, 2])
        assert t.pin("a", reader=0, pin_s=5) is LeaseState.HELD
        if end == "release":
            assert t.release("a") is LeaseState.RELEASED  # another party's release (reader -1)
        else:
            assert t.force_expire("a", scrub=scrubbed.extend) is LeaseState.EXPIRED
        assert freed == [] and scrubbed == [] and t.num_blocks_held == 2
        assert t.complete("a", reader=0) is LeaseState.COMPLETED  # the pinned read finished intact
        assert freed == [1, 2] and scrubbed == ([1, 2] if end == "force" else []) and t.num_blocks_held == 0
        assert t.state("a") is (LeaseState.RELEASED if end == "release" else LeaseState.EXPIRED)


def test_pin_reports_an_ended_lease_and_the_readers_release_drops_its_pin() -> None:
    t, clock, freed = table()
    t.grant("a", [1])
    t.release("a")
    assert t.pin("a", 0, 5) is LeaseState.RELEASED and t.pin("zz", 0, 5) is LeaseState.UNKNOWN
    t.grant("b", [2])
    assert t.pin("b", reader=1, pin_s=5) is LeaseState.HELD
    assert t.release("b", reader=1) is LeaseState.RELEASED and freed == [1, 2]  # its own pin: freed at once
    hooks = FaultHooks()
    t = LeaseTable(
        10.0, clock, lambda rid, ids: freed.extend(ids), tombstone_s=30.0, expire_read=hooks.take_read_expiry
    )
    t.grant("c", [3])
    hooks.expire_next_reads(1)
    assert t.pin("c", 0, 5) is LeaseState.EXPIRED and freed == [1, 2, 3]  # fault injection hits the pin


def test_several_readers_each_pin_and_the_last_one_frees() -> None:
    t, clock, freed = table()
    t.grant("a", [7])
    for reader in (0, 1):
        assert t.pin("a", reader, 5) is LeaseState.HELD
    assert t.complete("a", reader=1, readers=2) is LeaseState.COMPLETED and freed == []
    t.release("a")  # e.g. the request was aborted while reader 0 still reads
    assert freed == []
    assert t.complete("a", reader=0, readers=2) is LeaseState.COMPLETED and freed == [7]


def test_a_lease_is_bound_to_its_blocks() -> None:
    """Only the leased blocks (or their tail: a decode's prefix hit reads fewer) may be named for a lease."""
    from kvconnect.core.wire.protocol import blocks_digest

    t, clock, freed = table()
    t.grant("a", [1, 2, 3])
    t.grant("b", [7, 8])
    assert t.blocks_problem("a", [1, 2, 3]) == "" and t.blocks_problem("a", [2, 3]) == ""
    assert t.blocks_problem("a", [3]) == ""
    assert "[7, 8] are not leased to it" in t.blocks_problem("a", [7, 8])
    assert "not the tail" in t.blocks_problem("a", [1, 2])  # a prefix is not what a prefix hit leaves
    assert "not the tail" in t.blocks_problem("a", [3, 2, 1])  # nor the same blocks in another order
    assert "required" in t.blocks_problem("a", [])
    assert "not leased" in t.blocks_problem("a", [0, 1, 2, 3])
    assert t.blocks_problem("nobody", [7]) == ""  # an unknown lease has nothing to protect
    assert t.digest_matches("a", 2, blocks_digest([2, 3])) and not t.digest_matches("a", 2, blocks_digest([7, 8]))
    assert not t.digest_matches("a", 0, b"")
    assert t.state("a") is LeaseState.HELD and t.state("b") is LeaseState.HELD and freed == []


def test_a_non_reader_release_never_drops_a_readers_pin() -> None:
    """A release from someone who is not reading (the proxy, a decode that gave up) ends the lease but leaves
    a reader's pin: the pinned READ's blocks stay until that reader confirms, so its data is good."""
    t, clock, freed = table()
    t.grant("a", [4, 5])
    assert t.pin("a", reader=0, pin_s=5.0) is LeaseState.HELD
    assert t.release("a", reader=-1) is LeaseState.RELEASED
    assert freed == [] and t.num_blocks_held == 2  # still pinned by reader 0
    assert t.complete("a", reader=0) is LeaseState.COMPLETED  # its read happened under the pin
    assert freed == [4, 5] and t.num_blocks_held == 0


def test_a_release_that_precedes_its_grant_ends_the_grant_within_the_grace() -> None:
    """An engine that grants a lease on its next step (vLLM) may see the decode's RELEASE first: with a grace
    the grant that follows ends at once, if the release named a suffix of its blocks and the grace holds."""
    clock, freed = Clock(), []
    t = LeaseTable(10.0, clock, lambda rid, ids: freed.extend(ids), tombstone_s=30.0, grace_s=5.0)
    assert t.release("early", block_ids=[2, 3]) is LeaseState.UNKNOWN
    t.grant("early", [1, 2, 3])
    assert t.state("early") is LeaseState.RELEASED and freed == [1, 2, 3] and t.num_blocks_held == 0
    t.release("foreign", block_ids=[9])  # blocks the grant does not end with: the grant stands
    t.grant("foreign", [4, 5])
    assert t.state("foreign") is LeaseState.HELD
    t.release("late", block_ids=[6])
    clock.now += 5.1
    t.expire()  # (forgotten after the grace)
    t.grant("late", [6])
    assert t.state("late") is LeaseState.HELD
    plain, _, plain_freed = table()  # no grace: nothing is remembered
    assert plain.release("x", block_ids=[1]) is LeaseState.UNKNOWN
    plain.grant("x", [1])
    assert plain.state("x") is LeaseState.HELD and plain_freed == []


def test_early_releases_are_bounded_whatever_a_peer_sends() -> None:
    """A peer may name any request id and up to a 4 MiB message of block ids: the table remembers at most
    MAX_EARLY_RELEASES of them (the oldest go first), and none whose id is over MAX_EARLY_ID characters."""
    from kvconnect.core.prefill import early as lease_module

    clock = Clock()
    t = LeaseTable(10.0, clock, lambda rid, ids: None, grace_s=5.0)
    last = lease_module.MAX_EARLY_RELEASES
    for i in range(last + 1):
        t.release(f"r{i}", block_ids=[10_000 + i])
    long_id = "x" * (lease_module.MAX_EARLY_ID + 1)
    t.release(long_id, block_ids=[1])  # not remembered, so it pushes nothing out
    t.grant(long_id, [1])
    t.grant("r0", [10_000])  # forgotten: the oldest of one too many
    t.grant("r1", [10_001])
    t.grant(f"r{last}", [10_000 + last])
    assert t.state(long_id) is LeaseState.HELD and t.state("r0") is LeaseState.HELD
    assert t.state("r1") is LeaseState.RELEASED and t.state(f"r{last}") is LeaseState.RELEASED


def test_a_lease_bound_to_its_prompt_answers_only_readers_of_that_prompt() -> None:
    """A client who sends prompt Q to a decode with prompt P's params must not have Q decoded from P's KV."""
    from kvconnect.core.plan.params import prompt_digest

    p_digest, q_digest = prompt_digest([5, 6, 7, 8]), prompt_digest([5, 6, 7, 9])
    t, clock, freed = table()
    t.grant("bound", [1, 2], prompt=p_digest)
    t.grant("unbound", [3])
    assert t.prompt_problem("bound", p_digest) == ""
    assert t.prompt_problem("bound", q_digest) == "prompt: the lease holds the KV of another prompt"
    assert "none named" in t.prompt_problem("bound", b"")
    assert t.prompt_problem("unbound", q_digest) == "" and t.prompt_problem("nobody", q_digest) == ""
    assert t.state("bound") is LeaseState.HELD and freed == []  # a refusal changes nothing


def test_a_prompt_digest_covers_every_token_and_the_cache_salt() -> None:
    from kvconnect.core.plan.params import prompt_digest

    base = prompt_digest([1, 2, 3])
    assert prompt_digest([1, 2, 3]) == base and len(base) == 16
    others = [prompt_digest([1, 2]), prompt_digest([1, 2, 4]), prompt_digest([3, 2, 1]), prompt_digest([1, 2, 3], "t")]
    assert base not in others and len(set(others)) == len(others)
    assert prompt_digest([1, 2, 3], "") == base  # no salt and an empty salt are the same


def test_a_hybrid_models_lease_takes_a_tail_of_each_kv_cache_group() -> None:
    """Blocks per KV cache group (plan/groups.py): a reader names, per group, a suffix of the lease's group
    (its own prefix hit or a sliding window's tail); anything else is refused, and the notification's digest
    is checked the same way."""
    from kvconnect.core.wire.protocol import blocks_digest

    t, clock, freed = table()
    t.grant("hy", [5, 6, 7, 8, 9, 10, 11], group_sizes=(3, 4))  # sliding group [5, 6, 7], full group [8..11]
    assert t.blocks_problem("hy", [5, 6, 7, 8, 9, 10, 11], (3, 4)) == ""
    assert t.blocks_problem("hy", [6, 7, 10, 11], (2, 2)) == ""  # a tail of each group
    assert "not the tail" in t.blocks_problem("hy", [6, 7, 8, 9], (2, 2))  # the full group's head
    assert "2 KV cache groups, 1 named" in t.blocks_problem("hy", [10, 11])  # a flat tail is not enough
    assert "do not split" in t.blocks_problem("hy", [6, 7, 10, 11], (2, 3))
    assert t.digest_matches("hy", 4, blocks_digest([6, 7, 10, 11]), (2, 2))
    assert not t.digest_matches("hy", 4, blocks_digest([6, 7, 10, 11]), ())
    assert not t.digest_matches("hy", 4, blocks_digest([7, 8, 10, 11]), (2, 2))
    with pytest.raises(LeaseError, match="do not split"):
        t.grant("bad", [1, 2, 3], group_sizes=(1, 1))
    assert t.state("hy") is LeaseState.HELD and freed == []


def test_grouped_blocks_pair_the_tail_of_each_group() -> None:
    from kvconnect.core.errors import InvalidRequestError
    from kvconnect.core.plan.groups import GroupedBlocks, tail_pairs

    remote = GroupedBlocks.flat([5, 6, 7, 8, 9, 10, 11], [3, 4], "f")
    local = GroupedBlocks.of([[20, 21, 22], [30, 31]])
    mine, theirs = tail_pairs(local, remote, "f")
    assert mine.ids.tolist() == [20, 21, 22, 30, 31] and theirs.ids.tolist() == [5, 6, 7, 10, 11]
    assert theirs.sizes == (3, 2) and theirs.wire_sizes() == [3, 2] and GroupedBlocks.of([[1, 2]]).wire_sizes() is None
    with pytest.raises(InvalidRequestError, match="2 remote blocks for 3 blocks to load in KV cache group 1"):
        tail_pairs(GroupedBlocks.of([[1], [2, 3, 4]]), GroupedBlocks.of([[5], [6, 7]]), "f")
    with pytest.raises(InvalidRequestError, match="do not split"):
        GroupedBlocks.flat([1, 2, 3], [1, 1], "kv_transfer_params.remote_group_sizes")


def test_leases_hold_at_most_their_share_of_the_cache_and_abandoned_ones_make_room() -> None:
    """Security review: four prefill-leg-only requests leased the whole prefill cache and the next one waited
    for the 60 s TTL. Leases now hold at most `max_blocks` (lease_cache_share of the cache): a grant beyond it
    expires the oldest leases nobody pinned; it is never refused (the engine serves the request), and leases
    being read (pinned) stay."""
    clock, freed = Clock(), []
    t = LeaseTable(60.0, clock, lambda lease, ids: freed.extend(ids), max_blocks=6)
    t.grant("a", [1, 2, 3])
    t.grant("b", [4, 5])
    t.grant("c", [3, 6])  # 6 blocks held (3 shared): at the cap, nothing ends
    assert t.num_blocks_held == 6 and freed == []
    t.grant("d", [7, 8])  # 8 > 6: the oldest unpinned lease ("a") ends; block 3 stays held by "c"
    assert t.state("a") is LeaseState.EXPIRED and sorted(freed) == [1, 2] and t.num_blocks_held == 6
    assert t.pin("b", 0, 30.0, b"tok") is LeaseState.HELD and t.pin("c", 0, 30.0, b"tk2") is LeaseState.HELD
    t.grant("e", [9])  # "b" and "c" are pinned: "d" is the one to go
    assert t.state("d") is LeaseState.EXPIRED and t.state("b") is LeaseState.HELD
    t.grant("f", [10, 11, 12])  # never refused: "e" ends, the pinned ones stay, and the bound is exceeded
    assert t.state("e") is LeaseState.EXPIRED and t.state("f") is LeaseState.HELD and t.num_blocks_held == 7
    big = LeaseTable(60.0, clock, lambda lease, ids: None, max_blocks=2)
    big.grant("alone", [1, 2, 3, 4])  # one request larger than the share: leased all the same
    assert big.state("alone") is LeaseState.HELD


def test_only_leases_idle_long_enough_end_to_keep_the_cache_share() -> None:
    """A lease younger than `share_min_idle_s` is most likely on its way to its decode: the bound ends only
    leases idle at least that long (oldest first), and the grant goes over it meanwhile."""
    clock, freed = Clock(), []
    t = LeaseTable(60.0, clock, lambda lease, ids: freed.extend(ids), max_blocks=4, share_min_idle_s=10.0)
    t.grant("a", [1, 2])
    clock.now += 1.0
    t.grant("b", [3, 4])
    clock.now += 1.0
    t.grant("c", [5, 6])  # 6 > 4, but "a" and "b" are 2 s and 1 s old: both stay
    assert [t.state(x) for x in "abc"] == [LeaseState.HELD] * 3 and t.num_blocks_held == 6 and freed == []
    clock.now += 9.0  # "a" idle 11 s, "b" 10 s, "c" 9 s
    t.grant("d", [7])  # 7 > 4: "a" then "b" end; "c" is younger than 10 s and stays
    assert t.state("a") is LeaseState.EXPIRED and t.state("b") is LeaseState.EXPIRED
    assert t.state("c") is LeaseState.HELD and sorted(freed) == [1, 2, 3, 4] and t.num_blocks_held == 3


@given(
    leased=st.lists(st.integers(0, 40), min_size=1, max_size=12, unique=True),
    named=st.lists(st.integers(0, 40), max_size=12),
    sizes=st.sampled_from(["none", "one", "wrong"]),
)
@settings(max_examples=300, deadline=None)
def test_a_one_group_lease_accepts_exactly_the_non_empty_tails_of_its_blocks(leased, named, sizes) -> None:
    """The one-group check a PIN takes (plain Python, no numpy) agrees with the grouped rule: a non-empty suffix
    of the leased ids is accepted, anything else refused with its reason."""
    t, _clock, _freed = table()
    t.grant("a", leased)
    group_sizes = {"none": (), "one": (len(named),), "wrong": (len(named) + 1,)}[sizes]
    problem = t.blocks_problem("a", named, group_sizes)
    is_tail = bool(named) and leased[-len(named) :] == named
    assert (problem == "") == (is_tail and sizes != "wrong"), problem
    assert problem == "" or problem.startswith("block_ids:")
