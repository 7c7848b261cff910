"""One learner rank: its engine (``engines.py``: a plain module at one rank, DeepSpeed ZeRO across
ranks), its role (``roles.py``: what it builds, outputs and trains on), and the collective
operations on them.

Every method here is collective: all ranks call it with the same arguments in the same order
(rank 0 decides, ``control.py`` relays). Rank 0 additionally gets the results (metrics, the
gathered weights). Nothing here knows about gRPC, and nothing here asks which role it runs.

* ``train_step``: samples -> balanced micro-batches -> loss -> one optimizer step.
* ``gathered_buckets``: the weights bucket by bucket, gathered where ZeRO-3 shards them (for
  PushWeights and export).
* ``save`` / ``load``: checkpoints with step, version, RNG and the caller's state.
"""

from __future__ import annotations

import logging
import os
import random
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from relayrl.common.memory import HeapTrimmer, resident_mb
from relayrl.common.weightsync.buckets import torch_dtype
from relayrl.common.weightsync.plan import Bucket, TensorMeta
from relayrl.learner import budget, lora
from relayrl.learner.attention import ATTENTION, packable, register
from relayrl.learner.batching import plan_step
from relayrl.learner.config import LearnerConfig
from relayrl.learner.engines import build_engine
from relayrl.learner.export import export_policy, writable_problem
from relayrl.learner.logprobs import chunk_rows, head_calls
from relayrl.learner.losses import Totals
from relayrl.learner.roles import Built, make_role
from relayrl.learner.samples import Sample, to_batch

