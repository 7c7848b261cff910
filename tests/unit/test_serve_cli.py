"""``relayrl serve``: its flags are the config models' fields (help, defaults, old short names
kept), values reach the config in order, and ``relayrl serve generator`` on a CPU machine without a
C++ compiler (a slim container image) runs vLLM's compiled sampler ops eagerly instead of killing
the engine at the first sample."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import types
from typing import get_args, get_origin

import pytest
import torch
from pydantic import BaseModel
from relayrl import serve_cli
from relayrl.common.config import ConfigError
from relayrl.env.config import EnvConfig
from relayrl.learner.config import LossConfig


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


# -- flags from the config models ---------------------------------------------------------------------
SERVE_FLAGS = {
    f"--{name.replace('_', '-')}": f"serve.{name}"
    for name in ("host", "port", "metrics_port", "grace_seconds", "tls_cert", "tls_key")
    + ("tls_client_ca", "token_file", "insecure")
}
OLD_FLAGS = {
    "generator": {
        "--model": "engine.model",
        "--dtype": "engine.dtype",
        "--tensor-parallel-size": "engine.tensor_parallel_size",
        "--max-model-len": "engine.max_model_len",
        "--kv-cache-gib": "engine.kv_cache_gib",
        "--replica-id": "replica_id",
    },
    "learner": {
        "--model": "model",
        "--role": "role",
        "--world-size": "world_size",
        "--dtype": "dtype",
        "--lr": "optim.lr",
        "--loss": "loss.kind",
        "--checkpoint-dir": "checkpoint_dir",
    },
    "reward": {"--workers": "workers", "--timeout-seconds": "timeout_seconds", "--plugin": "plugins"},
    "coordinator": {},
    "env": {"--plugin": "plugins", "--max-sessions": "max_sessions", "--lease-seconds": "lease_seconds"},
    "gateway": {
        "--generator": "generators",
        "--http-host": "http.host",
        "--http-port": "http.port",
        "--public-url": "http.public_url",
        "--model-name": "model_name",
    },
}
"""Every flag ``relayrl serve`` had when its flags were written by hand: the scripts, deploy files
and launchers that call it use them."""
HEAVY = ("torch", "vllm", "deepspeed", "transformers")


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices


def service_parsers() -> dict[str, argparse.ArgumentParser]:
    top = argparse.ArgumentParser()
    serve_cli.add_parser(top.add_subparsers())
    return _subcommands(_subcommands(top)["serve"])


def fields(model: type[BaseModel], prefix: str = ""):
    """(dotted path, field) of every field that is not a section, read here from the model alone."""
    for name, f in model.model_fields.items():
        types_ = (f.annotation, *get_args(f.annotation))
        if get_origin(f.annotation) in (list, tuple, dict):  # a list of models is one (JSON) flag
            types_ = ()
        inner = [t for t in types_ if isinstance(t, type) and issubclass(t, BaseModel)]
        if inner:
            yield from fields(inner[0], f"{prefix}{name}.")
        else:
            yield prefix + name, f


def config_of(argv: list[str]):
    top = argparse.ArgumentParser()
    serve_cli.add_parser(top.add_subparsers())
    return serve_cli.build_config(top.parse_args(argv))


@pytest.mark.parametrize("name", list(serve_cli.SERVICES))
def test_every_field_is_a_flag_with_its_docstring_and_default(name):
    """The drift test: each flag's help is its field's docstring and its default the field's."""
    model = serve_cli.SERVICES[name].config
    actions = {a.dest: a for a in service_parsers()[name]._actions}
    for path, f in fields(model):
        action = actions.pop(f"field:{path}", None)
        assert action is not None, f"{model.__name__}.{path} has no flag"
        assert "--" + path.replace("_", "-") in action.option_strings
        assert f.description, f"{model.__name__}.{path} has no docstring to be its help"
        default = f.default_factory() if f.default_factory is not None else f.default
        doc = " ".join(f.description.split()).replace("%", "%%")
        assert action.help.startswith(doc + " ") and action.help.endswith(f"default: {default!r}]")
    assert not [d for d in actions if d.startswith("field:")], "flags of fields the model no longer has"


@pytest.mark.parametrize("name", list(serve_cli.SERVICES))
def test_the_short_flags_set_the_fields_they_always_did(name):
    paths = {p for p, _ in fields(serve_cli.SERVICES[name].config)}
    assert set(serve_cli.SERVICES[name].aliases.values()) <= paths  # hand-kept aliases: real fields
    by_option = service_parsers()[name]._option_string_actions
    for flag, path in {**SERVE_FLAGS, **OLD_FLAGS[name]}.items():
        assert flag in by_option, f"relayrl serve {name} lost {flag}"
        assert by_option[flag].dest == f"field:{path}", flag


