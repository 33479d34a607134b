"""The transport registry (core/transports/registry.py): every fast path's start-up half runs on the thread
that builds the connector, its offer reaches peers in the handshake, and the decode takes the first path
that opens (NIXL otherwise; a required path that cannot serve a peer is refused by name)."""

from __future__ import annotations

import threading

import pytest
import zmq

from kvconnect.core.cache import KVCache
from kvconnect.core.config import TransportChoice
from kvconnect.core.connector import KVConnector
from kvconnect.core.errors import TransportUnavailableError
from kvconnect.core.plan.layout import LayoutKind
from kvconnect.core.transports.base import Transport, TransportKind
from kvconnect.core.transports.registry import FastPaths
from kvconnect.core.wire import protocol as p
from kvconnect.core.wire.handshake import request as side_request
from tests.helpers import config_for_tests, spec


class Recording(Transport):
    """A path that records which thread ran its start-up halves (it moves nothing: never opened here)."""

    kind = TransportKind.MEMORY
    calls: list[tuple[str, int]] = []

    @classmethod
    def warm_up(cls, cache: KVCache) -> None:
        cls.calls.append(("warm_up", threading.get_ident()))

    @classmethod
    def offer(cls, cache: KVCache) -> bytes:
        cls.calls.append(("offer", threading.get_ident()))
        return b"recorded"


def test_fast_paths_start_on_the_building_thread_before_the_connector_returns() -> None:
    """An engine (vLLM) captures CUDA graphs right after it registers its cache; start-up CUDA work on the
    connector's loop thread then raced that capture and failed the engine's start. Every path's warm-up and
    offer therefore run on the thread that builds the connector, and are done when it returns."""
    Recording.calls = []
    me = threading.get_ident()
    with KVConnector(KVCache.allocate(spec(LayoutKind.BLOCKS_FIRST, 8)), config_for_tests(), fast_paths=(Recording,)):
        assert Recording.calls == [("warm_up", me), ("offer", me)]


def test_a_paths_offer_reaches_peers_in_the_handshake_under_its_kind() -> None:
    cache = KVCache.allocate(spec(LayoutKind.BLOCKS_FIRST, 8))
    with KVConnector(cache, config_for_tests(), fast_paths=(Recording,)) as conn:
        ctx = zmq.Context()
        try:
            info = side_request(ctx, "127.0.0.1", conn.side_channel_port, p.Hello(p.PROTOCOL_VERSION, "d"), 5, b"")
        finally:
            ctx.term()
        assert isinstance(info, p.PeerInfo) and info.offers == {"memory": b"recorded"}
    with KVConnector(cache, config_for_tests(transport="nixl"), fast_paths=(Recording,)) as conn:
        assert conn._peer_info.offers == {}  # transport=nixl: no fast path starts, none is offered


class Unopenable(Recording):
    @classmethod
    def open(cls, offer, info, plan, cache) -> Transport:
        raise TransportUnavailableError("the peer is on another host")


@pytest.mark.parametrize("offered", [True, False])
def test_the_decode_reads_over_nixl_unless_the_required_path_is_the_one_refused(offered: bool) -> None:
    cache = KVCache.allocate(spec(LayoutKind.BLOCKS_FIRST, 8))
    info = p.PeerInfo(
        p.PROTOCOL_VERSION, "e", "inc", "agent", b"", cache.spec, [0] * 4, offers={"memory": b"x"} if offered else {}
    )
    why = "the peer is on another host" if offered else "not offered by the peer"
    auto = FastPaths.start(cache, TransportChoice.AUTO, (Unopenable,))
    assert auto.open(info, None, cache, "e#0") is None  # type: ignore[arg-type]  # (NIXL)
    required = FastPaths((Unopenable,), required=True)
    with pytest.raises(
        TransportUnavailableError, match=f"peer e#0: the required transport cannot serve it: memory: {why}"
    ):
        required.open(info, None, cache, "e#0")  # type: ignore[arg-type]


def test_the_architecture_page_lists_every_part_a_new_transport_must_provide() -> None:
    """docs/architecture.md's touch list for a new transport stays true to the interface and the registry."""
    import inspect
    from pathlib import Path

    from kvconnect.core.transports import registry

    doc = (Path(__file__).resolve().parents[1] / "docs" / "architecture.md").read_text()
    touch = doc[doc.index("- **A transport**") : doc.index("- **A cache layout**")]
    hooks = {name for name, _ in inspect.getmembers(Transport) if not name.startswith("_")} - {"kind", "notifies"}
    assert hooks == {"applies", "warm_up", "offer", "open", "order", "post", "close"}  # (the interface itself)
    missing = [h for h in sorted(hooks - {"close"}) if f"`{h}" not in touch]
    assert not missing, f"the touch list does not name {missing}"
    assert "registry.FAST_PATHS" in touch and registry.FAST_PATHS
    assert all(t.__module__.startswith("kvconnect.core.transports.") for t in registry.FAST_PATHS)
