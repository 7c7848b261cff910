"""The manual stays true: every repository path and module the README and docs/ name exists, the
README's service table is the set of services, and the config reference covers every field.

The docs site itself is built strict by the test command (scripts/test.sh: ``mkdocs build
--strict``), which fails on a broken link or anchor; these tests catch what it cannot see: a
module moved or renamed while a page still names it in backticks.
"""

from __future__ import annotations

import doctest
import importlib.util
import json
import os
import re
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
# Paths taken from the repository's root: its top-level folders and files.
TOP = {"services", "tests", "examples", "bench", "deploy", "scripts", "docs", "protos", "schemas"}
TOP_FILES = {"README.md", "pyproject.toml", "mkdocs.yml", "conftest.py"}
# Folders paths are also written under (docs/rl-step.md: "Paths are under `services/`").
SERVICE_PACKAGES = {p.name for p in (ROOT / "services").iterdir() if (p / "__init__.py").is_file()}
CODE_SUFFIXES = (".py", ".proto")
GENERATED = {f"docs/{hooks_page}" for hooks_page in ("config-reference.md", "index.md")}  # made by the build
SKIP_DIRS = {".git", ".venv", ".venv-trl", "build", "runs", "__pycache__", "relayrl.egg-info", "site"}


def _load_hooks():
    spec = importlib.util.spec_from_file_location("docs_hooks", ROOT / "scripts" / "docs_hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


hooks = _load_hooks()


@cache
def repo_files() -> tuple[str, ...]:
    """Every file of the working tree (outputs and environments left out), as posix paths."""
    out = []
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS and not d.startswith(".")]
        rel = Path(folder).relative_to(ROOT)
        out += [(rel / name).as_posix() for name in files]
    return tuple(out)


def _exists(rel: str) -> bool:
    if "*" in rel:
        return any(ROOT.glob(rel.rstrip("/")))
    return (ROOT / rel).exists()


def path_problem(token: str, inline: bool) -> str | None:
    """Why a word of a page's code is a repository path that does not exist; None when it is not
    a path or it exists. Rooted paths (``services/...``, ``examples/x.yaml``) are checked in code
    blocks too; paths under ``services/`` without it, suffixes (``algorithms/base.py``) and bare
    module names (``losses.py``) only in inline code, where the prose names a file.

    >>> path_problem("services/learner/nope.py", inline=True)
    'no such path'
    >>> path_problem("runs/<name>/metrics.jsonl", inline=True) is None
    True
    """
    token = token.strip("`\"'()[]{}").rstrip(".,;:")
    if not token or any(c in token for c in "<>{}$") or token.startswith(("/", ".", "~", "-")):
        return None
    token = token.split("#", 1)[0].split("::", 1)[0]
    first = token.split("/", 1)[0]
    if first in TOP and "/" in token or token in TOP_FILES:
        return None if _exists(token) else "no such path"
    if not inline or not token.endswith((*CODE_SUFFIXES, "/")) or token.endswith("//"):
        return None
    if first in SERVICE_PACKAGES and "/" in token:
        return None if _exists(f"services/{token}") else "no such path under services/"
    if "/" in token:
        if not token.endswith(CODE_SUFFIXES):
            return None
        found = any(f == token or f.endswith("/" + token) for f in repo_files())
        return None if found else "no file ends with this path"
    if token.endswith(CODE_SUFFIXES) and re.fullmatch(r"[\w.-]+", token):
        found = any(f.rsplit("/", 1)[-1] == token for f in repo_files())
        return None if found else "no file of this name"
    return None


_KUBECTL_RESOURCE = re.compile(r"(deploy|deployment|statefulset|sts|pod|job|svc|service)/[\w-]+")
_MODULE = re.compile(r"(?<![\w/.-])relayrl(?:\.[A-Za-z_]\w*)+")


def module_problem(dotted: str) -> str | None:
    """Why ``relayrl.x.y[.Attr]`` names no module (and attribute) of services/; None when it does.

    >>> module_problem("relayrl.common.healthcheck") is None
    True
    >>> module_problem("relayrl.reward.scorers.ScoreResult") is None
    True
    >>> module_problem("relayrl.reward.nope")
    "relayrl.reward has no 'nope'"
    """
    parts = dotted.split(".")[1:]
    base = ROOT / "services"
    i = 0
    while i < len(parts):
        nxt = base / parts[i]
        if (nxt / "__init__.py").is_file():
            base = nxt
        elif nxt.with_suffix(".py").is_file():
            base = nxt.with_suffix(".py")
            i += 1
            break
        else:
            break
        i += 1
    rest = parts[i:]
    if not rest:
        return None
    problem = f"{'.'.join(['relayrl', *parts[:i]])} has no {rest[0]!r}"
    # After a package only a module (above) or a class (a contract's service) may follow; after a
    # module, one attribute and perhaps its attribute (``Class.method``).
    if len(rest) > 2 or base.is_dir() and not rest[0][:1].isupper():
        return problem
    sources = [base] if base.is_file() else sorted([*base.glob("*.py"), *base.glob("*.pyi")])
    found = any(re.search(rf"\b{re.escape(rest[0])}\b", p.read_text()) for p in sources)
    return None if found else problem


