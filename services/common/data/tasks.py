"""Deterministic task generators that emit rows in verl's parquet schema.

Five tasks, each small enough for a tiny model and checkable by a rule-based reward:

- ``countdown`` (TinyZero): reach a target with + - * / using every given number once.
- ``arithmetic``: evaluate a 2-3 operand integer expression.
- ``reverse``: reverse a string of digits, optionally with a step-by-step ``<think>`` trace.
- ``calc`` (multi-turn, env ``calc``): multiply two numbers, with a calculator tool.
- ``guess`` (multi-turn, env ``guess``): find a hidden number from higher/lower answers.

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

import hashlib
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from relayrl.common.data.expressions import expression_steps, random_tree, reverse_trace
from relayrl.common.data.gym import is_gym
from relayrl.common.data.gym import rows as gym_rows

SPLITS = ("train", "test")
TEST_BUCKETS = 10
"""One problem in this many (by hash of its key) belongs to the test split, the rest to train."""
MAX_SHOTS = 8
"""Most worked examples a prompt may carry (``shots``)."""

ANSWER_TAGS = "Put the answer in <answer> </answer> tags."
MAX_NUMBER = 10**6
"""Largest operand of countdown and arithmetic (countdown's target: its square): far past what a
model learns, and small enough that no row's text grows without bound."""
MAX_DIGITS = 4096
"""Longest digit string of ``reverse``."""


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


# ---- countdown --------------------------------------------------------------------------------------


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
        tree = random_tree(rng, numbers)
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
    if not 1 <= min_number <= max_number <= MAX_NUMBER:
        raise ValueError(
            f"need 1 <= min_number <= max_number <= {MAX_NUMBER}, got {min_number}..{max_number}"
        )
    if not max_number <= max_target <= MAX_NUMBER**2:
        raise ValueError(
            f"max_target must be in max_number..{MAX_NUMBER**2} ({max_number}..), got {max_target}"
        )


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
    if not 1 <= max_value <= MAX_NUMBER:
        raise ValueError(f"max_value must be in 1..{MAX_NUMBER}, got {max_value}")


def _answer_reference(row: Mapping[str, Any]) -> str:
    return f"<answer>{row['reward_model']['ground_truth']}</answer>"


def _arithmetic_worked(row: Mapping[str, Any]) -> str:
    # The steps before the tags: a small model shown a bare "<answer>5</answer>" copies the tags
    # and skips the arithmetic (SmolLM2-135M: greedy accuracy 0.08 against 0.92 with the steps).
    _, steps = expression_steps(row["extra_info"]["expression"])
    return f"{', '.join(steps)}, so the answer is <answer>{row['reward_model']['ground_truth']}</answer>"


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
    if not 1 <= min_len <= max_len <= MAX_DIGITS:
        raise ValueError(f"need 1 <= min_len <= max_len <= {MAX_DIGITS}, got {min_len}..{max_len}")


def _reverse_reference(row: Mapping[str, Any]) -> str:
    answer = str(row["reward_model"]["ground_truth"])
    if (row.get("extra_info") or {}).get("trace"):
        return reverse_trace(answer[::-1])
    return f"<answer>{answer}</answer>"


# ---- calc (multi-turn: the calc tool of the env service) -------------------------------------------


def _calc(rng: random.Random, min_digits: int, max_digits: int) -> Problem:
    a, b = (
        rng.randint(10 ** (rng.randint(min_digits, max_digits) - 1), 10**max_digits - 1) for _ in range(2)
    )
    return Problem(
        key=f"{a}*{b}",
        prompt=f"What is {a} * {b}? End with the answer as a number.",
        ground_truth=str(a * b),
        info={"expression": f"{a} * {b}"},
    )


def _calc_check(min_digits: int, max_digits: int) -> None:
    if not 1 <= min_digits <= max_digits <= 6:
        raise ValueError(f"need 1 <= min_digits <= max_digits <= 6, got {min_digits}..{max_digits}")


def _calc_reference(row: Mapping[str, Any]) -> str:
    return f"The answer is {row['reward_model']['ground_truth']}."


# ---- guess (multi-turn: feedback, no tools) ---------------------------------------------------------


def _guess(rng: random.Random, low: int, high: int) -> Problem:
    hidden = rng.randint(low, high)
    # Distinct problems need distinct keys: a small range has few numbers, so the draw's index
    # tells rows apart (the env derives nothing from it; the ground truth is the number).
    return Problem(
        key=f"{low}-{high}-{hidden}-{rng.getrandbits(32)}",
        prompt=(
            f"I am thinking of a number from {low} to {high}. Guess it: write <guess>N</guess>. "
            "I answer higher, lower or correct."
        ),
        ground_truth=str(hidden),
        info={"low": low, "high": high},
    )


def _guess_check(low: int, high: int) -> None:
    if not 1 <= low < high <= 1_000_000:
        raise ValueError(f"need 1 <= low < high <= 1000000, got {low}..{high}")


def _guess_reference(row: Mapping[str, Any]) -> str:
    return f"<guess>{row['reward_model']['ground_truth']}</guess>"


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
    worked: Callable[[Mapping[str, Any]], str] | None = None
    """``worked(row) -> completion`` shown in a worked example (``shots``); None: ``reference``."""


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
        _arithmetic_worked,
    ),
    "reverse": TaskSpec(
        "reverse",
        "string",
        {"min_len": 3, "max_len": 8, "trace": False},
        _reverse,
        _reverse_check,
        _reverse_reference,
    ),
    "calc": TaskSpec("calc", "math", {"min_digits": 3, "max_digits": 3}, _calc, _calc_check, _calc_reference),
    "guess": TaskSpec("guess", "game", {"low": 1, "high": 63}, _guess, _guess_check, _guess_reference),
}
SINGLE_TURN_TASKS = ("arithmetic", "countdown", "reverse")
"""The tasks a single completion answers (the others are multi-turn: an env service's episodes)."""


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
    return generate_rows(task, n, seed, split, params)


