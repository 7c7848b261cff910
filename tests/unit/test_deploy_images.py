"""Images, the health probe and docker compose (deploy/docker, deploy/compose), checked without
a Docker engine; ``docker-compose config`` also runs where installed. Every service must serve TLS,
ask for a client certificate and the token, its health check must present the client certificate,
and every caller (the learner, the experiment) must trust the CA and send the token: all from the
compose secrets mounted at /run/secrets, which deploy/make-secrets.sh makes."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tomllib
from concurrent import futures
from pathlib import Path

import grpc
import pytest
import yaml
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from relayrl.common import security
from relayrl.common.config import ConfigError
from relayrl.common.healthcheck import main as healthcheck_main
from relayrl.common.serving import ClientSecurity
from relayrl.coordinator.derive import load_experiment

from tests.kit.deploy import (  # the token-env fixture applies to every test here
    COMPOSE_DIR,
    COMPOSE_SECRETS,
    DOCKERFILE,
    FULL_NAME,
    HEAVY,
    ROOT,
    SECRET_FILES,
    _no_token_env,  # noqa: F401
    agent_models,
    assert_calls_with,
    assert_probes_over_tls,
    assert_serves_agents_plain_http,
    assert_serves_tls_from,
    check_cli,
    container_config,
    env_server,
    gateway_server,
    healthcheck_target,
    list_envs,
    make_secrets_dir,
    multi_turn,
    on_host,
    open_session,
    relayrl_invocations,
    reward_server,
    run_probe,
    score,
    secret_paths,
)
from tests.kit.net import refused_port


@pytest.fixture(scope="module")
def secrets_dir(tmp_path_factory) -> Path:
    return make_secrets_dir(tmp_path_factory)


def test_invocations_are_found_in_shell_scripts():
    script = "test -f /m/config.json || { rm -rf /t && relayrl model tiny --out /t && mv /t /m; }"
    assert relayrl_invocations(["sh", "-c", script]) == [["relayrl", "model", "tiny", "--out", "/t"]]
    assert relayrl_invocations(["relayrl", "serve", "reward"]) == [["relayrl", "serve", "reward"]]
    assert relayrl_invocations("test 1 || exec relayrl run x.yaml") == [["relayrl", "run", "x.yaml"]]


def test_a_flag_typo_fails_the_cli_check():
    with pytest.raises(pytest.fail.Exception):
        check_cli(["relayrl", "serve", "reward", "--wrokers", "2"])
    with pytest.raises(pytest.fail.Exception):  # accepted by argparse as an abbreviation, not here
        check_cli(["relayrl", "serve", "reward", "--worker", "2"])
    with pytest.raises(ConfigError):  # an invalid value fails in the service's config
        check_cli(["relayrl", "serve", "learner", "--loss", "grpo2"])


# -- the health probe -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def health_server():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    servicer.set("relayrl.x.v1.Ready", health_pb2.HealthCheckResponse.SERVING)
    servicer.set("relayrl.x.v1.Loading", health_pb2.HealthCheckResponse.NOT_SERVING)
    yield f"127.0.0.1:{port}"
    server.stop(0)


def test_healthcheck_exit_codes(health_server, capsys):
    assert healthcheck_main([health_server]) == 0
    assert healthcheck_main([health_server, "relayrl.x.v1.Ready"]) == 0
    assert healthcheck_main([health_server, "relayrl.x.v1.Loading"]) == 1
    assert "NOT_SERVING" in capsys.readouterr().err
    assert healthcheck_main([health_server, "relayrl.x.v1.Unknown"]) == 1
    assert "NOT_FOUND" in capsys.readouterr().err


def test_healthcheck_fails_within_its_deadline_when_nothing_listens():
    import time

    with refused_port() as port:
        t0 = time.monotonic()
        assert healthcheck_main([f"127.0.0.1:{port}", "--timeout", "1"]) == 1
        assert time.monotonic() - t0 < 5


def test_healthcheck_runs_as_a_module(health_server):
    run = subprocess.run(
        [sys.executable, "-m", "relayrl.common.healthcheck", health_server, "relayrl.x.v1.Loading"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 1 and "NOT_SERVING" in run.stderr
    ok = subprocess.run([sys.executable, "-m", "relayrl.common.healthcheck", health_server], timeout=60)
    assert ok.returncode == 0


# -- Dockerfile -------------------------------------------------------------------------------------
def dockerfile_stages() -> dict[str, dict]:
    """Stage name -> {"from": base, "lines": [instruction lines, continuations joined]}."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    stages: dict[str, dict] = {}
    current = None
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = re.match(r"FROM\s+(\S+)\s+AS\s+(\S+)$", line, re.IGNORECASE)
        if m:
            current = stages.setdefault(m.group(2), {"from": m.group(1), "lines": []})
        elif current is not None:
            current["lines"].append(line)
    return stages


TARGETS = {  # image target -> (extra it installs, service it serves)
    "reward": ("reward", "reward"),
    "env": ("env", "env"),
    "gateway": ("gateway", "gateway"),
    "coordinator": ("coordinator", "coordinator"),
    "learner": ("learner", "learner"),
    "generator": ("generator", "generator"),
    "generator-cpu": ("generator-cpu", "generator"),
}


