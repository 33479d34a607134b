"""The transports (core/transports/): each is an object of its connector, started on the thread that builds the
connector, its offer reaches peers in the handshake, a decode opens the first transport that can serve a peer
(NIXL's READ last, always there; a required transport that cannot serve a peer is refused by name), and the decode
half of the package knows no NIXL detail."""

from __future__ import annotations

import ast
import threading
from pathlib import Path

import pytest
import zmq

from kvconnect.core.agent import NixlAgent
from kvconnect.core.cache import KVCache
from kvconnect.core.config import TransportChoice
from kvconnect.core.connector import KVConnector
from kvconnect.core.errors import TransportUnavailableError
from kvconnect.core.plan.layout import LayoutKind
from kvconnect.core.transports.base import Link, Transport
from kvconnect.core.transports.nixl_read import NixlLink, NixlRead
from kvconnect.core.transports.registry import READY, TRANSPORTS, Transports
from kvconnect.core.wire import protocol as p
from kvconnect.core.wire.handshake import request as side_request
from tests.helpers import config_for_tests, spec

ROOT = Path(__file__).resolve().parents[1]


class Recording(Transport):
    """A transport that records which thread started it (it moves nothing: never opened here)."""

    kind = "memory"
    calls: list[tuple[str, int]] = []

    def start(self, cache: KVCache, agent: NixlAgent) -> bytes:
        Recording.calls.append(("start", threading.get_ident()))
        self.state = "started"  # (per connector: an instance of its own)
        return b"recorded"

    def open(self, offer: bytes, info: p.PeerInfo, plan) -> Link:  # type: ignore[no-untyped-def]
        raise TransportUnavailableError("the peer is on another host" if offer else "not offered by the peer")


def test_transports_start_on_the_building_thread_before_the_connector_returns() -> None:
    """An engine (vLLM) captures CUDA graphs right after it registers its cache; start-up CUDA work on the
    connector's loop thread then raced that capture and failed the engine's start. Every transport's start
    therefore runs on the thread that builds the connector, and is done when it returns."""
    Recording.calls = []
    me = threading.get_ident()
    cache = KVCache.allocate(spec(LayoutKind.BLOCKS_FIRST, 8))
    with KVConnector(cache, config_for_tests(), transports=(Recording,)) as conn:
        assert Recording.calls == [("start", me)]
        assert [t.kind for t in conn._transports.started] == ["memory", "nixl"]  # NIXL's READ added, last
        assert all(isinstance(t, Transport) for t in conn._transports.started)  # objects of this connector


def test_a_transports_offer_reaches_peers_in_the_handshake_under_its_kind() -> None:
    cache = KVCache.allocate(spec(LayoutKind.BLOCKS_FIRST, 8))
    with KVConnector(cache, config_for_tests(), transports=(Recording,)) as conn:
        ctx = zmq.Context()
        try:
            info = side_request(ctx, "127.0.0.1", conn.side_channel_port, p.Hello(p.PROTOCOL_VERSION, "d"), 5, b"")
        finally:
            ctx.term()
        assert isinstance(info, p.PeerInfo) and info.offers == {"memory": b"recorded"}  # (NIXL offers nothing)
    with KVConnector(cache, config_for_tests(transport="nixl"), transports=(Recording,)) as conn:
        assert conn._peer_info.offers == {}  # transport=nixl: no other transport starts, none is offered
        assert conn._transports.status == {"memory": "off (transport=nixl)", "nixl": READY}


def test_the_start_up_report_names_every_transport() -> None:
    cache = KVCache.allocate(spec(LayoutKind.BLOCKS_FIRST, 8))
    with NixlAgentFor() as agent:
        started = Transports.start(cache, agent, TransportChoice.AUTO)
        try:
            assert set(started.status) == {t.kind for t in TRANSPORTS}
            assert started.status == {"ipc": "not for a cpu cache", "nixl": READY}
            assert started.describe() == "ipc not for a cpu cache; nixl ready"
        finally:
            started.close()


