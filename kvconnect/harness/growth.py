"""What a long-lived connector keeps: the size of every container reachable from it through kvconnect's objects.

A server that makes thousands of pulls must hold no state per finished pull: a dict of ended leases, a list of
handles, a set of seen request ids would grow with the pulls, and anything that walks them (a tick, a sweep, a
snapshot) would slow down with the server's age. `sizes` walks the object graph from a root (a `KVConnector`)
through attributes of kvconnect's own classes, into the values of small dicts and lists (a peer per remote
engine, a transport per kind), and records the length of each dict, list, set, deque and the like it passes by
its path (`root._lender.leases`). `grown` compares two walks.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence, Set
from typing import Any

PACKAGE = "kvconnect."
MAX_DEPTH = 8
FAN_OUT = 64  # a container's items are walked when it holds at most this many (a peer table, a transport list)


def _ours(obj: Any) -> bool:
    return type(obj).__module__.startswith(PACKAGE)


def _attributes(obj: Any) -> list[tuple[str, Any]]:
    out: dict[str, Any] = dict(getattr(obj, "__dict__", {}))
    for cls in type(obj).__mro__:
        for name in getattr(cls, "__slots__", ()):
            if name not in out and hasattr(obj, name):
                out[name] = getattr(obj, name)
    for name in getattr(type(obj), "__struct_fields__", ()):
        out.setdefault(name, getattr(obj, name, None))
    return list(out.items())


def _sized(value: Any) -> bool:
    return isinstance(value, (Mapping, Set)) or (
        isinstance(value, Sequence) and not isinstance(value, (str, bytes, bytearray, memoryview, tuple))
    )


def sizes(root: Any, name: str = "root") -> dict[str, int]:
    """{path: length} of every container reachable from `root` (see the module's text); each object walked once."""
    out: dict[str, int] = {}
    seen: set[int] = set()

    def walk(obj: Any, path: str, depth: int) -> None:
        if id(obj) in seen or depth > MAX_DEPTH:
            return
        seen.add(id(obj))
        if _sized(obj):
            try:
                out[path] = len(obj)
            except TypeError:  # (an object that looks like a container but has no length)
                return
            if len(obj) <= FAN_OUT:
                items = obj.items() if isinstance(obj, Mapping) else enumerate(list(obj))
                for key, value in list(items):
                    if _ours(value) or _sized(value):
                        walk(value, f"{path}[{key!r}]" if isinstance(obj, Mapping) else f"{path}[]", depth + 1)
            return
        if not _ours(obj):
            return
        for attr, value in _attributes(obj):
            if _ours(value) or _sized(value):
                walk(value, f"{path}.{attr}", depth + 1)

    walk(root, name, 0)
    return out


def grown(before: Mapping[str, int], after: Mapping[str, int], at_least: int) -> dict[str, tuple[int, int]]:
    """{path: (before, after)} of the containers that grew by `at_least` or more (new paths count from 0)."""
    return {path: (before.get(path, 0), n) for path, n in sorted(after.items()) if n - before.get(path, 0) >= at_least}


def rss_bytes(pid: int | str = "self") -> int:
    """A process's resident memory (Linux `/proc`; 0 where that cannot be read)."""
    import os

    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0
