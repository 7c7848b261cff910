"""The engine calls its worker extension's methods by name (vLLM's ``collective_rpc`` takes a
string): every name it uses is one of the extension's methods, and every method the extension
offers to the engine has its name in the table, so a rename cannot break a call silently."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

from relayrl.generator.vllm_weights import Worker
from relayrl.generator.worker_ext import WeightSyncExtension

NAMES = {k: v for k, v in vars(Worker).items() if k.isupper()}
GENERATOR = Path(__file__).resolve().parents[2] / "services" / "generator"


def test_every_name_in_the_table_is_a_method_of_the_extension():
    missing = [
        f"Worker.{k} = {v!r}"
        for k, v in NAMES.items()
        if not inspect.isfunction(getattr(WeightSyncExtension, v, None))
    ]
    assert not missing, missing


def test_every_method_the_extension_offers_is_in_the_table():
    offered = {
        n for n, f in vars(WeightSyncExtension).items() if inspect.isfunction(f) and n.startswith("relayrl_")
    }
    assert offered == set(NAMES.values())


def test_no_worker_method_is_named_by_a_literal_outside_the_table():
    """``collective_rpc("relayrl_...")`` anywhere else would escape the checks above."""
    found = [
        f"{path.name}:{node.lineno} {node.value!r}"
        for path in GENERATOR.glob("*.py")
        if path.name != "vllm_weights.py"  # the table itself
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Constant) and node.value in NAMES.values()
    ]
    assert not found, found
