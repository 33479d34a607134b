"""What a decode does with params a client controls, beyond validating them: releases to the ranks they
name, the prefill's incarnation behind each lease answer, staging caches per remote shape, and the start-up
warning for a decode open to the network without a peer allow-list. Real connectors and NIXL throughout."""

from __future__ import annotations

import os
import socket
import time
import types

import msgspec
import pytest

from kvconnect.core.cache import KVCache
from kvconnect.core.connector import KVConnector
from kvconnect.core.decode.confirm import LeaseConfirmation
from kvconnect.core.decode.peers import Peer
from kvconnect.core.decode.pull import PinState, Pull
from kvconnect.core.errors import KVConnectError, LayoutMismatchError, LeaseLostError
from kvconnect.core.plan.hetero import Source
from kvconnect.core.plan.layout import CacheSpec, LayoutKind
from kvconnect.core.plan.params import KVTransferParams
from kvconnect.core.transports.nixl_read import MAX_STAGING_POOLS, NixlRead
from kvconnect.core.wire import lease_client
from kvconnect.core.wire import protocol as p
from kvconnect.harness.prefill import PrefillProcess
from kvconnect.serving.serve import exposure_warning
from tests.faultkit import poll_until
from tests.helpers import config_for_tests, params_to

SPEC = CacheSpec(
    kind=LayoutKind.BLOCKS_FIRST,
    dtype="float16",
    num_layers=2,
    num_blocks=16,
    block_size=16,
    num_kv_heads=2,
    head_dim=32,
)


def decoder(**config) -> KVConnector:
    return KVConnector(KVCache.allocate(SPEC), config_for_tests(**config))


