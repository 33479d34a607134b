"""`kvconnect` command line: one subcommand per module, imported only when chosen.

Each subcommand module exposes `add_arguments(parser)` and `run(args) -> int`. Flags default to the
matching `KVCONNECT_*` environment variable where one exists (see config.py).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys

from kvconnect.core.config import env_setting

SUBCOMMANDS = {
    "serve": ("kvconnect.serving.server", "run an OpenAI-compatible prefill, decode or aggregated worker"),
    "proxy": ("kvconnect.serving.proxy", "run the llm-d style prefill/decode proxy"),
    "demo": ("kvconnect.serving.demo", "start a local prefill+decode+proxy and check disagg == agg"),
    "bench": ("kvconnect.bench.run", "KV-shaped transfer benchmark against a same-run copy ceiling"),
    "bench-vllm": ("kvconnect.bench.vllm_pd", "vLLM P/D head-to-head: vLLM's NixlConnector vs kvconnect's"),
    "verdict": ("kvconnect.bench.verdict", "time a NIXL READ against a copy and name the UCX transport (JSON)"),
}


def build_parser(argv: list[str]) -> tuple[argparse.ArgumentParser, str | None]:
    parser = argparse.ArgumentParser(prog="kvconnect", description=__doc__.splitlines()[0])
    parser.add_argument("--log-level", default=env_setting("LOG_LEVEL", "INFO"))
    sub = parser.add_subparsers(dest="command", required=True)
    chosen = next((a for a in argv if a in SUBCOMMANDS), None)
    for name, (module, help_text) in SUBCOMMANDS.items():
        sp = sub.add_parser(name, help=help_text)
        if name == chosen:
            importlib.import_module(module).add_arguments(sp)
    return parser, chosen


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser, chosen = build_parser(argv)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, str(args.log_level).upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    assert chosen is not None
    return int(importlib.import_module(SUBCOMMANDS[chosen][0]).run(args) or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
