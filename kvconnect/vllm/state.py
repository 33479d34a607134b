"""Mamba and linear-attention state layers of a hybrid model, over the attention layers' regions.

vLLM pads every page of a hybrid model to one size and lays each state layer's page (conv state, then SSM
state) over an attention layer's page of the same block (block ids are unique across KV cache groups), so a
state layer adds no region: page b of every region holds whatever group owns block b. vLLM 0.32 hands a state
layer as one int8 `[B, 1, 1, bytes]` view over the allocation every layer shares; vLLM 0.26 as a list of its
conv and SSM views, strided by the page. `describe_with_state` describes the attention layers as
`layout.describe` does, checks that each state layer's block b lies inside page b of a region (refusing one
that does not, naming it), and reads the blocks as opaque pages of the given format: K and V are no longer
all they hold, so nothing may split them by halves or by heads alone. Given the model's Mamba2 state
(`StateSpec`), and where each state layer's block starts its page with the conv state and the SSM state right
after it, the spec carries it (`CacheSpec.state`): a peer of another TP size can then take its share.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import msgspec

from kvconnect.core.cache import KVCache
from kvconnect.core.errors import LayoutError
from kvconnect.core.plan.layout import LayoutKind
from kvconnect.core.plan.state import StateSpec
from kvconnect.vllm.layout import Described, as_bytes, describe, layer_order

log = logging.getLogger(__name__)


def describe_with_state(
    kv_caches: Mapping[str, Any], state_layers: frozenset[str], state: StateSpec | None = None, **kw: Any
) -> Described:
    """`layout.describe(kv_caches, **kw)` for a model whose `state_layers` overlay its attention layers' pages
    (none: exactly `layout.describe`). `kw["page"]` names what a page holds, states included; `state`: the
    model's Mamba2 state, kept in the spec where every state layer lays it out as `StateSpec` says."""
    states = {name: kv_caches[name] for name in kv_caches if name in state_layers}
    described = describe({n: t for n, t in kv_caches.items() if n not in state_layers}, **kw)
    if not states:
        return described
    kind = described.cache.spec.kind
    if kind is not LayoutKind.BLOCKS_FIRST:
        raise LayoutError(f"vLLM state layers beside a {kind.value} KV cache: they need one page per block per layer")
    described = _as_pages(described, kw["page"])
    starts = [_check_state(name, states[name], described.cache) for name in sorted(states, key=layer_order)]
    spec = described.cache.spec
    if state is None or state.tp_problem(spec.tp_size):
        return described
    conv = state.conv_bytes(spec.tp_size)
    if any(s not in ([0], [0, conv]) for s in starts) or state.block_bytes(spec.tp_size) > spec.block_stride_bytes:
        log.info("kvconnect: the state layers are not laid out as %s: their pages move between equal TP only", state)
        return described
    cache = KVCache.from_tensors(msgspec.structs.replace(spec, state=state), list(described.cache.regions))
    log.info(
        "kvconnect: rank %d describes the model's Mamba2 state (peers of other TP sizes read their share)", spec.tp_rank
    )
    return Described(cache, described.layer_names, described.layout)


def _as_pages(described: Described, page: str) -> Described:
    spec = described.cache.spec
    if spec.page:
        return described
    paged = msgspec.structs.replace(spec, page=page)
    regions = [as_bytes(r, paged.region_shape(), paged.block_stride_bytes) for r in described.cache.regions]
    return Described(KVCache.from_tensors(paged, regions), described.layer_names, described.layout + " pages")


def _check_state(name: str, views: Any, cache: KVCache) -> list[int]:
    """LayoutError unless every block of state layer `name` (a view, or a list of views: conv, SSM) lies inside
    the same block's page of one region of `cache` (blocks_first: one page per block per layer); returns where
    each view starts inside its page."""
    spec = cache.spec
    tensors = list(views) if isinstance(views, (list, tuple)) else [views]
    where = f"vLLM state layer {name}"
    page, bases = spec.block_stride_bytes, cache.base_addrs()
    starts = []
    for t in tensors:
        isz = t.element_size()
        extent = (1 + sum((n - 1) * st for n, st in zip(t.shape[1:], t.stride()[1:], strict=True))) * isz
        start, stride = int(t.data_ptr()), t.stride(0) * isz
        inside = [b for b in bases if b <= start and start + extent <= b + page]
        if t.shape[0] != spec.num_blocks or stride != page or not inside:
            raise LayoutError(
                f"{where}: {tuple(t.shape)} {t.dtype} with blocks {stride} bytes apart does not lie inside an "
                f"attention layer's pages ({spec.num_blocks} blocks of {page} bytes); kvconnect moves state that "
                "vLLM's hybrid allocation lays over the attention pages"
            )
        starts.append(start - inside[0])
    return starts
