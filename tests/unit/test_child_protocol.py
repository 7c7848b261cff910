"""The parent/child protocol the GPU transport tests run their receivers with (``tests.kit.child``),
on the CPU: an answer comes back as data, bytes included; a child that fails, dies or hangs fails
the test within its bound, saying why (its traceback, its exit status, what it wrote so far)."""

from __future__ import annotations

import time

import pytest

from tests.kit.child import ChildFailed, run_child

HERE = "tests.unit.test_child_protocol"


def echo(handle: bytes, n: int) -> dict:
    return {"handle": handle[::-1], "n": n + 1, "pair": (1, 2)}


def fail(why: str) -> None:
    raise AttributeError(why)


def die() -> None:
    import os
    import sys

    print("about to die", file=sys.stderr, flush=True)
    os._exit(7)


def hang() -> None:
    import sys

    print("waiting for an event nobody sets", file=sys.stderr, flush=True)
    time.sleep(600)


def test_an_answer_comes_back_as_data():
    assert run_child(f"{HERE}:echo", {"handle": b"\x00\x01\xff", "n": 41}, 60) == {
        "handle": b"\xff\x01\x00",
        "n": 42,
        "pair": [1, 2],
    }


def test_a_child_that_raises_fails_the_test_with_its_traceback():
    with pytest.raises(ChildFailed) as e:
        run_child(f"{HERE}:fail", {"why": "'_CUuuid' object has no attribute 'hex'"}, 60)
    msg = str(e.value)
    assert "exited with status 1 without an answer" in msg
    assert "Traceback" in msg and "AttributeError: '_CUuuid' object has no attribute 'hex'" in msg


def test_a_child_that_dies_says_its_status_and_what_it_wrote():
    with pytest.raises(ChildFailed, match=r"status 7 without an answer; its stderr:\nabout to die"):
        run_child(f"{HERE}:die", {}, 60)


def test_a_child_that_hangs_is_killed_at_the_bound_saying_so():
    t0 = time.monotonic()
    with pytest.raises(
        ChildFailed, match=r"no answer within 10 s \(killed\); its stderr so far:\nwaiting for an event"
    ):
        run_child(f"{HERE}:hang", {}, 10)
    assert time.monotonic() - t0 < 30


def test_a_target_that_cannot_be_imported_says_so():
    with pytest.raises(ChildFailed, match="ModuleNotFoundError: No module named 'tests.unit.no_such_module'"):
        run_child("tests.unit.no_such_module:f", {}, 60)
