"""Two hosts on one machine: prefill and decode in their own network namespaces, KV pulled over a veth.

Topology (made fresh per run, names unique, torn down in a finalizer even on failure):

    netns <run>-p  "prefill host"                netns <run>-d  "decode host"
    10.77.0.1/24 on veth kvp<id>  <── veth ──>   10.77.0.2/24 on veth kvd<id>
      kvconnect serve (prefill), configured        kvconnect serve --role decode (flags)
      by KVCONNECT_* variables only, HTTP and      kvconnect serve --role both (the reference)
      side channel bound to 0.0.0.0, side          kvconnect proxy (llm-d style decode sidecar,
      channel advertised as 10.77.0.1              KVCONNECT_* variables only)
                                                   the test's HTTP client threads (setns)
    every process gets one KVCONNECT_SECRET, so each side-channel message crossing the veth is authenticated

UCX is limited to `UCX_TLS=tcp` on the veth (`UCX_NET_DEVICES`): cma and shared memory would cross
namespaces through the shared kernel and never touch the "network", so the KV really travels over TCP
on the veth, which the veth's byte counters confirm. Only the two namespaces' own addresses and their
loopbacks are ever dialled. Skips only where namespaces cannot be created (not root, no `ip`, or the
kernel refuses).
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest

from kvconnect.core.config import connector_config
from kvconnect.core.errors import ConfigError
from kvconnect.harness.cluster import complete
from kvconnect.harness.netns import delete_stale_namespaces, enter_netns, ip, netns_unavailable

pytestmark = [pytest.mark.netns, pytest.mark.cluster]
T = TypeVar("T")

NS_PREFIX = "kvct-"  # every namespace this test makes starts so, followed by the creating pid
PREFILL_ADDR, DECODE_ADDR, PREFIX_LEN = "10.77.0.1", "10.77.0.2", 24
HTTP_PORT, REF_PORT, PROXY_PORT, SIDE_PORT = 8000, 8001, 8080, 5600
STARTUP_S = 120.0
SECRET = secrets.token_hex(16)  # the side channel authenticated across the hosts, as deployments should be
PROMPTS = (
    ["a", "hello", "y" * 15, "z" * 16, "w" * 17, "u" * 32, "t" * 33]
    + [f"prompt {i}: " + "lorem ipsum dolor sit amet " * (i % 6) for i in range(10)]
    + ["The KV cache of a long prompt spans many blocks. " * k for k in (2, 5)]
    + ["ragged\n\ttext with ünïcödé ✓ " * 3]
)


# --- namespaces --------------------------------------------------------------------------------------


@dataclass
class Hosts:
    """Two namespaces joined by a veth pair."""

    prefill_ns: str
    decode_ns: str
    prefill_dev: str
    decode_dev: str

    def tx_bytes(self, ns: str, dev: str) -> int:
        stats = json.loads(ip("-n", ns, "-s", "-j", "link", "show", "dev", dev).stdout)
        return int(stats[0]["stats64"]["tx"]["bytes"])


@pytest.fixture(scope="module")
def hosts() -> Iterator[Hosts]:
    reason = netns_unavailable()
    if reason:
        pytest.skip(reason)
    delete_stale_namespaces(NS_PREFIX)
    token = secrets.token_hex(3)
    h = Hosts(
        f"{NS_PREFIX}{os.getpid()}-{token}-p", f"{NS_PREFIX}{os.getpid()}-{token}-d", f"kvp{token}", f"kvd{token}"
    )
    made: list[str] = []
    try:
        for ns in (h.prefill_ns, h.decode_ns):
            out = ip("netns", "add", ns, check=False)
            if out.returncode != 0:
                if not made:
                    pytest.skip(f"cannot create a network namespace here: {out.stderr.strip()}")
                raise RuntimeError(f"ip netns add {ns}: {out.stderr.strip()}")
            made.append(ns)
        # both ends are created inside their namespaces: nothing touches the root namespace
        ip(
            "link",
            "add",
            h.prefill_dev,
            "netns",
            h.prefill_ns,
            "type",
            "veth",
            "peer",
            "name",
            h.decode_dev,
            "netns",
            h.decode_ns,
        )
        ends = ((h.prefill_ns, h.prefill_dev, PREFILL_ADDR), (h.decode_ns, h.decode_dev, DECODE_ADDR))
        for ns, dev, addr in ends:
            ip("-n", ns, "addr", "add", f"{addr}/{PREFIX_LEN}", "dev", dev)
            ip("-n", ns, "link", "set", "lo", "up")
            ip("-n", ns, "link", "set", dev, "up")
        yield h
    finally:
        for ns in made:  # deleting a namespace destroys its veth end, and with it the pair
            ip("netns", "del", ns, check=False)


# --- the cluster -------------------------------------------------------------------------------------


@dataclass
class NetnsCluster:
    hosts: Hosts
    log_dir: Path
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    pool: cf.ThreadPoolExecutor | None = None  # threads living in the decode host's namespace

    prefill_url = f"http://{PREFILL_ADDR}:{HTTP_PORT}"
    decode_url = f"http://{DECODE_ADDR}:{HTTP_PORT}"
    reference_url = f"http://127.0.0.1:{REF_PORT}"
    proxy_url = f"http://{DECODE_ADDR}:{PROXY_PORT}"

    @staticmethod
    def base_env(dev: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("KVCONNECT_", "UCX_"))}
        env.update(
            UCX_TLS="tcp",
            UCX_NET_DEVICES=dev,
            NIXL_LOG_LEVEL="WARN",
            KVCONNECT_LOG_LEVEL="WARNING",
            KVCONNECT_SECRET=SECRET,
            PYTHONUNBUFFERED="1",
        )
        return env

    def spawn(self, name: str, ns: str, args: list[str], env: dict[str, str]) -> None:
        out = open(self.log_dir / f"{name}.log", "wb")
        cmd = ["ip", "netns", "exec", ns, sys.executable, "-m", "kvconnect.cli", *args]
        self.procs[name] = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
        out.close()

    def start(self) -> None:
        h = self.hosts
        # prefill host: configuration through KVCONNECT_* only, as in the container images and manifests
        env = self.base_env(h.prefill_dev)
        env.update(
            KVCONNECT_ROLE="prefill",
            KVCONNECT_HOST="0.0.0.0",
            KVCONNECT_PORT=str(HTTP_PORT),
            KVCONNECT_SIDE_CHANNEL_HOST="0.0.0.0",
            KVCONNECT_SIDE_CHANNEL_PORT=str(SIDE_PORT),
            KVCONNECT_ADVERTISE_HOST=PREFILL_ADDR,
            KVCONNECT_LAYOUT="cross_layer",
            KVCONNECT_ENGINE_ID="netns-prefill",
            KVCONNECT_NUM_BLOCKS="256",
        )
        self.spawn("prefill", h.prefill_ns, ["serve"], env)
        # decode host: flags this time, bound to the host's own address
        env = self.base_env(h.decode_dev)
        common = ["--layout", "blocks_first", "--num-blocks", "256"]
        self.spawn(
            "decode",
            h.decode_ns,
            [
                "serve",
                "--role",
                "decode",
                "--host",
                DECODE_ADDR,
                "--port",
                str(HTTP_PORT),
                "--side-channel-host",
                DECODE_ADDR,
                "--engine-id",
                "netns-decode",
                *common,
            ],
            env,
        )
        self.spawn(
            "reference",
            h.decode_ns,
            ["serve", "--role", "both", "--host", "127.0.0.1", "--port", str(REF_PORT), *common],
            env,
        )
        env = self.base_env(h.decode_dev)
        env.update(
            KVCONNECT_PROXY_HOST="0.0.0.0",
            KVCONNECT_PROXY_PORT=str(PROXY_PORT),
            KVCONNECT_PREFILL_URLS=self.prefill_url,
            KVCONNECT_DECODE_URLS=self.decode_url,
        )
        self.spawn("proxy", h.decode_ns, ["proxy"], env)
        self.pool = cf.ThreadPoolExecutor(
            12, thread_name_prefix="netns-client", initializer=enter_netns, initargs=(h.decode_ns,)
        )
        self.wait_healthy()

    def logs(self) -> str:
        parts = []
        for name in self.procs:
            path = self.log_dir / f"{name}.log"
            tail = path.read_text(errors="replace")[-1500:] if path.exists() else ""
            parts.append(f"--- {name} (exit {self.procs[name].poll()}) ---\n{tail}")
        return "\n".join(parts)

    def check_alive(self) -> None:
        dead = [n for n, p in self.procs.items() if p.poll() is not None]
        if dead:
            raise AssertionError(f"{dead} exited early\n{self.logs()}")

    def run(self, fn: Callable[..., T], *args: Any, timeout_s: float = 60.0) -> T:
        """Call fn(*args) on a thread inside the decode host's namespace."""
        assert self.pool is not None
        return self.pool.submit(fn, *args).result(timeout_s)

    def map(self, fn: Callable[..., T], *iterables: Any, timeout_s: float = 120.0) -> list[T]:
        assert self.pool is not None
        return list(self.pool.map(fn, *iterables, timeout=timeout_s))

    def get(self, url: str) -> httpx.Response:
        return self.run(lambda: httpx.get(url, timeout=5.0))

    def post(self, url: str, body: dict[str, Any], timeout_s: float = 60.0) -> httpx.Response:
        return self.run(lambda: httpx.post(url, json=body, timeout=timeout_s), timeout_s=timeout_s + 5)

    def wait_healthy(self) -> None:
        urls = {
            "prefill": self.prefill_url,
            "decode": self.decode_url,
            "reference": self.reference_url,
            "proxy": self.proxy_url,
        }
        pending = {name: url + "/health" for name, url in urls.items()}

        def healthy(url: str) -> bool:
            try:
                return httpx.get(url, timeout=1.0).status_code == 200
            except httpx.HTTPError:
                return False

        deadline = time.monotonic() + STARTUP_S
        while pending:
            self.check_alive()
            for name, ok in zip(list(pending), self.map(healthy, list(pending.values())), strict=True):
                if ok:
                    del pending[name]
            if time.monotonic() > deadline:
                raise AssertionError(f"not healthy within {STARTUP_S}s: {sorted(pending)}\n{self.logs()}")
            if pending:
                time.sleep(0.1)  # poll interval, bounded by the deadline above

    def health(self, url: str) -> dict[str, Any]:
        return self.get(url + "/health").json()  # type: ignore[no-any-return]

    def poll_until(self, predicate: Callable[[], bool], what: str, timeout_s: float = 20.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not predicate():
            if time.monotonic() > deadline:
                raise AssertionError(f"{what} not reached within {timeout_s}s\n{self.logs()}")
            time.sleep(0.02)

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)


