"""vLLM's KV cache tensors as a kvconnect cache: described from their strides, never from a layout name.

vLLM (0.32) hands `register_kv_caches` one view per attention layer, logically `[B, H, N, C]` (blocks,
KV heads, tokens per block, content), each a strided view into an allocation that may be shared by all
layers; `C` packs a head's K and V for one token (on the CPU the page of one (block, head) holds K
transposed, then V). What kvconnect needs is where each block's bytes lie, so the views are read as:

- a block's *page* in one layer, `[H, N, C]`, must be one contiguous run (layouts LBHNC, LBNHC, BLHNC,
  BLNHC); it is moved whole, or, when heads are its outer dimension (`H` before `N`), as a run of heads
  (tensor-parallel pairs);
- blocks one page apart in each layer: one region per layer (kvconnect's `blocks_first`, one descriptor
  per block per layer);
- or blocks `L` pages apart with layer `l`'s page at `l` pages into the block (block-outermost): one
  region for the whole cache (`cross_layer`, one descriptor per block for every layer).

Backends that keep K and V as a dimension of size 2 (FlashInfer, vLLM before the packed views, kvconnect's
own engine) hand 5-D tensors per layer: `(B, 2, N, H, D)` (or physically `(B, 2, H, N, D)`), `(2, B, N, H, D)`,
or per-layer views of one `(B, L, 2, N, H, D)` buffer. Those are kvconnect's own layouts (blocks_first,
kv_first, cross_layer), so their spec carries no page format and every plan (K/V halves, heads) applies.

MLA models (DeepSeek, Kimi, GLM) cache one latent vector per token and layer, shared by every head: vLLM
hands `(B, N, C)` per layer on the GPU (0.26) or `[B, 1, N, C]` (0.32), C = kv_lora_rank + rope dims (576
for DeepSeek-V3). `describe(..., latent=True)` reads them as pages of one "head" (no K/V halves, nothing to
split by heads), so every tensor-parallel rank holds the whole latent: the head planning's replication
(one copy read, the others released) applies as it is.

Kernel blocks: a backend may split a scheduler block of `block_size` tokens into `k` kernel blocks (the
tensors then have `k * num_blocks` blocks of `block_size / k` tokens). One scheduler block is then `k`
consecutive pages: one run, moved whole. With tokens outer in the page (NHD) that run is exactly a page of
`block_size` tokens; with heads outer it is not (`k` runs of heads), so the page format names the kernel
block size and such pages pair only with the same split and tensor-parallel size.

Mamba and linear-attention state layers are described by `state.py`, over these regions.

Anything else (pages split by another dimension, padded pages, layers that are not evenly spaced,
mixed dtypes or shapes) is refused with a `LayoutError` saying which and why. The page's interior is
the engine's business: `CacheSpec.page` names it, and two peers exchange pages only when their names
match.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from kvconnect.core.cache import TORCH_DTYPES, KVCache
from kvconnect.core.errors import LayoutError
from kvconnect.core.plan.layout import CacheSpec, LayoutKind

_DTYPE_NAMES = {v: k for k, v in TORCH_DTYPES.items()}


@dataclass(frozen=True)
class Described:
    cache: KVCache
    layer_names: tuple[str, ...]  # in layer order
    layout: str  # what the strides say, in vLLM's terms (e.g. "LBHNC"), for logs


def layer_order(name: str) -> tuple[int, ...]:
    """Sort key: the numbers in a layer name ("model.layers.12.self_attn.attn" -> (12,))."""
    return tuple(int(x) for x in re.findall(r"\d+", name))


def describe(
    kv_caches: Mapping[str, torch.Tensor],
    *,
    num_blocks: int,
    block_size: int,
    tp_size: int,
    tp_rank: int,
    total_kv_heads: int,
    page: str,
    latent: bool = False,
) -> Described:
    """A kvconnect cache over vLLM's tensors (no copy): the spec and byte views of its regions. `latent`: the
    model is MLA (vLLM's `model_config.use_mla`), its tensors latent caches. (A hybrid's state layers:
    `state.describe_with_state`.)"""
    if not kv_caches:
        raise LayoutError("vLLM registered no KV cache tensors")
    names, views = _distinct(tuple(sorted(kv_caches, key=layer_order)), kv_caches)
    if latent:
        views = [_latent_view(name, t) for name, t in zip(names, views, strict=True)]
        total_kv_heads = 1  # one latent per token, replicated on every tensor-parallel rank
    first = views[0]
    for name, t in zip(names, views, strict=True):
        if t.dim() == 3:
            raise LayoutError(
                f"vLLM KV cache {name}: a 3-D tensor {tuple(t.shape)} is an MLA latent cache (blocks, tokens, "
                "latent), but vLLM's model config does not say use_mla"
            )
        if t.dim() not in (4, 5):
            raise LayoutError(
                f"vLLM KV cache {name}: a {t.dim()}-D tensor {tuple(t.shape)}; expected [B, H, N, C] "
                "(vLLM 0.32 per-layer views), 5-D with K and V as a dimension of size 2, or an MLA latent cache"
            )
        if (t.shape, t.dtype, t.device, t.stride()) != (first.shape, first.dtype, first.device, first.stride()):
            raise LayoutError(
                f"vLLM KV cache {name}: shape/dtype/device/strides {tuple(t.shape)} {t.dtype} "
                f"{t.device} {t.stride()} differ from {names[0]}'s; kvconnect needs one page format"
            )
    if first.dtype not in _DTYPE_NAMES:
        raise LayoutError(f"vLLM KV cache dtype {first.dtype} is not one of {sorted(TORCH_DTYPES)}")
    if first.dim() == 5:
        return _describe_split(
            names,
            views,
            num_blocks=num_blocks,
            block_size=block_size,
            tp_size=tp_size,
            tp_rank=tp_rank,
            total_kv_heads=total_kv_heads,
        )
    nb, heads, tokens, content = first.shape
    isz = first.element_size()
    s_block, s_head, s_token, s_content = (s * isz for s in first.stride())
    if latent:  # (one "head": its stride means nothing; a latent page is tokens outer)
        s_head = content * isz
    where = f"vLLM KV cache [B, H, N, C] = {tuple(first.shape)}, byte strides {(s_block, s_head, s_token, s_content)}"
    split = nb // num_blocks if nb % num_blocks == 0 else 0  # kernel blocks per scheduler block
    if not split or tokens * split != block_size:
        raise LayoutError(
            f"{where}: {nb} kernel blocks of {tokens} tokens for {num_blocks} scheduler blocks of {block_size} "
            "tokens; kvconnect needs the kernel block size to divide the block size"
        )
    if s_content != isz:
        raise LayoutError(f"{where}: the content dimension is not contiguous")
    if content % 2:
        what = (
            "latent values per token (kvconnect moves latent caches of an even width)"
            if latent
            else ("content elements per (head, token) is not K + V of one head size")
        )
        raise LayoutError(f"{where}: {content} {what}")
    heads_outer = s_head > s_token
    inner, outer = ((s_token, tokens), (s_head, heads)) if heads_outer else ((s_head, heads), (s_token, tokens))
    page_bytes = heads * tokens * content * isz
    if inner[0] != content * isz or outer[0] != inner[1] * inner[0]:
        raise LayoutError(
            f"{where}: a block's [H, N, C] page is not one contiguous run (the layout splits it, e.g. "
            "LHBNC or BHLNC); kvconnect supports LBHNC, LBNHC, BLHNC and BLNHC"
        )
    bases = [int(t.data_ptr()) for t in views]
    num_layers = len(views)
    if split > 1:
        if s_block != page_bytes:
            raise LayoutError(
                f"{where}: {split} kernel blocks per block with blocks {s_block} bytes apart: a block is one run "
                "only when kernel blocks are one page apart (a per-layer layout, not block-outermost)"
            )
        if heads_outer and heads > 1:  # k runs of heads per block: no longer one run of heads per block
            page = f"{page}/kernel-block-{tokens}"
            heads_outer = False
        nb, tokens, page_bytes, s_block = num_blocks, block_size, page_bytes * split, page_bytes * split
    if s_block == page_bytes:
        kind, order = LayoutKind.BLOCKS_FIRST, "LB"
    elif s_block == num_layers * page_bytes and all(b == bases[0] + i * page_bytes for i, b in enumerate(bases)):
        kind, order = LayoutKind.CROSS_LAYER, "BL"
    else:
        raise LayoutError(
            f"{where}: blocks {s_block} bytes apart with pages of {page_bytes} bytes and {num_layers} "
            "layers: neither one page per block per layer nor one block of every layer's page "
            "(padded pages are not supported)"
        )
    spec = CacheSpec(
        kind=kind,
        dtype=_DTYPE_NAMES[first.dtype],
        num_layers=num_layers,
        num_blocks=nb,
        block_size=tokens,
        num_kv_heads=heads,
        head_dim=content // 2,
        device=first.device.type,
        tp_size=tp_size,
        tp_rank=tp_rank,
        token_layout="HND" if heads_outer else "NHD",
        total_kv_heads=total_kv_heads,
        page=page,
    )
    shape = spec.region_shape()
    if kind is LayoutKind.CROSS_LAYER:
        regions = [as_bytes(first, shape, s_block)]
    else:
        regions = [as_bytes(t, shape, s_block) for t in views]
    page_order = "NC (MLA latent)" if latent else ("HNC" if heads_outer else "NHC")
    kernel = f", {split} kernel blocks per block" if split > 1 else ""
    return Described(KVCache.from_tensors(spec, regions), names, order + page_order + kernel)


def _latent_view(name: str, t: torch.Tensor) -> torch.Tensor:
    """An MLA latent cache as `[B, 1, N, C]`: vLLM 0.26's `(B, N, C)` gains a one-"head" dimension (a view);
    vLLM 0.32's `[B, 1, N, C]` is kept."""
    if t.dim() == 4 and t.shape[1] == 1:
        return t
    if t.dim() != 3:
        raise LayoutError(
            f"vLLM KV cache {name}: a {t.dim()}-D tensor {tuple(t.shape)} for an MLA model; expected its latent "
            "cache (blocks, tokens, latent) or [blocks, 1, tokens, latent]"
        )
    b, n, c = t.shape
    sb, sn, sc = t.stride()
    return torch.as_strided(t, (b, 1, n, c), (sb, c * sc, sn, sc), t.storage_offset())  # (as 0.32 strides it)


