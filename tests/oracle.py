"""Test-side helpers over the pure planning code: full validation + planning in one call, and the merge
rule NIXL applies, executed on explicit descriptor arrays (the oracle the layout properties compare with)."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvconnect.core.plan.descriptors import PairPlan, PullPlan
from kvconnect.core.plan.params import validate_block_ids


def validated(
    pair: PairPlan, local_ids: Sequence[int] | np.ndarray, remote_ids: Sequence[int] | np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Every check a pull's ids get on their way to a READ, in the order the READ issues them."""
    local = validate_block_ids("local_block_ids", local_ids, pair.local_spec.num_blocks)
    remote = validate_block_ids("remote_block_ids", remote_ids, pair.remote_spec.num_blocks)
    return pair.order_checked(local, remote)


def plan(
    pair: PairPlan,
    local_ids: Sequence[int] | np.ndarray,
    remote_ids: Sequence[int] | np.ndarray,
    num_tokens: int | None = None,
    remote_offset: int = 0,
    state_ids: Sequence[int] | None = None,
) -> PullPlan:
    state = None if state_ids is None else np.asarray(state_ids, dtype=np.int64)
    return pair.plan_validated(*validated(pair, local_ids, remote_ids), num_tokens, remote_offset, state)


def merge_runs(
    dst: np.ndarray, src: np.ndarray, dst_region: np.ndarray | None = None, src_region: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Merge (N, 3) descriptor pairs, in order, where both sides continue the previous one (and stay in the
    same registered region, when regions are given). Returns the merged (M, 3) arrays: what a READ touches."""
    if dst.shape != src.shape:
        raise ValueError("descriptor arrays differ in shape")
    if dst.shape[0] == 0:
        return dst.copy(), src.copy()
    joins = (
        (dst[1:, 0] == dst[:-1, 0] + dst[:-1, 1])
        & (src[1:, 0] == src[:-1, 0] + src[:-1, 1])
        & (dst[1:, 2] == dst[:-1, 2])
        & (src[1:, 2] == src[:-1, 2])
    )
    if dst_region is not None and src_region is not None:
        joins &= (dst_region[1:] == dst_region[:-1]) & (src_region[1:] == src_region[:-1])
    starts = np.flatnonzero(np.concatenate(([True], ~joins)))
    lengths = np.add.reduceat(dst[:, 1], starts)
    out_dst = dst[starts].copy()
    out_src = src[starts].copy()
    out_dst[:, 1] = lengths
    out_src[:, 1] = lengths
    return out_dst, out_src


def execute(
    pair: PairPlan,
    dst: Any,
    src: Any,
    local_ids: Sequence[int],
    remote_ids: Sequence[int],
    num_tokens: int | None = None,
    remote_offset: int = 0,
    state_ids: Sequence[int] | None = None,
) -> PullPlan:
    """Carry out `pair`'s plan for these blocks with memmove between two local caches (`KVCache`): what a READ
    of the same descriptors would do."""
    p = plan(pair, local_ids, remote_ids, num_tokens, remote_offset, state_ids)
    ldesc, rdesc = pair.local_descs(dst.base_addrs(), 0), pair.remote_descs(src.base_addrs(), 0)
    for (daddr, n, _), (saddr, m, _) in zip(ldesc[p.local_indices], rdesc[p.remote_indices], strict=True):
        assert n == m
        ctypes.memmove(int(daddr), int(saddr), int(n))
    return p
