"""KV digests (`kv_digest`): the bytes a decode pulled are checked against the prefill's, end to end.

At grant, a prefill with `kv_digest` on sums the content of each leased block, position-weighted: every
64-bit word (byte, where a row of head_dim elements is not a multiple of 8 bytes) is multiplied by an odd
weight drawn from its *canonical* position (layer, K or V, token, head, word in the row; an engine's opaque
page: layer, word in the page) and the products summed modulo 2**64. The canonical position does not depend
on where a layout puts the word (kv_first, blocks_first, cross_layer, NHD or HND), so the two sides need not
share a layout or a device; but a word moved to another position changes the sum: layers swapped, K and V
swapped, tokens or heads reordered (a plain sum could not tell). One pass: a gather of the blocks in
canonical order, a multiply and a reduction per chunk of blocks (at most CHUNK_BYTES gathered at once).

Its answer to a PIN or CONFIRM carries `digest()` over the sums of exactly the blocks named; the decode
computes the same over the blocks it wrote and fails the pull closed (`DigestError`) on a mismatch. It
applies where a local block holds what one remote block holds (`applies`): the `block` path of one source;
pulls that reassemble blocks (TP splits, block-size changes, staging) are not checked.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Sequence

import numpy as np
import torch

from kvconnect.core.cache import KVCache
from kvconnect.core.plan.layout import CacheSpec, LayoutKind

CHUNK_BYTES = 256 * 2**20  # blocks gathered at once on a GPU (fewer kernel launches)
CPU_CHUNK_BYTES = 2 * 2**20  # ... and on the CPU (a gather that stays in cache while it is multiplied and summed)
DIGEST_BYTES = 16


_MIX = -0x61C8864680B583EB  # 0x9E3779B97F4A7C15 as a signed int64 (the weights wrap modulo 2**64)
_ADD = 0x632BE59BD9B4E019


def _units(cache: KVCache) -> list[tuple[torch.Tensor, int]]:
    """The cache as units, each (num_blocks, ...) holding words of a block in canonical order, with the
    canonical position (in words, or bytes: `_word_bytes`) of its first: as few units as the layout allows
    (NHD: a whole cross_layer block, a blocks_first layer, a kv_first K or V; HND: each K or V as a strided
    view in token order; an engine's page per layer)."""
    spec = cache.spec
    unit = 8 if _word_bytes(spec) == 8 else 1
    half = spec.half_bytes // unit
    if spec.page:
        page = spec.region_bytes // spec.num_blocks // unit
        return [(r.view(spec.num_blocks, -1), layer * page) for layer, r in enumerate(cache.regions)]
    if spec.token_layout == "HND":
        views = [kv for layer in range(spec.num_layers) for kv in cache.kv(layer)]
        return [(v, i * half) for i, v in enumerate(views)]
    if spec.kind is LayoutKind.CROSS_LAYER:
        return [(cache.regions[0].reshape(spec.num_blocks, -1), 0)]
    if spec.kind is LayoutKind.BLOCKS_FIRST:
        return [(r.reshape(spec.num_blocks, -1), 2 * layer * half) for layer, r in enumerate(cache.regions)]
    return [(r[kv], (2 * layer + kv) * half) for layer, r in enumerate(cache.regions) for kv in (0, 1)]


def _word_bytes(spec: CacheSpec) -> int:
    """8 (int64 words) where every row of head_dim elements (or an engine's page) is whole words, else 1."""
    row = spec.region_bytes // spec.num_blocks if spec.page else spec.head_dim * spec.itemsize
    return 8 if row % 8 == 0 else 1


def _as_words(rows: torch.Tensor, word_bytes: int) -> torch.Tensor:
    """(m, ...) rows as (m, n) int64 words in their canonical order (bytes widened to int64 when 1)."""
    raw = rows.contiguous().view(torch.uint8).reshape(rows.shape[0], -1)
    return raw.view(torch.int64) if word_bytes == 8 else raw.to(torch.int64)


@functools.lru_cache(maxsize=512)
def _weights(start: int, n: int, device: torch.device) -> torch.Tensor:
    """The odd weights of canonical positions [start, start + n) (kept: the same units come back)."""
    pos = torch.arange(start, start + n, dtype=torch.int64, device=device)
    return (pos * _MIX + _ADD) | 1


def block_sums(cache: KVCache, block_ids: Sequence[int] | np.ndarray) -> list[int]:
    """Per block of `block_ids` (in order), its position-weighted sum modulo 2**64 (module docstring)."""
    units, word_bytes = _units(cache), _word_bytes(cache.spec)
    index = torch.as_tensor(np.asarray(block_ids, dtype=np.int64), device=units[0][0].device)
    sums = torch.zeros(len(index), dtype=torch.int64, device=index.device)
    for view, start in units:
        chunk_bytes = CHUNK_BYTES if view.device.type == "cuda" else CPU_CHUNK_BYTES
        per_chunk = max(1, chunk_bytes // max(view[0].numel() * view.element_size(), 1))
        for first in range(0, len(index), per_chunk):
            words = _as_words(view.index_select(0, index[first : first + per_chunk]), word_bytes)
            weights = _weights(start, words.shape[1], words.device)
            sums[first : first + per_chunk] += words.mul_(weights).sum(dim=1)  # (words: a gathered copy)
    return [int(x) for x in sums.cpu().tolist()]


def digest(sums: Sequence[int]) -> bytes:
    """DIGEST_BYTES over a list of block sums, in its order (a block swapped with another changes it)."""
    return hashlib.blake2b(np.asarray(sums, dtype="<i8").tobytes(), digest_size=DIGEST_BYTES).digest()


def applies(local: CacheSpec, remote: CacheSpec, whole_blocks: bool, one_source: bool) -> bool:
    """Whether a pull between these specs leaves each local block holding one remote block's words."""
    same = ("dtype", "num_layers", "block_size", "num_kv_heads", "head_dim", "page")
    return whole_blocks and one_source and all(getattr(local, f) == getattr(remote, f) for f in same)
