"""What a reader may name for a lease (pure): its blocks, its prompt, the digest of what it read, the content
sums recorded at the grant. The lease table looks the lease up under its lock and asks these (`table.py`)."""

from __future__ import annotations

import hmac
from collections.abc import Sequence

import numpy as np

from kvconnect.core.plan.groups import MAX_GROUPS, GroupedBlocks
from kvconnect.core.prefill.lease import Lease
from kvconnect.core.wire.protocol import blocks_digest


def grouped(ids: Sequence[int], groups: tuple[int, ...]) -> GroupedBlocks:
    return GroupedBlocks(np.asarray(ids, dtype=np.int64), groups or (len(ids),))


def blocks_problem(lease: Lease | None, block_ids: Sequence[int], group_sizes: Sequence[int] = ()) -> str:
    """Why `block_ids` (per KV cache group, `group_sizes`) may not be named for `lease` ("" when they may): a
    non-empty suffix of the leased ids, of each group's for a hybrid model's lease. A lease nobody knows has
    nothing to protect ("")."""
    if lease is None:
        return ""
    leased_ids, groups = lease.block_ids, lease.groups
    ids = tuple(int(b) for b in block_ids)
    if ids and len(groups) <= 1 and tuple(group_sizes) in ((), (len(ids),)) and leased_ids[-len(ids) :] == ids:
        return ""  # (one group, a suffix: the common case, answered without numpy on a PIN's path)
    leased = grouped(leased_ids, groups)
    if not ids:
        return f"block_ids: required (the lease holds {leased.ids.size} blocks)"
    if group_sizes and (len(group_sizes) > MAX_GROUPS or sum(group_sizes) != len(ids)):
        return "block_ids: group_sizes do not split them"
    named = grouped(ids, tuple(group_sizes))
    if named.num_groups != leased.num_groups:
        return f"block_ids: the lease holds {leased.num_groups} KV cache groups, {named.num_groups} named"
    if not named.is_tail_of(leased):
        foreign = sorted(set(ids) - set(lease.block_ids))[:8]
        what = f"blocks {foreign} are not leased to it" if foreign else "they are not the tail of its blocks"
        return f"block_ids: the lease cannot name {list(ids[:8])}{'...' if len(ids) > 8 else ''}: {what}"
    return ""


def prompt_problem(lease: Lease | None, prompt: bytes) -> str:
    """Why a reader naming the prompt digest `prompt` may not read `lease` ("" when it may)."""
    bound = lease.prompt if lease is not None else b""
    if not bound or hmac.compare_digest(bound, prompt):
        return ""
    why = "the lease holds the KV of another prompt" if prompt else "the lease is bound to a prompt; none named"
    return f"prompt: {why}"


def digest_matches(lease: Lease | None, num_blocks: int, digest: bytes, group_sizes: Sequence[int] = ()) -> bool:
    """Whether a notification's (count, digest) names a suffix of the lease's blocks (of each group's, with
    `group_sizes` counting the blocks read per group; see protocol)."""
    if lease is None:
        return True  # (completing an unknown lease does nothing)
    leased = grouped(lease.block_ids, lease.groups)
    sizes = tuple(group_sizes) if len(group_sizes) > 1 else (num_blocks,)
    if len(sizes) != leased.num_groups or sum(sizes) != num_blocks or not 0 < num_blocks <= leased.ids.size:
        return False
    tails = [g[g.size - n :] for g, n in zip(leased.groups(), sizes, strict=True) if 0 <= n <= g.size]
    return len(tails) == len(sizes) and blocks_digest(np.concatenate(tails).tolist()) == digest


def content_of(lease: Lease | None, block_ids: Sequence[int]) -> list[int] | None:
    """The content sums the grant recorded for `block_ids` of the lease (None: it recorded none)."""
    by_block = dict(zip(lease.block_ids, lease.content, strict=True)) if lease and lease.content else {}
    return [by_block[int(b)] for b in block_ids] if all(int(b) in by_block for b in block_ids) else None