@pytest.fixture(scope="module")
def cluster(hosts: Hosts, tmp_path_factory: pytest.TempPathFactory) -> Iterator[NetnsCluster]:
    c = NetnsCluster(hosts, tmp_path_factory.mktemp("netns-logs"))
    try:
        c.start()
        yield c
    finally:
        c.stop()


# --- tests -------------------------------------------------------------------------------------------


def test_wildcard_bind_needs_an_advertise_host() -> None:
    """Binding every interface says nothing about which address a peer on another host should dial."""
    for wildcard in ("0.0.0.0", "::", "*"):
        with pytest.raises(ConfigError, match="advertise_host"):
            connector_config(environ={"KVCONNECT_SIDE_CHANNEL_HOST": wildcard})
        with pytest.raises(ConfigError, match="advertise_host"):
            connector_config(environ={"KVCONNECT_ADVERTISE_HOST": wildcard})
    cfg = connector_config(
        environ={
            "KVCONNECT_SIDE_CHANNEL_HOST": "0.0.0.0",
            "KVCONNECT_SIDE_CHANNEL_PORT": "5600",
            "KVCONNECT_ADVERTISE_HOST": "10.1.2.3",
            "KVCONNECT_SECRET": SECRET,
        }
    )
    assert (cfg.side_channel_host, cfg.side_channel_port, cfg.advertise_host) == ("0.0.0.0", 5600, "10.1.2.3")
    assert (
        connector_config(environ={"KVCONNECT_SIDE_CHANNEL_HOST": "10.1.2.3", "KVCONNECT_SECRET": SECRET}).advertise_host
        == "10.1.2.3"
    )


