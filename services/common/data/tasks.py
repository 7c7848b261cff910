"""Deterministic task generators that emit rows in verl's parquet schema.

Three tasks, each small enough for a tiny model and checkable by a rule-based reward:

- ``countdown`` (TinyZero): reach a target with + - * / using every given number once.
- ``arithmetic``: evaluate a 2-3 operand integer expression.
- ``reverse``: reverse a string of digits, optionally with a step-by-step ``<think>`` trace.

Out flows a list of rows, one dict per problem::

    {"data_source": "reverse",
     "prompt": [{"role": "user", "content": "Reverse the digits 48213. Put the answer in ..."}],
     "ability": "string",
     "reward_model": {"style": "rule", "ground_truth": "31284"},
     "extra_info": {"split": "train", "index": 0, "length": 5, "trace": False}}

and :func:`reference_completion` gives the text a perfect model writes for a row (SFT warm starts).

Determinism and splits. ``generate(task, n, seed, split, **params)`` draws from a
``random.Random`` whose seed is derived from (task, split, seed), so the same call always gives the
same rows. Splits are disjoint by construction, whatever the seeds and sizes: every problem has a
canonical key (the digits, the expression, the sorted numbers and target), a hash of the key puts
it in the test bucket (1 in ``TEST_BUCKETS``) or the train bucket, and each split keeps only
problems of its own bucket. Within one call problems are also unique. Everything here is stdlib.
"""

from __future__ import annotations

import ast
import hashlib
import operator
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

SPLITS = ("train", "test")
TEST_BUCKETS = 10
"""One problem in this many (by hash of its key) belongs to the test split, the rest to train."""

ANSWER_TAGS = "Put the answer in <answer> </answer> tags."


# ---- small pure helpers ---------------------------------------------------------------------------


def split_of(task: str, key: str) -> str:
    """The split a problem belongs to, from a stable hash of its canonical key.

    >>> split_of("reverse", "48213")
    'train'
    >>> sorted({split_of("reverse", str(i)) for i in range(100)})
    ['test', 'train']
    """
    digest = hashlib.sha256(f"{task}|{key}".encode()).digest()
    return "test" if int.from_bytes(digest[:8], "big") % TEST_BUCKETS == 0 else "train"


def derive_seed(task: str, split: str, seed: int) -> int:
    """The RNG seed for one (task, split, seed), so splits and tasks draw independent streams.

    >>> derive_seed("reverse", "train", 0) == derive_seed("reverse", "train", 0)
    True
    >>> derive_seed("reverse", "train", 0) == derive_seed("reverse", "test", 0)
    False
    """
    return int.from_bytes(hashlib.sha256(f"relayrl-data|{task}|{split}|{seed}".encode()).digest()[:8], "big")


_OPS: dict[type, tuple[str, Callable[[Fraction, Fraction], Fraction]]] = {
    ast.Add: ("+", operator.add),
    ast.Sub: ("-", operator.sub),
    ast.Mult: ("*", operator.mul),
    ast.Div: ("/", operator.truediv),
}


def _fmt(x: Fraction) -> str:
    return str(x.numerator) if x.denominator == 1 else f"{x.numerator}/{x.denominator}"


def expression_steps(expr: str) -> tuple[Fraction, list[str]]:
    """Evaluate an integer + - * / expression with ``ast`` (never ``eval``), recording each step.

    Steps come in evaluation order, one ``"a op b = c"`` per binary operation.

    >>> value, steps = expression_steps("(19 + 36) * 7 / 5")
    >>> value, steps
    (Fraction(77, 1), ['19 + 36 = 55', '55 * 7 = 385', '385 / 5 = 77'])
    >>> expression_steps("2 ** 3")
    Traceback (most recent call last):
    ...
    ValueError: unsupported expression element: BinOp with Pow
    """
    steps: list[str] = []

    def walk(node: ast.AST) -> Fraction:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return Fraction(node.value)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -walk(node.operand)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            left, right = walk(node.left), walk(node.right)
            sym, fn = _OPS[type(node.op)]
            if sym == "/" and right == 0:
                raise ValueError("division by zero")
            out = fn(left, right)
            steps.append(f"{_fmt(left)} {sym} {_fmt(right)} = {_fmt(out)}")
            return out
        detail = f" with {type(node.op).__name__}" if isinstance(node, ast.BinOp) else ""
        raise ValueError(f"unsupported expression element: {type(node).__name__}{detail}")

    return walk(ast.parse(expr, mode="eval").body), steps


