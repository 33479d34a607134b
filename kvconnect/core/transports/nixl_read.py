"""The NIXL READ transport: one READ per pull over descriptor lists prepared once per peer.

The remote list (every unit of every remote block, in NIXL's strided form) is prepared at handshake, the
local one once per local target (the cache, or a staging cache) and shared by every peer that reads into
it. A pull passes only two index arrays, issued sorted by remote block id so that runs of consecutive
blocks on both sides merge into one descriptor. The READ carries the notification that tells the
prefill side it has been read.
"""

from __future__ import annotations

import numpy as np

from kvconnect.core.agent import NixlAgent, PreppedList, XferHandle, XferState
from kvconnect.core.plan.descriptors import PairPlan, PullPlan
from kvconnect.core.transports.base import Posted, Transport, TransportKind


class PostedRead(Posted):
    abandonable = True  # NIXL cannot cancel a posted READ: a given-up one may still land

    def __init__(self, agent: NixlAgent, xfer: XferHandle) -> None:
        self._agent = agent
        self._xfer = xfer

    def state(self) -> XferState:
        return self._agent.state(self._xfer)

    def release(self) -> None:
        self._agent.release(self._xfer)

    def issued_descs(self) -> int | None:
        return self._agent.telemetry_descs(self._xfer)


class NixlRead(Transport):
    kind = TransportKind.NIXL
    notifies = True

    def __init__(self, agent: NixlAgent, pair: PairPlan, local_list: PreppedList, remote_list: PreppedList) -> None:
        self._agent = agent
        self._pair = pair
        self._local = local_list
        self._remote = remote_list

    def order(self, local_ids: np.ndarray, remote_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return self._pair.order_checked(local_ids, remote_ids)

    def post(
        self, local_ids: np.ndarray, remote_ids: np.ndarray, num_tokens: int | None, notif: bytes
    ) -> tuple[Posted, XferState, PullPlan]:
        plan = self._pair.plan_validated(local_ids, remote_ids, num_tokens)
        xfer = self._agent.read(self._local, plan.local_indices, self._remote, plan.remote_indices, notif)
        posted = PostedRead(self._agent, xfer)
        try:
            state = self._agent.post(xfer)
        except BaseException:
            posted.release()
            raise
        return posted, state, plan
