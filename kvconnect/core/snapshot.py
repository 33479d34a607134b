"""What a connector has done so far: its counters, and the snapshot it hands to /health and /metrics."""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec


@dataclass
class Counters:
    """Monotonic counters; written only inside a connector tick (loop thread or a driving thread)."""

    pulls_ok: int = 0
    pull_failures: dict[str, int] = field(default_factory=dict)  # by error class
    bytes_pulled: int = 0
    handshakes: int = 0
    handshake_failures: int = 0
    notifs: int = 0
    stale_notifs: int = 0
    unknown_lease_requests: int = 0  # PIN, CONFIRM or RELEASE naming a lease this side never granted (or forgot)

    def failed(self, error: BaseException) -> None:
        name = type(error).__name__
        self.pull_failures[name] = self.pull_failures.get(name, 0) + 1


class ConnectorSnapshot(msgspec.Struct, frozen=True):
    """A connector's state at one moment, for health checks and metrics (read from any thread)."""

    engine_id: str
    incarnation_id: str
    side_channel_port: int
    pulls_ok: int
    pull_failures: dict[str, int]
    bytes_pulled: int
    handshakes: int
    handshake_failures: int
    notifs: int
    stale_notifs: int
    side_channel_refused: int  # malformed, wrong version, or unauthenticated side-channel messages
    abandoned_reads: int  # given-up transfers that may still write into their blocks
    quarantined_blocks: int  # local blocks held until those transfers end
    leases_held: int
    lease_blocks_held: int
    leases_ended: dict[str, int]  # by lease state (held counts the ones still held)
    ipc_gather_unavailable: int = 0  # 1: the IPC gather could not be compiled here; same-host peers use NIXL
    unknown_lease_requests: int = 0  # lease requests naming a lease never granted here (or forgotten)
    claims_refused: int = 0  # params claiming a known prefill restarted or moved, refuted by its own handshake
    lease_renewals: int = 0  # renewals that held a lease longer: its decode's request still waited in its queue
