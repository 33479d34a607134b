"""Faults survived with a clear outcome and no leak: real worker processes, real NIXL, signals, admin faults.

One cluster serves the module: a prefill worker whose UCX speaks TCP only (so a SIGSTOPped prefill really
holds a READ in flight) with fault injection on and a short lease TTL, a decode worker that fails pulls
("decode"), one that recomputes ("decode-r"), an aggregated reference worker and the proxy.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from kvconnect.harness.cluster import Cluster, complete
from kvconnect.serving.server import LEASE_NOT_READABLE
from tests.faultkit import (
    decode_leg,
    health,
    idle,
    metric,
    open_request,
    poll_until,
    prefill_leg,
    reference,
    scrape,
)

pytestmark = pytest.mark.cluster  # worker clusters in processes: the full tier (`dev.sh fast` skips them)

TTL_S = 4.0
PULL_TIMEOUT_S = 2.0
PROMPT = "The KV cache of a long prompt spans many blocks; " * 6  # ~300 tokens: 19 blocks
MAX_TOKENS = 6
FAILED = "kvconnect_nixl_num_failed_transfers_total"
RELEASES = "kvconnect_proxy_lease_releases_total"


def fault_cluster(log_dir: str) -> Cluster:
    decode_flags = ["--pull-timeout-s", str(PULL_TIMEOUT_S), "--handshake-timeout-s", "2"]
    return Cluster(
        "blocks_first",
        "blocks_first",
        decodes=("decode", "decode-r"),
        extra_args={
            "prefill": ["--lease-ttl-s", str(TTL_S)],
            "decode": ["--failure-policy", "fail", *decode_flags],
            "decode-r": ["--failure-policy", "recompute", *decode_flags],
        },
        extra_env={"prefill": {"UCX_TLS": "tcp", "KVCONNECT_FAULT_INJECTION": "1"}},
        log_dir=log_dir,
    )


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory):
    """One cluster for the tests that leave it as they found it (every signal they send is undone in a
    `finally`); each starts by waiting until nothing is held anywhere."""
    with fault_cluster(str(tmp_path_factory.mktemp("fault-logs"))) as c:
        yield c


@pytest.fixture
def cluster(shared: Cluster) -> Cluster:
    poll_until(lambda: all_idle(shared), what="the shared cluster idle before the test")
    return shared


@pytest.fixture
def own_cluster(tmp_path: Path):
    """A cluster of the test's own, for tests that kill, restart or leave quarantined a worker."""
    with fault_cluster(str(tmp_path)) as c:
        yield c


@pytest.fixture
def expected(cluster: Cluster) -> list[int]:
    """PROMPT's completion on the aggregated worker."""
    return reference(cluster.urls["aggregated"], PROMPT, MAX_TOKENS)


def warm(cluster: Cluster, expected: list[int]) -> None:
    """One request through each decode worker, so both hold a ready peer for the prefill's incarnation."""
    for name in ("decode", "decode-r"):
        rid = f"warm-{name}-{time.monotonic_ns()}"
        params = prefill_leg(cluster.urls["prefill"], PROMPT, rid)
        got = decode_leg(cluster.urls[name], PROMPT, params, MAX_TOKENS, rid)
        assert got["token_ids"] == expected, got


def legs_in_parallel(cluster: Cluster, calls: list[tuple[str, dict, str]]) -> list[dict]:
    """Decode legs [(worker name, params, request id)] at once, PROMPT each."""
    with cf.ThreadPoolExecutor(len(calls)) as pool:
        futures = [
            pool.submit(decode_leg, cluster.urls[name], PROMPT, params, MAX_TOKENS, rid) for name, params, rid in calls
        ]
        return [f.result() for f in futures]


def requests_finished(url: str) -> float:
    """Requests a worker finished, whatever their outcome."""
    return sum(v for (name, _), v in scrape(url).items() if name == "kvconnect_requests_total")


