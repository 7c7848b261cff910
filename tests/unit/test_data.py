"""The data kit: task generators, verl-schema files (parquet, jsonl), the ``relayrl data`` command."""

from __future__ import annotations

import argparse
import ast
import json
import re
import subprocess
import sys
from collections import Counter
from fractions import Fraction

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from relayrl.common.data import cli
from relayrl.common.data.dataset import DatasetError, load_rows, write_jsonl, write_parquet, write_rows
from relayrl.common.data.tasks import TASKS, generate, reference_completion, split_of, worked_completion
from relayrl.reward.scorers import SCORERS

TASK_PARAMS = [
    ("countdown", {}),
    ("countdown", {"num_numbers": 3}),
    ("arithmetic", {}),
    ("reverse", {}),
    ("reverse", {"min_len": 8, "max_len": 12, "trace": True}),
]
IDS = [f"{t}-{'-'.join(map(str, p.values())) or 'default'}" for t, p in TASK_PARAMS]


def safe_eval(expr: str) -> tuple[Fraction, list[int]]:
    """Value of an integer + - * / expression and the literals it uses; ``ast`` only, never eval."""
    ops = {
        ast.Add: lambda a, b: a + b,
        ast.Sub: lambda a, b: a - b,
        ast.Mult: lambda a, b: a * b,
        ast.Div: lambda a, b: a / b,
    }
    used: list[int] = []

    def walk(node: ast.AST) -> Fraction:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            used.append(node.value)
            return Fraction(node.value)
        if isinstance(node, ast.BinOp) and type(node.op) in ops:
            return ops[type(node.op)](walk(node.left), walk(node.right))
        raise ValueError(f"not allowed: {ast.dump(node)}")

    return walk(ast.parse(expr, mode="eval").body), used


def answer_of(completion: str) -> str:
    m = re.fullmatch(r"(?s).*<answer>(.*?)</answer>", completion)
    assert m, completion
    return m.group(1).strip()


def content(row: dict) -> str:
    return row["prompt"][0]["content"]


# ---- generators ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(("task", "params"), TASK_PARAMS, ids=IDS)
def test_same_seed_same_rows_other_seed_other_rows(task, params):
    rows = generate(task, 50, seed=7, **params)
    assert rows == generate(task, 50, seed=7, **params)
    assert [content(r) for r in rows] != [content(r) for r in generate(task, 50, seed=8, **params)]


@pytest.mark.parametrize(("task", "params"), TASK_PARAMS, ids=IDS)
def test_schema_and_unique_prompts(task, params):
    rows = generate(task, 100, seed=0, split="test", **params)
    assert len({content(r) for r in rows}) == 100
    for i, r in enumerate(rows):
        assert r["data_source"] == task
        assert r["ability"] == TASKS[task].ability
        assert r["prompt"][0]["role"] == "user" and len(r["prompt"]) == 1
        assert r["reward_model"]["style"] == "rule"
        assert r["extra_info"]["split"] == "test" and r["extra_info"]["index"] == i


@pytest.mark.parametrize(("task", "params"), TASK_PARAMS, ids=IDS)
def test_train_and_test_splits_never_share_a_problem(task, params):
    train = {content(r) for seed in (0, 1) for r in generate(task, 400, seed, split="train", **params)}
    test = {content(r) for seed in (0, 1) for r in generate(task, 100, seed, split="test", **params)}
    assert train and test and not train & test


def test_trace_and_plain_reverse_splits_are_disjoint_too():
    # The split key is the digits, not the completion style.
    train = {content(r) for r in generate("reverse", 300, 0, min_len=3, max_len=3)}
    test = {content(r) for r in generate("reverse", 50, 0, split="test", min_len=3, max_len=3, trace=True)}
    assert not train & test


