"""Mamba / linear-attention state layers beside attention layers, laid out as vLLM lays out a hybrid model's
cache (no vLLM needed): every page padded to one size, each state layer's page (conv state, then SSM state)
over an attention layer's page of the same block. vLLM 0.26 hands a state layer as a list of its conv and SSM
views and its attention as a (2, B, N, H, D) view with blocks outermost in memory; vLLM 0.32 hands one int8
[B, 1, 1, bytes] view per state layer over the one allocation every layer shares."""

from __future__ import annotations

import ctypes

import msgspec
import pytest
import torch

from kvconnect.core.errors import LayoutError, LayoutMismatchError
from kvconnect.core.plan.hetero import Source, plan_source
from kvconnect.vllm.state import describe_with_state

BLOCKS, TOKENS, HEADS, HEAD_DIM = 16, 32, 4, 32
PAGE_BYTES = 2 * TOKENS * HEADS * HEAD_DIM * 2  # K and V of one block in bfloat16
CONV, SSM = (3, 320), (8, 4, 16)  # (state_len, dim) and (heads, head_dim, state) in float32
STATE = "+state(MAMBA2:3x320/8x4x16:float32/float32)"


def mamba_views_026(raw: torch.Tensor) -> list[torch.Tensor]:
    """vLLM 0.26's `_reshape_kv_cache_tensors` for a MambaSpec: conv then SSM, strided by the page."""
    out, offset = [], 0
    for shape in (CONV, SSM):
        per_page = PAGE_BYTES // 4
        inner = torch.empty((BLOCKS, *shape)).stride()[1:]
        out.append(torch.as_strided(raw.view(torch.float32), (BLOCKS, *shape), (per_page, *inner), offset // 4))
        offset += int(torch.tensor(shape).prod()) * 4
    return out


def attention_026(raw: torch.Tensor) -> torch.Tensor:
    """FlashAttention's (2, B, N, H, D), re-strided by vLLM 0.26 to blocks outermost (a hybrid with state)."""
    view = raw.view(torch.bfloat16).view(2, BLOCKS, TOKENS, HEADS, HEAD_DIM)
    half = TOKENS * HEADS * HEAD_DIM
    return view.as_strided(view.shape, (half, 2 * half, *view.stride()[2:]))


def caches_026(slots: int = 2) -> tuple[dict[str, object], list[torch.Tensor]]:
    """`slots` raw tensors, each shared by one attention layer and one state layer (two KV cache groups)."""
    raws = [torch.zeros(BLOCKS * PAGE_BYTES, dtype=torch.int8) for _ in range(slots)]
    caches: dict[str, object] = {}
    for i, raw in enumerate(raws):
        caches[f"model.layers.{2 * i}.mixer"] = mamba_views_026(raw)
        caches[f"model.layers.{2 * i + 1}.attn"] = attention_026(raw)
    return caches, raws


def describe_026(caches: dict[str, object], tp: int = 1) -> object:
    return describe_with_state(
        caches,
        frozenset(n for n in caches if n.endswith("mixer")),
        num_blocks=BLOCKS,
        block_size=TOKENS,
        tp_size=tp,
        tp_rank=0,
        total_kv_heads=HEADS * tp,
        page="vllm:cuda" + STATE,
    )


def page(region: torch.Tensor, block: int) -> bytes:
    row = region[block]
    return ctypes.string_at(row.data_ptr(), row.numel())


def test_vllm_026_state_layers_ride_in_the_attention_pages_they_overlay() -> None:
    caches, raws = caches_026()
    d = describe_026(caches)
    spec = d.cache.spec  # type: ignore[attr-defined]
    assert (spec.kind.value, spec.num_layers, spec.page) == ("blocks_first", 2, "vllm:cuda" + STATE)
    assert spec.block_stride_bytes == PAGE_BYTES and d.layer_names == ("model.layers.1.attn", "model.layers.3.attn")
    conv, ssm = caches["model.layers.2.mixer"]  # type: ignore[misc]
    ssm[5].fill_(1.5)  # the state of block 5 in the second slot: page 5 of region 1, after the conv state
    conv[5].fill_(-2.0)
    got = page(d.cache.regions[1], 5)  # type: ignore[attr-defined]
    conv_bytes = 3 * 320 * 4
    assert got[:conv_bytes] == torch.full(CONV, -2.0).numpy().tobytes()
    assert got[conv_bytes : conv_bytes + 8 * 4 * 16 * 4] == torch.full(SSM, 1.5).numpy().tobytes()
    assert page(d.cache.regions[1], 4) == bytes(PAGE_BYTES) == page(d.cache.regions[0], 5)  # type: ignore[attr-defined]


def test_vllm_032_state_views_over_the_one_allocation() -> None:
    raw = torch.zeros(BLOCKS * PAGE_BYTES, dtype=torch.int8)
    attn = raw.view(torch.bfloat16).view(BLOCKS, HEADS, TOKENS, 2 * HEAD_DIM)  # LBHNC
    state_bytes = (3 * 320 + 8 * 4 * 16) * 4
    state = torch.as_strided(raw, (BLOCKS, 1, 1, state_bytes), (PAGE_BYTES, state_bytes, state_bytes, 1), 0)
    caches = {f"model.layers.{i}.mixer": state for i in (0, 2, 3)} | {"model.layers.1.attn": attn}
    d = describe_with_state(
        caches,
        frozenset({"model.layers.0.mixer", "model.layers.2.mixer", "model.layers.3.mixer"}),
        num_blocks=BLOCKS,
        block_size=TOKENS,
        tp_size=1,
        tp_rank=0,
        total_kv_heads=HEADS,
        page="vllm:cpu-vec" + STATE,
    )
    assert (d.cache.spec.num_layers, d.layer_names, d.cache.spec.page) == (
        1,
        ("model.layers.1.attn",),
        "vllm:cpu-vec" + STATE,
    )
    state[7].fill_(9)
    assert page(d.cache.regions[0], 7)[:state_bytes] == bytes([9]) * state_bytes


def test_a_state_layer_outside_the_attention_pages_is_refused_naming_it() -> None:
    caches, _ = caches_026()
    elsewhere = torch.zeros(BLOCKS * PAGE_BYTES, dtype=torch.int8)  # its own memory: no region holds it
    caches["model.layers.4.mixer"] = mamba_views_026(elsewhere)
    with pytest.raises(LayoutError, match=r"state layer model\.layers\.4\.mixer: .* does not lie inside"):
        describe_026(caches)
    caches, raws = caches_026()
    conv, ssm = caches["model.layers.0.mixer"]  # type: ignore[misc]
    caches["model.layers.0.mixer"] = [conv, ssm[: BLOCKS // 2]]  # (fewer blocks than the cache)
    with pytest.raises(LayoutError, match=r"state layer model\.layers\.0\.mixer"):
        describe_026(caches)


def test_pages_with_state_move_whole_between_equal_tp_sizes_only() -> None:
    one = describe_026(caches_026()[0]).cache.spec  # type: ignore[attr-defined]
    two = msgspec.structs.replace(one, tp_size=2, tp_rank=0, num_kv_heads=HEADS // 2)
    same = plan_source(one, one, Source(0, (0, HEADS), 0, 1))
    assert same.reason == "same blocks"
    with pytest.raises(LayoutMismatchError, match="state") as e:
        plan_source(two, one, Source(0, (0, HEADS // 2), 0, 1))
    assert "tp_size" in str(e.value)
    ds = msgspec.structs.replace(one, page=one.page.replace("3x320", "320x3"))  # the other conv-state layout
    with pytest.raises(LayoutMismatchError, match="VLLM_SSM_CONV_STATE_LAYOUT"):
        plan_source(ds, one, Source(0, (0, HEADS), 0, 1))
