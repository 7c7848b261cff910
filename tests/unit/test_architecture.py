"""The floors of the house, read from the source: every ``import`` (inside functions too) between
relayrl's own modules.

* ``common/`` is the ground floor: it imports no service and no command.
* A service imports ``common/`` and other services' contracts (``relayrl.<svc>.v1``) only. The
  coordinator sits above the others: it also reads their config models (an experiment file holds
  one section per service).
* Entrypoints (``relayrl.cli``, ``relayrl.serve_cli``, every ``__main__``) are the top floor.
* No import circles, not even through imports inside functions.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "services"
SERVICES = ("generator", "learner", "reward", "coordinator", "env", "gateway")


def module_name(path: Path) -> str:
    parts = ("relayrl", *path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {
        module_name(p): p
        for p in ROOT.rglob("*.py")
        if "/v1/" not in str(p) and not p.name.endswith("_pb2.py")
    }


def imports_of(path: Path, known: set[str]) -> set[str]:
    """relayrl modules ``path`` imports, anywhere in it (``from relayrl.x import y`` counts as
    ``relayrl.x.y`` when that is a module, else ``relayrl.x``)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [
                f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in known else node.module
                for a in node.names
            ]
        for name in names:
            if name.startswith("relayrl"):
                out.add(name)
    return out


def graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods) | {m for m in _contracts()}
    return {m: {i for i in imports_of(p, known) if i != m} for m, p in mods.items()}


def _contracts() -> set[str]:
    return {module_name(p) for p in ROOT.rglob("v1/*.py")}


def floor(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return "package"
    if parts[-1] == "__main__":
        return "command"
    if parts[1] in SERVICES:
        return "contract" if len(parts) > 2 and parts[2] == "v1" else parts[1]
    if parts[1] == "common":
        return "contract" if len(parts) > 2 and parts[2] == "v1" else "common"
    return "command"  # relayrl.cli, relayrl.serve_cli, relayrl._compat ...


def test_common_imports_no_service_and_no_command():
    bad = [
        f"{m} imports {i}"
        for m, deps in graph().items()
        if floor(m) == "common"
        for i in deps
        if floor(i) not in ("common", "contract", "package")
        or (floor(i) == "contract" and not i.startswith("relayrl.common"))
    ]
    assert not bad, "\n".join(bad)


ACROSS = {"coordinator": {"config"}}
"""Modules of other services a service may import beyond their contracts."""


@pytest.mark.parametrize("service", SERVICES)
def test_a_service_uses_other_services_only_through_their_contracts(service):
    bad = [
        f"{m} imports {i}"
        for m, deps in graph().items()
        if floor(m) == service
        for i in deps
        if floor(i) in SERVICES and floor(i) != service and i.split(".")[2] not in ACROSS.get(service, set())
    ]
    assert not bad, "\n".join(bad)


def test_services_import_no_command():
    bad = [
        f"{m} imports {i}"
        for m, deps in graph().items()
        if floor(m) in SERVICES
        for i in deps
        if floor(i) == "command"
    ]
    assert not bad, "\n".join(bad)


def test_no_import_circles():
    g = graph()
    state: dict[str, int] = {}
    cycles = []

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        for d in sorted(g.get(m, ())):
            if d not in g:
                continue
            if state.get(d) == 1:
                cycles.append(" -> ".join([*stack[stack.index(d) :], d]))
            elif d not in state:
                visit(d, [*stack, d])
        state[m] = 2

    for m in sorted(g):
        if m not in state:
            visit(m, [m])
    assert not cycles, "\n".join(cycles)