def _distinct(
    names: tuple[str, ...], kv_caches: Mapping[str, torch.Tensor]
) -> tuple[tuple[str, ...], list[torch.Tensor]]:
    """The layers whose tensors are not another layer's, in layer order. A hybrid model's KV cache groups
    overlay one allocation (vLLM gives a layer of each group the same tensor; a block id belongs to one
    group at a time), so those layers are one region: the first of them names it."""
    kept: dict[int, tuple[str, torch.Tensor]] = {}
    for name in names:
        t = kv_caches[name]
        first = kept.setdefault(t.data_ptr(), (name, t))
        if first[1] is not t and (t.shape, t.stride(), t.dtype) != (first[1].shape, first[1].stride(), first[1].dtype):
            raise LayoutError(
                f"vLLM KV cache {name} overlays {first[0]} with another shape, strides or dtype "
                f"({tuple(t.shape)} {t.stride()} {t.dtype} against {tuple(first[1].shape)} {first[1].stride()} "
                f"{first[1].dtype}); kvconnect needs overlaid KV cache groups to share one page format"
            )
    return tuple(n for n, _ in kept.values()), [t for _, t in kept.values()]


def as_bytes(view: torch.Tensor, shape: tuple[int, ...], block_stride: int) -> torch.Tensor:
    """`view`'s blocks as a (num_blocks, bytes) uint8 tensor over the same memory, starting at its first byte."""
    raw = view.view(torch.uint8)  # (the content dimension is contiguous: this is a view)
    out = torch.as_strided(raw, shape, (block_stride, 1), raw.storage_offset())
    assert out.data_ptr() == view.data_ptr()
    return out


