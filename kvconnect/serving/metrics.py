"""Prometheus metrics of one worker (its own registry, so several workers can share a process).

Names follow vLLM's `nixl_*` connector metrics where they fit, under the `kvconnect_` prefix. Failure
classes: failed pulls by error class, handshake failures, side-channel refusals, stale notifications,
ended leases by outcome, recomputed and quarantined pulls, and finished requests by outcome.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from kvconnect.core.decode.handle import PullStats
from kvconnect.core.errors import KVConnectError
from kvconnect.core.snapshot import ConnectorSnapshot

if TYPE_CHECKING:
    from kvconnect.verdict.ucx_tables import TransportVerdict

_TIME_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
_BYTE_BUCKETS = tuple(float(2**k) for k in range(12, 36, 2))
_DESC_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096, 16384, 65536)

# values read from the connector's snapshot at scrape time: name -> (kind, help, snapshot field)
SNAPSHOT = {
    "kvconnect_pulls_ok": ("counter", "pulls completed with the lease confirmed", "pulls_ok"),
    "kvconnect_handshakes": ("counter", "successful handshakes with prefill peers", "handshakes"),
    "kvconnect_handshake_failures": ("counter", "failed or timed-out handshakes", "handshake_failures"),
    "kvconnect_notifs": ("counter", "read notifications received (prefill side)", "notifs"),
    "kvconnect_stale_notifs": ("counter", "notifications naming another incarnation, ignored", "stale_notifs"),
    "kvconnect_unknown_lease_requests": (
        "counter",
        "PIN/CONFIRM/RELEASE naming a lease not (yet) granted here",
        "unknown_lease_requests",
    ),
    "kvconnect_lease_renewals": (
        "counter",
        "leases held longer because their decode's request still waited in its queue",
        "lease_renewals",
    ),
    "kvconnect_side_channel_refused": (
        "counter",
        "side-channel messages refused: malformed, version, auth",
        "side_channel_refused",
    ),
    "kvconnect_abandoned_reads": ("gauge", "given-up READs that may still write into their blocks", "abandoned_reads"),
    "kvconnect_quarantined_blocks": (
        "gauge",
        "blocks held until an abandoned READ into them ends",
        "quarantined_blocks",
    ),
    "kvconnect_leases_held": ("gauge", "prefill leases waiting for a reader", "leases_held"),
    "kvconnect_lease_blocks_held": ("gauge", "blocks held by leases", "lease_blocks_held"),
    "kvconnect_ipc_gather_unavailable": (
        "gauge",
        "1 when the IPC gather could not be compiled at start-up (same-host GPU peers use NIXL)",
        "ipc_gather_unavailable",
    ),
}


class _Snapshot:
    """A collector that reads the connector's snapshot at scrape time (no double bookkeeping)."""

    def __init__(self, read: Callable[[], ConnectorSnapshot]) -> None:
        self._read = read

    def collect(self) -> Iterator[Metric]:
        snap = self._read()
        for name, (kind, text, attr) in SNAPSHOT.items():
            family = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            yield family(name, text, value=float(getattr(snap, attr)))
        ended = GaugeMetricFamily("kvconnect_leases_ended", "leases by state (held: still held)", labels=["outcome"])
        for state, count in sorted(snap.leases_ended.items()):
            ended.add_metric([state], float(count))
        yield ended


class WorkerMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.xfer_time = Histogram(
            "kvconnect_nixl_xfer_time_seconds", "READ posted -> complete", registry=r, buckets=_TIME_BUCKETS
        )
        self.post_time = Histogram(
            "kvconnect_nixl_post_time_seconds", "planning + posting one READ", registry=r, buckets=_TIME_BUCKETS
        )
        self.pull_time = Histogram(
            "kvconnect_pull_time_seconds", "pull requested -> blocks usable", registry=r, buckets=_TIME_BUCKETS
        )
        self.bytes = Histogram("kvconnect_nixl_bytes_transferred", "bytes per pull", registry=r, buckets=_BYTE_BUCKETS)
        self.paths = Counter(
            "kvconnect_pulls_by_path",
            "completed pulls by plan path (block, direct, staging; "
            "'+'-joined when a request read several prefill ranks) and source count",
            ["path", "sources"],
            registry=r,
        )
        self.scatter_time = Histogram(
            "kvconnect_staging_scatter_seconds",
            "staging path: staging -> decode cache",
            registry=r,
            buckets=_TIME_BUCKETS,
        )
        self.digest_time = Histogram(
            "kvconnect_digest_seconds",
            "kv_digest: summing a pull's blocks to check them against the prefill's",
            registry=r,
            buckets=_TIME_BUCKETS,
        )
        self.descs = Histogram(
            "kvconnect_nixl_num_descriptors",
            "descriptors per pull after run merging",
            registry=r,
            buckets=_DESC_BUCKETS,
        )
        self.failed = Counter(
            "kvconnect_nixl_num_failed_transfers", "failed pulls by error class", ["reason"], registry=r
        )
        self.requests = Counter("kvconnect_requests", "finished requests by outcome", ["outcome"], registry=r)
        self.recomputed = Counter("kvconnect_recomputed_prefills", "prompts recomputed after a failed pull", registry=r)
        self.quarantined = Counter(
            "kvconnect_quarantined_pulls",
            "failed pulls whose blocks were held until their abandoned READ ended",
            registry=r,
        )
        self.free_blocks = Gauge("kvconnect_free_blocks", "free KV blocks", registry=r)
        self.running = Gauge("kvconnect_num_requests_running", "admitted requests", registry=r)
        self.waiting = Gauge("kvconnect_num_requests_waiting", "requests queued for blocks", registry=r)

    def bind(self, read: Callable[[], ConnectorSnapshot]) -> None:
        """Expose the connector snapshot that `read()` returns at each scrape."""
        self.registry.register(_Snapshot(read))

    def on_verdict(self, verdict: TransportVerdict) -> None:
        """The start-up transport verdict: exported only by workers that ran one."""
        r = self.registry
        Gauge("kvconnect_transport_gbps", "start-up NIXL READ throughput (GB/s)", registry=r).set(verdict.gbps)
        Gauge(
            "kvconnect_transport_ceiling_gbps", "torch copy of the same bytes in the same run (GB/s)", registry=r
        ).set(verdict.ceiling_gbps)
        Gauge("kvconnect_transport_ratio", "READ / ceiling", registry=r).set(verdict.ratio)
        Info("kvconnect_transport", "UCX transport of the start-up READ", registry=r).info(
            {
                "transport": verdict.transport,
                "mem_kind": verdict.mem_kind,
                "protocol": verdict.protocol,
                "ucx_config": ";".join(verdict.ucx_config),
            }
        )

    def on_pull_done(self, stats: PullStats, error: KVConnectError | None) -> None:
        if error is not None:
            self.failed.labels(type(error).__name__).inc()
            return
        self.xfer_time.observe(stats.transfer_s)
        self.post_time.observe(stats.post_s)
        self.pull_time.observe(stats.total_s)
        self.bytes.observe(stats.bytes)
        self.descs.observe(stats.num_descs_merged)
        self.paths.labels(stats.path or "block", str(stats.num_sources)).inc()
        if "staging" in stats.path:
            self.scatter_time.observe(stats.scatter_s)
        if stats.digest_s > 0:
            self.digest_time.observe(stats.digest_s)

    def render(self) -> bytes:
        return generate_latest(self.registry)
