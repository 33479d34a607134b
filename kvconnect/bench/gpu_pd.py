"""What the GPU P/D benchmarks share: the connector pairs they start on one GPU, each side's byte path, and
per-request deltas of vLLM's own /metrics.

The pairs, each a prefill and a decode server with the same flags:

- `kvconnect`: kvconnect's plug-in as shipped (`transport: auto`: same-host GPU peers use its CUDA IPC gather);
- `kvconnect-samehost`: the same servers as `kvconnect`, named for the path they take (in runs that also measure
  the NIXL path);
- `kvconnect-nixl`: the plug-in as pods on different nodes run it: `transport: nixl` (every pull a NIXL READ) and
  `lease_board: false` (the board lives in the host's shared memory, which two nodes do not share: every pull
  waits for its PIN's answer);
- `kvconnect-nixl-xl`: `kvconnect-nixl` with `cross_layer_blocks: true` and vLLM's V1 model runner
  (`VLLM_USE_V2_MODEL_RUNNER=0`: 0.26's default V2 runner never asks for cross-layer blocks): one descriptor per
  block for every layer instead of one per block and layer;
- `kvconnect-nixl-board`: `transport: nixl` with the lease board on (what `kvconnect-nixl` was before the board
  was turned off in it: results/gpu/h2h-fair run11);
- `nixl`: vLLM's NixlConnector (the decode READs);
- `push`: vLLM's NixlPushConnector (the prefill WRITEs into the blocks the decode registered; both legs must carry
  the same request id, and its transfer telemetry is on the prefill's /metrics).

Every server that moves bytes with NIXL gets `UCX_CUDA_IPC_ENABLE_GET_ZCOPY=on` (UCX turns cuda_ipc GET off where
it finds no NVLink, and a READ then runs as "software emulation" over TCP; `ucx_default=True` leaves UCX's default
to show that) and `UCX_PROTO_INFO=y`, so that its log holds UCX's protocol table: the byte path it took.
"""

from __future__ import annotations

from typing import Any

from kvconnect.harness.vllm_cluster import Server, connector_json, kvconnect_config

PAIRS = (
    "kvconnect",
    "kvconnect-samehost",
    "kvconnect-nixl",
    "kvconnect-nixl-xl",
    "kvconnect-nixl-board",
    "nixl",
    "push",
)
# the plug-in's kv_connector_extra_config per kvconnect pair ({}: as shipped)
KVCONNECT_EXTRA: dict[str, dict[str, Any]] = {
    "kvconnect": {},
    "kvconnect-samehost": {},
    "kvconnect-nixl": {"transport": "nixl", "lease_board": False},
    "kvconnect-nixl-xl": {"transport": "nixl", "lease_board": False, "cross_layer_blocks": True},
    "kvconnect-nixl-board": {"transport": "nixl"},
}
# environment per pair beyond UCX's (the V1 model runner: the only one of vLLM 0.26's that asks for cross-layer blocks)
PAIR_ENV: dict[str, dict[str, str]] = {"kvconnect-nixl-xl": {"VLLM_USE_V2_MODEL_RUNNER": "0"}}
# histograms read per request from /metrics: short name -> metric (vLLM's own, then each connector's)
VLLM = {
    "queue_s": "vllm:request_queue_time_seconds",
    "first_forward_s": "vllm:request_prefill_time_seconds",  # (a decode's "prefill" is the KV wait + first step)
    "itl_s": "vllm:inter_token_latency_seconds",
    "ttft_server_s": "vllm:time_to_first_token_seconds",
}
NIXL = {
    "bytes": "vllm:nixl_bytes_transferred",
    "descs": "vllm:nixl_num_descriptors",
    "xfer_s": "vllm:nixl_xfer_time_seconds",
}
# a pull's stages on the decode (the plug-in's histograms): arrival -> pull asked -> picked up by the engine thread
# -> READ posted -> READ done -> usable (the prefill's PIN answer back, where no lease board answers it)
STAGES = {
    f"{stage}_s": f"vllm:kvconnect_{stage}_seconds"
    for stage in ("arrival_to_pull", "pull_to_pickup", "pickup_to_post", "read", "read_to_usable")
}
# what the serve benchmark reads per cell from a pair's decode (`transfer_side`'s server): kvconnect's stages plus its
# post (plan, PIN sent, NIXL's post) and descriptors; NixlConnector's transfer time and descriptors
CELL_SERIES = {
    "kvconnect": {
        **STAGES,
        "post_s": "vllm:kvconnect_post_time_seconds",
        "descs": "vllm:kvconnect_num_descriptors",
        # the share of pulls the connector's loop thread posted (the rest: vLLM's engine thread, driving)
        "loop_share": "vllm:kvconnect_pulls_posted_on{thread=loop}",
    },
    "nixl": {"xfer_s": "vllm:nixl_xfer_time_seconds", "descs": "vllm:nixl_num_descriptors"},
}
KVCONNECT = {
    "bytes": "vllm:kvconnect_bytes_transferred",
    "descs": "vllm:kvconnect_num_descriptors",
    "xfer_s": "vllm:kvconnect_xfer_time_seconds",
    "usable_s": "vllm:kvconnect_pull_time_seconds",
    **STAGES,
}


