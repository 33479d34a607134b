"""A prefill that grants its lease after the params left (the vLLM plug-in grants on its next engine step):
the decode's PIN, CONFIRM or RELEASE may arrive first. Real NIXL between this process and a prefill process."""

from __future__ import annotations

import uuid

import msgspec
import pytest

from kvconnect.core.cache import KVCache
from kvconnect.core.connector import KVConnector
from kvconnect.core.errors import LeaseLostError
from kvconnect.core.plan.layout import CacheSpec, LayoutKind
from kvconnect.core.plan.params import new_lease_id
from kvconnect.harness.prefill import PrefillProcess
from tests.faultkit import poll_until
from tests.helpers import config_for_tests

SPEC = CacheSpec(
    kind=LayoutKind.CROSS_LAYER,
    num_blocks=24,
    dtype="float16",
    num_layers=2,
    block_size=16,
    num_kv_heads=2,
    head_dim=32,
)


def rid() -> str:
    return f"late-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def late_prefill():
    pre = PrefillProcess.start(SPEC, seed=5, lease_grace_s=30.0)
    yield pre
    pre.stop()


def not_granted_yet(pre: PrefillProcess, request_id: str, block_ids: list[int]):
    """Params naming a lease `pre` has not granted (yet), otherwise as its own."""
    warm = rid()
    params = pre.lease(warm, [23])
    pre.release(warm)
    return msgspec.structs.replace(
        params, remote_request_id=request_id, remote_block_ids=block_ids, remote_lease_id=new_lease_id()
    )


def decoder(**config) -> KVConnector:
    return KVConnector(
        KVCache.allocate(msgspec.structs.replace(SPEC, num_blocks=8)),
        config_for_tests(**config),
    )


@pytest.mark.parametrize("pin_reads", [True, False], ids=["pin", "confirm"])
def test_a_pull_posted_before_the_grant_succeeds_once_the_lease_is_granted(late_prefill, pin_reads) -> None:
    pre, request_id = late_prefill, rid()
    params = not_granted_yet(pre, request_id, [4, 5])
    with decoder(pin_reads=pin_reads) as dec:
        before = pre.ask("unknown")
        handle = dec.pull(params, [1, 2])
        poll_until(lambda: pre.ask("unknown") > before, what="the prefill was asked about the lease")
        assert handle.poll() is False  # still waiting for the grant, not failed
        pre.lease(request_id, [4, 5], lease_id=params.remote_lease_id)
        handle.wait(20)
        assert dec.cache.block_bytes(2) == pre.ask("block", 5)
        poll_until(lambda: pre.ask("state", request_id) == "completed", what="lease completed by the reader")


def test_without_a_grace_a_lease_the_prefill_never_saw_fails_at_once() -> None:
    pre = PrefillProcess.start(SPEC, seed=6)
    try:
        with decoder() as dec:
            with pytest.raises(LeaseLostError, match="unknown"):
                dec.pull(not_granted_yet(pre, rid(), [3]), [0]).wait(20)
    finally:
        pre.stop()


def test_a_lease_never_granted_fails_when_the_grace_ends_not_at_the_deadline() -> None:
    pre = PrefillProcess.start(SPEC, seed=7, lease_grace_s=0.3)
    try:
        with decoder(pull_timeout_s=60.0) as dec:
            with pytest.raises(LeaseLostError, match="unknown"):  # (at the deadline it would be a timeout)
                dec.pull(not_granted_yet(pre, rid(), [3]), [0]).wait(30)
    finally:
        pre.stop()


def test_a_release_that_arrives_before_the_grant_frees_the_blocks_at_the_grant(late_prefill) -> None:
    pre, request_id = late_prefill, rid()
    params = not_granted_yet(pre, request_id, [7, 8])
    with decoder() as dec:
        before = pre.ask("unknown")
        dec.release_remote(params)  # the decode aborted before the prefill's next step
        poll_until(lambda: pre.ask("unknown") > before, what="the release reached the prefill")
    pre.lease(request_id, [7, 8], lease_id=params.remote_lease_id)
    assert pre.ask("state", request_id) == "released"
    assert {7, 8} <= set(pre.ask("freed"))
