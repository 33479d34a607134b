"""The connector's loop: one thread that serves the side channel and runs ticks, and `drive`, by which an
engine's own thread runs a tick itself.

Threading: the side-channel server, the NIXL agent and the peers' sockets are used only inside a tick, and
ticks are serialised by one lock. The loop thread runs them; the engine's thread may run one too (`drive`)
when the loop is not in one, so that a pull is posted and finished, and a decode's lease request answered,
without waiting for the interpreter to switch threads (a Python engine loop holds the GIL between its waits).
The loop thread waits on the server socket's file descriptor (`zmq.FD`), never on the socket itself: a ZMQ
socket may not be polled by one thread while another reads it. Other threads only enqueue work (`call`). No
tick blocks on a peer. On a CUDA cache the loop thread works on the cache's device with a relaxed stream-capture
mode (`device.py`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq

from kvconnect.core.affinity import place_current_thread
from kvconnect.core.device import enter_device_thread
from kvconnect.core.errors import KVConnectError

log = logging.getLogger(__name__)

DRIVEN_S = 0.05  # a caller that drove within this long is still driving: the loop thread leaves the ticks to it
DRIVEN_TICK_MS = 10  # ... and wakes this often to see whether it still does (or at once for the side channel)
# with nothing in flight or held (`quiet`), the loop thread ticks this often: new work wakes it anyway (the side
# channel, `call`), and a thread ticking every millisecond takes the GIL from an engine's step 1,000 times a second
QUIET_TICK_MS = 50


class Loop:
    def __init__(
        self,
        name: str,
        tick: Callable[[], None],
        server_sock: zmq.Socket[Any],
        serve: Callable[[], object],
        busy: Callable[[], bool],
        poll_interval_s: float,
        cpus: frozenset[int],
        device: Any = None,
        gate: Any = None,
        quiet: Callable[[], bool] = lambda: False,
    ) -> None:
        """`tick` runs under the loop's lock; `serve` answers what waits on the side channel (`server_sock`), in
        every tick, on whichever thread runs it;
        `busy` says whether a transfer is in flight (the loop then spins); `quiet` whether nothing is in flight or
        held (it then ticks every `QUIET_TICK_MS`); `device` is the cache's torch CUDA
        device (None on the CPU); `gate` is a lock the loop thread takes before each tick (fault injection)."""
        self._tick_fn = tick
        self._sock = server_sock
        self._serve = serve
        self._busy = busy
        self._quiet = quiet
        self._tick_ms = max(int(poll_interval_s * 1000), 1)
        self._cpus = cpus
        self._device = device
        self._gate = gate if gate is not None else contextlib.nullcontext()
        self._inbox: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._stop = threading.Event()
        self.lock = threading.Lock()  # one tick at a time, on the loop thread or a driving thread
        self._driven_until = 0.0  # until then a caller is driving: the loop thread leaves the ticks to it
        self._backlog = False  # the last serve left messages waiting (their descriptor will not signal again)
        self.wakeups = 0  # times `call` woke the loop thread
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def closed(self) -> bool:
        return self._stop.is_set()

    def call(self, fn: Callable[[], None], driver: bool = False) -> None:
        """Run `fn` in the next tick (any thread). `driver`: the caller drives right after (`drive`), so the
        loop thread is not woken for it: woken, it would take the tick first and then wait for the GIL the
        caller holds (up to the interpreter's 5 ms switch interval while an engine runs Python)."""
        if self._stop.is_set():
            raise KVConnectError("connector is closed")
        # (a tick running now would make the caller's drive fail: then the loop thread runs it)
        driving = driver and not self.lock.locked() and self._on_cache_device()
        if driving:
            self._driven_until = time.monotonic() + DRIVEN_S
        self._inbox.put(fn)
        if driving or time.monotonic() < self._driven_until:
            return  # the driving thread runs it at its next `drive` (the loop thread at its next tick)
        self.wakeups += 1
        try:
            os.write(self._wake_w, b"\0")  # wake the loop now, not at its next tick
        except BlockingIOError:  # the pipe is full: a wake-up is pending anyway
            pass

    def _run(self) -> None:
        place_current_thread(self._cpus, "connector loop")  # (see affinity.py)
        if self._device is not None:  # NIXL and the IPC path need this device's context on this thread
            enter_device_thread(self._device)
        with self.lock:
            sock_fd = self._sock.getsockopt(zmq.FD)  # (readable when the socket's state may have changed)
        poller = zmq.Poller()
        poller.register(sock_fd, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        while not self._stop.is_set():
            try:
                driven = time.monotonic() < self._driven_until
                timeout_ms = 0 if self._backlog else DRIVEN_TICK_MS if driven else self._timeout_ms()
                ready = dict(poller.poll(timeout_ms))
                if self._wake_r in ready:
                    try:
                        os.read(self._wake_r, 4096)
                    except BlockingIOError:
                        pass
                side = sock_fd in ready or self._backlog
                if not side and time.monotonic() < self._driven_until:
                    continue  # the driving thread ticks: a tick here would hold the lock while it waits for the GIL
                with self._gate, self.lock:
                    self.tick()  # (serves the side channel first)
            except Exception:  # keep serving; the failing pull or message was already answered
                log.exception("kvconnect loop iteration failed")

    def _timeout_ms(self) -> int:
        if self._busy():
            return 0
        with self.lock:  # (the state `quiet` reads changes inside ticks)
            quiet = self._quiet() and self._inbox.empty()
        return QUIET_TICK_MS if quiet else self._tick_ms

    def tick(self) -> None:
        """The side channel, queued work, then the connector's own tick (under `lock`). The socket's descriptor
        signals a change once: what one serve leaves waiting (it answers a bounded batch) is served at once."""
        try:
            self._serve()
            self._backlog = bool(int(self._sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN)
        except Exception:  # (the ticks' work goes on: a message that failed was answered or dropped)
            log.exception("kvconnect side channel failed")
        while True:
            try:
                self._inbox.get_nowait()()
            except queue.Empty:
                break
        self._tick_fn()

    def drive(self) -> bool:
        """Run one tick on the calling thread, unless a tick is running now; never blocks, never raises.

        A tick serves the side channel first: a prefill's engine thread that drives while it waits for its
        leases answers the decodes' PINs itself, instead of waiting for the loop thread to get the GIL. While
        a caller drives (it did within `DRIVEN_S`), the loop thread ticks only when the side channel signals,
        and takes over again once the caller stops. A CUDA cache is driven only from a thread whose
        current device is the cache's. Returns whether a tick ran."""
        if self._stop.is_set() or not self._on_cache_device() or not self.lock.acquire(blocking=False):
            return False
        try:
            self._driven_until = time.monotonic() + DRIVEN_S
            self.tick()
        except Exception:
            log.exception("kvconnect tick failed on a driving thread")
        finally:
            self.lock.release()
        return True

    def on_loop_thread(self) -> bool:
        """Whether the calling thread is the loop's own (not a driving caller's)."""
        return threading.current_thread() is self._thread

    def _on_cache_device(self) -> bool:
        if self._device is None:
            return True
        import torch

        return bool(torch.cuda.current_device() == self._device.index)

    def wait_idle(self, timeout_s: float = 5.0) -> None:
        """Block until the loop has processed everything queued so far (tests, shutdown)."""
        done = threading.Event()
        self.call(done.set)
        if not done.wait(timeout_s):
            raise KVConnectError(f"connector loop did not answer within {timeout_s}s")

    def stop(self) -> bool:
        """Stop the thread (the caller then closes what ticks use, under `lock`); False if already stopped."""
        if self._stop.is_set():
            return False
        self._stop.set()
        with contextlib.suppress(BlockingIOError):
            os.write(self._wake_w, b"\0")  # (out of its poll now, not at its next tick)
        self._thread.join(timeout=10)
        return True

    def close(self) -> None:
        os.close(self._wake_r)
        os.close(self._wake_w)
