"""`kvconnect bench` flags: argument types that name what is allowed, and the options they build."""

from __future__ import annotations

import argparse
import logging
import re

from kvconnect.bench.report import BenchOptions, Geometry
from kvconnect.core.errors import ConfigError
from kvconnect.core.plan.hetero import PATHS as HETERO_PATHS
from kvconnect.core.plan.layout import DTYPE_BYTES, TOKEN_LAYOUTS, LayoutKind, tp_problem

log = logging.getLogger(__name__)

# (num_layers, num_kv_heads, head_dim)
PRESETS = {
    "llama-3-8b": (32, 8, 128),
    "llama-3-70b": (80, 8, 128),
    "small": (4, 2, 64),  # 32 KiB per 16-token block: CI-sized
}
LAYOUTS = [k.value for k in LayoutKind]
SAME_PAIRS = [(k, k) for k in ("kv_first", "blocks_first", "cross_layer")]
TRANSPORTS = ("nixl", "ipc", "auto")
_ENV_NAME = re.compile(r"^UCX_[A-Z0-9_]+$")
_DEVICE = re.compile(r"^(cpu|cuda(:\d+)?)$")


# --- argument types (each raises ArgumentTypeError with a message naming what is allowed) ----------


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _non_negative_int(text: str) -> int:
    return 0 if text.strip() == "0" else _positive_int(text)


def parse_tokens(text: str) -> list[int]:
    """`4096`, `256,1024,4096`, or `256..4096` (doubling)."""
    out: list[int] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        if ".." in part:
            lo_text, hi_text = part.split("..", 1)
            lo, hi = _positive_int(lo_text), _positive_int(hi_text)
            if hi < lo:
                raise argparse.ArgumentTypeError(f"range {part!r} runs backwards")
            while lo <= hi:
                out.append(lo)
                lo *= 2
        else:
            out.append(_positive_int(part))
    if not out:
        raise argparse.ArgumentTypeError("no token counts given")
    return out


def parse_layout_pairs(text: str) -> list[tuple[str, str]]:
    """`PREFILL:DECODE[,...]`; a bare layout means the same on both sides; `same`, `all`."""
    out: list[tuple[str, str]] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        if part == "same":
            out += SAME_PAIRS
        elif part == "all":
            out += [(a, b) for a in LAYOUTS for b in LAYOUTS]
        else:
            sides = part.split(":")
            if len(sides) == 1:
                sides = sides * 2
            bad = [s for s in sides if s not in LAYOUTS]
            if len(sides) != 2 or bad:
                raise argparse.ArgumentTypeError(
                    f"bad layout pair {part!r}: expected PREFILL:DECODE with layouts from "
                    f"{', '.join(LAYOUTS)} (or 'same', 'all')"
                )
            out.append((sides[0], sides[1]))
    if not out:
        raise argparse.ArgumentTypeError("no layout pairs given")
    return list(dict.fromkeys(out))


def parse_patterns(text: str) -> list[str]:
    """`contiguous`, `scattered`, `runs:K`, comma-separated for a sweep."""
    out: list[str] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        m = re.fullmatch(r"runs:(\d+)", part)
        if part in ("contiguous", "scattered"):
            out.append(part)
        elif m and int(m.group(1)) >= 1:
            out.append("scattered" if int(m.group(1)) == 1 else part)
        else:
            raise argparse.ArgumentTypeError(
                f"bad pattern {part!r}: expected contiguous, scattered or runs:K with K >= 1"
            )
    if not out:
        raise argparse.ArgumentTypeError("no pattern given")
    return list(dict.fromkeys(out))


def parse_transports(text: str) -> list[str]:
    out = [p.strip() for p in text.split(",") if p.strip()]
    bad = [p for p in out if p not in TRANSPORTS]
    if bad or not out:
        raise argparse.ArgumentTypeError(f"bad transport {','.join(bad) or text!r}: expected {', '.join(TRANSPORTS)}")
    return list(dict.fromkeys(out))


def parse_tp_pairs(text: str) -> list[tuple[int, int]]:
    """`P:D[,...]` prefill:decode TP sizes; a bare `N` means N on both sides."""
    out: list[tuple[int, int]] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        sides = part.split(":")
        sides = sides * 2 if len(sides) == 1 else sides
        try:
            sizes = [_positive_int(side) for side in sides]
        except argparse.ArgumentTypeError:
            sizes = []
        if len(sides) != 2 or len(sizes) != 2:
            raise argparse.ArgumentTypeError(f"bad TP pair {part!r}: expected PREFILL:DECODE TP sizes, e.g. 2:1")
        out.append((sizes[0], sizes[1]))
    if not out:
        raise argparse.ArgumentTypeError("no TP pairs given")
    return list(dict.fromkeys(out))


