"""Paged KV-cache layouts: the typed spec, its byte math, and the compatibility check (pure, no I/O).

A worker's cache is a set of registered *regions* (one per layer for `blocks_first` and `kv_first`, a
single one for `cross_layer`). Inside a region every block sits at `block_stride_bytes` from the next.
The unit of transfer is a *granularity*: the whole block across all layers (`BLOCK`), the K+V of one
layer (`LAYER`), or one K or V half of one layer (`HALF`). Each layout is contiguous at its own natural
granularity and at every finer one, so two peers move data at the finer of their two natural ones.
Descriptor arrays and per-request plans built on this live in `descriptors.py`.

Tensor parallelism: a rank holds a slice of the model's KV heads (`head_range`); when TP exceeds the
number of KV heads, each rank holds one head and `tp_size // model_kv_heads` ranks hold the same one
(replication). Inside one K or V block the tokens are laid out NHD `(block_size, H, D)` (FlashAttention)
or HND `(H, block_size, D)` (one head's tokens contiguous). Pairs that differ in TP, block size or token
layout are planned in `hetero.py`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import msgspec
import numpy as np

from kvconnect.core.errors import LayoutError, LayoutMismatchError
from kvconnect.core.plan.state import StateSpec


class LayoutKind(str, enum.Enum):
    BLOCKS_FIRST = "blocks_first"  # per layer (num_blocks, 2, block_size, H, D)
    KV_FIRST = "kv_first"  # per layer (2, num_blocks, block_size, H, D)
    CROSS_LAYER = "cross_layer"  # one tensor (num_blocks, num_layers, 2, block_size, H, D)


class Granularity(enum.IntEnum):
    """Transfer unit; a larger value is finer."""

    BLOCK = 0  # one block, every layer, K and V: one contiguous span in cross_layer
    LAYER = 1  # one block of one layer, K and V together
    HALF = 2  # one block of one layer, K or V alone
    CHUNK = 3  # a piece of one K or V block (a token range and/or a head slice): see hetero.py


NATURAL_GRANULARITY = {
    LayoutKind.CROSS_LAYER: Granularity.BLOCK,
    LayoutKind.BLOCKS_FIRST: Granularity.LAYER,
    LayoutKind.KV_FIRST: Granularity.HALF,
}

DTYPE_BYTES = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
}

DEVICE_KINDS = ("cpu", "cuda")
TOKEN_LAYOUTS = ("NHD", "HND")

# Fields two peers must agree on, in the order a mismatch is reported (TP, block size and token layout
# may differ: hetero.py plans those pairs).
_MUST_MATCH = ("dtype", "num_layers", "head_dim", "model_kv_heads", "page")


def rank_heads(model_kv_heads: int, tp_size: int, tp_rank: int) -> tuple[int, int]:
    """The global KV heads [start, stop) that rank `tp_rank` of `tp_size` holds."""
    if tp_size <= model_kv_heads:
        per_rank = model_kv_heads // tp_size
        return tp_rank * per_rank, (tp_rank + 1) * per_rank
    head = tp_rank // (tp_size // model_kv_heads)
    return head, head + 1


def tp_problem(model_kv_heads: int, tp_size: int) -> str:
    """Why `tp_size` ranks cannot share `model_kv_heads` KV heads evenly ("" when they can)."""
    if tp_size <= model_kv_heads and model_kv_heads % tp_size:
        return f"tp_size {tp_size} does not divide the model's {model_kv_heads} KV heads"
    if tp_size > model_kv_heads and tp_size % model_kv_heads:
        return f"tp_size {tp_size} is not a multiple of the model's {model_kv_heads} KV heads (replication)"
    return ""


class CacheSpec(msgspec.Struct, frozen=True):
    """What a worker's paged KV cache looks like; travels in the handshake.

    Add new fields at the end with defaults; never reorder or retype (rolling upgrades).
    """

    kind: LayoutKind
    dtype: str
    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    device: str = "cpu"
    tp_size: int = 1
    tp_rank: int = 0
    token_layout: str = "NHD"  # inside one K or V block: NHD (block_size, H, D) or HND (H, block_size, D)
    total_kv_heads: int = 0  # the model's KV heads; 0 means num_kv_heads * tp_size (no replication)
    # "" = kvconnect's own blocks (K and V halves, `token_layout` inside each). Otherwise an engine's page
    # format (e.g. "vllm:cpu-vec"): one layer's block is an opaque page, moved whole or, when heads are its
    # outer dimension (token_layout HND), as a run of heads; its regions are (num_blocks, bytes) uint8 views.
    page: str = ""
    # a Mamba2 hybrid's state layers over the model (`state.py`), when the engine lays them out as kvconnect can
    # split between ranks of different TP sizes; None: state pages (if any) move whole, between equal TP only
    state: StateSpec | None = None

    def __post_init__(self) -> None:
        problems = []
        if self.dtype not in DTYPE_BYTES:
            problems.append(f"dtype {self.dtype!r} is not one of {sorted(DTYPE_BYTES)}")
        for name in ("num_layers", "num_blocks", "block_size", "num_kv_heads", "head_dim", "tp_size"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                problems.append(f"{name} must be a positive integer, got {value!r}")
        if self.device not in DEVICE_KINDS:
            problems.append(f"device must be one of {DEVICE_KINDS}, got {self.device!r}")
        if type(self.tp_rank) is not int or not 0 <= self.tp_rank < max(int(self.tp_size), 1):
            problems.append(f"tp_rank must lie in [0, tp_size), got {self.tp_rank!r}")
        if self.token_layout not in TOKEN_LAYOUTS:
            problems.append(f"token_layout {self.token_layout!r} is not one of {TOKEN_LAYOUTS}")
        if self.page and self.kind is LayoutKind.KV_FIRST:
            problems.append("an engine page format needs a blocks_first or cross_layer kind (K and V share a page)")
        if type(self.total_kv_heads) is not int or self.total_kv_heads < 0:
            problems.append(f"total_kv_heads must be a non-negative integer, got {self.total_kv_heads!r}")
        elif not problems:
            total, tp = self.model_kv_heads, self.tp_size
            if tp_problem(total, tp):
                problems.append(tp_problem(total, tp))
            elif self.num_kv_heads != max(total // tp, 1):
                problems.append(
                    f"num_kv_heads {self.num_kv_heads} != {max(total // tp, 1)}, the heads per rank "
                    f"of {total} KV heads over tp_size {tp}"
                )
        if self.state is not None and not problems:
            if not holds_state(self.page):
                problems.append(f"a state spec needs pages that hold state, not {self.page!r}")
            elif self.state.tp_problem(self.tp_size):
                problems.append(self.state.tp_problem(self.tp_size))
            elif self.state.block_bytes(self.tp_size) > self.block_stride_bytes:
                problems.append(
                    f"the state's {self.state.block_bytes(self.tp_size)} bytes per block exceed the "
                    f"{self.block_stride_bytes}-byte page"
                )
        if problems:
            raise LayoutError("invalid cache spec: " + "; ".join(problems))

    # --- heads -------------------------------------------------------------------------------------

    @property
    def model_kv_heads(self) -> int:
        return self.total_kv_heads or self.num_kv_heads * self.tp_size

    @property
    def head_replication(self) -> int:
        """How many ranks hold the same heads (1 unless tp_size exceeds the KV heads)."""
        return max(self.tp_size // self.model_kv_heads, 1)

    def head_range(self) -> tuple[int, int]:
        """The global KV heads [start, stop) this rank holds."""
        return rank_heads(self.model_kv_heads, self.tp_size, self.tp_rank)

    # --- byte math ---------------------------------------------------------------------------------

    @property
    def itemsize(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def half_bytes(self) -> int:
        """One K (or V) block of one layer."""
        return self.block_size * self.num_kv_heads * self.head_dim * self.itemsize

    @property
    def layer_block_bytes(self) -> int:
        """K and V of one block of one layer."""
        return 2 * self.half_bytes

    @property
    def block_bytes(self) -> int:
        """K and V of one block across all layers: what a request moves per block."""
        return self.num_layers * self.layer_block_bytes

    @property
    def num_regions(self) -> int:
        return 1 if self.kind is LayoutKind.CROSS_LAYER else self.num_layers

    @property
    def region_bytes(self) -> int:
        if self.kind is LayoutKind.CROSS_LAYER:
            return self.num_blocks * self.block_bytes
        return self.num_blocks * self.layer_block_bytes

    @property
    def cache_bytes(self) -> int:
        return self.num_regions * self.region_bytes

    @property
    def block_stride_bytes(self) -> int:
        """Distance between block b and block b+1 inside one region."""
        return {
            LayoutKind.BLOCKS_FIRST: self.layer_block_bytes,
            LayoutKind.KV_FIRST: self.half_bytes,
            LayoutKind.CROSS_LAYER: self.block_bytes,
        }[self.kind]

    @property
    def head_page_bytes(self) -> int:
        """One head's share of one layer's block: the unit of a head run inside an HND page."""
        return self.layer_block_bytes // self.num_kv_heads

    @property
    def torch_dtype_name(self) -> str:
        """The element type of the registered tensors (bytes for an engine's opaque pages)."""
        return "uint8" if self.page else self.dtype

    @property
    def natural_granularity(self) -> Granularity:
        return NATURAL_GRANULARITY[self.kind]

    def region_shape(self) -> tuple[int, ...]:
        """Shape of one registered tensor (an engine's pages: (num_blocks, bytes) of uint8)."""
        if self.page:
            return (self.num_blocks, self.region_bytes // self.num_blocks)
        tail = (self.block_size, self.num_kv_heads, self.head_dim)
        if self.token_layout == "HND":
            tail = (self.num_kv_heads, self.block_size, self.head_dim)
        if self.kind is LayoutKind.BLOCKS_FIRST:
            return (self.num_blocks, 2, *tail)
        if self.kind is LayoutKind.KV_FIRST:
            return (2, self.num_blocks, *tail)
        return (self.num_blocks, self.num_layers, 2, *tail)

    def region_strides(self) -> tuple[int, ...]:
        """Contiguous (row-major) element strides of one registered tensor."""
        shape = self.region_shape()
        strides = [1] * len(shape)
        for i in range(len(shape) - 2, -1, -1):
            strides[i] = strides[i + 1] * shape[i + 1]
        return tuple(strides)

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)


@dataclass(frozen=True)
class UnitTable:
    """Where each transfer unit of a block lies: unit u of block b starts at
    `base_addrs[region[u]] + offset_bytes[u] + b * block_stride_bytes` and spans `unit_bytes` (or `sizes[u]`)."""

    granularity: Granularity
    region: np.ndarray  # (U,) int64
    offset_bytes: np.ndarray  # (U,) int64
    unit_bytes: int  # every unit's size; with `sizes`, the largest
    block_stride_bytes: int
    sizes: np.ndarray | None = None  # (U,) int64 when units differ in size (a Mamba state's runs: state.py)

    @property
    def num_units(self) -> int:
        return int(self.region.shape[0])

    @property
    def unit_sizes(self) -> np.ndarray:
        """(U,) int64: each unit's bytes."""
        if self.sizes is not None:
            return self.sizes
        return np.full(self.num_units, self.unit_bytes, dtype=np.int64)


def unit_table(spec: CacheSpec, granularity: Granularity) -> UnitTable:
    """The unit table of `spec` at `granularity`; unit u means the same (layer, K/V) on every layout."""
    if granularity is Granularity.CHUNK:
        raise LayoutError("CHUNK unit tables depend on the pair: build them with hetero.chunk_tables")
    if granularity is Granularity.HALF and spec.page:
        raise LayoutError(f"{spec.page} pages hold K and V together: they cannot be split into halves")
    if granularity < spec.natural_granularity:
        raise LayoutError(
            f"{spec.kind.value} is not contiguous at {granularity.name} granularity "
            f"(its coarsest is {spec.natural_granularity.name})"
        )
    num_layers, half = spec.num_layers, spec.half_bytes
    layers = np.arange(num_layers, dtype=np.int64)
    if granularity is Granularity.BLOCK:
        return UnitTable(
            granularity, np.zeros(1, np.int64), np.zeros(1, np.int64), spec.block_bytes, spec.block_stride_bytes
        )
    if granularity is Granularity.LAYER:
        if spec.kind is LayoutKind.CROSS_LAYER:
            region, offset = np.zeros(num_layers, np.int64), layers * 2 * half
        else:  # blocks_first
            region, offset = layers, np.zeros(num_layers, np.int64)
        return UnitTable(granularity, region, offset, 2 * half, spec.block_stride_bytes)
    # HALF: unit u = 2 * layer + kv
    kv = np.tile(np.arange(2, dtype=np.int64), num_layers)
    layer_of_unit = np.repeat(layers, 2)
    if spec.kind is LayoutKind.CROSS_LAYER:
        region, offset = np.zeros(2 * num_layers, np.int64), (2 * layer_of_unit + kv) * half
    elif spec.kind is LayoutKind.BLOCKS_FIRST:
        region, offset = layer_of_unit, kv * half
    else:  # kv_first
        region, offset = layer_of_unit, kv * spec.num_blocks * half
    return UnitTable(granularity, region, offset, half, spec.block_stride_bytes)


def holds_state(page: str) -> bool:
    """Whether an engine page format names state beside K and V (a Mamba hybrid's pages: "...+state(...)")."""
    return "+state(" in page


def pair_granularity(local: CacheSpec, remote: CacheSpec) -> Granularity:
    """The coarsest unit both layouts hold contiguously."""
    return max(local.natural_granularity, remote.natural_granularity)


def check_compatible(local: CacheSpec, remote: CacheSpec) -> None:
    """Raise LayoutMismatchError naming every field that makes the two caches hold different models."""
    mismatched = {
        name: (getattr(local, name), getattr(remote, name))
        for name in _MUST_MATCH
        if getattr(local, name) != getattr(remote, name)
    }
    if "page" in mismatched and local.state is not None and local.state == remote.state:
        if local.page.split("+state(")[0] == remote.page.split("+state(")[0]:
            del mismatched["page"]  # (its state shapes are the rank's: the state specs, equal, are the model's)
    if local.state is not None and remote.state is not None and local.state != remote.state:
        mismatched["state"] = (local.state, remote.state)
    if mismatched:
        why = "the two workers do not serve the same model shape"
        if "page" in mismatched and holds_state(local.page) and holds_state(remote.page):
            undescribed = [side for side, spec in (("local", local), ("remote", remote)) if spec.state is None]
            if local.tp_size != remote.tp_size and undescribed:
                why = (
                    "pages that hold Mamba / linear-attention state differ between tensor-parallel sizes: kvconnect "
                    f"splits a Mamba2 state only, and the {' and '.join(undescribed)} worker does not describe it"
                )
            else:
                why += (
                    " (or lay out its Mamba state differently: vLLM's VLLM_SSM_CONV_STATE_LAYOUT, SD or DS, must match)"
                )
        raise LayoutMismatchError(mismatched, why)


def same_block_shape(local: CacheSpec, remote: CacheSpec) -> bool:
    """True when a block means the same bytes on both sides: same heads, block size and token order."""
    if local.head_range() != remote.head_range() or local.block_size != remote.block_size:
        return False
    if local.page or remote.page:
        return local.page == remote.page and local.token_layout == remote.token_layout
    return local.token_layout == remote.token_layout or local.num_kv_heads == 1 or local.block_size == 1
