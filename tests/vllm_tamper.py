"""KV connectors that let a test scramble a prefill's blocks in a running vLLM server (the failure table's
"permuted KV" case: an engine or allocator fault writing into leased blocks, made on purpose).

Each class is a connector as shipped (kvconnect's, and vLLM's NixlConnector / NixlPushConnector with their thread
pinning undone and their progress thread kept, `kvconnect.bench.nixl_fair`) plus one thing on the worker side:
before each step's forward (`bind_connector_metadata`) it looks for a file `blocks.json` in the directory
`KVCONNECT_TAMPER_DIR` names. The file holds a list of block ids; the worker permutes their content across layers
(each block of layer l takes what the same block held in layer l + 1, the last layer the first's: K and V stay
paired, as a layout fault that shifts layers would leave them), then renames the file `done.json`, so the test
knows it happened. With no such directory, or no file, they are the shipped connectors (one `stat` per step).

(Reversing the blocks' order instead would not do: attention sums over the prompt's positions, whose places are
already in the keys (rotary embeddings), so a decode reading the blocks in another order still computes the same
answer.)

Load one by name: `{"kv_connector": "TamperKVConnectConnector", "kv_connector_module_path":
"tests.vllm_tamper"}`.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import torch

from kvconnect.bench.nixl_fair import ProgressNixlConnector, ProgressNixlPushConnector
from kvconnect.vllm import KVConnectConnector

log = logging.getLogger(__name__)

TAMPER_DIR_ENV = "KVCONNECT_TAMPER_DIR"
ORDER, DONE = "blocks.json", "done.json"


def rotate_layers(kv_caches: dict[str, torch.Tensor], block_ids: list[int]) -> int:
    """Give each of `block_ids` in layer l the content it has in layer l + 1 (the last layer the first's);
    dimension 0 of each layer's tensor is the block (vLLM's CPU cache: `[num_blocks, kv_heads, block_size,
    2 * head_size]`). Returns how many layers were rewritten."""
    tensors = list(kv_caches.values())
    ids = torch.tensor(block_ids, dtype=torch.long, device=tensors[0].device)
    saved = [t.index_select(0, ids).clone() for t in tensors]
    for i, tensor in enumerate(tensors):
        tensor.index_copy_(0, ids, saved[(i + 1) % len(tensors)])
    return len(tensors)


class _Tamper:
    """The mixin, first in each class's bases: remembers the KV tensors, and rewrites blocks when a test asks
    (its two hooks call the connector's own through `super()`)."""

    _tamper_caches: dict[str, torch.Tensor] | None = None

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        super().register_kv_caches(kv_caches)  # type: ignore[misc]
        self._tamper_caches = dict(kv_caches)

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        self._tamper_check()
        super().bind_connector_metadata(connector_metadata)  # type: ignore[misc]

    def _tamper_check(self) -> None:
        where = os.environ.get(TAMPER_DIR_ENV)
        if not where or self._tamper_caches is None:
            return
        order = Path(where) / ORDER
        if not order.exists():
            return
        block_ids = [int(b) for b in json.loads(order.read_text())]
        layers = rotate_layers(self._tamper_caches, block_ids)
        log.warning("tamper: blocks %s permuted across %d layers", block_ids, layers)
        order.rename(Path(where) / DONE)


class TamperKVConnectConnector(_Tamper, KVConnectConnector):
    pass


class TamperNixlConnector(_Tamper, ProgressNixlConnector):
    pass


class TamperNixlPushConnector(_Tamper, ProgressNixlPushConnector):
    pass
