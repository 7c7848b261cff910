"""Configuration of the learner service (DeepSpeed ZeRO-3 ranks; rank 0 serves gRPC)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator
from relayrl.common.config import StrictModel
from relayrl.common.serving import ClientSecurity, ServeConfig

K3_BOUND = 10.0
"""Bound, in nats, of the per-token k3 KL estimate wherever relayrl computes one: in the actor's
loss (``loss.kl_estimator: k3``) and in the reward (``algorithm.kl_penalty: k3``), as verl's
``low_var_kl`` clamps both to [-10, 10]. k3 = e^-d + d - 1 (d = log(pi/ref)) grows like e^-d: at 30
nats below the reference its gradient would be -1e13 x kl_coef, enough to wipe out a step. The
log-ratio is clamped to [-K3_LOG_RATIO_BOUND, K3_LOG_RATIO_BOUND] before the exponential (no
overflow, no 0 x inf in backward) and the estimate to [-K3_BOUND, K3_BOUND] (k3 is never
negative, so at most K3_BOUND): past the bound (about 2.6 nats below the reference, 11 above) a
token's KL gives no gradient, and inside it the gradient is at most e^2.6 - 1, about 12.6, times
kl_coef."""
K3_LOG_RATIO_BOUND = 20.0
"""Clamp of the log-ratio inside k3, before the exponential (verl's): past it k3 is past
``K3_BOUND`` anyway."""


class LossConfig(StrictModel):
    """The policy loss. GRPO, Dr.GRPO and DAPO differ in clipping and in how tokens are averaged."""

    kind: Literal["grpo", "drgrpo", "dapo", "gspo", "sft"] = "grpo"
    """grpo: clipped ratio; drgrpo: no length normalisation; dapo: asymmetric clip, token-level;
    gspo: one clipped ratio per sequence (the geometric mean of its token ratios; the paper clips
    at 3e-4 / 4e-4, set clip_low / clip_high so); sft."""
    aggregation: Literal["token", "sequence"] | None = None
    """Average per token over the batch, or per sequence then over sequences. None: the kind's
    own (grpo: sequence, dapo: token; drgrpo sums tokens and divides by a constant)."""
    clip_low: float = Field(0.2, ge=0, le=1)
    """Lower clip epsilon of the importance ratio."""
    clip_high: float = Field(0.2, ge=0, le=10)
    """Upper clip epsilon (DAPO raises it, e.g. 0.28)."""
    kl_coef: float = Field(0.0, ge=0)
    """Weight of the KL penalty to the frozen reference model; 0 loads no reference model."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """KL estimator: k1 = log ratio, k2 = half its square, k3 = Schulman's unbiased low-variance
    estimator, clamped per token to [-10, 10] nats (``K3_BOUND``, the same bound as the reward's
    ``algorithm.kl_penalty: k3``, and verl's): a token far below the reference then adds a bounded
    KL and no gradient, instead of one that grows like e^gap. k1 and k2 are not clamped."""
    kl_ratio: bool = False
    """Multiply the per-token KL by the policy's importance ratio (TRL's bias-corrected k3):
    the KL's gradient is then unbiased for samples drawn by the behaviour policy."""
    tis_cap: float | None = Field(None, gt=0)
    """Importance-sampling cap for the generator/learner mismatch; None turns it off."""
    tis_mode: Literal["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"] = "token_truncate"
    """With ``tis_cap``: weight each token by its ratio capped (truncate) or zeroed above the cap
    (mask), per token or per sequence (the product of its token ratios), as TRL's
    ``vllm_importance_sampling_mode``."""
    temperature: float = Field(1.0, gt=0)
    """Sampling temperature of the generators: logprobs are computed from logits / temperature
    so they compare with the generator's. The coordinator sets it from ``sampling.temperature``."""
    max_tokens_normaliser: int | None = Field(None, ge=1)
    """drgrpo: constant divisor of the summed token losses (default: max completion length)."""
    value_clip: float | None = Field(0.5, gt=0)
    """Critic only: clip range of the value loss around the values the batch was scored with
    (PPO's ``cliprange_value``, verl's default 0.5); None: the plain squared error."""

    @model_validator(mode="after")
    def _aggregation_fits_kind(self) -> LossConfig:
        # DAPO's token-level average is part of its definition, not an option.
        if self.kind == "dapo" and self.aggregation == "sequence":
            raise ValueError("dapo averages per token: aggregation must be 'token' or unset")
        if self.kind == "gspo" and self.tis_cap is not None:
            raise ValueError("gspo's sequence ratio is its own importance correction: tis_cap must be unset")
        return self


class OptimConfig(StrictModel):
    """Optimizer and schedule (torch AdamW: DeepSpeed's own Adam compiles for minutes on CPU)."""

    lr: float = Field(1e-5, gt=0, le=1)
    """Peak learning rate."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW weight decay."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    warmup_steps: int = Field(0, ge=0)
    """Linear warm-up steps."""
    schedule: Literal["constant", "cosine", "linear"] = "constant"
    """Decay after warm-up, over ``total_steps``."""
    total_steps: int = Field(1000, ge=1)
    """Steps the schedule spans."""
    grad_clip: float = Field(1.0, gt=0)
    """Clip the global gradient norm to this."""


RENDEZVOUS_FILE_VAR = "RELAYRL_RENDEZVOUS_FILE"
"""A learner rank's environment variable naming the file where rank 0 publishes the training
group's rendezvous port, bound by its own store (``learner/rendezvous.py``): what the Ray and
Slurm launchers give the ranks instead of a port picked free beforehand, which another process
can take before rank 0 binds it."""

LmHead = Literal["auto", "fused", "chunked"]
"""``LearnerConfig.lm_head``."""

ONE_RANK_STAGE = 0
"""ZeRO stage of a one-rank learner when ``zero_stage`` is unset: 0, no DeepSpeed at all
(``engines.PlainEngine``): at world size 1 there is nothing to partition, and ZeRO's machinery
(a gradient hook per parameter, bucket flushes, a device sync per backward, per-parameter
overflow checks) only costs (``bench/learner.py`` counts it)."""


class LoraConfig(StrictModel):
    """A LoRA adapter trained over frozen base weights (PEFT): only the adapter's tensors train,
    are checkpointed and are pushed to the generators (vLLM loads them through its LoRA API)."""

    rank: Literal[1, 8, 16, 32, 64, 128, 256, 320, 512] = 16
    """Rank r of each update (the ranks vLLM serves)."""
    alpha: float = Field(32.0, gt=0, le=1e6)
    """Scale numerator: each update is (alpha / r) B A."""
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        min_length=1,
        max_length=64,
    )
    """Names of the linear modules that get an adapter (the default: every attention and MLP
    projection of Llama, Qwen2 and Mistral-style models; vLLM supports these)."""
    dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on the adapter's input in training. Not 0 makes the learner's log-probs differ
    from the generator's (which runs without it)."""


Role = Literal["actor", "critic", "reference"]


class LearnerConfig(StrictModel):
    """The learner: all ranks read the same config; rank 0 serves it."""

    role: Role = "actor"
    """actor: the policy (TrainStep on advantages, PushWeights to generators); critic: the
    model's backbone with a scalar value head, trained on returns (ComputeValues, TrainStep);
    reference: the model frozen, forward only (ComputeLogprobs). Each role is its own service,
    with its own ranks, devices and checkpoints."""
    serve: ServeConfig = Field(default_factory=ServeConfig)
    """Where rank 0 listens, and who may call it."""
    security: ClientSecurity = Field(default_factory=ClientSecurity)
    """How rank 0 calls the generators (weight-sync control): CA, client certificate, token file.
    In an experiment file, unset takes ``services.security``."""
    model: str = ""
    """Path of a Hugging Face model folder to train. Required to serve."""
    world_size: int = Field(1, ge=1, le=4096)
    """ZeRO-3 ranks (processes), over one or several nodes."""
    zero_stage: Literal[0, 1, 2, 3] | None = None
    """DeepSpeed ZeRO stage: 3 partitions weights, gradients and optimizer state over the ranks
    (what lets a model larger than one device train); 2 and 1 keep every weight whole on every
    rank and partition less, faster where it fits; 0 (one rank only) runs no DeepSpeed: the
    module whole, fp32 master weights, fused AdamW (``learner/engines.py``). None: 3 with several
    ranks, ``ONE_RANK_STAGE`` (0) with one. A frozen model (the reference role, the in-process
    reference) runs as ZeRO-3 with several ranks and whole with one. A one-rank run saved at
    stage 1 or 2 resumes at stage 0."""
    param_persistence_threshold: int | None = Field(None, ge=0)
    """ZeRO-3: a parameter with fewer elements stays whole on every rank instead of being gathered
    at each use (norms, biases: many small collectives). None: 10 x the hidden size (Hugging
    Face's "auto"); 0 partitions every parameter."""
    overlap_comm: bool | None = None
    """Overlap ZeRO's gradient reductions and parameter gathers with compute. None: on with CUDA
    (NCCL runs on streams of its own), off on CPU (gloo has none to overlap with)."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Training dtype; bfloat16 on GPUs, float32 on CPU."""
    micro_batch_tokens: int | None = Field(None, ge=16)
    """Tokens per micro-batch per rank; samples are balanced across ranks by token count. Packed:
    real tokens; padded: samples x the longest. None: derived at start (``learner/budget.py``):
    on a GPU what fits the memory left once the model is loaded (the smallest over ranks), on
    CPU 4096; every step's metrics report it (``micro_batch_tokens``)."""
    score_micro_batch_tokens: int | None = Field(None, ge=16)
    """Tokens per micro-batch of forward-only scoring (ComputeLogprobs, ComputeValues): nothing
    is kept for a backward pass, so it can be larger. None: 4 x the training budget."""
    packing: Literal["auto", "on", "off"] = "auto"
    """How a micro-batch's samples are laid out. Packed: one row of whole samples end to end, each
    attending only to itself (no padding; ``learner/attention.py``). Padded: one row per sample,
    padded to the longest. auto: packed where the model's attention allows it (it takes an
    attention function through transformers' AttentionInterface and has no sliding-window
    layers), padded otherwise; on: packed, or refuse to start; off: padded."""

    @field_validator("packing", mode="before")
    @classmethod
    def _yaml_on_off(cls, v: object) -> object:
        # YAML 1.1 reads a bare `on`/`off` (in a file or `--set learner.packing=on`) as a boolean.
        return {True: "on", False: "off"}.get(v, v) if isinstance(v, bool) else v

    gradient_checkpointing: bool = False
    """Recompute activations in backward to save memory."""
    head_calls: Literal["per_micro_batch", "per_step"] = "per_step"
    """How many times the LM head runs per micro-batch (a chunk of rows at a time, and again in
    backward): as many as each micro-batch needs (the most any rank needs for it, as ZeRO-3's
    gathers require), or the step's most for every micro-batch, so each repeats the same module
    order and ZeRO-3's prefetcher, which replays the order it recorded, stays valid."""
    logits_chunk_mib: float = Field(512.0, gt=0, le=1 << 20)
    """Log-probs are computed from the last hidden states a chunk of tokens at a time, the LM head
    applied inside the chunk (and again in backward): this bounds one chunk's float32 logits, in
    MiB. Full-vocabulary logits for a whole micro-batch never exist."""
    lm_head: LmHead = "auto"
    """How log-probs come out of the LM head (``learner/fused_head.py``). fused: one autograd
    function from the hidden states and the head's weight, nothing of the vocabulary's size saved
    for backward and fewer passes over each chunk's logits; chunked: the head module called a
    chunk at a time, recomputed in backward (the reference). auto: fused on CUDA, chunked on CPU.
    A head whose weight ZeRO-3 partitions, or that PEFT wraps, runs chunked whatever this says
    (the fused path reads the whole weight). Both take ``logits_chunk_mib`` chunks."""
    bucket_mb: float = Field(64.0, gt=0, le=4096)
    """Weight push bucket size in MiB: tensors are packed into buckets this large per broadcast."""
    lora: LoraConfig | None = None
    """Train a LoRA adapter instead of every weight (actor only). The KL term's reference is
    then the same model with the adapter switched off (no second copy). Pushes, checkpoints and
    ``ExportModel(adapter=true)`` carry the adapter alone; ``ExportModel`` otherwise writes the
    merged model. The generators need ``engine.max_lora_rank`` at least ``rank``."""
    loss: LossConfig = Field(default_factory=LossConfig)
    """The policy loss."""
    optim: OptimConfig = Field(default_factory=OptimConfig)
    """Optimizer and LR schedule."""
    weight_sync_host: str = ""
    """Address generators use to reach rank 0's weight-sync rendezvous; empty: ``serve.host``,
    or this host's name when serving on all interfaces."""
    weight_sync_transport: Literal["auto", "ipc", "shm", "nccl", "gloo"] = "auto"
    """How weights reach each generator. auto: CUDA IPC to a replica on the learner's GPU, shared
    memory to one on the same host (CPU), NCCL to other GPUs, gloo across CPU hosts, each checked
    when the replica registers (falling back ipc -> shm -> gloo when a probe fails). Anything
    else forces that transport for every replica, and a replica it cannot reach is refused."""
    weight_sync_timeout_seconds: float = Field(300.0, gt=0)
    """Limit for generators to join the weight-sync group, for each broadcast, and for each
    replica to answer a push once the learner has sent it (a replica silent longer is named in
    the push's error; training does not wait for it); the replicas' quick calls (GetStatus,
    CloseWeightSync) wait at most 30 s or this. The embedded default lowers it to a third of
    the coordinator's ``services.deadline_seconds`` when the two together would not fit in it
    (the coordinator's call would time out first and name the learner, not the generator)."""
    heartbeat_timeout_seconds: float = Field(120.0, ge=1, le=86400)
    """Longest silence between rank 0 and the other ranks (rank 0 beats every tenth of it, on a
    group of its own): a follower that does not hear rank 0 for this long exits with status 1, and
    rank 0 stops serving and exits with status 1 when a follower does not take a beat, so that
    their supervisor restarts the learner rather than ranks waiting on each other for ever. Also
    the limit for the other ranks to take rank 0's last command at shutdown."""
    rpc_deadline_seconds: float = Field(600.0, gt=0)
    """Deadline of the learner's own calls to generators (InitWeightSync, UpdateWeights)."""
    checkpoint_dir: str = "checkpoints"
    """Folder on the learner's own filesystem (every rank must see it) under which relative
    checkpoint and export paths resolve, and which an empty path means. Relative: to the
    learner's working directory. Callers on other hosts send relative paths, so nothing
    assumes a filesystem shared with them."""

    @model_validator(mode="after")
    def _plain_at_one_rank(self) -> LearnerConfig:
        if self.zero_stage == 0 and self.world_size > 1:
            raise ValueError(f"zero_stage: 0 runs one rank, not world_size {self.world_size}; use 1, 2 or 3")
        return self

    @model_validator(mode="after")
    def _role_fits_loss(self) -> LearnerConfig:
        # The in-process reference (kl_coef) belongs to the actor: a critic or a reference would
        # load a second copy of the model for nothing.
        if self.role != "actor" and self.loss.kl_coef > 0:
            raise ValueError(f"loss.kl_coef: a {self.role} has no KL term; set it on the actor (or 0)")
        if self.role != "actor" and self.lora is not None:
            raise ValueError(f"lora: a {self.role} trains no adapter; set it on the actor")
        return self
