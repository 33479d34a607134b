"""A Mamba2 hybrid's pages between ranks of different TP sizes (pure planning, executed with memmove): every
decode rank's state blocks rebuilt exactly from the prefill ranks' (x channels, B and C groups, SSM heads, SD and
DS conv layouts, one replicated group or several split), its attention blocks from their runs of heads, and
nothing written twice or outside what the rank holds."""

from __future__ import annotations

import types

import msgspec
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvconnect.core.cache import KVCache
from kvconnect.core.errors import InvalidRequestError, LayoutError, LayoutMismatchError
from kvconnect.core.plan.hetero import ReadPath, plan_source, plan_sources
from kvconnect.core.plan.layout import CacheSpec, LayoutKind, check_compatible
from kvconnect.core.plan.state import StateSpec
from kvconnect.vllm import groups as groups_mod
from tests.oracle import execute

TP_PAIRS = [(1, 2), (2, 1), (1, 4), (4, 1), (2, 4), (4, 2)]  # (prefill, decode)


def state_spec(layout: str, groups: int, heads: int = 8, head_dim: int = 4, conv_len: int = 3) -> StateSpec:
    return StateSpec("mamba2", layout, conv_len, heads * head_dim, groups, 4, heads, head_dim * 4 * 4, 4)


def rank_state(s: StateSpec, conv: np.ndarray, ssm: np.ndarray, tp: int, rank: int) -> bytes:
    """What vLLM holds on rank `rank` of `tp`: conv (x | B | C of its share; one group on every rank), then SSM.
    conv: (conv_len, channels + 2 * groups * group_size) over the model; ssm: (heads, head_bytes / 4)."""
    per_x = s.channels // tp
    g_lo, g_hi = s.groups_of(tp, rank)
    b0, c0 = s.channels, s.channels + s.groups * s.group_size
    cols = np.concatenate(
        [
            conv[:, rank * per_x : (rank + 1) * per_x],
            conv[:, b0 + g_lo * s.group_size : b0 + g_hi * s.group_size],
            conv[:, c0 + g_lo * s.group_size : c0 + g_hi * s.group_size],
        ],
        axis=1,
    )
    if s.conv_layout == "DS":
        cols = cols.T
    per_h = s.heads // tp
    return np.ascontiguousarray(cols).tobytes() + ssm[rank * per_h : (rank + 1) * per_h].tobytes()


