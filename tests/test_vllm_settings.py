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
    assert consumer.request_finished(Req({"do_remote_decode": True}), [1, 2]) == (False, None)
    assert consumer.build_connector_meta(1).leases == []
    producer = SchedulerSide(read_settings(Cfg({}, role="kv_producer")))
    delay, params = producer.request_finished(Req({"do_remote_decode": True}), [1, 2])
    assert delay and params is not None and params["remote_block_ids"] == [1, 2]
    assert [o.block_ids for o in producer.build_connector_meta(1).leases] == [[1, 2]]


def test_a_kv_producer_pulls_nothing_for_a_clients_do_remote_prefill() -> None:
    params = {"do_remote_prefill": True, "remote_engine_id": "e", "remote_block_ids": [1], "remote_host": "h"}
    producer = SchedulerSide(read_settings(Cfg({}, role="kv_producer")))
    assert producer.get_num_new_matched_tokens(Req(dict(params)), 0) == (0, False)
    consumer = SchedulerSide(read_settings(Cfg({}, role="kv_consumer")))
    assert consumer.get_num_new_matched_tokens(Req(dict(params)), 0) == (65, True)
