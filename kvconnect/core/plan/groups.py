"""The blocks of a request, per KV cache group (pure).

A hybrid model (sliding-window + full attention layers, as in gpt-oss and Gemma 3) keeps one block list per
KV cache group: the engine's block pool is shared, so a block id belongs to one group at a time, and the
groups' layers overlay one allocation. Block b of any group is therefore block b of every registered
region: what moves is the same whatever the group, and only which local block receives which remote one
depends on the groups. On the wire a request's blocks stay one flat list (`remote_block_ids`, group after
group) with the per-group counts beside it (`remote_group_sizes`); a single-group model sends no counts,
exactly as before.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvconnect.core.errors import InvalidRequestError

MAX_GROUPS = 64  # KV cache groups a request may name (models have a handful)


@dataclass(frozen=True)
class GroupedBlocks:
    """Block ids, group after group (`ids`), with how many each group holds (`sizes`)."""

    ids: np.ndarray  # int64
    sizes: tuple[int, ...]

    @classmethod
    def of(cls, groups: Sequence[Sequence[int] | np.ndarray]) -> GroupedBlocks:
        if len(groups) == 1:  # (the common case, on a pull's path: no concatenation)
            only = np.asarray(groups[0], dtype=np.int64).reshape(-1)
            return cls(only, (int(only.size),))
        arrays = [np.asarray(g, dtype=np.int64).reshape(-1) for g in groups]  # (not element by element: 256 ids
        ids = np.concatenate(arrays) if arrays else np.zeros(0, dtype=np.int64)  # took 35 us so, on a pull's path)
        return cls(ids, tuple(int(a.size) for a in arrays))

    @classmethod
    def flat(cls, ids: Sequence[int] | np.ndarray, sizes: Sequence[int] | None, field: str) -> GroupedBlocks:
        """`ids` split by `sizes` (None or empty: one group); InvalidRequestError naming `field` otherwise."""
        arr = np.asarray(ids, dtype=np.int64)
        if not sizes:
            return cls(arr, (int(arr.size),))
        if len(sizes) > MAX_GROUPS:
            raise InvalidRequestError(field, f"{len(sizes)} groups, more than {MAX_GROUPS}")
        if any(type(n) is not int or n < 0 for n in sizes) or sum(sizes) != arr.size:
            raise InvalidRequestError(field, f"group sizes {list(sizes)[:8]} do not split {arr.size} block ids")
        return cls(arr, tuple(int(n) for n in sizes))

    @property
    def num_groups(self) -> int:
        return len(self.sizes)

    def groups(self) -> list[np.ndarray]:
        if len(self.sizes) == 1:
            return [self.ids]
        cut = np.cumsum((0, *self.sizes))
        return [self.ids[cut[i] : cut[i + 1]] for i in range(len(self.sizes))]

    def wire_sizes(self) -> list[int] | None:
        """What `remote_group_sizes` carries: None for one group (the wire as without groups)."""
        return list(self.sizes) if len(self.sizes) > 1 else None

    def is_tail_of(self, leased: GroupedBlocks) -> bool:
        """Whether each of these groups is a suffix of the same group of `leased` (a decode whose own prefix
        cache holds a group's first blocks reads only the rest of it); one group may name a flat lease."""
        if self.num_groups != leased.num_groups:
            return False
        for mine, theirs in zip(self.groups(), leased.groups(), strict=True):
            n = mine.size
            if n > theirs.size or not np.array_equal(theirs[theirs.size - n :], mine):
                return False
        return True


def tail_pairs(local: GroupedBlocks, remote: GroupedBlocks, field: str) -> tuple[GroupedBlocks, GroupedBlocks]:
    """Per group, the local blocks to fill and the remote blocks they receive: the last blocks of each, as
    many as the local group holds (its first blocks are the local prefix-cache hit; a sliding-window group
    holds the window's tail on both sides). InvalidRequestError naming `field` when they cannot pair."""
    if local.num_groups != remote.num_groups:
        raise InvalidRequestError(
            field, f"blocks for {remote.num_groups} KV cache groups; this model has {local.num_groups}"
        )
    out_local, out_remote = [], []
    for g, (mine, theirs) in enumerate(zip(local.groups(), remote.groups(), strict=True)):
        if mine.size > theirs.size:
            raise InvalidRequestError(
                field, f"{theirs.size} remote blocks for {mine.size} blocks to load in KV cache group {g}"
            )
        out_local.append(mine)
        out_remote.append(theirs[theirs.size - mine.size :])
    return GroupedBlocks.of(out_local), GroupedBlocks.of(out_remote)
