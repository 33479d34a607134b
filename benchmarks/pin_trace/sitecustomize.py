"""Where a PIN's round trip goes, inside real engines: a trace of kvconnect's side channel in every process.

Put this directory first on PYTHONPATH and set KVCONNECT_PIN_TRACE to a directory; every Python process started with
that environment (vLLM's servers included) then appends lines `monotonic_ns thread event args... thread_cpu_ns` to
`DIR/p<pid>.log`. The clock is the host's monotonic clock, so lines of two processes on one host compare. `report.py
DIR` joins them. Events: a decode's PIN built and sent (`pin_sent`, `sent_done`), the prefill's server handling a
request (`ans_in`, `answer`, `ans_out`), the decode's tick reading answers (`recv`) and handling the PIN's
(`pin_answer`), a vLLM worker inside `transfer_results` (`tr_in`, `tr_out`) and `bind_connector_metadata` (`bind_in`,
`bind_out`), the worker's and the connector's start of a pull (`start_in`, `start_out`, `pull_in`, `pull_out`) and
its pickup by a tick (`pickup`), a pull made usable (`usable`) and reported to vLLM (`reported`), and connector ticks
over 0.1 ms (`slow_tick`). A diagnostic: it wraps private methods, and each event costs a few microseconds.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

_DIR = os.environ.get("KVCONNECT_PIN_TRACE", "")
_lock = threading.Lock()
_out: list[Any] = []


def rec(*args: object) -> None:
    with _lock:
        if not _out:
            _out.append(open(f"{_DIR}/p{os.getpid()}.log", "a", buffering=1))  # noqa: SIM115 (kept open)
        fields = (
            time.monotonic_ns(),
            threading.current_thread().name[:12].replace(" ", "_"),
            *args,
            time.thread_time_ns(),
        )
        _out[0].write(" ".join(str(x) for x in fields) + "\n")


def _lender(m: Any) -> None:
    answer = m.Lender.answer

    def traced(self: Any, msg: Any) -> Any:
        reply = answer(self, msg)
        rec("answer", msg.action.value, msg.lease_id[:8], msg.seq)
        return reply

    m.Lender.answer = traced


def _puller(m: Any) -> None:
    start = m.Puller._start

    def traced(self: Any, pull: Any) -> None:
        rec("pickup", pull.lease_id[:8])
        start(self, pull)

    m.Puller._start = traced


def _confirm(m: Any) -> None:
    send_pin, answer = m.LeaseConfirmation._send_pin, m.LeaseConfirmation.answer

    def traced_send(self: Any, peer: Any, pull: Any) -> None:
        rec("pin_sent", pull.lease_id[:8])
        send_pin(self, peer, pull)

    def traced_answer(self: Any, peer: Any, pull: Any, reply: Any) -> None:
        rec("pin_answer", pull.lease_id[:8], pull.pin.name)
        answer(self, peer, pull, reply)

    m.LeaseConfirmation._send_pin, m.LeaseConfirmation.answer = traced_send, traced_answer


def _handshake(m: Any) -> None:
    server_answer, send, receive = m.SideChannelServer._answer, m.PeerChannel.send, m.PeerChannel.receive

    def traced_answer(self: Any, payload: bytes) -> Any:
        rec("ans_in")
        try:
            return server_answer(self, payload)
        finally:
            rec("ans_out")

    def traced_send(self: Any, msg: Any) -> None:
        send(self, msg)
        rec("sent_done", getattr(msg, "lease_id", "-")[:8])

    def traced_receive(self: Any) -> Any:
        out = receive(self)
        if out:
            rec("recv", len(out))
        return out

    m.SideChannelServer._answer, m.PeerChannel.send, m.PeerChannel.receive = traced_answer, traced_send, traced_receive


def _connector(m: Any) -> None:
    tick, pull = m.KVConnector._tick, m.KVConnector.pull

    def traced_pull(self: Any, *args: Any, **kwargs: Any) -> Any:
        rec("pull_in")
        try:
            return pull(self, *args, **kwargs)
        finally:
            rec("pull_out")

    m.KVConnector.pull = traced_pull

    def traced(self: Any) -> None:
        t0 = time.monotonic_ns()
        tick(self)
        took = time.monotonic_ns() - t0
        if took > 100_000:
            rec("slow_tick", took // 1000)

    m.KVConnector._tick = traced


def _worker(m: Any) -> None:
    worker = m.KVConnectWorker
    results, pull_done, report = worker.transfer_results, worker._pull_done, worker._report_timeline
    bind = m.KVConnectWorker.bind_connector_metadata

    def traced(self: Any, finished: set[str]) -> Any:
        rec("tr_in", int(self._idle), len(self._loads), len(self._leased))
        try:
            return results(self, finished)
        finally:
            rec("tr_out")

    def traced_done(self: Any, stats: Any, error: Any) -> None:
        pull_done(self, stats, error)
        rec("usable", stats.request_id[-8:], int(error is None))

    def traced_report(self: Any, load: Any) -> None:
        rec("reported", load.order.request_id[-8:])
        report(self, load)

    def traced_bind(self: Any, orders: Any) -> None:
        rec("bind_in", len(orders.pulls), len(orders.leases), int(orders.idle))
        bind(self, orders)
        rec("bind_out")

    start = m.KVConnectWorker._start

    def traced_start(self: Any, order: Any) -> None:
        rec("start_in", order.request_id[-8:])
        start(self, order)
        rec("start_out")

    m.KVConnectWorker._start = traced_start
    m.KVConnectWorker.transfer_results, m.KVConnectWorker._pull_done = traced, traced_done
    m.KVConnectWorker._report_timeline, m.KVConnectWorker.bind_connector_metadata = traced_report, traced_bind


PATCHES: dict[str, Callable[[Any], None]] = {
    "kvconnect.core.prefill.lender": _lender,
    "kvconnect.core.decode.confirm": _confirm,
    "kvconnect.core.decode.puller": _puller,
    "kvconnect.core.wire.handshake": _handshake,
    "kvconnect.core.connector": _connector,
    "kvconnect.vllm.worker": _worker,
}


class _Hook(importlib.abc.MetaPathFinder):
    """Wraps the traced modules' classes right after they are first imported."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name not in PATCHES:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def traced_exec(module: Any) -> None:
            exec_module(module)
            PATCHES[name](module)

        spec.loader.exec_module = traced_exec  # type: ignore[method-assign]
        return spec


if _DIR:
    sys.meta_path.insert(0, _Hook())
