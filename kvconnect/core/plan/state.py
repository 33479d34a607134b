"""A Mamba2 state layer's geometry over the model, and what moves of it between ranks of different TP sizes
(pure, numpy).

One state block of one layer (vLLM lays it from the start of the block's page) holds, on a rank of `tp`:

- the convolution state: the last `conv_len` inputs of `conv_dim` channels, `[x | B | C]`, where the rank holds
  x channels `[r, r + 1) * channels / tp` and groups `[r, r + 1) * groups / tp` of B and of C (`group_size`
  channels each); a model with one group keeps it whole on every rank (vLLM's replication when the groups do not
  divide among the ranks). Laid out `SD` (conv_len, conv_dim) or `DS` (conv_dim, conv_len);
- then the SSM state: heads `[r, r + 1) * heads / tp`, `head_bytes` each, heads outermost.

Between two ranks of different TP sizes, what the local rank needs of the remote one is the overlap of their
x channels, groups and heads: a run per overlap (per conv row when SD), each at its own offset on both sides.
"""

from __future__ import annotations

import msgspec

from kvconnect.core.errors import LayoutError

CONV_LAYOUTS = ("SD", "DS")


def _share(total: int, tp: int, rank: int) -> tuple[int, int]:
    per = total // tp
    return rank * per, (rank + 1) * per


class StateSpec(msgspec.Struct, frozen=True):
    """A Mamba2 state layer over the model (not the rank); travels in the handshake inside `CacheSpec.state`.

    Add new fields at the end with defaults; never reorder or retype (rolling upgrades)."""

    kind: str  # "mamba2"
    conv_layout: str  # SD: (conv_len, conv_dim); DS: (conv_dim, conv_len)
    conv_len: int  # the conv kernel less one
    channels: int  # x channels over the model (Mamba2: heads x head_dim)
    groups: int  # B and C groups over the model
    group_size: int  # channels per group (the SSM state size)
    heads: int  # SSM heads over the model
    head_bytes: int  # one head's SSM state (head_dim x state size x itemsize)
    conv_itemsize: int

    def __post_init__(self) -> None:
        problems = []
        if self.kind != "mamba2":
            problems.append(f"kind {self.kind!r} is not 'mamba2'")
        if self.conv_layout not in CONV_LAYOUTS:
            problems.append(f"conv_layout {self.conv_layout!r} is not one of {CONV_LAYOUTS}")
        for name in ("conv_len", "channels", "groups", "group_size", "heads", "head_bytes", "conv_itemsize"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                problems.append(f"{name} must be a positive integer, got {value!r}")
        if problems:
            raise LayoutError("invalid state spec: " + "; ".join(problems))

    def tp_problem(self, tp: int) -> str:
        """Why `tp` ranks cannot share this state evenly ("" when they can)."""
        if self.channels % tp or self.heads % tp:
            return f"tp_size {tp} does not divide the state's {self.channels} channels and {self.heads} heads"
        if self.groups % tp and self.groups != 1:
            return f"tp_size {tp} does not divide the state's {self.groups} groups (only one group is replicated)"
        return ""

    def groups_of(self, tp: int, rank: int) -> tuple[int, int]:
        """The groups [start, stop) rank `rank` of `tp` holds (one group: all of it, on every rank)."""
        return (0, 1) if self.groups % tp else _share(self.groups, tp, rank)

    def conv_dim(self, tp: int) -> int:
        lo, hi = self.groups_of(tp, 0)
        return self.channels // tp + 2 * (hi - lo) * self.group_size

    def conv_bytes(self, tp: int) -> int:
        return self.conv_len * self.conv_dim(tp) * self.conv_itemsize

    def block_bytes(self, tp: int) -> int:
        """One rank's state of one layer: conv, then SSM."""
        return self.conv_bytes(tp) + self.heads // tp * self.head_bytes

    def _segments(self, tp: int, rank: int) -> list[tuple[int, int, int]]:
        """(first global channel, count, first channel in the rank's conv_dim) of x, B and C on this rank."""
        x_lo, x_hi = _share(self.channels, tp, rank)
        g_lo, g_hi = self.groups_of(tp, rank)
        x_n, g_n = x_hi - x_lo, (g_hi - g_lo) * self.group_size
        start = g_lo * self.group_size
        return [(x_lo, x_n, 0), (start, g_n, x_n), (start, g_n, x_n + g_n)]

    def runs(self, local: tuple[int, int], remote: tuple[int, int]) -> list[tuple[int, int, int]]:
        """The (local offset, remote offset, bytes) runs of one block that local rank `local` (rank, tp) reads
        from remote rank `remote` (rank, tp): the x channels, groups and SSM heads both hold, conv first. Groups
        every remote rank holds (one group, replicated) are read from the remote rank that holds the local
        rank's first x channel only."""
        (l_rank, l_tp), (r_rank, r_tp) = local, remote
        isz, out = self.conv_itemsize, []
        l_dim, r_dim = self.conv_dim(l_tp), self.conv_dim(r_tp)
        replicated_elsewhere = self.groups % r_tp != 0 and r_rank != l_rank * r_tp // l_tp
        segments = zip(self._segments(l_tp, l_rank), self._segments(r_tp, r_rank), strict=True)
        for i, ((l_first, l_n, l_at), (r_first, r_n, r_at)) in enumerate(segments):
            lo, hi = max(l_first, r_first), min(l_first + l_n, r_first + r_n)
            if lo >= hi or (i and replicated_elsewhere):
                continue
            l_ch, r_ch, n = l_at + lo - l_first, r_at + lo - r_first, hi - lo
            if self.conv_layout == "DS":
                out.append((l_ch * self.conv_len * isz, r_ch * self.conv_len * isz, n * self.conv_len * isz))
                continue
            for t in range(self.conv_len):
                out.append(((t * l_dim + l_ch) * isz, (t * r_dim + r_ch) * isz, n * isz))
        l_heads, r_heads = _share(self.heads, l_tp, l_rank), _share(self.heads, r_tp, r_rank)
        lo, hi = max(l_heads[0], r_heads[0]), min(l_heads[1], r_heads[1])
        if lo < hi:
            out.append(
                (
                    self.conv_bytes(l_tp) + (lo - l_heads[0]) * self.head_bytes,
                    self.conv_bytes(r_tp) + (lo - r_heads[0]) * self.head_bytes,
                    (hi - lo) * self.head_bytes,
                )
            )
        return out