@settings(max_examples=60, deadline=None)
@given(
    tps=st.sampled_from(TP_PAIRS),
    layout=st.sampled_from(["SD", "DS"]),
    groups=st.sampled_from([1, 4, 8]),
    conv_len=st.integers(1, 4),
    seed=st.integers(0, 2**16),
)
def test_state_runs_rebuild_every_rank_exactly_once(tps, layout, groups, conv_len, seed) -> None:
    tp_p, tp_d = tps
    s = state_spec(layout, groups, conv_len=conv_len)
    rng = np.random.default_rng(seed)
    conv = rng.standard_normal((conv_len, s.channels + 2 * groups * s.group_size)).astype(np.float32)
    ssm = rng.standard_normal((s.heads, s.head_bytes // 4)).astype(np.float32)
    prefill = [rank_state(s, conv, ssm, tp_p, r) for r in range(tp_p)]
    for d in range(tp_d):
        want = rank_state(s, conv, ssm, tp_d, d)
        assert len(want) == s.block_bytes(tp_d)
        got, written = bytearray(len(want)), np.zeros(len(want), np.int64)
        for r in range(tp_p):
            for l_off, r_off, n in s.runs((d, tp_d), (r, tp_p)):
                got[l_off : l_off + n] = prefill[r][r_off : r_off + n]
                written[l_off : l_off + n] += 1
        assert bytes(got) == want, (tps, d)
        assert (written == 1).all(), "a byte written twice or never"


def test_state_spec_refuses_what_it_cannot_split() -> None:
    with pytest.raises(LayoutError, match="conv_layout"):
        StateSpec("mamba2", "XY", 3, 32, 1, 4, 8, 64, 4)
    with pytest.raises(LayoutError, match="kind"):
        StateSpec("gdn", "SD", 3, 32, 1, 4, 8, 64, 4)
    assert "groups" in state_spec("SD", 6).tp_problem(4)
    assert "heads" in state_spec("SD", 1, heads=6).tp_problem(4)
    assert state_spec("SD", 1).tp_problem(4) == ""


# --- pages: attention blocks and state blocks over one region, planned per source and executed ---------------

HEADS, HEAD_DIM, BLOCK = 4, 8, 4


def page_spec(tp: int, rank: int, s: StateSpec | None, num_blocks: int = 12, layers: int = 2) -> CacheSpec:
    per = HEADS // tp
    shapes = f"{s.conv_dim(tp) if s else 0}x{tp}"  # (the rank's own shapes, as vLLM's page names them)
    return CacheSpec(
        kind=LayoutKind.BLOCKS_FIRST,
        dtype="float32",
        num_layers=layers,
        num_blocks=num_blocks,
        block_size=BLOCK,
        num_kv_heads=per,
        head_dim=HEAD_DIM,
        tp_size=tp,
        tp_rank=rank,
        token_layout="HND",
        total_kv_heads=HEADS,
        page=f"vllm:cpu-vec+state(MAMBA2:{shapes}:float32)",
        state=s,
    )


@pytest.mark.parametrize("tps", TP_PAIRS, ids=[f"tp{p}-to-tp{d}" for p, d in TP_PAIRS])
@pytest.mark.parametrize("layout,groups", [("SD", 1), ("DS", 1), ("SD", 4)])
def test_a_hybrids_pages_move_between_tp_sizes(tps, layout, groups) -> None:
    tp_p, tp_d = tps
    s = state_spec(layout, groups, heads=4, head_dim=2, conv_len=2)  # (small enough for a 256-byte rank page)
    rng = np.random.default_rng(7)
    layers = 2
    attn_ids, state_ids = [3, 5, 6], [9, 1]  # (remote ids; local ones differ below)
    local_attn, local_state = [2, 7, 8], [11, 4]
    # model-wide content: attention K+V per (layer, block, head) and a state per (layer, state block)
    head_bytes = 2 * BLOCK * HEAD_DIM * 4
    attn = {
        (ly, b, h): rng.integers(0, 255, head_bytes, np.uint8)
        for ly in range(layers)
        for b in attn_ids
        for h in range(HEADS)
    }
    conv = {
        (ly, b): rng.standard_normal((2, s.channels + 2 * groups * s.group_size)).astype(np.float32)
        for ly in range(layers)
        for b in state_ids
    }
    ssm = {
        (ly, b): rng.standard_normal((s.heads, s.head_bytes // 4)).astype(np.float32)
        for ly in range(layers)
        for b in state_ids
    }

    def fill(cache: KVCache, tp: int, rank: int, ids: tuple[list[int], list[int]]) -> None:
        """Rank `rank`'s share of the content in blocks ids[0] (attention) and ids[1] (state), whose content is
        that of the remote blocks in the same places of (attn_ids, state_ids)."""
        per = HEADS // tp
        for ly, region in enumerate(cache.regions):
            pages = region.view(torch.uint8).view(cache.spec.num_blocks, -1).numpy()
            for b, sb in zip(ids[0], attn_ids, strict=True):
                pages[b, : per * head_bytes] = np.concatenate(
                    [attn[ly, sb, h] for h in range(rank * per, (rank + 1) * per)]
                )
            for b, sb in zip(ids[1], state_ids, strict=True):
                held = np.frombuffer(rank_state(s, conv[ly, sb], ssm[ly, sb], tp, rank), np.uint8)
                pages[b, : held.size] = held

    prefill = []
    for r in range(tp_p):
        cache = KVCache.allocate(page_spec(tp_p, r, s, layers=layers))
        fill(cache, tp_p, r, (attn_ids, state_ids))
        prefill.append(cache)
    for d in range(tp_d):
        local_spec = page_spec(tp_d, d, s, layers=layers)
        dst = KVCache.allocate(local_spec)
        want = KVCache.allocate(local_spec)
        fill(want, tp_d, d, (local_attn, local_state))
        for src in plan_sources(local_spec, tp_p).reads:
            sp = plan_source(local_spec, prefill[src.rank].spec, src)
            assert sp.path is ReadPath.DIRECT and sp.pair.state_from, sp.describe()
            p = execute(
                sp.pair, dst, prefill[src.rank], local_attn + local_state, attn_ids + state_ids, state_ids=local_state
            )
            assert p.num_blocks == 5
        for ly in range(layers):
            got = dst.regions[ly].view(torch.uint8).view(local_spec.num_blocks, -1).numpy()
            exp = want.regions[ly].view(torch.uint8).view(local_spec.num_blocks, -1).numpy()
            assert np.array_equal(got, exp), (tps, d, ly)


def test_state_pages_between_tp_sizes_need_both_sides_to_describe_the_state() -> None:
    s = state_spec("SD", 1, heads=4, head_dim=2, conv_len=2)
    local, remote = page_spec(2, 0, s), page_spec(1, 0, None)
    src = plan_sources(local, 1).reads[0]
    with pytest.raises(LayoutMismatchError, match="does not describe it"):
        plan_source(local, remote, src)
    other = page_spec(1, 0, state_spec("DS", 1, heads=4, head_dim=2, conv_len=2))
    with pytest.raises(LayoutMismatchError, match="state"):
        check_compatible(local, other)
    sp = plan_source(local, page_spec(1, 0, s), src)
    with pytest.raises(InvalidRequestError, match="hold state"):
        sp.pair.plan_validated(np.array([1, 2]), np.array([3, 4]))
    # equal TP sizes: the pages are the same bytes, moved whole (no state ids needed)
    same = plan_source(page_spec(2, 0, s), page_spec(2, 0, s), plan_sources(page_spec(2, 0, s), 2).reads[0])
    assert same.path is ReadPath.BLOCK and not same.pair.state_from


def test_state_pages_are_not_split_where_ranks_hold_copies_of_heads() -> None:
    """With more ranks than KV heads a decode rank reads each head from one copy, so the prefill ranks it reads
    would not hold all of its state: refused, naming why (a silent hole otherwise)."""
    s = state_spec("SD", 1, heads=8, head_dim=2, conv_len=2)
    replicated = msgspec.structs.replace(page_spec(1, 0, s), tp_size=8, num_kv_heads=1)
    local = page_spec(1, 0, s)
    src = plan_sources(local, 8).reads[0]
    with pytest.raises(LayoutMismatchError, match="more ranks than its 4 KV heads"):
        plan_source(local, replicated, src)


class MambaSpec:  # (named as vLLM's: the plug-in reads a group's kind from its class names)
    def __init__(self, shapes: tuple, itemsize: int = 4) -> None:
        self.shapes = shapes
        self.dtypes = (types.SimpleNamespace(itemsize=itemsize),) * 2
        self.mamba_type = types.SimpleNamespace(name="MAMBA2")


def vllm_state(tp: int, groups: int, heads: int = 8, head_dim: int = 4, size: int = 16, dim: int | None = None):
    """vLLM's per-rank Mamba2 shapes (conv SD: (conv_len, conv_dim); SSM (heads, head_dim, state size)) as a
    KVCacheConfig with one state group, and the model's config."""
    per_rank = groups // tp if groups % tp == 0 else 1
    conv_dim = dim if dim is not None else heads * head_dim // tp + 2 * per_rank * size
    spec = MambaSpec(((3, conv_dim), (heads // tp, head_dim, size)))
    config = types.SimpleNamespace(kv_cache_groups=[types.SimpleNamespace(kv_cache_spec=spec)])
    return config, types.SimpleNamespace(n_groups=groups)


def test_the_plugin_describes_one_state_for_every_tp_size_and_refuses_a_split_it_does_not_know() -> None:
    for groups in (1, 2, 4):
        specs = {
            tp: groups_mod.state_spec(*vllm_state(tp, groups), tp)
            for tp in (1, 2, 4)
            if groups % tp == 0 or groups == 1
        }
        assert None not in specs.values() and len(set(specs.values())) == 1, (groups, specs)
        (spec,) = set(specs.values())
        assert (spec.channels, spec.groups, spec.heads, spec.conv_len) == (32, groups, 8, 3)
    assert groups_mod.state_spec(*vllm_state(2, 3), 2) is None  # (3 groups over 2 ranks: not vLLM's split)
    assert groups_mod.state_spec(*vllm_state(2, 2, dim=50), 2) is None  # (a conv width of another split)
    assert groups_mod.state_spec(vllm_state(1, 2)[0], types.SimpleNamespace(), 1) is None  # (no group count)
