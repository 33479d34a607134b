"""`kvconnect <command>` without the optional extra it needs: one line naming the extra, not a traceback."""

from __future__ import annotations

import importlib

import pytest

from kvconnect import cli


def test_a_missing_extra_is_named_in_one_line(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    real = importlib.import_module

    def without_starlette(name: str, *args: object) -> object:
        if name == "kvconnect.serving.proxy":
            raise ModuleNotFoundError("No module named 'starlette'", name="starlette")
        return real(name, *args)

    monkeypatch.setattr(cli.importlib, "import_module", without_starlette)
    assert cli.main(["proxy", "--port", "9"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == "kvconnect proxy: needs starlette, from the `serve` extra: pip install 'kvconnect[serve]'"


def test_a_missing_module_no_extra_brings_is_not_hidden(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.import_module

    def broken(name: str, *args: object) -> object:
        if name == "kvconnect.serving.proxy":
            raise ModuleNotFoundError("No module named 'kvconnect.serving.gone'", name="kvconnect.serving.gone")
        return real(name, *args)

    monkeypatch.setattr(cli.importlib, "import_module", broken)
    with pytest.raises(ModuleNotFoundError, match="gone"):
        cli.main(["proxy", "--port", "9"])