def all_idle(cluster: Cluster, names=("prefill", "decode", "decode-r")) -> bool:
    return all(idle(cluster.urls[n]) for n in names)


def test_prefill_killed_mid_pull_fails_clearly_or_recomputes_and_restart_serves(own_cluster: Cluster) -> None:
    """(1) + (5): SIGKILL while READs are in flight; then the prefill comes back under the same engine id."""
    cluster = own_cluster
    expected = reference(cluster.urls["aggregated"], PROMPT, MAX_TOKENS)
    warm(cluster, expected)
    a = prefill_leg(cluster.urls["prefill"], PROMPT, "kill-a")
    b = prefill_leg(cluster.urls["prefill"], PROMPT, "kill-b")
    old_incarnation = health(cluster.urls["prefill"])["incarnation_id"]
    handshakes = {n: metric(cluster.urls[n], "kvconnect_handshakes_total") for n in ("decode", "decode-r")}
    cluster.signal("prefill", signal.SIGSTOP)  # over TCP the READs now stay in flight
    with cf.ThreadPoolExecutor(2) as pool:
        fa = pool.submit(decode_leg, cluster.urls["decode"], PROMPT, a, MAX_TOKENS, "kill-a")
        fb = pool.submit(decode_leg, cluster.urls["decode-r"], PROMPT, b, MAX_TOKENS, "kill-b")
        poll_until(
            lambda: all(health(cluster.urls[n])["loading"] == 1 for n in ("decode", "decode-r")),
            what="both pulls in flight",
        )
        cluster.kill("prefill")
        ra, rb = fa.result(), fb.result()
    # a dead peer is noticed at once, well before the pull deadline, and named
    assert ra["status"] == 502 and "PeerGoneError" in ra["error"] and "disconnected" in ra["error"], ra
    assert ra["elapsed_s"] < PULL_TIMEOUT_S  # (else the deadline would have ended it, as TransferTimeoutError)
    assert rb["status"] == 200 and rb["token_ids"] == expected  # recomputed, same tokens
    poll_until(lambda: idle(cluster.urls["decode"]) and idle(cluster.urls["decode-r"]), what="decode blocks freed")
    assert metric(cluster.urls["decode"], FAILED, reason="PeerGoneError") >= 1
    assert metric(cluster.urls["decode-r"], FAILED, reason="PeerGoneError") >= 1
    assert metric(cluster.urls["decode-r"], "kvconnect_recomputed_prefills_total") >= 1

    cluster.restart("prefill")  # same HTTP port, same engine id, new incarnation and side-channel port
    assert health(cluster.urls["prefill"])["incarnation_id"] != old_incarnation
    with cf.ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda _: complete(cluster.urls["proxy"], PROMPT, MAX_TOKENS), range(4)))
    assert all(r["status"] == 200 and r["token_ids"] == expected for r in results), results
    for name in ("decode", "decode-r"):  # each decode dropped the dead peer and handshook with the new one
        assert metric(cluster.urls[name], "kvconnect_handshakes_total") == handshakes[name] + 1
    stale = decode_leg(cluster.urls["decode"], PROMPT, a, MAX_TOKENS, "kill-a-again")  # lease of the dead one
    assert stale["status"] == 502 and "prefill" in stale["error"]
    poll_until(lambda: all_idle(cluster), what="nothing held anywhere")