class NixlAgentFor:
    """A bare NIXL agent for a test, closed after."""

    def __enter__(self) -> NixlAgent:
        self.agent = NixlAgent("transports-test")
        return self.agent

    def __exit__(self, *exc: object) -> None:
        self.agent.close()


@pytest.mark.parametrize("offered", [True, False])
def test_the_decode_reads_over_nixl_unless_the_required_transport_is_the_one_refused(offered: bool) -> None:
    cache = KVCache.allocate(spec(LayoutKind.BLOCKS_FIRST, 8))
    with KVConnector(cache, config_for_tests()) as prefill, NixlAgentFor() as agent:
        info = prefill._peer_info
        if offered:
            info.offers["memory"] = b"x"
        from kvconnect.core.plan.hetero import plan_source, plan_sources

        plan = plan_source(cache.spec, info.spec, plan_sources(cache.spec, 1).reads[0], "auto", 0)
        auto = Transports.start(cache, agent, TransportChoice.AUTO, (Recording,))
        link = auto.open(info, plan, "e#0")
        assert isinstance(link, NixlLink) and link.kind == "nixl" and link.notifies  # (NIXL, after the refusal)
        link.close()
        required = Transports(started=auto.started, required="memory", status=dict(auto.status))
        why = "the peer is on another host" if offered else "not offered by the peer"
        with pytest.raises(
            TransportUnavailableError, match=f"peer e#0: the required transport cannot serve it: memory: {why}"
        ):
            required.open(info, plan, "e#0")
        auto.close()


def test_the_decode_half_knows_no_nixl_detail() -> None:
    """A backend owns both halves of its transfer: nothing under core/decode/ imports NIXL's wrapper, a NIXL
    transport module, or the staging cache; it sees transports only through `transports/base.py` and the
    registry's `Transports`."""
    allowed = {"kvconnect.core.transports.base", "kvconnect.core.transports.registry"}
    for path in sorted((ROOT / "kvconnect" / "core" / "decode").glob("*.py")):
        tree = ast.parse(path.read_text())
        names = {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        names |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        nixl = {x for x in names if x.split(".")[0] == "nixl" or x.startswith("nixl_")}
        ours = {x for x in names if x.startswith("kvconnect.core.transports") and x not in allowed}
        assert not nixl and not ours, f"{path.name} imports {sorted(nixl | ours)}"
        assert "kvconnect.core.agent" not in names, f"{path.name} imports NIXL's wrapper"
        text = path.read_text()
        for word in ("NixlAgent", "PreppedList", "add_remote", "prep(", "StagingPool", "staging_ids"):
            assert word not in text, f"{path.name} mentions {word}"


def test_nixl_is_the_last_transport_and_every_transport_lives_in_its_room() -> None:
    assert TRANSPORTS[-1] is NixlRead
    assert all(t.__module__.startswith("kvconnect.core.transports.") for t in TRANSPORTS)


def test_the_architecture_page_lists_every_part_a_new_transport_must_provide() -> None:
    """docs/architecture.md's touch list for a new transport stays true to the interface and the registry."""
    import inspect

    from kvconnect.core.transports import base

    doc = (ROOT / "docs" / "architecture.md").read_text()
    touch = doc[doc.index("- **A transport**") : doc.index("- **A cache layout**")]
    hooks = {
        f"{cls.__name__}.{name}"
        for cls in (base.Transport, base.Link, base.Move)
        for name, _ in inspect.getmembers(cls)
        if not name.startswith("_") and name not in ("kind", "notifies", "abandonable")
    }
    assert hooks == {
        "Transport.applies",
        "Transport.start",
        "Transport.open",
        "Transport.close",
        "Link.prepare",
        "Link.close",
        "Move.post",
        "Move.state",
        "Move.issued_descs",
        "Move.land",
        "Move.release",
        "Move.settle",
    }
    missing = [h for h in sorted(hooks) if f"`{h.split('.')[1]}" not in touch]
    assert not missing, f"the touch list does not name {missing}"
    assert "registry.TRANSPORTS" in touch
