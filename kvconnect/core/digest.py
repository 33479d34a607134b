"""KV digests (`kv_digest`): the bytes a decode pulled are checked against the prefill's, end to end.

At grant, a prefill with `kv_digest` on sums the content of each leased block: the block seen as 64-bit
words, summed modulo 2**64 (bytes, where a row of head_dim elements is not a multiple of 8 bytes), over
every layer and both halves. Such a sum does not depend on where the layout puts the words (kv_first,
blocks_first, cross_layer, NHD or HND all hold the same words per block), nor on the order of the adds, so
the two sides need not share a layout or a device. Its answer to a PIN or CONFIRM carries `digest()` over
the sums of exactly the blocks named; the decode computes the same over the blocks it wrote and fails the
pull closed (`DigestError`) on a mismatch. It applies where a local block holds what one remote block
holds (`applies`): the `block` path of one source; pulls that reassemble blocks (TP splits, block-size
changes, staging) are not checked.

On CUDA the sums are one gather and one reduction per chunk of blocks (at most CHUNK_BYTES gathered at
once); on the CPU, numpy sums each block where it lies (no copy), at memory speed.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np
import torch

from kvconnect.core.cache import KVCache
from kvconnect.core.plan.layout import CacheSpec, LayoutKind

CHUNK_BYTES = 256 * 2**20  # blocks gathered at once on a GPU
DIGEST_BYTES = 16


def _words(cache: KVCache) -> list[torch.Tensor]:
    """Every region of `cache` as (num_blocks, n) views, one row per block, of int64 words (or uint8)."""
    spec = cache.spec
    row_bytes = spec.head_dim * spec.itemsize
    wide = spec.page or row_bytes % 8 == 0
    out = []
    for region in cache.regions:
        parts = [region[0], region[1]] if spec.kind is LayoutKind.KV_FIRST and not spec.page else [region]
        for part in parts:
            raw = part.view(torch.uint8).view(spec.num_blocks, -1)  # (a view: never a copy of the cache)
            out.append(raw.view(torch.int64) if wide and raw.shape[1] % 8 == 0 else raw)
    return out


def block_sums(cache: KVCache, block_ids: Sequence[int] | np.ndarray) -> list[int]:
    """Per block of `block_ids` (in order), the sum of its content modulo 2**64 (see the module docstring)."""
    ids = np.asarray(block_ids, dtype=np.int64)
    views = _words(cache)
    if views[0].device.type == "cpu":
        total = np.zeros(len(ids), dtype=np.int64)
        for view in views:
            host = view.numpy()
            total += np.fromiter((host[b].sum(dtype=np.int64) for b in ids), dtype=np.int64, count=len(ids))
        return [int(x) for x in total]
    index = torch.as_tensor(ids, device=views[0].device)
    sums = torch.zeros(len(ids), dtype=torch.int64, device=index.device)
    for view in views:
        per_chunk = max(1, CHUNK_BYTES // max(view.shape[1] * view.element_size(), 1))
        for start in range(0, len(ids), per_chunk):
            rows = view.index_select(0, index[start : start + per_chunk])
            sums[start : start + per_chunk] += rows.sum(dim=1, dtype=torch.int64)
    return [int(x) for x in sums.cpu().tolist()]


def digest(sums: Sequence[int]) -> bytes:
    """DIGEST_BYTES over a list of block sums, in its order (a block swapped with another changes it)."""
    return hashlib.blake2b(np.asarray(sums, dtype="<i8").tobytes(), digest_size=DIGEST_BYTES).digest()


def applies(local: CacheSpec, remote: CacheSpec, whole_blocks: bool, one_source: bool) -> bool:
    """Whether a pull between these specs leaves each local block holding one remote block's words."""
    same = ("dtype", "num_layers", "block_size", "num_kv_heads", "head_dim", "page")
    return whole_blocks and one_source and all(getattr(local, f) == getattr(remote, f) for f in same)
