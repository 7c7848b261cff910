"""``relayrl launch ray`` without Ray: the placement plan, rank numbering, the config section, CLI."""

from __future__ import annotations

import subprocess
import sys

import pytest
from relayrl.common.config import ConfigError
from relayrl.coordinator.config import ExperimentConfig
from relayrl.coordinator.derive import load_experiment
from relayrl.coordinator.launch.ray.plan import Slot, assign_ranks, needs, plan
from relayrl.gateway.server import base_url


def _cfg(**sections) -> ExperimentConfig:
    return ExperimentConfig.model_validate({"model": {"path": "m"}, "data": {"train": "t"}, **sections})


def test_gpu_plan_gives_each_rank_a_gpu_and_each_replica_its_tensor_parallel_gpus():
    cfg = _cfg(
        learner={"world_size": 4},
        generator={"engine": {"tensor_parallel_size": 2}},
        reward={"workers": 4},
        services={"generator_replicas": 2, "reward_replicas": 1},
    )
    learner, rollout = plan(cfg, gpus=True, run_id="exp-1")
    assert learner.name == "relayrl-exp-1-learner" and learner.strategy == "PACK"
    assert learner.bundles == [{"CPU": 1.0, "GPU": 1.0}] * 4
    assert learner.roles == ["learner-0", "learner-1", "learner-2", "learner-3"]
    assert rollout.name == "relayrl-exp-1-rollout" and rollout.strategy == "PACK"
    assert rollout.bundles == [{"CPU": 1.0, "GPU": 2.0}, {"CPU": 1.0, "GPU": 2.0}, {"CPU": 4.0}]
    assert rollout.roles == ["gen-0", "gen-1", "reward-0"]
    assert needs([learner, rollout]) == {"CPU": 10.0, "GPU": 8.0}


def test_plan_follows_the_ray_section():
    cfg = _cfg(
        learner={"world_size": 2},
        ray={
            "learner_cpus_per_rank": 8,
            "learner_strategy": "STRICT_PACK",
            "generator_cpus": 4,
            "reward_cpus": 2,
            "rollout_strategy": "SPREAD",
        },
    )
    learner, rollout = plan(cfg, gpus=True, run_id="r")
    assert learner.strategy == "STRICT_PACK" and learner.bundles == [{"CPU": 8.0, "GPU": 1.0}] * 2
    assert rollout.strategy == "SPREAD" and rollout.bundles == [{"CPU": 4.0, "GPU": 1.0}, {"CPU": 2.0}]
    cpu_learner, cpu_rollout = plan(cfg, gpus=False, run_id="r")
    assert "GPU" not in needs([cpu_learner, cpu_rollout])


