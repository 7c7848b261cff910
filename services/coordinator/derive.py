"""The derive step: an experiment as written -> the experiment a run uses. Paths made absolute
against the experiment file's folder, and the service sections filled from the experiment's own
fields (the model path, the learner's sampling temperature and length normaliser, the critic and
reference sections from the learner's where unset)."""

from __future__ import annotations

from pathlib import Path

from pydantic import ValidationError
from relayrl.common import config as cfg
from relayrl.common.serving import ClientSecurity
from relayrl.coordinator import algorithms
from relayrl.coordinator.config import LEARNER_ROLES, ExperimentConfig
from relayrl.env.config import resolved
from relayrl.learner.config import LearnerConfig


def under(base: Path, p: str) -> str:
    """``p`` made absolute: as it is if it is, else resolved under ``base``."""
    return str(p if Path(p).is_absolute() else (base / p).resolve())


def resolve_paths(exp: ExperimentConfig, base: Path | None) -> ExperimentConfig:
    """Make paths absolute (relative ones against ``base``, or the working folder) and fill the
    service sections from the experiment's own fields."""
    base = base or Path.cwd()

    def rel(p: str) -> str:
        return under(base, p)

    updates = {
        "model": exp.model.model_copy(update={"path": rel(exp.model.path)}),
        "data": exp.data.model_copy(
            update={"train": rel(exp.data.train), "test": rel(exp.data.test) if exp.data.test else None}
        ),
        "runs_dir": rel(exp.runs_dir),
    }
    exp = exp.model_copy(update=updates)
    _resolve_security_paths(exp, rel)
    _resolve_env_paths(exp, base)
    if not exp.generator.engine.model:
        exp.generator.engine.model = exp.model.path
    if not exp.learner.model:
        exp.learner.model = exp.model.path
    deadline, sync_s = exp.services.deadline_seconds, exp.learner.weight_sync_timeout_seconds
    if exp.services.embedded and sync_s + min(30.0, sync_s) >= deadline:
        # A push waits for a silent generator (its status, then its answer) less than the
        # coordinator waits for the push, so the error names the generator, not the learner.
        exp.learner.weight_sync_timeout_seconds = deadline / 3
    # The learner scores tokens like the generators sample them, and Dr.GRPO divides by the
    # longest completion allowed.
    exp.learner.loss.temperature = exp.sampling.temperature or 1.0
    if exp.learner.loss.max_tokens_normaliser is None:
        exp.learner.loss.max_tokens_normaliser = exp.sampling.max_tokens
    _lora_serving(exp)
    _fill_roles(exp)
    return exp


def _resolve_env_paths(exp: ExperimentConfig, base: Path) -> None:
    """With the embedded default, the agents' and verifiers environments' folders and requirements
    files, relative to the experiment file, made absolute and checked (the env replicas it starts
    may start in another folder); deployed env services read their own on their own hosts."""
    if not exp.services.embedded:
        return
    for field, spec, attr in exp.env.path_fields():
        try:
            setattr(spec, attr, resolved(getattr(spec, attr), field, base))
        except ValueError as e:
            raise cfg.ConfigError(str(e)) from None


def _lora_serving(exp: ExperimentConfig) -> None:
    """A LoRA learner pushes adapters: the generators it starts take them (``engine.max_lora_rank``
    at least the adapter's rank); one set lower in the experiment is refused, naming both."""
    adapter = exp.learner.lora
    if adapter is None:
        return
    engine = exp.generator.engine
    if "max_lora_rank" not in engine.model_fields_set:
        engine.max_lora_rank = adapter.rank
    elif engine.max_lora_rank < adapter.rank:
        raise cfg.ConfigError(
            f"generator.engine.max_lora_rank {engine.max_lora_rank} is below learner.lora.rank "
            f"{adapter.rank}: the generators could not load the adapter the learner pushes"
        )


