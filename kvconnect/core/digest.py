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

import hashlib
from collections.abc import Sequence

import numpy as np
import torch

from kvconnect.core.cache import KVCache
from kvconnect.core.plan.layout import CacheSpec

CHUNK_BYTES = 256 * 2**20  # blocks gathered at once on a GPU
DIGEST_BYTES = 16


_MIX = -0x61C8864680B583EB  # 0x9E3779B97F4A7C15 as a signed int64 (the weights wrap modulo 2**64)
_ADD = 0x632BE59BD9B4E019


def _units(cache: KVCache) -> list[torch.Tensor]:
    """The cache as units in canonical order, each (num_blocks, ...) with the words of one unit of a block in
    canonical order inside it: per layer K then V as (block_size, H, row words) views (an HND cache's strided
    the other way round), or per layer the engine's page."""
    spec = cache.spec
    if spec.page:
        return [region.view(spec.num_blocks, -1) for region in cache.regions]
    out: list[torch.Tensor] = []
    for layer in range(spec.num_layers):
        out.extend(cache.kv(layer))
    return out


def _as_words(rows: torch.Tensor) -> torch.Tensor:
    """(m, ...) contiguous rows as (m, n) int64 words (bytes widened to int64 where rows of the last
    dimension are not whole words)."""
    raw = rows.contiguous().view(torch.uint8).reshape(rows.shape[0], *rows.shape[1:-1], -1)
    if raw.shape[-1] % 8 == 0:
        return raw.view(torch.int64).reshape(rows.shape[0], -1)
    return raw.reshape(rows.shape[0], -1).to(torch.int64)


def _weights(n: int, unit: int, device: torch.device) -> torch.Tensor:
    pos = torch.arange(unit * n, (unit + 1) * n, dtype=torch.int64, device=device)
    return (pos * _MIX + _ADD) | 1


def block_sums(cache: KVCache, block_ids: Sequence[int] | np.ndarray) -> list[int]:
    """Per block of `block_ids` (in order), its position-weighted sum modulo 2**64 (module docstring)."""
    units = _units(cache)
    index = torch.as_tensor(np.asarray(block_ids, dtype=np.int64), device=units[0].device)
    sums = torch.zeros(len(index), dtype=torch.int64, device=index.device)
    for u, view in enumerate(units):
        unit_bytes = max(view[0].numel() * view.element_size(), 1)
        per_chunk = max(1, CHUNK_BYTES // unit_bytes)
        weights: torch.Tensor | None = None
        for start in range(0, len(index), per_chunk):
            words = _as_words(view.index_select(0, index[start : start + per_chunk]))
            if weights is None:
                weights = _weights(words.shape[1], u, words.device)
            sums[start : start + per_chunk] += words.mul_(weights).sum(dim=1)  # (words: a gathered copy)
    return [int(x) for x in sums.cpu().tolist()]


def digest(sums: Sequence[int]) -> bytes:
    """DIGEST_BYTES over a list of block sums, in its order (a block swapped with another changes it)."""
    return hashlib.blake2b(np.asarray(sums, dtype="<i8").tobytes(), digest_size=DIGEST_BYTES).digest()


def applies(local: CacheSpec, remote: CacheSpec, whole_blocks: bool, one_source: bool) -> bool:
    """Whether a pull between these specs leaves each local block holding one remote block's words."""
    same = ("dtype", "num_layers", "block_size", "num_kv_heads", "head_dim", "page")
    return whole_blocks and one_source and all(getattr(local, f) == getattr(remote, f) for f in same)