def test_countdown_is_solvable_by_its_reference_expression():
    for num in (None, 3, 4):
        for row in generate("countdown", 300, seed=1, num_numbers=num):
            gt = row["reward_model"]["ground_truth"]
            target, numbers = gt["target"], gt["numbers"]
            assert type(target) is int and 1 <= target <= 1000
            assert len(numbers) in ((3, 4) if num is None else (num,))
            assert all(type(n) is int and 1 <= n <= 99 for n in numbers)
            assert content(row).startswith(
                f"Using the numbers {numbers}, create an equation that equals {target}. "
            )
            completion = reference_completion(row)
            assert completion.startswith("<think>") and "</think>\n<answer>" in completion
            value, used = safe_eval(answer_of(completion))
            assert value == target
            assert Counter(used) == Counter(numbers)  # every number exactly once


def test_countdown_derivation_ends_at_the_target():
    row = generate("countdown", 1, seed=5)[0]
    think = reference_completion(row).split("</think>")[0].removeprefix("<think>")
    steps = think.split(", ")
    assert len(steps) == row["extra_info"]["num_numbers"] - 1
    assert steps[-1].endswith(f"= {row['reward_model']['ground_truth']['target']}")


def test_arithmetic_answers_are_correct():
    for row in generate("arithmetic", 300, seed=2):
        m = re.fullmatch(r"Compute (.+)\. Put the final answer in <answer> </answer> tags\.", content(row))
        assert m, content(row)
        value, used = safe_eval(m.group(1))
        assert 2 <= len(used) <= 3 and all(0 <= n <= 99 for n in used)
        gt = row["reward_model"]["ground_truth"]
        assert isinstance(gt, str) and gt == str(int(value))
        assert reference_completion(row) == f"<answer>{gt}</answer>"


def test_reverse_answers_are_correct():
    for row in generate("reverse", 300, seed=3, min_len=2, max_len=9):
        m = re.fullmatch(
            r"Reverse the digits (\d+)\. Put the answer in <answer> </answer> tags\.", content(row)
        )
        assert m, content(row)
        digits = m.group(1)
        assert 2 <= len(digits) <= 9 and row["extra_info"]["length"] == len(digits)
        assert row["reward_model"]["ground_truth"] == digits[::-1]
        assert reference_completion(row) == f"<answer>{digits[::-1]}</answer>"


def test_reverse_trace_completions_are_regular_and_end_with_the_answer():
    for row in generate("reverse", 200, seed=4, min_len=8, max_len=12, trace=True):
        assert row["extra_info"]["trace"] is True
        gt = row["reward_model"]["ground_truth"]
        digits = gt[::-1]
        completion = reference_completion(row)
        assert completion.endswith(f"</think>\n<answer>{gt}</answer>")
        assert completion == (
            f"<think>digits {' '.join(digits)}; last digit {', then '.join(gt)}; so {gt}</think>\n<answer>{gt}</answer>"
        )


def test_generate_rejects_bad_arguments():
    with pytest.raises(ValueError, match="unknown task 'sort'"):
        generate("sort", 1, 0)
    with pytest.raises(ValueError, match="unknown split 'val'"):
        generate("reverse", 1, 0, split="val")
    with pytest.raises(ValueError, match="takes no parameter"):
        generate("reverse", 1, 0, num_numbers=3)
    with pytest.raises(ValueError, match="min_len"):
        generate("reverse", 1, 0, min_len=5, max_len=4)
    with pytest.raises(ValueError, match="problem space is too small"):
        generate("reverse", 50, 0, split="test", min_len=1, max_len=1)


