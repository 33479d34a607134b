"""Real pulls between two processes: a prefill process and this (decode) process, NIXL over UCX."""

from __future__ import annotations

import errno
import socket
import time
import uuid
import zlib

import msgspec
import numpy as np
import pytest
import zmq

from kvconnect.core.cache import KVCache
from kvconnect.core.connector import KVConnector
from kvconnect.core.errors import (
    AuthError,
    DigestError,
    HandshakeTimeoutError,
    InvalidRequestError,
    LayoutMismatchError,
    LeaseLostError,
    TransferError,
    TransferTimeoutError,
    TransportUnavailableError,
)
from kvconnect.core.plan.layout import LayoutKind
from kvconnect.core.plan.params import KVTransferParams
from kvconnect.harness.prefill import PrefillProcess
from tests.faultkit import poll_until
from tests.helpers import config_for_tests, decoder, params_to, spec


@pytest.fixture(scope="module")
def prefills():
    procs = {kind: PrefillProcess.start(spec(kind), seed=11 + i) for i, kind in enumerate(LayoutKind)}
    yield procs
    for proc in procs.values():
        proc.stop()


def connector_for(kind: LayoutKind, transports, **config) -> KVConnector:
    return KVConnector(KVCache.allocate(spec(kind, 32)), config_for_tests(**config), transports=transports)


def rid() -> str:
    return f"req-{uuid.uuid4().hex[:8]}"


@pytest.mark.parametrize("local_kind", list(LayoutKind))
def test_every_layout_pair_pulls_byte_exact(prefills, local_kind) -> None:
    rng = np.random.default_rng(zlib.crc32(local_kind.value.encode()))  # (str hash() is salted per process)
    with decoder(local_kind) as dec:
        for remote_kind, pre in prefills.items():
            for t in dec.cache.regions:
                t.zero_()
            remote_ids = [int(x) for x in rng.permutation(36)[:12]] + [36, 37, 38]  # scattered + a run
            local_ids = [int(x) for x in rng.permutation(29)[:12]] + [29, 30, 31]
            request_id = rid()
            params = pre.lease(request_id, remote_ids)
            stats = dec.pull(params, local_ids).wait(20)
            for lid, r in zip(local_ids, remote_ids, strict=True):
                assert dec.cache.block_bytes(lid) == pre.ask("block", r), (local_kind, remote_kind, lid)
            untouched = set(range(32)) - set(local_ids)
            zero = bytes(spec(local_kind).block_bytes)
            assert all(dec.cache.block_bytes(b) == zero for b in untouched)
            assert stats.bytes == 15 * spec(local_kind).block_bytes and stats.num_blocks == 15
            if local_kind is remote_kind:  # the run of three merges (mixed pairs may share no dense unit)
                assert stats.num_descs_merged < stats.num_descs
            assert stats.num_descs_merged <= stats.num_descs
            assert pre.ask("state", request_id) == "completed"
            assert set(remote_ids) <= set(pre.ask("freed"))
        assert dec.snapshot().pulls_ok == 3 and dec.snapshot().handshakes == 3


def test_notification_alone_releases_the_lease(prefills) -> None:
    pre = prefills[LayoutKind.CROSS_LAYER]
    with decoder(LayoutKind.CROSS_LAYER, confirm_reads=False) as dec:
        request_id = rid()
        params = pre.lease(request_id, [1, 2, 3, 20])
        assert pre.ask("state", request_id) == "held"
        stats = dec.pull(params, [4, 5, 6, 7]).wait(20)
        assert stats.num_descs == 4 and stats.num_descs_merged == 2 and stats.granularity == "BLOCK"
        poll_until(lambda: pre.ask("state", request_id) == "completed", what="lease completed by notification")
        assert pre.ask("held") == 0


def test_unread_lease_expires_and_frees_blocks() -> None:
    pre = PrefillProcess.start(spec(LayoutKind.BLOCKS_FIRST), lease_ttl_s=0.3)
    try:
        request_id = rid()
        pre.lease(request_id, [7, 8])
        poll_until(lambda: pre.ask("state", request_id) == "expired", what="lease expiry")
        assert pre.ask("freed") == [7, 8] and pre.ask("held") == 0
    finally:
        pre.stop()


