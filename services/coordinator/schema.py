"""The experiment config as a JSON Schema, for clients and editors that do not run Python.

``experiment_schema()`` builds it from the pydantic models (``ExperimentConfig`` and the service
sections it holds): every field with its type, bounds, default and allowed values, its docstring as
``description`` (``StrictModel`` sets ``use_attribute_docstrings``), unknown fields refused
(``additionalProperties: false``). ``scripts/gen_protos.py`` writes it to
``schemas/experiment.schema.json`` beside the generated gRPC code, and ``--check`` fails when the
committed file differs from a fresh build, so a config change without the file is caught by the
test command like a stale proto.

The schema states structure and per-field bounds; checks across fields (``ExperimentConfig``'s
validators: a critic only with ``gae``, ``sampling.n`` within ``generator_samples_per_call``, ...)
and a task's ``data.generate.params`` remain the coordinator's, which answers a bad config with
INVALID_ARGUMENT naming the field. A YAML experiment file is validated as the JSON it parses to.
"""

from __future__ import annotations

import json
from typing import Any

from relayrl.coordinator import algorithms
from relayrl.coordinator.config import ExperimentConfig

SCHEMA_DIALECT = "https://json-schema.org/draft/2020-12/schema"
SCHEMA_PATH = "schemas/experiment.schema.json"
"""Where ``scripts/gen_protos.py`` writes the schema, relative to the repository."""


def experiment_schema() -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of an experiment file: ``ExperimentConfig``'s, with what
    pydantic cannot say from a type alone: ``algorithm.advantage`` is one of the names the
    registered algorithm families serve (``coordinator/algorithms``)."""
    schema: dict[str, Any] = {"$schema": SCHEMA_DIALECT}
    schema.update(ExperimentConfig.model_json_schema(mode="validation"))
    schema["$defs"]["AlgorithmSection"]["properties"]["advantage"]["enum"] = algorithms.names()
    return schema


def schema_text() -> str:
    """``experiment_schema()`` as the committed file holds it: indented JSON, one final newline,
    the same bytes for the same models."""
    return json.dumps(experiment_schema(), indent=2, ensure_ascii=False) + "\n"
