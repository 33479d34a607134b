"""KV cache tensors shaped the way vLLM's attention backends allocate them, without vLLM: what its worker
hands `register_kv_caches`, for tests and GPU checks of `kvconnect.vllm.layout.describe`.

- `packed_views(order, ...)`: vLLM 0.32 — one raw buffer, per layer a `[B, H, N, C]` view (C = K and V of
  one head, packed) whose strides follow `order`, a permutation of "LBHNC" read outermost first (LBNHC is
  the FlashAttention NHD layout, LBHNC the HND one, BLNHC/BLHNC block-outermost: a block holds every
  layer's page).
- `latent_views(form, ...)`: MLA latent caches, one vector of `width` values per token and layer: "3d"
  `(B, N, C)` per layer (vLLM 0.26 on the GPU), "4d" `[B, 1, N, C]` (vLLM 0.32), "cross" one
  `(B, L, N, C)` buffer viewed per layer.
- `make_views(shape, ...)`: any of them, by name: a packed order, "split:<form>" or "latent:<form>".
- `split_views(form, ...)`: K and V as a dimension of size 2 (older vLLM backends and FlashInfer):
  "blocks_first" `(num_blocks, 2, N, H, D)` per layer (the FlashInfer/FlashAttention paged layout), "kv_first"
  `(2, num_blocks, N, H, D)` per layer, or "cross_layer": one `(num_blocks, L, 2, N, H, D)` buffer viewed per
  layer, so one block holds every layer's K and V.
"""

from __future__ import annotations

import torch

DIMS = "LBHNC"
PACKED_ORDERS = ("LBNHC", "LBHNC", "BLNHC", "BLHNC")
SPLIT_FORMS = ("blocks_first", "kv_first", "cross_layer")


def layer_name(layer: int) -> str:
    return f"model.layers.{layer}.self_attn.attn"


def _filled(numel: int, dtype: torch.dtype, seed: int, device: str) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(numel, generator=gen).to(dtype).to(device)


def packed_views(
    order: str,
    layers: int,
    blocks: int,
    heads: int,
    tokens: int,
    head_dim: int,
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
    device: str = "cpu",
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """(per-layer [B, H, N, C] views, the raw buffer under them), random values from `seed`."""
    if sorted(order) != sorted(DIMS):
        raise ValueError(f"order {order!r} is not a permutation of {DIMS}")
    size = dict(zip(DIMS, (layers, blocks, heads, tokens, 2 * head_dim), strict=True))
    stride: dict[str, int] = {}
    step = 1
    for dim in reversed(order):
        stride[dim] = step
        step *= size[dim]
    raw = _filled(step, dtype, seed, device)
    views = {
        layer_name(layer): torch.as_strided(
            raw, [size[d] for d in "BHNC"], [stride[d] for d in "BHNC"], layer * stride["L"]
        )
        for layer in range(layers)
    }
    return views, raw


def split_views(
    form: str,
    layers: int,
    blocks: int,
    heads: int,
    tokens: int,
    head_dim: int,
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
    device: str = "cpu",
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """(per-layer 5-D views with K and V as a dimension of size 2, the memory under them)."""
    tail = (tokens, heads, head_dim)
    if form == "cross_layer":
        raw = _filled(blocks * layers * 2 * tokens * heads * head_dim, dtype, seed, device)
        whole = raw.view(blocks, layers, 2, *tail)
        return {layer_name(layer): whole[:, layer] for layer in range(layers)}, raw
    shape = {"blocks_first": (blocks, 2, *tail), "kv_first": (2, blocks, *tail)}.get(form)
    if shape is None:
        raise ValueError(f"form {form!r} is not one of {SPLIT_FORMS}")
    per = blocks * 2 * tokens * heads * head_dim
    raw = _filled(layers * per, dtype, seed, device)
    return {layer_name(layer): raw[layer * per : (layer + 1) * per].view(shape) for layer in range(layers)}, raw


LATENT_FORMS = ("3d", "4d", "cross")


def latent_views(
    form: str,
    layers: int,
    blocks: int,
    tokens: int,
    width: int,
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
    device: str = "cpu",
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """(per-layer latent caches, the memory under them), random values from `seed`."""
    if form not in LATENT_FORMS:
        raise ValueError(f"form {form!r} is not one of {LATENT_FORMS}")
    raw = _filled(layers * blocks * tokens * width, dtype, seed, device)
    if form == "cross":
        whole = raw.view(blocks, layers, tokens, width)
        return {layer_name(layer): whole[:, layer] for layer in range(layers)}, raw
    per = blocks * tokens * width
    shape = (blocks, tokens, width) if form == "3d" else (blocks, 1, tokens, width)
    return {layer_name(layer): raw[layer * per : (layer + 1) * per].view(shape) for layer in range(layers)}, raw


def make_views(
    shape: str,
    layers: int,
    blocks: int,
    heads: int,
    tokens: int,
    head_dim: int,
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
    device: str = "cpu",
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """`packed_views(shape, ...)`, `split_views(form, ...)` for a shape "split:<form>", or `latent_views(form,
    ...)` for "latent:<form>" (width 2 x head_dim, `heads` ignored: a latent has none)."""
    if shape.startswith("latent:"):
        return latent_views(shape.removeprefix("latent:"), layers, blocks, tokens, 2 * head_dim, dtype, seed, device)
    if shape.startswith("split:"):
        return split_views(shape.removeprefix("split:"), layers, blocks, heads, tokens, head_dim, dtype, seed, device)
    return packed_views(shape, layers, blocks, heads, tokens, head_dim, dtype, seed, device)
