"""How a pull ends, exactly once: usable, or failed with nothing of it left behind.

- **Success**: the bytes are counted, the handle finished, the request reported (a request read from several
  prefill ranks once, when its group ends).
- **Failure**: the pull's pin is dropped (a RELEASE as its reader, so the prefill frees the blocks now rather
  than at the pin's deadline), the failure is logged (a few lines a second, then a count: clients choose how
  many pulls fail), a transfer still in flight is handed to `AbandonedReads` (it may still write into the
  pull's blocks), or else the pull's move settles at once; then the handle is finished with the error and the
  request reported.

Every part of the decode ends pulls through here (loop thread, inside a tick).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from kvconnect.core.decode.abandoned import AbandonedReads
from kvconnect.core.decode.pull import PinState, Pull, PullPhase
from kvconnect.core.decode.releases import Releases
from kvconnect.core.errors import KVConnectError
from kvconnect.core.snapshot import Counters
from kvconnect.core.wire.logs import LogLimiter

log = logging.getLogger(__name__)
FAILURE_LOGS_PER_S = 10.0  # failed pulls logged per second at most (the rest are counted into the next line)
# on_done(the request's pull, its error or None): once per request, inside a tick
DoneCallback = Callable[[Pull, KVConnectError | None], None]


class Endings:
    def __init__(self, releases: Releases, counters: Counters, on_done: DoneCallback) -> None:
        self.releases, self._counters, self._on_done = releases, counters, on_done
        self.abandoned = AbandonedReads()  # given-up transfers that may still land
        self._failure_logs = LogLimiter(FAILURE_LOGS_PER_S)

    def succeed(self, pull: Pull) -> None:
        self._counters.bytes_pulled += pull.handle.stats.bytes
        pull.finish(None)
        self._report(pull, None)

    def fail(self, pull: Pull, error: KVConnectError) -> None:
        if pull.ended:
            return
        if pull.pin is not PinState.NONE:
            self.releases.for_pull(pull)
        if self._failure_logs.allow():
            log.warning("%s%s", pull.failure_line(error), self._failure_logs.suppressed())
        if pull.phase is PullPhase.POSTED and pull.move is not None:
            # its transfer runs on (given up, refused, peer dropped): its blocks wait for it
            self.abandoned.add(pull)
        elif pull.move is not None:
            pull.move.settle()  # nothing of it can land any more
        pull.finish(error)
        self._report(pull, error)

    def _report(self, pull: Pull, error: KVConnectError | None) -> None:
        if pull.group is not None:
            if not pull.group.part_done(pull, error):
                return
            pull = pull.group.parent
        if error is None:
            self._counters.pulls_ok += 1
        else:
            self._counters.failed(error)
        self._on_done(pull, error)