def test_hung_prefill_hits_the_deadline_and_quarantines_until_the_read_ends(own_cluster: Cluster) -> None:
    """(2): SIGSTOP; the decode deadline fires, the request fails or recomputes at once; the blocks an
    abandoned READ may still write stay quarantined until SIGCONT lets that READ end; then all is free."""
    cluster = own_cluster
    expected = reference(cluster.urls["aggregated"], PROMPT, MAX_TOKENS)
    warm(cluster, expected)
    a = prefill_leg(cluster.urls["prefill"], PROMPT, "hung-a")
    b = prefill_leg(cluster.urls["prefill"], PROMPT, "hung-b")
    num_blocks = len(a["remote_block_ids"])
    recomputed = metric(cluster.urls["decode-r"], "kvconnect_recomputed_prefills_total")
    cluster.signal("prefill", signal.SIGSTOP)
    try:
        ra, rb = legs_in_parallel(cluster, [("decode", a, "hung-a"), ("decode-r", b, "hung-b")])
        assert ra["status"] == 502 and "TransferTimeoutError" in ra["error"], ra
        # not before the deadline; and it fired (a hang would end only at the client's 60 s)
        assert PULL_TIMEOUT_S * 0.9 <= ra["elapsed_s"] < 3 * PULL_TIMEOUT_S
        assert rb["status"] == 200 and rb["token_ids"] == expected, rb  # recomputed in fresh blocks
        assert rb["elapsed_s"] < 3 * PULL_TIMEOUT_S
        for name in ("decode", "decode-r"):
            h = health(cluster.urls[name])
            assert h["quarantined_blocks"] == num_blocks, h  # held: the READ may still land there
            assert h["free_blocks"] + num_blocks == h["total_blocks"] and h["running"] == 0, h
            assert metric(cluster.urls[name], "kvconnect_quarantined_pulls_total") >= 1
            assert metric(cluster.urls[name], "kvconnect_abandoned_reads") == 1
            assert metric(cluster.urls[name], FAILED, reason="TransferTimeoutError") >= 1
        assert metric(cluster.urls["decode-r"], "kvconnect_recomputed_prefills_total") == recomputed + 1
    finally:
        cluster.signal("prefill", signal.SIGCONT)
    poll_until(lambda: all_idle(cluster), what="READs ended, leases ended, every block back")
    assert metric(cluster.urls["decode"], "kvconnect_abandoned_reads") == 0
    ended = sum(
        metric(cluster.urls["prefill"], "kvconnect_leases_ended", outcome=o)
        for o in ("released", "expired", "completed")
    )
    assert ended >= 2
    assert complete(cluster.urls["proxy"], PROMPT, MAX_TOKENS)["token_ids"] == expected


def test_unread_lease_expires_after_its_ttl(cluster: Cluster) -> None:
    """(3): nobody reads; the TTL frees the blocks, counted and logged with the request id."""
    expired = metric(cluster.urls["prefill"], "kvconnect_leases_ended", outcome="expired")
    params = prefill_leg(cluster.urls["prefill"], PROMPT, "never-read")
    t0 = time.monotonic()
    assert health(cluster.urls["prefill"])["leased_blocks"] == len(params["remote_block_ids"])
    poll_until(lambda: idle(cluster.urls["prefill"]), timeout_s=TTL_S + 5, what="lease expiry")
    assert time.monotonic() - t0 >= TTL_S * 0.8
    assert metric(cluster.urls["prefill"], "kvconnect_leases_ended", outcome="expired") == expired + 1


def test_client_abort_makes_the_proxy_release_the_lease_at_once(cluster: Cluster, expected: list[int]) -> None:
    """(3): decode workers hung, client gives up: the proxy frees the prefill lease without waiting for the
    TTL; when the decode workers wake, the stale leg fails closed (or recomputes) and leaves nothing."""
    urls = cluster.urls
    released = metric(urls["prefill"], "kvconnect_leases_ended", outcome="released")
    by_proxy = metric(urls["proxy"], RELEASES, reason="client_aborted", state="released")
    for name in ("decode", "decode-r"):
        cluster.signal(name, signal.SIGSTOP)
    try:
        body = json.dumps({"prompt": PROMPT, "max_tokens": MAX_TOKENS}).encode()
        sock = open_request(urls["proxy"], "/v1/completions", body, "abandoned-1")
        poll_until(lambda: health(urls["prefill"])["leased_blocks"] > 0, what="prefill leg done, lease held")
        sock.close()
        poll_until(lambda: health(urls["prefill"])["leased_blocks"] == 0, timeout_s=TTL_S, what="lease released")
        # released by the proxy, not expired by the TTL
        assert metric(urls["prefill"], "kvconnect_leases_ended", outcome="released") == released + 1
        assert metric(urls["proxy"], "kvconnect_proxy_requests_total", outcome="client_aborted") >= 1
        assert metric(urls["proxy"], RELEASES, reason="client_aborted", state="released") == by_proxy + 1
    finally:
        for name in ("decode", "decode-r"):
            cluster.signal(name, signal.SIGCONT)
    poll_until(lambda: all_idle(cluster), what="the stale decode leg left nothing behind")
    assert complete(urls["proxy"], PROMPT, MAX_TOKENS)["token_ids"] == expected