class GenerationStopped(Exception):
    """``generate_rows`` was told to stop before it had every row."""


STOP_EVERY = 1024
"""Draws between two questions to ``generate_rows``'s ``stop``."""


def generate_rows(
    task: str,
    n: int,
    seed: int,
    split: str = "train",
    params: Mapping[str, Any] | None = None,
    stop: Callable[[], bool] | None = None,
) -> list[dict[str, Any]]:
    """``generate`` with the task's parameters as a mapping, and ``stop``, asked every
    ``STOP_EVERY`` draws: once it answers true, GenerationStopped (a coordinator preparing the
    data of a run that was stopped meanwhile, from another thread, gives up at once)."""
    params = dict(params or {})
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {', '.join(SPLITS)}")
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if is_gym(task):  # any reasoning-gym task, by name
        return gym_rows(task, n, seed, split, params)
    spec = TASKS.get(task)
    if spec is None:
        raise ValueError(f"unknown task {task!r}; expected one of {', '.join(TASKS)}")
    shots = params.pop("shots", 0)
    unknown = sorted(set(params) - set(spec.defaults))
    if unknown:
        raise ValueError(
            f"{task} takes no parameter(s) {', '.join(unknown)}; known: {', '.join(spec.defaults)}, shots"
        )
    if type(shots) is not int or not 0 <= shots <= MAX_SHOTS:
        raise ValueError(f"shots must be an integer in 0..{MAX_SHOTS}, got {shots!r}")
    kw = {**spec.defaults, **params}
    spec.check(**kw)
    # Examples come from a stream of their own, so rows are the same problems with or without them.
    shot_rng = random.Random(derive_seed(task, "shots", seed))

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
        if stop is not None and budget % STOP_EVERY == 0 and stop():
            raise GenerationStopped(f"{task}: stopped after {len(rows)} of {n} {split} rows")
        p = spec.sample(rng, **kw)
        if p.key in seen or split_of(task, p.key) != split:
            continue
        seen.add(p.key)
        examples = _worked_examples(task, spec, kw, shot_rng, shots, p.key) if shots else []
        rows.append(
            {
                "data_source": task,
                "prompt": [*examples, {"role": "user", "content": p.prompt}],
                "ability": spec.ability,
                "reward_model": {"style": "rule", "ground_truth": p.ground_truth},
                "extra_info": {
                    "split": split,
                    "index": len(rows),
                    **p.info,
                    **({"shots": shots} if shots else {}),
                },
            }
        )
    return rows


def _worked_examples(
    task: str, spec: TaskSpec, kw: Mapping[str, Any], rng: random.Random, shots: int, own_key: str
) -> list[dict[str, str]]:
    """``shots`` solved problems as earlier chat turns (user, then assistant): few-shot prompting
    for instruction models that do not follow an answer format from the instruction alone. They
    are training-split problems, never the row's own, so a test prompt leaks no test answer."""
    turns: list[dict[str, str]] = []
    keys = {own_key}
    for _ in range(1000 * shots):  # draws; the train split holds ~90 % of every problem space
        if len(turns) == 2 * shots:
            break
        p = spec.sample(rng, **kw)
        if p.key in keys or split_of(task, p.key) != "train":
            continue
        keys.add(p.key)
        row = {"data_source": task, "reward_model": {"ground_truth": p.ground_truth}, "extra_info": p.info}
        turns += [
            {"role": "user", "content": p.prompt},
            {"role": "assistant", "content": worked_completion(row)},
        ]
    if len(turns) < 2 * shots:
        raise ValueError(f"{task}: could not draw {shots} distinct worked examples with {dict(kw)}")
    return turns


def worked_completion(row: Mapping[str, Any]) -> str:
    """The completion a worked example shows for ``row``: the steps, then the answer.

    >>> row = generate("arithmetic", 1, seed=0, min_operands=2, max_operands=2)[0]
    >>> e = row["extra_info"]["expression"]
    >>> worked_completion(row).startswith(e + " = ")
    True
    """
    spec = _spec_of(row)
    return (spec.worked or spec.reference)(row)


def reference_completion(row: Mapping[str, Any]) -> str:
    """The completion a perfect model writes for ``row`` (dispatch on ``data_source``).

    >>> row = generate("arithmetic", 1, seed=3)[0]
    >>> reference_completion(row) == f"<answer>{row['reward_model']['ground_truth']}</answer>"
    True
    """
    return _spec_of(row).reference(row)


def _spec_of(row: Mapping[str, Any]) -> TaskSpec:
    spec = TASKS.get(row.get("data_source", ""))
    if spec is None:
        raise ValueError(
            f"no reference for data_source {row.get('data_source')!r}; known: {', '.join(TASKS)}"
        )
    return spec
