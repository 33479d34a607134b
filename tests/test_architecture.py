"""The package's shape: rooms import only downwards, no import cycles (TYPE_CHECKING ones included), the
public API is declared, and modules stay small.

Rooms and what each may import (besides itself and third-party libraries):

    kvconnect (the public API)  -> core
    core (and core/transports)  -> (nothing of ours)
    engine                      -> core
    verdict                     -> core (the start-up transport probe)
    vllm                        -> core, the public API
    harness                     -> core, vllm (its layout description), the public API
    bench                       -> core, harness, the public API
    serving                     -> core, engine, verdict, harness, the public API
    cli                         -> anything
Nothing in the package (or scripts/) imports tests.

Inside core, sub-rooms follow a request (`CORE_ALLOWED`): errors <- plan (pure: no I/O library) <- wire <-
core's own top-level modules (config, agent, cache, digest, ...) <- transports <- prefill | decode <- the
connector and its loop. The prefill and decode halves never import each other. Each transport owns both halves of
its transfer (its module defines its `start`, prefill half, and its `open`, decode half), so the decode half knows
no NIXL detail; the prefill half owns its state (the lease table, its parts and the board writer are built and
reached only from `prefill/`), and the connector only composes.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "kvconnect"
MAX_LINES = 400

ALLOWED = {
    "api": {"core"},
    "core": set(),
    "engine": {"core"},
    "verdict": {"core"},
    "vllm": {"core", "api"},
    "harness": {"core", "vllm", "api"},
    "bench": {"core", "harness", "api"},
    "serving": {"core", "engine", "verdict", "harness", "api"},
    "cli": {"core", "engine", "verdict", "vllm", "harness", "bench", "serving", "api"},
}


CORE_ROOMS = ("plan", "wire", "transports", "prefill", "decode")
CORE_ROOT = ("kvconnect.core.connector", "kvconnect.core.loop")  # the composition: may import all of core
CORE_ALLOWED = {
    "errors": set(),
    "plan": {"errors"},
    "wire": {"errors", "plan"},
    "base": {"errors", "plan", "wire"},
    "transports": {"errors", "plan", "wire", "base"},
    "prefill": {"errors", "plan", "wire", "base", "transports"},
    "decode": {"errors", "plan", "wire", "base", "transports"},
}
IO_LIBRARIES = {"zmq", "torch", "socket", "threading", "os", "subprocess", "asyncio", "ctypes", "nixl", "triton"}


def core_room(module: str) -> str:
    """kvconnect.core.plan.layout -> plan; kvconnect.core.config -> base; kvconnect.core.errors -> errors."""
    parts = module.split(".")
    if len(parts) > 3 and parts[2] in CORE_ROOMS:
        return parts[2]
    if parts[2:] in (["errors"], ["__init__"]):
        return "errors"
    return parts[2] if parts[2] in CORE_ROOMS else "base"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}


def room(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return "api"
    return parts[1] if parts[1] in ALLOWED else "api"


def imported(path: Path) -> set[str]:
    """Every kvconnect module `path` imports, anywhere in the file (functions and TYPE_CHECKING included)."""
    tree = ast.parse(path.read_text())
    here = module_name(path)
    package = here if path.name == "__init__.py" else here.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names]
        else:
            continue
        for name in names:
            if name.split(".")[0] in ("kvconnect", "tests"):
                out.add(name)
    return out


GRAPH = {name: imported(path) for name, path in MODULES.items()}


def test_the_graph_sees_the_imports_it_should() -> None:
    # a check that can fail: known edges of the real package are found, TYPE_CHECKING ones included
    assert "kvconnect.core.decode.puller" in GRAPH["kvconnect.core.connector"]
    assert core_room("kvconnect.core.plan.layout") == "plan" and core_room("kvconnect.core.config") == "base"
    assert (
        core_room("kvconnect.core.errors") == "errors" and core_room("kvconnect.core.transports.base") == "transports"
    )
    assert "kvconnect.core.decode.pull" in GRAPH["kvconnect.core.decode.peers"]  # (under TYPE_CHECKING)
    assert room("kvconnect.core.transports.nixl_read") == "core" and room("kvconnect") == "api"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_rooms_import_only_downwards(module: str) -> None:
    mine = room(module)
    for target in sorted(GRAPH[module]):
        assert not target.startswith("tests"), f"{module} imports the test suite ({target})"
        theirs = room(target)
        assert theirs == mine or theirs in ALLOWED[mine], (
            f"{module} ({mine}) imports {target} ({theirs}); {mine} may import {sorted(ALLOWED[mine]) or 'nothing'}"
        )


CORE_MODULES = sorted(m for m in MODULES if m.startswith("kvconnect.core.") and m not in CORE_ROOT)


@pytest.mark.parametrize("module", CORE_MODULES)
def test_core_sub_rooms_import_only_downwards(module: str) -> None:
    mine = core_room(module)
    for target in sorted(GRAPH[module]):
        if not target.startswith("kvconnect.core.") or target == "kvconnect.core":
            continue
        theirs = core_room(target)
        assert target not in CORE_ROOT, f"{module} imports the connector's composition ({target})"
        assert theirs == mine or theirs in CORE_ALLOWED[mine], (
            f"{module} ({mine}) imports {target} ({theirs}); {mine} may import {sorted(CORE_ALLOWED[mine])}"
        )


def test_the_prefill_and_decode_halves_never_meet_below_the_connector() -> None:
    for module in CORE_MODULES:
        room_ = core_room(module)
        other = {"prefill": "decode", "decode": "prefill"}.get(room_)
        if other:
            assert not [t for t in GRAPH[module] if core_room(t) == other], f"{module} imports the {other} half"


@pytest.mark.parametrize("module", [m for m in CORE_MODULES if core_room(m) == "plan"])
def test_planning_imports_no_io_library(module: str) -> None:
    assert not third_party(MODULES[module]) & IO_LIBRARIES, f"{module}: {third_party(MODULES[module]) & IO_LIBRARIES}"


TRANSPORT_MODULES = ("kvconnect.core.transports.nixl_read", "kvconnect.core.transports.ipc_gather")


@pytest.mark.parametrize("module", TRANSPORT_MODULES)
def test_each_transport_owns_both_halves_of_its_transfer(module: str) -> None:
    """A transport module defines a `Transport` with its own `start` (set-up and prefill half) and `open` (decode
    half), and the `Link` and `Move` it opens: nothing of its path is built elsewhere."""
    tree = ast.parse(MODULES[module].read_text())
    classes = {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}
    bases = {name: {getattr(b, "id", "") for b in node.bases} for name, node in classes.items()}
    (transport,) = [name for name, b in bases.items() if "Transport" in b]
    methods = {f.name for f in classes[transport].body if isinstance(f, ast.FunctionDef)}
    assert {"start", "open"} <= methods, f"{module}: {transport} lacks {sorted({'start', 'open'} - methods)}"
    assert any("Link" in b for b in bases.values()) and any("Move" in b for b in bases.values()), module


NIXL_DETAIL = ("kvconnect.core.agent", "kvconnect.core.transports.nixl_read", "kvconnect.core.transports.staging")


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m.startswith("kvconnect.core.decode.")))
def test_the_decode_half_imports_no_nixl_detail(module: str) -> None:
    """The decode half sees transports only through `transports/base.py` and the registry: NIXL's wrapper, its
    READ transport and its staging cache are the transport's business."""
    assert not GRAPH[module] & set(NIXL_DETAIL), f"{module} imports {sorted(GRAPH[module] & set(NIXL_DETAIL))}"
    assert "nixl" not in {n.split(".")[0] for n in third_party(MODULES[module])}, module


