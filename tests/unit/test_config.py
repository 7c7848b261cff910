"""Experiment config: YAML + dotted overrides, strict validation with the field path named."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest
from relayrl.common.config import ConfigError, apply_overrides, dump_yaml, read_yaml
from relayrl.coordinator.config import ExperimentConfig
from relayrl.coordinator.derive import load_experiment

MINIMAL = """
name: demo
model: {path: models/tiny}
data: {train: data/train.parquet, test: data/test.parquet}
"""


def write(tmp_path, text: str):
    p = tmp_path / "exp.yaml"
    p.write_text(textwrap.dedent(text))
    return p


def test_minimal_file_gets_defaults_and_resolved_paths(tmp_path):
    exp = load_experiment(write(tmp_path, MINIMAL))
    assert exp.sampling.n == 8 and exp.schedule.max_staleness == 1
    assert exp.model.path == str(tmp_path / "models/tiny")
    assert exp.data.train == str(tmp_path / "data/train.parquet")
    # Service sections inherit the policy path so each service can be handed its section alone.
    assert exp.generator.engine.model == exp.model.path == exp.learner.model
    assert exp.services.embedded


def test_dotted_overrides_parse_yaml_values(tmp_path):
    exp = load_experiment(
        write(tmp_path, MINIMAL),
        [
            "sampling.temperature=0.7",
            "sampling.stop=['</answer>']",
            "learner.loss.kind=dapo",
            "schedule.steps=3",
        ],
    )
    assert exp.sampling.temperature == 0.7
    assert exp.sampling.stop == ["</answer>"]
    assert exp.learner.loss.kind == "dapo"
    assert exp.schedule.steps == 3


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        (
            "sampling.temperature=-1",
            "sampling.temperature: Input should be greater than or equal to 0 (got -1)",
        ),
        ("sampling.n=0", "sampling.n: Input should be greater than or equal to 1"),
        ("sampling.tempreature=0.5", "sampling.tempreature: unknown field"),
        ("learner.optim.lr=fast", "learner.optim.lr: Input should be a valid number"),
        ("generator.engine.dtype=fp8", "generator.engine.dtype: Input should be"),
        (
            "reward.plugins=[nocolon]",
            "reward.plugins: Value error, plugin 'nocolon' must look like module:function",
        ),
        ("learner.loss.aggregation=sequence", "dapo averages per token"),
        ("services.learner=host:1", "give addresses for generators, rewards and learner, or none"),
        ("algorithm.kl_coef=0.1", "algorithm.kl_coef: a KL in the reward needs token-level advantages"),
        ("critic={world_size: 1}", "critic: algorithm.advantage grpo calls no critic"),
        (
            "algorithm.advantage=ppo",
            "algorithm.advantage: 'ppo' is none of grpo, drgrpo, rloo, reinforce_pp, gae",
        ),
        ("algorithm.critic_warmup=2", "only algorithm.advantage gae has a critic"),
        ("learner.role=critic", "learner.role: the learner section is the actor"),
        ("schedule.eval_samples=4", "schedule.eval_samples > 1 needs schedule.eval_temperature > 0"),
        (
            "data.generate={task: arithmetic, params: {max_len: 3}}",
            "data.generate: Value error, data.generate.params: arithmetic takes no parameter(s) max_len",
        ),
        ("data.generate={task: arithmetic, params: {shots: 9}}", "shots must be an integer in 0..8, got 9"),
        (
            "services.generator_samples_per_call=4",
            "sampling.n (8) exceeds services.generator_samples_per_call (4)",
        ),
        ("seed=-1", "seed: Input should be greater than or equal to 0"),
    ],
)
def test_bad_values_name_the_field(tmp_path, override, needle):
    extra = ["learner.loss.kind=dapo"] if "aggregation" in override else []
    with pytest.raises(ConfigError) as e:
        load_experiment(write(tmp_path, MINIMAL), [*extra, override])
    assert needle in str(e.value)
    assert str(tmp_path / "exp.yaml") in str(e.value)


def test_several_errors_are_all_reported(tmp_path):
    with pytest.raises(ConfigError) as e:
        load_experiment(write(tmp_path, MINIMAL), ["sampling.n=0", "schedule.steps=0", "bogus=1"])
    msg = str(e.value)
    assert "sampling.n:" in msg and "schedule.steps:" in msg and "bogus: unknown field" in msg


def test_missing_required_section(tmp_path):
    with pytest.raises(ConfigError, match="data: Field required"):
        load_experiment(write(tmp_path, "model: {path: m}\n"))


def test_unreadable_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config"):
        read_yaml(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="not valid YAML"):
        read_yaml(write(tmp_path, "a: [1, 2\n"))
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        read_yaml(write(tmp_path, "- 1\n- 2\n"))


def test_override_syntax_errors():
    with pytest.raises(ConfigError, match="expected KEY.PATH=VALUE"):
        apply_overrides({}, ["sampling.temperature"])
    with pytest.raises(ConfigError, match="a.b is a value, not a section"):
        apply_overrides({"a": {"b": 1}}, ["a.b.c=2"])


def test_resolved_config_round_trips(tmp_path):
    exp = load_experiment(write(tmp_path, MINIMAL), ["sampling.n=4"])
    again = ExperimentConfig.model_validate(__import__("yaml").safe_load(dump_yaml(exp)))
    assert again == exp


def test_every_field_is_documented():
    """The config is user-facing: every field carries a docstring (shown in errors and docs)."""
    from pydantic import BaseModel

    seen, missing = set(), []

    def walk(model: type[BaseModel]):
        if model in seen:
            return
        seen.add(model)
        for name, field in model.model_fields.items():
            if not field.description:
                missing.append(f"{model.__name__}.{name}")
            for sub in _models_in(field.annotation):
                walk(sub)

    walk(ExperimentConfig)
    assert not missing, missing


def _models_in(annotation):
    from typing import get_args

    from pydantic import BaseModel

    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for a in get_args(annotation) for m in _models_in(a)]


def test_ppo_gets_critic_and_reference_sections_from_the_learners(tmp_path):
    over = [
        "algorithm.advantage=gae",
        "algorithm.kl_coef=0.05",
        "learner.world_size=2",
        "learner.dtype=bfloat16",
    ]
    over += ["sampling.temperature=0.7", "critic.optim.lr=1e-4"]
    exp = load_experiment(write(tmp_path, MINIMAL), over)
    assert list(exp.role_sections()) == ["learner", "critic", "reference"]
    c, r = exp.critic, exp.reference
    assert (c.role, r.role) == ("critic", "reference")
    assert c.model == r.model == exp.learner.model == str(tmp_path / "models/tiny")
    assert c.world_size == 2 and r.world_size == 1 and c.dtype == r.dtype == "bfloat16"
    assert c.optim.lr == 1e-4 and exp.learner.optim.lr == 1e-5  # the critic's own rate, set by the user
    assert r.loss.temperature == 0.7  # log-probs at the temperature the generators sample with
    # written back (a resumed run's config.yaml) it loads to the same sections
    again = ExperimentConfig.model_validate(read_yaml_text(dump_yaml(exp)))
    assert again.critic == c and again.reference == r
    assert c.serve.port == 0 and c.serve.host == "127.0.0.1"  # where it listens is its own


def test_the_critic_and_reference_are_called_as_the_learner_is(tmp_path):
    over = ["algorithm.advantage=gae", "algorithm.kl_coef=0.1", "learner.serve.tls_cert=c.pem"]
    over += ["learner.serve.tls_key=k.pem", "learner.serve.token_file=tok", "learner.serve.port=50052"]
    over += ["learner.serve.metrics_port=9466", "learner.serve.host=0.0.0.0"]
    exp = load_experiment(write(tmp_path, MINIMAL), over)
    for role in (exp.critic, exp.reference):
        assert role.serve.tls_cert == str(tmp_path / "c.pem") and role.serve.token_file == str(
            tmp_path / "tok"
        )
        assert (role.serve.host, role.serve.port, role.serve.metrics_port) == ("127.0.0.1", 0, None)


def read_yaml_text(text: str) -> dict:
    import yaml

    return yaml.safe_load(text)


def test_grpo_starts_no_critic_or_reference(tmp_path):
    exp = load_experiment(write(tmp_path, MINIMAL))
    assert list(exp.role_sections()) == ["learner"] and exp.critic is None and exp.reference is None


def test_a_deployed_ppo_run_needs_the_critic_and_reference_addresses(tmp_path):
    deployed = ["services.generators=[g:1]", "services.rewards=[r:1]", "services.learner=l:1"]
    with pytest.raises(ConfigError, match="services.critic: a deployed run of gae needs its address"):
        load_experiment(write(tmp_path, MINIMAL), [*deployed, "algorithm.advantage=gae"])
    exp = load_experiment(
        write(tmp_path, MINIMAL),
        [
            *deployed,
            "algorithm.advantage=gae",
            "services.critic=c:1",
            "algorithm.kl_coef=0.1",
            "services.reference=x:1",
        ],
    )
    assert exp.services.critic == "c:1" and exp.services.reference == "x:1"


def test_a_critic_or_reference_has_no_kl_term_of_its_own():
    from relayrl.learner.config import LearnerConfig

    with pytest.raises(ValueError, match="loss.kl_coef: a critic has no KL term"):
        LearnerConfig(role="critic", loss={"kl_coef": 0.1})


@pytest.mark.parametrize(
    "path", sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.yaml")), ids=lambda p: p.name
)
def test_every_example_loads(path):
    exp = load_experiment(path)
    if exp.algorithm.advantage == "gae":
        assert exp.critic.role == "critic" and exp.critic.model == exp.learner.model
    for agent in exp.env.agents:  # relative to the experiment file, wherever it is loaded from
        assert Path(agent.folder) == Path(path).resolve().parent / "agents" / "langchain_calc"


def test_env_paths_resolve_against_the_experiment_file_and_name_the_field(tmp_path):
    folder = tmp_path / "exp" / "agent"
    folder.mkdir(parents=True)
    (folder / "agent.py").write_text("")
    agents = "env: {agents: [{name: a, task: calc, folder: agent, requirements: reqs.txt}]}\n"
    path = tmp_path / "exp" / "e.yaml"
    path.write_text(MINIMAL + agents)
    with pytest.raises(ConfigError, match=r"env.agents.0.requirements: 'reqs.txt' is not a file"):
        load_experiment(path)
    (tmp_path / "exp" / "reqs.txt").write_text("langchain-openai\n")
    exp = load_experiment(path)
    assert exp.env.agents[0].folder == str(folder) and exp.env.agents[0].requirements == str(
        path.parent / "reqs.txt"
    )


@pytest.mark.parametrize(("threads", "want"), [(None, {}), (2, {"OMP_NUM_THREADS": "2"})])
def test_services_threads_reach_every_local_process(tmp_path, monkeypatch, threads, want):
    from relayrl.coordinator.launch import local as local_services

    started = []

    class Proc:
        def __init__(self, name, args, log_dir, env):
            self.command = [name, *args]
            started.append(env)

    monkeypatch.setattr(local_services, "ServiceProcess", Proc)
    over = [] if threads is None else [f"services.threads={threads}"]
    exp = load_experiment(write(tmp_path, MINIMAL), over)
    services = local_services.LocalServices(exp, tmp_path)
    services._start("gen-0", "generator", exp.generator, [])
    services._start("learner", "learner", exp.learner, [], devices="0")
    assert started == [want, {"CUDA_VISIBLE_DEVICES": "0", **want}]


def test_nesting_is_bounded_without_a_recursion_error(tmp_path):
    # PyYAML recurses once per level: 10^5 nested lists were a RecursionError (INTERNAL upstream).
    deep = "[" * 100_000 + "]" * 100_000
    with pytest.raises(ConfigError, match="nested deeper than 64 levels"):
        read_yaml(write(tmp_path, f"a: {deep}\n"))
    with pytest.raises(ConfigError, match="nested deeper than 64 levels"):
        read_yaml(write(tmp_path, "a: " + "[" * 100 + "]" * 100 + "\n"))  # parses, but too deep
    with pytest.raises(ConfigError, match="nested deeper than 64 levels"):
        load_experiment(write(tmp_path, MINIMAL), ["seed=" + "[" * 2000 + "]" * 2000])
    with pytest.raises(ConfigError, match="nested deeper than 64 levels"):
        load_experiment(write(tmp_path, MINIMAL), ["seed=" + "[" * 100 + "]" * 100])


def test_a_bad_reference_or_critic_section_is_a_config_error_naming_it(tmp_path):
    ppo = ["algorithm.advantage=reinforce_pp", "algorithm.kl_coef=0.1"]
    with pytest.raises(ConfigError, match=r"reference: Value error, loss.kl_coef: a reference has no KL"):
        load_experiment(write(tmp_path, MINIMAL), [*ppo, "reference.loss.kl_coef=0.5"])
    with pytest.raises(ConfigError, match=r"critic.loss.kl_coef|critic: Value error, loss.kl_coef"):
        load_experiment(write(tmp_path, MINIMAL), ["algorithm.advantage=gae", "critic.loss.kl_coef=0.5"])


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ("data.generate={task: reverse, n_train: 1000000000}", "data.generate.n_train: Input should be less"),
        ("data.generate={task: reverse, n_test: 1000000000}", "data.generate.n_test: Input should be less"),
        ("data.generate={task: reverse, params: {max_len: 1000000000}}", "max_len <= 4096"),
        ("data.generate={task: arithmetic, params: {max_value: 1000000000000}}", "max_value must be in"),
        ("data.generate={task: countdown, params: {max_number: 1000000000}}", "max_number <= 1000000"),
    ],
)
def test_generated_data_is_bounded(tmp_path, override, needle):
    # One request asking for 10^9 rows held a coordinator's memory and run slot until a restart.
    with pytest.raises(ConfigError, match=re.escape(needle)):
        load_experiment(write(tmp_path, MINIMAL), [override])


def test_a_push_waits_for_a_silent_generator_less_than_the_coordinator_waits_for_the_push(tmp_path):
    """Otherwise the coordinator's PushWeights times out first and the run's error names the
    learner, not the generator that did not answer."""
    from relayrl.common import config as cfg_mod
    from relayrl.coordinator.config import ExperimentConfig
    from relayrl.coordinator.derive import resolve_paths

    raw = {"model": {"path": "m"}, "data": {"train": "t"}, "services": {"deadline_seconds": 100}}
    derived = resolve_paths(cfg_mod.build(ExperimentConfig, raw), tmp_path)
    assert derived.learner.weight_sync_timeout_seconds == pytest.approx(100 / 3)  # the default, lowered
    room = {**raw, "services": {"deadline_seconds": 600}}
    assert (
        resolve_paths(cfg_mod.build(ExperimentConfig, room), tmp_path).learner.weight_sync_timeout_seconds
        == 300
    )


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (["sampling.stop=[END]"], "sampling.stop: an episode's turns end on the model's end-of-turn token"),
        (
            ["episodes.concurrency=2000"],
            "episodes.concurrency (2000) exceeds generator.max_pending_requests (1024)",
        ),
        (["env.lease_seconds=60"], "env.lease_seconds (60) must exceed services.deadline_seconds (600)"),
        (
            ["services.generators=[g:1]", "services.rewards=[r:1]", "services.learner=l:1"],
            "services.envs: a deployed run with an episodes section needs env service addresses",
        ),
        (["episodes.tool_format=json"], "episodes.tool_format"),
    ],
)
def test_episodes_refuse_what_cannot_work_naming_the_field(tmp_path, overrides, needle):
    path = write(tmp_path, MINIMAL + "episodes: {env: calc}\n")
    assert load_experiment(path).episodes.env == "calc"
    with pytest.raises(ConfigError) as e:
        load_experiment(path, overrides)
    assert needle in str(e.value)


def test_a_lora_learner_gets_generators_that_take_its_adapter(tmp_path):
    from relayrl.common.config import ConfigError
    from relayrl.coordinator.config import ExperimentConfig
    from relayrl.coordinator.derive import resolve_paths

    def exp(**generator):
        return ExperimentConfig.model_validate(
            {
                "model": {"path": "m"},
                "data": {"train": "t"},
                "learner": {"lora": {"rank": 32}},
                "generator": generator,
            }
        )

    assert resolve_paths(exp(), tmp_path).generator.engine.max_lora_rank == 32
    assert resolve_paths(exp(engine={"max_lora_rank": 64}), tmp_path).generator.engine.max_lora_rank == 64
    with pytest.raises(ConfigError, match="max_lora_rank 16 is below learner.lora.rank 32"):
        resolve_paths(exp(engine={"max_lora_rank": 16}), tmp_path)


def test_packing_on_and_off_mean_what_they_say_in_yaml_and_in_set():
    """YAML 1.1 reads a bare `on`/`off` as a boolean: `learner.packing: on` in a file or
    `--set learner.packing=on` must still mean "on", not fail as "got True"."""
    from relayrl.learner.config import LearnerConfig

    base = {"model": {"path": "m"}, "data": {"train": "t"}}
    for word in ("on", "off"):
        data = {**base, **read_yaml_text(f"learner: {{packing: {word}}}\n")}
        assert ExperimentConfig.model_validate(data).learner.packing == word
        over = apply_overrides(dict(base), [f"learner.packing={word}"])
        assert ExperimentConfig.model_validate(over).learner.packing == word
    assert LearnerConfig.model_validate({"packing": "auto"}).packing == "auto"
    with pytest.raises(ValueError, match="packing"):
        LearnerConfig.model_validate({"packing": 3})
