"""MkDocs hooks of the docs site (mkdocs.yml): pages made at build time, so nothing is written twice.

    README.md                      -> the site's home page (index.md), its links mapped into the site
    schemas/experiment.schema.json -> config-reference.md, a section per config model, field by field
    a repository file a page links -> copied into the site under repo/, the link pointed at the copy

The schema is generated from the pydantic config models by ``scripts/gen_protos.py`` (and checked
fresh by its ``--check``), so the reference page follows the models through it and is never
committed. Pages keep the links that work on GitHub (``../examples/x.png`` from docs/,
``docs/learner.md`` from the README); a link to anything that does not exist is left as it is, and
the strict build fails on it. Only the standard library and mkdocs are imported: the build needs
neither torch nor relayrl.
"""

from __future__ import annotations

import json
import posixpath
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = "schemas/experiment.schema.json"
REFERENCE_PAGE = "config-reference.md"
REPO_PREFIX = "repo"  # where linked repository files land in the site

# Code a page quotes: fenced blocks (``` or ~~~ at a line's start, up to the same fence) and
# inline spans (a run of backticks up to the same run). Links and paths inside them are text.
_CODE = re.compile(
    r"^[ \t]*(?P<fence>`{3,}|~{3,})[^\n]*\n.*?^[ \t]*(?P=fence)[ \t]*$"
    r"|(?P<ticks>`+)(?!`).+?(?<!`)(?P=ticks)(?!`)",
    re.M | re.S,
)
# An inline link or image: [text](target "title") / ![alt](target).
_LINK = re.compile(r"(!?\[[^\]]*\]\()([^)\s]+)((?:\s+\"[^\"]*\")?\))")


def split_code(text: str) -> list[tuple[bool, str]]:
    """Cut markdown into (is_code, chunk) pieces, in order; joined they give the text back.

    >>> split_code("see `a/b.py` and\\n```\\nx\\n```\\nend")
    [(False, 'see '), (True, '`a/b.py`'), (False, ' and\\n'), (True, '```\\nx\\n```'), (False, '\\nend')]
    """
    out, pos = [], 0
    for m in _CODE.finditer(text):
        if m.start() > pos:
            out.append((False, text[pos : m.start()]))
        out.append((True, m.group(0)))
        pos = m.end()
    if pos < len(text):
        out.append((False, text[pos:]))
    return out


def links(text: str) -> list[str]:
    """The targets of the inline links and images in a page's prose (not in its code).

    >>> links("[a](docs/x.md#y) `[b](no.md)` ![c](../examples/p.png)")
    ['docs/x.md#y', '../examples/p.png']
    """
    return [m.group(2) for code, chunk in split_code(text) if not code for m in _LINK.finditer(chunk)]


def repo_target(source: str, target: str) -> tuple[str, str] | None:
    """(repository path, '#anchor' or '') a relative link of the file ``source`` points at;
    None for URLs, absolute paths, pure anchors and links that leave the repository.

    >>> repo_target("docs/learner.md", "../examples/a.png")
    ('examples/a.png', '')
    >>> repo_target("README.md", "docs/weight-sync.md#the-plan")
    ('docs/weight-sync.md', '#the-plan')
    >>> repo_target("README.md", "https://example.org") is None
    True
    """
    if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith(("/", "#")):
        return None
    path, _, anchor = target.partition("#")
    resolved = posixpath.normpath(posixpath.join(posixpath.dirname(source), path))
    if resolved.startswith("../") or resolved == "..":
        return None
    return resolved, f"#{anchor}" if anchor else ""


# --- the config reference, from the JSON Schema ---------------------------------------------


def _ref_name(node: dict) -> str | None:
    ref = node.get("$ref")
    return ref.rsplit("/", 1)[-1] if ref else None


def _escape(text: str) -> str:
    """One table cell: docstring lines joined, ``|`` and ``<`` escaped outside code spans."""
    text = " ".join(line.strip() for line in text.strip().splitlines())
    return "".join(
        chunk if code else chunk.replace("|", "\\|").replace("<", "&lt;") for code, chunk in split_code(text)
    )


def _type(node: dict) -> str:
    """A field's type in a few words, a config model as a link to its section."""
    name = _ref_name(node)
    if name:
        return f"[{name}](#{name.lower()})"
    if "anyOf" in node:
        return " or ".join(_type(n) for n in node["anyOf"])
    if "enum" in node:
        return " | ".join(f"`{json.dumps(v)}`" for v in node["enum"])
    kind = node.get("type", "any")
    if kind == "array":
        if "prefixItems" in node:
            return "[" + ", ".join(_type(n) for n in node["prefixItems"]) + "]"
        return f"list of {_type(node.get('items', {}))}"
    if kind == "object":
        extra = node.get("additionalProperties")
        return f"map of {_type(extra)}" if isinstance(extra, dict) else "map"
    return {"integer": "int", "number": "float", "boolean": "bool", "string": "str", "null": "null"}.get(
        kind, kind
    )


_BOUNDS = (
    ("minimum", ">= {}"),
    ("exclusiveMinimum", "> {}"),
    ("maximum", "<= {}"),
    ("exclusiveMaximum", "< {}"),
    ("minLength", "length >= {}"),
    ("maxLength", "length <= {}"),
    ("minItems", "items >= {}"),
    ("maxItems", "items <= {}"),
    ("pattern", "matches `{}`"),
)