def closed_port_base(ranks: int) -> int:
    """A base port for `ranks` consecutive loopback ports nobody listens on (bound and closed just now)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + ranks < 65536:
            return base
    raise AssertionError("no free port range")


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def params_for(engine_id: str, port: int, tp_size: int) -> KVTransferParams:
    return params_to(port, engine_id, block_ids=(1, 2), request_id="r-1", tp_size=tp_size)


def test_release_only_channels_close_again_and_never_pile_up() -> None:
    """Params the decode will not read are released on every rank they name. Each such rank used to become a
    peer with a socket kept for the process's life (params of 1,100 ranks: 'Too many open files', the decode
    wedged). Now a rank with no peer gets a channel that closes once its time is up, and no more than
    SHORT_CHANNELS_MAX are open at once; the decode keeps no peer for any of them."""
    with decoder() as dec:
        short = dec._decode.peers.short
        before = open_fds()
        base = closed_port_base(64)
        for i in range(3):  # 3 x 64 ranks, nobody answering: at most SHORT_CHANNELS_MAX open
            dec.release_remote(params_for(f"gone-{i}", base, 64))
        poll_until(
            lambda: short.dropped == 3 * 64 - lease_client.SHORT_CHANNELS_MAX,
            timeout_s=10,
            what="releases beyond the cap dropped",
        )
        assert len(short) <= lease_client.SHORT_CHANNELS_MAX
        assert dec._decode.peers.all() == []
        poll_until(
            lambda: len(short) == 0, timeout_s=lease_client.SHORT_CHANNEL_S + 10, what="release-only channels closed"
        )
        poll_until(lambda: open_fds() <= before + 2, timeout_s=10, what="their sockets closed")


def test_an_answered_release_closes_its_channel_at_once_and_frees_the_lease() -> None:
    pre = PrefillProcess.start(SPEC, seed=3)
    try:
        params = pre.lease("short-1", [4, 5])
        with decoder() as dec:
            t0 = time.monotonic()
            dec.release_remote(params)
            poll_until(lambda: pre.ask("state", "short-1") == "released", what="lease released")
            poll_until(lambda: len(dec._decode.peers.short) == 0, what="channel closed on the answer")
            assert time.monotonic() - t0 < lease_client.SHORT_CHANNEL_S  # (closed by the answer, not the timer)
    finally:
        pre.stop()


def test_a_release_goes_to_no_more_ranks_than_the_prefill_runs_once_it_handshook() -> None:
    """After a pull, the decode knows the prefill's TP size from its handshake: params claiming 8 ranks are
    released on the one rank there is (its peer's channel), not on 7 more addresses the client chose."""
    pre = PrefillProcess.start(SPEC, seed=4)
    try:
        with decoder() as dec:
            dec.pull(pre.lease("tp-1", [1]), [0]).wait(20)
            params = msgspec.structs.replace(pre.lease("tp-2", [2]), tp_size=8)
            dec.release_remote(params)
            poll_until(lambda: pre.ask("state", "tp-2") == "released", what="lease released on rank 0")
            assert len(dec._decode.peers.short) == 0 and dec._decode.peers.short.dropped == 0
            assert [peer.key for peer in dec._decode.peers.all()] == [f"{params.remote_engine_id}#0"]
    finally:
        pre.stop()


def test_a_lease_answer_from_another_incarnation_fails_the_pull() -> None:
    """A pin answered HELD by a process that is not the one the decode handshook with (a prefill restarted
    on the same address) must not make the pull's data trusted."""
    failed: list[KVConnectError] = []
    endings = types.SimpleNamespace(succeed=lambda pull: None, fail=lambda pull, e: failed.append(e))
    confirmation = LeaseConfirmation(config_for_tests(), KVCache.allocate(SPEC), "decode", endings)  # type: ignore[arg-type]
    info = p.PeerInfo(p.PROTOCOL_VERSION, "prefill-0", "a" * 32, "agent", b"", SPEC, [0, 0, 0, 0])
    peer = Peer("prefill-0", "127.0.0.1", 5600, types.SimpleNamespace(), Source(0, (0, 2), 0, 1), info=info)
    pull = Pull.from_params(params_for("prefill-0", 5600, 1), [0, 1], "r-1", SPEC, 10.0)
    pull.source = Source(0, (0, 2), 0, 1)
    for incarnation, fails in (("a" * 32, 0), ("", 0), ("b" * 32, 1)):
        pull.pin = PinState.SENT
        confirmation.answer(peer, pull, p.LeaseReply(pull.lease_id, p.LeaseState.HELD, incarnation))
        assert len(failed) == fails, incarnation
        assert pull.pin is (PinState.HELD if not fails else PinState.SENT)
    assert isinstance(failed[0], LeaseLostError) and "restarted" in str(failed[0])


def test_staging_caches_are_capped_per_decode() -> None:
    """Each remote cache shape a decode stages for costs a staging cache of up to staging_mb; a decode that
    any client can point at prefills of ever new shapes must stop allocating them."""
    with decoder() as dec:
        (nixl,) = [t for t in dec._transports.started if isinstance(t, NixlRead)]
        for i in range(MAX_STAGING_POOLS):
            nixl.staging[msgspec.structs.replace(SPEC, num_blocks=100 + i)] = object()  # type: ignore[assignment]
        with pytest.raises(LayoutMismatchError, match="staging cache"):
            nixl._staging_pool(msgspec.structs.replace(SPEC, num_blocks=99))
        nixl.staging.clear()


@pytest.mark.parametrize(
    ("role", "host", "allowlist", "warns"),
    [
        ("decode", "0.0.0.0", "", True),
        ("both", "10.1.2.3", " ", True),
        ("decode", "127.0.0.1", "", False),
        ("decode", "::1", "", False),
        ("decode", "0.0.0.0", "10.0.0.0/8", False),
        ("prefill", "0.0.0.0", "", False),
    ],
)
def test_a_decode_reachable_from_the_network_without_an_allowlist_is_warned_about(role, host, allowlist, warns) -> None:
    text = exposure_warning(role, host, allowlist)
    assert bool(text) is warns
    if warns:
        assert "--peer-allowlist" in text and host in text
