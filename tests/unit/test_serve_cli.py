"""``relayrl serve generator`` on a CPU machine without a C++ compiler (a slim container image):
vLLM's compiled sampler ops must run eagerly instead of killing the engine at the first sample."""

from __future__ import annotations

import shutil

import torch
from relayrl import serve_cli


def _no_dynamo_setting(monkeypatch):
    # set, then deleted: monkeypatch restores "unset" afterwards, whatever the code sets
    monkeypatch.setenv("TORCHDYNAMO_DISABLE", "x")
    monkeypatch.delenv("TORCHDYNAMO_DISABLE")
    monkeypatch.delenv("CXX", raising=False)


def test_no_compiler_with_a_cpu_torch_turns_dynamo_off(monkeypatch):
    _no_dynamo_setting(monkeypatch)
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(shutil, "which", lambda name: None)
    assert serve_cli.eager_without_compiler() is True
    assert serve_cli.os.environ["TORCHDYNAMO_DISABLE"] == "1"


def test_a_compiler_a_gpu_torch_or_the_operators_choice_leave_it_alone(monkeypatch):
    _no_dynamo_setting(monkeypatch)
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(shutil, "which", lambda name: "/usr/bin/g++" if name == "g++" else None)
    assert serve_cli.eager_without_compiler() is False
    monkeypatch.setattr(shutil, "which", lambda name: None)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    assert serve_cli.eager_without_compiler() is False
    assert "TORCHDYNAMO_DISABLE" not in serve_cli.os.environ
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setenv("TORCHDYNAMO_DISABLE", "0")
    assert serve_cli.eager_without_compiler() is False
    assert serve_cli.os.environ["TORCHDYNAMO_DISABLE"] == "0"