logger = logging.getLogger(__name__)


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
    """One rank's model, engine and role."""

    def __init__(self, cfg: LearnerConfig):
        from transformers import AutoConfig

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
        self.rows_per_chunk = chunk_rows(self.model_config.vocab_size, cfg.logits_chunk_mib)
        self.role = make_role(cfg)
        self.peft = None
        self.packed = False
        built: list[Built] = []

        def make() -> torch.nn.Module:
            b = self.role.build(self.model_config, self.dtype, self.rows_per_chunk)
            # LoRA: adapter layers injected in place (the module tree the role runs stays the same).
            self.peft = lora.wrap(b.inner, cfg.lora) if cfg.lora is not None else None
            self.packed = self._packing(b.inner)
            if cfg.gradient_checkpointing and self.role.trains:
                b.inner.gradient_checkpointing_enable()
                if self.peft is not None:  # frozen embeddings: the checkpointed layers still need grads in
                    b.inner.enable_input_require_grads()
            built.append(b)
            return b.module

        self.engine = self._engine(make, frozen=not self.role.trains)
        # The module whose parameter names are pushed and exported; with LoRA, only the
        # adapter's tensors are pushed, under PEFT's names.
        self.lm = built[0].pushed
        self.pushed = (
            lora.adapter_params(built[0].inner) if self.peft is not None else dict(self.lm.named_parameters())
        )
        self.role.attach(self)
        self.micro_batch_tokens = cfg.micro_batch_tokens or self._budget()
        self._heap = HeapTrimmer()
        self.step = 0
        self.version = 0
        self.vocab_size = self.model_config.vocab_size
        self.max_len = getattr(self.model_config, "max_position_embeddings", 1 << 30)

    def _engine(self, make: Callable[[], torch.nn.Module], frozen: bool):
        return build_engine(
            self.cfg, make, frozen=frozen, device=self.device, dtype=self.dtype,
            hidden_size=self.model_config.hidden_size,
        )  # fmt: skip

    def _budget(self) -> int:
        """The micro-batch token budget this rank's memory allows (``budget.py``), the smallest
        over ranks: every rank must cut a step into as many micro-batches as the others."""
        if self.device.type != "cuda":
            return budget.CPU_TOKENS
        trainable = sum(
            getattr(p, "ds_numel", p.numel()) for p in self.engine.module.parameters() if p.requires_grad
        )
        if self.engine.stage == 3:  # optimizer state and gradients are sharded over the ranks
            trainable //= self.world_size
        free = torch.cuda.mem_get_info(self.device)[0] - trainable * budget.STEP_BYTES_PER_PARAM
        checkpointing = self.cfg.gradient_checkpointing and self.role.trains
        mine = budget.micro_batch_tokens(self.model_config, self.dtype.itemsize, free, checkpointing)
        least = torch.tensor([mine], dtype=torch.int64, device=self.device)
        dist.all_reduce(least, op=dist.ReduceOp.MIN)
        if self.rank == 0:
            logger.info("micro-batch budget: %d tokens (learner.micro_batch_tokens unset)", int(least))
        return int(least)

    def frozen_copy(self, build: Callable[[], Built]):
        """A frozen engine of another model (a role's in-process reference), laid out as this
        one's (packed attention where this one packs)."""

        def make() -> torch.nn.Module:
            b = build()
            if self.packed:
                b.inner.set_attn_implementation(ATTENTION)
            return b.module

        return self._engine(make, frozen=True)

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
    def _plan(self, samples: list[Sample], tokens: int | None = None) -> list[tuple[list[int], int]]:
        """This rank's micro-batches (sample indices; empty ones still run, see ``train_step``)
        and for each the LM-head calls to make: the most any rank needs for its micro-batch of
        that index. ZeRO-3 gathers the head's weight at every call, a collective: ranks whose
        micro-batches differ in size must still call it as often as each other. ``tokens``:
        tokens per micro-batch (default: training's)."""
        lengths = [len(s.prompt) + len(s.completion) for s in samples]
        plans = plan_step(lengths, self.world_size, tokens or self.micro_batch_tokens, self.packed)

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

    def train_step(self, samples: list[Sample], max_completion_tokens: int) -> dict[str, float]:
        """One optimizer step on ``samples`` (the whole step's batch; every rank gets all of it)."""
        if not self.role.trains:
            raise RuntimeError(
                f"this learner's model is frozen ({type(self.role).__name__}): it takes no training step"
            )
        t0 = time.monotonic()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        plan = self._plan(samples)
        total_tokens = sum(sum(s.loss_mask) if s.loss_mask else len(s.completion) for s in samples)
        totals = Totals(
            tokens=max(1, int(total_tokens)), sequences=len(samples), max_tokens=max_completion_tokens
        )
        names = self.role.sums()
        # Summed on the training device and read once after the step (an NCCL group takes no
        # CPU tensor; each read of a device value waits for the device).
        sums = torch.zeros(2 + len(names), dtype=torch.float64, device=self.device)  # loss, entropy, ...
        self.engine.train()
        for k, (mb, calls) in enumerate(plan):
            self.engine.set_gradient_accumulation_boundary(k == len(plan) - 1)
            # An empty micro-batch still runs forward/backward (weight 0): ZeRO-3 reduces
            # gradients inside backward, so every rank must run as many as the others.
            b = to_batch([samples[i] for i in mb] or [samples[0]], self.device, self.packed)
            b.mask = b.mask * (1.0 if mb else 0.0)
            loss, entropy, stats = self.role.loss(self.engine, b, totals, calls)
            # ZeRO averages gradients over ranks; our loss is already a share of the global
            # mean, so undo the average.
            self.engine.backward(loss * self.world_size)
            ent = (entropy * b.mask).sum() if entropy is not None else loss.new_zeros(())
            sums += torch.stack([loss.detach(), ent, *(stats[n] for n in names)]).to(torch.float64)
        lr = self.engine.lr()
        # A step whose global gradient norm is NaN or infinite is skipped (every rank agrees):
        # weights, optimizer and schedule stay as they were, and so do step and version. The
        # caller learns it from "applied".
        applied, grad_norm = self.engine.step()
        dist.all_reduce(sums)
        if applied:
            self.step += 1
            self.version += 1
        if self.device.type == "cpu":
            self._heap.after_step()  # freed activations back to the OS once the heap creeps
        t = float(totals.tokens)
        loss_sum, entropy_sum, *stat_sums = sums.tolist()
        per_token_means = token_means(dict(zip(names, stat_sums, strict=True)), t)
        return {
            "applied": applied,
            "loss": loss_sum,
            "entropy": entropy_sum / t,
            "kl": 0.0,
            **per_token_means,
            "grad_norm": grad_norm,
            "lr": float(lr),
            "tokens": int(total_tokens),
            "samples": len(samples),
            "step_seconds": time.monotonic() - t0,
            "micro_batches": len(plan),
            "micro_batch_tokens": self.micro_batch_tokens,
            "peak_memory_mb": _peak_memory_mb(self.device),
            "resident_memory_mb": resident_mb(),
        }

    def score(self, samples: list[Sample]) -> list[list[float]]:
        """Forward only: per completion token, the role's output (a log-prob, or a value).
        Collective: each rank scores its share (balanced as in training, the same
        number of micro-batches everywhere for ZeRO-3's gathers), and one all-reduce of a flat
        buffer, on the training device, gives every rank all of it."""
        plan = self._plan(samples, self.cfg.score_micro_batch_tokens or 4 * self.micro_batch_tokens)
        sizes = [len(s.completion) for s in samples]
        offsets = [0]
        for n in sizes:
            offsets.append(offsets[-1] + n)
        flat = torch.zeros(offsets[-1], dtype=torch.float32, device=self.device)
        self.engine.train(False)
        with torch.no_grad():
            for mb, calls in plan:
                batch = to_batch([samples[i] for i in mb] or [samples[0]], self.device, self.packed)
                out, _ = self.role.per_token(self.engine, batch, calls)
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
        params = self.pushed if params is None else params
        for b in buckets:
            group = [params[m.name] for m in b.tensors]
            with self.engine.gathered(group):
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
        names = self.engine.state_files(path, tag)
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
        self.engine.save(path, tag, state, exclude_frozen=self.peft is not None)

    def load(self, path: str, tag: str | None) -> dict:
        client = self.engine.load(path, tag, strict=self.peft is None)
        if client is None:
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
