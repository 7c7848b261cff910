"""relayrl's vLLM general plugin (entry point ``vllm.general_plugins`` in pyproject.toml): vLLM
loads it in each of its processes (the EngineCore, the workers) before the model. It only ties
those processes' lives to their parent's when a relayrl generator started them
(``common.lifeline``); in any other program using vLLM it does nothing."""

from __future__ import annotations


def register() -> None:
    from relayrl.common.lifeline import die_with_parent

    die_with_parent()