def parse_token_layouts(text: str) -> list[tuple[str, str]]:
    """`P:D[,...]` prefill:decode token layouts inside a block (NHD, HND); a bare one means both sides."""
    out: list[tuple[str, str]] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        sides = [side.upper() for side in part.split(":")]
        sides = sides * 2 if len(sides) == 1 else sides
        if len(sides) != 2 or any(side not in TOKEN_LAYOUTS for side in sides):
            raise argparse.ArgumentTypeError(
                f"bad token layout pair {part!r}: expected PREFILL:DECODE from {', '.join(TOKEN_LAYOUTS)}"
            )
        out.append((sides[0], sides[1]))
    if not out:
        raise argparse.ArgumentTypeError("no token layouts given")
    return list(dict.fromkeys(out))


def parse_hetero_paths(text: str) -> list[str]:
    out = [p.strip() for p in text.split(",") if p.strip()]
    bad = [p for p in out if p not in HETERO_PATHS]
    if bad or not out:
        raise argparse.ArgumentTypeError(
            f"bad hetero path {','.join(bad) or text!r}: expected {', '.join(HETERO_PATHS)}"
        )
    return list(dict.fromkeys(out))


def parse_merges(text: str) -> list[bool]:
    words, out = {"on": True, "off": False}, [p.strip() for p in text.split(",") if p.strip()]
    if (bad := [p for p in out if p not in words]) or not out:
        raise argparse.ArgumentTypeError(f"bad --merge {','.join(bad) or text!r}: expected on, off or on,off")
    return list(dict.fromkeys(words[p] for p in out))


