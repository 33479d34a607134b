"""vLLM CPU pages of different block sizes (pure, numpy): which bytes of a token segment move where.

vLLM's CPU attention keeps one layer's block as `num_kv_heads` slabs, one per head (heads outermost: the page's
token_layout HND), each slab holding K in its first half and V in its second, 2 x block_size x head_dim elements.
Inside a half, the layout depends on the instruction set the backend chose (the page format names it), and some
halves depend on the block size B (elements, d a head-dim index, t a token):

- `vllm:cpu-vec` and `vllm:cpu-vec16` (float32/float16, or no AMX): K column-major, K(d, t) at d * B + t;
  V row-major, V(t, d) at t * head_dim + d.
- `vllm:cpu-amx` (bfloat16 with AMX): K in groups of 16 tokens, a segment of tokens [t0, t0 + n) contiguous at
  t0 * head_dim; V in groups of 16 head-dim elements, V(t, d) within group d // 16 at (d // 16) * 16 * B + 16 * t
  (token pairs interleaved: a segment starting at an even token is contiguous within a group).

So a segment of g tokens (g the gcd of the two block sizes, a multiple of 32 in vLLM's CPU build) of one head is a
few equal pieces per half whose place depends on each side's B, and whose bytes do not: the decode's kernel reads
them as written. `page_pair` builds the CHUNK unit tables (`descriptors.PairPlan`): per (layer, head, half), per
segment, `chunks` pieces. Other page formats (ARM's, whose bfloat16 layout differs again; GPU pages; state pages)
are refused by name.
"""

from __future__ import annotations

import math

import numpy as np

from kvconnect.core.errors import LayoutMismatchError
from kvconnect.core.plan.descriptors import PairPlan
from kvconnect.core.plan.layout import CacheSpec, Granularity, UnitTable, unit_table

# page format -> (head-dim elements per piece group, True when K is the column-major half)
_FORMATS = {"vllm:cpu-vec": (1, True), "vllm:cpu-vec16": (1, True), "vllm:cpu-amx": (16, False)}


def _pieces(spec: CacheSpec, g: int) -> tuple[np.ndarray, int, int]:
    """Per (half, segment, piece) of one head's slab, the piece's offset in elements; the pieces per half and
    segment; the piece's length in elements."""
    group, k_columns = _FORMATS[spec.page]
    b, hd = spec.block_size, spec.head_dim
    segs = np.arange(b // g, dtype=np.int64)[:, None]
    if k_columns:  # vec: K one piece of g per head-dim element; V's contiguous segment cut the same way
        j = np.arange(hd, dtype=np.int64)[None, :]
        k = j * b + segs * g
        v = b * hd + segs * g * hd + j * g
        return np.stack([k, v]), hd, g
    j = np.arange(hd // group, dtype=np.int64)[None, :]  # amx: K's segment cut into head-dim groups; V per group
    k = segs * g * hd + j * group * g
    v = b * hd + j * group * b + group * segs * g
    return np.stack([k, v]), hd // group, group * g


def _table(spec: CacheSpec, heads: tuple[int, int], g: int) -> tuple[UnitTable, int]:
    """Units (layer, head, half, segment, piece) of one side, in that order; and the pieces per segment."""
    offsets, chunks, length = _pieces(spec, g)
    isz = spec.head_page_bytes // (2 * spec.block_size * spec.head_dim)
    layer = unit_table(spec, Granularity.LAYER)
    first = heads[0] - spec.head_range()[0]
    slab = np.arange(first, first + heads[1] - heads[0], dtype=np.int64) * spec.head_page_bytes
    off = layer.offset_bytes[:, None, None] + slab[None, :, None] + (offsets.reshape(-1) * isz)[None, None, :]
    region = np.broadcast_to(layer.region[:, None, None], off.shape)
    table = UnitTable(
        Granularity.CHUNK, region.reshape(-1).copy(), off.reshape(-1), length * isz, spec.block_stride_bytes
    )
    return table, chunks


def page_pair(local: CacheSpec, remote: CacheSpec, heads: tuple[int, int]) -> PairPlan:
    """A CHUNK plan moving `heads` between vLLM CPU pages of different block sizes (module doc). Raises
    LayoutMismatchError naming why a pair of pages cannot be served."""
    sizes: dict[str, tuple[object, object]] = {"block_size": (local.block_size, remote.block_size)}
    if local.page not in _FORMATS or local.token_layout != "HND":
        known = ", ".join(sorted(_FORMATS))
        raise LayoutMismatchError(
            sizes, f"{local.page} pages move between equal block sizes only (different ones: {known} pages)"
        )
    g = math.gcd(local.block_size, remote.block_size)
    group = _FORMATS[local.page][0]
    if g % group or local.head_dim % group:
        raise LayoutMismatchError(
            sizes,
            f"{local.page} pages: block sizes {local.block_size} and {remote.block_size} share {g}-token "
            f"segments, which its layout cannot cut (head_dim {local.head_dim})",
        )
    l_table, chunks = _table(local, heads, g)
    r_table, _ = _table(remote, heads, g)
    return PairPlan(local, remote, Granularity.CHUNK, l_table, r_table, seg_tokens=g, chunks=chunks)
