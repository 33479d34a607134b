"""Descriptor math as numpy arrays (pure, no I/O): prepared lists per peer, index arrays per request.

A *pair plan* is computed once per (local spec, remote spec) at handshake time: it fixes the
granularity and the unit tables of both sides. Each side's prepared descriptor list holds every unit of
every block, unit-major: descriptor `u * num_blocks + b` is unit u of block b. A request then needs only
two index arrays. Pairs are issued unit-major and sorted by remote block id, so runs of consecutive
blocks (consecutive on both sides) sit next to each other and merge into one descriptor; we count the
merged descriptors exactly from the unit tables, the same rule NIXL applies when it merges.

Pairs whose blocks differ (TP head slices, block sizes, NHD/HND) use CHUNK units instead (built in
`hetero.py`): the request is cut into token *segments* of `seg_tokens` (the gcd of the two block sizes),
each segment of each K/V half moves as `chunks` equal pieces, and ids stay in token order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvconnect.core.errors import InvalidRequestError, LayoutError
from kvconnect.core.plan.layout import (
    CacheSpec,
    Granularity,
    UnitTable,
    check_compatible,
    pair_granularity,
    same_block_shape,
    unit_table,
)


def descriptor_array(table: UnitTable, num_blocks: int, base_addrs: Sequence[int], device_id: int) -> np.ndarray:
    """Every unit of every block as an (U * num_blocks, 3) array of (addr, len, device id), unit-major."""
    bases = np.asarray(base_addrs, dtype=np.int64)
    if bases.shape[0] <= int(table.region.max()):
        raise LayoutError(f"need {int(table.region.max()) + 1} base addresses, got {bases.shape[0]}")
    starts = bases[table.region] + table.offset_bytes  # (U,)
    blocks = np.arange(num_blocks, dtype=np.int64) * table.block_stride_bytes
    addrs = (starts[:, None] + blocks[None, :]).reshape(-1)
    out = np.empty((addrs.shape[0], 3), dtype=np.int64)
    out[:, 0] = addrs
    out[:, 1] = np.repeat(table.unit_sizes, num_blocks)
    out[:, 2] = device_id
    return out


def strided_descriptor_array(
    table: UnitTable, num_blocks: int, base_addrs: Sequence[int], device_id: int
) -> np.ndarray:
    """The same list in NIXL's compressed Nx5 form: one row per unit, (addr, len, dev, stride, count)."""
    bases = np.asarray(base_addrs, dtype=np.int64)
    out = np.empty((table.num_units, 5), dtype=np.int64)
    out[:, 0] = bases[table.region] + table.offset_bytes
    out[:, 1] = table.unit_sizes
    out[:, 2] = device_id
    out[:, 3] = table.block_stride_bytes
    out[:, 4] = num_blocks
    return out