@pytest.mark.parametrize(("task", "params"), TASK_PARAMS, ids=IDS)
def test_shots_put_solved_training_problems_before_the_same_rows(task, params):
    plain = generate(task, 20, 0, split="test", **params)
    shot = generate(task, 20, 0, split="test", shots=2, **params)
    for p, s in zip(plain, shot, strict=True):
        # The same problem, ground truth and question; two worked examples ahead of it.
        assert s["reward_model"] == p["reward_model"] and s["prompt"][-1] == p["prompt"][-1]
        assert s["extra_info"] == {**p["extra_info"], "shots": 2}
        turns = s["prompt"][:-1]
        assert [t["role"] for t in turns] == ["user", "assistant"] * 2
        questions = [t["content"] for t in turns[::2]]
        assert len(set(questions)) == 2 and p["prompt"][-1]["content"] not in questions
        for question, answer in zip(questions, [t["content"] for t in turns[1::2]], strict=True):
            # A training problem (a test prompt leaks no test answer), solved correctly.
            key, truth = _problem(task, question)
            assert split_of(task, key) == "train"
            assert SCORERS[task](answer, truth, {}).reward == 1.0, (question, answer)
    assert generate(task, 20, 0, split="test", shots=2, **params) == shot  # deterministic


def _problem(task: str, question: str) -> tuple[str, object]:
    """A question's canonical key and ground truth, read back from its text."""
    if task == "countdown":
        m = re.match(r"Using the numbers \[([\d, ]+)\], create an equation that equals (\d+)\.", question)
        numbers, target = [int(x) for x in m.group(1).split(", ")], int(m.group(2))
        return f"{sorted(numbers)}->{target}", {"numbers": numbers, "target": target}
    if task == "arithmetic":
        expr = re.match(r"Compute (.+?)\. Put", question).group(1)
        return expr, str(eval(expr))  # test-only: our own generated expression
    digits = re.match(r"Reverse the digits (\d+)\.", question).group(1)
    return digits, digits[::-1]


def test_arithmetic_worked_examples_show_the_steps_then_the_answer():
    row = generate("arithmetic", 1, 0, min_operands=3, max_operands=3)[0]
    steps, answer = worked_completion(row).split(", so the answer is ")
    assert answer == f"<answer>{row['reward_model']['ground_truth']}</answer>"
    assert len(steps.split(", ")) == 2  # one "a op b = c" per operation


@pytest.mark.parametrize("shots", [-1, 9, 1.5, True])
def test_shots_out_of_range_are_refused(shots):
    with pytest.raises(ValueError, match="shots must be an integer in 0..8"):
        generate("arithmetic", 1, 0, shots=shots)


# ---- files ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("task", "params"), TASK_PARAMS, ids=IDS)
@pytest.mark.parametrize("ext", [".parquet", ".jsonl", ".json"])
def test_files_round_trip_exactly(tmp_path, task, params, ext):
    rows = generate(task, 30, seed=0, **params)
    path = write_rows(rows, tmp_path / f"d{ext}")
    back = load_rows(path)
    assert back == rows
    gt = back[0]["reward_model"]["ground_truth"]
    if task == "countdown":
        assert all(type(n) is int for n in gt["numbers"]) and type(gt["target"]) is int
    else:
        assert isinstance(gt, str)


def test_extra_info_defaults_to_empty(tmp_path):
    rows = [{k: v for k, v in r.items() if k != "extra_info"} for r in generate("reverse", 3, 0)]
    for path in (write_parquet(rows, tmp_path / "a.parquet"), write_jsonl(rows, tmp_path / "a.jsonl")):
        assert [r["extra_info"] for r in load_rows(path)] == [{}, {}, {}]


def test_json_array_file_loads(tmp_path):
    rows = generate("arithmetic", 3, 0)
    (tmp_path / "a.json").write_text(json.dumps(rows))
    assert load_rows(tmp_path / "a.json") == rows


def test_mixed_tasks_need_jsonl_not_parquet(tmp_path):
    rows = generate("countdown", 2, 0) + generate("reverse", 2, 0)
    with pytest.raises(DatasetError, match="one task per parquet file"):
        write_parquet(rows, tmp_path / "mixed.parquet")
    assert not (tmp_path / "mixed.parquet").exists()
    assert load_rows(write_jsonl(rows, tmp_path / "mixed.jsonl")) == rows


def _good() -> dict:
    return generate("reverse", 1, 0)[0]


