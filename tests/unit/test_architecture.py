"""The floors of the house, read from the source: every ``import`` (inside functions too) between
relayrl's own modules.

* ``common/`` is the ground floor: it imports no service and no command.
* A service imports ``common/`` and other services' contracts (``relayrl.<svc>.v1``) only. The
  coordinator sits above the others: it also reads their config models (an experiment file holds
  one section per service).
* Entrypoints (``relayrl.cli``, ``relayrl.serve_cli``, every ``__main__``) are the top floor.
* No import circles, not even through imports inside functions.
* Inside the coordinator, rooms by job (``clients/``: talk to services, ``rollout/``: make
  rollouts, ``launch/``: place services, ``service/``: the standing gRPC service, ``records/``:
  what a run leaves behind, ``algorithms/``), each importing only the rooms below it, with the
  experiment, its config and its loop at the top; its floors (the longest import chain among its
  modules) stay few.
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


# -- the coordinator's rooms -----------------------------------------------------------------------
COORDINATOR = "relayrl.coordinator"
MAX_COORDINATOR_TOP_LEVEL = 12
"""Modules at the coordinator's top level (the experiment, its config, its loop, its commands);
the rest live in rooms by job."""
MAX_COORDINATOR_FLOORS = 12
"""The longest import chain among the coordinator's modules (``coordinator_floors``): 14 while it
was one flat hall of 31 modules (issue 41), 12 in rooms."""
ROOMS = {
    "clients": {"config", "errors"},
    "records": {"config", "errors"},
    "launch": {"config"},
    "rollout": {"config", "errors", "clients"},
    "algorithms": {"config", "errors", "clients", "rollout.base"},
    "service": {"config", "errors", "assets", "derive", "drive", "metrics", "launch", "records"},
    "loop": {
        "config",
        "errors",
        "clients",
        "rollout.base",
        "algorithms.base",
        "algorithms.rewards",
        "records.alarms",
    },
}
"""What of the coordinator a room (or a top-level module) may import besides itself: clients and
records import no other room (an alarm's failure is a ``RunFailure`` of ``errors``); launchers place services and know nothing of the run; rollout
sources talk through the clients and import no launcher, no record and no algorithm; the
algorithm families see only the rollout's contract; the loop knows the seams (``rollout.base``,
``algorithms.base``) and the run's alarms (``records.alarms``), never a rollout source or an
algorithm family."""


def coordinator_graph() -> dict[str, set[str]]:
    """The coordinator's modules, each with the coordinator modules it imports."""
    return {
        m: {d for d in deps if d.startswith(COORDINATOR)}
        for m, deps in graph().items()
        if m == COORDINATOR or m.startswith(COORDINATOR + ".")
    }


def coordinator_floors(g: dict[str, set[str]] | None = None) -> int:
    """The coordinator's floors, as the review counted them: the longest import chain among its
    modules (a module importing none of them is on floor 0, any other one floor above the highest
    it imports).

    >>> coordinator_floors({"a": set(), "b": {"a"}, "c": {"a", "b"}})
    2
    """
    g = coordinator_graph() if g is None else g
    level: dict[str, int] = {}

    def floor_of(m: str) -> int:
        if m not in level:
            level[m] = 1 + max((floor_of(d) for d in g[m] if d in g), default=-1)
        return level[m]

    return max(map(floor_of, g), default=0)


def _relative(module: str) -> str:
    return module.removeprefix(COORDINATOR).lstrip(".")


def _within(module: str, allowed: set[str]) -> bool:
    rel = _relative(module)
    return any(rel == a or rel.startswith(a + ".") for a in allowed)


def test_the_coordinator_top_level_holds_few_modules():
    top = sorted(
        p.name for p in (ROOT / "coordinator").glob("*.py") if p.name not in ("__init__.py", "__main__.py")
    )
    assert len(top) <= MAX_COORDINATOR_TOP_LEVEL, top


def test_the_coordinator_has_few_floors():
    assert coordinator_floors() <= MAX_COORDINATOR_FLOORS


@pytest.mark.parametrize("room", sorted(ROOMS))
def test_a_coordinator_room_imports_only_the_rooms_below_it(room):
    bad = [
        f"{m} imports {d}"
        for m, deps in coordinator_graph().items()
        if _within(m, {room})
        for d in deps
        if not _within(d, {room, "v1", *ROOMS[room]}) and d != COORDINATOR  # v1: its own contract
    ]
    assert not bad, "\n".join(bad)


def test_only_the_rollout_seam_asks_which_kind_of_episode_an_env_runs():
    """``rollout.make`` picks the source by ``EnvInfo.black_box``; no source, lifecycle, loop or
    wiring tests it again."""
    readers = sorted(
        str(p.relative_to(ROOT)) for p in (ROOT / "coordinator").rglob("*.py") if "black_box" in p.read_text()
    )
    assert readers == ["coordinator/rollout/__init__.py"], readers


def test_the_trainer_never_asks_which_role_it_runs():
    """The learner's roles own what differs between them (``learner/roles.py``); the trainer runs
    any of them alike, and its engine never branches on one either."""
    for name in ("trainer.py", "engines.py"):
        code = ast.parse((ROOT / "learner" / name).read_text())
        named = {
            n.value
            for n in ast.walk(code)
            if isinstance(n, ast.Constant) and n.value in ("actor", "critic", "reference")
        }
        compared = [
            ast.unparse(n) for n in ast.walk(code) if isinstance(n, ast.Compare) and "role" in ast.unparse(n)
        ]
        assert not named and not compared, (name, named, compared)
