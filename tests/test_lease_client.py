"""The one lease client: the proxy releases a whole prefill TP group, as a non-reader, and never drops a
decode reader's pin (real connectors and side channels, in this process)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import msgspec
import pytest
import zmq

from kvconnect.core.cache import KVCache
from kvconnect.core.config import connector_config
from kvconnect.core.connector import KVConnector
from kvconnect.core.plan.hetero import Source
from kvconnect.core.plan.layout import CacheSpec, LayoutKind
from kvconnect.core.plan.params import new_lease_id
from kvconnect.core.wire import lease_client
from kvconnect.core.wire import protocol as p
from kvconnect.core.wire.handshake import request
from kvconnect.harness.net import free_port_run, poll_until
from kvconnect.serving.proxy import Proxy

IDS = [3, 5, 6]


@pytest.fixture
def group() -> Iterator[list[tuple[KVConnector, list[int]]]]:
    """A prefill TP group of two ranks (one KV head each) on consecutive side-channel ports."""
    base = free_port_run(2)
    ranks = []
    try:
        for rank in range(2):
            spec = CacheSpec(
                kind=LayoutKind.BLOCKS_FIRST,
                dtype="float16",
                num_layers=2,
                num_blocks=8,
                block_size=4,
                num_kv_heads=1,
                head_dim=8,
                tp_size=2,
                tp_rank=rank,
                total_kv_heads=2,
            )
            freed: list[int] = []
            conn = KVConnector(
                KVCache.allocate(spec),
                connector_config(
                    {}, engine_id="tp-group", side_channel_host="127.0.0.1", side_channel_port=base + rank
                ),
                on_blocks_freed=freed.extend,
            )
            ranks.append((conn, freed))
        yield ranks
    finally:
        for conn, _ in ranks:
            conn.close()


def test_the_proxy_releases_every_rank_as_a_non_reader_and_keeps_a_readers_pin(group) -> None:
    (r0, freed0), (r1, freed1) = group
    lease_id = new_lease_id()  # one id for the group
    params = [conn.lease("req-tp", IDS, 12, lease_id) for conn, _ in group][0]  # rank 0's params serve the group
    assert params.tp_size == 2 and params.remote_port == r0.side_channel_port and params.remote_lease_id == lease_id
    ctx = zmq.Context()
    try:  # decode reader 0 of 1 pins rank 0's lease, as it does when it posts its READ
        pin = lease_client.pin("decode", lease_id, Source(0, (0, 1), 0, 1), IDS, 30.0, b"reader-0")
        assert request(ctx, "127.0.0.1", r0.side_channel_port, pin, 5).state is p.LeaseState.HELD
        proxy = Proxy(["http://127.0.0.1:1"], ["http://127.0.0.1:2"])
        asyncio.run(proxy._release("req-tp", msgspec.to_builtins(params), "client_aborted"))
        assert r0.lease_state(lease_id) is p.LeaseState.RELEASED and r1.lease_state(lease_id) is p.LeaseState.RELEASED
        poll_until(lambda: sorted(freed1) == IDS, what="rank 1's blocks freed")  # nobody read rank 1
        assert freed0 == [] and r0.snapshot().lease_blocks_held == 3  # rank 0's pinned READ keeps its blocks
        confirm = lease_client.confirm("decode", lease_id, Source(0, (0, 1), 0, 1), IDS, b"reader-0")
        assert request(ctx, "127.0.0.1", r0.side_channel_port, confirm, 5).state is p.LeaseState.COMPLETED
        poll_until(lambda: sorted(freed0) == IDS, what="rank 0's blocks freed once its reader confirmed")
    finally:
        ctx.term()


def test_release_everywhere_names_every_ranks_answer_even_when_one_is_gone(group) -> None:
    (r0, _), (r1, _) = group
    lease_id = new_lease_id()
    params = [conn.lease("req-gone", IDS, 12, lease_id) for conn, _ in group][0]
    r1.close()  # rank 1 is gone: its answer is an error, rank 0 is still released
    ctx = zmq.Context()
    try:
        answers = lease_client.release_everywhere(ctx, params, "proxy", b"", 0.5)
    finally:
        ctx.term()
    assert answers[0] == "released" and answers[1].startswith("error")
