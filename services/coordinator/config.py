"""The experiment config: what ``relayrl run EXPERIMENT.yaml`` reads.

One YAML file describes a whole run. Each service gets its own section (``generator``,
``learner``, ``reward``, ``env``), which the coordinator hands to that service unchanged, so a deployed
service and an embedded one read the same schema. The rest (model, data, sampling, algorithm,
schedule, service addresses) is the coordinator's.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator
from relayrl.common.config import StrictModel
from relayrl.common.data.gym import is_gym
from relayrl.common.data.tasks import TASKS
from relayrl.common.serving import ClientSecurity, ServeConfig
from relayrl.common.verifiers import DATA_PREFIX as VERIFIERS_DATA_PREFIX
from relayrl.coordinator.launch.ray.config import RaySection
from relayrl.env.config import EnvConfig
from relayrl.gateway.config import GatewayConfig
from relayrl.generator.config import GeneratorConfig
from relayrl.learner.config import LearnerConfig
from relayrl.reward.config import RewardConfig

Task = Literal[tuple(TASKS)]  # the built-in tasks of the data kit, from its registry
TinyTask = Literal[(*TASKS, "pyexec")]
GYM_SCORER = "relayrl.reward.gym:score"
"""The reward plugin that scores reasoning-gym tasks (``data.generate.task: reasoning_gym/<name>``)."""
"""What a tiny model may be warm-started on: a data kit task, or an env whose warm start is on its
episodes of a data kit task (``pyexec``: calc's rows, a python tool)."""


class TinyModelSpec(StrictModel):
    """Build a tiny local model when ``model.path`` does not exist yet (demos, tests, CI)."""

    task: TinyTask | None = "reverse"
    """Task of the supervised warm start; None keeps the random init."""
    sft_steps: int = Field(150, ge=0, le=100_000)
    """Supervised warm-start steps (an R1-Zero-like starting point: RL then has room to improve)."""
    seed: int = 0
    """Seed of the weights, tokenizer corpus and warm-start data."""
    sft_lr: float = Field(1e-3, gt=0, le=1)
    """Learning rate of the warm start."""
    tool_share: float = Field(0.5, ge=0, le=1)
    """Tasks of an env with tools (``calc``, ``pyexec``): the share of warm-start episodes that
    call the tool (the rest answer at once). Their warm start is multi-turn
    (``relayrl.warmstart``): episodes rendered through the generator's chat codec, loss on the
    model's turns only, and the tokenizer learns the env's tool text too."""
    sft_tool_bar: float = Field(0.7, ge=0, le=1)
    """Tasks of an env with tools: past ``sft_steps``, train on 100 steps at a time until the model
    reproduces this share of held-out tool episodes token for token after their first token
    (teacher-forced), and fail the build when ``sft_max_steps`` pass first. A tiny model can sit
    on a loss plateau for hundreds of steps before it learns to copy the question into its call;
    RL from there gets no reward on either branch. 0: exactly ``sft_steps``. Measured (calc and
    pyexec, seeds 0-2): builds that learned to copy reproduce 0.83-0.91, the plateau 0.0."""
    sft_max_steps: int | None = Field(None, ge=0, le=100_000)
    """Most warm-start steps with ``sft_tool_bar``; None: 4 x ``sft_steps``."""


EPISODE_WARM_STARTS = ("calc", "pyexec")
"""``model.tiny.task`` values whose warm start is on an env's episodes (``relayrl.warmstart``)."""


class ModelSection(StrictModel):
    """The policy model."""

    path: str
    """Hugging Face model folder (config.json, safetensors, tokenizer). Relative paths are taken
    from the experiment file's folder."""
    tiny: TinyModelSpec | None = None
    """When set and ``path`` is missing, build a tiny warm-started model there first."""


MAX_GENERATED_ROWS = 50_000
"""Most rows ``data.generate`` builds per file: one request must not hold a coordinator's memory
and a run slot for minutes (at this bound: ~3 s and ~100 MB of countdown rows; ~17 s and
~0.3 GB with 8 worked examples per prompt; a stop ends it at once)."""


class TaskDataSpec(StrictModel):
    """Generate the dataset files when they are missing."""

    task: Task | str
    """Which task: a built-in one, any reasoning-gym task as ``reasoning_gym/<name>`` (needs
    ``relayrl[tasks]``; score it with the reward plugin ``relayrl.reward.gym:score``), or the tasks
    of a verifiers environment of ``env.verifiers`` as ``verifiers/<name>`` (its rows name their
    task; the env scores them)."""
    n_train: int = Field(2000, ge=1, le=MAX_GENERATED_ROWS)
    """Training prompts (at most 50,000: generated in memory before the run starts; write a
    larger set with ``relayrl data`` and name it in ``data.train``)."""
    n_test: int = Field(128, ge=0, le=MAX_GENERATED_ROWS)
    """Held-out prompts (disjoint from training), at most 50,000."""
    seed: int = 0
    """Seed of the generator."""
    params: dict[str, int | bool | None] = Field(default_factory=dict)
    """The task's parameters (``relayrl data --help`` lists them), e.g. ``{max_value: 20, shots: 1}``;
    the rest keep their defaults."""

    @model_validator(mode="after")
    def _known_params(self) -> TaskDataSpec:
        from relayrl.common.data.tasks import generate

        if self.task.startswith(VERIFIERS_DATA_PREFIX):
            if self.params:
                raise ValueError(
                    "data.generate.params: a verifiers taskset takes its own (env.verifiers.taskset_args)"
                )
            return self
        if self.task not in TASKS and not is_gym(self.task):
            raise ValueError(
                f"data.generate.task: {self.task!r} is neither a built-in task ({', '.join(TASKS)}), "
                "reasoning_gym/<name> nor verifiers/<name>"
            )

        try:  # no rows: only the parameter checks run
            generate(self.task, 0, self.seed, **self.params)
        except (ValueError, TypeError) as e:  # TypeError: a null where the task wants a number
            raise ValueError(f"data.generate.params: {e}") from e
        return self


class DataSection(StrictModel):
    """Prompts, in verl's schema (parquet or JSONL)."""

    train: str
    """Training prompts file."""
    test: str | None = None
    """Held-out prompts for periodic evaluation (``schedule.eval_*``); None turns it off."""
    generate: TaskDataSpec | None = None
    """When set, write ``train``/``test`` from a built-in task if they do not exist."""
    shuffle: bool = True
    """Shuffle the training prompts each epoch (seeded, so a resume sees the same order)."""


class SamplingSection(StrictModel):
    """How completions are sampled for training."""

    n: int = Field(8, ge=1, le=1024)
    """Completions per prompt (the group size G of GRPO)."""
    temperature: float = Field(1.0, ge=0, le=10)
    """Sampling temperature; 0 is greedy (useless for GRPO groups, fine for evaluation)."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling mass."""
    top_k: int = Field(-1, ge=-1)
    """Top-k sampling; -1 turns it off."""
    max_tokens: int = Field(128, ge=1, le=1_000_000)
    """Longest completion in tokens."""
    stop: list[str] = Field(default_factory=list)
    """Stop strings (the model's end-of-turn token always stops)."""
    seeded: bool = True
    """Seed every generation request from the experiment's ``seed`` (each prompt its own stream):
    reproducible samples and resumes. vLLM samples seeded requests with a generator each, which
    on GPUs skips its fused top-k/top-p sampling kernel; false trades reproducibility for that."""


class EpisodesSection(StrictModel):
    """Multi-turn episodes: each sample is an episode of the environment ``env`` (served by the
    env service), the model's turns and the environment's answers in one token-exact sample.
    Without this section every sample is one completion scored by the reward service."""

    env: str = Field(min_length=1, max_length=128)
    """Name of the environment (built in: ``calc``, ``guess``, ``pyexec`` when ``env.plugins``
    names it; or a plugin's), as the env service lists it. Each data row is one task; ``sampling.n`` episodes of it form a group."""
    tool_format: Literal["", "hermes", "llama3_json"] = "hermes"
    """How the model writes tool calls, for the generator to read them: ``hermes`` (Qwen2.5,
    Hermes: <tool_call>{...}</tool_call>), ``llama3_json`` (Llama-3.1), or "" for none (a
    text-only environment; an environment that expects tools then trips the zero-tool alarm)."""
    max_turns: int | None = Field(None, ge=1, le=256)
    """Most model turns per episode; None: the environment's own bound (its max_turns)."""
    max_episode_tokens: int = Field(1024, ge=1, le=1_000_000)
    """Most tokens after the first prompt (the model's and the environment's): an episode that
    reaches it ends truncated, scored as the environment scores an unfinished episode."""
    concurrency: int = Field(256, ge=1, le=65536)
    """Most episodes under way at once (each holds an env session and at most one Generate call):
    within the generators' ``max_pending_requests`` and the env replicas' ``max_sessions``
    together. The rest of a step's episodes wait their turn."""
    max_attempts: int = Field(3, ge=1, le=100)
    """How many times an episode whose environment failed (a replica died, the session was lost,
    the environment said REDO) is run; after that it is masked: never trained on, never part of
    its group's baseline, counted (``env_masked``). Too many masked episodes in a step fail the run
    as scorer failures do (``services.max_reward_error_fraction``)."""
    zero_tool_alarm: Literal["warn", "fail"] = "warn"
    """What happens when an environment that expects tools sees no tool call in
    ``zero_tool_steps`` training steps in a row (the tools never reached the prompt, or the
    calls are never parsed): a warning in the log and ``alarm_zero_tool_calls`` 1 in the
    metrics, or the run fails."""
    zero_tool_steps: int = Field(3, ge=1, le=1000)
    """Training steps in a row without a tool call that trip the alarm."""
    turns: Literal["exact", "stepwise"] = "exact"
    """How a turn's prompt is made. ``exact``: the previous turn's exact tokens extended with the
    environment's answer (the generator's bridge); the episode is one learner sample, the
    environment's tokens masked. ``stepwise``: the whole dialogue rendered again by the chat
    template for every call (for templates that are not prefix-preserving, e.g. ones that strip
    earlier reasoning); each call is a learner sample of its own (a segment) carrying its
    episode's advantage. Token-exact per segment either way. Stepwise costs O(turns^2) tokens and
    takes group advantages only (grpo, drgrpo, rloo)."""
    agent_reward: bool = False
    """Black-box episodes: the agent may set its episode's reward itself (``POST /rl/set_reward``
    on the gateway), which then replaces the env's. Only for agents whose scoring the model
    cannot reach: an agent that runs the model's commands holds the session's key, so the model
    could write its own reward. False: the HTTP call gets 403 (the gRPC SetReward, for a harness
    outside the agent, still works)."""
    malformed_call_penalty: float = Field(0.0, ge=0, le=1e6)
    """Black-box episodes: subtracted from the episode's reward once per tool call the model wrote
    that did not parse (the gateway's count, handed to the agent as text). 0: the env's reward
    alone; the count is a reward component (``malformed_calls``) and a metric either way."""
    allow_template_drift: bool = False
    """With ``turns: exact``, train even when the chat template is not prefix-preserving (the
    generator's CheckChat: rendering the whole dialogue gives other tokens than the turn-by-turn
    bridge). Training stays token-exact (the learner sees the tokens sampled); the model then
    trains on contexts a full render would not show it. False refuses to start, naming the
    difference and pointing to ``turns: stepwise``."""


class AlgorithmSection(StrictModel):
    """How rewards become advantages."""

    advantage: str = Field("grpo", pattern=r"^[a-z][a-z0-9_]{0,63}$")
    """The algorithm, by the family that serves it (``coordinator/algorithms``; a name no family
    serves is refused when the experiment is loaded). grpo: (r - group mean) / group std;
    drgrpo: r - group mean; rloo: leave-one-out baseline; reinforce_pp: REINFORCE++, token-level
    returns whitened over the whole batch (no group baseline); gae: PPO with a critic (the
    ``critic`` section: a learner of role critic), GAE advantages whitened over the batch, the
    critic trained on the returns in the same step."""
    gamma: float = Field(1.0, ge=0, le=1)
    """reinforce_pp, gae: discount per token (1: every token gets the score)."""
    lam: float = Field(1.0, ge=0, le=1)
    """gae: GAE's lambda (1: Monte-Carlo advantages against the critic's baseline, verl's
    default; lower trusts the critic more)."""
    kl_coef: float = Field(0.0, ge=0, le=100)
    """reinforce_pp, gae: weight of a per-token KL penalty to the reference policy *in the reward*
    (``kl_penalty``), computed from the generator's log-probs and the ``reference`` service's
    (a frozen learner started for it); the initial value when ``kl_target`` is set. 0: none. A KL
    in the actor's *loss* instead is ``learner.loss.kl_coef`` (its reference in-process)."""
    kl_penalty: Literal["k1", "k2", "k3", "abs"] = "k1"
    """Estimator of the KL in the reward: k1 = log(pi/ref), k2 = its square / 2, k3 = Schulman's
    low-variance one, clamped per token to [-10, 10] as the actor's in-loss k3 is (the learner's
    ``K3_BOUND``, verl's bound), abs = |log(pi/ref)| (verl's ``kl_penalty``)."""
    kl_target: float | None = Field(None, gt=0)
    """Adaptive KL controller (Ziegler et al. 2019; verl's ``AdaptiveKLController``): the KL per
    token it steers toward; None keeps ``kl_coef`` fixed. Its coefficient is checkpointed."""
    kl_horizon: float = Field(10000.0, gt=0)
    """Adaptive controller: samples over which the coefficient may move by 20 %."""
    critic_warmup: int = Field(0, ge=0)
    """gae: first steps on which only the critic trains (the actor and the generators wait), so
    the policy's first updates use values that mean something."""
    scale_std: bool = True
    """grpo only: divide by the group's reward std (off = Dr.GRPO's unbiased variant)."""
    kl_reduction: Literal["token", "sequence"] = "token"
    """Adaptive controller: the KL it compares with ``kl_target``. token: the mean over every
    completion token of the batch (long completions weigh more); sequence: each completion's
    mean per token, then the mean over completions (verl's). Up to 2x apart on mixed lengths."""
    timeout_reward: float | None = Field(None, ge=-1e6, le=1e6)
    """Reward of a sample whose scorer ran past its timeout (SCORE_STATUS_TIMEOUT). None: left
    out of its group like a scorer ERROR, which is always left out (an infrastructure failure
    is never trained on as a wrong answer, nor counted in the group's baseline). A number (e.g.
    0.0): counted as that reward, for tasks where a completion that makes the scorer hang is
    the model's fault (a program that never ends)."""


class ScheduleSection(StrictModel):
    """Steps, batch shape, staleness, evaluation and checkpoints."""

    steps: int = Field(100, ge=1)
    """Learner steps to run."""
    prompts_per_step: int = Field(8, ge=1)
    """Prompts per learner step; each gets ``sampling.n`` completions."""
    max_staleness: int = Field(1, ge=0, le=64)
    """Policy versions a sample may lag the learner; 0 is synchronous on-policy."""
    eval_every: int = Field(10, ge=0)
    """Held-out evaluation every this many steps (and at step 0 and the last); 0 turns it off."""
    eval_temperature: float = Field(0.0, ge=0, le=10)
    """0: greedy held-out accuracy. Above 0: the accuracy of completions sampled at this
    temperature (``eval_samples`` per prompt, averaged: pass@1 estimated by sampling, as
    DeepSeek-R1 reports it), i.e. what the policy as sampled gets right on unseen prompts."""
    eval_samples: int = Field(1, ge=1, le=64)
    """Completions per held-out prompt; more than 1 needs ``eval_temperature`` above 0."""
    checkpoint_every: int = Field(50, ge=0)
    """Checkpoint every this many steps; 0 only at the end."""
    no_signal_steps: int = Field(5, ge=1, le=10_000)
    """Training steps in a row that train on no sample (every group's rewards equal, or every
    episode masked) that trip the no-signal alarm."""
    no_signal_alarm: Literal["warn", "fail"] = "warn"
    """What the no-signal alarm does: a warning in the log and ``alarm_no_signal`` 1 in the
    metrics, or the run fails (a collapsed policy, a reward that never varies)."""

    @property
    def eval_label(self) -> str:
        """What ``eval_accuracy`` measures, in words (logs and the curve).

        >>> ScheduleSection().eval_label, ScheduleSection(eval_temperature=1, eval_samples=4).eval_label
        ('held-out greedy accuracy', 'held-out accuracy (4 samples per prompt at temperature 1)')
        """
        if self.eval_temperature == 0:
            return "held-out greedy accuracy"
        return f"held-out accuracy ({self.eval_samples} samples per prompt at temperature {self.eval_temperature:g})"

    @model_validator(mode="after")
    def _eval_sampling(self) -> ScheduleSection:
        if self.eval_samples > 1 and self.eval_temperature == 0:
            raise ValueError(
                "schedule.eval_samples > 1 needs schedule.eval_temperature > 0 (greedy samples are identical)"
            )
        return self


class ServicesSection(StrictModel):
    """Addresses of deployed services. All empty: the embedded default starts them locally."""

    generators: list[str] = Field(default_factory=list)
    """Generator replicas, ``host:port`` each."""
    rewards: list[str] = Field(default_factory=list)
    """Reward replicas, ``host:port`` each."""
    envs: list[str] = Field(default_factory=list)
    """Env service replicas, ``host:port`` each: deployed runs with an ``episodes`` section."""
    gateways: list[str] = Field(default_factory=list)
    """Gateway replicas (their gRPC ``host:port``): deployed runs whose env runs an agent of its
    own (a black-box ``harness`` env), which reaches the model through the gateway."""
    learner: str | None = None
    """Learner rank 0, ``host:port``."""
    critic: str | None = None
    """Critic's rank 0 (a learner of role critic), ``host:port``: deployed runs with
    ``algorithm.advantage: gae``."""
    reference: str | None = None
    """Reference's rank 0 (a learner of role reference), ``host:port``: deployed runs with
    ``algorithm.kl_coef`` > 0."""
    generator_replicas: int = Field(1, ge=1, le=64)
    """Embedded default and ``relayrl launch ray``: generator replicas to start."""
    reward_replicas: int = Field(1, ge=1, le=64)
    """Embedded default and ``relayrl launch ray``: reward replicas to start."""
    env_replicas: int = Field(1, ge=1, le=64)
    """Embedded default and ``relayrl launch ray``: env service replicas to start (runs with an
    ``episodes`` section)."""
    gateway_replicas: int = Field(0, ge=0, le=64)
    """Embedded default: gateway replicas to start (the ``gateway`` section, its generators filled
    in); 1 for an env that runs an agent of its own (a black-box ``harness`` env), else 0."""
    generator_devices: list[str] = Field(default_factory=list)
    """Embedded default on GPUs: CUDA_VISIBLE_DEVICES of each generator replica (e.g. ["0", "1"]),
    so generation and training get their own GPUs; empty inherits the environment."""
    learner_devices: str = ""
    """Embedded default on GPUs: CUDA_VISIBLE_DEVICES of the learner (e.g. "2,3"); empty inherits."""
    critic_devices: str = ""
    """Embedded default on GPUs: CUDA_VISIBLE_DEVICES of the critic; empty inherits."""
    reference_devices: str = ""
    """Embedded default on GPUs: CUDA_VISIBLE_DEVICES of the reference; empty inherits."""
    deadline_seconds: float = Field(600.0, gt=0)
    """Default deadline of every call to a service."""
    generator_samples_per_call: int = Field(4096, ge=1, le=1 << 20)
    """Most samples (prompts x n) in one Generate call: a replica's share of a larger batch or
    evaluation goes as several concurrent calls. Keep it at or under the generators'
    ``max_samples_per_request`` (default 16384), which they enforce."""
    restarts: int = Field(3, ge=0, le=100)
    """Embedded default: how many times a generator or reward replica that exits (a crash, an
    OOM kill, a vLLM engine that died) is started again at its address, as Kubernetes or
    compose would; the run takes it back into rotation. 0: never. A learner is never restarted:
    its state lives in its checkpoints, so the run stops and resumes from them."""
    max_attempts: int = Field(4, ge=1, le=100)
    """How many times one piece of work (a prompt's samples, a chunk of scores) is sent to a
    replica before the run fails, naming the replicas and their errors: work that fails every
    time (a prompt that kills its generator, a replica that fails and comes back) must not be
    sent again forever."""
    max_reward_error_fraction: float = Field(0.5, ge=0, le=1)
    """A step in which the reward service failed to score more than this share of the samples
    (ERROR, and TIMEOUT when ``algorithm.timeout_reward`` is None) fails the run, naming the
    reward service and one of its errors: a broken verifier must not train silently on the rest."""
    stop_grace_seconds: float = Field(600.0, ge=0, le=86400)
    """After a stop (Ctrl-C, SIGTERM, StopExperiment), how long the run may take to end its step
    and write a checkpoint before it is cancelled (it then ends without that checkpoint; a
    second Ctrl-C or Stop cancels at once). Give a scheduler's kill timeout (Kubernetes'
    terminationGracePeriodSeconds, Slurm's --signal) more than this."""
    replica_wait_seconds: float = Field(600.0, ge=0, le=86400)
    """How long generation or scoring waits for a replica to come back when every replica of
    that service failed (a restarted container takes minutes to serve again); replicas out of
    rotation are probed every few seconds meanwhile. 0 fails at once."""
    threads: int | None = Field(None, ge=1, le=1024)
    """Embedded default: OpenMP/torch threads of each local service process (OMP_NUM_THREADS).
    None: the environment's OMP_NUM_THREADS, else 1. On a small CPU machine with
    ``schedule.max_staleness`` 0 (services take turns) set it to the core count."""
    metrics_port: int | None = Field(None, ge=0, le=65535)
    """Prometheus port of the coordinator (per-step run metrics); None turns it off."""
    metrics_host: str = "127.0.0.1"
    """Address the metrics endpoint binds; 0.0.0.0 in a container so Prometheus can scrape it."""
    security: ClientSecurity = Field(default_factory=ClientSecurity)
    """How the coordinator calls the services: CA (TLS), client certificate (mutual TLS), token
    file. Default: plaintext, token from $RELAYRL_TOKEN_FILE if set (services on loopback)."""

    @property
    def embedded(self) -> bool:
        return not (self.generators or self.rewards or self.learner)

    @model_validator(mode="after")
    def _all_or_nothing(self) -> ServicesSection:
        given = [bool(self.generators), bool(self.rewards), bool(self.learner)]
        if any(given) and not all(given):
            raise ValueError("give addresses for generators, rewards and learner, or none (embedded)")
        return self


class WandbSection(StrictModel):
    """Weights & Biases: every run metric, per step, to a W&B run named after the run folder."""

    project: str = Field("relayrl", min_length=1, max_length=128)
    """W&B project."""
    entity: str | None = Field(None, min_length=1, max_length=128)
    """W&B entity (user or team); None: the account's default."""
    mode: Literal["offline", "online"] = "offline"
    """offline: written under ``<run>/wandb`` with no network (``wandb sync`` uploads it later);
    online: streamed to the W&B server (the API key from the environment, never this file)."""
    tags: list[str] = Field(default_factory=list, max_length=64)
    """Tags of the W&B run."""


class TrackingSection(StrictModel):
    """Experiment trackers besides ``metrics.jsonl`` and Prometheus. Nothing is logged anywhere
    not asked for here: both are off by default."""

    tensorboard: bool = False
    """Write every run metric as TensorBoard scalars under ``<run>/tensorboard`` (``tensorboard
    --logdir runs``)."""
    wandb: WandbSection | None = None
    """Log every run metric to Weights & Biases; None: off."""


LEARNER_ROLES = ("critic", "reference")
"""Learner roles an algorithm may call beside the actor, each with an experiment section of its
name and a ``services.<role>`` address for deployed runs."""


class ExperimentConfig(StrictModel):
    """A whole experiment."""

    name: str = Field("experiment", min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._-]+$")
    """Run name; run folders are ``<runs_dir>/<name>-<timestamp>``."""
    seed: int = Field(0, ge=0, lt=2**63)
    """Seed of data order and sampling: every generation request carries it (``sampling.seeded``),
    and each prompt's samples are drawn from a random stream of its own derived from it and the
    prompt's id (generator ``SamplingParams.seed``). With ``schedule.max_staleness`` 0 a resumed
    run therefore draws as the uninterrupted one would (the same samples where vLLM's numbers do
    not depend on the batch: on CPU here, or with ``VLLM_BATCH_INVARIANT=1`` on GPUs); held-out
    prompts get the same streams at every evaluation."""
    runs_dir: str = "runs"
    """Where run folders go."""
    model: ModelSection
    """The policy."""
    data: DataSection
    """The prompts."""
    sampling: SamplingSection = Field(default_factory=SamplingSection)
    """Sampling for training."""
    episodes: EpisodesSection | None = None
    """Multi-turn episodes with an environment (tools, feedback); None: single-turn samples."""
    algorithm: AlgorithmSection = Field(default_factory=AlgorithmSection)
    """Advantages."""
    schedule: ScheduleSection = Field(default_factory=ScheduleSection)
    """Steps and batches."""
    services: ServicesSection = Field(default_factory=ServicesSection)
    """Where the services run."""
    generator: GeneratorConfig = Field(default_factory=GeneratorConfig)
    """Generator section (model path filled from ``model.path`` when empty)."""
    learner: LearnerConfig = Field(default_factory=LearnerConfig)
    """Learner section: the actor (model path filled from ``model.path`` when empty)."""
    critic: LearnerConfig | None = None
    """The critic, a learner of role critic, for ``algorithm.advantage: gae`` (its role is set
    here). None with gae: the learner section's model, ranks, dtype and optimizer."""
    reference: LearnerConfig | None = None
    """The reference, a frozen learner of role reference, for ``algorithm.kl_coef`` > 0 (its role
    is set here). None then: one rank of the learner section's model and dtype."""
    reward: RewardConfig = Field(default_factory=RewardConfig)
    """Reward section."""
    env: EnvConfig = Field(default_factory=EnvConfig)
    """Env service section: the replicas a run with an ``episodes`` section starts."""
    gateway: GatewayConfig = Field(default_factory=GatewayConfig)
    """Gateway section: the replicas ``services.gateway_replicas`` starts (their ``generators``
    are the run's)."""
    ray: RaySection = Field(default_factory=RaySection)
    """Placement on a Ray cluster, for ``relayrl launch ray``."""
    tracking: TrackingSection = Field(default_factory=TrackingSection)
    """TensorBoard and Weights & Biases logging (off unless turned on)."""

    @model_validator(mode="after")
    def _sections_fit(self) -> ExperimentConfig:
        # What the algorithm asks of the sections (its roles, its fields) is checked where the
        # experiment is loaded, by its family (``derive.resolve_paths``, ``algorithms``).
        if self.learner.role != "actor":
            raise ValueError(
                "learner.role: the learner section is the actor; the critic and reference have sections of their own"
            )
        per_call = self.services.generator_samples_per_call
        for name, n in (
            ("sampling.n", self.sampling.n),
            ("schedule.eval_samples", self.schedule.eval_samples),
        ):
            if n > per_call:
                raise ValueError(f"{name} ({n}) exceeds services.generator_samples_per_call ({per_call})")
        if self.episodes is not None and not self.services.embedded and not self.services.envs:
            raise ValueError(
                "services.envs: a deployed run with an episodes section needs env service addresses"
            )
        if self.episodes is not None and self.episodes.concurrency > self.generator.max_pending_requests:
            raise ValueError(
                f"episodes.concurrency ({self.episodes.concurrency}) exceeds generator.max_pending_requests "
                f"({self.generator.max_pending_requests}): the turns of that many episodes may all reach one replica"
            )
        if self.episodes is not None and self.env.lease_seconds <= self.services.deadline_seconds:
            raise ValueError(
                f"env.lease_seconds ({self.env.lease_seconds:g}) must exceed services.deadline_seconds "
                f"({self.services.deadline_seconds:g}): a session waits that long for a turn's Generate"
            )
        gen = self.data.generate
        if gen is not None and gen.task.startswith(VERIFIERS_DATA_PREFIX):
            name = gen.task.removeprefix(VERIFIERS_DATA_PREFIX)
            if name not in {v.name for v in self.env.verifiers}:
                raise ValueError(f"data.generate.task {gen.task!r}: env.verifiers has no env named {name!r}")
        if (
            gen is not None
            and is_gym(gen.task)
            and self.services.embedded
            and GYM_SCORER not in self.reward.plugins
        ):
            raise ValueError(
                f"reward.plugins: data.generate.task {gen.task!r} is scored by {GYM_SCORER}; add it"
            )
        if (self.services.gateway_replicas or self.services.gateways) and self.episodes is None:
            raise ValueError(
                "services.gateway_replicas / services.gateways: a gateway serves black-box episodes; "
                "it needs an episodes section (an env that runs its own agent)"
            )
        if self.episodes is not None and self.sampling.stop:
            raise ValueError(
                "sampling.stop: an episode's turns end on the model's end-of-turn token, never on a stop "
                "string (the next turn must extend tokens that end with that token)"
            )
        return self

    def role_sections(self) -> dict[str, LearnerConfig]:
        """The learner services this run starts, by name: ``learner`` (the actor) always, and
        the roles beside it that the algorithm calls (their sections are filled in by
        ``derive.resolve_paths``, and refused there when the algorithm calls no such role)."""
        roles = {r: s for r in LEARNER_ROLES if (s := getattr(self, r)) is not None}
        return {"learner": self.learner, **roles}


class CoordinatorServeConfig(StrictModel):
    """``relayrl serve coordinator``: a standing coordinator that runs experiments on request."""

    serve: ServeConfig = Field(default_factory=ServeConfig)
    """Where the coordinator listens."""
    root: str = "."
    """Folder every path of an experiment sent by StartExperiment must lie in (runs_dir, data files,
    model folders, learner checkpoint_dir, certificate, key and token files, resume_from); relative
    paths resolve under it. Keep the coordinator's own secrets outside it: a token file inside
    could be named by an experiment and sent to the addresses it gives. Default: the working
    folder."""
    max_running: int = Field(1, ge=1, le=256)
    """Experiments running at once; StartExperiment beyond it is RESOURCE_EXHAUSTED (an embedded
    experiment starts a learner, generators and reward processes of its own)."""
    max_config_kib: int = Field(1024, ge=1, le=65536)
    """Largest config_yaml accepted, in KiB."""
