"""`kvconnect <command>` without the optional extra it needs: one line naming the extra, not a traceback."""

from __future__ import annotations

import importlib

import pytest

from kvconnect import cli


def proxy_missing(monkeypatch: pytest.MonkeyPatch, module: str) -> None:
    """Make importing the proxy's subcommand module fail as if `module` were not installed."""
    real = importlib.import_module

    def importer(name: str, *args: object) -> object:
        if name == "kvconnect.serving.proxy":
            raise ModuleNotFoundError(f"No module named '{module}'", name=module)
        return real(name, *args)

    monkeypatch.setattr(cli.importlib, "import_module", importer)


def test_a_missing_extra_is_named_in_one_line(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    proxy_missing(monkeypatch, "starlette")
    assert cli.main(["proxy", "--port", "9"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == "kvconnect proxy: needs starlette, from the `serve` extra: pip install 'kvconnect[serve]'"


def test_a_missing_module_no_extra_brings_is_not_hidden(monkeypatch: pytest.MonkeyPatch) -> None:
    proxy_missing(monkeypatch, "kvconnect.serving.gone")
    with pytest.raises(ModuleNotFoundError, match="gone"):
        cli.main(["proxy", "--port", "9"])