def _instr(stage: dict, name: str) -> list[str]:
    return [line[len(name) :].strip() for line in stage["lines"] if line.upper().startswith(name + " ")]


def test_dockerfile_has_a_target_per_service_with_its_extra_only():
    stages = dockerfile_stages()
    for target, (extra, _svc) in TARGETS.items():
        assert target in stages, f"no target {target}"
        copies = [c for c in _instr(stages[target], "COPY") if c.startswith("--from=")]
        assert len(copies) == 1 and copies[0].endswith("/opt/venv /opt/venv"), copies
        install = stages[copies[0].split()[0].removeprefix("--from=")]
        installs = re.findall(r"pip install (\S+)", " ".join(_instr(install, "RUN")))
        assert installs == [f'".[{extra}]"'], f"{target} installs {installs}, expected .[{extra}] only"
    cpu_gen = " ".join(_instr(stages["install-generator-cpu"], "RUN"))
    assert re.search(r"pip uninstall --yes torchvision torchaudio torchcodec", cpu_gen)


def test_each_image_comes_right_after_its_install_stage_and_cuda_last():
    """Docker's legacy builder (a docker CLI without buildx) builds every stage above the
    target: in this order `--target reward` builds only the reward's stages, and no CPU image
    builds the CUDA generator's."""
    order = list(dockerfile_stages())
    assert order[:2] == ["runtime", "build"]
    for target in TARGETS:
        assert order.index(target) == order.index(f"install-{target}") + 1, order
    assert order[-2:] == ["install-generator", "generator"]


def test_light_extras_pull_no_heavy_package():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]

    def deps(extra: str) -> set[str]:
        out = set()
        for req in extras[extra]:
            m = re.match(r"relayrl\[([^\]]+)\]", req)
            if m:
                for e in m.group(1).split(","):
                    out |= deps(e.strip())
            else:
                out.add(re.split(r"[<>=!~;\[ ]", req, maxsplit=1)[0].lower())
        return out

    base = {re.split(r"[<>=!~;\[ ]", r, maxsplit=1)[0].lower() for r in project["dependencies"]}
    assert "env" in extras, "pyproject.toml has no env extra, which the env image installs (.[env])"
    for light in ("reward", "env", "gateway", "coordinator"):  # CPU-only images
        assert not (base | deps(light)) & HEAVY, light
    assert "kubernetes-validate" in deps("dev")


def test_images_run_unprivileged_with_grpc_health_checks_and_valid_commands(secrets_dir):
    stages = dockerfile_stages()
    for target, (_extra, svc) in TARGETS.items():
        stage = stages[target]
        users = _instr(stage, "USER")
        assert users, f"{target}: no USER"
        user = users[-1].split(":")[0]
        assert user not in {"root", "0"} and user.isdigit(), f"{target}: USER {users[-1]} (numeric, not root)"
        checks = _instr(stage, "HEALTHCHECK")
        assert len(checks) == 1, f"{target}: HEALTHCHECK missing"
        hc = json.loads(checks[0][checks[0].index("CMD") + 3 :])
        cmd = json.loads(_instr(stage, "CMD")[-1])
        (argv,) = relayrl_invocations(cmd)
        args, config = check_cli(on_host(argv, COMPOSE_SECRETS, secrets_dir))
        assert args.service == svc and config.serve.host == "0.0.0.0"
        # Secure by default, from where compose puts its secrets: `docker run` mounts them there.
        config = container_config(argv)
        assert_serves_tls_from(config, COMPOSE_SECRETS)
        if svc == "learner":
            assert_calls_with(config.security, COMPOSE_SECRETS)
        assert healthcheck_target(hc) == (config.serve.port, FULL_NAME[svc])
        assert_probes_over_tls(hc, COMPOSE_SECRETS)
        exposed = " ".join(_instr(stage, "EXPOSE")).split()
        assert str(config.serve.port) in exposed
        if svc == "gateway":  # its OpenAI API too; it calls the generators as the learner does
            assert config.http.host == "0.0.0.0" and config.http.insecure and not config.http.tls_cert
            assert_calls_with(config.client, COMPOSE_SECRETS)
            assert str(config.http.port) in exposed


def test_dockerfile_base_and_index_are_build_args():
    text = DOCKERFILE.read_text()
    assert re.search(r"^ARG BASE_IMAGE=python:3\.11-slim$", text, re.M)
    assert re.search(r"^ARG PIP_EXTRA_INDEX_URL=\S+$", text, re.M)
    assert re.search(r"^FROM \$\{BASE_IMAGE\} AS runtime$", text, re.M)
    code = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
    hosts = [line for line in code if "://" in line]
    assert hosts == [line for line in code if line.startswith("ARG PIP_EXTRA_INDEX_URL=")]
    ignore = (ROOT / ".dockerignore").read_text().split()
    assert ignore[ignore.index("*") :][:1] == ["*"] and "!services/" in ignore  # an allowlist