def _set(path: list, value):
    """A row from _good() with the field at ``path`` replaced (or deleted when value is ...)."""
    row = json.loads(json.dumps(_good()))
    *head, last = path
    target = row
    for k in head:
        target = target[k]
    if value is ...:
        del target[last]
    else:
        target[last] = value
    return row


MALFORMED = [
    (_set(["data_source"], ...), "column 'data_source': missing"),
    (_set(["data_source"], ""), "column 'data_source': expected a non-empty string"),
    (_set(["prompt"], ...), "column 'prompt': missing"),
    (_set(["prompt"], []), "column 'prompt': expected a non-empty list"),
    (_set(["prompt"], "hello"), "column 'prompt': expected a non-empty list"),
    (
        _set(["prompt", 0, "role"], "bot"),
        "column 'prompt'[0].role: expected one of system/user/assistant, got 'bot'",
    ),
    (_set(["prompt", 0, "content"], 5), "column 'prompt'[0].content: expected a string, got int"),
    (_set(["prompt", 0, "content"], ...), "column 'prompt'[0].content: expected a string, got missing"),
    (_set(["reward_model"], ...), "column 'reward_model': missing"),
    (_set(["reward_model"], "31284"), "column 'reward_model': expected an object, got str"),
    (_set(["reward_model", "ground_truth"], ...), "column 'reward_model'.ground_truth: missing"),
    (_set(["ability"], 3), "column 'ability': expected a string, got int"),
    (_set(["extra_info"], "x"), "column 'extra_info': expected an object, got str"),
    ([1, 2], "expected an object with columns, got list"),
]


@pytest.mark.parametrize(("bad", "message"), MALFORMED, ids=[m for _, m in MALFORMED])
def test_malformed_jsonl_row_names_row_and_column(tmp_path, bad, message):
    path = tmp_path / "data.jsonl"
    lines = [json.dumps(_good()), "", json.dumps(_good()), json.dumps(bad)]  # row 2 sits on line 4
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(DatasetError) as e:
        load_rows(path)
    assert str(e.value).startswith(f"{path}: row 2 (0-based, line 4)")
    assert message in str(e.value)


def test_malformed_parquet_row_names_row_and_column(tmp_path):
    rows = generate("reverse", 20, 0)
    rows[17]["prompt"][0]["role"] = "bot"
    path = tmp_path / "data.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)  # bypasses write_parquet's validation
    with pytest.raises(DatasetError) as e:
        load_rows(path)
    assert str(e.value) == (
        f"{path}: row 17 (0-based), column 'prompt'[0].role: expected one of system/user/assistant, got 'bot'"
    )


def test_null_ground_truth_in_parquet(tmp_path):
    rows = generate("reverse", 3, 0)
    rows[1]["reward_model"]["ground_truth"] = None
    path = tmp_path / "data.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    with pytest.raises(DatasetError, match=r"row 1 \(0-based\), column 'reward_model'.ground_truth: is null"):
        load_rows(path)


def test_write_validates_before_writing(tmp_path):
    rows = generate("reverse", 3, 0)
    rows[2]["data_source"] = ""
    with pytest.raises(DatasetError, match=r"row 2 \(0-based\), column 'data_source'"):
        write_parquet(rows, tmp_path / "out.parquet")
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(DatasetError, match="empty dataset"):
        write_jsonl([], tmp_path / "out.jsonl")


def test_bad_json_line_reports_line_number(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps(_good()) + "\n" + json.dumps(_good()) + "\n{not json\n")
    with pytest.raises(DatasetError, match=r"data.jsonl: line 3 \(1-based\): not valid JSON"):
        load_rows(path)


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        ("missing.jsonl", None, "no such file"),
        ("empty.jsonl", "", "empty file"),
        ("empty.parquet", "", "empty file"),
        ("blank.jsonl", "\n\n", "no rows"),
        ("junk.parquet", "not parquet", "not a readable parquet file"),
        ("data.csv", "a,b\n", "unknown extension '.csv'"),
        ("data", "x", "unknown extension '(none)'"),
    ],
)
def test_unreadable_files_say_why(tmp_path, name, text, message):
    path = tmp_path / name
    if text is not None:
        path.write_text(text)
    with pytest.raises(DatasetError, match=re.escape(message)) as e:
        load_rows(path)
    assert str(e.value).startswith(str(path))


