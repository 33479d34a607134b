"""End to end over HTTP: prefill, decode and aggregated workers plus the proxy, as real processes."""

from __future__ import annotations

import concurrent.futures as cf
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from kvconnect.harness.cluster import Cluster, complete
from tests.faultkit import health, poll_until, scrape

pytestmark = pytest.mark.cluster  # worker clusters in processes: the full tier (`dev.sh fast` skips them)

# 50+ prompts: shorter than a block, exactly a block (16 tokens incl. BOS), many blocks, ragged.
PROMPTS = (
    ["", "a", "ab", "hello", "x" * 14, "y" * 15, "z" * 16, "w" * 17, "v" * 31, "u" * 32, "t" * 33]
    + [f"prompt {i}: " + "lorem ipsum dolor sit amet " * (i % 7) for i in range(30)]
    + ["The KV cache of a long prompt spans many blocks. " * k for k in (1, 2, 3, 5, 8)]
    + ["ragged\n\ttext with ünïcödé ✓ " * k for k in (1, 2, 4)]
    + ["0123456789" * k for k in (3, 6, 9)]
)
PROMPTS = [p for p in PROMPTS if p]  # the OpenAI API refuses empty prompts


def check_all_equal(cluster: Cluster, prompts: list[str], max_tokens: int = 6) -> None:
    def one(prompt: str):
        d = complete(cluster.urls["proxy"], prompt, max_tokens)
        a = complete(cluster.urls["aggregated"], prompt, max_tokens)
        return prompt, d, a

    with cf.ThreadPoolExecutor(8) as pool:
        for prompt, d, a in pool.map(one, prompts):
            assert d["status"] == 200, (prompt, d)
            assert d["token_ids"] == a["token_ids"], prompt
            assert len(d["token_ids"]) == max_tokens or d["token_ids"][-1:] != []


@pytest.mark.parametrize(
    ("prefill_layout", "decode_layout"),
    # (cross_layer -> blocks_first is the module's `cluster`, checked against the aggregated worker by the
    # concurrency test; every layout pair also pulls byte-exact in test_pull.py)
    [("kv_first", "kv_first"), ("cross_layer", "cross_layer"), ("kv_first", "cross_layer")],
)
def test_disaggregated_equals_aggregated(prefill_layout: str, decode_layout: str) -> None:
    assert len(PROMPTS) >= 50
    with Cluster(prefill_layout, decode_layout) as cluster:
        check_all_equal(cluster, PROMPTS)
        poll_until(lambda: health(cluster.urls["prefill"])["leased_blocks"] == 0, what="leases released")


def test_prefill_and_decode_with_different_block_sizes() -> None:
    """Prefill pages 64-token blocks, decode 16-token ones: the pull maps tokens, not blocks."""
    with Cluster("cross_layer", "blocks_first", extra_args={"prefill": ["--block-size", "64"]}) as cluster:
        check_all_equal(cluster, PROMPTS[:16])
        poll_until(lambda: health(cluster.urls["prefill"])["leased_blocks"] == 0, what="leases released")
        pulls = {
            dict(labels)["path"]: value
            for (name, labels), value in scrape(cluster.urls["decode"]).items()
            if name == "kvconnect_pulls_by_path_total"
        }
        assert set(pulls) <= {"direct", "staging"} and sum(pulls.values()) >= 15, pulls  # (one prompt is short)


@pytest.fixture(scope="module")
def cluster():
    with Cluster("cross_layer", "blocks_first", extra_args={"prefill": ["--lease-ttl-s", "60"]}) as c:
        yield c


def test_concurrent_streaming_and_not_leave_nothing_behind(cluster: Cluster) -> None:
    before = {name: health(cluster.urls[name])["free_blocks"] for name in ("prefill", "decode")}
    prompts = [f"concurrent request {i} " * (1 + i % 5) for i in range(24)]
    with cf.ThreadPoolExecutor(24) as pool:
        futures = [
            pool.submit(complete, cluster.urls["proxy"], p, 8, i % 2 == 0, i % 3 == 0) for i, p in enumerate(prompts)
        ]
        refs = [
            pool.submit(complete, cluster.urls["aggregated"], p, 8, False, i % 3 == 0) for i, p in enumerate(prompts)
        ]
        results = [f.result() for f in futures]
        expected = [f.result() for f in refs]
    for got, want in zip(results, expected, strict=True):
        assert got["status"] == 200 and got["token_ids"] == want["token_ids"]
    samples = scrape(cluster.urls["decode"])  # every pull's blocks were summed against the prefill's (kv_digest)
    pulls = sum(v for (n, _), v in samples.items() if n == "kvconnect_nixl_xfer_time_seconds_count")
    assert sum(v for (n, _), v in samples.items() if n == "kvconnect_digest_seconds_count") == pulls > 0
    poll_until(lambda: health(cluster.urls["prefill"])["leased_blocks"] == 0, what="no leased blocks")
    poll_until(
        lambda: {n: health(cluster.urls[n])["free_blocks"] for n in before} == before,
        what="free blocks back to the start",
    )


