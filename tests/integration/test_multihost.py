"""Several hosts on one machine: each service in its own network namespace with its own address.

Four namespaces hang off one bridge, as four machines on one switch. Every service binds its own
address (never loopback, so TLS and a token are required: the test serves with both), gets its
own working folder and its own copy of the model, and the coordinator reaches them only through
the addresses in its experiment file. The loop runs a few GRPO steps across them: generation,
scoring, training, the weight push over a gloo group between namespaces, a checkpoint. Nothing
may assume localhost or a filesystem shared with the coordinator: the learner's checkpoint lands
under the learner's own folder and the coordinator never needs the model.

Needs root and ``ip netns`` (iproute2); skipped elsewhere with the reason.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from contextlib import ExitStack, contextmanager
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

SUBNET = "10.213.{}.{}"


def _ip(*args: str, ns: str | None = None) -> None:
    cmd = ["ip", *(["netns", "exec", ns, "ip"] if ns else []), *args]
    subprocess.run(cmd, check=True, capture_output=True, text=True)


def _netns_usable() -> str | None:
    """None when namespaces can be made here, else why not."""
    if shutil.which("ip") is None:
        return "iproute2 (ip) is not installed"
    if os.geteuid() != 0:
        return "network namespaces need root"
    probe = f"rrlprobe{os.getpid()}"
    try:
        _ip("netns", "add", probe)
    except subprocess.CalledProcessError as e:
        return f"ip netns add failed: {e.stderr.strip()}"
    _ip("netns", "delete", probe)
    return None


@contextmanager
def hosts(names: list[str]):
    """One namespace per name on a shared bridge; yields {name: (namespace, address)}."""
    tag = f"{os.getpid() % 10000}"
    net = 100 + os.getpid() % 100
    bridge = f"rrb{tag}"
    made: list[str] = []
    try:
        _ip("link", "add", bridge, "type", "bridge")
        _ip("link", "set", bridge, "up")
        out = {}
        for i, name in enumerate(names):
            ns, a, b = f"rrl{tag}-{name}", f"rr{tag}{i}a", f"rr{tag}{i}b"
            _ip("netns", "add", ns)
            made.append(ns)
            _ip("link", "add", a, "type", "veth", "peer", "name", b)
            _ip("link", "set", b, "netns", ns)
            _ip("link", "set", a, "master", bridge, "up")
            addr = SUBNET.format(net, 10 + i)
            _ip("addr", "add", f"{addr}/24", "dev", b, ns=ns)
            _ip("link", "set", b, "up", ns=ns)
            _ip("link", "set", "lo", "up", ns=ns)  # torchrun's local rendezvous inside a host
            out[name] = (ns, addr)
        yield out
    finally:
        for ns in made:
            subprocess.run(["ip", "netns", "delete", ns], capture_output=True)
        subprocess.run(["ip", "link", "delete", bridge], capture_output=True)


EXPERIMENT = """
name: netns
seed: 0
runs_dir: runs
model: {{path: /nonexistent/the-coordinator-never-loads-it}}
data:
  train: data/train.parquet
  test: data/test.parquet
  generate: {{task: reverse, n_train: 200, n_test: 16, seed: 0}}
sampling: {{n: 4, temperature: 1.0, max_tokens: 24}}
schedule: {{steps: 3, prompts_per_step: 4, max_staleness: 0, eval_every: 0, checkpoint_every: 3}}
services:
  generators: ["{gen}"]
  rewards: ["{reward}"]
  learner: "{learner}"
  deadline_seconds: 180
  security: {{ca: {ca}, token_file: {token}}}