# ---- CLI --------------------------------------------------------------------------------------------


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="relayrl")
    cli.add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(argv)


def test_cli_writes_train_and_test_files(tmp_path, capsys):
    common = ["--min-len", "8", "--max-len", "12", "--trace"]
    train, test = tmp_path / "train.parquet", tmp_path / "test.jsonl"
    args = _parse(["data", "reverse", "--n", "40", "--out", str(train), *common])
    assert args.func(args) == 0
    args = _parse(["data", "reverse", "--n", "10", "--out", str(test), "--split", "test", *common])
    assert args.func(args) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines == [
        f"wrote 40 reverse rows (split=train, seed=0, min_len=8, max_len=12, trace=True) to {train}",
        f"wrote 10 reverse rows (split=test, seed=0, min_len=8, max_len=12, trace=True) to {test}",
    ]
    train_rows, test_rows = load_rows(train), load_rows(test)
    assert train_rows == generate("reverse", 40, 0, min_len=8, max_len=12, trace=True)
    assert not {content(r) for r in train_rows} & {content(r) for r in test_rows}


def test_cli_countdown_num_numbers(tmp_path):
    args = _parse(["data", "countdown", "--n", "5", "--out", str(tmp_path / "c.jsonl"), "--num-numbers", "3"])
    cli.run(args)
    assert {len(r["reward_model"]["ground_truth"]["numbers"]) for r in load_rows(tmp_path / "c.jsonl")} == {3}


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["countdown", "--n", "5", "--out", "c.jsonl", "--trace"],
            "--trace does not apply to task 'countdown'",
        ),
        (["reverse", "--n", "5", "--out", "r.jsonl", "--min-len", "9", "--max-len", "3"], "min_len"),
        (["reverse", "--n", "5", "--out", "r.csv"], "--out must end in one of"),
        (["reverse", "--n", "0", "--out", "r.jsonl"], "--n must be >= 1"),
    ],
)
def test_cli_usage_errors(tmp_path, monkeypatch, argv, message):
    monkeypatch.chdir(tmp_path)
    args = _parse(["data", *argv])
    with pytest.raises(SystemExit, match=re.escape(message)):
        cli.run(args)
    assert list(tmp_path.iterdir()) == []


def test_importing_the_data_kit_stays_light():
    code = (
        "import sys, relayrl.common.data.cli, relayrl.common.data.tasks, relayrl.common.data.dataset\n"
        "print(sorted(m for m in ('torch', 'transformers', 'vllm', 'deepspeed') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_rows_an_env_scores_need_no_reward_columns(tmp_path):
    """TRL's datasets carry a prompt and the columns their env's reset takes: rows of episodes
    (scored by their env) load as they are; single-turn rows still need their reward columns."""
    from relayrl.common.data.dataset import DatasetError, check_head, load_rows

    path = tmp_path / "trl.jsonl"
    path.write_text(json.dumps({"prompt": [{"role": "user", "content": "Play."}], "secret": 7}) + "\n")
    with pytest.raises(DatasetError, match="'data_source': missing"):
        load_rows(path)
    (row,) = load_rows(path, env_scored=True)
    assert row["secret"] == 7 and row["data_source"] == "env" and row["reward_model"] == {"ground_truth": ""}
    check_head(path, env_scored=True)
    with pytest.raises(DatasetError, match="'prompt'"):
        path.write_text(json.dumps({"secret": 7}) + "\n")
        load_rows(path, env_scored=True)