def test_help_is_generated_and_imports_nothing_heavy():
    """``relayrl serve SERVICE --help`` lists every field's flag with its help, without importing
    an engine."""
    script = (
        "import contextlib, io, json, sys\n"
        "from relayrl.cli import main\n"
        "out = {}\n"
        "for svc in sys.argv[1:]:\n"
        "    buf = io.StringIO()\n"
        "    with contextlib.redirect_stdout(buf), contextlib.suppress(SystemExit):\n"
        "        main(['serve', svc, '--help'])\n"
        "    out[svc] = buf.getvalue()\n"
        f"out['heavy'] = [m for m in {HEAVY!r} if m in sys.modules]\n"
        "print(json.dumps(out))\n"
    )
    env = {**os.environ, "COLUMNS": "100000"}  # one line per flag: no wrapping to undo
    proc = subprocess.run(
        [sys.executable, "-c", script, *serve_cli.SERVICES],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=True,
    )
    out = json.loads(proc.stdout)
    assert out.pop("heavy") == []
    parsers = service_parsers()
    for name, text in out.items():
        text = " ".join(text.split())
        for action in parsers[name]._actions:
            if action.dest.startswith("field:"):
                assert f"{', '.join(action.option_strings)} " in text
                assert action.help.replace("%%", "%") in text
    lease = parsers["env"]._option_string_actions["--lease-seconds"]  # its hand-written help said 300
    assert EnvConfig().lease_seconds == 1800 and lease.help.endswith("[default: 1800.0]")
    assert f"--lease-seconds LEASE_SECONDS {lease.help}" in " ".join(out["env"].split())
    kinds = get_args(LossConfig.model_fields["kind"].annotation)
    assert "gspo" in kinds and f"--loss, --loss.kind {{{','.join(kinds)}}}" in out["learner"]


def test_file_then_flags_then_set(tmp_path):
    path = tmp_path / "learner.yaml"
    path.write_text("serve: {port: 5, host: 127.0.0.2}\noptim: {lr: 0.1, total_steps: 7}\n")
    c = config_of(["serve", "learner", "--config", str(path), "--port", "6", "--lr", "1e-4"])
    assert (c.serve.port, c.serve.host, c.optim.lr, c.optim.total_steps) == (6, "127.0.0.2", 1e-4, 7)
    c = config_of(["serve", "learner", "--config", str(path), "--lr", "1e-4", "--set", "optim.lr=0.2"])
    assert c.optim.lr == 0.2


def test_values_are_text_yaml_switches_or_repeated_items():
    c = config_of(["serve", "generator", "--model", "0001", "--max-model-len", "512", "--enforce-eager"])
    assert (c.engine.model, c.engine.max_model_len, c.engine.enforce_eager) == ("0001", 512, True)
    extra = ["--engine.extra-args", "{enable_prefix_caching: true}"]
    c = config_of(["serve", "generator", "--max-model-len", "null", *extra, "--insecure", "false"])
    assert c.engine.max_model_len is None and c.engine.extra_args == {"enable_prefix_caching": True}
    assert c.serve.insecure is False
    assert config_of(["serve", "generator", "--enforce-eager", "None"]).engine.enforce_eager is None
    c = config_of(["serve", "learner", "--optim.betas", "[0.9, 0.95]", "--packing", "on", "--lora.rank", "8"])
    assert c.optim.betas == (0.9, 0.95) and c.packing == "on" and c.lora.rank == 8
    c = config_of(["serve", "gateway", "--generator", "a:1", "--generators", "b:2"])
    assert c.generators == ["a:1", "b:2"]
    c = config_of(["serve", "reward", "--sandbox.limits.memory-mb", "256"])
    assert c.sandbox.limits.memory_mb == 256


def test_a_bad_value_fails_naming_its_field_and_abbreviations_are_refused():
    with pytest.raises(ConfigError, match=r"serve\.port"):
        config_of(["serve", "reward", "--port", "abc"])
    with pytest.raises(ConfigError, match=r"loss\.kind"):
        config_of(["serve", "learner", "--loss", "grpo2"])
    with pytest.raises(SystemExit):
        config_of(["serve", "env", "--lease", "5"])


@pytest.mark.parametrize(
    "name", [n for n, s in serve_cli.SERVICES.items() if isinstance(s.start, serve_cli.Server)]
)
def test_each_server_module_exists(name):
    assert importlib.util.find_spec(serve_cli.SERVICES[name].start.module) is not None  # found, not imported


