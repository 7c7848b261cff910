"""Built-in scorers as pure functions: TinyZero countdown rules, numbers, strings, GSM8K, MATH, format.

Every case goes through the wire form of the ground truth (``encode_ground_truth`` then
``decode_ground_truth``), as the service sees it.
"""

from __future__ import annotations

import time

import pytest
from relayrl.common.data.tasks import generate, reference_completion
from relayrl.reward.scorers import (
    SCORERS,
    ScoreResult,
    check_result,
    decode_ground_truth,
    encode_ground_truth,
    extract_boxed,
)


def score(source: str, completion: str, ground_truth, extra_info: dict | None = None) -> ScoreResult:
    return SCORERS[source](
        completion, decode_ground_truth(encode_ground_truth(ground_truth)), extra_info or {}
    )


@pytest.mark.parametrize("task", ["countdown", "arithmetic", "reverse"])
def test_reference_completions_of_every_task_score_one(task):
    rows = generate(task, 40, seed=5) + generate(task, 10, seed=5, split="test")
    if task == "reverse":
        rows += generate(task, 10, seed=6, trace=True)
    for row in rows:
        r = score(task, reference_completion(row), row["reward_model"]["ground_truth"], row["extra_info"])
        assert r == ScoreResult(1.0, {"format": 1.0, "correctness": 1.0}), (row, r)


COUNTDOWN = {"target": 24, "numbers": [3, 4, 6, 8]}


@pytest.mark.parametrize(
    ("answer", "reward"),
    [
        ("(8 - 6) * 3 * 4", 1.0),
        ("4 * (8 - 6) * 3", 1.0),  # any order
        ("((8 - 6)) * (3 * 4)", 1.0),  # redundant parentheses
        ("3 * 8 / (6 - 4) * 2", 0.1),  # 2 is not given
        ("8 * 3 * 4 / 4", 0.1),  # 4 reused, 6 missing
        ("8 * 3", 0.1),  # numbers missing
        ("(8 - 6) * 3 * 4 + 0", 0.1),  # an extra number
        ("(8 - 6) * 3 * 4 * 1", 0.1),  # an extra number that keeps the value
        ("3 + 4 + 6 + 8", 0.1),  # every number once, wrong value (21)
        ("3 * 4 * 6 / (8 - 8)", 0.1),  # division by zero
        ("(8 - 6 * 3 * 4", 0.1),  # unbalanced parenthesis
        ("8 - 6) * 3 * 4", 0.1),
        ("9**9**9**9", 0.1),  # powers are not allowed at all
        ("3 ** 2 + 6 + 8 - 4 + 4", 0.1),
        ("(8 - 6) * 3 * 4 = 24", 0.1),  # not an expression
        ("abs(-24) + 3 - 3", 0.1),  # calls are not allowed
        ("__import__('os')", 0.1),
        ("(8.0 - 6) * 3 * 4", 0.1),  # floats are not the given integers
        ("", 0.1),
        # Python's other integer spellings and comments are not what a person calls numbers
        ("(0x8 - 6) * 3 * 4", 0.1),
        ("(0o10 - 6) * 3 * 4", 0.1),
        ("(0b1000 - 6) * 3 * 4", 0.1),
        ("(8 - 6) * 3 * 4_0 / 10", 0.1),
        ("(8 - 6) * 3 * 4  # done", 0.1),
        ("-" * 900 + "(8 - 6) * 3 * 4", 0.1),  # 900 unary minus signs: nested past any equation
    ],
)
def test_countdown_follows_tinyzero_rules(answer, reward):
    r = score("countdown", f"<think>x</think>\n<answer>{answer}</answer>", COUNTDOWN)
    assert r.reward == reward
    assert r.components == {"format": 1.0, "correctness": float(reward == 1.0)}