def reverse_trace(digits: str) -> str:
    """The step-by-step reference completion for reversing ``digits``.

    Regular on purpose so a tiny model can learn it: copy the digits one by one (a byte-level
    BPE merges digit runs; spaced digits are one token each), read them back from the last one,
    state the result, then answer. For 8-12 digits this is about 55-90 tokens under a small
    byte-level BPE, so generation carries real weight.

    >>> reverse_trace("4821")
    '<think>digits 4 8 2 1; last digit 1, then 2, then 8, then 4; so 1284</think>\\n<answer>1284</answer>'
    >>> reverse_trace("7")
    '<think>digits 7; last digit 7; so 7</think>\\n<answer>7</answer>'
    """
    rev = digits[::-1]
    return f"<think>digits {' '.join(digits)}; last digit {', then '.join(rev)}; so {rev}</think>\n<answer>{rev}</answer>"


# ---- countdown --------------------------------------------------------------------------------------

_PREC = {"+": 1, "-": 1, "*": 2, "/": 2}
_APPLY = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.floordiv}


@dataclass(frozen=True)
class _Node:
    """An expression tree node: a number (``op`` empty) or ``left op right``."""

    value: int
    op: str = ""
    left: _Node | None = None
    right: _Node | None = None

    def render(self) -> str:
        if not self.op:
            return str(self.value)
        assert self.left is not None and self.right is not None
        lhs, rhs = self.left.render(), self.right.render()
        p = _PREC[self.op]
        if self.left.op and _PREC[self.left.op] < p:
            lhs = f"({lhs})"
        # Right operand of - and / needs parentheses at equal precedence: a - (b - c) != a - b - c.
        if self.right.op and (_PREC[self.right.op] < p or (_PREC[self.right.op] == p and self.op in "-/")):
            rhs = f"({rhs})"
        return f"{lhs} {self.op} {rhs}"


def _random_tree(rng: random.Random, numbers: list[int]) -> _Node:
    """Combine random pairs until one node is left; every intermediate stays a positive integer."""
    nodes = [_Node(n) for n in numbers]
    while len(nodes) > 1:
        i, j = rng.sample(range(len(nodes)), 2)
        a, b = nodes[i], nodes[j]
        ops = ["+", "*"]
        if a.value > b.value:
            ops.append("-")
        if a.value % b.value == 0:
            ops.append("/")
        op = rng.choice(ops)
        node = _Node(_APPLY[op](a.value, b.value), op, a, b)  # "/" is exact: checked just above
        nodes = [n for k, n in enumerate(nodes) if k not in (i, j)] + [node]
    return nodes[0]


@dataclass(frozen=True)
class Problem:
    """One sampled problem before it becomes a row."""

    key: str
    """Canonical identity: decides the split and de-duplicates within a call."""
    prompt: str
    ground_truth: Any
    info: dict[str, Any] = field(default_factory=dict)
    """Task parameters that go into ``extra_info``."""


def _countdown_prompt(numbers: list[int], target: int) -> str:
    return (
        f"Using the numbers {numbers}, create an equation that equals {target}. "
        "You can use basic arithmetic operations (+, -, *, /) and each number can only be used once. "
        "Show your work in <think> </think> tags. And return the final answer in <answer> </answer> tags, "
        "for example <answer> (1 + 2) / 3 </answer>."
    )


