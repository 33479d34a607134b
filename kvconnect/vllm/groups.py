"""vLLM's KV cache groups as the plug-in moves them (the hybrid KV cache manager, `SupportsHMA`).

A hybrid model's layers fall into groups by their cache spec, each with its own block list per request:

- full attention (`FullAttentionSpec` and its kinds): every block of the prompt moves (less what the
  decode's own prefix cache holds);
- sliding-window attention (`SlidingWindowSpec`): only the window's tail moves, the last
  cdiv(window, block_size) + 1 blocks; vLLM has already swapped the blocks before it for its null block. vLLM
  frees them for the window of the *next* token (a prefill that computed n tokens keeps n - window + 1 onwards),
  but the decode computes the prompt's last token again, whose window starts one position earlier: where that
  position opens a block, the block is gone and the decode would attend to a null block (NixlConnector's P/D
  differs from the aggregated server there, at one prompt length per block). So a model with a sliding window
  backs off a token too (`BACKOFF`): the prefill computes all but the last prompt token, and the window of the
  token the decode computes is exactly what the prefill kept;
- Mamba and linear-attention state (`MambaSpec`: Mamba1/2, GDN, short convolutions): one block holds a
  request's whole state (conv + SSM) after its last computed token; only that block moves (scratch blocks
  for speculative decoding and the null placeholders of vLLM's "align" cache mode stay). A state cannot be
  rewound, so the prefill of a model with state computes all but the prompt's last token (`BACKOFF`) and the
  decode computes that token itself from the state it pulled.

Any other spec (chunked local attention, cross-attention, ...) stops start-up with one line naming the
group's layers, the spec and what is supported. Specs are recognised by their class names (vLLM moves its
classes between releases), subclasses included.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvconnect.core.errors import ConfigError, LayoutError
from kvconnect.core.plan.state import StateSpec

NULL_BLOCK_ID = 0  # vLLM's block pool keeps block 0 as its null block: a placeholder, never a request's KV
FULL = ("FullAttentionSpec",)
SLIDING = ("SlidingWindowSpec",)
STATE = ("MambaSpec",)
BACKOFF = 1  # prompt tokens a model with state or a sliding window leaves to the decode (module docstring)


@dataclass(frozen=True)
class GroupMove:
    """How one KV cache group's blocks move."""

    spec: str  # the spec's class name (logs)
    keep_blocks: int = 0  # 0: every block; n: the last n (a sliding window's tail)
    state: bool = False  # a Mamba / linear-attention state group: one block holds the request's state
    scratch_blocks: int = 0  # (state) blocks after the state's, for speculative decoding: never moved

    def trim(self, block_ids: Sequence[int]) -> list[int]:
        """The blocks of this group that move, in token order (null placeholders dropped)."""
        ids = [int(b) for b in block_ids if int(b) != NULL_BLOCK_ID]
        if self.state:
            scratch = min(self.scratch_blocks, max(len(ids) - 1, 0))
            return ids[: len(ids) - scratch][-1:]
        return ids[-self.keep_blocks :] if self.keep_blocks else ids


def backoff(moves: Sequence[GroupMove]) -> int:
    """Prompt tokens the prefill leaves for the decode to compute: `BACKOFF` for a model with state or a sliding
    window (module docstring), else 0 (full attention's KV of the last token is simply computed again)."""
    return BACKOFF if any(m.state or m.keep_blocks for m in moves) else 0


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
        elif kinds & set(STATE):
            moves.append(GroupMove(name, state=True, scratch_blocks=int(getattr(spec, "num_speculative_blocks", 0))))
        else:
            layers = list(getattr(group, "layer_names", []))
            shown = ", ".join(layers[:3]) + (f" and {len(layers) - 3} more" if len(layers) > 3 else "")
            raise ConfigError(
                f"kvconnect: KV cache group {i} ({shown}) is {name}; kvconnect moves full-attention and "
                "sliding-window attention caches and Mamba / linear-attention state (MambaSpec); chunked "
                "local attention and cross-attention are not supported yet"
            )
    return tuple(moves)


def state_layers(kv_cache_config: Any) -> tuple[frozenset[str], str]:
    """The layers of the state groups of `kv_cache_config`, and what their pages hold, for the page format
    ("" when none): the state kind, shapes and dtypes per layer kind (vLLM's conv-state layout, SD or DS, shows
    as the order of the conv shape), so that only peers whose states are laid out alike exchange pages."""
    names: set[str] = set()
    kinds: set[str] = set()
    for group in getattr(kv_cache_config, "kv_cache_groups", None) or ():
        spec = group.kv_cache_spec
        if not _kinds(spec) & set(STATE):
            continue
        names.update(group.layer_names)
        kind = getattr(getattr(spec, "mamba_type", None), "name", type(spec).__name__)
        shapes = "/".join("x".join(str(n) for n in shape) for shape in spec.shapes)
        dtypes = "/".join(str(d).removeprefix("torch.") for d in spec.dtypes)
        kinds.add(f"{kind}:{shapes}:{dtypes}")
    return frozenset(names), (f"+state({';'.join(sorted(kinds))})" if kinds else "")


GROUP_KEYS = ("n_groups", "mamba_n_groups", "ngroups")  # the model's B/C groups, by the configs' spellings


def state_spec(kv_cache_config: Any, hf_config: Any, tp_size: int) -> StateSpec | None:
    """The model's Mamba2 state over all ranks (`StateSpec`), from this rank's state shapes and the model's group
    count, so that ranks of other TP sizes can take their share; None when the state groups are not all Mamba2
    of one shape or the config names no group count (their pages then move whole, between equal TP sizes)."""
    specs = [
        g.kv_cache_spec
        for g in getattr(kv_cache_config, "kv_cache_groups", None) or ()
        if _kinds(g.kv_cache_spec) & set(STATE)
    ]
    groups = next((getattr(hf_config, k) for k in GROUP_KEYS if isinstance(getattr(hf_config, k, None), int)), 0)
    if not specs or groups < 1:
        return None
    first = specs[0]
    if any(getattr(getattr(s, "mamba_type", None), "name", "") != "MAMBA2" for s in specs) or any(
        (tuple(s.shapes), tuple(s.dtypes)) != (tuple(first.shapes), tuple(first.dtypes)) for s in specs
    ):
        return None
    if len(first.shapes) != 2 or len(first.shapes[0]) != 2 or len(first.shapes[1]) != 3:
        return None
    conv, (heads, head_dim, size) = (int(n) for n in first.shapes[0]), (int(n) for n in first.shapes[1])
    conv_a, conv_b = conv
    conv_len = min(conv_a, conv_b)
    layout = "SD" if conv_a == conv_len and conv_b != conv_len else "DS"
    dim = conv_b if layout == "SD" else conv_a
    itemsizes = [_itemsize(d) for d in first.dtypes]
    try:
        spec = StateSpec(
            "mamba2",
            layout,
            conv_len,
            heads * head_dim * tp_size,
            groups,
            size,
            heads * tp_size,
            head_dim * size * itemsizes[1],
            itemsizes[0],
        )
    except LayoutError:
        return None
    if spec.tp_problem(tp_size) or spec.conv_dim(tp_size) != dim:
        return None  # (not vLLM's Mamba2 split as state.py knows it)
    return spec


def _itemsize(dtype: Any) -> int:
    return int(getattr(dtype, "itemsize", 0)) or 1