def token_span(
    n_local: int, local_block: int, n_remote: int, remote_block: int, num_tokens: int | None, remote_offset: int = 0
) -> int:
    """How many tokens a request moves when the two sides' block sizes differ (the remote blocks' first
    `remote_offset` tokens excluded); InvalidRequestError when the two block lists cannot hold the same tokens."""
    cap_local, cap_remote = n_local * local_block, n_remote * remote_block - remote_offset
    if num_tokens is None:
        n = min(cap_local, cap_remote)
        if n < 1 or -(-n // local_block) != n_local or -(-(n + remote_offset) // remote_block) != n_remote:
            raise InvalidRequestError(
                "remote_block_ids",
                f"{n_remote} remote blocks of {remote_block} tokens and {n_local} local blocks "
                f"of {local_block} tokens do not hold the same tokens; send remote_num_tokens",
            )
        return n
    if num_tokens < 1:
        raise InvalidRequestError("remote_num_tokens", f"must be positive, got {num_tokens}")
    for field, cap, count, size in (
        ("local_block_ids", cap_local, n_local, local_block),
        ("remote_block_ids", cap_remote, n_remote, remote_block),
    ):
        if cap < num_tokens:
            raise InvalidRequestError(field, f"{count} blocks of {size} tokens cannot hold {num_tokens} tokens")
    return num_tokens


@dataclass(frozen=True)
class PullPlan:
    """One request's READ: index arrays into both prepared lists, and what it will move."""

    local_indices: np.ndarray  # int32, into the local prepared list
    remote_indices: np.ndarray  # int32, into the remote prepared list
    num_blocks: int
    num_descs: int  # before run merging
    num_descs_merged: int
    total_bytes: int


@dataclass(frozen=True)
class PairPlan:
    """Everything about moving blocks between two specs that does not depend on the request."""

    local_spec: CacheSpec
    remote_spec: CacheSpec
    granularity: Granularity
    local_units: UnitTable
    remote_units: UnitTable
    # CHUNK plans only (see the module doc); 0 means block for block
    seg_tokens: int = 0
    chunks: int = 1
    # block for block, a hybrid's pages split by TP (hetero.state_pair): units [0, state_from) move the
    # attention blocks, the rest the state blocks (which local blocks hold state: `plan_validated`'s `state_ids`)
    state_from: int = 0

    @classmethod
    def build(cls, local_spec: CacheSpec, remote_spec: CacheSpec) -> PairPlan:
        """Block-for-block plan; the two specs must hold the same heads, block size and token order."""
        check_compatible(local_spec, remote_spec)
        if not same_block_shape(local_spec, remote_spec):
            raise LayoutError("blocks differ in heads, block size or token layout: plan with hetero.plan_source")
        gran = pair_granularity(local_spec, remote_spec)
        return cls(local_spec, remote_spec, gran, unit_table(local_spec, gran), unit_table(remote_spec, gran))

    @property
    def unit_bytes(self) -> int:
        return self.local_units.unit_bytes

    @property
    def block_for_block(self) -> bool:
        return self.seg_tokens == 0

    def local_descs(self, base_addrs: Sequence[int], device_id: int) -> np.ndarray:
        return descriptor_array(self.local_units, self.local_spec.num_blocks, base_addrs, device_id)

    def remote_descs(self, base_addrs: Sequence[int], device_id: int) -> np.ndarray:
        return descriptor_array(self.remote_units, self.remote_spec.num_blocks, base_addrs, device_id)

    def order_checked(
        self, local_ids: Sequence[int] | np.ndarray, remote_ids: Sequence[int] | np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """Ids that already passed `params.validate_block_ids` (integers, non-negative, unique) checked against
        both sides' sizes (`bounds_checked`), as pairs sorted by remote id when block for block: the order a
        READ issues them in, so runs of consecutive blocks merge."""
        local, remote = self.bounds_checked(
            np.asarray(local_ids, dtype=np.int64), np.asarray(remote_ids, dtype=np.int64)
        )
        if not self.block_for_block:
            return local, remote
        order = np.argsort(remote, kind="stable")
        return local[order], remote[order]

    def bounds_checked(self, local_ids: np.ndarray, remote_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The checks left after `validate_block_ids`: upper bounds on both sides and, block for block, equal
        counts. Unsorted, for a copy whose issue order does not matter (the IPC gather: one kernel)."""
        for field, ids, bound in (
            ("local_block_ids", local_ids, self.local_spec.num_blocks),
            ("remote_block_ids", remote_ids, self.remote_spec.num_blocks),
        ):
            if ids.size and int(ids.max()) >= bound:
                raise InvalidRequestError(field, f"block ids {ids[ids >= bound][:8].tolist()} outside [0, {bound})")
        if self.block_for_block and local_ids.size != remote_ids.size:
            raise InvalidRequestError(
                "remote_block_ids", f"{remote_ids.size} remote blocks for {local_ids.size} local blocks"
            )
        return local_ids, remote_ids

    def summary(self, num_blocks: int) -> PullPlan:
        """What a block-for-block copy of `num_blocks` blocks moves, without index arrays (IPC gather)."""
        units = self.local_units.num_units * num_blocks
        empty = np.empty(0, dtype=np.int32)
        return PullPlan(empty, empty, num_blocks, units, units, units * self.unit_bytes)

    def plan_validated(
        self,
        local: np.ndarray,
        remote: np.ndarray,
        num_tokens: int | None = None,
        remote_offset: int = 0,
        state_ids: np.ndarray | None = None,
    ) -> PullPlan:
        """Index arrays for pulling remote[i] into local[i] (block for block), or the tokens the two block lists
        hold (CHUNK plans; the local blocks' first token is the remote blocks' `remote_offset`-th), for ids that
        came out of `order_checked`; `state_ids`: the local blocks that hold state (plans with `state_from`).
        Raises InvalidRequestError."""
        if not self.block_for_block:
            return self._plan_segments(local, remote, num_tokens, remote_offset)
        if remote_offset:
            raise InvalidRequestError("remote_block_ids", f"whole blocks move here, not from token {remote_offset}")
        units = np.arange(self.local_units.num_units, dtype=np.int64)
        if not self.state_from:
            return self._plan_blocks(local, remote, units)
        if state_ids is None:
            raise InvalidRequestError("remote_group_sizes", "this pair splits state pages: which blocks hold state?")
        state = np.isin(local, state_ids)
        parts = [
            self._plan_blocks(local[~state], remote[~state], units[: self.state_from]),
            self._plan_blocks(local[state], remote[state], units[self.state_from :]),
        ]
        return PullPlan(
            local_indices=np.concatenate([p.local_indices for p in parts]),
            remote_indices=np.concatenate([p.remote_indices for p in parts]),
            num_blocks=int(local.size),
            num_descs=sum(p.num_descs for p in parts),
            num_descs_merged=sum(p.num_descs_merged for p in parts),
            total_bytes=sum(p.total_bytes for p in parts),
        )

    def _plan_blocks(self, local: np.ndarray, remote: np.ndarray, units: np.ndarray) -> PullPlan:
        """Units `units` of every block pair, unit-major."""
        local_idx = (units[:, None] * self.local_spec.num_blocks + local[None, :]).reshape(-1)
        remote_idx = (units[:, None] * self.remote_spec.num_blocks + remote[None, :]).reshape(-1)
        sizes = self.local_units.unit_sizes[units]
        return PullPlan(
            local_indices=local_idx.astype(np.int32),
            remote_indices=remote_idx.astype(np.int32),
            num_blocks=int(local.size),
            num_descs=int(local_idx.size),
            num_descs_merged=_count_merged(self.local_units, self.remote_units, local, remote, units),
            total_bytes=int(sizes.sum()) * int(local.size),
        )

    def _plan_segments(self, local: np.ndarray, remote: np.ndarray, num_tokens: int | None, offset: int) -> PullPlan:
        ls, rs, g, c = self.local_spec, self.remote_spec, self.seg_tokens, self.chunks
        if offset % g or not 0 <= offset < rs.block_size:
            raise InvalidRequestError(
                "remote_block_ids", f"token {offset} of a remote block is no segment start (segments of {g} tokens)"
            )
        n = token_span(local.size, ls.block_size, remote.size, rs.block_size, num_tokens, offset)
        t = np.arange(-(-n // g), dtype=np.int64) * g  # first token of each segment
        l_blk, l_sub = local[t // ls.block_size], (t % ls.block_size) // g
        r_blk, r_sub = remote[(t + offset) // rs.block_size], ((t + offset) % rs.block_size) // g
        order = np.lexsort((r_sub, r_blk))  # issue in remote address order: neighbours merge
        l_blk, l_sub, r_blk, r_sub = l_blk[order], l_sub[order], r_blk[order], r_sub[order]
        common = np.arange(self.local_units.num_units // (ls.block_size // g), dtype=np.int64)[:, None]
        half, piece = common // c, common % c
        l_unit = ((half * (ls.block_size // g) + l_sub) * c + piece).reshape(-1)
        r_unit = ((half * (rs.block_size // g) + r_sub) * c + piece).reshape(-1)
        l_blk = np.broadcast_to(l_blk, (common.shape[0], l_blk.size)).reshape(-1)
        r_blk = np.broadcast_to(r_blk, (common.shape[0], r_blk.size)).reshape(-1)
        lt, rt = self.local_units, self.remote_units
        l_pos, r_pos = (
            lt.offset_bytes[l_unit] + l_blk * lt.block_stride_bytes,
            rt.offset_bytes[r_unit] + r_blk * rt.block_stride_bytes,
        )
        size = lt.unit_bytes
        joins = (
            (lt.region[l_unit[1:]] == lt.region[l_unit[:-1]])
            & (l_pos[1:] == l_pos[:-1] + size)
            & (rt.region[r_unit[1:]] == rt.region[r_unit[:-1]])
            & (r_pos[1:] == r_pos[:-1] + size)
        )
        return PullPlan(
            local_indices=(l_unit * ls.num_blocks + l_blk).astype(np.int32),
            remote_indices=(r_unit * rs.num_blocks + r_blk).astype(np.int32),
            num_blocks=int(local.size),
            num_descs=int(l_unit.size),
            num_descs_merged=int(l_unit.size - np.count_nonzero(joins)),
            total_bytes=int(l_unit.size) * size,
        )


def _unit_positions(table: UnitTable, ids: np.ndarray, units: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(region, byte offset inside the region) of every (unit, block) in issue order."""
    region = np.repeat(table.region[units], ids.size)
    offset = (table.offset_bytes[units][:, None] + ids[None, :] * table.block_stride_bytes).reshape(-1)
    return region, offset


def _count_merged(
    local_t: UnitTable, remote_t: UnitTable, local: np.ndarray, remote: np.ndarray, units: np.ndarray
) -> int:
    """Descriptors left after merging neighbours that are adjacent, in order, on both sides."""
    lr, lo = _unit_positions(local_t, local, units)
    rr, ro = _unit_positions(remote_t, remote, units)
    size = np.repeat(local_t.unit_sizes[units], local.size)[:-1]
    joins = (lr[1:] == lr[:-1]) & (lo[1:] == lo[:-1] + size) & (rr[1:] == rr[:-1]) & (ro[1:] == ro[:-1] + size)
    return int(lo.size - np.count_nonzero(joins))
