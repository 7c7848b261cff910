"""The data kit's bounds (issue #27): what one request may make a service read or build. A
dataset file is checked from its first rows within a bounded read; generated data is bounded per
row and per file, and its generation stops when asked."""

from __future__ import annotations

import json
import os
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from relayrl.common.data.dataset import HEAD_BYTES, DatasetError, check_head, write_rows
from relayrl.common.data.tasks import GenerationStopped, generate, generate_rows


def test_check_head_reads_the_first_rows_only(tmp_path):
    path = tmp_path / "big.jsonl"
    good = "".join(json.dumps(r) + "\n" for r in generate("reverse", 20, 0))
    path.write_text(good + "not json\n")  # a bad row past the head: load_rows finds it later
    check_head(path)
    path.write_text("not json\n" + good)
    with pytest.raises(DatasetError, match=r"line 1 \(1-based\): not valid JSON"):
        check_head(path)
    path.write_text(good[: good.index("\n")] + "x" * HEAD_BYTES)  # one line longer than the bound
    with pytest.raises(DatasetError, match="no complete line in its first"):
        check_head(path)


@pytest.mark.parametrize("ext", [".parquet", ".jsonl", ".json"])
def test_check_head_accepts_what_load_rows_accepts(tmp_path, ext):
    rows = generate("countdown", 40, 0)
    path = write_rows(rows, tmp_path / f"data{ext}")
    check_head(path)
    array = tmp_path / "array.json"
    array.write_text(json.dumps(rows))
    check_head(array)
    array.write_text(json.dumps(rows)[:-200])  # a cut array: the first rows still check
    check_head(array)


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("bad.parquet", b"PAR1 not parquet", "not a readable parquet file"),
        ("empty.jsonl", b"", "empty file"),
        ("blank.jsonl", b"\n\n", "no rows"),
        ("latin.jsonl", b'{"a": "\xe9"}\n', "not UTF-8"),
        ("row.jsonl", b'{"data_source": "x"}\n', "column 'prompt': missing"),
        ("array.json", b'[{"data_source": "x"}, ', "column 'prompt': missing"),
        ("deep.jsonl", b"[" * 100_000 + b"\n", "not valid JSON"),
        ("fifo.jsonl", None, "not a regular file"),
        ("missing.jsonl", "missing", "cannot read"),
    ],
)
def test_check_head_refuses_what_would_fail_later(tmp_path, name, content, message):
    path = tmp_path / name
    if content is None:
        os.mkfifo(path)  # opened without blocking: no writer needed for the check to return
    elif content != "missing":
        path.write_bytes(content)
    with pytest.raises(DatasetError, match=re.escape(message)):
        check_head(path)


def test_parquet_without_the_schemas_columns_is_refused_from_its_footer(tmp_path):
    path = tmp_path / "other.parquet"
    pq.write_table(pa.table({"text": ["a", "b"]}), path)
    with pytest.raises(DatasetError, match="no column 'data_source', 'prompt', 'reward_model'"):
        check_head(path)


def test_generation_stops_when_asked():
    # A split of a 10-problem space asked for many rows draws up to 200 x n times before it
    # fails: a stopped run must not wait for that.
    asked = []

    def stop() -> bool:
        asked.append(1)
        return len(asked) >= 3

    with pytest.raises(GenerationStopped):
        generate_rows("reverse", 100_000, 0, "test", {"min_len": 1, "max_len": 1}, stop=stop)
    assert len(asked) == 3
    assert generate_rows("reverse", 5, 0, "train", {"max_len": 4}, stop=lambda: False) == generate(
        "reverse", 5, 0, max_len=4
    )


@pytest.mark.parametrize(
    ("task", "params", "message"),
    [
        ("reverse", {"max_len": 5000}, "max_len <= 4096"),
        ("arithmetic", {"max_value": 10**7}, "max_value must be in 1..1000000"),
        ("countdown", {"max_number": 10**7, "max_target": 10**8}, "max_number <= 1000000"),
        ("countdown", {"max_target": 10**13}, "max_target must be in"),
    ],
)
def test_task_parameters_are_bounded(task, params, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        generate(task, 1, 0, **params)