def _countdown(
    rng: random.Random, num_numbers: int | None, min_number: int, max_number: int, max_target: int
) -> Problem:
    k = num_numbers if num_numbers is not None else rng.choice((3, 4))
    while True:  # resample until the target is in range (every intermediate is already positive)
        numbers = [rng.randint(min_number, max_number) for _ in range(k)]
        tree = _random_tree(rng, numbers)
        if tree.value <= max_target:
            break
    return Problem(
        key=f"{sorted(numbers)}->{tree.value}",
        prompt=_countdown_prompt(numbers, tree.value),
        ground_truth={"target": tree.value, "numbers": numbers},
        info={"num_numbers": k, "expression": tree.render()},
    )


def _countdown_check(num_numbers: int | None, min_number: int, max_number: int, max_target: int) -> None:
    if num_numbers is not None and not 2 <= num_numbers <= 6:
        raise ValueError(f"num_numbers must be in 2..6 (or None for 3 or 4), got {num_numbers}")
    if not 1 <= min_number <= max_number:
        raise ValueError(f"need 1 <= min_number <= max_number, got {min_number}..{max_number}")
    if max_target < max_number:
        raise ValueError(f"max_target ({max_target}) must be at least max_number ({max_number})")


def _countdown_reference(row: Mapping[str, Any]) -> str:
    expr = (row.get("extra_info") or {}).get("expression")
    if not expr:
        raise ValueError("countdown row has no extra_info['expression'] to build a reference from")
    _, steps = expression_steps(expr)
    return f"<think>{', '.join(steps)}</think>\n<answer>{expr}</answer>"


# ---- arithmetic -------------------------------------------------------------------------------------


def _arithmetic(rng: random.Random, min_operands: int, max_operands: int, max_value: int) -> Problem:
    k = rng.randint(min_operands, max_operands)
    parts = [str(rng.randint(0, max_value))]
    for _ in range(k - 1):
        parts += [rng.choice("+-*"), str(rng.randint(0, max_value))]
    expr = " ".join(parts)
    value, _ = expression_steps(expr)
    return Problem(
        key=expr,
        prompt=f"Compute {expr}. Put the final answer in <answer> </answer> tags.",
        ground_truth=str(int(value)),
        info={"num_operands": k, "expression": expr},
    )


def _arithmetic_check(min_operands: int, max_operands: int, max_value: int) -> None:
    if not 2 <= min_operands <= max_operands <= 6:
        raise ValueError(f"need 2 <= min_operands <= max_operands <= 6, got {min_operands}..{max_operands}")
    if max_value < 1:
        raise ValueError(f"max_value must be >= 1, got {max_value}")


def _answer_reference(row: Mapping[str, Any]) -> str:
    return f"<answer>{row['reward_model']['ground_truth']}</answer>"


# ---- reverse ----------------------------------------------------------------------------------------


def _reverse(rng: random.Random, min_len: int, max_len: int, trace: bool) -> Problem:
    length = rng.randint(min_len, max_len)
    digits = "".join(rng.choice("0123456789") for _ in range(length))
    return Problem(
        key=digits,
        prompt=f"Reverse the digits {digits}. {ANSWER_TAGS}",
        ground_truth=digits[::-1],
        info={"length": length, "trace": bool(trace)},
    )


def _reverse_check(min_len: int, max_len: int, trace: bool) -> None:
    if not 1 <= min_len <= max_len:
        raise ValueError(f"need 1 <= min_len <= max_len, got {min_len}..{max_len}")


def _reverse_reference(row: Mapping[str, Any]) -> str:
    answer = str(row["reward_model"]["ground_truth"])
    if (row.get("extra_info") or {}).get("trace"):
        return reverse_trace(answer[::-1])
    return f"<answer>{answer}</answer>"


