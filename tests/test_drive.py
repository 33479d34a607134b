"""The engine's own thread drives the connector (`KVConnector.drive`): pulls are posted, polled and confirmed
by whichever thread ticks, one tick at a time. Real NIXL between this process and a prefill process; the
loop thread is held (`FaultHooks.hold_loop`) so that only the driving thread can move a pull."""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
import types
from collections.abc import Iterator
from typing import Any

import pytest

from kvconnect.core.cache import KVCache
from kvconnect.core.connector import KVConnector
from kvconnect.core.faults import FaultHooks
from kvconnect.core.loop import Loop
from kvconnect.core.plan.layout import CacheSpec, LayoutKind
from kvconnect.harness.net import poll_until
from kvconnect.harness.prefill import PrefillProcess
from tests.helpers import config_for_tests

SPEC = CacheSpec(
    kind=LayoutKind.CROSS_LAYER,
    num_blocks=16,
    dtype="float16",
    num_layers=2,
    block_size=16,
    num_kv_heads=2,
    head_dim=32,
)


@pytest.fixture(scope="module")
def prefill():
    pre = PrefillProcess.start(SPEC, seed=11)
    yield pre
    pre.stop()


def decoder() -> KVConnector:
    return KVConnector(KVCache.allocate(SPEC), config_for_tests(), faults=FaultHooks())


def test_a_driving_thread_completes_a_pull_while_the_loop_thread_is_held(prefill: PrefillProcess) -> None:
    params = prefill.lease("driven", [3, 7, 8])
    with decoder() as dec, dec.faults.hold_loop():
        handle = dec.pull(params, [0, 5, 6])
        ticks = []
        poll_until(lambda: ticks.append(dec.drive()) or handle.done(), what="the driven pull ended")
        handle.wait(0)  # raises the pull's error, if it failed
        assert all(ticks)  # nothing else was ticking: every drive ran one
        assert handle.stats.posted_on == "engine"
        for local, remote in zip([0, 5, 6], [3, 7, 8], strict=True):
            assert dec.cache.block_bytes(local) == prefill.ask("block", remote)
    assert prefill.settle("driven", 20) == "completed"


def test_a_pull_nobody_drives_is_posted_by_the_loop_thread_and_says_so(prefill: PrefillProcess) -> None:
    """Which thread posted a pull is in its stats (the vLLM plug-in counts it: `posted_on`): a pull the loop
    thread posts waits for the GIL at each blocking call while the engine runs Python."""
    params = prefill.lease("undriven", [2, 4])
    with decoder() as dec:
        stats = dec.pull(params, [1, 3]).wait(20)
    assert stats.posted_on == "loop"
    assert prefill.settle("undriven", 20) == "completed"


def test_a_prefill_whose_loop_thread_is_held_answers_the_handshake_and_pin_from_its_driving_thread() -> None:
    """A prefill's engine thread drives while it waits for its leases: each tick serves the side channel, so a
    decode's PIN is answered at the next drive instead of when the loop thread gets the GIL (in vLLM it waited
    for an engine thread that held it: the PIN's answer came 0.7-1.3 ms after it was sent, on an H200 host)."""
    with KVConnector(KVCache.allocate(SPEC), config_for_tests(), faults=FaultHooks()) as pre, decoder() as dec:
        pre.cache.fill_pattern(5)
        params = pre.lease("answered-by-the-driver", [3, 7, 8])
        with pre.faults.hold_loop():  # only the prefill's driving thread can answer now
            handle = dec.pull(params, [0, 5, 6])
            poll_until(lambda: pre.drive() and handle.done(), what="the pull, answered by the driving prefill")
            handle.wait(0)  # raises the pull's error, if it failed
            poll_until(lambda: pre.drive() and not pre.held_leases(), what="the reader's confirmation served")
        for local, remote in zip([0, 5, 6], [3, 7, 8], strict=True):
            assert dec.cache.block_bytes(local) == pre.cache.block_bytes(remote)


