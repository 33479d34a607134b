"""vLLM's KV cache groups as the plug-in moves them (the hybrid KV cache manager, `SupportsHMA`).

A hybrid model's layers fall into groups by their cache spec, each with its own block list per request:

- full attention (`FullAttentionSpec` and its kinds): every block of the prompt moves (less what the
  decode's own prefix cache holds);
- sliding-window attention (`SlidingWindowSpec`): only the window's tail moves, the last
  cdiv(window, block_size) + 1 blocks; vLLM has already swapped the blocks before it for its null block.

Any other spec (Mamba or linear-attention state, chunked local attention, cross-attention, ...) stops
start-up with one line naming the group's layers, the spec and what is supported. Specs are recognised by
their class names (vLLM moves its classes between releases), subclasses included.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvconnect.core.errors import ConfigError

NULL_BLOCK_ID = 0  # vLLM's block pool keeps block 0 as its null block: a placeholder, never a request's KV
FULL = ("FullAttentionSpec",)
SLIDING = ("SlidingWindowSpec",)


@dataclass(frozen=True)
class GroupMove:
    """How one KV cache group's blocks move."""

    spec: str  # the spec's class name (logs)
    keep_blocks: int = 0  # 0: every block; n: the last n (a sliding window's tail)

    def trim(self, block_ids: Sequence[int]) -> list[int]:
        """The blocks of this group that move, in token order (null placeholders dropped)."""
        ids = [int(b) for b in block_ids if int(b) != NULL_BLOCK_ID]
        return ids[-self.keep_blocks :] if self.keep_blocks else ids


def _kinds(spec: Any) -> set[str]:
    return {cls.__name__ for cls in type(spec).__mro__}


def group_moves(kv_cache_config: Any) -> tuple[GroupMove, ...]:
    """One `GroupMove` per KV cache group of `kv_cache_config` (vLLM's `KVCacheConfig`; None: one full group).
    ConfigError naming the group's layers and spec when a group holds state the plug-in cannot move."""
    groups = getattr(kv_cache_config, "kv_cache_groups", None)
    if not groups:
        return (GroupMove("FullAttentionSpec"),)
    moves = []
    for i, group in enumerate(groups):
        spec = group.kv_cache_spec
        kinds, name = _kinds(spec), type(spec).__name__
        if kinds & set(SLIDING):
            window, block_size = int(spec.sliding_window), int(spec.block_size)
            moves.append(GroupMove(name, -(-window // block_size) + 1))
        elif kinds & set(FULL):
            moves.append(GroupMove(name))
        else:
            layers = list(getattr(group, "layer_names", []))
            shown = ", ".join(layers[:3]) + (f" and {len(layers) - 3} more" if len(layers) > 3 else "")
            raise ConfigError(
                f"kvconnect: KV cache group {i} ({shown}) is {name}; kvconnect moves full-attention and "
                "sliding-window attention caches (Mamba and linear-attention state, chunked local attention "
                "and cross-attention are not supported yet)"
            )
    return tuple(moves)
