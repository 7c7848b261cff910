"""A function run in a fresh Python process, for tests that need a second process of their own
(CUDA IPC between two processes on one GPU): what it returns, or why it did not, within a bound.

    got = run_child("tests.integration.test_weight_transports_gpu:receive", {"fields": f}, 120)

The child is ``python -c`` in the repository root (it imports ``target``, ``module:function``,
afresh: nothing is inherited from the test's process, CUDA included). Keyword arguments go in
and the result comes out as JSON (bytes as ``{"__bytes__": hex}``), never pickle. A child that
raises, exits or dies without answering fails the test with its exit status and the end of its
stderr (the traceback); one silent past ``timeout_s`` is killed and fails it saying so, with
what it wrote so far. (A spawned ``multiprocessing.Process`` that died before putting its
answer on a queue left its parent waiting out the queue's timeout, with nothing to say why.)
"""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ANSWER = "relayrl-child-answer:"
TAIL = 4000  # characters of the child's stderr an error quotes


class ChildFailed(AssertionError):
    """The child gave no answer: the message says why (exit status or timeout, its stderr)."""


def run_child(target: str, kwargs: dict, timeout_s: float) -> object:
    """``target(**kwargs)`` in a fresh process; its return value (see the module docstring)."""
    code = "from tests.kit.child import main; main()"
    try:
        done = subprocess.run(
            [sys.executable, "-c", code, target],
            input=json.dumps(encode(kwargs)),
            capture_output=True,
            text=True,
            timeout=timeout_s,
            cwd=ROOT,
        )
    except subprocess.TimeoutExpired as e:
        raise ChildFailed(
            f"{target} gave no answer within {timeout_s:g} s (killed); its stderr so far:\n{tail(e.stderr)}"
        ) from None
    answers = [line for line in done.stdout.splitlines() if line.startswith(ANSWER)]
    if done.returncode != 0 or not answers:
        raise ChildFailed(
            f"{target} exited with status {done.returncode} without an answer; its stderr:\n{tail(done.stderr)}"
        )
    return decode(json.loads(answers[-1][len(ANSWER) :]))


def main() -> None:
    """The child's side: read the arguments, call the target, write its answer on one line."""
    module, _, name = sys.argv[1].partition(":")
    kwargs = decode(json.loads(sys.stdin.read()))
    result = getattr(importlib.import_module(module), name)(**kwargs)
    print(ANSWER + json.dumps(encode(result)), flush=True)


def tail(text: str | bytes | None) -> str:
    """The end of a child's output, as text ("(nothing)" when it wrote none)."""
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    text = (text or "").strip()
    return text[-TAIL:] if text else "(nothing)"


def encode(value):
    """``value`` as JSON-ready data: bytes become ``{"__bytes__": hex}``, tuples lists.

    >>> encode({"h": b"\\x01\\xff", "n": (1, 2)})
    {'h': {'__bytes__': '01ff'}, 'n': [1, 2]}
    >>> decode(encode({"h": b"\\x01\\xff"}))
    {'h': b'\\x01\\xff'}
    """
    if isinstance(value, bytes):
        return {"__bytes__": value.hex()}
    if isinstance(value, dict):
        return {k: encode(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [encode(v) for v in value]
    return value


def decode(value):
    if isinstance(value, dict):
        if set(value) == {"__bytes__"}:
            return bytes.fromhex(value["__bytes__"])
        return {k: decode(v) for k, v in value.items()}
    if isinstance(value, list):
        return [decode(v) for v in value]
    return value
