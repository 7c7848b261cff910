"""Kubernetes (deploy/k8s): overlays rendered (``kubectl kustomize`` when present, else the small
renderer here, compared with kubectl where both exist) and validated strictly with
``kubernetes-validate`` against a pinned Kubernetes version. Every service serves TLS, asks for a
client certificate and the token, and is probed over TLS; every caller trusts the CA and sends the
token; all from the Secrets mounted at /run/secrets/relayrl, which deploy/k8s/secrets (from
deploy/make-secrets.sh's files) or cert-manager makes."""

from __future__ import annotations

import base64
import copy
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from relayrl.common import security
from relayrl.common.serving import ClientSecurity
from relayrl.coordinator.derive import load_experiment

from tests.kit.deploy import (  # the token-env fixture applies to every test here
    FULL_NAME,
    K8S,
    K8S_SECRETS,
    K8S_VERSION,
    KIDS,
    KUSTOMIZATIONS,
    OVERLAYS,
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
    expand,
    flag,
    gateway_server,
    healthcheck_args,
    healthcheck_target,
    list_envs,
    make_secrets,
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

# The Secrets the pods mount and the keys each holds (cert-manager's names for certificates).
SECRET_KEYS = {
    "relayrl-tls": {"tls.crt", "tls.key", "ca.crt"},
    "relayrl-client-tls": {"tls.crt", "tls.key", "ca.crt"},
    "relayrl-token": {"token"},
}


@pytest.fixture(scope="module")
def secrets_dir(tmp_path_factory) -> Path:
    return make_secrets_dir(tmp_path_factory)


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
    return render_folder(_folder(name))


def render_folder(folder: Path) -> list[dict]:
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
def test_k8s_commands_parse_with_the_cli(overlay, rendered, secrets_dir):
    seen = set()
    for doc, c, argv in workload_commands(rendered[overlay]):
        args, config = check_cli(on_host(argv, K8S_SECRETS, secrets_dir))
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
    assert seen == {"reward", "env", "gateway", "generator", "learner", "coordinator", "model"}


def _serve(doc: dict, secrets: Path) -> tuple[dict, list[str], object]:
    """(container, relayrl argv, config with the container's paths) of a workload's server; the
    command passes the start-up check with the secret files in ``secrets``."""
    (c,) = [c for c in doc["spec"]["template"]["spec"]["containers"]]
    (argv,) = relayrl_invocations(c["command"])
    argv = expand(argv, _env_values(doc, c))
    check_cli(on_host(argv, K8S_SECRETS, secrets))
    return c, argv, container_config(argv)


SERVERS = ("generator", "reward", "env", "gateway", "coordinator", "learner")
LEARNER_ROLES = ("critic", "reference")  # PPO's other learners (the cpu-ppo overlay)


def servers(workloads: dict) -> list[str]:
    return [*SERVERS, *(r for r in LEARNER_ROLES if r in workloads)]


PROBES = ("startupProbe", "livenessProbe", "readinessProbe")


def _workloads(docs: list[dict]) -> dict[str, dict]:
    return {**by_kind(docs, "Deployment"), **by_kind(docs, "StatefulSet")}


def probe_argv(c: dict, probe: str) -> list[str]:
    """The health check a probe runs: the learner's pods other than pod 0 skip it (only pod 0
    serves gRPC), through a shell; the others run it directly."""
    command = c[probe]["exec"]["command"]
    if command[:2] == ["sh", "-c"]:
        assert command[2].startswith('test "$POD_INDEX" != 0 || exec python'), command
        return shlex.split(command[2].split("exec ", 1)[1])
    return command


@pytest.mark.parametrize("overlay", KUSTOMIZATIONS, ids=KIDS)
def test_k8s_probes_check_grpc_health_over_tls(overlay, rendered, secrets_dir):
    """Kubernetes' grpc: probe speaks plaintext only: with TLS on, every probe runs the Python one,
    live ("") for startup and liveness, the service's full name for readiness."""
    workloads = _workloads(rendered[overlay])
    for name in servers(workloads):
        c, _argv, config = _serve(workloads[name], secrets_dir)
        for probe in PROBES:
            assert set(c[probe]) & {"grpc", "tcpSocket", "httpGet"} == set(), f"{name} {probe}: not over TLS"
            argv = probe_argv(c, probe)
            full = FULL_NAME["learner" if name in LEARNER_ROLES else name]
            service = full if probe == "readinessProbe" else ""
            assert healthcheck_target(argv) == (config.serve.port, service), (name, probe)
            assert_probes_over_tls(argv, K8S_SECRETS)
            # Kubernetes kills an exec probe at timeoutSeconds: leave room for Python to start.
            assert c[probe]["timeoutSeconds"] >= healthcheck_args(argv).timeout + 2, (name, probe)


def _secret_volume(pod: dict, container: dict, mount_path: str) -> dict[str, tuple[str, str]]:
    """Files of the projected Secrets volume ``container`` mounts at ``mount_path``:
    path in the container -> (Secret, key)."""
    (mount,) = [m for m in container.get("volumeMounts", []) if m["mountPath"] == mount_path]
    assert mount.get("readOnly") is True, f"{mount_path} must be mounted read-only"
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    files = {}
    for source in volume["projected"]["sources"]:
        secret = source["secret"]
        assert secret["name"] in SECRET_KEYS, f"unknown Secret {secret['name']}"
        for item in secret["items"]:
            assert item["key"] in SECRET_KEYS[secret["name"]], (secret["name"], item["key"])
            files[f"{mount_path}/{item['path']}"] = (secret["name"], item["key"])
    return files


@pytest.mark.parametrize("overlay", KUSTOMIZATIONS, ids=KIDS)
def test_k8s_services_serve_and_call_with_tls_from_mounted_secrets(overlay, rendered, secrets_dir):
    workloads = _workloads(rendered[overlay])
    for name in servers(workloads):
        pod = _pod_spec(workloads[name])
        c, argv, config = _serve(workloads[name], secrets_dir)
        assert_serves_tls_from(config, K8S_SECRETS)
        if name == "learner":  # rank 0 calls the generators (weight-sync control)
            assert_calls_with(config.security, K8S_SECRETS)
        if name == "gateway":  # it calls the generators; its OpenAI API is the one plain HTTP server
            assert_calls_with(config.client, K8S_SECRETS)
            assert_serves_agents_plain_http(config, "gateway")
        files = _secret_volume(pod, c, K8S_SECRETS)
        used = secret_paths(argv).union(*(secret_paths(probe_argv(c, p)) for p in PROBES))
        assert used <= files.keys(), f"{name} names secrets it does not mount: {used - files.keys()}"
        # The server's own certificate, key and CA come from one Secret (one cert-manager Certificate).
        assert {files[f"{K8S_SECRETS}/{f}"][0] for f in ("tls.crt", "tls.key", "ca.crt")} == {"relayrl-tls"}
        assert files[f"{K8S_SECRETS}/client.crt"] == ("relayrl-client-tls", "tls.crt")
        assert files[f"{K8S_SECRETS}/client.key"] == ("relayrl-client-tls", "tls.key")
        assert files[f"{K8S_SECRETS}/token"] == ("relayrl-token", "token")
        # 0440 read through the pod's group: the files belong to root and to fsGroup.
        assert pod["securityContext"]["fsGroup"] == pod["securityContext"]["runAsGroup"]
        (volume,) = [v for v in pod["volumes"] if "projected" in v]
        assert volume["projected"]["defaultMode"] == 0o440


@pytest.mark.parametrize("overlay", KUSTOMIZATIONS, ids=KIDS)
def test_k8s_experiment_calls_with_the_mounted_client_secrets(overlay, rendered, tmp_path):
    """The coordinator and a run Job call the services with services.security: the CA, the client
    certificate and the token, mounted in both; the Job holds no server key."""
    docs = rendered[overlay]
    cm = by_kind(docs, "ConfigMap")["relayrl-experiment"]
    (tmp_path / "experiment.yaml").write_text(cm["data"]["experiment.yaml"])
    sec = load_experiment(tmp_path / "experiment.yaml").services.security
    assert_calls_with(sec, K8S_SECRETS)
    needed = {sec.ca, sec.cert, sec.key, sec.token_file}
    coord = by_kind(docs, "Deployment")["coordinator"]
    (job,) = [d for d in yaml.safe_load_all((K8S / "jobs" / "run-experiment.yaml").read_text()) if d]
    for pod in (_pod_spec(coord), _pod_spec(job)):
        files = _secret_volume(pod, pod["containers"][0], K8S_SECRETS)
        assert needed <= files.keys()
    assert f"{K8S_SECRETS}/tls.key" not in _secret_volume(
        _pod_spec(job), _pod_spec(job)["containers"][0], K8S_SECRETS
    )


async def test_k8s_wiring_end_to_end(rendered, secrets_dir, tmp_path):
    """The reward service as its pod starts it (its access settings, on the secrets make-secrets.sh
    made) passes its readiness probe, and the coordinator's and the learner's client settings reach
    it under every name they dial (each generator replica's stable name included)."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl not installed: no real certificates to serve with")
    workloads = _workloads(rendered["cpu"])
    c, argv, _config = _serve(workloads["reward"], secrets_dir)
    _args, served = check_cli(on_host(argv, K8S_SECRETS, secrets_dir))
    cm = by_kind(rendered["cpu"], "ConfigMap")["relayrl-experiment"]
    (tmp_path / "experiment.yaml").write_text(cm["data"]["experiment.yaml"])
    exp = load_experiment(tmp_path / "experiment.yaml").services
    learner = _serve(workloads["learner"], secrets_dir)[2].security

    def here(sec: ClientSecurity) -> ClientSecurity:
        return ClientSecurity(**{k: v and on_host([v], K8S_SECRETS, secrets_dir)[0] for k, v in sec})

    envs = multi_turn(cm["data"]["experiment.yaml"], ["env:50057"], tmp_path).services.envs
    hosts = [a.rsplit(":", 1)[0] for a in [*exp.generators, *exp.rewards, exp.learner, *envs]]
    callers = [(here(exp.security), h) for h in [*hosts, "coordinator"]]
    callers.append((here(learner), "generator-7.generator-headless"))  # after scaling to 8 replicas
    async with reward_server(served.serve) as port:
        probe = on_host(probe_argv(c, "readinessProbe"), K8S_SECRETS, secrets_dir)
        assert await run_probe(probe, port) == 0
        for sec, host in callers:
            name = [("grpc.ssl_target_name_override", host)]
            async with security.client_channel(f"127.0.0.1:{port}", sec, options=name) as ch:
                assert await score(ch) == 1.0, host


def test_k8s_secrets_kustomization_makes_the_secrets_the_pods_mount(tmp_path, kv):
    """deploy/k8s/secrets with make-secrets.sh's files: the three Secrets, their keys, valid."""
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl not installed: the fallback renderer has no secretGenerator")
    folder = tmp_path / "secrets"
    shutil.copytree(K8S / "secrets", folder)
    run = make_secrets(folder)
    assert run.returncode == 0, run.stderr
    docs = render_folder(folder)
    secrets = by_kind(docs, "Secret")
    assert {n: set(d["data"]) for n, d in secrets.items()} == SECRET_KEYS
    for doc in docs:
        kv.validate(doc, K8S_VERSION, strict=True)
    assert secrets["relayrl-tls"]["type"] == secrets["relayrl-client-tls"]["type"] == "kubernetes.io/tls"
    data = lambda name, key: base64.b64decode(secrets[name]["data"][key])  # noqa: E731
    assert data("relayrl-tls", "tls.key") == (folder / "tls.key").read_bytes()
    assert data("relayrl-client-tls", "tls.crt") == (folder / "client.crt").read_bytes()
    assert data("relayrl-token", "token") == (folder / "token").read_bytes()
    assert not any((K8S / "secrets" / f).exists() for f in SECRET_FILES), "secret files in the repository"


def test_k8s_cert_manager_example_fills_the_same_secrets(rendered, tmp_path):
    docs = [d for d in yaml.safe_load_all((K8S / "secrets" / "cert-manager.yaml").read_text()) if d]
    certs = {d["spec"]["secretName"]: d["spec"] for d in docs if d["kind"] == "Certificate"}
    assert {"relayrl-tls", "relayrl-client-tls"} <= certs.keys()
    assert "server auth" in certs["relayrl-tls"]["usages"]
    assert "client auth" in certs["relayrl-client-tls"]["usages"]
    issuers = {d["metadata"]["name"] for d in docs if d["kind"] == "Issuer"}
    for spec in certs.values():
        assert spec["issuerRef"]["name"] in issuers
    # The server certificate names every host the experiment dials, and 127.0.0.1 for the probes.
    cm = by_kind(rendered["base"], "ConfigMap")["relayrl-experiment"]
    (tmp_path / "experiment.yaml").write_text(cm["data"]["experiment.yaml"])
    exp = load_experiment(tmp_path / "experiment.yaml").services
    hosts = {a.rsplit(":", 1)[0] for a in [*exp.generators, *exp.rewards, exp.learner]}
    assert hosts | {"coordinator", "env", "gateway"} <= set(certs["relayrl-tls"]["dnsNames"])
    assert "127.0.0.1" in certs["relayrl-tls"]["ipAddresses"]


@pytest.mark.parametrize("overlay", KUSTOMIZATIONS, ids=KIDS)
def test_k8s_learner_statefulset_and_rendezvous(overlay, rendered, secrets_dir):
    docs = rendered[overlay]
    sts = by_kind(docs, "StatefulSet")["learner"]
    services = by_kind(docs, "Service")
    headless = services[sts["spec"]["serviceName"]]
    assert sts["spec"]["serviceName"] == "learner-headless"
    assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["publishNotReadyAddresses"] is True
    assert headless["spec"]["selector"].items() <= sts["spec"]["template"]["metadata"]["labels"].items()
    assert sts["spec"]["podManagementPolicy"] == "Parallel"  # pod 0 is not ready until all ranks joined
    c, argv, config = _serve(sts, secrets_dir)
    raw = relayrl_invocations(c["command"])[0]
    assert flag(raw, "--node-rank") == "$(POD_INDEX)"
    assert _env_values(sts, c)["POD_INDEX"] == "0"
    assert flag(argv, "--master-addr") == f"{sts['metadata']['name']}-0.{sts['spec']['serviceName']}"
    assert int(flag(argv, "--nnodes")) == sts["spec"]["replicas"]
    assert int(flag(argv, "--master-port")) in {p["port"] for p in headless["spec"]["ports"]}
    assert config.weight_sync_host == flag(argv, "--master-addr")
    # The coordinator's relative checkpoint paths resolve on the runs volume, in the run folder.
    assert config.checkpoint_dir == "/runs"
    assert "/runs" in {m["mountPath"] for m in c["volumeMounts"]}
    front = services["learner"]
    assert front["spec"]["selector"]["statefulset.kubernetes.io/pod-name"] == "learner-0"
    gpus = c["resources"].get("limits", {}).get("nvidia.com/gpu")
    if gpus is not None:  # one rank per GPU of each pod
        assert config.world_size == int(gpus) * sts["spec"]["replicas"]


@pytest.mark.parametrize("overlay", KUSTOMIZATIONS, ids=KIDS)
def test_k8s_generators_and_experiment(overlay, rendered, tmp_path, secrets_dir):
    docs = rendered[overlay]
    sts = by_kind(docs, "StatefulSet")["generator"]
    services = by_kind(docs, "Service")
    headless = services[sts["spec"]["serviceName"]]
    assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["publishNotReadyAddresses"] is True
    _c, _argv, gen = _serve(sts, secrets_dir)
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
        assert _serve(workload, secrets_dir)[2].serve.port == int(port)
    coord = by_kind(docs, "Deployment")["coordinator"]
    mounts = {
        m["mountPath"]: m["name"] for m in coord["spec"]["template"]["spec"]["containers"][0]["volumeMounts"]
    }
    volumes = {v["name"]: v for v in coord["spec"]["template"]["spec"]["volumes"]}
    assert volumes[mounts["/experiments"]]["configMap"]["name"] == "relayrl-experiment"
    for path in (exp.model.path, exp.data.train, exp.runs_dir):
        assert any(path == m or path.startswith(m + "/") for m in mounts), f"{path} is not mounted"
    assert Path(gen.engine.model).parent.as_posix() == "/models"


@pytest.mark.parametrize("overlay", KUSTOMIZATIONS, ids=KIDS)
def test_k8s_env_service_a_multi_turn_experiment_reaches(overlay, rendered, tmp_path, secrets_dir):
    """Every variant runs the env service (CPU only, one image for all) behind the Service a
    multi-turn experiment names in services.envs, with the coordinator's client settings."""
    docs = rendered[overlay]
    workloads, services = _workloads(docs), by_kind(docs, "Service")
    env = workloads["env"]
    assert env["kind"] == "Deployment"
    c, _argv, config = _serve(env, secrets_dir)
    assert c["image"] == "relayrl/env:0.1.0" and "nvidia.com/gpu" not in c["resources"].get("limits", {})
    assert [m["mountPath"] for m in c["volumeMounts"]] == [K8S_SECRETS]  # no model, data or runs
    ports = {p["name"]: p["port"] for p in services["env"]["spec"]["ports"]}
    assert (ports["grpc"], ports["metrics"]) == (config.serve.port, config.serve.metrics_port)
    assert (
        services["env"]["spec"]["selector"].items() <= env["spec"]["template"]["metadata"]["labels"].items()
    )
    cm = by_kind(docs, "ConfigMap")["relayrl-experiment"]
    exp = multi_turn(cm["data"]["experiment.yaml"], [f"env:{ports['grpc']}"], tmp_path)
    assert exp.services.envs == [f"env:{config.serve.port}"]
    assert_calls_with(exp.services.security, K8S_SECRETS)


async def test_k8s_env_service_end_to_end(rendered, secrets_dir, tmp_path):
    """The real env replica as its pod starts it (on the secrets make-secrets.sh made) passes its
    readiness probe, and a multi-turn experiment's client settings reach it at its Service name."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl not installed: no real certificates to serve with")
    workloads = _workloads(rendered["cpu"])
    c, argv, config = _serve(workloads["env"], secrets_dir)
    _args, served = check_cli(on_host(argv, K8S_SECRETS, secrets_dir))
    cm = by_kind(rendered["cpu"], "ConfigMap")["relayrl-experiment"]
    exp = multi_turn(cm["data"]["experiment.yaml"], [f"env:{config.serve.port}"], tmp_path).services
    sec = ClientSecurity(**{k: v and on_host([v], K8S_SECRETS, secrets_dir)[0] for k, v in exp.security})
    async with env_server(served) as port:
        probe = on_host(probe_argv(c, "readinessProbe"), K8S_SECRETS, secrets_dir)
        assert await run_probe(probe, port) == 0
        (host,) = [a.rsplit(":", 1)[0] for a in exp.envs]
        name = [("grpc.ssl_target_name_override", host)]
        async with security.client_channel(f"127.0.0.1:{port}", sec, options=name) as ch:
            assert {"calc", "guess"} <= set(await list_envs(ch))


def black_box_k8s(docs: list[dict], folder: Path, secrets: Path):
    """The Kubernetes experiment made black-box, as gateway.yaml and experiment.yaml say: the env
    Service in services.envs and the gateway's in services.gateways, with their gRPC ports."""
    workloads = _workloads(docs)
    env, gateway = (_serve(workloads[n], secrets)[2].serve.port for n in ("env", "gateway"))
    cm = by_kind(docs, "ConfigMap")["relayrl-experiment"]
    return multi_turn(cm["data"]["experiment.yaml"], [f"env:{env}"], folder, gateways=[f"gateway:{gateway}"])


@pytest.mark.parametrize("overlay", KUSTOMIZATIONS, ids=KIDS)
def test_k8s_gateway_a_black_box_experiment_and_its_agents_reach(overlay, rendered, tmp_path, secrets_dir):
    """Every variant runs the gateway (`relayrl serve gateway`, CPU only, one image for all) as one
    pod behind the Service an experiment names in services.gateways (gRPC) and whose name the URL
    handed to agents carries (HTTP on 8000): one pod, since its sessions live in its memory. It
    samples on the generators the experiment names, with the coordinator's client settings, and
    is probed over gRPC health like the others (test_k8s_probes_check_grpc_health_over_tls)."""
    docs = rendered[overlay]
    workloads, services = _workloads(docs), by_kind(docs, "Service")
    gateway = workloads["gateway"]
    assert gateway["kind"] == "Deployment" and gateway["spec"]["replicas"] == 1
    assert gateway["spec"]["strategy"] == {"type": "Recreate"}  # never two pods behind the Service
    c, argv, config = _serve(gateway, secrets_dir)
    assert argv[:3] == ["relayrl", "serve", "gateway"]
    assert c["image"] == "relayrl/gateway:0.1.0" and "nvidia.com/gpu" not in c["resources"].get("limits", {})
    assert c["resources"]["requests"] and c["resources"]["limits"]["memory"]
    assert [m["mountPath"] for m in c["volumeMounts"]] == [K8S_SECRETS]  # no model, data or runs
    assert {p["name"]: p["containerPort"] for p in c["ports"]}["http"] == config.http.port == 8000
    ports = {p["name"]: p["port"] for p in services["gateway"]["spec"]["ports"]}
    assert ports == {
        "grpc": config.serve.port,
        "http": config.http.port,
        "metrics": config.serve.metrics_port,
    }
    selector = services["gateway"]["spec"]["selector"]
    assert selector.items() <= gateway["spec"]["template"]["metadata"]["labels"].items()
    assert_serves_agents_plain_http(config, "gateway")
    assert config.http.public_url == f"http://gateway:{ports['http']}/v1"  # the Service's port
    exp = black_box_k8s(docs, tmp_path, secrets_dir)
    assert exp.services.gateways == [f"gateway:{config.serve.port}"] and exp.episodes is not None
    assert config.generators == exp.services.generators
    assert_calls_with(config.client, K8S_SECRETS)
    assert_calls_with(exp.services.security, K8S_SECRETS)


async def test_k8s_gateway_end_to_end(rendered, secrets_dir, tmp_path):
    """The real gateway as its pod starts it (on the secrets make-secrets.sh made) passes its
    readiness probe; the coordinator's client settings open a session at the Service name; an
    agent lists the model at the URL it is handed, with the session's key."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl not installed: no real certificates to serve with")
    workloads = _workloads(rendered["cpu"])
    c, argv, _config = _serve(workloads["gateway"], secrets_dir)
    _args, served = check_cli(on_host(argv, K8S_SECRETS, secrets_dir))
    exp = black_box_k8s(rendered["cpu"], tmp_path, secrets_dir).services
    sec = ClientSecurity(**{k: v and on_host([v], K8S_SECRETS, secrets_dir)[0] for k, v in exp.security})
    async with gateway_server(served) as (port, http_port):
        probe = on_host(probe_argv(c, "readinessProbe"), K8S_SECRETS, secrets_dir)
        assert await run_probe(probe, port) == 0
        (host,) = [a.rsplit(":", 1)[0] for a in exp.gateways]
        name = [("grpc.ssl_target_name_override", host)]
        async with security.client_channel(f"127.0.0.1:{port}", sec, options=name) as ch:
            opened = await open_session(ch)
        assert opened.base_url == served.http.public_url
        models = await agent_models(opened.base_url, http_port, opened.session_key, secrets_dir / "ca.crt")
        assert models == [served.model_name]


def test_k8s_ppo_overlay_adds_critic_and_reference_the_ppo_experiment_reaches(
    rendered, tmp_path, secrets_dir
):
    docs = rendered["cpu-ppo"]
    workloads, services = _workloads(docs), by_kind(docs, "Service")
    assert (
        set(LEARNER_ROLES) <= workloads.keys() and not set(LEARNER_ROLES) & _workloads(rendered["cpu"]).keys()
    )
    cm = by_kind(docs, "ConfigMap")["relayrl-experiment"]
    (tmp_path / "experiment-ppo.yaml").write_text(cm["data"]["experiment-ppo.yaml"])
    exp = load_experiment(tmp_path / "experiment-ppo.yaml")
    assert exp.algorithm.advantage == "gae" and "reference" in exp.role_sections()
    for role in LEARNER_ROLES:
        _c, _argv, config = _serve(workloads[role], secrets_dir)
        assert config.role == role
        host, port = getattr(exp.services, role).rsplit(":", 1)
        assert host == role and config.serve.port == int(port)
        assert int(port) in {p["port"] for p in services[role]["spec"]["ports"]}
        assert workloads[role]["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"] == str(
            config.serve.metrics_port
        )
    critic = _serve(workloads["critic"], secrets_dir)[2]
    assert critic.checkpoint_dir == "/runs"  # its checkpoints land in the run folder, as the actor's
    mounts = {m["mountPath"] for m in _pod_spec(workloads["critic"])["containers"][0]["volumeMounts"]}
    assert "/runs" in mounts


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
        suffix = {"cpu": "-cpu", "gpu": "-cuda", "cpu-ppo": "-cpu"}[overlay]
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


def test_the_manual_documents_deployment():
    """The README points at the deployment pages, and they hold the commands that deploy."""
    assert "docs/deployment.md" in (ROOT / "README.md").read_text()
    pages = {p: (ROOT / "docs" / p).read_text() for p in ("compose.md", "kubernetes.md")}
    for page, text in (
        ("compose.md", "docker compose up"),
        ("compose.md", "--profile gpu"),
        ("compose.md", "relayrl run /experiments/experiment.yaml"),
        ("kubernetes.md", "overlays/gpu"),
        ("kubernetes.md", "relayrl run /experiments/experiment.yaml"),
    ):
        assert text in pages[page], (page, text)


@pytest.mark.parametrize("overlay", KUSTOMIZATIONS, ids=KIDS)
def test_k8s_env_pod_alone_may_make_namespaces_for_its_sandbox(overlay, rendered, secrets_dir):
    """The code sandbox (bubblewrap as user 10001) needs user namespaces: the env container runs
    under the Localhost seccomp profile shipped for it and no AppArmor profile, still unprivileged
    (no escalation, every capability dropped, non-root); every other container keeps the runtime's
    default profile. Its jobs run without /proc (the runtime masks it)."""
    workloads = _workloads(rendered[overlay])
    for name, doc in workloads.items():
        pod = _pod_spec(doc)
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        for c in [*pod.get("initContainers", []), *pod["containers"]]:
            sc = c.get("securityContext", {})
            assert not sc.get("privileged") and not sc.get("capabilities", {}).get("add"), name
            if name != "env":
                assert "seccompProfile" not in sc and "appArmorProfile" not in sc, name
    pod = _pod_spec(workloads["env"])
    (c,) = pod["containers"]
    sc = c["securityContext"]
    assert sc["seccompProfile"] == {"type": "Localhost", "localhostProfile": "relayrl/env-sandbox.json"}
    assert sc["appArmorProfile"] == {"type": "Unconfined"}
    assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"] == {"drop": ["ALL"]}
    assert pod["securityContext"]["runAsNonRoot"] is True
    _c, _argv, config = _serve(workloads["env"], secrets_dir)
    assert config.sandbox.tier == "full" and config.sandbox.proc is False
    assert (ROOT / "deploy/compose/seccomp-env.json").is_file()
