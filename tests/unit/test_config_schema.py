"""The experiment config's JSON Schema (schemas/experiment.schema.json): built from the pydantic
models, kept fresh by ``scripts/gen_protos.py --check`` (tests/unit/test_contracts.py), and true to
the example experiments: every example validates, and what pydantic refuses it refuses too."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import yaml
from relayrl.coordinator.schema import SCHEMA_PATH, experiment_schema

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
assert EXAMPLES, "no example experiments under examples/"


def _example(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def test_fields_carry_their_docstrings() -> None:
    schema = experiment_schema()
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    assert schema["additionalProperties"] is False
    assert schema["required"] == ["model", "data"]
    sampling = schema["$defs"]["SamplingSection"]["properties"]
    assert sampling["n"]["description"].startswith("Completions per prompt")
    assert (sampling["n"]["minimum"], sampling["n"]["maximum"]) == (1, 1024)


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_top_level_keys_are_schema_properties(path: Path) -> None:
    assert set(_example(path)) <= set(experiment_schema()["properties"])


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_validate(path: Path) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads((ROOT / SCHEMA_PATH).read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    jsonschema.Draft202012Validator(schema).validate(_example(path))


def test_schema_refuses_what_the_models_refuse() -> None:
    jsonschema = pytest.importorskip("jsonschema")
    validator = jsonschema.Draft202012Validator(experiment_schema())
    good = _example(ROOT / "examples" / "reverse-tiny.yaml")
    bad = []
    for edit in (
        lambda c: c["sampling"].update(temperature=-1),  # below its minimum
        lambda c: c["sampling"].update(tempreature=0.7),  # unknown field
        lambda c: c["learner"]["loss"].update(kind="ppo"),  # not an allowed value
        lambda c: c.pop("model"),  # required
        lambda c: c["learner"].update(world_size="two"),  # wrong type
    ):
        config = copy.deepcopy(good)
        edit(config)
        bad.append(config)
    assert validator.is_valid(good)
    assert [validator.is_valid(c) for c in bad] == [False] * len(bad)