@pytest.mark.parametrize(
    "module", sorted(m for m in MODULES if not m.startswith("kvconnect.core.prefill.") and m != "kvconnect.core.board")
)
def test_the_prefill_state_is_built_and_reached_only_in_the_prefill_half(module: str) -> None:
    """The lease table and the lease board's writer belong to the prefill half: outside `prefill/`, only the
    decode may read a board (`BoardReader`), and nothing constructs a `LeaseTable` or a `BoardWriter`."""
    text = MODULES[module].read_text()
    assert "LeaseTable(" not in text and "BoardWriter" not in text, module
    assert "kvconnect.core.prefill.table" not in GRAPH[module], module


def test_no_import_cycles() -> None:
    state: dict[str, int] = {}  # 1 = on the stack, 2 = done
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for target in sorted(GRAPH.get(node, ())):
            if target not in MODULES or target == node:
                continue
            if state.get(target) == 1:
                cycle = stack[stack.index(target) :] + [target]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if target not in state:
                visit(target)
        stack.pop()
        state[node] = 2

    for module in sorted(MODULES):
        if module not in state:
            visit(module)


SERVE_LIBRARIES = ("starlette", "uvicorn", "httpx", "prometheus_client")  # the `serve` extra


def third_party(path: Path) -> set[str]:
    """Top-level names of every module `path` imports that is not ours."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            out.add(node.module.split(".")[0])
    return out - {"kvconnect", "tests"}


@pytest.mark.parametrize("module", sorted(m for m in MODULES if room(m) in ("api", "core", "engine", "vllm")))
def test_the_library_and_the_vllm_plugin_need_no_serving_libraries(module: str) -> None:
    """starlette, uvicorn, httpx and prometheus-client come with the `serve` extra only."""
    assert not third_party(MODULES[module]) & set(SERVE_LIBRARIES), module


def test_no_test_module_imports_another() -> None:
    """Shared test code lives in helper modules (tests/helpers.py, faultkit.py, ...), not in test modules."""
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        tree = ast.parse(path.read_text())
        names = [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
        names += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        bad = [name for name in names if name.split(".")[-1].startswith("test_") or ".test_" in name]
        assert not bad, f"{path.relative_to(ROOT)} imports test modules {bad}"


def test_scripts_do_not_import_the_test_suite() -> None:
    for path in sorted([*(ROOT / "scripts").glob("*.py"), *(ROOT / "benchmarks").glob("*.py")]):
        assert not any(name.startswith("tests") for name in imported(path)), path


@pytest.mark.parametrize("module", sorted(MODULES))
def test_modules_are_small_and_say_what_they_own(module: str) -> None:
    path = MODULES[module]
    text = path.read_text()
    assert len(text.splitlines()) <= MAX_LINES, f"{path.relative_to(ROOT)} has {len(text.splitlines())} lines"
    if text.strip():
        assert ast.get_docstring(ast.parse(text)), f"{path.relative_to(ROOT)} opens with no docstring"


def test_the_public_api_is_declared_and_importable() -> None:
    import kvconnect

    assert set(kvconnect.__all__) >= {
        "KVConnector",
        "KVCache",
        "CacheSpec",
        "LayoutKind",
        "ConnectorConfig",
        "connector_config",
        "PullHandle",
        "PullStats",
        "KVTransferParams",
        "KVConnectError",
        "LeaseLostError",
        "ConnectorSnapshot",
    }
    missing = [name for name in kvconnect.__all__ if not hasattr(kvconnect, name)]
    assert not missing
    from kvconnect.core.errors import KVConnectError

    errors = [getattr(kvconnect, n) for n in kvconnect.__all__ if n.endswith("Error")]
    assert all(issubclass(e, KVConnectError) for e in errors)
