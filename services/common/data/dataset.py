"""Read and write task rows in verl's schema, as parquet or JSON lines, validating every row.

In: rows from :mod:`relayrl.common.data.tasks` (or any verl-style dataset). Out: ``.parquet``,
``.jsonl`` or ``.json`` files, and back the same Python values: parquet stores a dict
``ground_truth`` (countdown) as a struct and a string one (reverse) as a string, and both read back
as written (a list of ints stays a list of ints). One parquet file holds one column type per
field, so rows whose ``ground_truth`` types differ (different tasks) go to separate files or to
JSON lines.

Schema of a row (verl): ``data_source`` non-empty str; ``prompt`` non-empty list of
``{"role": system|user|assistant, "content": str}``; ``reward_model`` a dict with a
``ground_truth``; optional ``ability`` (str) and ``extra_info`` (dict, ``{}`` when absent). Other
columns pass through. Anything else raises :class:`DatasetError` naming the file, the 0-based row
and the field.
"""

from __future__ import annotations

import codecs
import json
import os
import re
import stat
import tempfile
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

REQUIRED_COLUMNS = ("data_source", "prompt", "reward_model")
ROLES = ("system", "user", "assistant")
EXTENSIONS = (".parquet", ".jsonl", ".json")


class DatasetError(ValueError):
    """A dataset file is missing, unreadable or has a malformed row; the message says where."""


def _type(x: Any) -> str:
    return "null" if x is None else type(x).__name__


def validate_row(row: Any, where: str, env_scored: bool = False) -> dict[str, Any]:
    """Check one row against the schema; return it with ``extra_info`` defaulted to ``{}``.

    ``where`` prefixes every message (e.g. ``"data.parquet: row 3 (0-based)"``). ``env_scored``:
    the rows of episodes, which their environment scores: ``data_source`` and ``reward_model`` may
    be left out (as TRL's datasets do: a prompt and the columns the env's ``reset`` takes), and
    default to ``"env"`` and an empty ground truth.

    >>> good = {"data_source": "x", "prompt": [{"role": "user", "content": "hi"}],
    ...         "reward_model": {"ground_truth": "1"}}
    >>> validate_row(good, "f.jsonl: row 0 (0-based)")["extra_info"]
    {}
    >>> try:
    ...     validate_row({**good, "prompt": [{"role": "bot", "content": "hi"}]}, "f.jsonl: row 0 (0-based)")
    ... except DatasetError as e:
    ...     print(e)
    f.jsonl: row 0 (0-based), column 'prompt'[0].role: expected one of system/user/assistant, got 'bot'
    """

    def fail(field: str, msg: str) -> DatasetError:
        return DatasetError(f"{where}, column {field}: {msg}")

    if not isinstance(row, Mapping):
        raise DatasetError(f"{where}: expected an object with columns, got {_type(row)}")
    if env_scored:
        row = {"data_source": "env", "reward_model": {"ground_truth": ""}, **row}
    for col in REQUIRED_COLUMNS:
        if row.get(col) is None:
            raise fail(f"'{col}'", "missing" if col not in row else "is null")

    source = row["data_source"]
    if not isinstance(source, str) or not source:
        raise fail("'data_source'", f"expected a non-empty string, got {source!r}")

    prompt = row["prompt"]
    if not isinstance(prompt, list) or not prompt:
        raise fail("'prompt'", f"expected a non-empty list of messages, got {prompt!r:.80}")
    for i, msg in enumerate(prompt):
        if not isinstance(msg, Mapping):
            raise fail(f"'prompt'[{i}]", f"expected a {{role, content}} object, got {_type(msg)}")
        for key in ("role", "content"):
            if not isinstance(msg.get(key), str):
                got = "missing" if key not in msg else _type(msg[key])
                raise fail(f"'prompt'[{i}].{key}", f"expected a string, got {got}")
        if msg["role"] not in ROLES:
            raise fail(f"'prompt'[{i}].role", f"expected one of {'/'.join(ROLES)}, got {msg['role']!r}")

    rm = row["reward_model"]
    if not isinstance(rm, Mapping):
        raise fail("'reward_model'", f"expected an object, got {_type(rm)}")
    if rm.get("ground_truth") is None:
        raise fail("'reward_model'.ground_truth", "missing" if "ground_truth" not in rm else "is null")

    if "ability" in row and not isinstance(row["ability"], str):
        raise fail("'ability'", f"expected a string, got {_type(row['ability'])}")
    extra = row.get("extra_info")
    if extra is not None and not isinstance(extra, Mapping):
        raise fail("'extra_info'", f"expected an object, got {_type(extra)}")
    return {**row, "extra_info": dict(extra or {})}


