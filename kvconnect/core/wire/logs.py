"""Log lines about what peers and clients send: their ids made printable, and a rate limit.

A peer chooses its ids and how often it is refused; neither may choose what the log says or how much of it
there is. `loggable` truncates an id and replaces anything outside printable ASCII (a newline would forge a
whole line); a `LogLimiter` lets a few lines a second through and counts the rest into the next one.
"""

from __future__ import annotations

import time
from collections.abc import Callable

MAX_LOGGED_ID = 64  # characters of a peer-sent id in a log line


def loggable(value: object, limit: int = MAX_LOGGED_ID) -> str:
    """`value` as text fit for a log line: at most `limit` characters, each printable ASCII ('?' otherwise)."""
    text = str(value)
    cut = text[:limit]
    return "".join(c if " " <= c <= "~" else "?" for c in cut) + ("..." if len(text) > limit else "")


class LogLimiter:
    """A token bucket of `per_s` lines a second; `allow()` says whether this line may be logged, and
    `suppressed()` (once, after an allowed line) how many were dropped since the last one."""

    def __init__(self, per_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._per_s = per_s
        self._clock = clock
        self._budget = per_s
        self._at = clock()
        self._dropped = 0

    def allow(self) -> bool:
        now = self._clock()
        self._budget = min(self._per_s, self._budget + (now - self._at) * self._per_s)
        self._at = now
        if self._budget < 1:
            self._dropped += 1
            return False
        self._budget -= 1
        return True

    def suppressed(self) -> str:
        """ " (N more suppressed)" for the line being logged, or ""; resets the count."""
        dropped, self._dropped = self._dropped, 0
        return f" ({dropped} more suppressed)" if dropped else ""
