"""The two-node compose demo, run for real: docker/docker-compose.yml (profile `cpu`) under rootful podman,
the images built from this checkout with docker/Dockerfile.cpu as users build them
(kvconnect.harness.images), prefill and decode in separate containers on the project's own bridge network,
the proxy published on a free loopback port, an aggregated worker of the same image as the reference.

What the KV took is read from three places: each non-streamed answer's `kvconnect_transfer` (transport
`nixl`, not `ipc`; `on_board` false: no lease board), UCX's protocol table in the decode's log
(`UCX_PROTO_INFO=y`: the READ's transport is tcp on eth0, no shared memory or cma), and the containers'
interface counters (eth0 of the decode received at least the KV bytes its /metrics counted). The two
containers' network and IPC namespaces differ (read from /proc on the host).

Needs root, podman and podman-compose (`bash scripts/dev.sh compose` installs and runs them); skipped
without them unless KVCONNECT_REQUIRE_COMPOSE=1 (CI), which makes a missing engine a failure.
"""

from __future__ import annotations

import concurrent.futures as cf
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvconnect.harness import images
from kvconnect.harness.cluster import complete
from kvconnect.harness.containers import ComposeProject, running, shipped_services
from kvconnect.verdict.ucx_tables import parse_proto_tables, read_transports
from tests.composekit import require_compose
from tests.faultkit import decode_leg, health, metric, poll_until, prefill_leg, reference

pytestmark = [pytest.mark.compose, pytest.mark.timeout(1800)]

MAX_TOKENS = 12
PROMPTS = (
    ["a", "hello", "y" * 15, "z" * 16, "w" * 17, "u" * 32, "t" * 33]
    + [f"prompt {i}: " + "lorem ipsum dolor sit amet " * (i % 6) for i in range(8)]
    + ["The KV cache of a long prompt spans many blocks. " * k for k in (2, 5)]
    + ["ragged\n\ttext with ünïcödé ✓ " * 3]
)
NAMED_FAILURES = ("PeerGoneError", "TransferError", "HandshakeError", "LeaseLostError", "prefill worker failed")


def cpu_override() -> dict[str, Any]:
    """The aggregated reference (the prefill's service as shipped, role `both`), and UCX's protocol table
    printed by the decode."""
    aggregated = shipped_services()["prefill"]
    aggregated.pop("healthcheck", None)
    aggregated["hostname"] = "aggregated"
    aggregated["environment"] = {
        **aggregated["environment"],
        "KVCONNECT_ROLE": "both",
        "KVCONNECT_ENGINE_ID": "aggregated-0",
        "KVCONNECT_ADVERTISE_HOST": "aggregated",
    }
    return {"services": {"aggregated": aggregated, "decode": {"environment": {"UCX_PROTO_INFO": "y"}}}}


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ComposeProject]:
    require_compose()
    images.ensure("cpu", rebuild=True)  # this checkout's code (podman's layer cache: quick when unchanged)
    log_dir = Path(tmp_path_factory.mktemp("compose-cpu"))
    with running(ComposeProject("cpu", log_dir, override=cpu_override()), health=["aggregated"]) as p:
        yield p


def kv_bytes(p: ComposeProject) -> float:
    return metric(p.url("decode"), "kvconnect_nixl_bytes_transferred_sum")


def test_every_completion_through_the_proxy_equals_the_aggregated_worker(project: ComposeProject) -> None:
    """Completions, streamed and not, and chat, concurrently: token for token the aggregated worker's."""

    def one(i: int, prompt: str) -> tuple[str, dict[str, Any], dict[str, Any]]:
        stream, chat = i % 3 == 1, i % 4 == 3
        got = complete(project.proxy_url, prompt, MAX_TOKENS, stream=stream, chat=chat)
        want = complete(project.url("aggregated"), prompt, MAX_TOKENS, chat=chat)
        return prompt, got, want

    with cf.ThreadPoolExecutor(6) as pool:
        rows = list(pool.map(lambda a: one(*a), enumerate(PROMPTS)))
    for prompt, got, want in rows:
        assert got["status"] == 200 and want["status"] == 200, (prompt, got, want)
        assert got["token_ids"] == want["token_ids"], prompt
        assert got["token_ids"]
    kinds = {(i % 3 == 1, i % 4 == 3) for i in range(len(PROMPTS))}
    assert {(True, False), (False, False), (False, True), (True, True)} <= kinds  # every kind was sent