def _describe_split(
    names: tuple[str, ...],
    views: list[torch.Tensor],
    *,
    num_blocks: int,
    block_size: int,
    tp_size: int,
    tp_rank: int,
    total_kv_heads: int,
) -> Described:
    """5-D per-layer tensors with K and V as a dimension of size 2: kvconnect's own layouts, no page format."""
    first = views[0]
    shape, stride = tuple(first.shape), first.stride()
    where = f"vLLM KV cache {tuple(shape)}, element strides {stride}"
    if num_blocks == 2:  # (2, 2, ...) reads as either order, and the strides of one can match the other's
        raise LayoutError(
            f"{where}: with 2 blocks, K/V-split tensors cannot tell blocks from K/V; give the engine more blocks"
        )
    if shape[:2] == (num_blocks, 2):
        kv_outer, (s_block, s_kv) = False, stride[:2]
    elif shape[:2] == (2, num_blocks):
        (s_kv, s_block) = stride[:2]
        # (a hybrid model with state layers on vLLM 0.26: the logical (2, B, ...) view with blocks outermost in
        # memory, so that each block is one page the state layers can overlay)
        kv_outer = s_kv > s_block
    else:
        raise LayoutError(
            f"{where}: neither (num_blocks={num_blocks}, 2, ...) nor (2, num_blocks, ...); kvconnect "
            "needs K and V as a dimension of size 2 next to the blocks"
        )
    tokens, heads, head_dim = shape[2:]
    s_token, s_head, s_dim = stride[2:]
    if tokens != block_size:
        raise LayoutError(f"{where}: {tokens} tokens per kernel block, but the block size is {block_size}")
    if s_dim != 1:
        raise LayoutError(f"{where}: the head dimension is not contiguous")
    if (s_head, s_token) == (head_dim, heads * head_dim):
        token_layout = "NHD"
    elif (s_token, s_head) == (head_dim, tokens * head_dim):
        token_layout = "HND"
    else:
        raise LayoutError(f"{where}: one block's K (or V) is not one contiguous run of (N, H, D) or (H, N, D)")
    half = tokens * heads * head_dim
    layer_bytes = 2 * half * first.element_size()
    bases = [int(t.data_ptr()) for t in views]
    if kv_outer and (s_block, s_kv) == (half, num_blocks * half):
        kind = LayoutKind.KV_FIRST
    elif not kv_outer and s_kv == half and s_block == 2 * half:
        kind = LayoutKind.BLOCKS_FIRST
    elif (
        not kv_outer
        and s_kv == half
        and s_block == 2 * half * len(views)
        and all(b == bases[0] + i * layer_bytes for i, b in enumerate(bases))
    ):
        kind = LayoutKind.CROSS_LAYER
    else:
        raise LayoutError(
            f"{where}: blocks {s_block} and K/V {s_kv} elements apart for K/V blocks of {half} "
            f"elements and {len(views)} layers: not a blocks_first, kv_first or cross_layer layout "
            "(padded blocks are not supported)"
        )
    spec = CacheSpec(
        kind=kind,
        dtype=_DTYPE_NAMES[first.dtype],
        num_layers=len(views),
        num_blocks=num_blocks,
        block_size=tokens,
        num_kv_heads=heads,
        head_dim=head_dim,
        device=first.device.type,
        tp_size=tp_size,
        tp_rank=tp_rank,
        token_layout=token_layout,
        total_kv_heads=total_kv_heads,
    )
    owners = views[:1] if kind is LayoutKind.CROSS_LAYER else views
    regions = [torch.as_strided(t, spec.region_shape(), spec.region_strides(), t.storage_offset()) for t in owners]
    order = {LayoutKind.KV_FIRST: "2B", LayoutKind.BLOCKS_FIRST: "B2", LayoutKind.CROSS_LAYER: "BL2"}[kind]
    return Described(KVCache.from_tensors(spec, regions), names, order + ("HND" if token_layout == "HND" else "NHD"))


def cross_layer_views(kv_cache: torch.Tensor, attn_backend: Any) -> dict[str, torch.Tensor]:
    """vLLM's one tensor for every layer (`register_cross_layers_kv_cache`, vLLM 0.26 with
    `prefer_cross_layer_blocks`) as the per-layer views vLLM's attention reads: the tensor is allocated in
    the backend's physical order with a layers dimension, so undoing that order gives
    (num_layers, *one layer's logical shape). `describe` then finds the layers inside each block (one
    region, one descriptor per block for every layer) from the views' strides, as for any other layout."""
    try:
        order = tuple(attn_backend.get_kv_cache_stride_order(include_num_layers_dimension=True))
    except (AttributeError, NotImplementedError):
        order = tuple(range(kv_cache.dim()))
    if sorted(order) != list(range(kv_cache.dim())):
        raise LayoutError(f"cross-layer KV cache of {kv_cache.dim()} dims, stride order {order}: not a permutation")
    logical = kv_cache.permute(*[order.index(i) for i in range(len(order))])
    return {f"cross_layer.{layer}": logical[layer] for layer in range(logical.shape[0])}