def test_client_gone_during_the_prefill_leg_gets_the_lease_released(cluster: Cluster) -> None:
    """(3): the client leaves while the prefill computes; the proxy waits for the answer only to learn
    which lease to free, frees it, and never sends the decode leg."""
    urls = cluster.urls
    released = metric(urls["prefill"], "kvconnect_leases_ended", outcome="released")
    by_proxy = metric(urls["proxy"], RELEASES, reason="client_aborted", state="released")
    decode_requests = {n: requests_finished(urls[n]) for n in ("decode", "decode-r")}
    cluster.signal("prefill", signal.SIGSTOP)
    try:
        body = json.dumps({"prompt": PROMPT, "max_tokens": MAX_TOKENS}).encode()
        sock = open_request(urls["proxy"], "/v1/completions", body, "gone-early")
        poll_until(
            lambda: metric(urls["proxy"], "kvconnect_proxy_legs_in_flight", leg="prefill") == 1,
            what="prefill leg under way",
        )
        sock.close()
    finally:
        cluster.signal("prefill", signal.SIGCONT)
    poll_until(
        lambda: metric(urls["proxy"], RELEASES, reason="client_aborted", state="released") == by_proxy + 1,
        what="the proxy released the lease",
    )
    poll_until(lambda: idle(urls["prefill"]), timeout_s=TTL_S / 2, what="prefill blocks back")
    assert metric(urls["prefill"], "kvconnect_leases_ended", outcome="released") == released + 1
    assert {n: requests_finished(urls[n]) for n in ("decode", "decode-r")} == decode_requests  # no decode leg


def test_decode_refusing_a_request_releases_its_lease_at_once(cluster: Cluster) -> None:
    """(3): an explicit release from the decode side: a refused (400) leg frees the prefill's blocks."""
    released = metric(cluster.urls["prefill"], "kvconnect_leases_ended", outcome="released")
    params = prefill_leg(cluster.urls["prefill"], PROMPT, "refused-1")
    r = decode_leg(cluster.urls["decode"], "a shorter prompt", params, MAX_TOKENS, "refused-1")
    assert r["status"] == 400 and r["param"] == "kv_transfer_params.remote_num_tokens", r  # tokens held != needed
    poll_until(lambda: idle(cluster.urls["prefill"]), timeout_s=TTL_S / 2, what="lease released by decode")
    assert metric(cluster.urls["prefill"], "kvconnect_leases_ended", outcome="released") == released + 1


@pytest.mark.parametrize("patch", [{"max_tokens": 0}, {"stream": "yes"}], ids=["max_tokens", "stream"])
def test_a_body_only_the_decode_refuses_has_the_proxy_release_the_lease(cluster: Cluster, patch: dict) -> None:
    """The prefill leg overrides max_tokens and stream, so such a body passes it and leases blocks; the decode
    then refuses it. The proxy frees the lease at once, not at its TTL."""
    urls = cluster.urls
    released = metric(urls["prefill"], "kvconnect_leases_ended", outcome="released")
    by_proxy = metric(urls["proxy"], RELEASES, reason="decode_refused", state="released")
    r = httpx.post(urls["proxy"] + "/v1/completions", json={"prompt": PROMPT, **patch}, timeout=60)
    assert r.status_code >= 400, r.text
    poll_until(
        lambda: metric(urls["proxy"], RELEASES, reason="decode_refused", state="released") == by_proxy + 1,
        what="the proxy released the refused request's lease",
    )
    poll_until(lambda: idle(urls["prefill"]), timeout_s=TTL_S / 2, what="prefill blocks back")
    assert metric(urls["prefill"], "kvconnect_leases_ended", outcome="released") == released + 1