def test_pull_of_expired_lease_fails_closed(prefills) -> None:
    pre = prefills[LayoutKind.BLOCKS_FIRST]
    with decoder(LayoutKind.BLOCKS_FIRST) as dec:
        request_id = rid()
        params = pre.lease(request_id, [10, 11])
        assert pre.ask("expire", request_id) == "expired"
        pre.ask("overwrite", 10)  # the blocks went back and now hold someone else's data
        with pytest.raises(LeaseLostError, match="expired"):
            dec.pull(params, [0, 1]).wait(20)
        assert dec.snapshot().pull_failures == {"LeaseLostError": 1}


@pytest.mark.parametrize("pin_reads", [True, False], ids=["pinned", "confirmed"])
def test_params_replayed_to_a_second_decode_after_the_read_are_consumed(prefills, pin_reads) -> None:
    """Decode A reads a lease and completes it; its blocks go back and hold another request's KV; the same
    params replayed to decode B (a router retry, a client reaching a decode directly) must not pass as read
    under the lease: B's read token is not the one that completed it."""
    pre = prefills[LayoutKind.BLOCKS_FIRST]
    request_id = rid()
    params = pre.lease(request_id, [12, 13, 14])
    with decoder(LayoutKind.BLOCKS_FIRST, pin_reads=pin_reads) as a:
        a.pull(params, [0, 1, 2]).wait(20)
    assert pre.settle(request_id, 20) == "completed"
    pre.ask("overwrite", 13)  # reused by another request
    with decoder(LayoutKind.BLOCKS_FIRST, pin_reads=pin_reads) as b:
        with pytest.raises(LeaseLostError, match="consumed"):
            b.pull(params, [0, 1, 2]).wait(20)
        assert b.snapshot().pull_failures == {"LeaseLostError": 1}


@pytest.mark.parametrize(("local_kind", "first"), [(LayoutKind.CROSS_LAYER, 32), (LayoutKind.KV_FIRST, 35)])
def test_blocks_that_changed_after_the_grant_fail_the_pull_on_their_digest(prefills, local_kind, first) -> None:
    """Something wrote into a leased block before the READ (here: the harness, as a bug in an engine or an
    allocator would): the READ, the pin and the confirmation all succeed, so only the bytes tell. With
    kv_digest the decode sums what it wrote, the prefill's grant-time sums disagree, and the pull fails
    closed; an untouched lease of the same blocks from another layout passes (the sums are layout-free)."""
    pre = prefills[LayoutKind.BLOCKS_FIRST]
    with decoder(local_kind) as dec:
        good = pre.lease(rid(), [30, 31])
        stats = dec.pull(good, [0, 1]).wait(20)
        assert stats.digest_s > 0  # checked (and passed) across layouts
        assert stats.after_read_s >= stats.confirm_s + stats.digest_s  # (the digest is after the read)
        request_id = rid()
        bad = pre.lease(request_id, [first, first + 1, first + 2])  # (blocks no earlier test overwrote)
        pre.ask("overwrite", first + 1)
        with pytest.raises(DigestError, match="digest"):
            dec.pull(bad, [2, 3, 4]).wait(20)
        assert dec.snapshot().pull_failures == {"DigestError": 1}
        poll_until(lambda: pre.ask("state", request_id) != "held", what="the bad lease ended")


def test_a_pull_whose_start_raises_fails_naming_why_instead_of_vanishing(prefills, monkeypatch) -> None:
    """An exception inside a pull's start (here: no socket for the peer, as with too many open files) used
    to escape the loop's tick: the pull was never registered, and its deadline never fired."""
    pre = prefills[LayoutKind.BLOCKS_FIRST]
    params = pre.lease(rid(), [20])
    with decoder(LayoutKind.BLOCKS_FIRST, pull_timeout_s=30.0) as dec:

        def no_socket(*args, **kwargs):
            raise zmq.ZMQError(errno.EMFILE)

        monkeypatch.setattr(dec._decode.peers, "new", no_socket)
        with pytest.raises(TransferError, match="could not start: ZMQError"):
            dec.pull(params, [0]).wait(10)
        assert dec.snapshot().pull_failures == {"TransferError": 1}