def test_a_burst_on_the_side_channel_is_served_in_batches_and_its_rest_marked_for_the_next_tick() -> None:
    """The loop thread waits on the socket's descriptor, which signals a change once: what one tick's serve leaves
    waiting (a serve answers at most MAX_PER_POLL) must be marked, or the rest would wait for the next timed tick."""
    import zmq

    from kvconnect.core.wire import protocol as p
    from kvconnect.core.wire.handshake import MAX_PER_POLL, zmq_address

    with KVConnector(KVCache.allocate(SPEC), config_for_tests(), faults=FaultHooks()) as conn:
        ctx = zmq.Context()
        client = ctx.socket(zmq.DEALER)
        client.setsockopt(zmq.LINGER, 0)
        client.connect(zmq_address("127.0.0.1", conn.side_channel_port))
        served: list[int] = []  # what each serve answered
        serve = conn._loop._serve
        conn._loop._serve = lambda: served.append(serve()) or served[-1]  # type: ignore[method-assign]
        try:
            sent, cut = 3 * MAX_PER_POLL, []
            with conn.faults.hold_loop():  # (only this thread ticks)
                for _ in range(5):  # (a first serve that came before the whole burst arrived proves nothing: again)
                    served.clear()
                    for _ in range(sent):
                        client.send_multipart([b"", p.encode(p.Hello(p.PROTOCOL_VERSION, "burst"))])
                    poll_until(lambda: conn.drive() and sum(served) > 0, what="the first batch answered")
                    assert served[-1] <= MAX_PER_POLL
                    if served[-1] == MAX_PER_POLL:  # cut at the cap with the rest waiting: marked for the next tick
                        cut.append(conn._loop._backlog)
                    poll_until(lambda: conn.drive() and sum(served) == sent, what="every request answered")
                    assert not conn._loop._backlog
                    while client.poll(0):
                        client.recv_multipart()
                    if cut:
                        break
            assert cut == [True]
        finally:
            client.close()
            ctx.term()


def test_drive_never_waits_for_a_tick_in_progress() -> None:
    entered, leave = threading.Event(), threading.Event()
    with decoder() as dec:
        dec._loop.call(lambda: (entered.set(), leave.wait(30)))  # the loop thread blocks inside its tick
        poll_until(entered.is_set, what="the loop thread entered its tick")
        try:
            assert dec.drive() is False
        finally:
            leave.set()
        poll_until(dec.drive, what="a tick once the loop's one ended")


def test_work_queued_by_a_caller_about_to_drive_does_not_wake_the_loop_thread() -> None:
    """Woken, the loop thread would take the tick and then wait for the GIL its caller holds (an engine
    running Python hands it over every 5 ms): the pull would start up to 5 ms late."""
    ran: list[str] = []
    config = config_for_tests(poll_interval_s=30.0)  # (the loop thread ticks only when woken)
    with KVConnector(KVCache.allocate(SPEC), config) as dec:
        wakeups = dec._loop.wakeups
        dec.wait_idle()  # (another caller's work wakes it)
        assert dec._loop.wakeups == wakeups + 1
        poll_until(lambda: not dec._loop.lock.locked(), what="the loop thread's tick ended")
        dec._loop.call(lambda: ran.append(threading.current_thread().name), driver=True)
        assert dec._loop.wakeups == wakeups + 1
        poll_until(lambda: ran or dec.drive() and False, what="the queued work ran")


def test_a_caller_about_to_drive_never_wakes_the_loop_thread_however_long_queueing_takes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On a starved host more than `DRIVEN_S` may pass between a driver's call marking itself as driving and
    checking that mark; it woke the loop thread then (a CI flake of the worker test below). Here every reading
    of the loop's clock is a second later than the one before."""
    import kvconnect.core.loop as loop_module

    ran: list[str] = []
    config = config_for_tests(poll_interval_s=30.0)
    with KVConnector(KVCache.allocate(SPEC), config) as dec:
        dec.wait_idle()
        poll_until(lambda: not dec._loop.lock.locked(), what="the loop thread's tick ended")
        wakeups = dec._loop.wakeups
        ticks = iter(range(10**9))
        slow = types.SimpleNamespace(monotonic=lambda: time.monotonic() + next(ticks), sleep=time.sleep)
        monkeypatch.setattr(loop_module, "time", slow)
        dec._loop.call(lambda: ran.append("ran"), driver=True)
        monkeypatch.undo()
        assert dec._loop.wakeups == wakeups
        poll_until(lambda: ran or dec.drive() and False, what="the queued work ran")


