"""Which vLLM this is, and which parts of the KV-connector API it has: the one place that knows.

The plug-in supports vLLM 0.26 through 0.33. Their `KVConnectorBase_V1` differ in a few hooks, and the
plug-in feature-detects them here instead of checking versions anywhere else:

- transfer results: 0.32 and later report a step's finished and failed transfers through
  `get_transfer_results` returning `KVConnectorTransferResults`; 0.26 calls `get_finished` (failed loads
  are reported among the finished ones and by `get_block_ids_with_load_errors`, in every version);
- cross-layer blocks: 0.26 asks `prefer_cross_layer_blocks` and may then call
  `register_cross_layers_kv_cache` with one tensor for every layer; later versions dropped both;
- sleep mode: 0.33 adds `supports_sleep_mode` / `unregister_kv_caches` / `restore_kv_caches` (the
  plug-in does not claim it: its NIXL registration would outlive the memory);
- the hybrid KV cache manager: where `SupportsHMA` exists the plug-in claims it (one block list per KV cache
  group, `request_finished_all_groups`), so vLLM keeps the manager on for hybrid models.

A vLLM outside the range is refused at start-up with one line naming its version and the range.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from types import ModuleType

from kvconnect.core.errors import ConfigError

SUPPORTED = ((0, 26), (0, 33))  # oldest and newest (major, minor) the plug-in was built against


def version_tuple(version: str) -> tuple[int, int] | None:
    """(major, minor) of a version string such as "0.32.0+cpu" or "0.26.0"; None if it has none."""
    m = re.match(r"\s*(\d+)\.(\d+)", version)
    return (int(m.group(1)), int(m.group(2))) if m else None


def check_version(version: str) -> None:
    """ConfigError (one line) unless `version` lies in the supported range."""
    got = version_tuple(version)
    (lo_major, lo_minor), (hi_major, hi_minor) = SUPPORTED
    if got is None or not SUPPORTED[0] <= got <= SUPPORTED[1]:
        raise ConfigError(
            f"kvconnect supports vLLM {lo_major}.{lo_minor} to {hi_major}.{hi_minor}; this is vLLM "
            f"{version or 'of unknown version'}"
        )


@dataclass(frozen=True)
class ConnectorApi:
    """What the installed `KVConnectorBase_V1` offers (from its names, not its version)."""

    transfer_results: bool  # get_transfer_results / KVConnectorTransferResults
    cross_layer_blocks: bool  # prefer_cross_layer_blocks / register_cross_layers_kv_cache
    sleep_mode: bool  # supports_sleep_mode / unregister_kv_caches / restore_kv_caches
    hma: bool = False  # SupportsHMA: the hybrid KV cache manager's request_finished_all_groups

    @classmethod
    def of(cls, module_names: set[str], base_names: set[str]) -> ConnectorApi:
        """From the names the `base` module and its `KVConnectorBase_V1` class define."""
        return cls(
            transfer_results="KVConnectorTransferResults" in module_names and "get_transfer_results" in base_names,
            cross_layer_blocks={"prefer_cross_layer_blocks", "register_cross_layers_kv_cache"} <= base_names,
            sleep_mode={"supports_sleep_mode", "unregister_kv_caches", "restore_kv_caches"} <= base_names,
            hma="SupportsHMA" in module_names,
        )


def detect(base: ModuleType) -> ConnectorApi:
    """The API of a loaded `vllm.distributed.kv_transfer.kv_connector.v1.base` module."""
    return ConnectorApi.of(set(vars(base)), set(dir(base.KVConnectorBase_V1)))


# hooks the plug-in defines only where the running vLLM has them: hook -> the ConnectorApi flag
OPTIONAL_HOOKS = {
    "get_transfer_results": "transfer_results",
    "prefer_cross_layer_blocks": "cross_layer_blocks",
    "register_cross_layers_kv_cache": "cross_layer_blocks",
    "request_finished_all_groups": "hma",  # (a method of SupportsHMA, not of KVConnectorBase_V1)
}


def hooks_of_source(source: str) -> tuple[set[str], dict[str, list[str]]]:
    """From the text of a vLLM `base.py` (parsed, never imported): the module's top-level class and
    function names, and each `KVConnectorBase_V1` method's parameter names. Lets the suite check the
    plug-in's hooks against a vLLM release that is not installed (its wheel's file, read as text)."""
    tree = ast.parse(source)
    names = {n.name for n in tree.body if isinstance(n, (ast.ClassDef, ast.FunctionDef))}
    hooks: dict[str, list[str]] = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == "KVConnectorBase_V1":
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    a = item.args
                    hooks[item.name] = [x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs)]
    return names, hooks
