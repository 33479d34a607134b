"""Soak: requests through the proxy at concurrency 32 while faults are injected at random.

Faults: client aborts (the client hangs up after a random delay), forced lease expiries with the blocks
scribbled over (and reads armed to find their lease expired), one SIGKILL + restart of a decode worker and
one of the prefill worker. Attacks, mixed into the load (`Attacks`): params replayed to a second decode
after the first one read them, PINs and CONFIRMs with forged read tokens or made-up lease ids, and an
unauthenticated flood of garbage frames at the prefill's side channel; and (`soakkit.MoreAttacks`) params
sent with another prompt, forged incarnations, made-up engine ids, prefill legs nobody decodes and half-sent
frames held open at the side channel. Two decode workers sit behind the
proxy: "decode" fails a request whose pull failed, "decode-r" recomputes it. At the end: every completion
equals the aggregated worker's or failed with an error naming its class; none is wrong and none unexplained;
no block is leased, allocated or quarantined on any worker; every process stays under RSS_BOUND_BYTES of
resident memory and those never restarted grew less than RSS_GROWTH_BYTES; each failure class a client saw
is counted in /metrics; and the failure each client saw was logged once (one WARNING line with its request
id).

CI runs KVCONNECT_SOAK_REQUESTS requests (default 200). The full run:
    KVCONNECT_SOAK_REQUESTS=1000 .venv/bin/pytest -q -s tests/test_soak.py
prints its figures as JSON (also written to $KVCONNECT_SOAK_REPORT when that is set).
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import json
import os
import random
import re
import string
import threading
import time
from typing import Any

import httpx
import msgspec
import pytest
import zmq

from kvconnect.core.errors import InvalidRequestError, KVConnectError
from kvconnect.core.plan.params import lease_params, parse_kv_transfer_params
from kvconnect.core.plan.signing import Keyring, sign_params, verify_params
from kvconnect.harness.cluster import Cluster
from kvconnect.serving.server import LEASE_NOT_READABLE
from tests.faultkit import health, idle, log_text, poll_until, scrape
from tests.soakkit import MoreAttacks

pytestmark = pytest.mark.cluster  # worker clusters in processes: the full tier (`dev.sh fast` skips them)

NUM_REQUESTS = int(os.environ.get("KVCONNECT_SOAK_REQUESTS", "200"))
CONCURRENCY = 32
SEED = int(os.environ.get("KVCONNECT_SOAK_SEED", "20261129"))
TTL_S = 8.0
SECRET = "soak-test-secret"
ABORT_P, STREAM_P, CHAT_P = 0.08, 0.35, 0.25
EXPIRY_EVERY = max(NUM_REQUESTS // 25, 4)  # completed requests between two expiry injections
RSS_BOUND_BYTES = 768 * 2**20  # workers sit near 310 MiB (torch, NIXL/UCX, the model, a 32 MiB cache)
RSS_GROWTH_BYTES = 128 * 2**20
WORKERS = ("prefill", "decode", "decode-r", "aggregated")
PULL_FAILURES = (
    "LeaseLostError",
    "PeerGoneError",
    "TransferTimeoutError",
    "TransferError",
    "HandshakeTimeoutError",
    "HandshakeError",
    "AuthError",
)
ERROR_CLASS = re.compile(r"\b([A-Z][A-Za-z]*(?:Error|Exception))\b")

PROMPTS = [f"soak prompt {i}: " + "the quick brown fox jumps over the lazy dog. " * (i % 6) for i in range(16)] + [
    "Z",
    "abcdefghijklmno",
    "0123456789" * 17,
    "KV blocks move between workers. " * 9,
    "ünïcödé ✓ " * 11,
    "def f(x):\n    return x * 2\n" * 5,
    "a" * 31,
    "b" * 33,
]

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def max_tokens_for(k: int) -> int:
    return 3 + k % 6


class Faults:
    """A thread that injects faults as the run progresses: a forced expiry (or an expiry armed for the
    next read) every EXPIRY_EVERY completed requests, a restart of decode-r at 30 % and of the prefill
    at 60 %. Restarts run here too, so they never overlap each other or an expiry."""

    def __init__(self, cluster: Cluster, rng: random.Random) -> None:
        self.cluster, self.rng = cluster, rng
        self.up = threading.Event()  # cleared while a worker is down: a client that failed waits for it
        self.up.set()
        self.progress = threading.Condition()
        self.done = 0
        self.finished = False
        self.expired = 0  # leases the injector actually expired
        self.armed = 0
        self.restarts: list[dict[str, Any]] = []
        self.killed_samples: list[tuple[str, Samples]] = []  # last scrape of each killed incarnation
        self.errors: list[str] = []
        self.thread = threading.Thread(target=self._run, name="soak-faults", daemon=True)

    def completed(self) -> None:
        with self.progress:
            self.done += 1
            self.progress.notify()

    def stop(self) -> None:
        with self.progress:
            self.finished = True
            self.progress.notify()
        self.thread.join(180)

    def _run(self) -> None:
        restarts = [(int(NUM_REQUESTS * 0.3), "decode-r"), (int(NUM_REQUESTS * 0.6), "prefill")]
        next_expiry = EXPIRY_EVERY
        while True:
            target = min(next_expiry, restarts[0][0] if restarts else NUM_REQUESTS + 1)
            with self.progress:
                self.progress.wait_for(lambda t=target: self.finished or self.done >= t)  # type: ignore[misc]
                if self.finished:
                    return
                done = self.done
            if restarts and done >= restarts[0][0]:
                self._restart(*restarts.pop(0))
            if done >= next_expiry:
                self._expire()
                next_expiry = done + EXPIRY_EVERY

    def _expire(self) -> None:
        url = self.cluster.urls["prefill"]
        try:
            if self.rng.random() < 0.3:
                r = httpx.post(url + "/admin/leases/expire-on-read", json={"count": 1}, timeout=5)
                r.raise_for_status()
                self.armed += 1
                return
            deadline = time.monotonic() + 2.0  # leases live for milliseconds: try until some are caught
            while time.monotonic() < deadline and not self.finished:
                r = httpx.post(url + "/admin/leases/expire", json={"poison": True}, timeout=5)  # all held now
                hit = sum(1 for state in r.json()["expired"].values() if state == "expired")
                if hit:
                    self.expired += hit
                    return
        except httpx.HTTPError as e:
            self.errors.append(f"expiry injection: {type(e).__name__}: {e}")

    def _restart(self, at: int, name: str) -> None:
        try:
            self.up.clear()
            self.killed_samples.append((name, scrape(self.cluster.urls[name])))
            t0 = time.monotonic()
            self.cluster.kill(name)
            self.cluster.restart(name)
            down_s = round(time.monotonic() - t0, 2)
            self.restarts.append({"worker": name, "after_requests": at, "down_s": down_s})
        except Exception as e:  # reported by the test
            self.errors.append(f"restart of {name}: {type(e).__name__}: {e}")
            self.restarts.append({"worker": name, "failed": True})
        finally:
            self.up.set()


class Attacks:
    """A thread that attacks while the load runs, until stopped:

    - replay: a prefill leg by hand, its decode leg at decode-r, then the same params at decode (a router
      retry, or a client that reaches a decode directly): the replay must be refused or, recomputed, be
      correct; never other tokens;
    - forged tokens: after that read, PIN and CONFIRM for the same lease with random read tokens, and for a
      made-up lease id: never answered held or completed;
    - flood: garbage frames at the prefill's side channel, FLOOD_BURST every 50 ms.
    """

    FLOOD_BURST = 64

    def __init__(self, cluster: Cluster, expected: dict[tuple[int, bool], list[int]], rng: random.Random) -> None:
        self.cluster, self.expected, self.rng = cluster, expected, rng
        self.stop_event = threading.Event()
        self.counts: collections.Counter[str] = collections.Counter()
        self.bad: list[str] = []  # anything that must never happen
        self.errors: list[str] = []  # the first attacks that could not be made (reported)
        self.threads = [
            threading.Thread(target=self._replays, daemon=True),
            threading.Thread(target=self._flood, daemon=True),
        ]

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def stop(self) -> None:
        self.stop_event.set()
        for t in self.threads:
            t.join(120)

    def _replays(self) -> None:
        from kvconnect.core.plan.hetero import Source
        from kvconnect.core.wire import lease_client
        from kvconnect.core.wire import protocol as p
        from kvconnect.core.wire.handshake import request as side_request

        ctx = zmq.Context()
        n = 0
        try:
            while not self.stop_event.wait(0.2):
                n += 1
                k = self.rng.randrange(len(PROMPTS))
                urls = self.cluster.urls
                try:
                    leg = httpx.post(
                        urls["prefill"] + "/v1/completions",
                        timeout=30,
                        json={"prompt": PROMPTS[k], "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}},
                    )
                    if leg.status_code != 200:
                        continue  # (the prefill is restarting)
                    params = leg.json()["kv_transfer_params"]
                    body = {
                        "prompt": PROMPTS[k],
                        "max_tokens": max_tokens_for(k),
                        "return_token_ids": True,
                        "kv_transfer_params": params,
                    }
                    for name, what in (("decode-r", "first_reads"), ("decode", "replays")):
                        r = httpx.post(urls[name] + "/v1/completions", json=body, timeout=60)
                        self.counts[what] += 1
                        if r.status_code == 200:
                            if r.json()["choices"][0]["token_ids"] != self.expected[(k, False)]:
                                self.bad.append(f"{what} at {name}: wrong tokens")
                            self.counts[f"{what}_ok"] += 1
                        else:
                            self.counts[f"{what}_refused"] += 1
                    port = health(urls["prefill"])["side_channel_port"]
                    for lease_id in (params["remote_lease_id"], f"made-up-{n}"):
                        for msg in (
                            lease_client.pin(
                                "attacker",
                                lease_id,
                                Source(0, (0, 1), 0, 1),
                                params["remote_block_ids"],
                                5.0,
                                os.urandom(16),
                            ),
                            lease_client.confirm(
                                "attacker",
                                lease_id,
                                Source(0, (0, 1), 0, 1),
                                params["remote_block_ids"],
                                os.urandom(16),
                            ),
                        ):
                            reply = side_request(ctx, "127.0.0.1", port, msg, 5.0, SECRET.encode())
                            self.counts["forged"] += 1
                            if isinstance(reply, p.LeaseReply) and reply.state in (
                                p.LeaseState.HELD,
                                p.LeaseState.COMPLETED,
                            ):
                                self.bad.append(f"forged token for {lease_id[:12]} answered {reply.state.value}")
                except (httpx.HTTPError, KeyError, ValueError, KVConnectError) as e:
                    self.counts["attack_errors"] += 1  # (a worker restarting; not a finding)
                    if len(self.errors) < 5:
                        self.errors.append(f"{type(e).__name__}: {e}"[:200])
        finally:
            ctx.term()

    def _flood(self) -> None:
        ctx = zmq.Context()
        sock, port = None, 0
        try:
            while not self.stop_event.wait(0.05):
                try:
                    now_port = health(self.cluster.urls["prefill"])["side_channel_port"]
                except (httpx.HTTPError, KeyError, ValueError):
                    continue
                if now_port != port:  # (a restarted prefill listens elsewhere)
                    if sock is not None:
                        sock.close(0)
                    sock, port = ctx.socket(zmq.DEALER), now_port
                    sock.setsockopt(zmq.LINGER, 0)
                    sock.setsockopt(zmq.SNDHWM, 1000)
                    sock.connect(f"tcp://127.0.0.1:{port}")
                for _ in range(self.FLOOD_BURST):
                    try:
                        sock.send_multipart([b"", os.urandom(self.rng.randrange(1, 64))], zmq.NOBLOCK)
                        self.counts["flood_frames"] += 1
                    except zmq.Again:
                        break
                while True:  # drain the refusals
                    try:
                        sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
        finally:
            if sock is not None:
                sock.close(0)
            ctx.term()


def one_request(
    client: httpx.Client, url: str, i: int, rng: random.Random, expected: dict[tuple[int, bool], list[int]]
) -> dict[str, Any]:
    """One client: {"kind": correct | wrong | failed | aborted | unclear, ...}."""
    k = rng.randrange(len(PROMPTS))
    chat, stream = rng.random() < CHAT_P, rng.random() < STREAM_P
    abort_after = rng.uniform(0.02, 0.8) if rng.random() < ABORT_P else None
    body: dict[str, Any] = {
        "max_tokens": max_tokens_for(k),
        "temperature": 0,
        "return_token_ids": True,
        "stream": stream,
    }
    if chat:
        body["messages"] = [{"role": "user", "content": PROMPTS[k]}]
    else:
        body["prompt"] = PROMPTS[k]
    path = "/v1/chat/completions" if chat else "/v1/completions"
    rid = f"soak-{i}"
    headers = {"x-request-id": rid}
    timeout = httpx.Timeout(120.0, read=abort_after) if abort_after else httpx.Timeout(120.0)
    t0 = time.monotonic()
    row: dict[str, Any] = {"rid": rid, "stream": stream, "chat": chat, "abort_after": abort_after}
    try:
        if stream:
            ids: list[int] = []
            finished = False
            with client.stream("POST", url + path, json=body, headers=headers, timeout=timeout) as r:
                if r.status_code != 200:
                    r.read()
                    error = r.json()["error"]["message"]
                    return {**row, "kind": "failed", "status": r.status_code, "error": error}
                for line in r.iter_lines():
                    if abort_after is not None and time.monotonic() - t0 > abort_after:
                        return {**row, "kind": "aborted"}
                    if line == "data: [DONE]":
                        finished = True
                    if not line.startswith("data: ") or finished:
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        return {**row, "kind": "failed", "status": 200, "error": chunk["error"]["message"]}
                    ids.extend(chunk["choices"][0].get("token_ids", []))
            if not finished:
                return {**row, "kind": "unclear", "error": "stream ended without [DONE]"}
        else:
            r = client.post(url + path, json=body, headers=headers, timeout=timeout)
            data = r.json()
            if r.status_code != 200:
                return {**row, "kind": "failed", "status": r.status_code, "error": data["error"]["message"]}
            ids = data["choices"][0]["token_ids"]
    except httpx.TimeoutException as e:
        if abort_after is not None:
            return {**row, "kind": "aborted"}
        return {**row, "kind": "unclear", "error": f"{type(e).__name__}: {e}"}
    except (httpx.HTTPError, ValueError, KeyError) as e:
        return {**row, "kind": "unclear", "error": f"{type(e).__name__}: {e}"}
    want = expected[(k, chat)]
    if ids != want:
        return {**row, "kind": "wrong", "got": ids, "want": want, "prompt": k}
    return {**row, "kind": "correct", "latency_s": time.monotonic() - t0}


def total(samples: list[tuple[str, Samples]], name: str, worker: str | None = None, **labels: str) -> float:
    """A counter summed over the scrapes given (every incarnation of every worker, or one worker's)."""
    key = (name, tuple(sorted(labels.items())))
    return sum(s.get(key, 0.0) for w, s in samples if worker is None or w == worker)


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return round(values[min(len(values) - 1, int(q * len(values)))], 3) if values else 0.0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    if os.environ.get("KVCONNECT_SKIP_SLOW"):  # pragma: no cover
        pytest.skip("KVCONNECT_SKIP_SLOW set")
    decode_flags = ["--pull-timeout-s", "5", "--handshake-timeout-s", "3"]
    with Cluster(
        "cross_layer",
        "blocks_first",
        decodes=("decode", "decode-r"),
        extra_args={
            "prefill": ["--lease-ttl-s", str(TTL_S)],
            "decode": ["--failure-policy", "fail", *decode_flags],
            "decode-r": ["--failure-policy", "recompute", *decode_flags],
        },
        extra_env={  # (every process holds the secret: params are signed, and every forged one must be refused)
            name: {"KVCONNECT_SECRET": SECRET, **({"KVCONNECT_FAULT_INJECTION": "1"} if name == "prefill" else {})}
            for name in ("prefill", "decode", "decode-r", "aggregated", "proxy")
        },
        log_dir=str(tmp_path_factory.mktemp("soak-logs")),
    ) as c:
        yield c


def test_soak_with_random_faults(cluster: Cluster) -> None:
    rng = random.Random(SEED)
    urls = cluster.urls
    processes = (*WORKERS, "proxy")
    t_start = time.monotonic()
    with httpx.Client(limits=httpx.Limits(max_connections=64, max_keepalive_connections=64)) as client:

        def ref(key: tuple[int, bool]) -> list[int]:
            k, chat = key
            body: dict[str, Any] = {"max_tokens": max_tokens_for(k), "return_token_ids": True}
            if chat:
                body["messages"] = [{"role": "user", "content": PROMPTS[k]}]
            else:
                body["prompt"] = PROMPTS[k]
            r = client.post(
                urls["aggregated"] + ("/v1/chat/completions" if chat else "/v1/completions"), json=body, timeout=120
            )
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["token_ids"]  # type: ignore[no-any-return]

        keys = [(k, chat) for k in range(len(PROMPTS)) for chat in (False, True)]
        with cf.ThreadPoolExecutor(8) as pool:
            expected = dict(zip(keys, pool.map(ref, keys), strict=True))
        rss_warm = {name: cluster.rss_bytes(name) for name in processes}

        faults = Faults(cluster, random.Random(SEED + 1))
        seeds = [rng.randrange(2**32) for _ in range(NUM_REQUESTS)]
        rows: list[dict[str, Any]] = []
        rows_lock = threading.Lock()

        def client_request(i: int) -> None:
            row = one_request(client, urls["proxy"], i, random.Random(seeds[i]), expected)
            with rows_lock:
                rows.append(row)
            faults.completed()
            if row["kind"] in ("failed", "unclear") and not faults.up.is_set():
                faults.up.wait(120)  # a worker is down: resume once it is up again (bounds the failures)

        t_run = time.monotonic()
        attacks = Attacks(cluster, expected, random.Random(SEED + 2))
        more = MoreAttacks(urls, PROMPTS, lambda k: expected[(k, False)], max_tokens_for, SEED + 3)
        faults.thread.start()
        attacks.start()
        more.start()
        try:
            with cf.ThreadPoolExecutor(CONCURRENCY) as pool:
                list(pool.map(client_request, range(NUM_REQUESTS)))
        finally:
            more.stop()
            attacks.stop()
            faults.stop()
        run_s = time.monotonic() - t_run
        client.post(urls["prefill"] + "/admin/leases/expire-on-read", json={"count": 0}, timeout=5)  # disarm
        assert not faults.errors, faults.errors[:5]
        kinds = collections.Counter(r["kind"] for r in rows)
        try:
            poll_until(
                lambda: all(idle(urls[n]) for n in WORKERS),
                timeout_s=TTL_S + 30,
                what="no block leased, allocated or quarantined anywhere",
            )
        except AssertionError as e:
            raise AssertionError(f"{e}: {[health(urls[n]) for n in WORKERS]} {kinds}") from None
        rss_end = {name: cluster.rss_bytes(name) for name in processes}
        after = [one_request(client, urls["proxy"], NUM_REQUESTS + i, random.Random(i), expected) for i in range(8)]
        assert all(r["kind"] in ("correct", "aborted") for r in after), [  # recovered: serving again
            (r["rid"], r["kind"], r.get("error")) for r in after
        ]
        samples = faults.killed_samples + [(n, scrape(urls[n])) for n in processes]

    failed = [r for r in rows if r["kind"] == "failed"]
    classes = collections.Counter((ERROR_CLASS.findall(r["error"]) or ["?"])[-1] for r in failed)
    latencies = [r["latency_s"] for r in rows if "latency_s" in r]
    report: dict[str, Any] = {
        "requests": NUM_REQUESTS,
        "concurrency": CONCURRENCY,
        "seed": SEED,
        "outcomes": dict(kinds),
        "failure_classes": dict(classes),
        "run_s": round(run_s, 1),
        "total_s": round(time.monotonic() - t_start, 1),
        "throughput_rps": round(NUM_REQUESTS / run_s, 1),
        "p50_latency_s": percentile(latencies, 0.5),
        "p99_latency_s": percentile(latencies, 0.99),
        "attacks": dict(attacks.counts),
        "attack_errors": attacks.errors,
        "more_attacks": dict(more.counts),
        "more_attack_errors": more.errors,
        "forced_expiries": faults.expired,
        "expire_on_read_armed": faults.armed,
        "restarts": faults.restarts,
        "rss_warm_mib": {k: round(v / 2**20) for k, v in rss_warm.items()},
        "rss_end_mib": {k: round(v / 2**20) for k, v in rss_end.items()},
        "recomputed": total(samples, "kvconnect_recomputed_prefills_total"),
        "quarantined_pulls": total(samples, "kvconnect_quarantined_pulls_total"),
        "pull_failures": {
            c: total(samples, "kvconnect_nixl_num_failed_transfers_total", reason=c) for c in PULL_FAILURES
        },
        "leases_ended": {
            o: total(samples, "kvconnect_leases_ended", "prefill", outcome=o)
            for o in ("completed", "released", "expired")
        },
        "proxy": {
            o: total(samples, "kvconnect_proxy_requests_total", "proxy", outcome=o)
            for o in ("ok", "prefill_failed", "decode_failed", "client_aborted", "bad_request")
        },
    }
    print("\nSOAK " + json.dumps(report, indent=1))
    if os.environ.get("KVCONNECT_SOAK_REPORT"):
        with open(os.environ["KVCONNECT_SOAK_REPORT"], "w") as f:
            json.dump({**report, "failed": failed}, f, indent=1)

    # attacks: nothing forged passed, no replay read anything but its own tokens, each kind happened
    assert attacks.bad == [], attacks.bad[:5]
    assert attacks.counts["replays"] >= 2 and attacks.counts["forged"] >= 4, report  # (workers restart meanwhile)
    assert attacks.counts["flood_frames"] >= 1000, report
    assert more.bad == [], more.bad[:5]  # (no prompt swap, forged incarnation or engine id read others' KV)
    for kind in (*MoreAttacks.KINDS, "half_sent"):
        assert more.counts[kind] >= 2, (kind, report)
    assert more.counts["forged_params_refused"] >= 4, report  # (each a 400 naming a signed field; none answered)
    # every completion correct or failed with a named error; none wrong, none unexplained
    assert kinds["wrong"] == 0, [r for r in rows if r["kind"] == "wrong"][:3]
    assert kinds["unclear"] == 0, [(r["rid"], r.get("error")) for r in rows if r["kind"] == "unclear"][:5]
    assert "?" not in classes, [r for r in failed if not ERROR_CLASS.search(r["error"])][:5]
    assert kinds["correct"] >= NUM_REQUESTS * 0.3, report  # (each restart fails up to one request per client)
    assert [r["worker"] for r in faults.restarts] == ["decode-r", "prefill"], report
    assert faults.expired + faults.armed >= 3, report
    # resident memory
    for name in processes:
        assert rss_end[name] < RSS_BOUND_BYTES, (name, report["rss_end_mib"])
    for name in ("decode", "aggregated", "proxy"):  # never restarted
        grown = rss_end[name] - rss_warm[name]
        assert grown < RSS_GROWTH_BYTES, (name, report["rss_warm_mib"], report["rss_end_mib"])
    # every failure class a client saw is counted where it was handled
    for cls, n in classes.items():
        if cls in PULL_FAILURES:
            assert report["pull_failures"][cls] >= n, (cls, n, report)
    seen_prefill = sum(1 for r in failed if re.match(r"prefill worker (failed|answered)", r["error"]))
    assert report["proxy"]["prefill_failed"] >= seen_prefill, report
    assert report["proxy"]["decode_failed"] >= len(failed) - seen_prefill, report
    assert report["leases_ended"]["expired"] >= faults.expired, report
    # the failure each client saw was logged once as a warning, with the request id, where it was handled
    logs = "\n".join(log_text(cluster.log_dir, n) for n in processes)
    handled = [ln for ln in logs.splitlines() if " WARNING " in ln]
    for r in failed:
        m = re.search(r"\b[A-Z]\w*(?:Error|Exception): (.*)$", r["error"])
        assert m, r
        said = m.group(1)[:60] if LEASE_NOT_READABLE not in r["error"] else "failed: "  # (uniform to clients)
        lines = [ln for ln in handled if re.search(rf"\b{r['rid']}\b", ln) and said in ln]
        assert len(lines) == 1, (r, lines)


def test_every_soak_forgery_is_refused_by_the_verifier_whatever_the_lease_id() -> None:
    """The soak's forged params (soakkit.FORGERIES) must each differ from the genuine ones, for a lease id starting
    with any character `secrets.token_urlsafe` draws: one that began with the character the forger wrote made a
    'forgery' equal to the original, which decode-r then read (a CI flake)."""
    keys = Keyring([SECRET.encode()])
    now_ms = int(time.time() * 1000)
    for first in string.ascii_letters + string.digits + "-_":
        genuine = lease_params(
            engine_id="prefill-engine",
            host="127.0.0.1",
            base_port=5600,
            tp_size=1,
            incarnation_id="inc",
            request_id="r1",
            lease_id=first + "Q" * 21,
            block_ids=[3, 4],
            num_tokens=40,
            prompt=b"\x01" * 16,
        )
        params = msgspec.to_builtins(sign_params(genuine, keys, expires_ms=now_ms + 60_000))
        for field, forge in MoreAttacks.FORGERIES:
            forged = {f: v for f, v in {**params, field: forge(params)}.items() if v is not None}
            parsed = parse_kv_transfer_params(forged)
            assert parsed is not None
            with pytest.raises(InvalidRequestError, match=r"kv_transfer_params\.remote_"):
                verify_params(parsed, keys, now_ms)
