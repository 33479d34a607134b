"""The lease board (kvconnect/core/board.py): a prefill's held leases in shared memory, which a decode on its host
reads after its transfer instead of waiting for its PIN's answer.

The board itself (its slots, bindings and generations) against a plain model; the files a decode refuses to
open; then two real connectors in this process over the fake wire (tests/fake_transport.py: a same-host path that,
like CUDA IPC, tells the prefill nothing), with the prefill's loop lock held so that its PIN answers wait: a pull
is usable from the board alone, and never when the lease ended, another prompt asks, or the board is off. Last,
a prefill process over real NIXL: the decode opens its board at the handshake."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvconnect.core.board import SIZE, BoardReader, BoardWriter, binding, boot_id, remove_orphans, slot_of
from kvconnect.core.cache import KVCache
from kvconnect.core.connector import KVConnector
from kvconnect.core.decode.pull import PullPhase
from kvconnect.core.errors import LeaseLostError
from kvconnect.core.plan.layout import LayoutKind
from kvconnect.harness.prefill import PrefillProcess
from tests.fake_transport import FakeTransport, Wire
from tests.faultkit import poll_until
from tests.helpers import config_for_tests, spec

INCARNATION = uuid.uuid4().hex
PROMPT = b"p" * 16
BOOT = boot_id()
ROOT = Path(__file__).resolve().parents[1]


def colliding(lease_id: str) -> str:
    """Another lease id in the same slot."""
    while True:
        other = uuid.uuid4().hex
        if slot_of(other) == slot_of(lease_id):
            return other


@pytest.fixture
def board(tmp_path) -> Iterator[BoardWriter]:
    writer = BoardWriter.create(INCARNATION, str(tmp_path))
    assert writer is not None
    yield writer
    writer.close()


def reader(board: BoardWriter, tmp_path, incarnation: str = INCARNATION) -> BoardReader | None:
    return BoardReader.open(board.name, incarnation, BOOT, str(tmp_path))


def test_a_held_lease_shows_bound_to_its_prompt_and_blocks_and_goes_when_it_ends(board, tmp_path) -> None:
    view = reader(board, tmp_path)
    assert view is not None
    board.held("lease-a", PROMPT, [4, 5, 6], ())
    assert view.holds("lease-a", binding("lease-a", PROMPT, [4, 5, 6], ()))
    assert view.holds("lease-a", binding("lease-a", PROMPT, [4, 5, 6], (3,)))  # (one group: the same)
    assert not view.holds("lease-a", binding("lease-a", b"q" * 16, [4, 5, 6], ()))  # another prompt
    assert not view.holds("lease-a", binding("lease-a", PROMPT, [4, 5, 7], ()))  # other blocks
    assert not view.holds("lease-a", binding("lease-a", PROMPT, [4, 5, 6], (1, 2)))  # other groups
    board.ended("lease-a")
    assert not view.holds("lease-a", binding("lease-a", PROMPT, [4, 5, 6], ()))


def test_a_slot_taken_by_a_held_lease_keeps_it_and_the_next_lease_there_is_not_shown(board, tmp_path) -> None:
    view = reader(board, tmp_path)
    assert view is not None
    other = colliding("lease-a")
    board.held("lease-a", PROMPT, [1], ())
    board.held(other, PROMPT, [2], ())
    assert view.holds("lease-a", binding("lease-a", PROMPT, [1], ()))
    assert not view.holds(other, binding(other, PROMPT, [2], ()))
    board.ended(other)  # (not its slot: changes nothing)
    assert view.holds("lease-a", binding("lease-a", PROMPT, [1], ()))
    board.ended("lease-a")
    board.held(other, PROMPT, [2], ())  # the slot is free again
    assert view.holds(other, binding(other, PROMPT, [2], ()))
    assert not view.holds("lease-a", binding("lease-a", PROMPT, [1], ()))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["grant", "end"]), st.integers(0, 5)), max_size=40))
def test_the_board_shows_exactly_the_held_leases_that_got_their_slot(tmp_path_factory, steps) -> None:
    """Against a model: ids 0-2 share one slot, 3-5 another; a grant while the slot is taken is not shown."""
    directory = str(tmp_path_factory.mktemp("board"))
    writer = BoardWriter.create(INCARNATION, directory)
    assert writer is not None
    try:
        view = BoardReader.open(writer.name, INCARNATION, BOOT, directory)
        assert view is not None
        first, second = "slot-one", "slot-two"
        ids = [first, colliding(first), colliding(first), second, colliding(second), colliding(second)]
        held: set[int] = set()
        shown: dict[int, int] = {}  # slot group (0 or 1) -> the lease shown there
        for action, i in steps:
            group = i // 3
            if action == "grant" and i not in held:
                held.add(i)
                writer.held(ids[i], PROMPT, [i], ())
                shown.setdefault(group, i)
            elif action == "end" and i in held:
                held.discard(i)
                writer.ended(ids[i])
                if shown.get(group) == i:
                    del shown[group]
            for j, lease_id in enumerate(ids):
                expected = j in held and shown.get(j // 3) == j
                assert view.holds(lease_id, binding(lease_id, PROMPT, [j], ())) is expected, (steps, j)
    finally:
        writer.close()


def test_a_decode_opens_only_a_board_of_its_form_size_and_incarnation(board, tmp_path) -> None:
    assert reader(board, tmp_path) is not None
    assert reader(board, tmp_path, uuid.uuid4().hex) is None  # another incarnation's (a restarted prefill)
    assert BoardReader.open("../" + board.name, INCARNATION, BOOT, str(tmp_path)) is None
    assert BoardReader.open("kvconnect-board-" + "0" * 32, INCARNATION, BOOT, str(tmp_path)) is None  # not there
    short = tmp_path / ("kvconnect-board-" + "1" * 32)
    short.write_bytes(b"KVCBOARD" + bytes(100))
    assert BoardReader.open(short.name, INCARNATION, BOOT, str(tmp_path)) is None
    link = tmp_path / ("kvconnect-board-" + "2" * 32)
    link.symlink_to(board.path)
    assert BoardReader.open(link.name, INCARNATION, BOOT, str(tmp_path)) is None


# --- a board nobody can plant or break (each of these was a way in before the checks) -------------------------


def planted(board: BoardWriter, tmp_path, name_digit: str) -> str:
    """A copy of `board` (its header and slots, held leases included) under another board name."""
    path = tmp_path / ("kvconnect-board-" + name_digit * 32)
    with open(board.path, "rb") as f:
        path.write_bytes(f.read())
    os.chmod(path, 0o600)
    return path.name


def test_a_decode_refuses_a_board_it_did_not_get_from_a_prefill_of_its_user_and_host(board, tmp_path) -> None:
    """Anyone on the host can see a board's name and incarnation on the wire; a board is trusted only when it is a
    regular file of the decode's own user, mode 0600, with one link, of a prefill that reported this boot id."""
    board.held("lease-a", PROMPT, [4, 5], ())
    good = planted(board, tmp_path, "4")
    assert BoardReader.open(good, INCARNATION, BOOT, str(tmp_path)) is not None  # (the copy itself passes)
    assert BoardReader.open(good, INCARNATION, "another-host", str(tmp_path)) is None
    assert BoardReader.open(good, INCARNATION, "", str(tmp_path)) is None
    os.chmod(tmp_path / good, 0o644)
    assert BoardReader.open(good, INCARNATION, BOOT, str(tmp_path)) is None  # readable by others: not ours
    os.chmod(tmp_path / good, 0o600)
    os.chown(tmp_path / good, 65534, 65534)
    assert BoardReader.open(good, INCARNATION, BOOT, str(tmp_path)) is None  # another user's
    linked = planted(board, tmp_path, "5")
    os.link(tmp_path / linked, tmp_path / "kept-elsewhere")
    assert BoardReader.open(linked, INCARNATION, BOOT, str(tmp_path)) is None  # two links: its content is not its own