def test_hand_driven_legs_use_vllm_field_names(cluster: Cluster) -> None:
    prompt = "a hand-driven prefill leg, as the llm-d sidecar sends it"
    leg = {"prompt": prompt, "max_tokens": 1, "stream": False, "kv_transfer_params": {"do_remote_decode": True}}
    r = httpx.post(
        cluster.urls["prefill"] + "/v1/completions", json=leg, headers={"x-request-id": "hand-1"}, timeout=30
    )
    assert r.status_code == 200
    params = r.json()["kv_transfer_params"]
    for name in (
        "do_remote_prefill",
        "remote_engine_id",
        "remote_block_ids",
        "remote_host",
        "remote_port",
        "remote_request_id",
        "tp_size",
    ):
        assert name in params
    assert params["do_remote_prefill"] is True and params["remote_request_id"] == "hand-1"
    assert health(cluster.urls["prefill"])["leased_blocks"] == len(params["remote_block_ids"])
    body = {"prompt": prompt, "max_tokens": 6, "return_token_ids": True, "kv_transfer_params": params}
    d = httpx.post(cluster.urls["decode"] + "/v1/completions", json=body, timeout=30).json()
    a = complete(cluster.urls["aggregated"], prompt, 6)
    assert d["choices"][0]["token_ids"] == a["token_ids"]
    assert d["kvconnect_transfer"]["num_blocks"] == len(params["remote_block_ids"])
    poll_until(lambda: health(cluster.urls["prefill"])["leased_blocks"] == 0, what="lease released")


