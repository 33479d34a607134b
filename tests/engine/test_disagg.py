"""Prefill/decode hooks in process: a KVKeeper on engine A keeps a request's blocks, a KVLoader on
engine B copies them (through `cache.kv()` views, across layouts) and B continues exactly as A would."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvconnect.core.errors import PeerGoneError, TransferError
from kvconnect.core.plan.layout import LayoutKind
from kvconnect.engine import Engine

from .support import CopyLoader, RecordingKeeper, generate, prompt, small_config, submit, wait_until


@pytest.fixture
def pair(request: pytest.FixtureRequest) -> Iterator[tuple[Engine, Engine]]:
    dst_layout = getattr(request, "param", LayoutKind.CROSS_LAYER)
    with Engine(small_config(LayoutKind.BLOCKS_FIRST)) as a, Engine(small_config(dst_layout)) as b:
        yield a, b


def prefill_on(a: Engine, ids: list[int], request_id: str) -> list[int]:
    """Run the prefill role on A (max_tokens=1, blocks kept) and return the kept block ids."""
    keeper = RecordingKeeper()
    c = generate(a, ids, 1, request_id, kv_keeper=keeper)
    assert c.final.finish_reason == "length"
    block_ids, num_prompt_tokens = keeper.kept[request_id]
    assert num_prompt_tokens == len(ids) and len(block_ids) == a.spec.blocks_for_tokens(len(ids))
    return block_ids


@pytest.mark.parametrize("pair", [LayoutKind.KV_FIRST, LayoutKind.CROSS_LAYER, LayoutKind.BLOCKS_FIRST], indirect=True)
@pytest.mark.parametrize("length", [1, 16, 37])
def test_decode_from_loaded_kv_equals_aggregated(pair: tuple[Engine, Engine], length: int) -> None:
    a, b = pair
    ids = prompt(50 + length, length)
    ref = generate(a, ids, 10, "ref")
    a_free, b_free = a.allocator.num_free, b.allocator.num_free
    first = generate(a, ids, 1, "probe").tokens
    assert first == ref.tokens[:1]
    kept = prefill_on(a, ids, "pre")
    assert a.allocator.num_free == a_free - len(kept)
    loader = CopyLoader(a, b, kept)
    out = generate(b, ids, 10, "dec", kv_loader=loader)
    assert out.tokens == ref.tokens and out.logprobs == ref.logprobs
    ((rid, block_ids, n),) = loader.started
    assert (rid, len(block_ids), n) == ("dec", len(kept), length)
    assert loader.handles[0].num_polls == 3  # two "still loading", then done
    wait_until(lambda: a.allocator.num_free == a_free and b.allocator.num_free == b_free, what="blocks back")


def test_the_loaded_kv_is_what_decode_uses(pair: tuple[Engine, Engine]) -> None:
    a, b = pair
    ids, other = prompt(60, 30), prompt(61, 30)
    ref = generate(a, ids, 8, "ref")
    wrong = prefill_on(a, other, "other")  # right shape, wrong content
    out = generate(b, ids, 8, "dec", kv_loader=CopyLoader(a, b, wrong))
    assert out.tokens != ref.tokens


@pytest.mark.parametrize("fail_at_start", [False, True])
def test_load_error_finishes_with_error_and_frees(pair: tuple[Engine, Engine], fail_at_start: bool) -> None:
    a, b = pair
    b_free = b.allocator.num_free
    loader = CopyLoader(a, b, [], error=PeerGoneError("prefill worker vanished"), fail_at_start=fail_at_start)
    c = generate(b, prompt(62, 40), 5, kv_loader=loader)
    assert c.tokens == []
    assert c.final.finish_reason == "error"
    error = c.final.error or ""
    assert "PeerGoneError" in error and "prefill worker vanished" in error
    wait_until(lambda: b.allocator.num_free == b_free, what="blocks freed")
    assert len(generate(b, prompt(63, 5), 3, "after").tokens) == 3  # the engine carries on


@pytest.mark.parametrize("fail_at_start", [False, True])
def test_recompute_policy_computes_the_prompt(pair: tuple[Engine, Engine], fail_at_start: bool) -> None:
    a, b = pair
    ids = prompt(64, 33)
    ref = generate(a, ids, 9, "ref")
    loader = CopyLoader(a, b, [], policy="recompute", error=TransferError("timed out"), fail_at_start=fail_at_start)
    out = generate(b, ids, 9, kv_loader=loader)
    assert out.tokens == ref.tokens and out.logprobs == ref.logprobs


def test_loading_does_not_block_other_requests(pair: tuple[Engine, Engine]) -> None:
    a, b = pair
    ids = prompt(65, 25)
    ref = generate(a, ids, 6, "ref")
    loader = CopyLoader(a, b, prefill_on(a, ids, "pre"))
    loader.gate.clear()  # the transfer hangs until we open the gate
    slow = submit(b, "slow", ids, 6, kv_loader=loader)
    wait_until(lambda: b.num_loading == 1, what="load started")
    other = generate(b, prompt(66, 12), 20, "other")
    assert len(other.tokens) == 20 and not slow.done
    assert loader.handles[0].num_polls > 1
    loader.gate.set()
    assert slow.wait().tokens == ref.tokens


def test_abort_while_loading_keeps_blocks_until_the_load_ends(pair: tuple[Engine, Engine]) -> None:
    a, b = pair
    b_free = b.allocator.num_free
    ids = prompt(67, 40)
    loader = CopyLoader(a, b, prefill_on(a, ids, "pre"))
    loader.gate.clear()
    c = submit(b, "doomed", ids, 6, kv_loader=loader)
    wait_until(lambda: b.num_loading == 1, what="load started")
    b.abort("doomed")
    assert c.wait().final.finish_reason == "abort"
    polls = loader.handles[0].num_polls
    wait_until(lambda: loader.handles[0].num_polls > polls + 2, what="draining polls")
    assert b.allocator.num_free == b_free - 3, "blocks freed while the transfer could still write"
    loader.gate.set()
    wait_until(lambda: b.allocator.num_free == b_free, what="blocks freed after the load ended")
    assert loader.handles[0].finished


def test_keeper_decline_or_failure_frees_and_abort_is_never_offered(pair: tuple[Engine, Engine]) -> None:
    a, _ = pair
    a_free = a.allocator.num_free
    declining, raising, unused = (RecordingKeeper(accept=False), RecordingKeeper(raises=True), RecordingKeeper())
    generate(a, prompt(68, 20), 3, "declined", kv_keeper=declining)
    generate(a, prompt(68, 20), 3, "raised", kv_keeper=raising)
    assert declining.kept["declined"][1] == 20
    c = submit(a, "aborted", prompt(69, 20), 400, kv_keeper=unused)
    wait_until(lambda: len(c.events) > 0, what="first token")
    a.abort("aborted")
    assert c.wait().final.finish_reason == "abort"
    assert unused.kept == {}
    wait_until(lambda: a.allocator.num_free == a_free, what="blocks freed")


def test_kept_blocks_cover_generated_tokens_too(pair: tuple[Engine, Engine]) -> None:
    a, _ = pair
    keeper = RecordingKeeper()
    generate(a, prompt(70, 14), 5, "r", kv_keeper=keeper)
    block_ids, n = keeper.kept["r"]
    assert n == 14 and len(block_ids) == 2  # 14 + 5 - 1 = 18 tokens with K/V written
    a.allocator.free(block_ids)  # the owner frees, from another thread
