"""The plug-in's settings and kv_role, without starting vLLM (vLLM's own config and request types only)."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("vllm", reason="the vLLM plug-in tests need vllm (the `vllm` extra)")

from vllm.config import KVTransferConfig  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402

from kvconnect.core.errors import ConfigError  # noqa: E402
from kvconnect.vllm.scheduler import SchedulerSide  # noqa: E402
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
    consumer = SchedulerSide(read_settings(Cfg({}, role="kv_consumer")))
    assert consumer.request_finished(Req({"do_remote_decode": True}), ([1, 2],)) == (False, None)
    assert consumer.build_connector_meta(1).leases == []
    producer = SchedulerSide(read_settings(Cfg({}, role="kv_producer")))
    delay, params = producer.request_finished(Req({"do_remote_decode": True}), ([1, 2],))
    assert delay and params is not None and params["remote_block_ids"] == [1, 2]
    assert [o.block_ids for o in producer.build_connector_meta(1).leases] == [[1, 2]]


def test_a_kv_producer_pulls_nothing_for_a_clients_do_remote_prefill() -> None:
    params = {"do_remote_prefill": True, "remote_engine_id": "e", "remote_block_ids": [1], "remote_host": "h"}
    producer = SchedulerSide(read_settings(Cfg({}, role="kv_producer")))
    assert producer.get_num_new_matched_tokens(Req(dict(params)), 0) == (0, False)
    consumer = SchedulerSide(read_settings(Cfg({}, role="kv_consumer")))
    assert consumer.get_num_new_matched_tokens(Req(dict(params)), 0) == (65, True)


def test_kv_cache_groups_move_whole_or_as_a_windows_tail_and_other_kinds_stop_start_up() -> None:
    """vLLM's KV cache groups (the hybrid KV cache manager): full attention moves every block, a sliding
    window its tail (null placeholders dropped); a kind kvconnect cannot move stops start-up in one line
    naming the group's layers and spec. vLLM's own spec classes, not look-alikes."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, SlidingWindowSpec

    from kvconnect.vllm.groups import group_moves

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
    mamba = Group(spec(MambaSpec), [f"model.layers.{i}.mixer" for i in (0, 2, 4, 6)])
    with pytest.raises(ConfigError) as e:
        group_moves(config(Group(full, ["model.layers.1.attn"]), mamba))
    message = str(e.value)
    assert "\n" not in message and "KV cache group 1 (model.layers.0.mixer" in message and "MambaSpec" in message
    assert "and 1 more" in message and "sliding-window" in message
