"""One learner rank: the DeepSpeed engine (ZeRO-3 across ranks) and the collective operations on it.

Every method here is collective: all ranks call it with the same arguments in the same order
(rank 0 decides, ``control.py`` relays). Rank 0 additionally gets the results (metrics, the
gathered weights). Nothing here knows about gRPC.

* ``train_step``: samples -> balanced micro-batches -> loss -> one optimizer step.
* ``gathered_buckets``: ZeRO-3 shards gathered bucket by bucket (for PushWeights and export).
* ``save`` / ``load``: DeepSpeed checkpoints with step, version, RNG and the caller's state.
"""

from __future__ import annotations

import logging
import math
import os
import random
import time
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from relayrl.common.memory import resident_mb, trim_heap
from relayrl.common.weightsync.buckets import torch_dtype
from relayrl.common.weightsync.plan import Bucket, TensorMeta
from relayrl.learner import lora
from relayrl.learner.attention import ATTENTION, packable, register
from relayrl.learner.batching import plan_step
from relayrl.learner.config import LearnerConfig
from relayrl.learner.dsconfig import ds_config, lr_lambda, zero_stage
from relayrl.learner.export import export_policy, writable_problem
from relayrl.learner.logprobs import chunk_rows, head_calls
from relayrl.learner.losses import LossInputs, Totals, policy_loss, policy_sums, value_loss
from relayrl.learner.models import Policy, ValueModel
from relayrl.learner.samples import Batch, Sample, to_batch

logger = logging.getLogger(__name__)


METRIC_SUMS = {
    "critic": ("vf_clipped", "vf_sq_err"),
    "reference": (),
}
"""Per role, the loss's metric sums a step adds up over micro-batches and ranks (then divides by
the step's tokens), under the names of ``METRIC_NAMES``; an actor's are its loss's
(``policy_sums``)."""
METRIC_NAMES = {
    "clipped": "clip_fraction",
    "tis_weight": "tis_weight_mean",
    "vf_clipped": "clip_fraction",
    "vf_sq_err": "vf_mse",
    "after_env_abs_diff": "logprob_abs_diff_after_env",
}
METRIC_COUNTS = {"after_env_abs_diff": "after_env_weight"}
"""Sums divided by a count summed beside them rather than by the step's tokens. The count itself
is not reported, and nor is the mean when its count is 0 (a step without multi-turn episodes
has no token after an environment span: absent, not a misleading 0)."""


def token_means(sums: dict[str, float], tokens: float) -> dict[str, float]:
    """The step's metric sums (over micro-batches and ranks) -> token-weighted means by name.

    >>> token_means({"clipped": 2.0, "after_env_abs_diff": 0.5, "after_env_weight": 2.0}, 8.0)
    {'clip_fraction': 0.25, 'logprob_abs_diff_after_env': 0.25}
    >>> token_means({"after_env_abs_diff": 0.0, "after_env_weight": 0.0}, 8.0)
    {}
    """
    counts = set(METRIC_COUNTS.values())
    out = {}
    for n, v in sums.items():
        if n in counts:
            continue
        count = sums[METRIC_COUNTS[n]] if n in METRIC_COUNTS else tokens
        if count > 0:
            out[METRIC_NAMES.get(n, n)] = v / count
    return out