def test_remote_ids_out_of_range_are_refused_before_posting(prefills) -> None:
    pre = prefills[LayoutKind.KV_FIRST]
    with decoder(LayoutKind.KV_FIRST) as dec:
        request_id = rid()
        params = pre.lease(request_id, [1, 2])
        params.remote_block_ids = [1, 4000]
        with pytest.raises(InvalidRequestError) as e:
            dec.pull(params, [0, 1]).wait(20)
        assert e.value.field == "remote_block_ids"
        assert pre.ask("state", request_id) == "held"  # nothing was read
        with pytest.raises(InvalidRequestError, match="duplicated"):
            dec.pull(params, [3, 3])


@pytest.mark.parametrize("pin_reads", [True, False], ids=["pinned", "confirmed"])
def test_params_naming_another_requests_blocks_are_refused_and_both_leases_survive(prefills, pin_reads) -> None:
    """Lease A's params edited to B's blocks: the prefill refuses the pin or confirmation (and the READ's
    notification completes nothing), the decode fails as for a lost lease (its message names the field), and
    A and B are still held for their own readers, who then read their own bytes."""
    pre = prefills[LayoutKind.CROSS_LAYER]
    with decoder(LayoutKind.CROSS_LAYER, pin_reads=pin_reads) as dec:
        a, b = rid(), rid()
        pa, pb = pre.lease(a, [20, 21]), pre.lease(b, [22, 23])
        edited = msgspec.structs.replace(pa, remote_block_ids=[22, 23])
        with pytest.raises(LeaseLostError, match="refused kv_transfer_params.remote_block_ids.*not leased"):
            dec.pull(edited, [0, 1]).wait(20)
        assert pre.ask("state", a) == "held" and pre.ask("state", b) == "held"
        for params, local, remote in ((pa, [2, 3], [20, 21]), (pb, [4, 5], [22, 23])):
            dec.pull(params, local).wait(20)
            assert [dec.cache.block_bytes(x) for x in local] == [pre.ask("block", x) for x in remote]
        poll_until(
            lambda: pre.ask("state", a) == "completed" and pre.ask("state", b) == "completed",
            what="both leases completed by their own readers",
        )


def test_layout_mismatch_names_the_fields() -> None:
    pre = PrefillProcess.start(spec(LayoutKind.BLOCKS_FIRST, head_dim=64, dtype="bfloat16"))
    try:
        with decoder(LayoutKind.BLOCKS_FIRST) as dec:
            params = pre.lease(rid(), [1])
            with pytest.raises(LayoutMismatchError) as e:
                dec.pull(params, [0]).wait(20)
            assert set(e.value.fields) == {"head_dim", "dtype"}
    finally:
        pre.stop()


def test_secret_required_and_checked() -> None:
    pre = PrefillProcess.start(spec(LayoutKind.CROSS_LAYER), secret="open-sesame")
    try:
        with decoder(LayoutKind.CROSS_LAYER, secret="") as dec:  # (takes unsigned params: the side channel refuses)
            with pytest.raises(AuthError):
                dec.pull(pre.lease(rid(), [10]), [0]).wait(20)
        with decoder(LayoutKind.CROSS_LAYER, secret="guess") as dec:  # (refuses the params: signed under another key)
            with pytest.raises(InvalidRequestError, match="remote_key_id"):
                dec.pull(pre.lease(rid(), [11]), [0])
        with decoder(LayoutKind.CROSS_LAYER, secret="open-sesame") as dec:
            request_id = rid()
            dec.pull(pre.lease(request_id, [2, 3]), [0, 1]).wait(20)
            assert dec.cache.block_bytes(1) == pre.ask("block", 3)
    finally:
        pre.stop()