# -- docker compose ---------------------------------------------------------------------------------
def load_compose() -> dict:
    """compose.yaml as compose reads it with no variables set: ``${VAR:-default}`` is the default."""
    text = (COMPOSE_DIR / "compose.yaml").read_text()
    return yaml.safe_load(re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", text))


def compose_env() -> dict[str, str]:
    env = {}
    for line in (COMPOSE_DIR / ".env").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            k, v = line.split("=", 1)
            env[k.strip()] = v.strip()
    return env


def active_services(compose: dict, profiles: list[str]) -> set[str]:
    return {
        n
        for n, s in compose["services"].items()
        if not s.get("profiles") or set(s["profiles"]) & set(profiles)
    }


RELAYRL_SERVICES = ("reward", "generator", "learner", "coordinator")
ENV = "env"  # the env service (multi-turn episodes), started with the `env` profile beside any stack
GATEWAY = "gateway"  # the gateway (black-box episodes' agents), with the `gateway` profile beside env


def compose_relayrl(compose: dict, name: str, secrets: Path):
    """(service definition, relayrl argv, parsed args, config with the container's paths) of a
    compose service, whose command passes the start-up check with the secret files in ``secrets``."""
    svc = compose["services"][name]
    (argv,) = relayrl_invocations(svc["command"])
    args, _config = check_cli(on_host(argv, COMPOSE_SECRETS, secrets))
    return svc, argv, args, container_config(argv)


def test_compose_services_and_profiles():
    compose = load_compose()
    assert compose_env()["COMPOSE_PROFILES"] == "cpu"  # plain `docker compose up` is the CPU stack
    cpu = active_services(compose, ["cpu"])
    gpu = active_services(compose, ["gpu"])
    one = active_services(compose, ["gpu1"])
    assert cpu == {"init", *RELAYRL_SERVICES, "prometheus", "grafana"}
    assert gpu == {"init", "reward", "generator-gpu", "learner-gpu", "coordinator", "prometheus", "grafana"}
    assert one == {"init", "reward", "generator-1gpu", "learner-1gpu", "coordinator", "prometheus", "grafana"}
    assert active_services(compose, ["cpu", "ppo"]) == cpu | {"critic", "reference"}  # PPO's roles, opt-in
    for stack, services in (("cpu", cpu), ("gpu", gpu), ("gpu1", one)):  # multi-turn episodes, opt-in
        assert active_services(compose, [stack, "env"]) == services | {ENV}
        assert active_services(compose, [stack, "env", "gateway"]) == services | {ENV, GATEWAY}
    for name in ("generator", "learner"):  # the same name on every profile for experiment and Prometheus
        for suffix in ("-gpu", "-1gpu"):
            assert compose["services"][f"{name}{suffix}"]["networks"]["default"]["aliases"] == [name]


COMPOSE_RELAYRL = [
    "reward", "generator", "learner", "coordinator", "generator-gpu", "learner-gpu", "generator-1gpu", "learner-1gpu",
    "critic", "reference", "env", "gateway",
]  # fmt: skip
LEARNER_ROLES = ("critic", "reference")  # learners of another role, served by `relayrl serve learner`


def on_gpu(name: str) -> bool:
    return name.endswith(("-gpu", "-1gpu"))


@pytest.mark.parametrize("name", COMPOSE_RELAYRL)
def test_compose_relayrl_service(name, secrets_dir):
    compose = load_compose()
    svc, argv, args, config = compose_relayrl(compose, name, secrets_dir)
    role = name.removesuffix("-gpu").removesuffix("-1gpu")
    base = "learner" if role in LEARNER_ROLES else role
    assert args.service == base and config.serve.host == "0.0.0.0"
    if base == "learner":
        assert config.role == ("actor" if role == "learner" else role)
    port = config.serve.port
    assert svc["ports"] == [f"127.0.0.1:{port}:{port}"]
    assert healthcheck_target(svc["healthcheck"]["test"][1:]) == (port, FULL_NAME[base])
    assert svc["healthcheck"]["test"][0] == "CMD"
    assert config.serve.metrics_port, f"{name}: no --metrics-port"
    build = svc["build"]
    assert build["dockerfile"] == "deploy/docker/Dockerfile" and build["target"] in dockerfile_stages()
    assert (COMPOSE_DIR / build["context"] / build["dockerfile"]).resolve() == DOCKERFILE
    gpu = on_gpu(name)
    args_ = build.get("args", {})
    assert (args_.get("BASE_IMAGE", "python:3.11-slim").startswith("nvidia/cuda:")) == gpu
    if gpu:
        assert args_["PIP_EXTRA_INDEX_URL"] == "", "CUDA images take PyPI's torch, not the CPU index"
    if base in ("generator", "learner"):
        target = {"generator": "generator" if gpu else "generator-cpu", "learner": "learner"}[base]
        assert build["target"] == target
        assert "models:/models:ro" in svc["volumes"] and config_model(config) == "/models/policy"
        assert svc["depends_on"]["init"]["condition"] == "service_completed_successfully"
    if base == "learner" and role != "reference":  # the reference is frozen: nothing to checkpoint
        assert "runs:/runs" in svc["volumes"]  # checkpoints go to the run folder the coordinator names
        assert config.checkpoint_dir == "/runs"  # relative paths of the coordinator resolve there
    if role == "learner":
        assert config.weight_sync_host == "learner"


def config_model(config) -> str:
    return getattr(getattr(config, "engine", None), "model", None) or config.model


def mounted_secrets(svc: dict) -> set[str]:
    """Container paths of the compose secrets a service mounts (short syntax: /run/secrets/NAME)."""
    assert all(isinstance(name, str) for name in svc.get("secrets", [])), "short syntax only"
    return {f"{COMPOSE_SECRETS}/{name}" for name in svc.get("secrets", [])}


@pytest.mark.parametrize("name", COMPOSE_RELAYRL)
def test_compose_service_serves_calls_and_probes_with_tls_from_secrets(name, secrets_dir):
    compose = load_compose()
    svc, argv, args, config = compose_relayrl(compose, name, secrets_dir)
    assert_serves_tls_from(config, COMPOSE_SECRETS)
    probe = svc["healthcheck"]["test"][1:]
    assert_probes_over_tls(probe, COMPOSE_SECRETS)
    if name.startswith("learner"):  # rank 0 calls the generators (weight-sync control)
        assert_calls_with(config.security, COMPOSE_SECRETS)
    if name == GATEWAY:  # it calls the generators; its OpenAI API is the one plain HTTP server
        assert_calls_with(config.client, COMPOSE_SECRETS)
        assert_serves_agents_plain_http(config, GATEWAY)
    used = secret_paths(argv) | secret_paths(probe)
    assert used <= mounted_secrets(svc), (
        f"{name} names secrets it does not mount: {used - mounted_secrets(svc)}"
    )


async def test_compose_wiring_end_to_end(secrets_dir):
    """The reward service as compose starts it (its access settings, on the secrets make-secrets.sh
    made) answers its compose health check, and the coordinator's and the learner's client settings
    reach it under every name they dial."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl not installed: no real certificates to serve with")
    compose = load_compose()
    svc, argv, _args, _config = compose_relayrl(compose, "reward", secrets_dir)
    _args, served = check_cli(on_host(argv, COMPOSE_SECRETS, secrets_dir))
    exp = load_experiment(COMPOSE_DIR / "experiment.yaml").services
    learner = compose_relayrl(compose, "learner", secrets_dir)[3].security

    def here(sec: ClientSecurity) -> ClientSecurity:
        return ClientSecurity(**{k: v and on_host([v], COMPOSE_SECRETS, secrets_dir)[0] for k, v in sec})

    callers = [
        (here(exp.security), a.rsplit(":", 1)[0])
        for a in [*exp.generators, *exp.rewards, exp.learner, *multi_turn_compose(secrets_dir).services.envs]
    ]
    callers.append((here(learner), exp.generators[0].rsplit(":", 1)[0]))  # weight-sync control
    async with reward_server(served.serve) as port:
        assert (
            await run_probe(on_host(svc["healthcheck"]["test"][1:], COMPOSE_SECRETS, secrets_dir), port) == 0
        )
        for sec, host in callers:
            name = [("grpc.ssl_target_name_override", host)]
            async with security.client_channel(f"127.0.0.1:{port}", sec, options=name) as ch:
                assert await score(ch) == 1.0, host


def test_compose_secrets_are_the_files_make_secrets_writes():
    compose = load_compose()
    assert compose["secrets"] == {name: {"file": f"./secrets/{name}"} for name in SECRET_FILES}
    for name in (*RELAYRL_SERVICES, ENV, GATEWAY):
        assert compose["services"][name]["secrets"] == list(SECRET_FILES)
    ignore = (COMPOSE_DIR / "secrets" / ".gitignore").read_text().split("\n")
    assert "*" in ignore and "!.gitignore" in ignore, "secret files must never be committed"
    if shutil.which("git") and (ROOT / ".git").exists():
        tracked = subprocess.run(
            ["git", "ls-files", "deploy/compose/secrets"], cwd=ROOT, capture_output=True, text=True
        ).stdout.split()
        assert tracked in ([], ["deploy/compose/secrets/.gitignore"]), tracked


def test_compose_gpu_profile_reserves_separate_gpus(secrets_dir):
    compose = load_compose()
    ids = {}
    for name in ("generator-gpu", "learner-gpu"):
        (dev,) = compose["services"][name]["deploy"]["resources"]["reservations"]["devices"]
        assert dev["driver"] == "nvidia" and dev["capabilities"] == ["gpu"]
        ids[name] = set(dev["device_ids"])
    assert ids["generator-gpu"] and ids["learner-gpu"] and not ids["generator-gpu"] & ids["learner-gpu"]
    _svc, _argv, _args, learner = compose_relayrl(compose, "learner-gpu", secrets_dir)
    assert learner.world_size == len(ids["learner-gpu"])
    for name, svc in compose["services"].items():
        if not on_gpu(name):
            assert "deploy" not in svc, f"{name} reserves devices outside the gpu profiles"


def test_compose_one_gpu_profile_shares_gpu_0_with_ipc_and_bounds_vllm(secrets_dir):
    """Learner and generator on one GPU: both reserve GPU 0, share the IPC namespace (CUDA IPC
    and the shared-memory probe need it), vLLM takes at most 45% of the GPU's memory."""
    compose = load_compose()
    for name in ("generator-1gpu", "learner-1gpu"):
        svc = compose["services"][name]
        (dev,) = svc["deploy"]["resources"]["reservations"]["devices"]
        assert dev["device_ids"] == ["0"] and svc["ipc"] == "host" and "shm_size" not in svc
    _svc, _argv, _args, gen = compose_relayrl(compose, "generator-1gpu", secrets_dir)
    _svc, _argv, _args, learner = compose_relayrl(compose, "learner-1gpu", secrets_dir)
    assert gen.engine.gpu_memory_utilization == 0.45 and learner.weight_sync_transport == "auto"


def test_compose_volumes_and_experiment(secrets_dir):
    compose = load_compose()
    assert {"models", "data", "runs"} <= set(compose["volumes"])
    coord = compose["services"]["coordinator"]
    mounts = {v.split(":")[1]: v for v in coord["volumes"]}
    assert mounts["/experiments/experiment.yaml"].startswith("./experiment.yaml:")
    exp = load_experiment(COMPOSE_DIR / "experiment.yaml")
    assert exp.model.tiny is None, "the coordinator image has no torch to build a tiny model"
    for path in (exp.model.path, exp.data.train, exp.data.test, exp.runs_dir):
        assert any(path == m or path.startswith(m + "/") for m in mounts), f"{path} is not on a volume"
    assert mounts["/runs"] == "runs:/runs" and mounts["/data"] == "data:/data"
    ports = {n: compose_relayrl(compose, n, secrets_dir)[3].serve.port for n in RELAYRL_SERVICES}
    assert exp.services.generators == [f"generator:{ports['generator']}"]
    assert exp.services.rewards == [f"reward:{ports['reward']}"]
    assert exp.services.learner == f"learner:{ports['learner']}"
    # The coordinator calls them over TLS with the client certificate and the token it mounts.
    assert_calls_with(exp.services.security, COMPOSE_SECRETS)
    assert secret_paths(list(exp.services.security.model_dump().values())) <= mounted_secrets(coord)
    # The documented command: `docker compose run --rm --name relayrl-run coordinator relayrl run ...`
    check_cli(["relayrl", "run", "/experiments/experiment.yaml"])
    # PPO: the same, plus the critic and the reference of the `ppo` profile
    assert mounts["/experiments/experiment-ppo.yaml"].startswith("./experiment-ppo.yaml:")
    ppo = load_experiment(COMPOSE_DIR / "experiment-ppo.yaml")
    assert ppo.algorithm.advantage == "gae" and "reference" in ppo.role_sections()
    for role in LEARNER_ROLES:
        assert (
            getattr(ppo.services, role)
            == f"{role}:{compose_relayrl(compose, role, secrets_dir)[3].serve.port}"
        )
    assert ppo.services.model_copy(update={"critic": None, "reference": None}) == exp.services
    check_cli(["relayrl", "run", "/experiments/experiment-ppo.yaml"])
    init = compose["services"]["init"]
    (tiny,) = relayrl_invocations(init["command"])
    check_cli(tiny)
    assert "mv /models/.policy.tmp /models/policy" in init["command"][2]


def multi_turn_compose(secrets_dir: Path):
    """The compose experiment made multi-turn against the env service compose runs."""
    port = compose_relayrl(load_compose(), ENV, secrets_dir)[3].serve.port
    return multi_turn((COMPOSE_DIR / "experiment.yaml").read_text(), [f"{ENV}:{port}"], secrets_dir.parent)


def test_compose_env_service_serves_multi_turn_experiments(secrets_dir):
    """The env service (profile `env`) is what a multi-turn experiment's services.envs names: its
    compose name and gRPC port; the coordinator reaches it with the same client settings; it
    needs nothing but its secrets (no model, no volume, no GPU)."""
    compose = load_compose()
    svc, _argv, _args, config = compose_relayrl(compose, ENV, secrets_dir)
    assert svc["profiles"] == [ENV] and svc["build"]["target"] == ENV
    assert not {"volumes", "depends_on", "deploy"} & svc.keys()
    exp = multi_turn_compose(secrets_dir)
    assert exp.services.envs == [f"{ENV}:{config.serve.port}"] and exp.episodes is not None
    assert_calls_with(exp.services.security, COMPOSE_SECRETS)
    others = [s for n, s in compose["services"].items() if n != ENV and "ports" in s]
    published = {p for s in others for p in s["ports"]}
    assert not set(svc["ports"]) & published, "the env service's port is taken"
    with pytest.raises(ConfigError, match="services.envs"):  # a deployed multi-turn run must name it
        multi_turn((COMPOSE_DIR / "experiment.yaml").read_text(), [], secrets_dir.parent)


async def test_compose_env_service_end_to_end(secrets_dir):
    """The real env replica as compose starts it (its access settings, on the secrets
    make-secrets.sh made) answers its compose health check, and a multi-turn experiment's client
    settings reach it under the name its services.envs dials."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl not installed: no real certificates to serve with")
    svc, argv, _args, _config = compose_relayrl(load_compose(), ENV, secrets_dir)
    _args, served = check_cli(on_host(argv, COMPOSE_SECRETS, secrets_dir))
    exp = multi_turn_compose(secrets_dir).services
    sec = ClientSecurity(**{k: v and on_host([v], COMPOSE_SECRETS, secrets_dir)[0] for k, v in exp.security})
    async with env_server(served) as port:
        probe = on_host(svc["healthcheck"]["test"][1:], COMPOSE_SECRETS, secrets_dir)
        assert await run_probe(probe, port) == 0
        (host,) = [a.rsplit(":", 1)[0] for a in exp.envs]
        name = [("grpc.ssl_target_name_override", host)]
        async with security.client_channel(f"127.0.0.1:{port}", sec, options=name) as ch:
            assert {"calc", "guess"} <= set(await list_envs(ch))


def black_box_compose(secrets_dir: Path):
    """The compose experiment made black-box, as compose.yaml and experiment.yaml say: the env
    service in services.envs and the gateway's gRPC address in services.gateways."""
    compose = load_compose()
    env_port = compose_relayrl(compose, ENV, secrets_dir)[3].serve.port
    port = compose_relayrl(compose, GATEWAY, secrets_dir)[3].serve.port
    text = (COMPOSE_DIR / "experiment.yaml").read_text()
    return multi_turn(text, [f"{ENV}:{env_port}"], secrets_dir.parent, gateways=[f"{GATEWAY}:{port}"])


def test_compose_gateway_serves_black_box_experiments(secrets_dir):
    """The gateway (profile `gateway`) runs `relayrl serve gateway` with its gRPC health check; its
    gRPC address is what a black-box experiment's services.gateways names; its OpenAI API listens
    on 8000 of the compose network, under the compose name it hands to agents; it samples on the
    generator the experiment names, with the coordinator's client settings; nothing but its
    secrets (no model, volume or GPU)."""
    compose = load_compose()
    svc, argv, args, config = compose_relayrl(compose, GATEWAY, secrets_dir)
    assert argv[:3] == ["relayrl", "serve", "gateway"] and args.service == GATEWAY
    assert svc["profiles"] == [GATEWAY] and svc["build"]["target"] == GATEWAY
    assert healthcheck_target(svc["healthcheck"]["test"][1:]) == (config.serve.port, FULL_NAME[GATEWAY])
    assert not {"volumes", "depends_on", "deploy", "security_opt"} & svc.keys()
    assert config.http.port == 8000 and svc["expose"] == ["8000"]
    assert_serves_agents_plain_http(config, GATEWAY)
    assert "http.insecure=true" in svc["command"]  # said in the file, not left to an image default
    exp = black_box_compose(secrets_dir)
    assert exp.services.gateways == [f"{GATEWAY}:{config.serve.port}"] and exp.episodes is not None
    assert config.generators == exp.services.generators
    assert_calls_with(config.client, COMPOSE_SECRETS)
    others = [s for n, s in compose["services"].items() if n != GATEWAY and "ports" in s]
    published = {p.rsplit(":", 1)[-1] for s in others for p in s["ports"]}
    assert not {str(config.serve.port), "8000"} & published, "the gateway's ports are taken"
    metrics = {
        compose_relayrl(compose, n, secrets_dir)[3].serve.metrics_port
        for n in COMPOSE_RELAYRL
        if n != GATEWAY
    }
    assert config.serve.metrics_port not in metrics


@pytest.mark.parametrize("scheme", ["http", "https"])
async def test_compose_gateway_end_to_end(scheme, secrets_dir):
    """The real gateway as compose starts it (on the secrets make-secrets.sh made) answers its
    compose health check; the coordinator's client settings open a session under the name
    services.gateways dials; an agent lists the model at the URL it is handed, with the session's
    key. https: the variant compose.yaml describes (http.tls_* from the secrets instead of
    http.insecure), under a name the certificate holds, the agent trusting ca.crt."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl not installed: no real certificates to serve with")
    svc, argv, _args, _config = compose_relayrl(load_compose(), GATEWAY, secrets_dir)
    if scheme == "https":
        i = argv.index("http.insecure=true")
        argv = [*argv[: i - 1], *argv[i + 1 :], "--set", f"http.tls_cert={COMPOSE_SECRETS}/tls.crt"]
        argv = [*argv, "--set", f"http.tls_key={COMPOSE_SECRETS}/tls.key"]
        argv[argv.index("--public-url") + 1] = f"https://{GATEWAY}:8000/v1"
    _args, served = check_cli(on_host(argv, COMPOSE_SECRETS, secrets_dir))
    assert served.http.public_url.startswith(f"{scheme}://") and bool(served.http.tls_cert) == (
        scheme == "https"
    )
    exp = black_box_compose(secrets_dir).services
    sec = ClientSecurity(**{k: v and on_host([v], COMPOSE_SECRETS, secrets_dir)[0] for k, v in exp.security})
    async with gateway_server(served) as (port, http_port):
        probe = on_host(svc["healthcheck"]["test"][1:], COMPOSE_SECRETS, secrets_dir)
        assert await run_probe(probe, port) == 0
        (host,) = [a.rsplit(":", 1)[0] for a in exp.gateways]
        name = [("grpc.ssl_target_name_override", host)]
        async with security.client_channel(f"127.0.0.1:{port}", sec, options=name) as ch:
            opened = await open_session(ch)
        assert opened.base_url == served.http.public_url
        models = await agent_models(opened.base_url, http_port, opened.session_key, secrets_dir / "ca.crt")
        assert models == [served.model_name]


def prometheus_targets(path: Path) -> dict[str, list[str]]:
    conf = yaml.safe_load(path.read_text())
    return {
        j["job_name"]: [t for sc in j["static_configs"] for t in sc["targets"]]
        for j in conf["scrape_configs"]
    }


def test_compose_prometheus_scrapes_every_metrics_port(secrets_dir):
    compose = load_compose()
    targets = prometheus_targets(COMPOSE_DIR / "prometheus.yml")
    for name in (*RELAYRL_SERVICES, *LEARNER_ROLES, ENV, GATEWAY):
        assert f"{name}:{compose_relayrl(compose, name, secrets_dir)[3].serve.metrics_port}" in targets[name]
    for name in ("generator", "learner"):  # the GPU variants answer on the same names and ports
        assert (
            compose_relayrl(compose, f"{name}-gpu", secrets_dir)[3].serve.metrics_port
            == compose_relayrl(compose, name, secrets_dir)[3].serve.metrics_port
        )
    exp = load_experiment(COMPOSE_DIR / "experiment.yaml")
    assert f"relayrl-run:{exp.services.metrics_port}" in targets["coordinator"]
    assert compose["services"]["prometheus"]["volumes"][0].startswith("./prometheus.yml:")


def _metric_samples() -> set[str]:
    """Names Prometheus sees for every metric the services define."""
    import importlib

    from prometheus_client.metrics import MetricWrapperBase

    names = set()
    for svc in ("generator", "learner", "reward", "coordinator", "env", "gateway"):
        mod = importlib.import_module(f"relayrl.{svc}.metrics")
        for m in vars(mod).values():
            if isinstance(m, MetricWrapperBase):
                (desc,) = m.describe()
                suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"]}.get(
                    desc.type, [""]
                )
                names |= {desc.name + s for s in suffixes}
    return names


def test_grafana_dashboard_uses_real_metric_names():
    dash = json.loads((COMPOSE_DIR / "grafana" / "dashboards" / "relayrl.json").read_text())
    ds = yaml.safe_load(
        (COMPOSE_DIR / "grafana" / "provisioning" / "datasources" / "prometheus.yaml").read_text()
    )
    uid = ds["datasources"][0]["uid"]
    titles = " ".join(p["title"].lower() for p in dash["panels"])
    for word in ("reward", "tokens/s", "sync", "staleness", "errors", "env"):
        assert word in titles, f"no panel about {word}"
    known = _metric_samples()
    loop = "".join(
        (ROOT / "services" / "coordinator" / f).read_text() for f in ("loop.py", "algorithms/rewards.py")
    )
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    for p in dash["panels"]:
        assert p["datasource"]["uid"] == uid and all(t["datasource"]["uid"] == uid for t in p["targets"])
    for expr in exprs:
        for name in re.findall(r"\brelayrl_[a-z_]+", expr):
            assert name in known, f"{expr}: {name} is not a metric the services export"
        for run_metric in re.findall(r'relayrl_run_metric\{name="([a-z_]+)"', expr):
            assert f'"{run_metric}"' in loop, f"{expr}: the coordinator records no {run_metric}"
    provider = yaml.safe_load(
        (COMPOSE_DIR / "grafana" / "provisioning" / "dashboards" / "relayrl.yaml").read_text()
    )
    mounts = compose_mounts("grafana")
    assert provider["providers"][0]["options"]["path"] in mounts.values()


def compose_mounts(name: str) -> dict[str, str]:
    return {v.split(":")[0]: v.split(":")[1] for v in load_compose()["services"][name]["volumes"]}


@pytest.mark.parametrize(
    "profile", ["cpu", "gpu", "gpu1"], ids=["cpu-profile", "gpu-profile", "gpu1-profile"]
)
def test_compose_file_is_valid_compose(profile):
    """The compose specification's schema (the ``compose-spec`` package, a validating parser:
    unknown keys, types, ports, durations), after YAML anchors and ``<<`` merges are resolved as
    compose resolves them; then what a schema cannot see: every service a profile runs depends
    only on services that profile runs, and every secret and named volume it uses is declared.
    Where Debian's ``docker-compose`` is installed, its ``config`` must accept the file too."""
    from compose_spec import PyCompose

    data = load_compose()
    PyCompose.from_yaml(yaml.safe_dump(data))  # ValueError naming the field when invalid
    active = {n: s for n, s in data["services"].items() if not s.get("profiles") or profile in s["profiles"]}
    assert {"generator", "learner", "reward", "coordinator"} <= {
        n.removesuffix("-gpu").removesuffix("-1gpu") for n in active
    }
    for name, svc in active.items():
        for dep in svc.get("depends_on", []):
            assert dep in active, f"{name} depends on {dep}, which the {profile} profile does not run"
        for secret in svc.get("secrets", []):
            source = secret if isinstance(secret, str) else secret["source"]
            assert source in data.get("secrets", {}), f"{name}: secret {source} is not declared"
        for volume in svc.get("volumes", []):
            source = (volume if isinstance(volume, str) else volume.get("source", "")).split(":")[0]
            if source and not source.startswith((".", "/", "~")):
                assert source in data.get("volumes", {}), f"{name}: volume {source} is not declared"
    if shutil.which("docker-compose"):
        run = subprocess.run(
            ["docker-compose", "-f", "compose.yaml", "--profile", profile, "config", "-q"],
            cwd=COMPOSE_DIR,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert run.returncode == 0, run.stderr


# -- the README's compose section and scripts/compose_check.sh ----------------------------------------
def readme_compose_commands() -> list[str]:
    """The commands of the first bash block of the manual's compose page, comments cut."""
    section = (ROOT / "docs" / "compose.md").read_text()
    block = section[section.index("```bash\n") + 8 :]
    block = block[: block.index("```")]
    return [
        line.split("  #")[0].strip()
        for line in block.splitlines()
        if line.strip() and not line.startswith("#")
    ]


def test_the_compose_check_runs_the_readmes_commands():
    """`scripts/compose_check.sh` is the manual's compose page (docs/compose.md), run: the same images under the
    same tags, the same secrets, `up`, the experiment's `run` and `down` (the script adds only
    `-T`, having no terminal, and waits for health by inspecting the containers)."""
    script = (ROOT / "scripts" / "compose_check.sh").read_text()
    images = dict(
        item.split(":", 1) for item in re.search(r"IMAGES=\((.*?)\)", script, re.S).group(1).split()
    )
    images = {t: tag.replace("$VERSION", "0.1.0") for t, tag in images.items()}
    commands = readme_compose_commands()
    built = {}
    for cmd in commands:
        if cmd.startswith("docker build"):
            words = cmd.split()
            assert words[-1] == "." and "-f deploy/docker/Dockerfile" in cmd, cmd
            built[words[words.index("--target") + 1]] = words[words.index("-t") + 1]
        elif cmd.startswith("docker compose "):
            sub = cmd.removeprefix("docker compose ")
            if sub == "ps":
                continue  # informational: the script inspects each container's health instead
            ran = script.replace("compose run -T ", "compose run ")
            assert f"compose {sub}" in ran, f"the script does not run: {cmd}"
        elif cmd.startswith("cd "):
            assert cmd == "cd deploy/compose"
        else:
            assert cmd in script, f"the script does not run: {cmd}"
    assert built == images, f"README builds {built}, the script {images}"
    assert {"docker compose up -d", "docker compose down"} <= set(commands)
    assert any(c.startswith("docker compose run ") for c in commands)
    for svc in ("generator", "learner", "reward", "coordinator"):  # the images compose runs
        image = load_compose()["services"][svc]["image"]
        assert image in images.values(), f"compose runs {image}, which neither builds"


def test_compose_env_service_alone_may_make_namespaces_for_its_sandbox(secrets_dir):
    """The code sandbox (bubblewrap as user 10001) needs user namespaces: the env service gets a
    seccomp profile that allows them and no AppArmor profile, nothing privileged, no capability;
    no other service gets any of it. Its image installs bubblewrap; its jobs run without /proc."""
    compose = load_compose()
    for name, svc in compose["services"].items():
        assert not svc.get("privileged") and not svc.get("cap_add"), f"{name} is privileged"
        if name != ENV:
            assert "security_opt" not in svc, f"{name} loosens its security profile"
    svc, _argv, _args, config = compose_relayrl(compose, ENV, secrets_dir)
    opts = dict(o.split("=", 1) for o in svc["security_opt"])
    assert opts == {"seccomp": "./seccomp-env.json", "apparmor": "unconfined"}
    profile = json.loads((COMPOSE_DIR / opts["seccomp"]).read_text())
    denied = {n for rule in profile["syscalls"] for n in rule["names"] if rule["action"] != "SCMP_ACT_ALLOW"}
    assert profile["defaultAction"] == "SCMP_ACT_ALLOW"
    assert not denied & {"clone", "clone3", "unshare", "mount", "umount2", "pivot_root", "setns"}
    assert {"bpf", "kexec_load", "init_module", "ptrace", "keyctl", "io_uring_setup", "io_setup"} <= denied
    vsock = [r for r in profile["syscalls"] if r["names"] == ["socket"]]  # AF_VSOCK ignores netns
    assert vsock == [
        {
            "names": ["socket"],
            "args": [{"index": 0, "value": 40, "op": "SCMP_CMP_EQ"}],
            "action": "SCMP_ACT_ERRNO",
            "errnoRet": 97,
        }
    ]
    assert config.sandbox.tier == "full" and config.sandbox.proc is False
    env_stage = " ".join(_instr(dockerfile_stages()[ENV], "RUN"))
    assert "apt-get install -y --no-install-recommends bubblewrap" in env_stage
