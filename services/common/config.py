"""Config plumbing shared by every service: strict pydantic models, YAML files, dotted overrides.

Flow: YAML file -> dict -> ``--set a.b=value`` overrides applied to the dict -> one pydantic
validation. Validating once, after the overrides, means an override can fix a file that would
not validate on its own, and every error names the full dotted path of the field at fault.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError

M = TypeVar("M", bound=BaseModel)


class ConfigError(ValueError):
    """A config that cannot be used; the message names the field path (``sampling.temperature``)."""


class StrictModel(BaseModel):
    """Base of every relayrl config: unknown fields are errors, field docstrings are the docs."""

    model_config = ConfigDict(
        extra="forbid",
        validate_assignment=True,
        use_attribute_docstrings=True,
        protected_namespaces=(),
    )


def plugin_refs(refs: list[str], what: str) -> list[str]:
    """``refs`` if each is ``module:<what>`` (a plugin to import), else ValueError naming it.

    >>> plugin_refs(["pkg.mod:score"], "function")
    ['pkg.mod:score']
    >>> plugin_refs(["pkg.mod"], "Class")
    Traceback (most recent call last):
    ValueError: plugin 'pkg.mod' must look like module:Class
    """
    for ref in refs:
        mod, sep, name = ref.partition(":")
        if not sep or not mod or not name:
            raise ValueError(f"plugin {ref!r} must look like module:{what}")
    return refs


def _format_loc(loc: Iterable[Any]) -> str:
    """``("data", "test", 0)`` -> ``data.test[0]``."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out or "<root>"


def format_validation_error(err: ValidationError, source: str = "", within: str = "") -> str:
    """One line per problem, each starting with the dotted field path (under ``within``, the
    path of the validated section in a larger config, e.g. ``reference``).

    Pydantic's own rendering puts the path on a line of its own and adds a docs URL; users read
    these in a terminal or a gRPC status message, so keep them short and path-first.
    """
    lines = []
    for e in err.errors(include_url=False):
        # Union members add their type name to loc (e.g. "function-after[...]"); drop those.
        loc = [p for p in e["loc"] if not (isinstance(p, str) and ("[" in p or p.startswith("function")))]
        path = _format_loc([within, *loc] if within else loc)
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            msg = "unknown field"
        got = e.get("input")
        if e["type"] not in ("missing", "extra_forbidden") and not isinstance(got, (dict, list)):
            msg += f" (got {got!r:.200})"
        lines.append(f"{path}: {msg}")
    prefix = f"{source}: " if source else ""
    return prefix + ("invalid config\n  " if len(lines) > 1 else "") + "\n  ".join(lines)


def parse_override(item: str) -> tuple[list[str], Any]:
    """Split ``a.b.c=value``; the value is parsed as YAML so numbers, bools and lists work.

    >>> parse_override("sampling.temperature=0.7")
    (['sampling', 'temperature'], 0.7)
    >>> parse_override("services.generators=[a:1, b:2]")
    (['services', 'generators'], ['a:1', 'b:2'])
    >>> parse_override("model.path=")
    (['model', 'path'], None)
    """
    key, sep, raw = item.partition("=")
    key = key.strip()
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {item!r}: expected KEY.PATH=VALUE")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as e:
        raise ConfigError(f"override {item!r:.200}: value is not valid YAML: {e}") from None
    except RecursionError:
        raise ConfigError(f"override {item!r:.200}: nested deeper than {MAX_CONFIG_DEPTH} levels") from None
    return key.split("."), value


