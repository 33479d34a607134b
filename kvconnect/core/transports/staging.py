"""The staging path of NIXL's READ: a cache shaped like the remote one, its block pool, and the scatter into
ours.

Whole remote blocks are read block for block into staging blocks (few, large descriptors); `scatter` then
moves the request's tokens and head slice into the decode cache on the cache's device, converting block size
and NHD/HND on the way. Staging blocks go back to the pool only when no READ can still write into them (the
move that reserved them gives them back when it settles: `nixl_read.py`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from kvconnect.core.cache import KVCache
from kvconnect.core.errors import InvalidRequestError
from kvconnect.core.plan.layout import CacheSpec, LayoutKind


class StagingPool:
    """A staging cache and its free blocks (touched only inside a connector tick)."""

    def __init__(self, spec: CacheSpec) -> None:
        self.cache = KVCache.allocate(spec)
        self._free = list(range(spec.num_blocks - 1, -1, -1))

    @property
    def capacity(self) -> int:
        return self.cache.spec.num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self, count: int) -> list[int] | None:
        """`count` blocks, or None while too few are free; InvalidRequestError if it can never fit."""
        if count > self.capacity:
            raise InvalidRequestError(
                "remote_block_ids",
                f"{count} blocks need more staging than its {self.capacity} blocks "
                f"({self.capacity * self.cache.spec.block_bytes / 2**20:.0f} MiB); raise staging_mb",
            )
        if count > len(self._free):
            return None
        out = self._free[-count:][::-1]
        del self._free[-count:]
        return out

    def free(self, ids: Sequence[int]) -> None:
        self._free.extend(ids)


def _token_major(cache: KVCache) -> list[torch.Tensor]:
    """Per region, a (num_blocks, block_size, layers, 2, H, D) view (no copy), whatever the layout."""
    hnd = cache.spec.token_layout == "HND"
    kind = cache.spec.kind
    out = []
    for t in cache.regions:
        if kind is LayoutKind.CROSS_LAYER:  # (nb, L, 2, B, H, D) or (nb, L, 2, H, B, D)
            out.append(t.permute(0, 4, 1, 2, 3, 5) if hnd else t.permute(0, 3, 1, 2, 4, 5))
        elif kind is LayoutKind.BLOCKS_FIRST:  # (nb, 2, B, H, D) or (nb, 2, H, B, D)
            out.append((t.permute(0, 3, 1, 2, 4) if hnd else t.permute(0, 2, 1, 3, 4)).unsqueeze(2))
        else:  # kv_first: (2, nb, B, H, D) or (2, nb, H, B, D)
            out.append((t.permute(1, 3, 0, 2, 4) if hnd else t.permute(1, 2, 0, 3, 4)).unsqueeze(2))
    return out


def _layer_views(cache: KVCache) -> list[torch.Tensor]:
    """Per layer, a (num_blocks, block_size, 1, 2, H, D) view."""
    views = _token_major(cache)
    if cache.spec.kind is LayoutKind.CROSS_LAYER:
        return [views[0][:, :, layer : layer + 1] for layer in range(cache.spec.num_layers)]
    return views


def scatter(
    src: KVCache,
    src_ids: Sequence[int] | np.ndarray,
    dst: KVCache,
    dst_ids: Sequence[int] | np.ndarray,
    num_tokens: int,
    heads: tuple[int, int],
) -> None:
    """Copy tokens [0, num_tokens) of global KV heads `heads` from blocks `src_ids` of `src` (token order) into
    blocks `dst_ids` of `dst`. Runs on the caches' device; the caller synchronises before using `dst`."""
    dev = dst.regions[0].device
    t = torch.arange(num_tokens, device=dev)
    s_blk = torch.as_tensor(list(src_ids), device=dev)[t // src.spec.block_size]
    d_blk = torch.as_tensor(list(dst_ids), device=dev)[t // dst.spec.block_size]
    s_slot, d_slot = t % src.spec.block_size, t % dst.spec.block_size
    s_lo = heads[0] - src.spec.head_range()[0]
    d_lo = heads[0] - dst.spec.head_range()[0]
    width = heads[1] - heads[0]
    if src.spec.kind is LayoutKind.CROSS_LAYER and dst.spec.kind is LayoutKind.CROSS_LAYER:
        pairs = [(_token_major(src)[0], _token_major(dst)[0])]  # every layer in one gather and one put
    else:
        pairs = list(zip(_layer_views(src), _layer_views(dst), strict=True))
    for s_view, d_view in pairs:
        d_view[d_blk, d_slot, :, :, d_lo : d_lo + width] = s_view[s_blk, s_slot, :, :, s_lo : s_lo + width]