def test_a_served_module_that_returns_a_reason_exits_with_it(monkeypatch):
    async def died(config, port_file=None):
        return "the engine died"

    async def stopped(config, port_file=None):
        return None

    args = argparse.Namespace(port_file=None)
    monkeypatch.setitem(sys.modules, "fake_died", types.SimpleNamespace(run=died))
    monkeypatch.setitem(sys.modules, "fake_stopped", types.SimpleNamespace(run=stopped))
    with pytest.raises(SystemExit, match="the engine died: exiting with status 1"):
        serve_cli.Server("fake_died")(object(), args)
    assert serve_cli.Server("fake_stopped")(object(), args) == 0


# -- the learner's launcher ---------------------------------------------------------------------------
def _launched(monkeypatch, world_size: int, **flags) -> tuple[list[str], dict[str, str]]:
    """What ``launch_learner`` execs, and the torch.distributed variables it leaves set."""
    from relayrl.learner.config import LearnerConfig

    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                "RELAYRL_RENDEZVOUS_FILE"):  # fmt: skip
        monkeypatch.delenv(var, raising=False)

    class Exec(Exception):
        pass

    def execv(path, cmd):
        raise Exec(cmd)

    monkeypatch.setattr(serve_cli.os, "execv", execv)
    fields = dict(port_file="/tmp/p", rank_from_slurm=False, nnodes=None, node_rank=None, master_addr=None,
                  master_port=None, rendezvous_file=None)  # fmt: skip
    args = argparse.Namespace(**{**fields, **flags})
    with pytest.raises(Exec) as got:
        serve_cli.launch_learner(LearnerConfig(model="m", world_size=world_size), args)
    cmd = got.value.args[0]
    os.unlink(cmd[cmd.index("--config") + 1])
    env = {v: os.environ[v] for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if v in os.environ}
    return cmd, env


def test_one_rank_is_this_process_and_several_go_through_torchrun(monkeypatch):
    cmd, env = _launched(monkeypatch, 1)
    assert cmd[1:3] == ["-m", "relayrl.learner.rank"] and cmd[-2:] == ["--port-file", "/tmp/p"]
    assert env["RANK"] == "0" and env["WORLD_SIZE"] == "1" and env["MASTER_ADDR"] == "127.0.0.1"
    # No port named: the rank's own store binds a free one (a port picked and closed could be taken).
    assert env["MASTER_PORT"] == "0"
    cmd, env = _launched(monkeypatch, 2)
    assert cmd[1:3] == ["-m", "torch.distributed.run"] and "--nproc_per_node=2" in cmd and env == {}
    assert cmd[cmd.index("-m", 3) + 1] == "relayrl.learner.rank"
    assert "--standalone" in cmd and not any(a.startswith("--master_port") for a in cmd)  # torchrun's store


def test_a_named_rendezvous_port_is_the_one_used(monkeypatch):
    cmd, env = _launched(monkeypatch, 1, master_port=29511)
    assert env["MASTER_PORT"] == "29511"
    cmd, env = _launched(monkeypatch, 2, master_port=29511)
    assert "--master_port=29511" in cmd and "--standalone" not in cmd


def test_port_0_names_no_port(monkeypatch):
    """--master-port 0 is a free port, as no port is: torchrun's static rendezvous on port 0 waits."""
    cmd, _ = _launched(monkeypatch, 2, master_port=0)
    assert "--standalone" in cmd and not any(a.startswith("--master_port") for a in cmd)


def test_ranks_srun_started_meet_through_a_rendezvous_file_or_a_named_port(monkeypatch):
    slurm = {"SLURM_PROCID": "1", "SLURM_LOCALID": "1", "SLURM_NTASKS": "2"}
    for k, v in slurm.items():
        monkeypatch.setenv(k, v)
    cmd, env = _launched(monkeypatch, 2, rank_from_slurm=True, master_addr="n1", rendezvous_file="/r/l.port")
    assert cmd[1:3] == ["-m", "relayrl.learner.rank"] and env["RANK"] == "1" and env["MASTER_ADDR"] == "n1"
    assert os.environ["RELAYRL_RENDEZVOUS_FILE"] == "/r/l.port" and "MASTER_PORT" not in env
    _, env = _launched(monkeypatch, 2, rank_from_slurm=True, master_addr="n1", master_port=29511)
    assert env["MASTER_PORT"] == "29511" and "RELAYRL_RENDEZVOUS_FILE" not in os.environ
    with pytest.raises(SystemExit, match="--rendezvous-file"):
        _launched(monkeypatch, 2, rank_from_slurm=True, master_addr="n1")
    with pytest.raises(SystemExit, match="goes with --rank-from-slurm"):
        _launched(monkeypatch, 2, rendezvous_file="/r/l.port")