@pytest.mark.parametrize(
    ("patch", "field"),
    [
        ({"remote_port": "not-a-port"}, "kv_transfer_params.remote_port"),
        ({"remote_block_ids": None}, "kv_transfer_params.remote_block_ids"),
        ({"remote_block_ids": [1, 1]}, "kv_transfer_params.remote_block_ids"),
        ({"remote_block_ids": [-3]}, "kv_transfer_params.remote_block_ids"),
        ({"remote_block_ids": [1, 2, 3, 4, 5, 6]}, "kv_transfer_params.remote_block_ids"),  # more than needed
        ({"remote_host": None}, "kv_transfer_params.remote_host"),
        ({"tp_size": 3}, "kv_transfer_params.tp_size"),  # 3 ranks cannot share 2 KV heads
    ],
)
def test_malformed_kv_transfer_params_get_400_naming_the_field(cluster: Cluster, patch: dict, field: str) -> None:
    params = {
        "do_remote_prefill": True,
        "remote_engine_id": "demo-prefill",
        "remote_block_ids": [1],
        "remote_host": "127.0.0.1",
        "remote_port": 5999,
        "remote_request_id": "x",
        "remote_lease_id": "lease-x",
        "tp_size": 1,
    }
    params.update(patch)
    params = {k: v for k, v in params.items() if v is not None}
    r = httpx.post(
        cluster.urls["decode"] + "/v1/completions",
        json={"prompt": "hello", "max_tokens": 2, "kv_transfer_params": params},
        timeout=30,
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field


def test_proxy_ignores_client_chosen_destinations(cluster: Cluster) -> None:
    evil = {
        "do_remote_prefill": True,
        "remote_engine_id": "evil",
        "remote_block_ids": [1],
        "remote_host": "127.0.0.2",
        "remote_port": 1,
        "remote_request_id": "x",
        "remote_lease_id": "lease-x",
    }
    r = httpx.post(
        cluster.urls["proxy"] + "/v1/completions",
        json={"prompt": "hello there", "max_tokens": 3, "return_token_ids": True, "kv_transfer_params": evil},
        timeout=30,
    )
    assert r.status_code == 200
    assert r.json()["choices"][0]["token_ids"] == complete(cluster.urls["aggregated"], "hello there", 3)["token_ids"]


def test_proxy_does_not_import_nixl() -> None:
    code = "import sys, kvconnect.serving.proxy; bad = [m for m in sys.modules if m.startswith('nixl')]; print(bad)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr


def test_decode_with_dead_prefill_fails_clearly_within_deadline() -> None:
    with Cluster("blocks_first", "blocks_first") as c:
        leg = {
            "prompt": "the prefill worker dies after this",
            "max_tokens": 1,
            "kv_transfer_params": {"do_remote_decode": True},
        }
        params = httpx.post(c.urls["prefill"] + "/v1/completions", json=leg, timeout=30).json()["kv_transfer_params"]
        c.procs["prefill"].send_signal(signal.SIGKILL)
        c.procs["prefill"].wait(10)
        t0 = time.monotonic()
        r = httpx.post(
            c.urls["decode"] + "/v1/completions",
            json={"prompt": leg["prompt"], "max_tokens": 4, "kv_transfer_params": params},
            timeout=60,
        )
        elapsed = time.monotonic() - t0
        assert r.status_code == 502, r.text
        assert "prefill" in r.json()["error"]["message"] and "Handshake" in r.json()["error"]["message"]
        assert elapsed < 15
        # the proxy reports a dead prefill leg clearly too
        r = httpx.post(c.urls["proxy"] + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=30)
        msg = r.json()["error"]["message"]
        assert r.status_code == 502 and "prefill worker" in msg and "127.0.0.1" not in msg, msg  # (no addresses)
        assert health(c.urls["decode"])["free_blocks"] == health(c.urls["decode"])["total_blocks"]


if os.environ.get("KVCONNECT_SKIP_SLOW"):  # pragma: no cover
    pytestmark = [pytest.mark.cluster, pytest.mark.skip("KVCONNECT_SKIP_SLOW set")]


def test_free_ports_come_from_below_the_kernels_ephemeral_range() -> None:
    """Servers of a test cluster bind ports picked earlier; a port from the ephemeral range can meanwhile be
    taken by any process's outgoing connection (seen: a worker exiting with uvicorn's startup failure)."""
    from kvconnect.harness.net import LOW_PORT, _ephemeral_start, free_port

    top = _ephemeral_start()
    ports = {free_port() for _ in range(20)}
    assert all(LOW_PORT <= port < top for port in ports), (sorted(ports), top)
    assert len(ports) > 1  # picked at random, so two callers rarely collide


@pytest.mark.parametrize("server", ["proxy", "decode"])
def test_deeply_nested_or_oversized_bodies_are_refused_not_crashed_on(cluster: Cluster, server: str) -> None:
    """A 100,000-deep JSON array raised RecursionError (a 500); a body of any size was read whole."""
    url = cluster.urls[server] + "/v1/completions"
    for field in ("prompt", "user"):  # (a typed field is refused by type first; an untyped one by depth)
        deep = b'{"prompt": "p", "' + field.encode() + b'": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
        r = httpx.post(url, content=deep, headers={"content-type": "application/json"}, timeout=30)
        assert r.status_code == 400, r.text
    from kvconnect.serving.bodies import DEFAULT_MAX_BODY_BYTES

    big = b'{"prompt": "' + b"x" * (DEFAULT_MAX_BODY_BYTES + 1) + b'"}'
    r = httpx.post(url, content=big, headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 413, r.text
    assert complete(cluster.urls["proxy"], "still serving", 3)["status"] == 200


def test_a_body_the_decode_refuses_still_releases_the_lease_its_params_name(cluster: Cluster) -> None:
    """The rest of the body fails validation (max_tokens 0) but its kv_transfer_params parse: the decode
    releases the prefill's lease at once instead of leaving it to the TTL."""
    from tests.faultkit import prefill_leg

    params = prefill_leg(cluster.urls["prefill"], "a refused body still names its lease", "refused-body-1")
    assert health(cluster.urls["prefill"])["leased_blocks"] > 0
    body = {"prompt": "a refused body still names its lease", "max_tokens": 0, "kv_transfer_params": params}
    r = httpx.post(cluster.urls["decode"] + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text
    poll_until(
        lambda: health(cluster.urls["prefill"])["leased_blocks"] == 0,
        timeout_s=20,
        what="the refused body's lease released (TTL is 60 s)",
    )


@pytest.mark.parametrize("stream", [False, True])
def test_the_proxy_names_its_share_of_the_handover_in_server_timing(cluster: Cluster, stream: bool) -> None:
    """Each relayed answer says how long the proxy's parts of the handover took (the handover split reads it)."""
    t0 = time.perf_counter()
    with httpx.stream(
        "POST",
        cluster.urls["proxy"] + "/v1/completions",
        json={"prompt": "a timed request", "max_tokens": 3, "stream": stream},
        timeout=30,
    ) as r:
        r.read()
    total_ms = 1000 * (time.perf_counter() - t0)
    assert r.status_code == 200
    parts = dict(part.strip().split(";dur=") for part in r.headers["server-timing"].split(","))
    assert list(parts) == ["proxy-in", "prefill", "handoff", "decode-head"]
    durations = [float(v) for v in parts.values()]
    assert min(durations) >= 0 and sum(durations) <= total_ms and durations[1] > 0
