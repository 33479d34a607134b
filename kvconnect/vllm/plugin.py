"""vLLM's general-plugin hook (`vllm.general_plugins` entry point `kvconnect`): registers
`KVConnectConnector` with vLLM's connector factory, so `{"kv_connector": "KVConnectConnector"}` works without
`kv_connector_module_path`. vLLM calls it in every process, possibly more than once: registering is lazy (the
connector's module is imported only when vLLM builds one) and done once."""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)
NAME = "KVConnectConnector"


def register() -> bool:
    """Register the connector by name; False when vLLM's factory already has the name (or is missing)."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    except ImportError as e:  # a vLLM without the V1 connector factory: the module path still works
        log.warning("kvconnect: cannot register %s with vLLM (%s); set kv_connector_module_path", NAME, e)
        return False
    if NAME in getattr(KVConnectorFactory, "_registry", {}):
        return False
    KVConnectorFactory.register_connector(NAME, "kvconnect.vllm", NAME)
    return True