def test_ranks_are_numbered_per_node_like_torchrun():
    # Two nodes with four learner GPUs each; Ray returned the bundles interleaved.
    slots = [
        Slot("B" if i % 2 else "A", "10.0.0.2" if i % 2 else "10.0.0.1", (str(7 - i // 2),)) for i in range(8)
    ]
    envs = assign_ranks(slots, "/runs/r/rendezvous/learner-1.port")
    assert sorted(e.rank for e in envs) == list(range(8))
    for slot, e in zip(slots, envs, strict=True):
        assert e.node_rank == (0 if slot.node_id == "A" else 1)  # bundle 0's node holds rank 0
        assert e.rank == e.node_rank * 4 + e.local_rank  # consecutive within a node
        assert e.env["CUDA_VISIBLE_DEVICES"].split(",")[e.local_rank] == slot.gpus[0]
        assert e.env["MASTER_ADDR"] == "10.0.0.1" and "MASTER_PORT" not in e.env  # rank 0 publishes it
        assert e.env["RELAYRL_RENDEZVOUS_FILE"] == "/runs/r/rendezvous/learner-1.port"
        assert e.env["WORLD_SIZE"] == "8" and e.env["LOCAL_WORLD_SIZE"] == "4"
    assert envs[0].env["CUDA_VISIBLE_DEVICES"] == "4,5,6,7"


def test_uneven_placement_still_gives_every_rank_one_gpu():
    slots = [Slot("A", "a", ("0",)), Slot("A", "a", ("1",)), Slot("A", "a", ("2",)), Slot("B", "b", ("0",))]
    envs = assign_ranks(slots, "f")
    assert [(e.rank, e.local_rank, e.env["LOCAL_WORLD_SIZE"]) for e in envs] == [
        (0, 0, "3"),
        (1, 1, "3"),
        (2, 2, "3"),
        (3, 0, "1"),
    ]
    assert envs[3].env["CUDA_VISIBLE_DEVICES"] == "0" and envs[3].env["MASTER_ADDR"] == "a"


def test_cpu_ranks_carry_no_device_list():
    envs = assign_ranks([Slot("n", "127.0.0.1"), Slot("n", "127.0.0.1")], "f")
    assert [e.env["LOCAL_RANK"] for e in envs] == ["0", "1"]
    assert all("CUDA_VISIBLE_DEVICES" not in e.env for e in envs)


MINIMAL = "model: {path: m}\ndata: {train: t.parquet}\n"


@pytest.mark.parametrize(
    "override, needle",
    [
        ("ray.learner_strategy=TIGHT", "ray.learner_strategy"),
        ("ray.learner_cpus_per_rank=0", "ray.learner_cpus_per_rank"),
        ("ray.accelerator=tpu", "ray.accelerator"),
        ("ray.nodes=2", "ray.nodes: unknown field"),
    ],
)
def test_bad_ray_settings_name_the_field(tmp_path, override, needle):
    (tmp_path / "exp.yaml").write_text(MINIMAL)
    with pytest.raises(ConfigError, match=needle):
        load_experiment(tmp_path / "exp.yaml", [override])


def test_address_flag_becomes_ray_address(tmp_path):
    from relayrl.cli import build_parser
    from relayrl.coordinator import cli

    (tmp_path / "exp.yaml").write_text(MINIMAL)
    args = build_parser().parse_args(
        ["launch", "ray", str(tmp_path / "exp.yaml"), "--address", "10.0.0.1:6379"]
    )
    cfg, resume = cli._experiment(args, cli.ray_overrides(args))
    assert cfg.ray.address == "10.0.0.1:6379" and resume is None


def test_launch_refuses_service_addresses():
    from relayrl.coordinator.run import launch_ray as launch

    cfg = _cfg(services={"generators": ["g:1"], "rewards": ["r:1"], "learner": "l:1"})
    with pytest.raises(SystemExit, match="starts the services itself"):
        launch(cfg)


def test_cli_parser_does_not_import_ray():
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "from relayrl.cli import build_parser; build_parser(); import sys; print('ray' in sys.modules)",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == "False"


def test_learner_checkpoints_go_beside_the_run_folder_on_resume_too(tmp_path):
    from relayrl.common.config import dump_yaml
    from relayrl.coordinator.launch.replicas import learner_section

    run_dir = tmp_path / "runs" / "exp-1"
    cfg = _cfg()
    assert learner_section(cfg, run_dir).checkpoint_dir == str(tmp_path / "runs")
    # A resumed run reads its config.yaml, which records every field, the default included.
    (tmp_path / "config.yaml").write_text(dump_yaml(cfg))
    resumed = load_experiment(tmp_path / "config.yaml")
    assert "checkpoint_dir" in resumed.learner.model_fields_set
    assert learner_section(resumed, run_dir).checkpoint_dir == str(tmp_path / "runs")
    own = _cfg(learner={"checkpoint_dir": "/shared/ckpt"})
    assert learner_section(own, run_dir).checkpoint_dir == "/shared/ckpt"


def test_the_ray_example_validates_and_plans():
    from pathlib import Path

    example = Path(__file__).resolve().parents[2] / "examples" / "countdown-ray-gpu.yaml"
    learner, rollout = plan(load_experiment(example), gpus=True, run_id="r")
    assert learner.bundles == [{"CPU": 8.0, "GPU": 1.0}] * 8 and rollout.strategy == "SPREAD"
    assert rollout.roles == ["gen-0", "gen-1", "gen-2", "gen-3", "reward-0", "reward-1"]


BLACK_BOX = {
    "episodes": {"env": "calc-harness"},
    "services": {"env_replicas": 1, "gateway_replicas": 2},
    "ray": {"env_cpus": 2, "gateway_cpus": 0.5},
}


def test_env_and_gateway_replicas_get_bundles_in_the_rollout_group():
    _, rollout = plan(_cfg(**BLACK_BOX), gpus=False, run_id="r")
    assert rollout.roles == ["gen-0", "reward-0", "env-0", "gateway-0", "gateway-1"]
    assert rollout.bundles[2:] == [{"CPU": 2.0}, {"CPU": 0.5}, {"CPU": 0.5}]


def _gateways_started(cfg: ExperimentConfig, ip: str, tmp_path) -> tuple[object, dict]:
    """``RayServices._start_gateways`` with the Ray calls stood in: what each gateway is given."""
    from relayrl.coordinator.launch.ray.services import RayServices

    class Host:  # an actor handle: nothing is asked of it before the launch
        pass

    svc = RayServices(cfg, tmp_path)
    svc.generators = {"gen-0": "192.0.2.5:4000"}  # documentation addresses: nothing is dialled
    svc.hosts = {f"gateway-{i}": Host() for i in range(2)}
    launched = {}
    svc._launch = lambda name, where, section, args: launched.setdefault(name, (section, args))
    svc._addresses = lambda names, where, deadline: {n: f"{ip}:5005{n[-1]}" for n in names}
    svc.record["services"] = {n: {} for n in svc.hosts}
    svc._start_gateways({n: {"ip": ip} for n in svc.hosts}, deadline=0)
    return svc, launched


def test_gateways_on_ray_sample_on_the_runs_generators_and_announce_their_node(tmp_path):
    # a public_url of the experiment's would name one address for every replica: each names its own
    cfg = _cfg(
        **BLACK_BOX, gateway={"http": {"insecure": True, "public_url": "http://lb:1/v1"}, "max_sessions": 9}
    )
    svc, launched = _gateways_started(cfg, "192.0.2.7", tmp_path)
    section, args = launched["gateway-1"]
    assert args == ["gateway"] and section.generators == ["192.0.2.5:4000"] and section.max_sessions == 9
    # A port bound there (0: no port picked here, which could be taken before the gateway binds
    # it), announced at the node's address with whatever port it bound.
    assert (section.http.host, section.http.port, section.http.public_host) == ("192.0.2.7", 0, "192.0.2.7")
    assert section.http.public_url == "" and section.serve.host == "192.0.2.7"
    assert base_url(section, 41234) == "http://192.0.2.7:41234/v1"
    assert svc.gateways == {"gateway-0": "192.0.2.7:50050", "gateway-1": "192.0.2.7:50051"}


def test_a_gateway_off_loopback_without_tls_is_refused_naming_the_field(tmp_path):
    with pytest.raises(ConfigError, match="gateway.http"):
        _gateways_started(_cfg(**BLACK_BOX), "192.0.2.7", tmp_path)
    _, launched = _gateways_started(_cfg(**BLACK_BOX), "127.0.0.1", tmp_path)  # a private instance
    assert base_url(launched["gateway-0"][0], 8000) == "http://127.0.0.1:8000/v1"
