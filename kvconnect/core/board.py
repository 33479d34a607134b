"""The lease board: a prefill's held leases, readable by the decodes on its host without a round trip.

A pinned pull is usable once the prefill has answered its PIN (HELD). Over a same-host path (the CUDA IPC
gather) the read itself can take less time than that answer's trip through two busy engine processes, so without
the board the answer, not the bytes, decides when the pull is usable. The board lets such a decode decide alone,
after its read has ended:

- The prefill keeps a small file in shared memory (`BOARD_DIR`, mode 0600, a random name it gives in its
  handshake). A lease's slot is a hash of its lease id; the slot holds a binding (a hash of the lease id, the
  prompt digest the lease is bound to, its block ids and group sizes) and a state word (a generation, odd while
  the lease is held). The state word changes to "not held" when the lease ends, before any of its blocks can
  go back to the engine; a new lease in the slot first changes it to a new even generation, then the binding.
- A decode that has read a lease's blocks reads the state word, the binding, and the state word again. The
  same odd word twice around a binding equal to the one it computes from its own params and prompt means: the
  lease this decode was granted for this prompt and these blocks had not ended when the read was over, so no
  block of it had been handed back and written; the read is good. Anything else (another lease in the slot, an
  ended lease, a binding that differs, no board) and it waits for the PIN's answer, as without a board.
- The PIN, and the CONFIRM that ends the lease, are still sent; only the wait for the PIN's answer goes. So a
  replay of the same params and the same prompt while the lease is held may read too (it reads that prompt's
  KV, nothing else); after the lease ended it is refused as before.

Nobody but the prefill's own user can plant or break a board (a decode checks before it trusts one):

- The prefill creates it under a temporary name (`kvconnect-board-tmp-...`, never opened as a board), holds an
  exclusive `flock` on it for life (how a later board sees it is live: a board whose owner died is removed by the
  next one created), reserves its blocks (`posix_fallocate`: a full shared memory gives no board, never a SIGBUS at
  a later grant), writes its header, then links it into place. Both sides read and write with `pread`/`pwrite`,
  never a mapping: a board truncated under a reader reads short, it does not kill the reader. `close` clears
  every held slot before the file goes.
- A decode opens only a name of the board form, under `BOARD_DIR`, non-blocking and without following links (a
  FIFO or a link named like a board hangs nobody), and only a regular file of its own user, mode 0600, one link,
  of the exact size, whose header names the incarnation that answered the handshake, of a prefill that reported
  this kernel's boot id. A prefill on another host (or container) has no such file here, and the decode uses
  answers.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import itertools
import logging
import os
import re
import secrets
import stat
import struct
from collections.abc import Sequence

import numpy as np

log = logging.getLogger(__name__)
BOARD_DIR = "/dev/shm"
NAME = re.compile(r"kvconnect-board-[0-9a-f]{32}\Z")
TMP_NAME = re.compile(r"kvconnect-board-tmp-[0-9a-f]{32}\Z")
MAGIC, VERSION = b"KVCBOARD", 1
SLOTS, SLOT_BYTES, HEADER_BYTES = 16384, 32, 64  # 512 KiB: a slot per lease id hash (a taken slot: no board)
BINDING_BYTES = 24
_HEADER = struct.Struct("<8sII32s")  # magic, version, slots, incarnation id (ASCII)
_WORD = struct.Struct("<Q")
SIZE = HEADER_BYTES + SLOTS * SLOT_BYTES


def slot_of(lease_id: str) -> int:
    return int.from_bytes(hashlib.blake2b(lease_id.encode(), digest_size=8).digest(), "little") % SLOTS


def binding(lease_id: str, prompt: bytes, block_ids: Sequence[int] | np.ndarray, group_sizes: Sequence[int]) -> bytes:
    """What a slot binds a lease to: its id, its prompt digest, its block ids and (hybrid models) group sizes."""
    h = hashlib.blake2b(digest_size=BINDING_BYTES)
    groups = [int(n) for n in group_sizes] if len(group_sizes) > 1 else []  # (one group: the same as none)
    for part in (lease_id.encode(), prompt, np.asarray(groups, dtype="<i8").tobytes()):
        h.update(len(part).to_bytes(4, "little"))
        h.update(part)
    h.update(np.asarray(block_ids, dtype="<i8").tobytes())
    return h.digest()


def boot_id() -> str:
    """The running kernel's boot id: peers reporting the same one run on this host ("" where it is unknown)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