def test_workers_bind_where_told_and_are_reached_across_hosts(cluster: NetnsCluster) -> None:
    prefill = cluster.health(cluster.prefill_url)  # from the decode host, over the veth
    assert prefill["role"] == "prefill" and prefill["engine_id"] == "netns-prefill"  # KVCONNECT_* only
    assert prefill["side_channel_port"] == SIDE_PORT
    decode = cluster.health(cluster.decode_url)
    assert decode["role"] == "decode" and decode["engine_id"] == "netns-decode"
    # --host 10.77.0.2 binds that address only: the decode host's loopback has nothing on the port
    with pytest.raises(httpx.ConnectError):
        cluster.get(f"http://127.0.0.1:{HTTP_PORT}/health")
    proxy = cluster.get(cluster.proxy_url + "/health").json()
    assert proxy["status"] == "ok" and set(proxy["workers"]) == {cluster.prefill_url, cluster.decode_url}


def test_prefill_advertises_its_address_not_its_bind_address(cluster: NetnsCluster) -> None:
    prompt = "a hand-driven prefill leg across two hosts, as the llm-d sidecar sends it"
    leg = {"prompt": prompt, "max_tokens": 1, "stream": False, "kv_transfer_params": {"do_remote_decode": True}}
    r = cluster.post(cluster.prefill_url + "/v1/completions", leg)
    assert r.status_code == 200, r.text
    params = r.json()["kv_transfer_params"]
    assert (params["remote_host"], params["remote_port"]) == (PREFILL_ADDR, SIDE_PORT)  # bound on 0.0.0.0
    assert params["remote_engine_id"] == "netns-prefill"
    body = {"prompt": prompt, "max_tokens": 6, "return_token_ids": True, "kv_transfer_params": params}
    d = cluster.post(cluster.decode_url + "/v1/completions", body)
    assert d.status_code == 200, d.text
    a = cluster.run(complete, cluster.reference_url, prompt, 6)
    assert d.json()["choices"][0]["token_ids"] == a["token_ids"]
    assert d.json()["kvconnect_transfer"]["num_blocks"] == len(params["remote_block_ids"])
    cluster.poll_until(lambda: cluster.health(cluster.prefill_url)["leased_blocks"] == 0, "lease released")


