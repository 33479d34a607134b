"""Transfers given up on (deadline, cancellation, peer dropped) that may still write into their blocks.

NIXL cannot cancel a posted READ: over UCX/TCP a hung peer that resumes still delivers the data, after
`release_xfer_handle` and even after `remove_remote_agent` (tests/test_faults.py shows it). So a given-up move
is kept and polled until it ends (done, error, or the peer is gone); until then its pull's
`PullHandle.settled()` is False and the owner must not reuse the blocks. Once it ends, the move settles (its
handle, staging blocks and its link's hold on the peer's agent go back). Loop thread only, but `num_blocks`
(read from any thread).
"""

from __future__ import annotations

import logging

from kvconnect.core.decode.pull import Pull
from kvconnect.core.errors import KVConnectError, PeerGoneError
from kvconnect.core.transports.base import XferState
from kvconnect.core.wire.logs import loggable

log = logging.getLogger(__name__)


class AbandonedReads:
    def __init__(self) -> None:
        self._pulls: list[Pull] = []

    def add(self, pull: Pull) -> None:
        """Keep polling `pull`'s move until it ends (a pull without one has nothing in flight)."""
        if pull.move is None:
            return
        pull.handle._unsettled = True
        self._pulls.append(pull)

    def __len__(self) -> int:
        return len(self._pulls)

    def uses(self, peer_key: str) -> bool:
        """Whether a given-up transfer from that peer may still land (the peer is then not forgotten at the cap)."""
        return any(pull.peer_key == peer_key for pull in self._pulls)

    @property
    def num_blocks(self) -> int:
        return sum(len(pull.local_block_ids) for pull in list(self._pulls))

    def poll(self) -> None:
        for pull in list(self._pulls):
            assert pull.move is not None
            try:
                state = pull.move.state()
            except PeerGoneError:
                state = XferState.ERR  # the connection is gone: nothing more can land
            except KVConnectError as e:
                log.warning(
                    "abandoned pull %s: cannot poll its transfer (%s); treating it as ended",
                    loggable(pull.handle.request_id),
                    loggable(e, 300),
                )
                state = XferState.ERR
            if state is XferState.PROC:
                continue
            self._pulls.remove(pull)
            _settle(pull)
            n = len(pull.local_block_ids)
            log.info(
                "abandoned pull %s: its transfer ended (%s); %d local blocks are safe again",
                pull.handle.request_id,
                state.value,
                n,
            )

    def close(self) -> None:
        for pull in self._pulls:
            _settle(pull)
        self._pulls.clear()


def _settle(pull: Pull) -> None:
    assert pull.move is not None
    pull.move.settle()
    pull.handle._unsettled = False