def _bounds(node: dict) -> str:
    parts = [fmt.format(node[key]) for key, fmt in _BOUNDS if key in node]
    for alt in node.get("anyOf", []):
        if alt.get("type") != "null":
            parts.extend(fmt.format(alt[key]) for key, fmt in _BOUNDS if key in alt)
    return ", ".join(parts)


def _default(node: dict, required: bool) -> str:
    if required:
        return "required"
    if "default" not in node:
        return "built from its fields" if _ref_name(node) else ""
    return f"`{json.dumps(node['default'])}`"


def _refs(node) -> list[str]:
    """Config models a field's schema names, in order."""
    if isinstance(node, dict):
        own = [_ref_name(node)] if _ref_name(node) else []
        return own + [r for v in node.values() for r in _refs(v)]
    if isinstance(node, list):
        return [r for v in node for r in _refs(v)]
    return []


def config_reference(schema: dict) -> str:
    """The config reference page: the top level, then one section per config model (in the order
    the experiment first reaches it) naming every path it sits at, and a table of its fields."""
    defs = schema.get("$defs", {})
    order, paths = [], {}

    def visit(model: dict, prefix: str, ancestors: tuple[str, ...]) -> None:
        for field, node in model.get("properties", {}).items():
            for name in dict.fromkeys(_refs(node)):
                paths.setdefault(name, []).append(prefix + field)
                if name not in order:
                    order.append(name)
                if name not in ancestors:  # every path a model sits at, cycles cut
                    visit(defs[name], prefix + field + ".", (*ancestors, name))

    visit(schema, "", ())

    lines = [
        "# Config reference",
        "",
        "Every field of an experiment file, made at build time from",
        f"`{SCHEMA}` (JSON Schema 2020-12), which `scripts/gen_protos.py` generates from the",
        "pydantic config models (each field's description is its docstring). Cross-field rules stay",
        "with the coordinator; [Coordinator and config](coordinator.md#experiment-config) says how a",
        "file is loaded and overridden (`--set path=value`). Unknown fields are refused.",
        "",
    ]

    def table(model: dict) -> list[str]:
        required = set(model.get("required", []))
        rows = ["| field | type | default | bounds | description |", "|---|---|---|---|---|"]
        for field, node in model.get("properties", {}).items():
            cells = (
                f"`{field}`",
                _escape(_type(node)),
                _escape(_default(node, field in required)),
                _escape(_bounds(node)),
                _escape(node.get("description", "")),
            )
            rows.append("| " + " | ".join(cells) + " |")
        return rows

    lines += ["## The experiment file", "", _escape(schema.get("description", "")), "", *table(schema), ""]
    for name in order:
        model = defs[name]
        where = ", ".join(f"`{p}`" for p in paths[name])
        lines += [
            f"## {name}",
            "",
            f"At {where}. {_escape(model.get('description', ''))}",
            "",
            *table(model),
            "",
        ]
    return "\n".join(lines)


# --- MkDocs events -----------------------------------------------------------------------------

_SOURCES: dict[str, str] = {}  # site page (src_uri) -> the repository file it is made from


def _page_sources(docs_dir: Path) -> dict[str, str]:
    pages = {"index.md": "README.md"}
    for path in sorted(docs_dir.rglob("*.md")):
        rel = path.relative_to(docs_dir).as_posix()
        pages[rel] = f"{docs_dir.relative_to(ROOT).as_posix()}/{rel}"
    return pages


def on_files(files, config):
    from mkdocs.structure.files import File

    docs_dir = Path(config["docs_dir"]).resolve()
    docs = docs_dir.relative_to(ROOT).as_posix()
    _SOURCES.clear()
    _SOURCES.update(_page_sources(docs_dir))
    if files.get_file_from_path("index.md") is None:
        files.append(File.generated(config, "index.md", content=(ROOT / "README.md").read_text()))
    schema = json.loads((ROOT / SCHEMA).read_text())
    files.append(File.generated(config, REFERENCE_PAGE, content=config_reference(schema)))
    # Repository files the pages link to (images, examples): copied under repo/.
    for source in _SOURCES.values():
        for target in links((ROOT / source).read_text()):
            found = repo_target(source, target)
            if found is None or found[0].startswith(docs + "/") or found[0].endswith(".md"):
                continue  # pages: docs/ is the site, README.md its home
            path = ROOT / found[0]
            uri = f"{REPO_PREFIX}/{found[0]}"
            if path.is_file() and files.get_file_from_path(uri) is None:
                files.append(File.generated(config, uri, abs_src_path=str(path)))
    return files


def on_page_markdown(markdown, page, config, files):
    source = _SOURCES.get(page.file.src_uri)
    if source is None:
        return markdown
    docs = Path(config["docs_dir"]).resolve().relative_to(ROOT).as_posix()
    here = posixpath.dirname(page.file.src_uri)

    def rewrite(m: re.Match) -> str:
        found = repo_target(source, m.group(2))
        if found is None:
            return m.group(0)
        path, anchor = found
        if path.startswith(docs + "/"):
            site = path[len(docs) + 1 :]
        elif path == "README.md":
            site = "index.md"
        elif files.get_file_from_path(f"{REPO_PREFIX}/{path}") is not None:
            site = f"{REPO_PREFIX}/{path}"
        else:
            return m.group(0)  # missing: the strict build names it
        return m.group(1) + posixpath.relpath(site, here or ".") + anchor + m.group(3)

    return "".join(chunk if code else _LINK.sub(rewrite, chunk) for code, chunk in split_code(markdown))