def test_disaggregated_equals_aggregated_with_kv_over_the_veth(cluster: NetnsCluster) -> None:
    h = cluster.hosts
    tx_before = h.tx_bytes(h.prefill_ns, h.prefill_dev)

    def one(i: int, prompt: str) -> tuple[str, dict[str, Any], dict[str, Any]]:
        stream, chat = i % 3 == 1, i % 4 == 3
        disagg = complete(cluster.proxy_url, prompt, 6, stream=stream, chat=chat)
        agg = complete(cluster.reference_url, prompt, 6, chat=chat)
        return prompt, disagg, agg

    rows = cluster.map(one, range(len(PROMPTS)), PROMPTS)
    kv_bytes = 0
    for prompt, disagg, agg in rows:
        assert disagg["status"] == 200, (prompt, disagg, cluster.logs())
        assert disagg["token_ids"] == agg["token_ids"], prompt
        if disagg.get("transfer"):
            kv_bytes += disagg["transfer"]["bytes"]
    assert kv_bytes > 256 * 1024, "too little KV moved for the check below to mean anything"
    cluster.poll_until(lambda: cluster.health(cluster.prefill_url)["leased_blocks"] == 0, "leases released")
    # the veth is the only path between the hosts: the prefill end sent at least every KV byte read
    sent = h.tx_bytes(h.prefill_ns, h.prefill_dev) - tx_before
    assert sent >= kv_bytes, (sent, kv_bytes)
    free = cluster.health(cluster.decode_url)
    assert free["free_blocks"] == free["total_blocks"]