class BoardWriter:
    """The prefill's board (one per connector): `held` at a grant and `ended` at the lease's end, both under the lease
    table's lock (the prefill half's `Lender` shows each grant and end: `prefill/lender.py`)."""

    def __init__(self, fd: int, path: str, incarnation_id: str) -> None:
        self._fd, self.path = fd, path
        self.name = os.path.basename(path)
        self._owner: dict[int, str] = {}  # slot -> the held lease written there
        self._gens = itertools.count(1)
        self._closed = False

    @classmethod
    def create(cls, incarnation_id: str, directory: str = BOARD_DIR) -> BoardWriter | None:
        """A new board (None where shared memory cannot hold one: decodes then use answers)."""
        if not os.path.isdir(directory):
            return None
        remove_orphans(directory)
        token = secrets.token_hex(16)
        tmp, path = (
            os.path.join(directory, f"kvconnect-board-tmp-{token}"),
            os.path.join(directory, f"kvconnect-board-{token}"),
        )
        try:
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        except OSError as e:
            log.info("no lease board (%s): same-host decodes wait for PIN answers", e)
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # (held for life: how a later board sees it is live)
            os.fchmod(fd, 0o600)  # (whatever the umask)
            os.posix_fallocate(fd, 0, SIZE)  # (ENOSPC now, not a SIGBUS at a grant)
            header = _HEADER.pack(MAGIC, VERSION, SLOTS, incarnation_id.encode()).ljust(HEADER_BYTES, b"\0")
            os.pwrite(fd, header, 0)
            os.link(tmp, path)
            os.unlink(tmp)
            return cls(fd, path, incarnation_id)
        except OSError as e:
            os.close(fd)
            for name in (tmp, path):
                with contextlib.suppress(OSError):
                    os.unlink(name)
            log.info("no lease board (%s): same-host decodes wait for PIN answers", e)
            return None

    def held(self, lease_id: str, prompt: bytes, block_ids: Sequence[int], group_sizes: Sequence[int]) -> None:
        slot = slot_of(lease_id)
        if self._owner.get(slot, lease_id) != lease_id or self._closed:
            return  # another held lease has the slot: this one is read with answers (or the connector closed)
        off, gen = HEADER_BYTES + slot * SLOT_BYTES, next(self._gens)
        with contextlib.suppress(OSError):
            os.pwrite(self._fd, _WORD.pack(gen << 1), off)  # a new generation, not held, before the binding changes
            os.pwrite(self._fd, binding(lease_id, prompt, block_ids, group_sizes), off + 8)
            os.pwrite(self._fd, _WORD.pack(gen << 1 | 1), off)
            self._owner[slot] = lease_id

    def ended(self, lease_id: str) -> None:
        slot = slot_of(lease_id)
        if self._owner.get(slot) != lease_id or self._closed:
            return
        self._clear(slot)
        del self._owner[slot]

    def _clear(self, slot: int) -> None:
        off = HEADER_BYTES + slot * SLOT_BYTES
        with contextlib.suppress(OSError):
            raw = os.pread(self._fd, 8, off)
            word = _WORD.unpack(raw)[0] if len(raw) == 8 else 0
            os.pwrite(self._fd, _WORD.pack(word & ~1), off)

    def close(self) -> None:
        if self._closed:
            return
        for slot in list(self._owner):  # (a decode that has the file open must not see a held lease any more)
            self._clear(slot)
        self._owner.clear()
        self._closed = True
        with contextlib.suppress(OSError):
            os.unlink(self.path)
        os.close(self._fd)


class BoardReader:
    """A decode's view of one prefill's board."""

    def __init__(self, fd: int) -> None:
        self._fd = fd

    @classmethod
    def open(cls, name: str, incarnation_id: str, peer_boot_id: str, directory: str = BOARD_DIR) -> BoardReader | None:
        """The board a handshake named, if it is here, safe to read and that incarnation's (else None: use answers)."""
        if not name or not NAME.match(name) or not peer_boot_id or peer_boot_id != boot_id():
            return None
        try:
            fd = os.open(os.path.join(directory, name), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            return None  # (another host's, or another container's shared memory)
        try:
            st = os.fstat(fd)
            own = stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) == 0o600
            header = os.pread(fd, _HEADER.size, 0) if own and st.st_nlink == 1 and st.st_size == SIZE else b""
        except OSError:
            header = b""
        if len(header) != _HEADER.size:
            os.close(fd)
            return None
        magic, version, slots, incarnation = _HEADER.unpack(header)
        if (magic, version, slots) != (MAGIC, VERSION, SLOTS) or incarnation.rstrip(b"\0") != incarnation_id.encode():
            os.close(fd)
            return None
        return cls(fd)

    def holds(self, lease_id: str, expected: bytes) -> bool:
        """Whether the lease is held now, bound to `expected` (`binding`): the state word and binding, then the word."""
        off = HEADER_BYTES + slot_of(lease_id) * SLOT_BYTES
        try:
            first = os.pread(self._fd, 8 + BINDING_BYTES, off)
            again = os.pread(self._fd, 8, off)
        except OSError:
            return False
        if len(first) != 8 + BINDING_BYTES or len(again) != 8:
            return False  # (a board cut short under us: nothing on it counts)
        (word,) = _WORD.unpack_from(first)
        return bool(word & 1) and first[:8] == again and first[8:] == expected

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self._fd)


def remove_orphans(directory: str) -> None:
    """Remove this user's boards (and half-made ones) whose owner is gone (nobody holds their lock)."""
    with contextlib.suppress(OSError):
        for name in os.listdir(directory):
            if not NAME.match(name) and not TMP_NAME.match(name):
                continue
            path = os.path.join(directory, name)
            with contextlib.suppress(OSError):
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
                try:
                    st = os.fstat(fd)
                    if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid():
                        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # (raises while its owner lives)
                        os.unlink(path)
                finally:
                    os.close(fd)
