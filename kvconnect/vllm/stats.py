"""The plug-in's numbers in vLLM: connector stats (the "KV Transfer metrics" log line) and Prometheus
metrics on vLLM's own `/metrics` (`vllm:kvconnect_*`).

Workers record one observation per finished pull (decode side) and per ended lease (prefill side); vLLM
ships the stats with each step's output, aggregates them over the workers and hands them to the
front-end process, which logs `reduce()` and feeds `KVConnectPromMetrics.observe`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)
from vllm.v1.metrics.utils import create_metric_per_engine

from kvconnect.core.plan.params import FIELD, KVTransferParams

PARAM_FIELDS = frozenset(KVTransferParams.__struct_fields__)  # (named bare by the pull's plan)

SERIES = ("pull_s", "xfer_s", "post_s", "bytes", "num_descs", "digest_s")  # per successful pull (digest_s: checked)
# a successful pull's timeline at the decode, in consecutive stages that add up to arrival -> reported:
# the request reached vLLM -> the worker asked for the pull -> a tick picked it up -> the READ was posted -> it
# completed -> the lease was confirmed (blocks usable) -> vLLM was told (its next get_finished / get_transfer_results)
STAGES = (
    "arrival_to_pull_s",
    "pull_to_pickup_s",
    "pickup_to_post_s",
    "read_s",
    "read_to_usable_s",
    "usable_to_reported_s",
)
COUNTS = ("failed", "leases_ended", "usable_by", "posted_on")  # {label: count}


_INDEX = re.compile(r"\[[^\]]*\]")


def failure_reason(error: Exception) -> str:
    """The `reason` label of a failed pull: the error's class, and the field it names without list indexes
    (a client chooses those: `remote_block_ids[100]` would make a label value per index), a field of the params
    always under `kv_transfer_params.`."""
    field_name = getattr(error, "field", None)
    if not isinstance(field_name, str):
        return type(error).__name__
    bare = _INDEX.sub("", field_name)
    if bare in PARAM_FIELDS:  # (the pull's plan names a params field bare: one label whichever check refused it)
        bare = f"{FIELD}.{bare}"
    return f"{type(error).__name__}({bare[:64]})"


def _empty() -> dict[str, Any]:
    return {**{k: [] for k in (*SERIES, *STAGES)}, **{k: {} for k in COUNTS}}


def timeline(arrival: float, requested: float, stats: Any, usable: float, reported: float) -> dict[str, float]:
    """One pull's stages (seconds, `STAGES`) from wall-clock instants: the request's arrival at vLLM (0: not
    known, the first stage is then left out), the worker's pull request, the pull's end and its report to vLLM;
    the middle stages from its `PullStats`."""
    read, after, queued = stats.transfer_s, stats.after_read_s, stats.queued_s
    out = {
        "pull_to_pickup_s": queued,
        "pickup_to_post_s": max(stats.total_s - read - after - queued, 0.0),
        "read_s": read,
        "read_to_usable_s": after,  # (the lease's answer, and the digest where it is on)
        "usable_to_reported_s": max(reported - usable, 0.0),
    }
    if arrival > 0:
        out = {"arrival_to_pull_s": max(requested - arrival, 0.0), **out}
    return out


@dataclass
class KVConnectStats(KVConnectorStats):
    data: dict[str, Any] = field(default_factory=_empty)

    def __post_init__(self) -> None:
        for key, empty in _empty().items():
            self.data.setdefault(key, empty)

    def record_pull(self, stats: Any) -> None:
        """A successful pull (`kvconnect.PullStats`)."""
        for key, value in (
            ("pull_s", stats.total_s),
            ("xfer_s", stats.post_s + stats.transfer_s),
            ("post_s", stats.post_s),
            ("bytes", stats.bytes),
            ("num_descs", stats.num_descs_merged),
        ):
            self.data[key].append(value)
        if stats.digest_s > 0:  # its blocks' content was checked against the prefill's (kv_digest)
            self.data["digest_s"].append(stats.digest_s)
        self.count("usable_by", "lease_board" if stats.on_board else "lease_answer")
        self.count("posted_on", stats.posted_on or "loop")

    def record_timeline(self, stages: dict[str, float]) -> None:
        for key, value in stages.items():
            self.data[key].append(value)

    def count(self, what: str, label: str) -> None:
        bucket = self.data[what]
        bucket[label] = bucket.get(label, 0) + 1

    def reset(self) -> None:
        self.data = _empty()

    def aggregate(self, other: KVConnectorStats) -> KVConnectStats:
        for key in (*SERIES, *STAGES):
            self.data[key].extend(other.data.get(key, []))
        for key in COUNTS:
            for label, n in other.data.get(key, {}).items():
                self.data[key][label] = self.data[key].get(label, 0) + n
        return self

    def is_empty(self) -> bool:
        return not self.data["pull_s"] and not any(self.data[k] for k in COUNTS)

    def reduce(self) -> dict[str, int | float]:
        pulls, xfer, size = self.data["pull_s"], self.data["xfer_s"], self.data["bytes"]
        n = len(pulls)
        out: dict[str, int | float] = {"Num successful pulls": n}
        if n:
            out["Avg pull time (ms)"] = round(1e3 * sum(pulls) / n, 3)
            out["Avg xfer time (ms)"] = round(1e3 * sum(xfer) / n, 3)
            out["Avg MB per pull"] = round(sum(size) / n / 1e6, 3)
            out["Throughput (MB/s)"] = round(sum(size) / max(sum(xfer), 1e-12) / 1e6, 1)
            out["Avg descriptors"] = round(sum(self.data["num_descs"]) / n, 1)
        out["Num failed pulls"] = sum(self.data["failed"].values())
        for state, count in sorted(self.data["leases_ended"].items()):
            out[f"Leases {state}"] = count
        if self.data["usable_by"].get("lease_board"):
            out["Pulls usable from the lease board"] = self.data["usable_by"]["lease_board"]
        return out


_TIME_BUCKETS = [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0]


class KVConnectPromMetrics(KVConnectorPromMetrics):
    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        hist: Any = self._histogram_cls
        counter: Any = self._counter_cls

        def per_engine(metric: Any) -> dict[int, Any]:
            return create_metric_per_engine(metric, per_engine_labelvalues)

        self.series = {
            "pull_s": per_engine(
                hist(
                    name="vllm:kvconnect_pull_time_seconds",
                    buckets=_TIME_BUCKETS,
                    documentation="kvconnect: pull requested -> blocks usable (lease confirmed)",
                    labelnames=labelnames,
                )
            ),
            "xfer_s": per_engine(
                hist(
                    name="vllm:kvconnect_xfer_time_seconds",
                    buckets=_TIME_BUCKETS,
                    documentation="kvconnect: posting + transfer of one pull",
                    labelnames=labelnames,
                )
            ),
            "post_s": per_engine(
                hist(
                    name="vllm:kvconnect_post_time_seconds",
                    buckets=_TIME_BUCKETS,
                    documentation="kvconnect: planning + posting of one pull",
                    labelnames=labelnames,
                )
            ),
            "bytes": per_engine(
                hist(
                    name="vllm:kvconnect_bytes_transferred",
                    documentation="kvconnect: bytes per pull",
                    buckets=[float(2**k) for k in range(12, 36, 2)],
                    labelnames=labelnames,
                )
            ),
            "num_descs": per_engine(
                hist(
                    name="vllm:kvconnect_num_descriptors",
                    documentation="kvconnect: descriptors per pull after merging",
                    buckets=[1, 2, 4, 8, 16, 32, 64, 128, 256, 1024, 4096, 16384, 65536],
                    labelnames=labelnames,
                )
            ),
            "digest_s": per_engine(
                hist(
                    name="vllm:kvconnect_digest_time_seconds",
                    buckets=_TIME_BUCKETS,
                    documentation="kvconnect: summing a pull's blocks to check them against the prefill's (kv_digest)",
                    labelnames=labelnames,
                )
            ),
        }
        stage_doc = {
            "arrival_to_pull_s": ("arrival_to_pull", "request reached vLLM -> its pull was asked for (scheduling)"),
            "pull_to_pickup_s": (
                "pull_to_pickup",
                "pull asked for -> a tick picked it up (on vLLM's or the loop thread)",
            ),
            "pickup_to_post_s": ("pickup_to_post", "picked up -> READ posted (first contact, plan, pin sent, post)"),
            "read_s": ("read", "READ posted -> complete"),
            "read_to_usable_s": ("read_to_usable", "READ complete -> lease confirmed, blocks usable"),
            "usable_to_reported_s": ("usable_to_reported", "blocks usable -> vLLM told (its next step)"),
        }
        for key, (name, doc) in stage_doc.items():
            self.series[key] = per_engine(
                hist(
                    name=f"vllm:kvconnect_{name}_seconds",
                    buckets=_TIME_BUCKETS,
                    documentation=f"kvconnect, a pull's timeline: {doc}",
                    labelnames=labelnames,
                )
            )
        self.failed = counter(
            name="vllm:kvconnect_num_failed_pulls",
            labelnames=[*labelnames, "reason"],
            documentation="kvconnect: failed pulls by error class (vLLM's failure policy applies)",
        )
        self.leases = counter(
            name="vllm:kvconnect_leases_ended",
            labelnames=[*labelnames, "outcome"],
            documentation="kvconnect: prefill leases ended by outcome",
        )
        self.usable_by = counter(
            name="vllm:kvconnect_pulls_usable_by",
            labelnames=[*labelnames, "by"],
            documentation="kvconnect: successful pulls by what made them usable: the same-host lease board, or "
            "the prefill's lease answer (or the transfer alone, with confirm_reads off)",
        )
        self.posted_on = counter(
            name="vllm:kvconnect_pulls_posted_on",
            labelnames=[*labelnames, "thread"],
            documentation="kvconnect: successful pulls by the thread that posted their transfer: engine (vLLM's own "
            "step, driving the connector) or loop (the connector's thread, which must take the GIL from the engine)",
        )
        self._labels = per_engine_labelvalues

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, metric in self.series.items():
            for value in transfer_stats_data.get(key, []):
                metric[engine_idx].observe(value)
        labels = self._labels[engine_idx]
        for reason, n in transfer_stats_data.get("failed", {}).items():
            self.failed.labels(*labels, reason).inc(n)
        for outcome, n in transfer_stats_data.get("leases_ended", {}).items():
            self.leases.labels(*labels, outcome).inc(n)
        for by, n in transfer_stats_data.get("usable_by", {}).items():
            self.usable_by.labels(*labels, by).inc(n)
        for thread, n in transfer_stats_data.get("posted_on", {}).items():
            self.posted_on.labels(*labels, thread).inc(n)