def references(text: str, source: str) -> list[tuple[str, str]]:
    """(reference, problem) for every stale reference of a page's text (``source``: its path in
    the repository): paths and modules in its code, and the targets of its relative links."""
    out = []
    for code, chunk in hooks.split_code(text):
        if not code:
            continue
        inline = not chunk.lstrip().startswith(("```", "~~~"))
        for line in chunk.splitlines():
            for word in re.split(r"[\s=]+", line):
                if "kubectl" in line and _KUBECTL_RESOURCE.fullmatch(word):
                    continue  # kubectl's kind/name (deploy/coordinator), not a folder
                problem = path_problem(word, inline)
                if problem:
                    out.append((word.strip("`"), problem))
        for dotted in _MODULE.findall(chunk):
            problem = module_problem(dotted)
            if problem:
                out.append((dotted, problem))
    for target in hooks.links(text):
        found = hooks.repo_target(source, target)
        if found is not None and found[0] not in GENERATED and not (ROOT / found[0]).exists():
            out.append((target, "link to a missing path"))
    return list(dict.fromkeys(out))


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_path_and_module_a_page_names_exists(page):
    stale = references(page.read_text(), page.relative_to(ROOT).as_posix())
    assert not stale, f"{page.relative_to(ROOT)} names what does not exist:\n" + "\n".join(
        f"  {ref}: {why}" for ref, why in stale
    )


def test_the_checker_catches_a_moved_module():
    text = (
        "See `services/coordinator/nope.py`, `coordinator/nope.py`, `algorithms/nope.py`, `nope.py`,\n"
        "`relayrl.coordinator.nope`, `relayrl.learner.v1.NopeService` and [a link](nope/missing.md).\n\n"
        "```bash\npython bench/nope.py --flag   # mymod.py: bare names in blocks are not checked\n```\n"
    )
    assert [ref for ref, _ in references(text, "docs/page.md")] == [
        "services/coordinator/nope.py",
        "coordinator/nope.py",
        "algorithms/nope.py",
        "nope.py",
        "relayrl.coordinator.nope",
        "relayrl.learner.v1.NopeService",
        "bench/nope.py",
        "nope/missing.md",
    ]


def test_the_readme_is_a_front_door_naming_every_service():
    readme = (ROOT / "README.md").read_text()
    lines = readme.splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines: the manual belongs in docs/"
    # Its first commands are the fresh machine's: install and run, then the tests.
    commands = re.findall(r"```bash\n(.*?)\n```", readme, re.S)
    assert commands[:2] == [
        "bash scripts/install.sh && .venv/bin/relayrl run examples/reverse-tiny.yaml",
        "bash scripts/test.sh",
    ]
    # The service table is the set of services that have a contract.
    services = {p.parent.parent.name for p in (ROOT / "protos" / "relayrl").glob("*/v1/*.proto")} - {"common"}
    table = set(re.findall(r"^\| (\w+) \(`services/\1/`\)", readme, re.M))
    assert table == services
    words = {1: "one", 2: "two", 3: "three", 4: "four", 5: "five", 6: "six", 7: "seven", 8: "eight"}
    assert f"through {words.get(len(services), len(services))} decoupled gRPC services" in readme


def test_every_docs_page_is_in_the_site_nav():
    nav = (ROOT / "mkdocs.yml").read_text()
    pages = {p.relative_to(ROOT / "docs").as_posix() for p in (ROOT / "docs").rglob("*.md")}
    missing = {p for p in pages if f": {p}" not in nav}
    assert not missing, f"docs pages missing from mkdocs.yml's nav: {sorted(missing)}"


def test_the_config_reference_covers_every_field_of_the_schema():
    schema = json.loads((ROOT / hooks.SCHEMA).read_text())
    page = hooks.config_reference(schema)
    for name, model in [("The experiment file", schema), *schema["$defs"].items()]:
        section = page.split(f"\n## {name}\n", 1)
        assert len(section) == 2, f"no section for {name}"
        body = section[1].split("\n## ", 1)[0]
        for field in model.get("properties", {}):
            assert f"| `{field}` |" in body, f"{name}.{field} missing from the config reference"
    # Every table row has its five cells (no unescaped pipe from a docstring).
    for row in (line for line in page.splitlines() if line.startswith("| `")):
        cells = re.split(r"(?<!\\)\|", re.sub(r"`[^`]*`", "code", row))
        assert len(cells) == 7, row


def test_docs_hooks_doctests():
    assert doctest.testmod(hooks).failed == 0