def test_lease_expired_before_the_pull_fails_closed(cluster: Cluster, expected: list[int]) -> None:
    """(4): the lease is force-expired and its blocks scribbled over (as reuse would) before the pull."""
    urls = cluster.urls
    a = prefill_leg(urls["prefill"], PROMPT, "fc-before-a")
    b = prefill_leg(urls["prefill"], PROMPT, "fc-before-b")
    r = httpx_post(
        urls["prefill"] + "/admin/leases/expire", {"request_ids": ["fc-before-a", "fc-before-b"], "poison": True}
    )
    assert r == {"expired": {"fc-before-a": "expired", "fc-before-b": "expired"}}
    lost = metric(urls["decode"], FAILED, reason="LeaseLostError")
    ra, rb = legs_in_parallel(cluster, [("decode", a, "fc-before-a"), ("decode-r", b, "fc-before-b")])
    assert ra["status"] == 502 and ra["error"] == LEASE_NOT_READABLE, ra  # (the decode's log says "expired")
    assert rb["status"] == 200 and rb["token_ids"] == expected, rb
    assert metric(urls["decode"], FAILED, reason="LeaseLostError") == lost + 1
    poll_until(lambda: all_idle(cluster), what="nothing held")


def test_lease_expired_during_the_pull_fails_closed(cluster: Cluster, expected: list[int]) -> None:
    """(4): the lease runs out while the decode is reading (injected as the read completes or is pinned,
    whichever reaches the prefill first)."""
    urls = cluster.urls
    expired = metric(urls["prefill"], "kvconnect_leases_ended", outcome="expired")
    a = prefill_leg(urls["prefill"], PROMPT, "fc-during-a")
    b = prefill_leg(urls["prefill"], PROMPT, "fc-during-b")
    assert httpx_post(urls["prefill"] + "/admin/leases/expire-on-read", {"count": 2}) == {"armed": 2}
    ra, rb = legs_in_parallel(cluster, [("decode", a, "fc-during-a"), ("decode-r", b, "fc-during-b")])
    assert ra["status"] == 502 and "LeaseLostError" in ra["error"], ra
    assert rb["status"] == 200 and rb["token_ids"] == expected, rb
    assert metric(urls["prefill"], "kvconnect_leases_ended", outcome="expired") == expired + 2  # (the injection)
    assert complete(urls["proxy"], PROMPT, MAX_TOKENS)["token_ids"] == expected  # not armed any more
    poll_until(lambda: all_idle(cluster), what="nothing held")


def httpx_post(url: str, body: dict) -> dict:
    import httpx

    r = httpx.post(url, json=body, timeout=10)
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


def test_without_confirmation_an_expired_lease_would_be_served() -> None:
    """The hazard the tests above guard against, shown at connector level: with the lease confirmation
    turned off, a pull of an expired, reused lease "succeeds" with someone else's bytes."""
    from kvconnect.core.errors import LeaseLostError
    from kvconnect.core.plan.layout import LayoutKind
    from kvconnect.harness.prefill import PrefillProcess
    from tests.helpers import decoder, spec

    pre = PrefillProcess.start(spec(LayoutKind.BLOCKS_FIRST))
    try:
        original = pre.ask("block", 10)
        for confirm in (False, True):
            params = pre.lease(f"control-{confirm}", [10, 11])
            assert pre.ask("expire", f"control-{confirm}") == "expired"
            pre.ask("overwrite", 10)  # the blocks were reused by another request
            with decoder(LayoutKind.BLOCKS_FIRST, confirm_reads=confirm) as dec:
                handle = dec.pull(params, [0, 1])
                if confirm:
                    with pytest.raises(LeaseLostError, match="expired"):
                        handle.wait(20)
                else:
                    handle.wait(20)
                    assert dec.cache.block_bytes(0) != original  # foreign data, accepted
                    assert dec.cache.block_bytes(0) == pre.ask("block", 10)
    finally:
        pre.stop()