def test_a_fifo_named_like_a_board_hangs_neither_a_prefills_start_nor_a_decode(tmp_path) -> None:
    """A FIFO blocks an open for reading until a writer comes: a blocking open hung the prefill's start (its
    orphan sweep) and the decode's loop. Run where a hang is a failure, not a stuck suite."""
    fifo = tmp_path / ("kvconnect-board-" + "6" * 32)
    os.mkfifo(fifo, 0o600)
    code = (
        "import sys; from kvconnect.core.board import BoardReader, BoardWriter, boot_id;"
        f"w = BoardWriter.create('{INCARNATION}', {str(tmp_path)!r}); assert w is not None; w.close();"
        f"assert BoardReader.open({fifo.name!r}, '{INCARNATION}', boot_id(), {str(tmp_path)!r}) is None;"
        "print('done')"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert done.returncode == 0 and "done" in done.stdout, done.stderr[-2000:]
    assert fifo.exists()  # (not ours to remove: not a regular file)


def test_a_full_shared_memory_gives_no_board_instead_of_a_sigbus_at_a_grant(tmp_path) -> None:
    """A board is 512 KiB of a shared memory that NCCL and vLLM fill too (64 MiB by default in a container). A
    sparse board let the first grant that touched an unbacked page kill the prefill with SIGBUS."""
    small = tmp_path / "shm"
    small.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(small)]).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        code = (
            "from kvconnect.core.board import BoardWriter;"
            f"w = BoardWriter.create('{INCARNATION}', {str(small)!r});"
            "print('no board' if w is None else 'board');"
            "w is None or [w.held(f'lease-{i}', b'p' * 16, [i], ()) for i in range(4000)]; print('alive')"
        )
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
        assert done.returncode == 0 and done.stdout.split() == ["no", "board", "alive"], (done.returncode, done.stdout)
        assert os.listdir(small) == []  # (nothing half-made left behind)
    finally:
        subprocess.run(["umount", str(small)], check=False)