def parse_ucx(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not _ENV_NAME.match(key):
        raise argparse.ArgumentTypeError(f"bad --ucx {text!r}: expected UCX_NAME=VALUE, e.g. UCX_TLS=tcp,cma,self")
    return key, value


def parse_device(text: str) -> str:
    if not _DEVICE.match(text):
        raise argparse.ArgumentTypeError(f"bad device {text!r}: expected cpu, cuda or cuda:N")
    return "cuda:0" if text == "cuda" else text


def _cache_factor(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value >= 1.0:
        raise argparse.ArgumentTypeError(f"must be >= 1.0, got {value}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("geometry")
    g.add_argument(
        "--model",
        choices=sorted(PRESETS),
        default=None,
        help="geometry preset (default llama-3-8b unless all three of the flags below are given)",
    )
    g.add_argument("--num-layers", type=_positive_int)
    g.add_argument(
        "--num-kv-heads",
        type=_positive_int,
        help="the model's KV heads (each TP rank holds heads/tp, or one copy when tp > heads)",
    )
    g.add_argument("--head-dim", type=_positive_int)
    g.add_argument("--dtype", choices=sorted(DTYPE_BYTES), default="bfloat16")
    g.add_argument("--block-size", type=_positive_int, default=16, help="tokens per paged block (prefill side)")
    h = parser.add_argument_group(
        "heterogeneous pairs (the bench is decode rank 0, reading each prefill rank it needs from its own process)"
    )
    h.add_argument(
        "--tp",
        type=parse_tp_pairs,
        default=None,
        metavar="P:D[,P:D...]",
        help="prefill:decode tensor-parallel sizes, comma-separated to compare (default 1:1)",
    )
    h.add_argument(
        "--decode-block-size",
        type=_positive_int,
        default=None,
        help="tokens per block on the decode side (default: --block-size)",
    )
    h.add_argument(
        "--token-layouts",
        type=parse_token_layouts,
        default=None,
        metavar="P:D[,P:D...]",
        help="prefill:decode token layout inside a block, NHD or HND (default NHD:NHD)",
    )
    h.add_argument(
        "--hetero-path",
        type=parse_hetero_paths,
        default=None,
        metavar="PATH[,PATH...]",
        help="decode side's hetero_path: auto (default), direct, staging; comma-separated to compare "
        "(pairs where the choice changes nothing run once); staging is sized per case",
    )
    w = parser.add_argument_group("workload")
    w.add_argument(
        "--tokens",
        type=parse_tokens,
        default=None,
        nargs="+",
        help="request length(s) (default 4096): 4096, 256,1024 or 256..4096 (doubling); several make a sweep",
    )
    w.add_argument(
        "--layouts",
        type=parse_layout_pairs,
        default=None,
        help="PREFILL:DECODE pairs, comma-separated, e.g. "
        "kv_first:kv_first,blocks_first:cross_layer; a bare layout means both sides; "
        "'same' (default) or 'all' (nine pairs)",
    )
    w.add_argument(
        "--pattern",
        type=parse_patterns,
        default=None,
        help="block ids: contiguous, scattered (default) or runs:K; comma-separated for a sweep",
    )
    w.add_argument(
        "--cache-factor",
        type=_cache_factor,
        default=1.25,
        help="each side's cache holds this many times the request's blocks (ids drawn from it)",
    )
    w.add_argument("--reps", type=_positive_int, default=5, help="timed pulls per case")
    w.add_argument(
        "--warmup", type=_non_negative_int, default=1, help="untimed pulls per case after the first-contact pull"
    )
    w.add_argument("--seed", type=int, default=0)
    w.add_argument(
        "--shuffle",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="run the cases in an order drawn from --seed (so runs with different seeds take different orders)",
    )
    m = parser.add_argument_group("memory and transport")
    m.add_argument("--prefill-device", type=parse_device, default="cpu", help="cpu (DRAM) or cuda:N (VRAM)")
    m.add_argument("--decode-device", type=parse_device, default="cpu", help="cpu (DRAM) or cuda:N (VRAM)")
    m.add_argument(
        "--transport",
        type=parse_transports,
        default=["nixl"],
        help="nixl (default), ipc (same-host GPU gather kernel) or auto; comma-separated to compare",
    )
    m.add_argument(
        "--ucx",
        type=parse_ucx,
        action="append",
        default=[],
        metavar="UCX_KEY=VAL",
        help="exported to both processes before NIXL loads (repeatable)",
    )
    m.add_argument(
        "--nixl-threads", type=_non_negative_int, default=0, help="UCX thread pool per agent (each pull split over it)"
    )
    m.add_argument(
        "--confirm",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="lease confirmation round trip before blocks count as usable (default on)",
    )
    m.add_argument("--pull-timeout", type=float, default=60.0, help="seconds per pull")
    m.add_argument(
        "--merge",
        type=parse_merges,
        default=[True],
        help="NIXL's merging of descriptors adjacent on both sides: on (default), off, or on,off to compare "
        "(off issues every block's units apart: what merging saves, on the same ids)",
    )
    m.add_argument("--telemetry", action="store_true", help="NIXL's telemetry: the 'issued' column (what it issued)")
    o = parser.add_argument_group("output")
    o.add_argument("--json", metavar="PATH", help="write every figure and the environment as JSON")
    o.add_argument("--plot", metavar="PATH", help="write a PNG: GB/s and %% of ceiling vs bytes per descriptor")
    o.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="progress bar on stderr (default: when stderr is a terminal)",
    )


def geometry_from_args(args: argparse.Namespace) -> Geometry:
    explicit = {"num_layers": args.num_layers, "num_kv_heads": args.num_kv_heads, "head_dim": args.head_dim}
    given = {k: v for k, v in explicit.items() if v is not None}
    if args.model is None and given and len(given) < 3:
        missing = ", ".join("--" + k.replace("_", "-") for k in explicit if k not in given)
        raise ConfigError(f"give --model, or all of --num-layers/--num-kv-heads/--head-dim (missing {missing})")
    model = args.model or ("custom" if given else "llama-3-8b")
    layers, heads, dim = PRESETS.get(model, (0, 0, 0))
    if args.model and given:
        model += " (" + ", ".join(f"{k}={v}" for k, v in given.items()) + ")"
    return Geometry(
        model=model,
        num_layers=given.get("num_layers", layers),
        num_kv_heads=given.get("num_kv_heads", heads),
        head_dim=given.get("head_dim", dim),
        dtype=args.dtype,
        block_size=args.block_size,
        decode_block_size=0 if args.decode_block_size in (None, args.block_size) else args.decode_block_size,
    )


def check_tp_pairs(pairs: list[tuple[int, int]], model_kv_heads: int) -> None:
    """ConfigError naming each TP size that cannot split the model's KV heads."""
    problems = [
        f"{side} {problem}"
        for pair in pairs
        for side, tp in zip(("prefill", "decode"), pair, strict=True)
        if (problem := tp_problem(model_kv_heads, tp))
    ]
    if problems:
        raise ConfigError("--tp: " + "; ".join(dict.fromkeys(problems)))


def options_from_args(args: argparse.Namespace) -> BenchOptions:
    flat = [t for item in (args.tokens or [[4096]]) for t in item]
    devices = {args.prefill_device.split(":")[0], args.decode_device.split(":")[0]}
    if "ipc" in args.transport and devices != {"cuda"}:
        raise ConfigError("--transport ipc needs both sides on cuda devices")
    if "cuda" in devices:
        import torch

        if not torch.cuda.is_available():
            raise ConfigError("a cuda device was asked for but torch sees no CUDA device")
        count = torch.cuda.device_count()
        for dev in (args.prefill_device, args.decode_device):
            if dev.startswith("cuda") and int(dev.split(":")[1]) >= count:
                raise ConfigError(f"device {dev} does not exist (torch sees {count} CUDA devices)")
    geometry = geometry_from_args(args)
    tp_pairs = args.tp or [(1, 1)]
    check_tp_pairs(tp_pairs, geometry.num_kv_heads)
    return BenchOptions(
        geometry=geometry,
        tokens=list(dict.fromkeys(flat)),
        layout_pairs=args.layouts or SAME_PAIRS,
        patterns=args.pattern or ["scattered"],
        transports=args.transport,
        reps=args.reps,
        warmup=args.warmup,
        seed=args.seed,
        cache_factor=args.cache_factor,
        prefill_device=args.prefill_device,
        decode_device=args.decode_device,
        ucx_env=dict(args.ucx),
        nixl_threads=args.nixl_threads,
        confirm=args.confirm,
        pull_timeout_s=args.pull_timeout,
        progress=args.progress,
        tp_pairs=tp_pairs,
        token_layouts=args.token_layouts or [("NHD", "NHD")],
        hetero_paths=args.hetero_path or ["auto"],
        merges=args.merge,
        shuffle=args.shuffle,
        telemetry=args.telemetry,
    )