def parked_at_the_gate(loop: Loop) -> None:
    """Wake the loop thread and wait until it blocks on the held gate: until then it may be between ticks holding
    the connector's lock (its quiet check), and a driver's `call` would then wake it (the drive could not run)."""
    import inspect

    gate_line = (
        next(i for i, line in enumerate(inspect.getsourcelines(Loop._run)[0]) if "with self._gate, self.lock" in line)
        + inspect.getsourcelines(Loop._run)[1]
    )

    def parked() -> bool:
        frame = sys._current_frames().get(loop._thread.ident or -1)
        return frame is not None and frame.f_code is Loop._run.__code__ and frame.f_lineno == gate_line

    os.write(loop._wake_w, b"\0")
    poll_until(parked, what="the loop thread blocked on the held gate")


def test_the_vllm_worker_side_drives_its_pulls_from_the_engine_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """The plug-in's worker drives the connector in `on_orders` and `results`: with the loop thread held, a
    load still finishes through vLLM's own step calls alone. Its stats count from the worker's request: the
    checks before the pull is handed to the connector are part of requested -> usable (they were left out,
    0.1-0.4 ms of it in vLLM on an H200 host). The worker's clock here runs 5 s behind, as if they took 5 s."""
    from types import SimpleNamespace

    import kvconnect.vllm.worker as worker_module
    from kvconnect.harness.vllm_shapes import packed_views
    from kvconnect.vllm.metadata import PullOrder, StepOrders
    from kvconnect.vllm.worker import KVConnectWorker

    late = SimpleNamespace(monotonic=lambda: time.monotonic() - 5.0, time=time.time, sleep=time.sleep)
    monkeypatch.setattr(worker_module, "time", late)

    pre = PrefillProcess.launch()
    try:
        pre.wait_started()
        geometry = dict(layers=2, blocks=12, heads=2, tokens=32, head_dim=32, page="vllm:cpu-vec")
        pre.setup_views("LBHNC", geometry, 4)
        pre.wait_setup()
        params = pre.lease("worker-driven", [2, 9], 64)
        views, _ = packed_views("LBHNC", 2, 12, 2, 32, 32, seed=1)
        worker = KVConnectWorker(config_for_tests(), tp_rank=0, total_kv_heads=2, faults=FaultHooks())
        worker.register_kv_caches(views, num_blocks=12, block_size=32, tp_size=1, page="vllm:cpu-vec")
        conn = worker.connector
        assert conn is not None
        try:
            with conn.faults.hold_loop():
                parked_at_the_gate(conn._loop)
                wakeups = conn._loop.wakeups
                worker.bind_connector_metadata(
                    StepOrders(pulls=[PullOrder("worker-driven", params, [[4, 1]], 64, 0)], idle=True)
                )
                # the pull was started on this thread; the loop thread was not woken to take the tick first
                assert conn._loop.wakeups == wakeups
                handle = worker._loads["worker-driven"].handle
                done = poll_until(lambda: worker.transfer_results(set())[1], what="the load was reported")
            assert handle is not None and handle.stats.total_s >= 5.0 and handle.stats.queued_s >= 5.0
            assert handle.stats.posted_on == "engine" and worker._stats.data["posted_on"] == {"engine": 1}
            assert done == {"worker-driven"} and not worker.get_block_ids_with_load_errors()
            for local, remote in zip([4, 1], [2, 9], strict=True):
                assert conn.cache.block_bytes(local) == pre.ask("block", remote)
        finally:
            worker.close()
    finally:
        pre.stop()