def test_abandoned_read_lands_after_release_so_blocks_are_held_until_it_ends(monkeypatch) -> None:
    """Why quarantine exists, at connector level with UCX over TCP: a READ abandoned at its deadline from
    a SIGSTOPped peer still writes into the local blocks once the peer resumes, although its NIXL handle
    deadline passed; the handle reports unsettled until that READ has ended."""
    monkeypatch.setenv("UCX_TLS", "tcp")  # both agents: cma would read the stopped process's memory anyway
    from kvconnect.core.errors import TransferTimeoutError
    from kvconnect.core.plan.layout import LayoutKind
    from kvconnect.harness.net import wait_stopped
    from kvconnect.harness.prefill import PrefillProcess
    from tests.helpers import decoder, spec

    pre = PrefillProcess.start(spec(LayoutKind.BLOCKS_FIRST, num_blocks=64), env={"UCX_TLS": "tcp"})
    try:
        with decoder(LayoutKind.BLOCKS_FIRST, num_blocks=64, pull_timeout_s=0.5) as dec:
            dec.pull(pre.lease("warm", [1]), [0]).wait(20)
            for t in dec.cache.regions:
                t.zero_()
            ids = list(range(8, 56))
            params = pre.lease("hung", ids)
            os.kill(pre.proc.pid, signal.SIGSTOP)
            wait_stopped(pre.proc.pid)  # delivery is asynchronous
            try:
                handle = dec.pull(params, ids)
                with pytest.raises(TransferTimeoutError):
                    handle.wait(20)
                assert not handle.settled() and dec.snapshot().quarantined_blocks == len(ids)
                zero = bytes(dec.cache.spec.block_bytes)
                assert all(dec.cache.block_bytes(b) == zero for b in ids)  # nothing landed yet
            finally:
                os.kill(pre.proc.pid, signal.SIGCONT)
            poll_until(handle.settled, what="the abandoned READ ended")
            assert all(dec.cache.block_bytes(b) == pre.ask("block", b) for b in ids)  # it did land late
            assert dec.snapshot().quarantined_blocks == 0
            poll_until(lambda: pre.ask("held") == 0, what="prefill lease ended")
    finally:
        pre.stop()


def test_pull_waiting_on_a_peer_that_moved_fails_instead_of_hanging() -> None:
    """Regression (found by the soak): after a prefill restart on a new side-channel port, pulls still
    waiting for the old address's handshake were orphaned when the peer was replaced, and hung forever."""
    import socket

    from kvconnect.core.errors import PeerGoneError
    from kvconnect.core.plan.layout import LayoutKind
    from kvconnect.harness.prefill import PrefillProcess
    from tests.helpers import decoder, params_to, spec

    pre = PrefillProcess.start(spec(LayoutKind.BLOCKS_FIRST), engine_id="moving")
    try:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            dead_port = s.getsockname()[1]  # the old incarnation's address: nobody answers there now
        with decoder(LayoutKind.BLOCKS_FIRST, handshake_timeout_s=30) as dec:
            stale = params_to(dead_port, "moving", request_id="old")
            waiting = dec.pull(stale, [0])
            dec.wait_idle()  # its handshake is under way
            dec.pull(pre.lease("new", [2]), [1]).wait(20)  # the same engine, at its new address
            with pytest.raises(PeerGoneError, match="address changed"):
                waiting.wait(10)  # at once, not after the 30 s handshake deadline, and not never
    finally:
        pre.stop()


if os.environ.get("KVCONNECT_SKIP_SLOW"):  # pragma: no cover
    pytestmark = [pytest.mark.cluster, pytest.mark.skip("KVCONNECT_SKIP_SLOW set")]