def test_countdown_needs_answer_tags_and_reads_the_last_one():
    assert score("countdown", "(8 - 6) * 3 * 4", COUNTDOWN).reward == 0.0
    assert score("countdown", "<answer>(8 - 6) * 3 * 4", COUNTDOWN).reward == 0.0  # unclosed
    two = "<answer>3 + 4 + 6 + 8</answer> no wait <answer>(8 - 6) * 3 * 4</answer>"
    assert score("countdown", two, COUNTDOWN).reward == 1.0
    assert score("countdown", two.replace("(8 - 6) * 3 * 4", "8 * 3"), COUNTDOWN).reward == 0.1


def test_countdown_exact_fractions():
    gt = {"target": 96, "numbers": [24, 1, 3, 4]}
    assert score("countdown", "<answer>24 / (1 - 3 / 4)</answer>", gt).reward == 1.0
    # 1/3 * 3 is exactly 1 with fractions, never 0.9999999
    assert (
        score("countdown", "<answer>(1 / 3 * 3) * 2</answer>", {"target": 2, "numbers": [1, 3, 3, 2]}).reward
        == 1.0
    )


@pytest.mark.parametrize(
    "answer",
    [
        "9**9**9**9",
        "(" * 100_000 + "8" + ")" * 100_000,
        "9" * 100_000,
        " * ".join(["99"] * 400),
        "<answer>" * 50_000,
    ],
)
def test_pathological_countdown_answers_are_rejected_quickly(answer):
    t0 = time.monotonic()
    r = score("countdown", f"<answer>{answer}</answer>", COUNTDOWN)
    assert time.monotonic() - t0 < 0.5
    assert r.components["correctness"] == 0.0
    assert score("countdown", answer, COUNTDOWN).reward == 0.0  # no tags: no format credit either


def test_countdown_with_unusable_ground_truth_raises():
    with pytest.raises(ValueError, match="countdown ground_truth"):
        score("countdown", "<answer>1</answer>", "24")


@pytest.mark.parametrize(
    ("answer", "truth", "correct"),
    [("42", "42", True), ("42.0", "42", True), ("-7", "-7", True), ("1,234", "1234", True),
     ("41", "42", False), ("forty-two", "42", False), ("", "42", False)],
)  # fmt: skip
def test_arithmetic_is_numeric_equality(answer, truth, correct):
    assert score("arithmetic", f"<answer>{answer}</answer>", truth).components == {
        "format": 1.0, "correctness": float(correct)}  # fmt: skip


def test_reverse_is_exact_string_equality():
    assert score("reverse", "<answer>04821</answer>", "04821").reward == 1.0  # leading zero kept
    assert score("reverse", "<answer>4821</answer>", "04821").reward == 0.1
    assert score("reverse", "<think>d</think>\n<answer> 123 </answer>", "123").reward == 1.0
    assert score("reverse", "123", "123").reward == 0.0


@pytest.mark.parametrize("source", ["gsm8k", "openai/gsm8k"])
@pytest.mark.parametrize(
    ("completion", "truth", "reward"),
    [
        ("So 3 * 400 + 34 = 1234.\n#### 1,234", "1234", 1.0),
        ("#### 1234", "Natalia sold 48/2 = 24 clips...\n#### 1,234", 1.0),
        ("#### $1,234.00", "1234", 1.0),
        ("first #### 12 then #### 1234", "1234", 1.0),  # the last one
        ("<answer>The total is 1,234 dollars</answer>", "1234", 1.0),
        ("#### 1243", "1234", 0.0),
        ("The answer is 1234.", "1234", 0.0),  # no #### and no tag: not read
        ("#### -5", "-5", 1.0),
    ],
)
def test_gsm8k_reads_the_last_hashes_or_the_answer_tag(source, completion, truth, reward):
    assert score(source, completion, truth).reward == reward


@pytest.mark.parametrize("source", ["math", "lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval"])
@pytest.mark.parametrize(
    ("answer", "truth", "correct"),
    [
        (r"0.5", r"\frac{1}{2}", True),
        (r"\frac{1}{2}", r"0.5", True),
        (r"\dfrac{1}{2}", r"\frac12", True),
        (r"\frac{\sqrt{2}}{2}", r"\sqrt{2}/2", True),
        (r"x(x+2)", r"x^2+2x", True),
        (r"3.0", r"3", True),
        (r"\frac{1}{3}", r"\frac{1}{2}", False),
        (r"", r"\frac{1}{2}", False),
        (r"\frac{1}{2}", r"The answer is $\boxed{\frac{2}{4}}$.", True),  # a whole solution as truth
    ],
)
def test_math_uses_the_last_boxed_answer_and_math_verify(source, answer, truth, correct):
    r = score(source, rf"Some work... \boxed{{{answer}}}", truth)
    assert r.components == {"format": 1.0, "correctness": float(correct)}
    assert r.reward == float(correct)