class Trainer:
    """A ZeRO-3 engine over a Hugging Face causal LM (one per rank)."""

    def __init__(self, cfg: LearnerConfig):
        import deepspeed
        from transformers import AutoConfig, AutoModel, AutoModelForCausalLM
        from transformers.integrations import HfDeepSpeedConfig

        self.cfg = cfg
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.device = (
            torch.device("cuda", torch.cuda.current_device())
            if torch.cuda.is_available()
            else torch.device("cpu")
        )
        self.dtype = torch.bfloat16 if cfg.dtype == "bfloat16" else torch.float32
        self.model_config = AutoConfig.from_pretrained(cfg.model)
        hidden, cuda = self.model_config.hidden_size, self.device.type == "cuda"
        conf = ds_config(cfg, hidden, zero_stage(cfg, frozen=cfg.role == "reference"), cuda)
        self.stage = conf["zero_optimization"]["stage"]
        # Must stay alive while models load: makes from_pretrained partition them (zero.Init) at ZeRO-3.
        self._hf_ds = HfDeepSpeedConfig(conf)
        rows = self.rows_per_chunk = chunk_rows(self.model_config.vocab_size, cfg.logits_chunk_mib)
        self.role = cfg.role
        if cfg.role == "critic":  # the backbone alone: no LM head, nor its optimizer state
            backbone = AutoModel.from_pretrained(cfg.model, dtype=self.dtype)
            module = ValueModel(backbone, self.model_config.hidden_size, self.dtype)
            inner = backbone
        else:
            inner = AutoModelForCausalLM.from_pretrained(cfg.model, dtype=self.dtype)
            module = Policy(inner, rows)
        # LoRA: adapter layers injected in place (the module tree Policy runs stays the same).
        self.peft = lora.wrap(inner, cfg.lora) if cfg.lora is not None else None
        self.packed = self._packing(inner)
        if cfg.gradient_checkpointing and cfg.role != "reference":
            inner.gradient_checkpointing_enable()
            if self.peft is not None:  # frozen embeddings: the checkpointed layers still need grads in
                inner.enable_input_require_grads()
        if cfg.role == "reference":  # frozen: no optimizer, forward only
            self.engine, *_ = deepspeed.initialize(model=module, config=conf)
            self.engine.train(False)
            self.optimizer = self.scheduler = None
        else:
            opt = torch.optim.AdamW(
                [p for p in module.parameters() if p.requires_grad],  # LoRA: the adapter alone
                lr=cfg.optim.lr,
                betas=cfg.optim.betas,
                weight_decay=cfg.optim.weight_decay,
            )
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg))
            self.engine, self.optimizer, _, self.scheduler = deepspeed.initialize(
                model=module, optimizer=opt, lr_scheduler=sched, config=conf
            )
        # The module whose parameter names are pushed and exported: the HF model for a policy
        # (names as in its checkpoint), the whole value model for a critic; with LoRA, only the
        # adapter's tensors are pushed, under PEFT's names.
        self.lm = module if cfg.role == "critic" else inner
        self.pushed = (
            lora.adapter_params(inner) if self.peft is not None else dict(self.lm.named_parameters())
        )
        self.ref = None
        # The actor's in-process reference (config: actors only); with LoRA, the same model with
        # its adapter off (``_loss``).
        if cfg.loss.kl_coef > 0 and self.peft is None:
            ref_conf = ds_config(cfg, hidden, zero_stage(cfg, frozen=True), cuda)
            self._hf_ds = HfDeepSpeedConfig(ref_conf)
            ref_model = AutoModelForCausalLM.from_pretrained(cfg.model, dtype=self.dtype)
            if self.packed:
                ref_model.set_attn_implementation(ATTENTION)
            self.ref, *_ = deepspeed.initialize(model=Policy(ref_model, rows), config=ref_conf)
            self.ref.train(False)  # frozen reference: inference mode
        self.step = 0
        self.version = 0
        self.vocab_size = self.model_config.vocab_size
        self.max_len = getattr(self.model_config, "max_position_embeddings", 1 << 30)

    def _packing(self, model) -> bool:
        """Whether micro-batches are packed (``learner.packing``); switches the model's attention
        to the varlen function when they are."""
        why = packable(type(model), model.config)
        if self.cfg.packing == "on" and why:
            raise ValueError(f"learner.packing is on, but {self.cfg.model} cannot run packed rows: {why}")
        if self.cfg.packing == "off" or why:
            if why and self.rank == 0:
                logger.info("padded micro-batches: %s", why)
            return False
        register()
        model.set_attn_implementation(ATTENTION)
        return True

    # -- training ------------------------------------------------------------------------
    def _plan(self, samples: list[Sample], budget: int | None = None) -> list[tuple[list[int], int]]:
        """This rank's micro-batches (sample indices; empty ones still run, see ``train_step``)
        and for each the LM-head calls to make: the most any rank needs for its micro-batch of
        that index. ZeRO-3 gathers the head's weight at every call, a collective: ranks whose
        micro-batches differ in size must still call it as often as each other. ``budget``:
        tokens per micro-batch (default: training's)."""
        lengths = [len(s.prompt) + len(s.completion) for s in samples]
        plans = plan_step(lengths, self.world_size, budget or self.cfg.micro_batch_tokens, self.packed)

        def rows(mb: list[int]) -> int:  # LM-head rows of the micro-batch as run
            batch = [samples[i] for i in mb] or [samples[0]]
            if self.packed:  # completion tokens only
                return sum(len(s.completion) for s in batch)
            return len(batch) * max(len(s.completion) for s in batch)

        calls = [
            max(head_calls(rows(p[k]), self.rows_per_chunk) for p in plans) for k in range(len(plans[0]))
        ]
        if self.cfg.head_calls == "per_step":
            calls = [max(calls)] * len(calls)
        return list(zip(plans[self.rank], calls, strict=True))

    def _per_token(self, engine, b: Batch, calls: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The module's per-token output: (log-probs, entropies) of a policy, (values, None) of a
        critic."""
        if self.role == "critic":
            return engine(b.ids, b.starts, b.width, packing=b.packing), None
        return engine(
            b.ids, b.targets, b.starts, b.width, self.cfg.loss.temperature, calls, packing=b.packing
        )

    def _loss(
        self, b: Batch, totals: Totals, calls: int
    ) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, float]]:
        """One micro-batch's share of the step loss, its entropies and the metric sums."""
        out, entropy = self._per_token(self.engine, b, calls)
        if self.role == "critic":
            # With value_clip set every sample carries its old values (decode_samples insists).
            clip = self.cfg.loss.value_clip
            loss, stats = value_loss(out, b.old_values, b.returns, b.mask, clip, "token", totals)
            return loss, None, stats
        ref_logp = None
        if self.ref is not None:
            with torch.no_grad():
                ref_logp, _ = self._per_token(self.ref, b, calls)
        elif self.peft is not None and self.cfg.loss.kl_coef > 0:
            with torch.no_grad(), lora.disabled(self.peft):
                ref_logp, _ = self._per_token(self.engine, b, calls)
        loss, stats = policy_loss(LossInputs(out, b.behavior, b.adv, b.mask, ref_logp), self.cfg.loss, totals)
        return loss, entropy, stats

    def train_step(self, samples: list[Sample], max_completion_tokens: int) -> dict[str, float]:
        """One optimizer step on ``samples`` (the whole step's batch; every rank gets all of it)."""
        if self.role == "reference":
            raise RuntimeError("a reference is frozen: it takes no training step")
        t0 = time.monotonic()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        plan = self._plan(samples)
        total_tokens = sum(sum(s.loss_mask) if s.loss_mask else len(s.completion) for s in samples)
        totals = Totals(
            tokens=max(1, int(total_tokens)), sequences=len(samples), max_tokens=max_completion_tokens
        )
        names = policy_sums(self.cfg.loss) if self.role == "actor" else METRIC_SUMS[self.role]
        # On the training device: an NCCL group takes no CPU tensor (issue 13 found this one).
        sums = torch.zeros(2 + len(names), dtype=torch.float64, device=self.device)  # loss, entropy, ...
        self.engine.train()
        for k, (mb, calls) in enumerate(plan):
            self.engine.set_gradient_accumulation_boundary(k == len(plan) - 1)
            # An empty micro-batch still runs forward/backward (weight 0): ZeRO-3 reduces
            # gradients inside backward, so every rank must run as many as the others.
            b = to_batch([samples[i] for i in mb] or [samples[0]], self.device, self.packed)
            b.mask = b.mask * (1.0 if mb else 0.0)
            loss, entropy, stats = self._loss(b, totals, calls)
            # ZeRO averages gradients over ranks; our loss is already a share of the global
            # mean, so undo the average.
            self.engine.backward(loss * self.world_size)
            ent = float((entropy * b.mask).sum()) if entropy is not None else 0.0
            sums += torch.tensor(
                [float(loss), ent, *(stats[n] for n in names)], dtype=torch.float64, device=self.device
            )
        lr = self.scheduler.get_last_lr()[0]
        self.engine.step()
        dist.all_reduce(sums)
        grad_norm = self.engine.get_global_grad_norm()
        grad_norm = float(grad_norm) if grad_norm is not None else float("nan")
        # ZeRO skips the update when the global gradient norm is NaN or infinite (its overflow
        # check, agreed on by every rank): weights, optimizer and schedule stay as they were, and
        # so do step and version. The caller learns it from "applied".
        applied = getattr(self.engine, "_step_applied", True) and math.isfinite(grad_norm)
        if applied:
            self.step += 1
            self.version += 1
        if self.device.type == "cpu":
            trim_heap()  # the step's activations go back to the OS (relayrl.common.memory)
        t = float(totals.tokens)
        per_token_means = token_means(dict(zip(names, sums[2:].tolist(), strict=True)), t)
        return {
            "applied": applied,
            "loss": float(sums[0]),
            "entropy": float(sums[1]) / t,
            "kl": 0.0,
            **per_token_means,
            "grad_norm": grad_norm,
            "lr": float(lr),
            "tokens": int(total_tokens),
            "samples": len(samples),
            "step_seconds": time.monotonic() - t0,
            "micro_batches": len(plan),
            "peak_memory_mb": _peak_memory_mb(self.device),
            "resident_memory_mb": resident_mb(),
        }

    def score(self, samples: list[Sample]) -> list[list[float]]:
        """Forward only: per completion token, the log-prob (actor, reference) or the value
        (critic). Collective: each rank scores its share (balanced as in training, the same
        number of micro-batches everywhere for ZeRO-3's gathers), and one all-reduce of a flat
        buffer, on the training device, gives every rank all of it."""
        plan = self._plan(samples, self.cfg.score_micro_batch_tokens or 4 * self.cfg.micro_batch_tokens)
        sizes = [len(s.completion) for s in samples]
        offsets = [0]
        for n in sizes:
            offsets.append(offsets[-1] + n)
        flat = torch.zeros(offsets[-1], dtype=torch.float32, device=self.device)
        self.engine.train(False)
        with torch.no_grad():
            for mb, calls in plan:
                batch = to_batch([samples[i] for i in mb] or [samples[0]], self.device, self.packed)
                out, _ = self._per_token(self.engine, batch, calls)
                for row, i in enumerate(mb):
                    flat[offsets[i] : offsets[i + 1]] = out[row, : sizes[i]].float()
        dist.all_reduce(flat)
        flat = flat.cpu()
        return [flat[offsets[i] : offsets[i + 1]].tolist() for i in range(len(samples))]

    # -- weights -------------------------------------------------------------------------
    def param_metas(self, dtype: str, params: dict | None = None) -> list[TensorMeta]:
        """Names and full shapes of what a push sends (``params``: of those), without gathering
        anything: every parameter under its checkpoint name, or with LoRA the adapter's."""
        params = self.pushed if params is None else params
        return [TensorMeta(n, dtype, tuple(getattr(p, "ds_shape", p.shape))) for n, p in params.items()]

    def gathered_buckets(
        self, buckets: list[Bucket], params: dict | None = None
    ) -> Iterator[list[torch.Tensor] | None]:
        """Per bucket, all ranks gather its parameters (of ``pushed``, or ``params``); rank 0
        gets the full tensors (in the bucket's order, cast to the plan's dtype), other ranks
        get None."""
        import deepspeed

        params = self.pushed if params is None else params
        for b in buckets:
            group = [params[m.name] for m in b.tensors]
            with deepspeed.zero.GatheredParameters(group, modifier_rank=None):
                if self.rank == 0:
                    yield [p.detach().to(torch_dtype(m.dtype)) for p, m in zip(group, b.tensors, strict=True)]
                else:
                    yield None

    def export(self, out: str | Path, bucket_bytes: int, adapter: bool = False) -> None:
        """Write the current policy as a Hugging Face folder (rank 0 writes; all ranks gather).
        With LoRA: the merged model, or with ``adapter`` the adapter's own folder."""
        export_policy(self, Path(out), bucket_bytes, adapter)

    # -- checkpoints ---------------------------------------------------------------------
    def problem(self, op: str, path: str, tag: str) -> str:
        """Why this rank could not run ``op`` ("save", "load", "export") on ``path``/``tag``, or
        "". Checked on every rank before any rank starts, because a rank that fails half-way
        through a collective leaves the others waiting for it: a refusal must come first."""
        if op == "save":
            return writable_problem(Path(path) / tag)
        if op == "export":
            return writable_problem(Path(path)) if self.rank == 0 else ""  # only rank 0 writes
        names = [os.path.join(path, tag)]
        try:  # the files this rank reads (DeepSpeed's own naming, so it stays in step with it)
            names = [self.engine._get_ckpt_name(path, tag), self.engine._get_zero_ckpt_name(path, tag)]
        except AttributeError:
            pass
        missing = [n for n in names if not os.path.exists(n)]
        return f"rank {self.rank} finds no {', '.join(missing)}" if missing else ""

    def save(self, path: str, tag: str, client_state_json: str) -> None:
        state = {
            "relayrl": {
                "step": self.step,
                "policy_version": self.version,
                "client_state_json": client_state_json,
            },
            "rng": {"torch": torch.get_rng_state(), "python": random.getstate()},
        }
        # LoRA: the frozen base is read from the model folder again, not saved with every step.
        self.engine.save_checkpoint(
            path, tag=tag, client_state=state, exclude_frozen_parameters=self.peft is not None
        )

    def load(self, path: str, tag: str | None) -> dict:
        load_path, client = self.engine.load_checkpoint(path, tag=tag, load_module_strict=self.peft is None)
        if load_path is None:
            raise FileNotFoundError(f"no checkpoint at {path} (tag {tag or 'latest'})")
        meta = client["relayrl"]
        self.step, self.version = meta["step"], meta["policy_version"]
        torch.set_rng_state(client["rng"]["torch"])
        random.setstate(client["rng"]["python"])
        return meta


def _peak_memory_mb(device: torch.device) -> float:
    """The CUDA allocator's peak since the step began, or on CPU the process's peak RSS."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
