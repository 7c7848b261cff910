"""Kubernetes (deploy/k8s): overlays rendered (``kubectl kustomize`` when present, else the small
renderer here, compared with kubectl where both exist) and validated strictly with
``kubernetes-validate`` against a pinned Kubernetes version."""

from __future__ import annotations

import copy
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from relayrl.coordinator.config import load_experiment

from tests.deploy_checks import (  # the token-env fixture applies to every test here
    FULL_NAME,
    K8S,
    K8S_VERSION,
    KIDS,
    KUSTOMIZATIONS,
    OVERLAYS,
    ROOT,
    _no_token_env,  # noqa: F401
    check_cli,
    expand,
    flag,
    healthcheck_target,
    relayrl_invocations,
)


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
