"""``relayrl serve generator`` on a CPU machine without a C++ compiler (a slim container image):
vLLM's compiled sampler ops must run eagerly instead of killing the engine at the first sample."""

from __future__ import annotations

import shutil

from relayrl import serve_cli


def test_no_compiler_on_a_cpu_turns_dynamo_off(monkeypatch):
    monkeypatch.delenv("TORCHDYNAMO_DISABLE", raising=False)
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setattr(shutil, "which", lambda name: None)
    assert serve_cli.eager_without_compiler() is True
    assert serve_cli.os.environ["TORCHDYNAMO_DISABLE"] == "1"


def test_a_compiler_or_the_operators_choice_leaves_it_alone(monkeypatch):
    monkeypatch.delenv("TORCHDYNAMO_DISABLE", raising=False)
    monkeypatch.setattr(shutil, "which", lambda name: "/usr/bin/g++" if name == "g++" else None)
    assert serve_cli.eager_without_compiler() is False
    assert "TORCHDYNAMO_DISABLE" not in serve_cli.os.environ
    monkeypatch.setenv("TORCHDYNAMO_DISABLE", "0")
    monkeypatch.setattr(shutil, "which", lambda name: None)
    assert serve_cli.eager_without_compiler() is False
    assert serve_cli.os.environ["TORCHDYNAMO_DISABLE"] == "0"
