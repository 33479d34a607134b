"""UCX's protocol tables, read: which transport carried a READ (see `kvconnect.verdict`), and the verdict
struct that a calibration produces. Pure parsing, no I/O."""

from __future__ import annotations

import re

import msgspec

MiB = 2**20
NUM_DESCS = 4  # the scratch buffer is read as this many equal descriptors (NIXL merges adjacent ones)
_PREFIX = re.compile(r"^\s*(\[[^\]]*\]\s*){0,2}")  # UCX log line prefix: [timestamp] [host:pid:thread]
_TRANSPORT = re.compile(r"([A-Za-z][\w-]*)/\S+")  # "cma/memory", "rc_mlx5/mlx5_0:1"


class TransportVerdict(msgspec.Struct, kw_only=True, frozen=True):
    """One calibration: NIXL READ throughput, the copy ceiling, and the UCX transport(s) of the READ."""

    gbps: float  # median over the timed READs
    ceiling_gbps: float  # median torch copy of the same bytes, peer device -> device
    ratio: float  # gbps / ceiling_gbps
    transport: str  # "cma", "tcp", "cuda_ipc", "rc_mlx5+cma", ... or "unknown"
    transports: tuple[str, ...] = ()
    ucx_config: tuple[str, ...] = ()  # UCX's Config cells for the READ, e.g. ("cma/memory",)
    protocol: str = ""  # UCX's description, e.g. "zero-copy" or "software emulation"
    mem_kind: str = "DRAM"  # of the reading side
    device: str = "cpu"
    peer_device: str = "cpu"
    bytes: int = 0
    num_descs: int = NUM_DESCS
    reps: int = 0
    ceiling_kind: str = ""
    duration_s: float = 0.0  # the whole calibration, process start-up included

    @property
    def is_tcp(self) -> bool:
        return any(t.startswith("tcp") for t in self.transports)

    def summary(self) -> str:
        return (
            f"transport verdict: {self.gbps:.1f} GB/s of {self.ceiling_gbps:.1f} GB/s ceiling "
            f"({100 * self.ratio:.0f} %) over {self.transport} ({self.mem_kind}, {self.bytes / MiB:.0f} MiB, "
            f"{self.protocol or 'protocol unknown'}, {self.duration_s:.1f} s)"
        )


class ProtoUse(msgspec.Struct, frozen=True):
    """One row of a UCX protocol table."""

    operation: str  # "remote memory read by ucp_get*(multi) into host memory from host"
    count: int | None  # None where the table has no Count column (UCX_PROTO_INFO=y)
    range: str
    description: str
    config: str


# --- UCX protocol tables ----------------------------------------------------------------------------


def parse_proto_tables(text: str) -> list[ProtoUse]:
    """Every data row of every UCX protocol table in `text` (UCX log lines; anything else is skipped)."""
    rows: list[ProtoUse] = []
    operation, header = "", None
    for raw in text.splitlines():
        line = _PREFIX.sub("", raw).strip()
        if not line.startswith("|"):
            if not line.startswith("+"):  # not a table line: any table has ended
                operation, header = "", None
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 1:  # a table's title rows: "<context> <ep kind> cfg#N", then the operation
            operation, header = (cells[0], None) if " by " in cells[0] else ("", None)
        elif header is None:
            header = [c.lower() for c in cells]
        elif operation:
            row = dict(zip(header, cells, strict=False))
            count = row.get("count", "")
            rows.append(
                ProtoUse(
                    operation,
                    int(count) if count.isdigit() else None,
                    row.get("range", ""),
                    row.get("description", ""),
                    row.get("config", ""),
                )
            )
    return rows


def read_transports(rows: list[ProtoUse]) -> tuple[tuple[str, ...], tuple[str, ...], str]:
    """(transports, config cells, descriptions) of the rows for remote reads (ucp_get), most used first."""
    used = [r for r in rows if "remote memory read" in r.operation and r.count != 0]
    used.sort(key=lambda r: -(r.count or 0))
    transports = [m for r in used for m in _TRANSPORT.findall(r.config)]
    configs = [r.config for r in used]
    descriptions = [r.description for r in used]
    return tuple(dict.fromkeys(transports)), tuple(dict.fromkeys(configs)), ", ".join(dict.fromkeys(descriptions))


def remote_memory_lines(text: str) -> list[str]:
    """UCX's protocol lines for remote memory (READ by ucp_get*, WRITE by ucp_put*) in one log, each once and in
    order: "<operation> | <range> | <how> | <lanes>". Needs the process to have run with `UCX_PROTO_INFO=y`."""
    rows = [r for r in parse_proto_tables(text) if "remote memory" in r.operation]
    return list(dict.fromkeys(f"{r.operation} | {r.range} | {r.description} | {r.config}" for r in rows))


def format_byte_paths(paths: dict[str, list[str]]) -> str:
    """`remote_memory_lines` of several logs as text: one "<log>: <line>" per line; a log without any says so."""
    out = [f"{name}: {line}" for name, lines in paths.items() for line in lines]
    out += [
        f"{name}: no remote-memory protocol line (UCX_PROTO_INFO unset, or no transfer)"
        for name, lines in paths.items()
        if not lines
    ]
    return "\n".join(out)
