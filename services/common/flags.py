"""Command-line flags made from a pydantic config model, so a flag cannot drift from its field.

``add_flags(parser, Model)`` adds one flag per field of the model and of its sections: its name
the field's dotted path in kebab case, its help the field's docstring with the field's default
(``StrictModel`` turns attribute docstrings into descriptions), one argument group per section.
``given(args, flags)`` returns what the user gave, by field path, for ``put`` into the config
dict before the one pydantic validation (``relayrl.common.config``): argparse checks no value, so
a bad one fails like a bad config file, naming the field.

    --serve.tls-cert PATH    the field serve.tls_cert
    --tls-cert PATH          the same: serve is a flat section (``flat=("serve",)``)
    --lr 1e-5                an alias kept by hand (``aliases={"--lr": "optim.lr"}``)

Values are YAML, as in ``--set`` (``null`` or ``None``, ``[0.9, 0.95]``, ``{a: 1}``), except for
text fields, which take the text as given (``--model 0001`` is the folder "0001"). A list of text
is a repeatable flag (``--plugin a:f --plugin b:g``); a switch (bool) needs no value
(``--insecure``, or ``--insecure false``). A flag not given leaves the config file's value alone.
"""

from __future__ import annotations

import argparse
import types
import typing
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import yaml
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined
from relayrl.common.config import ConfigError

Kind = Literal["text", "yaml", "switch", "list"]


@dataclass(frozen=True)
class Flag:
    """One field as a flag."""

    path: str
    """Dotted field path (``serve.tls_cert``)."""
    field: FieldInfo
    """The pydantic field: its docstring (``description``) and default make the help."""
    kind: Kind
    """How the value is read: text as given, YAML, a switch, or a repeatable text item."""
    options: tuple[str, ...]
    """Its option strings: aliases, then the name in a flat section, then the dotted path."""


def option(path: str) -> str:
    """The generated flag of a field path.

    >>> option("serve.tls_client_ca")
    '--serve.tls-client-ca'
    """
    return "--" + path.replace("_", "-")


def default_of(field: FieldInfo) -> Any:
    """The field's default (a default factory called), or ``PydanticUndefined`` if required."""
    if field.default_factory is not None:
        return field.default_factory()
    return field.default


def help_text(field: FieldInfo, kind: Kind = "yaml") -> str:
    """The field's docstring on one line, then its default: what ``--help`` shows (``%``
    doubled: argparse formats help strings with ``%``).

    >>> from pydantic import Field
    >>> print(help_text(Field(0.85, description="Share of GPU memory\\n    vLLM may use (%).")))
    Share of GPU memory vLLM may use (%%). [default: 0.85]
    """
    doc = " ".join((field.description or "").split()).replace("%", "%%")
    default = default_of(field)
    tail = "required" if default is PydanticUndefined else f"default: {default!r}"
    tail = f"[repeatable; {tail}]" if kind == "list" else f"[{tail}]"
    return f"{doc} {tail}" if doc else tail


