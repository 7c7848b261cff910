"""Checkpoint and export paths name folders inside the learner's own ``checkpoint_dir``; tags
name one folder. Anything else is refused before any rank does anything."""

from __future__ import annotations

import os

import pytest
from relayrl.common.rpc import InvalidRequest
from relayrl.learner.core import check_tag
from relayrl.learner.export import writable_problem
from relayrl.learner.servicer import LearnerServicer


@pytest.fixture
def servicer(tmp_path):
    (tmp_path / "ck").mkdir()
    return LearnerServicer(core=None, sync=None, bucket_bytes=1, max_tokens=0, checkpoint_dir=tmp_path / "ck")


def test_paths_resolve_inside_the_learners_checkpoint_dir(servicer, tmp_path):
    ck = tmp_path / "ck"
    assert servicer.resolve("") == str(ck)
    assert servicer.resolve("run-1/checkpoints") == str(ck / "run-1" / "checkpoints")
    assert servicer.resolve(str(ck / "abs" / "inside")) == str(ck / "abs" / "inside")


@pytest.mark.parametrize(
    "bad",
    ["../elsewhere", "run/../../x", "sub/../../../x", "/abs/where", "/", "x\0y", "a" * 2000],
)
def test_paths_may_not_leave_it(servicer, bad):
    with pytest.raises(
        InvalidRequest, match=r"outside the learner's checkpoint_dir|'\.\.' is not allowed|no NUL"
    ):
        servicer.resolve(bad)


def test_a_symbolic_link_out_of_it_is_refused(servicer, tmp_path):
    (tmp_path / "outside").mkdir()
    os.symlink(tmp_path / "outside", tmp_path / "ck" / "door")
    with pytest.raises(InvalidRequest, match="outside the learner's checkpoint_dir"):
        servicer.resolve("door/x")


def test_a_relative_checkpoint_dir_is_fixed_at_start(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    s = LearnerServicer(core=None, sync=None, bucket_bytes=1, max_tokens=0, checkpoint_dir="ck")
    monkeypatch.chdir("/")
    assert s.resolve("r") == str(tmp_path / "ck" / "r")


@pytest.mark.parametrize("tag", ["step20", "s2", "final.v1", "a_b-c"])
def test_plain_tags_pass(tag):
    assert check_tag(tag) == tag


@pytest.mark.parametrize("tag", ["", ".", "..", "../x", "a/b", "/abs", "x\0", ".hidden", "t" * 129, "é"])
def test_tags_that_are_not_one_plain_folder_name_are_refused(tag):
    with pytest.raises(InvalidRequest, match="letters, digits"):
        check_tag(tag)


def test_writable_problem_looks_without_creating(tmp_path):
    assert writable_problem(tmp_path / "a" / "b" / "c") == ""
    assert not (tmp_path / "a").exists()
    (tmp_path / "file").write_text("x")
    assert writable_problem(tmp_path / "file" / "sub") == f"{tmp_path / 'file'} is not a folder"
