"""Checkpoint and export paths name folders on the learner's own filesystem."""

from __future__ import annotations

import pytest
from relayrl.common.rpc import InvalidRequest
from relayrl.learner.servicer import LearnerServicer


@pytest.fixture
def servicer(tmp_path):
    return LearnerServicer(core=None, sync=None, bucket_bytes=1, max_tokens=0, checkpoint_dir=tmp_path / "ck")


def test_relative_paths_resolve_under_the_learners_checkpoint_dir(servicer, tmp_path):
    assert servicer.resolve("") == str(tmp_path / "ck")
    assert servicer.resolve("run-1/checkpoints") == str(tmp_path / "ck" / "run-1" / "checkpoints")
    assert servicer.resolve("/abs/where") == "/abs/where"


@pytest.mark.parametrize("bad", ["../elsewhere", "run/../../x"])
def test_relative_paths_may_not_leave_it(servicer, bad):
    with pytest.raises(InvalidRequest, match=r"'\.\.' is not allowed"):
        servicer.resolve(bad)


def test_a_relative_checkpoint_dir_is_fixed_at_start(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    s = LearnerServicer(core=None, sync=None, bucket_bytes=1, max_tokens=0, checkpoint_dir="ck")
    monkeypatch.chdir("/")
    assert s.resolve("r") == str(tmp_path / "ck" / "r")