# ---- reading ----------------------------------------------------------------------------------------


def _read_parquet(path: Path) -> list[tuple[str, Any]]:
    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as e:
        raise DatasetError(f"{path}: not a readable parquet file ({e})") from e
    return [(f"{path}: row {i} (0-based)", row) for i, row in enumerate(table.to_pylist())]


def _read_json(path: Path) -> list[tuple[str, Any]]:
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise DatasetError(f"{path}: not UTF-8 text ({e})") from e
    if path.suffix == ".json" and text.lstrip().startswith("["):  # one JSON array of rows
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as e:
            raise DatasetError(f"{path}: line {e.lineno} (1-based): not valid JSON ({e.msg})") from e
        return [(f"{path}: row {i} (0-based)", row) for i, row in enumerate(rows)]
    out = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue  # blank lines carry no row
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise DatasetError(
                f"{path}: line {lineno} (1-based): not valid JSON ({e.msg} at column {e.colno})"
            ) from e
        out.append((f"{path}: row {len(out)} (0-based, line {lineno})", row))
    return out


_READERS: dict[str, Callable[[Path], list[tuple[str, Any]]]] = {
    ".parquet": _read_parquet,
    ".jsonl": _read_json,
    ".json": _read_json,
}


def _suffix(path: Path) -> str:
    if path.suffix not in EXTENSIONS:
        raise DatasetError(
            f"{path}: unknown extension {path.suffix or '(none)'!r}; expected one of {', '.join(EXTENSIONS)}"
        )
    return path.suffix


def load_rows(path: str | os.PathLike[str], env_scored: bool = False) -> list[dict[str, Any]]:
    """All rows of a ``.parquet``, ``.jsonl`` or ``.json`` dataset, each one validated
    (``validate_row``'s ``env_scored``)."""
    path = Path(path)
    suffix = _suffix(path)
    if not path.exists():
        raise DatasetError(f"{path}: no such file")
    if path.is_dir():
        raise DatasetError(f"{path}: is a directory, not a dataset file")
    if path.stat().st_size == 0:
        raise DatasetError(f"{path}: empty file (no rows)")
    raw = _READERS[suffix](path)
    if not raw:
        raise DatasetError(f"{path}: no rows")
    return [validate_row(row, where, env_scored) for where, row in raw]


HEAD_ROWS = 16
"""Rows ``check_head`` validates."""
HEAD_BYTES = 4 << 20
"""Most bytes of a JSON dataset ``check_head`` reads (a parquet file: its footer and first rows)."""