def apply_overrides(data: dict[str, Any], overrides: Iterable[str]) -> dict[str, Any]:
    """Return a copy of ``data`` with each ``a.b=value`` applied (intermediate dicts created).

    >>> apply_overrides({"a": {"b": 1}}, ["a.b=2", "a.c.d=x"])
    {'a': {'b': 2, 'c': {'d': 'x'}}}
    """
    out = _deep_copy(data)
    for item in overrides:
        path, value = parse_override(item)
        node = out
        for i, part in enumerate(path[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            elif not isinstance(child, dict):
                where = ".".join(path[: i + 1])
                raise ConfigError(f"override {item!r}: {where} is a value, not a section")
            node = child
        node[path[-1]] = value
    return out


def _deep_copy(d: Mapping[str, Any]) -> dict[str, Any]:
    return {k: _deep_copy(v) if isinstance(v, Mapping) else v for k, v in d.items()}


MAX_CONFIG_NODES = 100_000
"""Most values (keys, scalars, lists, mappings) a config may hold once YAML aliases are expanded; a
few lines of nested aliases expand to billions ("billion laughs")."""
MAX_CONFIG_DEPTH = 64
"""Deepest nesting of lists and mappings a config may have (relayrl's own is under 10): deeper
structures would exhaust the recursion of the YAML parser, the overrides or the validation."""


def parse_yaml(text: str, source: str = "config") -> dict[str, Any]:
    r"""A YAML mapping from ``text``; bad YAML, a non-mapping or an alias bomb is a ConfigError.

    >>> parse_yaml("a: {b: 1}")
    {'a': {'b': 1}}
    >>> bomb = "a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
    ...     f"{c}: &{c} [*{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}]\n" for p, c in zip("abcde", "bcdef"))
    >>> try:
    ...     parse_yaml(bomb)
    ... except ValueError as e:
    ...     print(e)
    config: more than 100000 values once YAML aliases are expanded
    """
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"{source}: not valid YAML: {e}") from None
    except RecursionError:  # PyYAML's composer recurses once per level of nesting
        raise ConfigError(f"{source}: nested deeper than {MAX_CONFIG_DEPTH} levels") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: top level must be a mapping of sections, got {type(data).__name__}")
    _check_size(data, source)
    return data


def _check_size(data: Any, source: str) -> None:
    """ConfigError past ``MAX_CONFIG_NODES`` values or ``MAX_CONFIG_DEPTH`` levels (no recursion)."""
    stack, seen = [(data, 0)], 0
    while stack:  # count as if aliases were copies: what validation and copying would walk
        x, depth = stack.pop()
        seen += 1
        if seen > MAX_CONFIG_NODES:
            raise ConfigError(f"{source}: more than {MAX_CONFIG_NODES} values once YAML aliases are expanded")
        if depth > MAX_CONFIG_DEPTH:
            raise ConfigError(f"{source}: nested deeper than {MAX_CONFIG_DEPTH} levels")
        if isinstance(x, dict):
            stack.extend((k, depth + 1) for k in x)
            stack.extend((v, depth + 1) for v in x.values())
        elif isinstance(x, list):
            stack.extend((v, depth + 1) for v in x)


def read_yaml(path: str | Path) -> dict[str, Any]:
    """Read a YAML mapping; a missing file, bad YAML or a non-mapping is a ConfigError."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise ConfigError(f"{p}: cannot read config: {e.strerror or e}") from None
    return parse_yaml(text, str(p))


def build(model: type[M], data: Mapping[str, Any], overrides: Iterable[str] = (), source: str = "") -> M:
    """Validate ``data`` plus ``overrides`` into ``model``; errors become one ConfigError."""
    merged = apply_overrides(dict(data), overrides)
    _check_size(merged, source or "config")  # overrides may add what the text's check never saw
    try:
        return model.model_validate(merged)
    except ValidationError as e:
        raise ConfigError(format_validation_error(e, source)) from None


def load(model: type[M], path: str | Path | None, overrides: Iterable[str] = ()) -> M:
    """Load a YAML file (or nothing) into ``model`` with dotted overrides applied."""
    data = read_yaml(path) if path is not None else {}
    return build(model, data, overrides, source=str(path) if path is not None else "")


def dump_yaml(model: BaseModel) -> str:
    """The resolved config as YAML (what a run folder records)."""
    return yaml.safe_dump(model.model_dump(mode="json"), sort_keys=False)
