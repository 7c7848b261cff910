"""What a standing coordinator checks before StartExperiment answers OK: the contract says OK
means the experiment is under way, so everything that can be checked is checked first.

- The config parses and validates (every error names its field).
- Every path it names lies inside the coordinator's root, relative ones resolved under it: run
  folders, data, models, learner checkpoints, and the certificates, keys and token files. The
  token is sent as ``authorization: Bearer`` to service addresses the experiment itself names,
  so a file outside the root would hand the coordinator's host's secrets to any caller.
- Secret files are small regular files (``/dev/zero`` or a FIFO would hold the reader forever).
- Data files that exist parse: their first rows, read within a bound.
- A resume folder holds a readable ``checkpoints/coordinator.json`` naming a tag and a step.

In: the request's fields and the root. Out: the resolved ``ExperimentConfig`` and the resume
folder, or ``InvalidRequest`` naming what is wrong. All of it is disk and CPU work: callers run
``admit`` in a worker thread, never on the event loop.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from pathlib import Path

from pydantic import ValidationError
from relayrl.common import config as cfg_mod
from relayrl.common import security
from relayrl.common.data.dataset import DatasetError, check_head
from relayrl.common.rpc import InvalidRequest, bounded
from relayrl.coordinator.assets import missing_inputs
from relayrl.coordinator.config import ExperimentConfig
from relayrl.coordinator.derive import resolve_paths, under
from relayrl.learner.config import LearnerConfig

MAX_PATH_CHARS = 4096
"""Longest path accepted (Linux's PATH_MAX): a longer one cannot name a file."""
MAX_CHECKPOINT_RECORD_BYTES = 1 << 20
"""Largest ``checkpoints/coordinator.json`` read (the coordinator writes a few hundred bytes)."""
_TAG = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def admit(
    config_yaml: str, overrides: list[str], resume_from: str, root: Path
) -> tuple[ExperimentConfig, Path | None]:
    """The experiment of a StartExperiment request, resolved under ``root`` and checked, and the
    folder it resumes (None: a fresh run); InvalidRequest otherwise."""
    cfg = _experiment(config_yaml, overrides, root)
    for what, path in _named_paths(cfg):
        inside(what, path, root)
    _check_secret_files(cfg)
    resume = resume_folder(resume_from, root) if resume_from else None
    problems = missing_inputs(cfg) if resume is None else _missing_data(cfg)
    if problems:
        raise InvalidRequest("; ".join(problems))
    for what, path in (("data.train", cfg.data.train), ("data.test", cfg.data.test)):
        if path and Path(path).exists():
            try:
                check_head(path, env_scored=cfg.episodes is not None)
            except DatasetError as e:
                raise InvalidRequest(f"{what}: {e}") from None
    return cfg, resume


def _experiment(config_yaml: str, overrides: list[str], root: Path) -> ExperimentConfig:
    try:
        data = cfg_mod.parse_yaml(config_yaml, "config_yaml")
        cfg = resolve_paths(cfg_mod.build(ExperimentConfig, data, overrides), base=root)
        _resolve_service_paths(cfg, root)
    except cfg_mod.ConfigError as e:
        raise InvalidRequest(str(e)) from None
    except ValidationError as e:  # a value resolve_paths derives and assigns
        raise InvalidRequest(cfg_mod.format_validation_error(e, "config_yaml")) from None
    except (ValueError, OSError) as e:  # a path that cannot be resolved (a NUL character)
        raise InvalidRequest(f"config_yaml: a path cannot be resolved: {bounded(str(e), 200)}") from None
    return cfg


def _roles(cfg: ExperimentConfig) -> Iterator[tuple[str, LearnerConfig]]:
    for role in ("learner", "critic", "reference"):
        if (section := getattr(cfg, role)) is not None:
            yield role, section


_DEFAULT_CHECKPOINT_DIR = LearnerConfig.model_fields["checkpoint_dir"].default


def _resolve_service_paths(cfg: ExperimentConfig, root: Path) -> None:
    """The model and checkpoint folders the embedded services get, relative ones under ``root``
    (a service process resolves them against its working folder, which need not be the root).
    The default ``checkpoint_dir`` stays: it means "beside the run folder" (``learner_section``).
    Deployed services' sections describe other hosts: left as they are."""
    if not cfg.services.embedded:
        return

    def rel(p: str) -> str:
        return under(root, p)

    if cfg.generator.engine.model:
        cfg.generator.engine.model = rel(cfg.generator.engine.model)
    for _, section in _roles(cfg):
        if section.model:
            section.model = rel(section.model)
        if section.checkpoint_dir != _DEFAULT_CHECKPOINT_DIR:
            section.checkpoint_dir = rel(section.checkpoint_dir)


_CLIENT_FILES = ("ca", "cert", "key", "token_file")
_SERVE_FILES = ("tls_cert", "tls_key", "tls_client_ca", "token_file")


def _secret_files(cfg: ExperimentConfig) -> Iterator[tuple[str, str]]:
    """(field, path) of every certificate, key and token file this host would read for the
    experiment: the coordinator's own (``services.security``), and with the embedded default
    those of the services it starts (deployed services read theirs on their own hosts)."""
    clients = [("services.security", cfg.services.security)]
    serves = []
    if cfg.services.embedded:
        clients += [(f"{role}.security", s.security) for role, s in _roles(cfg)]
        serves += [(f"{name}.serve", getattr(cfg, name).serve) for name in ("generator", "reward")]
        serves += [(f"{role}.serve", s.serve) for role, s in _roles(cfg)]
    for where, section, names in [*((w, s, _CLIENT_FILES) for w, s in clients),
                                  *((w, s, _SERVE_FILES) for w, s in serves)]:  # fmt: skip
        for name in names:
            if path := getattr(section, name):
                yield f"{where}.{name}", path


def _named_paths(cfg: ExperimentConfig) -> Iterator[tuple[str, str]]:
    """(field, path) of every file or folder of this host the experiment would read or write."""
    yield "runs_dir", cfg.runs_dir
    yield "data.train", cfg.data.train
    if cfg.data.test:
        yield "data.test", cfg.data.test
    yield "model.path", cfg.model.path
    if cfg.services.embedded:  # the services this coordinator starts read and write these
        if cfg.generator.engine.model:
            yield "generator.engine.model", cfg.generator.engine.model
        for role, section in _roles(cfg):
            if section.model:
                yield f"{role}.model", section.model
            if section.checkpoint_dir != _DEFAULT_CHECKPOINT_DIR:
                yield f"{role}.checkpoint_dir", section.checkpoint_dir
        for field, spec, attr in cfg.env.path_fields():  # read by the env replicas it starts
            if value := getattr(spec, attr):
                yield field, value
    yield from _secret_files(cfg)


def inside(what: str, path: str, root: Path) -> Path:
    """``path`` (absolute by now) if it lies in ``root`` once links are followed, else
    InvalidRequest naming the field ``what``."""
    if len(path) > MAX_PATH_CHARS or "\0" in path:
        raise InvalidRequest(f"{what}: not a usable path (a NUL, or more than {MAX_PATH_CHARS} characters)")
    if not Path(os.path.realpath(path)).is_relative_to(root):
        raise InvalidRequest(f"{what} {bounded(path, 200)!r} is outside the coordinator's root {root}")
    return Path(path)


def _check_secret_files(cfg: ExperimentConfig) -> None:
    """Each certificate, key and token file: a small readable regular file, a token one word."""
    for what, path in _secret_files(cfg):
        try:
            if what.endswith("token_file"):
                security.read_token(path)
            else:
                security.read_file(path, what)
        except security.SecurityError as e:
            raise InvalidRequest(f"{what}: {e}") from None


def _missing_data(cfg: ExperimentConfig) -> list[str]:
    """A resumed run builds nothing: its data files must be there."""
    return [
        f"data file {p} does not exist (a resumed run does not generate data)"
        for p in (cfg.data.train, cfg.data.test)
        if p and not Path(p).is_file()
    ]


def resume_folder(resume_from: str, root: Path) -> Path:
    """The run folder ``resume_from`` names (relative: under ``root``), checked to hold a readable
    checkpoint record naming a tag and a step; InvalidRequest otherwise."""
    if len(resume_from) > MAX_PATH_CHARS or "\0" in resume_from:
        raise InvalidRequest(
            f"resume_from: not a usable path (a NUL, or more than {MAX_PATH_CHARS} characters)"
        )
    folder = inside("resume_from", str(root / resume_from), root)
    record = folder / "checkpoints" / "coordinator.json"
    if not os.path.lexists(record):
        raise InvalidRequest(f"resume_from: {bounded(str(folder), 200)} has no checkpoint to resume from")
    inside("resume_from", str(record), root)  # its checkpoints/ may be a link elsewhere
    try:
        state = json.loads(security.read_file(str(record), "resume_from", MAX_CHECKPOINT_RECORD_BYTES))
    except security.SecurityError as e:
        raise InvalidRequest(str(e)) from None
    except (ValueError, RecursionError) as e:  # not UTF-8, not JSON, or absurdly nested
        raise InvalidRequest(f"resume_from: {record} is not JSON ({bounded(str(e), 200)})") from None
    tag = state.get("tag") if isinstance(state, dict) else None
    step = state.get("step") if isinstance(state, dict) else None
    if not (isinstance(tag, str) and _TAG.fullmatch(tag) and type(step) is int and step >= 0):
        raise InvalidRequest(
            f"resume_from: {record} does not name a checkpoint (a 'tag' and a 'step', as the coordinator writes)"
        )
    return folder
