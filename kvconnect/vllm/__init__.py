"""kvconnect as a vLLM KV-connector plug-in (`KVConnectorBase_V1` of vLLM 0.26 to 0.33; see compat.py).

    --kv-transfer-config '{"kv_connector": "KVConnectConnector", "kv_connector_module_path": "kvconnect.vllm",
                           "kv_role": "kv_producer",
                           "kv_connector_extra_config": {"secret_file": "/etc/kvconnect/secret"}}'

`KVConnectConnector` (and with it vLLM) is imported on first use, so the vLLM-free parts of this package
(`layout.py`: vLLM's tensors described by their strides) load without vLLM.
"""

from __future__ import annotations

from typing import Any

__all__ = ["KVConnectConnector"]


def __getattr__(name: str) -> Any:
    if name == "KVConnectConnector":
        from kvconnect.vllm.connector import KVConnectConnector

        return KVConnectConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
