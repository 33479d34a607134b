"""What binds a lease to a vLLM request (kvconnect/vllm/binding.py): everything vLLM's prefix cache keys its KV by.

Findings 1 and 2 of the fourth review: a prompt given as embeddings had an empty binding (an unbound lease: any
prompt's PIN was answered HELD), and two requests differing only in an image (same placeholder tokens) or a LoRA
adapter shared one binding. The binding now covers the token ids, the cache salt, the prompt embeddings (dtype,
shape, bytes), each multimodal item's identity and place, and the LoRA adapter; a request whose binding cannot be
computed is not leased. vLLM's own request type is not needed: the binding reads only these attributes.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from kvconnect.core.cache import KVCache
from kvconnect.core.connector import KVConnector
from kvconnect.core.errors import LeaseLostError
from kvconnect.core.plan.layout import LayoutKind
from kvconnect.core.plan.params import prompt_digest
from kvconnect.vllm.binding import prompt_binding
from tests.helpers import config_for_tests, spec


def request(**over: Any) -> SimpleNamespace:
    base: dict[str, Any] = dict(
        prompt_token_ids=list(range(40)),
        num_prompt_tokens=40,
        prompt_embeds=None,
        mm_features=None,
        lora_request=None,
        cache_salt=None,
    )
    return SimpleNamespace(**{**base, **over})


def image(identifier: str | None, offset: int = 5, length: int = 16) -> SimpleNamespace:
    return SimpleNamespace(identifier=identifier, mm_position=SimpleNamespace(offset=offset, length=length))


def lora(name: str, path: str = "/adapters/x", int_id: int = 1) -> SimpleNamespace:
    return SimpleNamespace(lora_name=name, lora_path=path, lora_int_id=int_id)


def embeds(seed: int, n: int = 40, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(n, 8, generator=torch.Generator().manual_seed(seed)).to(dtype)


def test_a_plain_prompt_is_bound_as_before_to_its_tokens_and_salt() -> None:
    assert prompt_binding(request()) == prompt_digest(list(range(40)))
    assert prompt_binding(request(cache_salt="tenant-a")) == prompt_digest(list(range(40)), "tenant-a")
    assert prompt_binding(request(), backoff=1) == prompt_digest(list(range(39)))


def test_a_prompt_of_embeddings_is_bound_to_its_embeddings() -> None:
    """Finding 1: an embeddings prompt had no token ids, so its binding was empty: an unbound lease."""
    a, b = (
        request(prompt_token_ids=None, prompt_embeds=embeds(1)),
        request(prompt_token_ids=None, prompt_embeds=embeds(2)),
    )
    assert prompt_binding(a) and prompt_binding(b) and prompt_binding(a) != prompt_binding(b)
    assert prompt_binding(a) == prompt_binding(request(prompt_token_ids=None, prompt_embeds=embeds(1)))
    as_bf16 = request(prompt_token_ids=None, prompt_embeds=embeds(1, dtype=torch.bfloat16))
    assert prompt_binding(as_bf16) != prompt_binding(a)  # (dtype and bytes are part of it)
    assert prompt_binding(a) != prompt_binding(request())  # (nor the same as a token prompt's)


@pytest.mark.parametrize(
    ("one", "other"),
    [
        ({"mm_features": [image("img-A")]}, {"mm_features": [image("img-B")]}),  # another image, same tokens
        ({"mm_features": [image("img-A", offset=5)]}, {"mm_features": [image("img-A", offset=9)]}),  # another place
        ({"lora_request": lora("sql")}, {"lora_request": lora("chat")}),  # another adapter
        ({"lora_request": lora("sql")}, {}),  # an adapter against the base model
        ({"lora_request": lora("sql", "/adapters/v1")}, {"lora_request": lora("sql", "/adapters/v2")}),  # repointed
    ],
    ids=["image", "image_place", "lora", "lora_base", "lora_path"],
)
def test_requests_that_differ_only_in_what_the_prefix_cache_keys_have_different_bindings(one, other) -> None:
    """Finding 2: the binding covered token ids and the salt only, while vLLM's block hashes also key images and
    LoRA adapters: image A's KV (or adapter A's) could be loaded, and cached, for image B (or the base model)."""
    assert prompt_binding(request(**one)) != prompt_binding(request(**other))
    assert prompt_binding(request(**one)) == prompt_binding(request(**one))


def test_what_cannot_be_bound_binds_nothing() -> None:
    assert prompt_binding(request(prompt_token_ids=None)) == b""  # (neither tokens nor embeddings)
    assert prompt_binding(request(mm_features=[image(None)])) == b""  # (an item without an identity)
    assert prompt_binding(request(mm_features=[image(None, offset=45)])) != b""  # (past the tokens bound: ignored)


def test_a_scheduler_leases_an_embeddings_prompt_bound_and_nothing_it_cannot_bind() -> None:
    """The vLLM scheduler half grants under the binding (never an empty one) and signs it into the params."""
    pytest.importorskip("vllm", reason="the vLLM plug-in needs vllm")
    from vllm.config import KVTransferConfig
    from vllm.v1.request import RequestStatus

    from kvconnect.vllm.scheduler import KVConnectScheduler
    from kvconnect.vllm.settings import read_settings

    config = SimpleNamespace(
        kv_transfer_config=KVTransferConfig(kv_connector="KVConnectConnector", kv_role="kv_producer"),
        parallel_config=SimpleNamespace(tensor_parallel_size=1),
        cache_config=SimpleNamespace(block_size=32),
    )
    producer = KVConnectScheduler(read_settings(config))
    leg = request(prompt_token_ids=None, prompt_embeds=embeds(3), num_computed_tokens=40)
    leg.request_id, leg.kv_transfer_params, leg.status = (
        "emb-1",
        {"do_remote_decode": True},
        RequestStatus.FINISHED_LENGTH_CAPPED,
    )
    delay, params = producer.request_finished(leg, ([1, 2],))
    assert delay and params is not None and params["remote_prompt_digest"] == prompt_binding(leg).hex()
    assert producer.build_connector_meta(1).leases[0].prompt_digest == prompt_binding(leg) != b""
    unbound = request(mm_features=[image(None)], num_computed_tokens=40)
    unbound.request_id, unbound.kv_transfer_params = "mm-1", {"do_remote_decode": True}
    unbound.status = RequestStatus.FINISHED_LENGTH_CAPPED
    assert producer.request_finished(unbound, ([3, 4],)) == (False, None)


def test_a_lease_bound_to_one_embeddings_prompt_is_not_read_for_another() -> None:
    """End to end through two connectors: the attacker's embeddings leg, another tenant's prompt with its params."""
    attacker, victim = (
        request(prompt_token_ids=None, prompt_embeds=embeds(4)),
        request(prompt_token_ids=None, prompt_embeds=embeds(5)),
    )
    cache = KVCache.allocate(spec(LayoutKind.BLOCKS_FIRST))
    with (
        KVConnector(cache, config_for_tests()) as prefill,
        KVConnector(KVCache.allocate(spec(LayoutKind.BLOCKS_FIRST)), config_for_tests()) as dec,
    ):
        params = prefill.lease("leg", [3, 4], 32, prompt_digest=prompt_binding(attacker))
        with pytest.raises(LeaseLostError, match="another prompt"):
            dec.pull(params, [0, 1], prompt_digest=prompt_binding(victim))
        assert prefill.lease_state(params.remote_lease_id).value == "held"
        dec.pull(params, [0, 1], prompt_digest=prompt_binding(attacker)).wait(20)