def test_dead_prefill_address_fails_within_deadline() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    params = params_to(port, "ghost")
    with decoder(LayoutKind.CROSS_LAYER, handshake_timeout_s=0.5) as dec:
        with pytest.raises(HandshakeTimeoutError, match="ghost"):  # (the caller's own 10 s would raise another)
            dec.pull(params, [0]).wait(10)


def test_tcp_only_transport_completes_asynchronously() -> None:
    pre = PrefillProcess.start(spec(LayoutKind.BLOCKS_FIRST), env={"UCX_TLS": "tcp"})
    try:
        with decoder(LayoutKind.KV_FIRST) as dec:
            request_id = rid()
            stats = dec.pull(pre.lease(request_id, [5, 9, 13]), [1, 2, 3]).wait(30)
            assert dec.cache.block_bytes(2) == pre.ask("block", 9)
            assert stats.transfer_s > 0
            # the post's parts (the timeline's DEBUG line splits "picked up -> posted" with them)
            assert stats.launch_s > 0 and stats.validate_s > 0 and stats.pin_s > 0  # (pins are on by default)
            assert 0 < stats.pin_rtt_s <= stats.total_s
            assert stats.validate_s + stats.pin_s + stats.launch_s <= stats.post_s
            poll_until(lambda: pre.ask("state", request_id) == "completed", what="lease completed")
    finally:
        pre.stop()


def test_prefill_restart_under_same_engine_id() -> None:
    pre = PrefillProcess.start(spec(LayoutKind.CROSS_LAYER), engine_id="prefill-a", seed=1)
    with decoder(LayoutKind.CROSS_LAYER) as dec:
        try:
            stale = pre.lease(rid(), [4])
            dec.pull(pre.lease(rid(), [1]), [0]).wait(20)
        finally:
            pre.stop()
        pre = PrefillProcess.start(spec(LayoutKind.CROSS_LAYER), engine_id="prefill-a", seed=2)
        try:
            request_id = rid()
            dec.pull(pre.lease(request_id, [1]), [0]).wait(20)  # new incarnation: re-handshake
            assert dec.cache.block_bytes(0) == pre.ask("block", 1)
            assert dec.snapshot().handshakes == 2
            stale.remote_port = pre.port  # a lease granted by the dead incarnation
            with pytest.raises(LeaseLostError, match="restarted"):
                dec.pull(stale, [2]).wait(20)
        finally:
            pre.stop()