INHERITED = {
    "critic": ("model", "dtype", "world_size", "zero_stage", "micro_batch_tokens", "gradient_checkpointing",
               "logits_chunk_mib", "optim", "security", "checkpoint_dir"),
    "reference": ("model", "dtype", "zero_stage", "micro_batch_tokens", "logits_chunk_mib", "lm_head", "security",
                  "checkpoint_dir"),
}  # fmt: skip
"""What the critic and the reference take from the learner section where their own leaves a field
unset (nested fields one by one: ``critic.optim.lr`` alone keeps the learner's schedule)."""


def _fill_roles(exp: ExperimentConfig) -> None:
    """The algorithm's own checks, then the sections of the learner roles it calls, from the
    learner's where unset; a section or address of a role it does not call is refused."""
    try:
        algorithms.check(exp)
        roles = algorithms.roles(exp)
    except ValueError as e:
        raise cfg.ConfigError(str(e)) from None
    name = exp.algorithm.advantage
    for role in LEARNER_ROLES:
        if role in roles:
            setattr(exp, role, _role(getattr(exp, role), role, exp))
            if not exp.services.embedded and not getattr(exp.services, role):
                raise cfg.ConfigError(f"services.{role}: a deployed run of {name} needs its address")
        elif getattr(exp, role) is not None:
            raise cfg.ConfigError(f"{role}: algorithm.advantage {name} calls no {role}")


def _merge(base: dict, given: dict) -> dict:
    out = dict(base)
    for k, v in given.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


SERVE_INHERITED = {
    "tls_cert",
    "tls_key",
    "tls_client_ca",
    "token_file",
    "insecure",
    "max_message_mb",
    "grace_seconds",
}
"""Who may call the critic and the reference, as the learner (its ``serve`` section less where it
listens: the roles listen on ports of their own)."""


def _role(section: LearnerConfig | None, role: str, exp: ExperimentConfig) -> LearnerConfig:
    base = exp.learner.model_dump(include=set(INHERITED[role]))
    base["serve"] = exp.learner.serve.model_dump(include=SERVE_INHERITED)
    given = section.model_dump(exclude_unset=True) if section is not None else {}
    try:
        out = LearnerConfig.model_validate({**_merge(base, given), "role": role})
    except ValidationError as e:  # a ConfigError naming the field (``reference.loss.kl_coef``)
        raise cfg.ConfigError(cfg.format_validation_error(e, within=role)) from None
    out.loss.temperature = exp.learner.loss.temperature  # log-probs as the generators sample
    return out


def _resolve_security_paths(exp: ExperimentConfig, rel) -> None:
    """Certificate, key and token paths against the experiment's folder, like the other paths;
    the learner and the gateway call the generators as the coordinator does unless their sections
    say otherwise."""
    roles = [r for r in (exp.critic, exp.reference) if r is not None]
    clients = (exp.services.security, exp.learner.security, exp.gateway.client, *(r.security for r in roles))
    for section in clients:
        for name in ("ca", "cert", "key", "token_file"):
            if getattr(section, name):
                setattr(section, name, rel(getattr(section, name)))
    serves = (exp.generator.serve, exp.learner.serve, exp.reward.serve, exp.env.serve, exp.gateway.serve)
    for serve in (*serves, *(r.serve for r in roles)):
        for name in ("tls_cert", "tls_key", "tls_client_ca", "token_file"):
            if getattr(serve, name):
                setattr(serve, name, rel(getattr(serve, name)))
    for name in ("tls_cert", "tls_key"):
        if getattr(exp.gateway.http, name):
            setattr(exp.gateway.http, name, rel(getattr(exp.gateway.http, name)))
    if exp.learner.security == ClientSecurity():
        exp.learner.security = exp.services.security.model_copy()
    if exp.gateway.client == ClientSecurity():
        exp.gateway.client = exp.services.security.model_copy()


def load_experiment(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> ExperimentConfig:
    """Load an experiment file; relative paths in it resolve against the file's folder. Errors
    found once it is read (the algorithm's, a role section's) name the file too."""
    exp = cfg.load(ExperimentConfig, path, overrides)
    try:
        return resolve_paths(exp, Path(path).resolve().parent)
    except cfg.ConfigError as e:
        raise cfg.ConfigError(f"{path}: {e}") from None