def test_the_kv_crosses_the_container_network_by_nixl_read_over_ucx_tcp(project: ComposeProject) -> None:
    """Two network and IPC namespaces; every pull a NIXL READ not decided by a lease board; the READ's UCX
    transport tcp on eth0; the decode's eth0 received at least the KV bytes it pulled, the prefill's eth0
    sent them."""
    for kind in ("net", "ipc"):
        assert project.namespace("prefill", kind) != project.namespace("decode", kind), kind
    bytes0, (rx0, _), (_, tx0) = kv_bytes(project), project.netdev("decode"), project.netdev("prefill")
    transfers = []
    for i in range(6):
        prompt = f"crossing {i}: " + "the KV cache travels between two containers " * (2 + i)
        got = complete(project.proxy_url, prompt, 4)
        assert got["status"] == 200, got
        transfers.append(got["transfer"])
    pulled = kv_bytes(project) - bytes0
    (rx1, _), (_, tx1) = project.netdev("decode"), project.netdev("prefill")
    assert all(t and t["transport"] == "nixl" and not t["on_board"] and t["bytes"] > 0 for t in transfers), transfers
    assert pulled == sum(t["bytes"] for t in transfers) > 0
    assert rx1 - rx0 >= pulled, (rx1 - rx0, pulled)  # (plus HTTP, side channel and TCP headers)
    assert tx1 - tx0 >= pulled, (tx1 - tx0, pulled)
    log = "".join(project.logs("decode", lines=100000).splitlines(keepends=True))
    transports, configs, _ = read_transports(parse_proto_tables(log))
    assert transports and set(transports) == {"tcp"}, (transports, configs)
    assert all("eth0" in c for c in configs), configs


def test_no_lease_is_held_after_the_requests(project: ComposeProject) -> None:
    complete(project.proxy_url, "one more request " * 8, 4)
    poll_until(lambda: health(project.url("prefill"))["leased_blocks"] == 0, 30, "prefill leases released")
    assert metric(project.url("prefill"), "kvconnect_leases_held") == 0
    assert health(project.url("decode"))["quarantined_blocks"] == 0


def test_a_killed_prefill_container_gives_a_named_failure_never_a_hang(project: ComposeProject) -> None:
    """(1) The prefill leased a prompt's blocks, then its container is killed: the decode's leg ends at once
    with a failure naming the cause (or recomputes the aggregated answer). (2) A request through the proxy
    waits on a frozen prefill container, which is then killed: the client gets the proxy's named error. (3)
    The prefill container started again (a new address behind the same name) serves through the proxy."""
    prompt = "a prompt whose prefill dies before the decode reads it " * 3
    want = reference(project.url("aggregated"), prompt, MAX_TOKENS)
    warm = prefill_leg(project.url("prefill"), prompt, "warm-0")  # the decode's peer is ready
    assert decode_leg(project.url("decode"), prompt, warm, MAX_TOKENS, "warm-0")["token_ids"] == want
    params = prefill_leg(project.url("prefill"), prompt, "killed-1")
    decode_url = project.url("decode")
    project.kill("prefill")
    got = decode_leg(decode_url, prompt, params, MAX_TOKENS, "killed-1", timeout_s=90)
    if got["status"] == 200:
        assert got["token_ids"] == want  # recomputed
    else:
        assert got["status"] == 502 and any(n in got["error"] for n in NAMED_FAILURES), got

    project.start("prefill")
    project.wait_healthy(["proxy"], timeout_s=120)
    project.pause("prefill")
    result: dict[str, Any] = {}
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "stream": True}
    client = threading.Thread(
        target=lambda: result.update(r=httpx.post(project.proxy_url + "/v1/completions", json=body, timeout=90))
    )
    client.start()
    poll_until(
        lambda: metric(project.proxy_url, "kvconnect_proxy_legs_in_flight", leg="prefill") >= 1, 30, "request in flight"
    )
    project.kill("prefill")
    client.join(90)
    assert not client.is_alive(), "the client still waits 90 s after the prefill container was killed"
    r = result["r"]
    assert r.status_code == 502 and "prefill worker failed" in r.json()["error"]["message"], r.text

    project.start("prefill")
    project.wait_healthy(["proxy"], timeout_s=120)
    again = complete(project.proxy_url, prompt, MAX_TOKENS)
    assert again["status"] == 200 and again["token_ids"] == want, again


def test_down_leaves_nothing_running(project: ComposeProject) -> None:
    """Last in this module: `podman-compose down` removes every container and the network; the published
    port no longer answers."""
    names = [project.container(s) for s in ("prefill", "decode", "proxy", "aggregated")]
    assert all(project.state(s) == "running" for s in ("prefill", "decode", "proxy", "aggregated")), names
    left = project.down()
    assert left == [], f"left after podman-compose down: {left}"
    with pytest.raises(httpx.ConnectError):
        httpx.get(project.proxy_url + "/health", timeout=5)