def test_a_board_cut_short_under_a_decode_reads_as_nothing_held_instead_of_killing_it(board, tmp_path) -> None:
    """The board's owner truncating it (or its user, on its behalf) made a decode reading a mapped board die of
    SIGBUS; read with pread, a short board holds nothing."""
    board.held("lease-a", PROMPT, [4, 5], ())
    code = (
        "import os; from kvconnect.core.board import BoardReader, binding, boot_id;"
        f"v = BoardReader.open({board.name!r}, '{INCARNATION}', boot_id(), {str(tmp_path)!r});"
        f"b = binding('lease-a', {PROMPT!r}, [4, 5], ()); print(v.holds('lease-a', b));"
        f"os.truncate({board.path!r}, 100); print(v.holds('lease-a', b))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert done.returncode == 0 and done.stdout.split() == ["True", "False"], (done.returncode, done.stderr[-500:])


def test_a_closed_board_shows_no_held_lease_to_a_decode_that_still_has_it_open(board, tmp_path) -> None:
    view = reader(board, tmp_path)
    assert view is not None
    board.held("lease-a", PROMPT, [4, 5], ())
    assert view.holds("lease-a", binding("lease-a", PROMPT, [4, 5], ()))
    board.close()
    assert not view.holds("lease-a", binding("lease-a", PROMPT, [4, 5], ()))


def test_a_closed_board_is_gone_and_later_lease_changes_do_nothing(tmp_path) -> None:
    writer = BoardWriter.create(INCARNATION, str(tmp_path))
    assert writer is not None
    writer.held("lease-a", PROMPT, [1], ())
    writer.close()  # (a connector closing while its engine still ends leases)
    writer.ended("lease-a")
    writer.held("lease-b", PROMPT, [2], ())
    assert not os.path.exists(writer.path)


def test_a_board_whose_owner_is_gone_is_removed_and_a_live_one_stays(board, tmp_path) -> None:
    orphan = tmp_path / ("kvconnect-board-" + "3" * 32)
    orphan.write_bytes(bytes(SIZE))  # (nobody holds its lock: its owner died)
    remove_orphans(str(tmp_path))
    assert not orphan.exists() and os.path.exists(board.path)


# --- two connectors over the fake wire ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def prefill() -> Iterator[KVConnector]:
    cache = KVCache.allocate(spec(LayoutKind.CROSS_LAYER))
    cache.fill_pattern(11)
    with KVConnector(cache, config_for_tests(kv_digest=False), transports=(FakeTransport,)) as conn:
        yield conn


@contextmanager
def a_ready_decode(prefill: KVConnector, **config) -> Iterator[tuple[KVConnector, Wire]]:
    """A decode over the fake wire whose peer is ready (a first pull done), so the prefill's loop can be held."""
    wire = Wire()
    wire.serve(prefill._peer_info.agent_name, prefill.cache)
    cache = KVCache.allocate(spec(LayoutKind.BLOCKS_FIRST, 32))
    settings = {"kv_digest": False, "pull_timeout_s": 60.0, **config}
    with KVConnector(cache, config_for_tests(**settings), transports=(wire.path(),)) as dec:
        dec.pull(prefill.lease(rid(), [1], 16), [31]).wait(10)
        yield dec, wire


def rid() -> str:
    return f"board-{uuid.uuid4().hex[:8]}"


def read_and_waiting(dec: KVConnector) -> bool:
    """Whether a pull has read its blocks and waits for the prefill's answer (the board did not decide)."""
    return any(x.phase is PullPhase.CONFIRMING for peer in dec._decode.peers.all() for x in peer.confirming.values())


def test_a_same_host_pull_is_usable_from_the_board_while_its_pin_is_unanswered(prefill) -> None:
    with a_ready_decode(prefill) as (dec, _):
        params = prefill.lease(rid(), [3, 9, 4], 40)
        with prefill._loop.lock:  # the prefill answers nothing meanwhile
            handle = dec.pull(params, [0, 1, 2])
            stats = poll_until(lambda: handle.done() and handle.wait(0), what="the pull usable, its PIN unanswered")
            assert stats.on_board and stats.pin_rtt_s == 0
            assert [dec.cache.block_bytes(b) for b in (0, 1, 2)] == [prefill.cache.block_bytes(b) for b in (3, 9, 4)]
            assert prefill.lease_state(params.remote_lease_id).value == "held"
        poll_until(  # its PIN, then its CONFIRM (sent, not awaited) end the lease
            lambda: prefill.lease_state(params.remote_lease_id).value == "completed", what="the lease completed"
        )


def test_a_lease_that_ended_before_the_read_was_checked_is_not_read_from_the_board(prefill) -> None:
    """The lease expires (its blocks scrubbed, as if reused) while the transfer is in flight and the PIN waits: the
    board shows it ended, so the decode waits for the answer, which refuses; the scrubbed bytes are never used."""
    with a_ready_decode(prefill) as (dec, wire):
        params = prefill.lease(rid(), [12, 13], 32)
        wire.hold = True
        with prefill._loop.lock:
            handle = dec.pull(params, [5, 6])
            poll_until(lambda: wire.posted and any(peer.confirming for peer in dec._decode.peers.all()), what="posted")
            posted = dec._decode._posted  # (the binding is worked out while the transfer runs, not after it)
            poll_until(lambda: posted and posted[0].board_binding, what="the board's binding, the transfer held")
            scrub = lambda ids: [t[i].fill_(0) for layer in range(3) for t in prefill.cache.kv(layer) for i in ids]  # noqa: E731
            assert prefill._leases.force_expire(params.remote_lease_id, scrub).value == "expired"
            wire.land()
            poll_until(lambda: read_and_waiting(dec), what="the read done, waiting for the PIN's answer")
            assert not handle.done()
        with pytest.raises(LeaseLostError, match="expired"):
            handle.wait(10)


def test_a_pull_for_another_prompt_is_not_read_from_the_board(prefill) -> None:
    with a_ready_decode(prefill) as (dec, _):
        params = prefill.lease(rid(), [20, 21], 32, prompt_digest=PROMPT)
        unbound = msgspec.structs.replace(params, remote_prompt_digest=None)  # (else refused before any read)
        with prefill._loop.lock:
            handle = dec.pull(unbound, [7, 8], prompt_digest=b"q" * 16)
            poll_until(lambda: read_and_waiting(dec), what="the read done, waiting for the PIN's answer")
            assert not handle.done()
        with pytest.raises(LeaseLostError, match="another prompt"):
            handle.wait(10)


@pytest.mark.parametrize("side", ["decode", "prefill"])
def test_with_the_board_off_on_either_side_a_pull_waits_for_its_pins_answer(side) -> None:
    cache = KVCache.allocate(spec(LayoutKind.CROSS_LAYER))
    config = config_for_tests(kv_digest=False, lease_board=side != "prefill")
    with KVConnector(cache, config, transports=(FakeTransport,)) as pre:
        assert bool(pre._peer_info.lease_board) is (side != "prefill")
        with a_ready_decode(pre, lease_board=side != "decode") as (dec, _):
            params = pre.lease(rid(), [3], 16)
            with pre._loop.lock:
                handle = dec.pull(params, [0])
                poll_until(lambda: read_and_waiting(dec), what="the read done, waiting for the PIN's answer")
                assert not handle.done()
            assert not handle.wait(10).on_board


def test_a_decode_opens_the_board_of_a_prefill_process_on_its_host_and_reads_right_over_nixl() -> None:
    """Over real NIXL (which also notifies the prefill as its READ ends): the board is found through the
    handshake and every pull reads the leased bytes, whether the board or the answer decided."""
    pre = PrefillProcess.launch(kv_digest=False)
    try:
        pre.wait_started()
        pre.setup(spec(LayoutKind.CROSS_LAYER), seed=5)
        pre.wait_setup()
        cache = KVCache.allocate(spec(LayoutKind.BLOCKS_FIRST, 32))
        with KVConnector(cache, config_for_tests(kv_digest=False)) as dec:
            for i in range(4):
                ids = [2 + 3 * i, 3 + 3 * i]
                dec.pull(pre.lease(f"nixl-{i}", ids, 32), [i, 10 + i]).wait(30)
                assert [dec.cache.block_bytes(b) for b in (i, 10 + i)] == [pre.ask("block", b) for b in ids]
            peers = dec._decode.peers.all()
            assert len(peers) == 1 and peers[0].board is not None
    finally:
        pre.stop()


def test_a_vllm_worker_reading_the_tail_of_a_lease_is_usable_from_the_board_over_nixl() -> None:
    """The vLLM worker reads only the tail of the prefill's blocks (its own prefix cache holds the first): the board
    binds the whole lease, so the worker hands the connector all of the lease's blocks (`leased`). The prefill
    process holds its PIN answers and the READs' notifications, so only the board can make the pull usable."""
    from kvconnect.harness.vllm_shapes import packed_views
    from kvconnect.vllm.metadata import PullOrder, StepOrders
    from kvconnect.vllm.worker import KVConnectWorker

    pre = PrefillProcess.launch(kv_digest=False)
    try:
        pre.wait_started()
        pre.setup_views("LBHNC", dict(layers=2, blocks=12, heads=2, tokens=32, head_dim=32, page="vllm:cpu-vec"), 4)
        pre.wait_setup()
        views, _ = packed_views("LBHNC", 2, 12, 2, 32, 32, seed=1)
        decode = KVConnectWorker(config_for_tests(kv_digest=False), tp_rank=0, total_kv_heads=2)
        decode.register_kv_caches(views, num_blocks=12, block_size=32, tp_size=1, page="vllm:cpu-vec")
        dec = decode.connector
        assert dec is not None
        try:
            dec.pull(pre.lease("first contact", [3], 32), [3]).wait(30)  # (the peer is ready: no handshake below)
            assert pre.ask("hold_pins", "and_notifs") == "ok"
            params = pre.lease("tail", [2, 9, 10], 96)
            order = PullOrder("tail", params, [[4, 1]], 96, 32)  # (its prefix cache holds the first 32 tokens)
            decode.bind_connector_metadata(StepOrders(pulls=[order], idle=True))
            handle = decode._loads["tail"].handle
            assert handle is not None
            poll_until(lambda: (dec.drive(), handle.done())[1], what="the pull usable, its PIN unanswered")
            assert handle.wait(0).on_board
            assert [dec.cache.block_bytes(b) for b in (4, 1)] == [pre.ask("block", b) for b in (9, 10)]
            assert pre.ask("answer_pins") == "ok"
        finally:
            decode.close()
    finally:
        pre.stop()