def check_head(path: str | os.PathLike[str], rows: int = HEAD_ROWS, env_scored: bool = False) -> None:
    """Validate the first ``rows`` rows of a dataset file, reading a bounded part of it: what a
    service checks before it accepts a run that reads the whole file later. DatasetError, as
    from ``load_rows``, for a file that is not a regular file, does not parse or has a bad row."""
    path = Path(path)
    suffix = _suffix(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # a FIFO must not block us
    except OSError as e:
        raise DatasetError(f"{path}: cannot read ({e.strerror})") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise DatasetError(f"{path}: not a regular file")
        if st.st_size == 0:
            raise DatasetError(f"{path}: empty file (no rows)")
        raw = (
            _parquet_head(f, path, rows, env_scored)
            if suffix == ".parquet"
            else _json_head(f, path, rows, st.st_size)
        )
    if not raw:
        raise DatasetError(f"{path}: no rows")
    for where, row in raw:
        validate_row(row, where, env_scored)


def _parquet_head(f: Any, path: Path, rows: int, env_scored: bool = False) -> list[tuple[str, Any]]:
    try:
        pf = pq.ParquetFile(f)
        needed = ("prompt",) if env_scored else REQUIRED_COLUMNS
        missing = [c for c in needed if c not in pf.schema_arrow.names]
        if missing:
            raise DatasetError(f"{path}: no column {', '.join(map(repr, missing))}")
        batch = next(pf.iter_batches(batch_size=rows), None)
        first = batch.to_pylist() if batch is not None else []
    except (pa.ArrowException, OSError) as e:
        raise DatasetError(f"{path}: not a readable parquet file ({e})") from e
    return [(f"{path}: row {i} (0-based)", r) for i, r in enumerate(first)]


def _json_head(f: Any, path: Path, rows: int, size: int) -> list[tuple[str, Any]]:
    head = f.read(HEAD_BYTES)
    cut = len(head) < size  # the read stopped inside the file: its last row may be partial
    try:  # incremental: a character cut by the bound is left out, not an error
        text = codecs.getincrementaldecoder("utf-8")().decode(head, final=not cut)
    except UnicodeDecodeError as e:
        raise DatasetError(f"{path}: not UTF-8 text ({e})") from e
    if path.suffix == ".json" and text.lstrip().startswith("["):
        return _array_head(text, path, rows, cut)
    if cut:
        text = text[: text.rfind("\n") + 1]
        if not text.strip():
            raise DatasetError(f"{path}: no complete line in its first {HEAD_BYTES} bytes")
    out = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if len(out) == rows:
            break
        if not line.strip():
            continue
        try:
            out.append((f"{path}: row {len(out)} (0-based, line {lineno})", json.loads(line)))
        except (json.JSONDecodeError, RecursionError) as e:
            raise DatasetError(f"{path}: line {lineno} (1-based): not valid JSON ({e})") from e
    return out


_BETWEEN_ROWS = re.compile(r"[\s,]*")


def _array_head(text: str, path: Path, rows: int, cut: bool) -> list[tuple[str, Any]]:
    """The first rows of one JSON array of rows (``cut``: ``text`` ends inside the file)."""
    decoder, pos, out = json.JSONDecoder(), text.index("[") + 1, []
    while len(out) < rows:
        pos = _BETWEEN_ROWS.match(text, pos).end()
        if pos >= len(text) or text[pos] == "]":
            break
        try:
            row, pos = decoder.raw_decode(text, pos)
        except (json.JSONDecodeError, RecursionError) as e:
            if cut and out:  # possibly the row the read bound cut: the rows before it were good
                break
            raise DatasetError(f"{path}: row {len(out)} (0-based): not valid JSON ({e})") from e
        out.append((f"{path}: row {len(out)} (0-based)", row))
    return out


# ---- writing ----------------------------------------------------------------------------------------


def _checked(rows: Iterable[Mapping[str, Any]], path: Path) -> list[dict[str, Any]]:
    rows = list(rows)
    if not rows:
        raise DatasetError(f"{path}: refusing to write an empty dataset")
    for i, row in enumerate(rows):
        validate_row(row, f"{path}: row {i} (0-based)")
    return [dict(row) for row in rows]


def atomic_write(path: Path, write: Callable[[Path], None]) -> Path:
    """Write through a temporary file in the same folder, so readers never see half a file,
    and flush it to disk before the rename (a power loss then leaves the old file or the new)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(Path(tmp))
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
        folder = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(folder)
        finally:
            os.close(folder)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def write_parquet(rows: Iterable[Mapping[str, Any]], path: str | os.PathLike[str]) -> Path:
    """Write validated rows to ``path`` as parquet (dict fields become structs)."""
    path = Path(path)
    rows = _checked(rows, path)
    if all(not row.get("extra_info") for row in rows):
        # Parquet cannot store a struct with no fields; load_rows restores the {} default.
        rows = [{k: v for k, v in row.items() if k != "extra_info"} for row in rows]
    try:
        table = pa.Table.from_pylist(rows)
    except (pa.ArrowInvalid, pa.ArrowTypeError) as e:
        raise DatasetError(
            f"{path}: rows do not share one column type per field ({e}); "
            "write one task per parquet file, or use .jsonl"
        ) from e
    return atomic_write(path, lambda tmp: pq.write_table(table, tmp))


def write_jsonl(rows: Iterable[Mapping[str, Any]], path: str | os.PathLike[str]) -> Path:
    """Write validated rows to ``path``, one JSON object per line."""
    path = Path(path)
    rows = _checked(rows, path)
    text = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
    return atomic_write(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def write_rows(rows: Iterable[Mapping[str, Any]], path: str | os.PathLike[str]) -> Path:
    """Write by extension: ``.parquet`` as parquet, ``.jsonl``/``.json`` as JSON lines."""
    path = Path(path)
    return write_parquet(rows, path) if _suffix(path) == ".parquet" else write_jsonl(rows, path)