def pair_servers(name: str, args: list[str], ucx_default: bool = False, port: int = 25600) -> list[Server]:
    """The prefill and decode servers of pair `name` (`<name>-prefill`, `<name>-decode`)."""
    ucx = {"UCX_PROTO_INFO": "y", **({} if ucx_default else {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "on"})}
    out = []
    for i, role in enumerate(("kv_producer", "kv_consumer")):
        side = "prefill" if role == "kv_producer" else "decode"
        if name in KVCONNECT_EXTRA:
            extra = KVCONNECT_EXTRA[name]
            cfg, env = kvconnect_config(role, extra or None), (dict(ucx) if extra.get("transport") == "nixl" else {})
        elif name in ("nixl", "push"):
            connector = "NixlConnector" if name == "nixl" else "NixlPushConnector"
            cfg, env = connector_json(connector, role), {**ucx, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(port + 100 * i)}
        else:
            raise ValueError(f"unknown pair {name!r}; known: {', '.join(PAIRS)}")
        out.append(Server(f"{name}-{side}", cfg, args=args, env={**env, **PAIR_ENV.get(name, {})}))
    return out


def moves_by_nixl(name: str) -> bool:
    """Whether pair `name` moves its bytes with NIXL (its servers then log UCX's protocol lines)."""
    return name in ("nixl", "push") or KVCONNECT_EXTRA.get(name, {}).get("transport") == "nixl"


def transfer_side(name: str) -> tuple[str, dict[str, str]]:
    """Which server of pair `name` reports the transfer, and its metrics."""
    if name == "push":
        return "prefill", NIXL
    return "decode", (KVCONNECT if name.startswith("kvconnect") else NIXL)


def cell_series(name: str) -> dict[str, str] | None:
    """What the serve benchmark reads per cell on pair `name`'s decode (`CELL_SERIES`); None where the transfer is
    reported on the prefill (push)."""
    side, metrics = transfer_side(name)
    if side != "decode":
        return None
    return CELL_SERIES["kvconnect" if metrics is KVCONNECT else "nixl"]


def deltas(
    before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]], means: tuple[str, ...] = ("itl_s",)
) -> dict[str, float]:
    """Per histogram, the sum of what one request added to it; for those in `means`, their mean."""
    out = {}
    for key, (total, count) in after.items():
        d_sum, d_count = total - before[key][0], count - before[key][1]
        out[key] = d_sum / d_count if key in means and d_count else d_sum
        out[f"{key}_n"] = d_count
    return out


def summary(values: list[float], scale: float = 1e3, digits: int = 2) -> dict[str, Any]:
    """min, median and max, scaled (ms by default)."""
    import statistics

    if not values:
        return {"min": None, "med": None, "max": None}
    return {
        "min": round(min(values) * scale, digits),
        "med": round(statistics.median(values) * scale, digits),
        "max": round(max(values) * scale, digits),
    }