# ---- registry ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TaskSpec:
    """One task: how to sample a problem and what a perfect completion is."""

    name: str
    """The row's ``data_source``."""
    ability: str
    """The row's ``ability`` ("math", "string")."""
    defaults: Mapping[str, Any]
    """Every tunable parameter with its default; ``generate`` rejects any other name."""
    sample: Callable[..., Problem]
    """``sample(rng, **params) -> Problem``; all randomness comes from ``rng``."""
    check: Callable[..., None]
    """``check(**params)`` raises ValueError on out-of-range parameters."""
    reference: Callable[[Mapping[str, Any]], str]
    """``reference(row) -> completion`` a perfect model writes."""


TASKS: dict[str, TaskSpec] = {
    "countdown": TaskSpec(
        "countdown",
        "math",
        {"num_numbers": None, "min_number": 1, "max_number": 99, "max_target": 1000},
        _countdown,
        _countdown_check,
        _countdown_reference,
    ),
    "arithmetic": TaskSpec(
        "arithmetic",
        "math",
        {"min_operands": 2, "max_operands": 3, "max_value": 99},
        _arithmetic,
        _arithmetic_check,
        _answer_reference,
    ),
    "reverse": TaskSpec(
        "reverse",
        "string",
        {"min_len": 3, "max_len": 8, "trace": False},
        _reverse,
        _reverse_check,
        _reverse_reference,
    ),
}


def generate(task: str, n: int, seed: int, split: str = "train", **params: Any) -> list[dict[str, Any]]:
    """``n`` distinct rows of ``task`` for ``split``; identical for identical arguments.

    Rows of different splits never share a problem (see the module docstring).

    >>> rows = generate("reverse", 2, seed=0, min_len=4, max_len=4)
    >>> [r["reward_model"]["ground_truth"] for r in rows] == [
    ...     r["reward_model"]["ground_truth"] for r in generate("reverse", 2, 0, min_len=4, max_len=4)]
    True
    >>> rows[0]["extra_info"]["split"], rows[1]["extra_info"]["index"]
    ('train', 1)
    """
    spec = TASKS.get(task)
    if spec is None:
        raise ValueError(f"unknown task {task!r}; expected one of {', '.join(TASKS)}")
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {', '.join(SPLITS)}")
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    unknown = sorted(set(params) - set(spec.defaults))
    if unknown:
        raise ValueError(
            f"{task} takes no parameter(s) {', '.join(unknown)}; known: {', '.join(spec.defaults)}"
        )
    kw = {**spec.defaults, **params}
    spec.check(**kw)

    rng = random.Random(derive_seed(task, split, seed))
    rows: list[dict[str, Any]] = []
    seen: set[str] = set()
    budget = 200 * n + 10_000  # draws; a split has ~1/TEST_BUCKETS or ~all of the problem space
    while len(rows) < n:
        if budget == 0:
            raise ValueError(
                f"{task}: found only {len(rows)} distinct {split} problems of {n} with {kw}; "
                "the problem space is too small (widen the parameters or ask for fewer)"
            )
        budget -= 1
        p = spec.sample(rng, **kw)
        if p.key in seen or split_of(task, p.key) != split:
            continue
        seen.add(p.key)
        rows.append(
            {
                "data_source": task,
                "prompt": [{"role": "user", "content": p.prompt}],
                "ability": spec.ability,
                "reward_model": {"style": "rule", "ground_truth": p.ground_truth},
                "extra_info": {"split": split, "index": len(rows), **p.info},
            }
        )
    return rows


def reference_completion(row: Mapping[str, Any]) -> str:
    """The completion a perfect model writes for ``row`` (dispatch on ``data_source``).

    >>> row = generate("arithmetic", 1, seed=3)[0]
    >>> reference_completion(row) == f"<answer>{row['reward_model']['ground_truth']}</answer>"
    True
    """
    spec = TASKS.get(row.get("data_source", ""))
    if spec is None:
        raise ValueError(
            f"no reference for data_source {row.get('data_source')!r}; known: {', '.join(TASKS)}"
        )
    return spec.reference(row)