def _members(annotation: Any) -> list[Any]:
    """The types of a union (``X | None`` -> [X]), None left out; a plain type alone."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return [a for a in typing.get_args(annotation) if a is not type(None)]
    return [annotation]


def _section(annotation: Any) -> type[BaseModel] | None:
    """The model of a field that holds exactly one (``ServeConfig``, ``LoraConfig | None``)."""
    models = [m for m in _members(annotation) if isinstance(m, type) and issubclass(m, BaseModel)]
    return models[0] if len(models) == 1 and len(_members(annotation)) == 1 else None


def kind_of(annotation: Any) -> Kind:
    """How a field's flag reads its value.

    >>> kind_of(str | None), kind_of(Literal["a", "b"]), kind_of(bool | None), kind_of(list[str])
    ('text', 'text', 'switch', 'list')
    >>> kind_of(int | None), kind_of(Literal[0, 8]), kind_of(tuple[float, float]), kind_of(dict[str, Any])
    ('yaml', 'yaml', 'yaml', 'yaml')
    """
    (member, *more) = _members(annotation) or [None]
    if more:
        return "yaml"
    if member is str or (
        typing.get_origin(member) is Literal and all(isinstance(v, str) for v in typing.get_args(member))
    ):
        return "text"
    if member is bool:
        return "switch"
    if typing.get_origin(member) is list and typing.get_args(member) == (str,):
        return "list"
    return "yaml"


def leaves(model: type[BaseModel], prefix: str = "") -> Iterator[tuple[str, FieldInfo]]:
    """Every field of ``model`` that is not itself a section, by dotted path, in model order."""
    for name, field in model.model_fields.items():
        section = _section(field.annotation)
        if section is None:
            yield prefix + name, field
        else:
            yield from leaves(section, f"{prefix}{name}.")


def sections(model: type[BaseModel], prefix: str = "") -> Iterator[tuple[str, FieldInfo]]:
    """Every field of ``model`` that is a section (a model of its own), by dotted path."""
    for name, field in model.model_fields.items():
        section = _section(field.annotation)
        if section is not None:
            yield prefix + name, field
            yield from sections(section, f"{prefix}{name}.")


def _metavar(path: str, field: FieldInfo, kind: Kind) -> str:
    (member, *_) = _members(field.annotation) or [None]
    if typing.get_origin(member) is Literal:
        return "{" + ",".join(str(v) for v in typing.get_args(member)) + "}"
    return "BOOL" if kind == "switch" else path.rsplit(".", 1)[-1].upper()


def add_flags(
    parser: argparse.ArgumentParser,
    model: type[BaseModel],
    flat: tuple[str, ...] = (),
    aliases: Mapping[str, str] | None = None,
) -> dict[str, Flag]:
    """Add a flag for every field of ``model`` (argument groups by section) and return them by
    argparse ``dest``. The fields of a ``flat`` section also answer to their own names
    (``--host`` for ``serve.host``); ``aliases`` maps further names to field paths. An alias of
    no field is a ValueError, a name taken twice argparse's ArgumentError."""
    fields = dict(leaves(model))
    aliases = dict(aliases or {})
    unknown = sorted(a for a, p in aliases.items() if p not in fields)
    if unknown:
        raise ValueError(f"{model.__name__}: aliases of no field: {', '.join(unknown)}")
    groups = {"": parser.add_argument_group(model.__name__, " ".join((model.__doc__ or "").split()))}
    for path, field in sections(model):
        optional = type(None) in typing.get_args(field.annotation)
        note = " Unset by default: any of these flags sets it." if optional else ""
        doc = " ".join((field.description or "").split()).replace("%", "%%")
        groups[path] = parser.add_argument_group(path, doc + note)
    flags: dict[str, Flag] = {}
    for path, field in fields.items():
        section, _, name = path.rpartition(".")
        short = [option(name)] if section in flat else []
        extra = [a for a, p in aliases.items() if p == path]
        options = (*sorted(extra, key=len), *short, option(path))
        kind = kind_of(field.annotation)
        dest = f"field:{path}"  # apart from every other attribute of the namespace
        more: dict[str, Any] = {"action": "append"} if kind == "list" else {}
        if kind == "switch":
            more = {"nargs": "?", "const": True}
        groups[section].add_argument(
            *options,
            dest=dest,
            default=argparse.SUPPRESS,  # absent unless given: the config file's value stands
            metavar=_metavar(path, field, kind),
            help=help_text(field, kind),
            **more,
        )
        flags[dest] = Flag(path, field, kind, options)
    return flags


def _yaml(raw: str, flag: Flag) -> Any:
    if raw.strip() == "None":  # the docstrings' spelling of null
        return None
    try:
        return yaml.safe_load(raw)
    except yaml.YAMLError as e:
        raise ConfigError(f"{flag.options[0]} {raw!r:.200}: not valid YAML: {e}") from None


def given(args: argparse.Namespace, flags: Mapping[str, Flag]) -> dict[str, Any]:
    """The values of the flags given on the command line, by field path."""
    out = {}
    for dest, flag in flags.items():
        if not hasattr(args, dest):
            continue
        raw = getattr(args, dest)
        if flag.kind == "yaml" or (flag.kind == "switch" and raw is not True):
            raw = _yaml(raw, flag)
        out[flag.path] = raw
    return out


def put(data: dict[str, Any], path: str, value: Any) -> None:
    """Set ``a.b.c`` in nested dicts, making the sections on the way.

    >>> d = {"serve": {"port": 1}}
    >>> put(d, "serve.host", "h"); put(d, "loss.kind", "gspo"); d
    {'serve': {'port': 1, 'host': 'h'}, 'loss': {'kind': 'gspo'}}
    """
    *sections_, name = path.split(".")
    node = data
    for i, part in enumerate(sections_):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        elif not isinstance(child, dict):
            raise ConfigError(f"{'.'.join(sections_[: i + 1])} is a value, not a section")
        node = child
    node[name] = value


class HelpFormatter(argparse.HelpFormatter):
    """argparse's, with a flag's value named once after all its names (``--host, --serve.host
    HOST``, as Python 3.13 prints it) and room for the long dotted names."""

    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=32)

    def _format_action_invocation(self, action: argparse.Action) -> str:
        if not action.option_strings or action.nargs == 0:
            return super()._format_action_invocation(action)
        value = self._format_args(action, self._get_default_metavar_for_optional(action))
        return f"{', '.join(action.option_strings)} {value}"