def test_the_loop_thread_ticks_rarely_while_nothing_is_in_flight_or_held(prefill: PrefillProcess) -> None:
    """A loop thread ticking every millisecond takes the GIL from the engine's step 1,000 times a second even
    when the connector has nothing to do; quiet, it waits for the side channel or new work instead."""
    from kvconnect.core.loop import QUIET_TICK_MS

    with decoder() as dec:
        loop = dec._loop
        assert loop._timeout_ms() == QUIET_TICK_MS
        dec.lease("held", [1, 2])
        assert loop._timeout_ms() < QUIET_TICK_MS  # (a lease expires and its reader's notification is drained)
        dec.release(dec.held_leases()[0].lease_id)
        assert loop._timeout_ms() == QUIET_TICK_MS
        with dec.faults.hold_loop():
            handle = dec.pull(prefill.lease("quiet", [4]), [9])
            poll_until(lambda: dec.drive() and loop._timeout_ms() < QUIET_TICK_MS, what="a pull in flight")
            poll_until(lambda: dec.drive() and handle.done(), what="the pull ended")
        handle.wait(0)
        poll_until(lambda: loop._timeout_ms() == QUIET_TICK_MS, what="quiet again")


def test_an_idle_step_that_waits_only_for_leases_polls_and_never_spins() -> None:
    """On a GPU cache an idle step waiting for its pulls drives tick after tick (a gather's end is seen at
    once). Waiting for leases alone it must not: a lease is held for as long as its reader takes (seconds, for a
    request whose decode leg never comes), and a spinning engine thread keeps the process's other threads
    (vLLM's output thread, the loop thread) from the GIL all that time: on an H200 host, when PINs were still
    answered by the loop thread alone, the decode waited 0.4-0.6 ms more for each. Polling, the wait's own
    ticks answer a PIN within `DRIVE_EVERY_S`."""
    from kvconnect.harness.vllm_shapes import packed_views
    from kvconnect.vllm.worker import DRIVE_EVERY_S, KVConnectWorker

    class Waits(threading.Event):  # the idle wait's sleeps between ticks
        def __init__(self) -> None:
            super().__init__()
            self.timeouts: list[float | None] = []

        def wait(self, timeout: float | None = None) -> bool:
            self.timeouts.append(timeout)
            return super().wait(timeout)

    views, _ = packed_views("LBHNC", 2, 12, 2, 32, 32, seed=1)
    worker = KVConnectWorker(config_for_tests(), tp_rank=0, total_kv_heads=2, faults=FaultHooks())
    worker.register_kv_caches(views, num_blocks=12, block_size=32, tp_size=1, page="vllm:cpu-vec")
    assert worker._drive_every_s == DRIVE_EVERY_S  # (a CPU cache polls, pulls or not)
    try:
        worker._drive_every_s = 0.0  # what a GPU cache's worker has
        worker._idle, worker._leased, worker._changed = True, {"a lease nobody reads yet"}, Waits()
        assert worker.transfer_results(set()) == (set(), set(), set())
        assert worker._changed.timeouts and set(worker._changed.timeouts) == {DRIVE_EVERY_S}
    finally:
        worker.close()


@contextlib.contextmanager
def a_pin_unanswered(faults: FaultHooks | None = None) -> Iterator[tuple[PrefillProcess, Any, KVConnector]]:
    """A prefill process holding its PIN answers (until `answer_pins`) and a vLLM worker whose pull "late" has
    read its blocks (2, 9 into 4, 1) and waits only for that answer: (prefill, worker, its connector)."""
    from kvconnect.harness.vllm_shapes import packed_views
    from kvconnect.vllm.metadata import PullOrder, StepOrders
    from kvconnect.vllm.worker import KVConnectWorker

    pre = PrefillProcess.launch()
    try:
        pre.wait_started()
        pre.setup_views("LBHNC", dict(layers=2, blocks=12, heads=2, tokens=32, head_dim=32, page="vllm:cpu-vec"), 4)
        pre.wait_setup()
        views, _ = packed_views("LBHNC", 2, 12, 2, 32, 32, seed=1)
        decode = KVConnectWorker(config_for_tests(), tp_rank=0, total_kv_heads=2, faults=faults)
        decode.register_kv_caches(views, num_blocks=12, block_size=32, tp_size=1, page="vllm:cpu-vec")
        dec = decode.connector
        assert dec is not None
        try:
            dec.pull(pre.lease("first contact", [3], 32), [3]).wait(30)  # (the peer is ready: no handshake below)
            assert pre.ask("hold_pins") == "ok"
            params = pre.lease("answered late", [2, 9], 64)
            decode.bind_connector_metadata(StepOrders(pulls=[PullOrder("late", params, [[4, 1]], 64, 0)], idle=True))
            poll_until(lambda: (dec.drive(), dec.await_answers(0))[1], what="the transfer done, the PIN unanswered")
            yield pre, decode, dec
        finally:
            decode.close()
    finally:
        pre.stop()


