"""An experiment's inputs on the coordinator's host: the model folder and the data files. What is
missing is named before anything starts (``missing_inputs``); what the config says how to build
(a tiny warm-started model, generated task data) is built (``prepare``)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from relayrl.common.verifiers import DATA_PREFIX as VERIFIERS_DATA_PREFIX
from relayrl.coordinator.config import EPISODE_WARM_STARTS, ExperimentConfig, TinyModelSpec
from relayrl.coordinator.records.trackers import missing_packages


def missing_inputs(cfg: ExperimentConfig) -> list[str]:
    """What the experiment needs on this host and can neither find nor build (empty: all there).
    With deployed services the model is theirs to load, on their own hosts: not looked for here."""
    problems = []
    model = Path(cfg.model.path)
    if cfg.services.embedded and not (model / "config.json").is_file() and cfg.model.tiny is None:
        problems.append(f"model folder {model} has no config.json (set model.tiny to build a tiny one)")
    for what, path in (("data.train", cfg.data.train), ("data.test", cfg.data.test)):
        if path and Path(path).exists() and not Path(path).is_file():
            problems.append(f"{what}: {path} is not a regular file")
        elif path and not Path(path).exists() and cfg.data.generate is None:
            problems.append(f"data file {path} does not exist (set data.generate to build it)")
    return problems + missing_packages(cfg.tracking)


def prepare(cfg: ExperimentConfig, stop: Callable[[], bool] | None = None) -> bool:
    """Build the tiny model and the task data when the config asks for them and they are missing;
    ValueError naming what is missing when it cannot. ``stop`` (asked from this thread, while
    data is generated): once true, give up, writing nothing more, and return False."""
    if problems := missing_inputs(cfg):
        raise ValueError("; ".join(problems))
    model = Path(cfg.model.path)
    if cfg.services.embedded and not (model / "config.json").exists():
        print(f"building tiny model in {model} ...", flush=True)
        if cfg.model.tiny.task in EPISODE_WARM_STARTS:
            build_episode_model(model, cfg.model.tiny)
        else:
            build_tiny_model(model, cfg.model.tiny)
    spec = cfg.data.generate
    for path, split, n in (
        (cfg.data.train, "train", spec and spec.n_train),
        (cfg.data.test, "test", spec and spec.n_test),
    ):
        if path and not Path(path).exists():
            from relayrl.common.data.dataset import write_rows
            from relayrl.common.data.tasks import GenerationStopped, generate_rows

            if spec.task.startswith(VERIFIERS_DATA_PREFIX):
                write_rows(verifiers_rows(cfg, split, n), path)
                continue
            try:
                rows = generate_rows(spec.task, n, spec.seed, split, spec.params, stop=stop)
            except GenerationStopped:
                return False
            write_rows(rows, path)
    return True


def build_tiny_model(model: Path, t: TinyModelSpec) -> None:
    """A tiny model, warm-started on a single-turn task when ``t`` names one."""
    from relayrl.common.modelkit.sft import warm_start
    from relayrl.common.modelkit.tiny import update_card, write_tiny_model

    write_tiny_model(model, seed=t.seed)
    if t.task and t.sft_steps:
        res = warm_start(model, t.task, t.sft_steps, seed=t.seed, lr=t.sft_lr)
        update_card(model, sft_task=t.task, sft_steps=t.sft_steps, sft_heldout_exact=res.heldout_exact)
        print(f"warm-started on {t.task}: held-out greedy exact {res.heldout_exact:.2f}", flush=True)


def build_episode_model(model: Path, t: TinyModelSpec) -> None:
    """A tiny model warm-started on an env's episodes, built by ``relayrl.warmstart`` in a process
    of its own (it joins the generator's chat codec and the env's code, which the coordinator
    only reaches through their services), in a folder beside ``model`` whose files move in when
    it is complete, config.json last: a build cut short leaves no model that looks finished."""
    part = model.with_name(model.name + ".part")
    shutil.rmtree(part, ignore_errors=True)
    cmd = [sys.executable, "-m", "relayrl.warmstart", "--out", str(part), "--task", str(t.task)]
    cmd += ["--seed", str(t.seed), "--sft-steps", str(t.sft_steps), "--sft-lr", str(t.sft_lr)]
    cmd += ["--tool-share", str(t.tool_share), "--tool-bar", str(t.sft_tool_bar)]
    if t.sft_max_steps is not None:
        cmd += ["--max-steps", str(t.sft_max_steps)]
    done = subprocess.run(cmd, stderr=subprocess.PIPE, text=True)  # its progress on our stdout
    if done.returncode:
        raise RuntimeError(f"building the tiny {t.task} model failed: {done.stderr[-2000:]}")
    model.mkdir(parents=True, exist_ok=True)
    for f in sorted(part.iterdir(), key=lambda f: f.name == "config.json"):  # config.json last
        f.replace(model / f.name)
    part.rmdir()


def verifiers_rows(cfg: ExperimentConfig, split: str, n: int) -> list[dict]:
    """``n`` rows of ``split`` from the taskset of ``data.generate.task: verifiers/<name>``: its
    tasks listed once under the sandbox's interpreter with the env's requirements installed
    (``relayrl.common.verifiers.list_tasks``), a seeded shuffle, the first ``n_test`` held out."""
    from relayrl.common import verifiers as vfc
    from relayrl.common.sandbox.packages import default_root
    from relayrl.common.sandbox.runner import resolve_python

    gen = cfg.data.generate
    name = gen.task.removeprefix(VERIFIERS_DATA_PREFIX)
    spec = next(v for v in cfg.env.verifiers if v.name == name)
    box = cfg.env.sandbox
    key = (name, gen.n_train + gen.n_test)
    if key not in _LISTED:
        print(f"listing the tasks of verifiers taskset {spec.taskset} ...", flush=True)
        reqs = Path(spec.requirements or vfc.DEFAULT_REQUIREMENTS).read_text()
        env = vfc.env_data(spec.taskset, spec.taskset_args, spec.harness, spec.max_turns)
        root = Path(box.packages_dir) if box.packages_dir else default_root()
        python = resolve_python(box.python)
        files = vfc.job_files(spec.folder)
        _LISTED[key] = vfc.list_tasks(env, files, reqs, key[1], python, root, box.packages_timeout_seconds)
    return vfc.task_rows(_LISTED[key], name, n, gen.seed, split, gen.n_test)


_LISTED: dict[tuple[str, int], list[dict]] = {}
"""Tasks listed in this process, by (env name, count): train and test come from one listing."""