def test_math_boxed_extraction():
    assert extract_boxed(r"\boxed{1} and finally \boxed{\frac{\{a\}}{2}}") == r"\frac{\{a\}}{2}"
    assert score("math", r"\boxed{1} no, \boxed{2}", "2").reward == 1.0
    assert score("math", r"the answer is 0.5", r"\frac{1}{2}").components == {
        "format": 0.0,
        "correctness": 0.0,
    }
    assert score("math", r"\boxed{\frac{1}{2}", r"\frac{1}{2}").reward == 0.0  # unbalanced


def test_format_reward_wants_think_then_answer():
    assert score("format", "<think>a</think>\n<answer>1</answer>", "").reward == 1.0
    for bad in ("<answer>1</answer>", "<think>a</think>", "<answer>1</answer><think>a</think>",
                "<think>a</think><answer>1</answer><answer>2</answer>"):  # fmt: skip
        assert score("format", bad, "").reward == 0.0


@pytest.mark.parametrize(
    "value", ["1", True, None, [1.0], float("inf"), {"reward": "1"}, {"reward": 1, "components": {"a": float("nan")}},
              {"reward": 1, "components": {1: 1.0}}, {"reward": 1, "components": [1]}],
)  # fmt: skip
def test_check_result_rejects_garbage(value):
    with pytest.raises((TypeError, ValueError)):
        check_result(value)


# Completions built to make a careless parser slow: long runs after a marker, deep nesting, markers
# repeated thousands of times. ~1 MB each; linear work takes milliseconds, quadratic takes hours.
_MB = 1 << 20
HOSTILE = {
    "spaces after ####": "#### " + " " * _MB,
    "#### repeated": "#### $ " * (_MB // 7),
    "spaces after <answer>": "<answer>" + " " * _MB + "</answer>",
    "answer tags repeated": "<answer>" * (_MB // 8),
    "digits and commas": "<answer>" + "1," * (_MB // 2) + "</answer>",
    "nested braces": "\\boxed{" + "{" * _MB + "}",
    "boxed repeated": "\\boxed{" * (_MB // 7),
    "long boxed answer": "\\boxed{" + "1+" * (_MB // 2) + "1}",
    "think tags repeated": "<think>" * (_MB // 7) + "</think><answer>1</answer>",
    "unary minus": "<answer>" + "-" * _MB + "1</answer>",
    "parentheses": "<answer>" + "(" * (_MB // 2) + "1" + ")" * (_MB // 2) + "</answer>",
    "code fences repeated": "```python\n" * (_MB // 10),
}
TRUTH = {
    "countdown": COUNTDOWN,
    "arithmetic": "42",
    "reverse": "1284",
    "gsm8k": "1234",
    "math": "\\frac{1}{2}",
    "format": "",
    "code": '[{"input": "", "output": "1"}]',  # each completion runs once, in the sandbox
}


@pytest.mark.parametrize("source", sorted(SCORERS))
def test_every_scorer_does_bounded_work_on_hostile_completions(source):
    """No scorer may stall a worker: every built-in one reads a 1 MB hostile completion in well
    under a second (the quadratic GSM8K regex took 77 s on 100 KB)."""
    family = next(f for f in TRUTH if f in source.lower())
    for name, completion in HOSTILE.items():
        t0 = time.monotonic()
        r = score(source, completion, TRUTH[family])
        took = time.monotonic() - t0
        assert took < 2.0, f"{source} on {name!r}: {took:.1f}s"
        assert r.components.get("correctness", 0.0) == 0.0, (source, name)