def test_an_idle_step_waiting_only_for_the_prefills_answer_blocks_on_its_channel_and_reports_the_pull_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Once its transfer has ended, a pull waits only for the prefill's answer to its PIN. The idle step then
    blocks on the channels owing answers (`KVConnector.await_answers`, the GIL released) and drives as one comes,
    instead of spinning tick after tick: spinning, on an H200 host, it read an answer 0.25 ms after the prefill
    sent it. Here the prefill process holds its PIN answers until told, from another thread, while the decode
    waits; both waits are stretched to 30 s, so only the answer can end them early."""
    import kvconnect.vllm.worker as worker_module

    monkeypatch.setattr(worker_module, "IDLE_WAIT_S", 30.0)
    monkeypatch.setattr(worker_module, "ANSWER_WAIT_S", 30.0)
    with a_pin_unanswered() as (pre, decode, dec):
        drives, awaits, entered = [], [], threading.Event()
        drive, await_answers = dec.drive, dec.await_answers

        def counted_await(timeout_s: float) -> bool:
            entered.set()
            t0 = time.monotonic()
            try:
                return await_answers(timeout_s)
            finally:
                awaits.append(time.monotonic() - t0)

        def counted_drive() -> bool:
            drives.append(1)
            if len(drives) > 1:  # (a drive after the step's first is inside the wait, too)
                entered.set()
            return drive()

        dec.drive = counted_drive  # type: ignore[method-assign]
        dec.await_answers = counted_await  # type: ignore[method-assign]
        answer = threading.Thread(target=lambda: entered.wait(30) and pre.ask("answer_pins"))
        answer.start()
        decode._changed.clear()  # (the first pull's end set it: this step must wait for the second)
        _, recving, failed = decode.transfer_results(set())
        answer.join(30)
        assert recving == {"late"} and not failed  # reported by the step that waited for it
        assert len(awaits) == 1 and awaits[0] < 15, awaits  # woken by the answer ...
        assert len(drives) <= 3, len(drives)  # ... and not driving tick after tick meanwhile
        for local, remote in zip([4, 1], [2, 9], strict=True):
            assert dec.cache.block_bytes(local) == pre.ask("block", remote)


def test_an_answer_that_arrived_unsignalled_is_read_at_once_not_waited_for() -> None:
    """A channel's descriptor signals only news: once ZMQ has taken an answer's arrival in (while sending on that
    socket, say, another pull's PIN), the answer waits unsignalled, and blocking on the descriptor would sleep
    through it. The wait asks the socket first and does not block then."""
    import zmq

    with a_pin_unanswered(FaultHooks()) as (pre, _decode, dec), dec.faults.hold_loop():  # (only this thread reads)
        assert pre.ask("answer_pins") == "ok"
        (channel,) = [peer.channel for peer in dec._decode.peers.all()]
        poll_until(lambda: channel.sock.getsockopt(zmq.EVENTS) & zmq.POLLIN, what="the answer, taken in by ZMQ")
        assert dec.await_answers(5.0) is False  # (it would have slept the 5 s through)
        poll_until(lambda: dec.drive() and dec._decode.quiet(), what="the pull, finished by this thread")


def test_the_wait_for_an_answer_blocks_on_descriptors_past_1023() -> None:
    """A busy vLLM server holds more than a thousand descriptors. `select` refuses any past 1023 at once: an idle
    step waiting on such a channel returned at once, every time, and drove tick after tick without yielding."""
    import os

    from kvconnect.core.connector import wait_readable

    r, w = os.pipe()
    high = 1500  # (this process may hold 20,000: `ulimit -n`)
    os.dup2(r, high)
    try:
        t0 = time.monotonic()
        assert wait_readable([high], 0.05)  # nothing to read: it waits its whole timeout
        assert time.monotonic() - t0 >= 0.05
        os.write(w, b"x")
        assert wait_readable([high], 30.0)  # readable: at once
    finally:
        for fd in (r, w, high):
            os.close(fd)