def test_a_peer_set_up_that_raises_fails_its_pulls_at_once_and_is_handshaken_again(prefills, monkeypatch) -> None:
    """Any exception after the remote agent was added (here a RuntimeError building NIXL's link) ends the waiting
    pulls with a named error, drops the half-made peer (and its remote agent), and the next pull handshakes afresh."""
    from kvconnect.core.errors import HandshakeError
    from kvconnect.core.transports import nixl_read

    real = nixl_read.NixlLink
    calls = []

    def flaky(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("set-up bug")
        return real(*args, **kwargs)

    monkeypatch.setattr(nixl_read, "NixlLink", flaky)
    pre = prefills[LayoutKind.BLOCKS_FIRST]
    with decoder(LayoutKind.BLOCKS_FIRST, pull_timeout_s=30) as dec:
        t0 = time.monotonic()
        with pytest.raises(HandshakeError, match="set-up failed: RuntimeError: set-up bug"):
            dec.pull(pre.lease(rid(), [3]), [0]).wait(20)
        assert time.monotonic() - t0 < 30  # (not at the pull's deadline, nor at the caller's)
        request_id = rid()
        dec.pull(pre.lease(request_id, [4]), [1]).wait(20)
        assert dec.cache.block_bytes(1) == pre.ask("block", 4)
        snap = dec.snapshot()
        assert (snap.handshakes, snap.handshake_failures) == (1, 1) and len(calls) == 2
        assert sum(1 for x in dec._agent._lists if x.agent_name) == 1  # (the failed attempt's remote list is gone)


def test_a_pull_ends_by_its_own_deadline_while_its_peer_never_answers() -> None:
    """A peer that accepts the connection and never answers: the pull ends at its deadline (1 s), with a named
    error, although the handshake's own deadline (60 s) is far away."""
    ctx = zmq.Context()
    silent = ctx.socket(zmq.ROUTER)
    silent.setsockopt(zmq.LINGER, 0)
    port = silent.bind_to_random_port("tcp://127.0.0.1")
    params = params_to(port, "mute")
    try:
        with decoder(LayoutKind.CROSS_LAYER, handshake_timeout_s=60, pull_timeout_s=1.0) as dec:
            with pytest.raises(TransferTimeoutError, match="not ready before its deadline"):
                dec.pull(params, [0]).wait(30)
    finally:
        silent.close()
        ctx.term()


def test_the_peer_allowlist_refuses_a_host_before_any_connection() -> None:
    with socket.socket() as listener:  # a prefill address the list does not name: nobody may connect to it
        listener.bind(("127.0.0.1", 0))
        listener.listen(4)
        listener.settimeout(0.5)
        port = listener.getsockname()[1]
        params = KVTransferParams(
            do_remote_prefill=True,
            remote_engine_id="p",
            remote_block_ids=[1],
            remote_host="127.0.0.1",
            remote_port=port,
            remote_request_id="r",
            remote_lease_id="lease-r",
        )
        with decoder(LayoutKind.CROSS_LAYER, peer_allowlist="10.0.0.0/8, prefill.internal") as dec:
            with pytest.raises(InvalidRequestError) as e:
                dec.pull(params, [0])
            assert e.value.field == "kv_transfer_params.remote_host" and "peer_allowlist" in str(e.value)
            dec.release_remote(params)  # nor is a release sent there
            dec.wait_idle()
            with pytest.raises(socket.timeout):
                listener.accept()


def test_an_ipc_gather_that_cannot_compile_leaves_nixl_and_says_so(prefills) -> None:
    """The start-up compile of the IPC gather failing (a CUDA image without a C compiler) is one warning and
    a gauge; peers then use NIXL, and a connector told to use only IPC refuses them naming why."""
    from kvconnect.core.transports.ipc_gather import IpcTransport, PeerCopyError

    class NoCompiler(IpcTransport):  # (as on a GPU: the transport applies to this cache, its start-up fails)
        @classmethod
        def applies(cls, cache) -> bool:
            return True

        def start(self, cache, agent) -> bytes:
            raise PeerCopyError("RuntimeError: failed to find a C compiler")

    pre = prefills[LayoutKind.CROSS_LAYER]
    with connector_for(LayoutKind.CROSS_LAYER, transports=(NoCompiler,)) as dec:
        assert dec.snapshot().ipc_gather_unavailable == 1
        stats = dec.pull(pre.lease(rid(), [6]), [2]).wait(20)
        assert stats.transport == "nixl" and dec.cache.block_bytes(2) == pre.ask("block", 6)
    with connector_for(LayoutKind.CROSS_LAYER, transports=(NoCompiler,), transport="ipc") as dec:
        with pytest.raises(TransportUnavailableError, match="ipc: unavailable here .RuntimeError: failed to find a C"):
            dec.pull(pre.lease(rid(), [7]), [3]).wait(20)


def test_a_pooled_agent_splits_every_pull_over_its_threads_byte_exact(prefills) -> None:
    """nixl_threads asks UCX's thread pool to split every list: NIXL's own split size (1,024 descriptors)
    would leave a merged kvconnect list, a handful of descriptors, on one thread."""
    rng = np.random.default_rng(5)
    with decoder(LayoutKind.KV_FIRST, nixl_threads=2) as dec:
        assert dec._agent.backend_params("UCX") == {"num_threads": "2", "split_batch_size": "1"}
        for pre in prefills.values():
            remote_ids = [int(x) for x in rng.permutation(36)[:10]]
            local_ids = [int(x) for x in rng.permutation(32)[:10]]
            dec.pull(pre.lease(rid(), remote_ids), local_ids).wait(20)
            for lid, r in zip(local_ids, remote_ids, strict=True):
                assert dec.cache.block_bytes(lid) == pre.ask("block", r)
        assert dec.snapshot().pulls_ok == 3