"""


@pytest.fixture(scope="module")
def model(reverse_assets) -> Path:
    # Warm-started, so rewards differ within groups and every step trains and pushes: the
    # session's reverse model (the e2e and chaos tests' own), built once for all of them.
    return reverse_assets / "model"


def test_the_loop_runs_across_four_hosts(model, tmp_path):
    why = _netns_usable()
    if why:
        pytest.skip(why)
    from relayrl.coordinator.launch.processes import ServiceProcess

    from tests.kit.pki import CA

    pki = tmp_path / "pki"
    pki.mkdir()
    ca = CA.create(pki)
    token = pki / "token"
    token.write_text("netns-test-token\n")
    names = ["learner", "learner-node1", "generator", "reward", "coordinator"]
    with hosts(names) as net, ExitStack() as stack:
        started: dict[str, tuple[ServiceProcess, str]] = {}

        def serve(name: str, *args: str) -> None:
            ns, addr = net[name]
            cert, key = ca.issue(name, addr)
            home = tmp_path / name
            # Each host holds its own copy of what it needs: nothing is read across hosts.
            if name.startswith(("learner", "generator")):
                shutil.copytree(model, home / "model")
            home.mkdir(parents=True, exist_ok=True)
            host = ServiceProcess(
                name,
                [
                    name.split("-")[0],
                    *args,
                    "--host",
                    addr,
                    "--port",
                    "0",
                    "--tls-cert",
                    cert,
                    "--tls-key",
                    key,
                    "--token-file",
                    str(token),
                ],
                home,
                # vLLM asks for the host's address for its own (single-worker) rendezvous.
                env={"VLLM_HOST_IP": addr, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
                entry=[
                    "ip",
                    "netns",
                    "exec",
                    ns,
                    sys.executable,
                    "-m",
                    "relayrl.cli",
                    "--log-level",
                    "INFO",
                    "serve",
                ],
                cwd=home,
            )
            stack.callback(host.stop)
            started[name] = (host, addr)

        serve(
            "generator",
            "--model",
            "model",
            "--dtype",
            "float32",
            "--max-model-len",
            "256",
            "--replica-id",
            "g0",
        )
        serve("reward", "--workers", "1")
        # The learner spans two hosts: one ZeRO-3 rank on each, torchrun's rendezvous on the
        # first; only node 0 (rank 0) serves gRPC.
        learner_args = [
            "--model",
            "model",
            "--world-size",
            "2",
            "--nnodes",
            "2",
            "--master-addr",
            net["learner"][1],
            "--master-port",
            "29555",
            "--set",
            f"security.ca={ca.path}",
            "--set",
            f"security.token_file={token}",
            # Namespaces share the IPC namespace (shared memory would work between them):
            # force what real hosts would use, a gloo broadcast across the network.
            "--set",
            "weight_sync_transport=gloo",
        ]
        serve("learner", *learner_args, "--node-rank", "0")
        serve("learner-node1", *learner_args, "--node-rank", "1")
        node1 = started.pop("learner-node1")[0]
        addrs = {n: h.wait_ready(600, host=a) for n, (h, a) in started.items()}
        assert node1.proc.poll() is None, node1.tail()
        assert not node1.port_file.exists()  # ranks other than 0 follow, they do not serve
        for n, a in addrs.items():
            assert not a.startswith("127."), f"{n} serves on loopback: {a}"

        coord = tmp_path / "coordinator"
        coord.mkdir()
        exp = coord / "exp.yaml"
        exp.write_text(
            textwrap.dedent(
                EXPERIMENT.format(
                    gen=addrs["generator"],
                    reward=addrs["reward"],
                    learner=addrs["learner"],
                    ca=ca.path,
                    token=token,
                )
            )
        )
        res = subprocess.run(
            [
                "ip",
                "netns",
                "exec",
                net["coordinator"][0],
                sys.executable,
                "-m",
                "relayrl.cli",
                "run",
                str(exp),
            ],
            cwd=coord,
            capture_output=True,
            text=True,
            timeout=900,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        logs = "\n".join(f"--- {n}\n{h.tail()}" for n, (h, _) in started.items()) + node1.tail()
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:] + logs

        run_dir = next((coord / "runs").glob("netns-*"))
        recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        steps = [r for r in recs if "reward_mean" in r]
        assert [r["step"] for r in steps] == [1, 2, 3]
        assert all(r["groups"] == 4 for r in steps)
        # Every push crossed namespaces over the gloo group and was verified on the generator.
        assert any(r["train_samples"] for r in steps), steps
        assert all(r["synced_replicas"] == 1 for r in steps if r["train_samples"]), steps
        assert steps[-1]["policy_version"] >= 2
        # The checkpoint is on the learner's host, under its own folder; the coordinator keeps
        # only its data cursor.
        ckpt = tmp_path / "learner" / "checkpoints" / run_dir.name / "checkpoints"
        assert (ckpt / "step3").is_dir(), sorted(p.name for p in (tmp_path / "learner").rglob("*"))[:50]
        assert (run_dir / "checkpoints" / "coordinator.json").exists()
        assert not (run_dir / "checkpoints" / "step3").exists()
        # Both nodes wrote their ZeRO-3 partition, at the path rank 0 resolved (checkpoint_dir
        # is storage every learner node mounts; here both see the same disk).
        parts = sorted(p.name for p in (ckpt / "step3").glob("*optim_states.pt"))
        assert len(parts) == 2 and "rank_1" in parts[1], parts
