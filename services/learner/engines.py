"""What trains a learner's module: the small interface the trainer runs, and its two engines.

* ``PlainEngine`` (one rank, the default there): the module as it is on the device, no sharding
  machinery. DeepSpeed's ZeRO at one rank adds a gradient hook per parameter, a bucket flush per
  large tensor, a device sync at the end of every backward and per-parameter overflow checks
  (NOTES.md, GPUs, second visit), and partitions nothing. Here: fp32 master weights beside a
  bfloat16 module (gradients accumulated into them by one foreach add per micro-batch), fused
  AdamW, the global-norm clip as one foreach multiply, and one host read per step (the gradient
  norm, which decides whether the step is applied and is reported).
* ``DeepSpeedEngine`` (several ranks, or a ZeRO stage asked for by name): ZeRO-1/2/3 as before.

Both keep the learner's contracts: a step whose global gradient norm is not finite changes
nothing (weights, optimizer state, schedule); checkpoints resume exactly; a frozen model (the
reference) has no optimizer. ``PlainEngine`` also loads a one-rank DeepSpeed (ZeRO-1/2, or a
frozen stage-0) checkpoint, the format every earlier learner wrote (``dscheckpoint.py``).

    engine = build_engine(cfg, make_module, frozen=False, device=..., dtype=...)
    out = engine(*inputs); engine.backward(loss); applied, norm = engine.step()
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from relayrl.learner.config import LearnerConfig
from relayrl.learner.dsconfig import ds_config, lr_lambda, zero_stage

PLAIN_STATE = "relayrl_plain_state.pt"
"""A plain engine's checkpoint file, in ``<path>/<tag>/``; ``<path>/latest`` names the last tag
(DeepSpeed's convention, so either engine finds the other's latest)."""


def build_engine(
    cfg: LearnerConfig,
    make_module: Callable[[], torch.nn.Module],
    *,
    frozen: bool,
    device: torch.device,
    dtype: torch.dtype,
    hidden_size: int,
):
    """The engine for one model of this learner (``make_module`` builds it: under ZeRO-3 inside
    DeepSpeed's partitioned loading). Stage 0 (one rank, unset or 0): ``PlainEngine``."""
    stage = zero_stage(cfg, frozen)
    if stage == 0:
        return PlainEngine(make_module(), cfg, device, dtype, frozen)
    from transformers.integrations import HfDeepSpeedConfig

    conf = ds_config(cfg, hidden_size, stage, device.type == "cuda")
    keep = HfDeepSpeedConfig(conf)  # alive while the model loads: from_pretrained partitions (ZeRO-3)
    return DeepSpeedEngine(make_module(), conf, cfg, frozen, keep)


def _adamw(params: list[torch.Tensor], cfg: LearnerConfig, fused: bool) -> torch.optim.Optimizer:
    """AdamW; ``fused``: one kernel over every tensor (torchtitan's default; on CPU too), with the
    step counts' bias corrections inside it, where the foreach path reads each parameter's step
    back to the host."""
    o = cfg.optim
    return torch.optim.AdamW(params, lr=o.lr, betas=o.betas, weight_decay=o.weight_decay, fused=fused or None)


class PlainEngine:
    """One rank, the module whole on its device (see the module docstring)."""

    stage = 0

    def __init__(
        self,
        module: torch.nn.Module,
        cfg: LearnerConfig,
        device: torch.device,
        dtype: torch.dtype,
        frozen: bool,
    ):
        self.cfg = cfg
        self.module = module.to(device)
        self.device = device
        self.params = [p for p in module.parameters() if p.requires_grad] if not frozen else []
        self.optimizer = self.scheduler = None
        self.master: list[torch.Tensor] | None = None
        self._acc: list[torch.Tensor] | None = None
        if frozen:
            self.module.train(False)
            return
        if dtype != torch.float32:  # master weights: the update in float32, the module in dtype
            self.master = [torch.nn.Parameter(p.detach().float().clone()) for p in self.params]
        self.optimizer = _adamw(self.master or self.params, cfg, fused=True)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(cfg))

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def train(self, mode: bool = True) -> None:
        self.module.train(mode)

    def set_gradient_accumulation_boundary(self, last: bool) -> None:
        """Nothing to do: gradients accumulate in place until ``step``."""

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()
        if self.master is None:
            return
        # bfloat16 gradients of one micro-batch added into float32 ones: a step's many
        # micro-batches accumulate without bfloat16's rounding (one foreach add, no hooks).
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        if self._acc is None:
            self._acc = [g.float() for g in grads]
        else:
            torch._foreach_add_(self._acc, grads)
        for p in self.params:
            p.grad = None

    def _grads(self) -> list[torch.Tensor]:
        if self.master is not None:
            return self._acc or []
        return [p.grad for p in self.params if p.grad is not None]

    def step(self) -> tuple[bool, float]:
        """Clip to ``optim.grad_clip`` and update, unless the global gradient norm is not finite
        (then nothing changes). (applied, the norm before clipping)."""
        grads = self._grads()
        norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads))) if grads else None
        value = float(norm) if norm is not None else 0.0  # the step's one host read
        applied = math.isfinite(value)
        if applied and grads:
            with torch.no_grad():
                # torch.nn.utils.clip_grad_norm_'s (and DeepSpeed's) coefficient, never above 1.
                torch._foreach_mul_(grads, (self.cfg.optim.grad_clip / (norm + 1e-6)).clamp(max=1.0))
                if self.master is not None:
                    for m, g in zip(self.master, grads, strict=True):
                        m.grad = g
                self.optimizer.step()
                if self.master is not None:
                    torch._foreach_copy_(self.params, self.master)  # back to the module's dtype
            self.scheduler.step()
        self.zero_grad()
        return applied, value

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None
        for m in self.master or ():
            m.grad = None
        self._acc = None

    def lr(self) -> float:
        return self.scheduler.get_last_lr()[0]

    def gathered(self, params: Iterable[torch.nn.Parameter]):
        """Parameters are whole here: nothing to gather."""
        return contextlib.nullcontext()

    # -- checkpoints ---------------------------------------------------------------------
    def state_files(self, path: str, tag: str) -> list[str]:
        """The files a load of ``tag`` reads (this engine's own, else a DeepSpeed one-rank
        checkpoint's model file)."""
        own = os.path.join(path, tag, PLAIN_STATE)
        if os.path.exists(own):
            return [own]
        from relayrl.learner.dscheckpoint import MODEL_FILE

        return [os.path.join(path, tag, MODEL_FILE)]

    def save(self, path: str, tag: str, client_state: dict, exclude_frozen: bool) -> None:
        module = self.module.state_dict()
        if exclude_frozen:  # LoRA: the base is read from the model folder again
            trained = {n for n, p in self.module.named_parameters() if p.requires_grad}
            module = {n: t for n, t in module.items() if n in trained}
        state = {
            "module": module,
            "master": [m.detach() for m in self.master] if self.master is not None else None,
            "optimizer": self.optimizer.state_dict() if self.optimizer is not None else None,
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "client_state": client_state,
        }
        folder = Path(path) / tag
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / (PLAIN_STATE + ".tmp")
        torch.save(state, tmp)
        os.replace(tmp, folder / PLAIN_STATE)  # whole or not at all
        latest = Path(path) / "latest.tmp"
        latest.write_text(tag)
        os.replace(latest, Path(path) / "latest")

    def load(self, path: str, tag: str | None, strict: bool) -> dict | None:
        """Load ``tag`` (None: the ``latest`` one); the client state, or None when there is no
        such checkpoint."""
        if tag is None:
            try:
                tag = (Path(path) / "latest").read_text().strip()
            except OSError:
                return None
        own = Path(path) / tag / PLAIN_STATE
        if own.exists():
            state = torch.load(own, map_location=self.device, weights_only=False)
        else:
            from relayrl.learner import dscheckpoint

            state = dscheckpoint.read(Path(path) / tag, self.module, self.params, self.optimizer)
            if state is None:
                return None
        self._restore(state, strict)
        return state["client_state"]

    def _restore(self, state: dict, strict: bool) -> None:
        missing, unexpected = self.module.load_state_dict(state["module"], strict=False)
        if unexpected or (strict and missing):
            raise ValueError(
                f"checkpoint does not fit the model: missing {missing[:5]}, unexpected {unexpected[:5]}"
            )
        if self.optimizer is None:
            return
        if self.master is not None:
            masters = state["master"] or [p.detach().float() for p in self.params]
            with torch.no_grad():
                torch._foreach_copy_(self.master, [m.to(self.device) for m in masters])
                torch._foreach_copy_(self.params, self.master)
        elif state["master"] is not None:  # float32 module: the masters are the weights
            with torch.no_grad():
                torch._foreach_copy_(self.params, [m.to(self.device) for m in state["master"]])
        if state["optimizer"] is not None:
            self.optimizer.load_state_dict(state["optimizer"])
        if state["scheduler"] is not None:
            self.scheduler.load_state_dict(state["scheduler"])


class DeepSpeedEngine:
    """A DeepSpeed engine (ZeRO-1/2/3) behind the same interface."""

    def __init__(self, module: torch.nn.Module, conf: dict, cfg: LearnerConfig, frozen: bool, keep: object):
        import deepspeed

        self._keep = keep  # HfDeepSpeedConfig: ZeRO-3's partitioned loading looks it up
        self.stage = conf["zero_optimization"]["stage"]
        if frozen:
            self.ds, *_ = deepspeed.initialize(model=module, config=conf)
            self.ds.train(False)
            self.optimizer = self.scheduler = None
        else:
            params = [p for p in module.parameters() if p.requires_grad]  # LoRA: the adapter alone
            opt = _adamw(params, cfg, fused=False)  # DeepSpeed steps its own flat fp32 copy
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg))
            self.ds, self.optimizer, _, self.scheduler = deepspeed.initialize(
                model=module, optimizer=opt, lr_scheduler=sched, config=conf
            )

    @property
    def module(self) -> torch.nn.Module:
        return self.ds.module

    def __call__(self, *args, **kwargs):
        return self.ds(*args, **kwargs)

    def train(self, mode: bool = True) -> None:
        self.ds.train(mode)

    def set_gradient_accumulation_boundary(self, last: bool) -> None:
        self.ds.set_gradient_accumulation_boundary(last)

    def backward(self, loss: torch.Tensor) -> None:
        self.ds.backward(loss)

    def step(self) -> tuple[bool, float]:
        self.ds.step()
        norm = self.ds.get_global_grad_norm()
        norm = float(norm) if norm is not None else float("nan")
        # ZeRO skips the update when the global gradient norm is NaN or infinite (its overflow
        # check, agreed on by every rank): weights, optimizer and schedule stay as they were.
        return getattr(self.ds, "_step_applied", True) and math.isfinite(norm), norm

    def lr(self) -> float:
        return self.scheduler.get_last_lr()[0]

    def gathered(self, params: Iterable[torch.nn.Parameter]):
        import deepspeed

        return deepspeed.zero.GatheredParameters(list(params), modifier_rank=None)

    def state_files(self, path: str, tag: str) -> list[str]:
        try:  # DeepSpeed's own naming, so it stays in step with it
            return [self.ds._get_ckpt_name(path, tag), self.ds._get_zero_ckpt_name(path, tag)]
        except AttributeError:
            return [os.path.join(path, tag)]

    def save(self, path: str, tag: str, client_state: dict, exclude_frozen: bool) -> None:
        self.ds.save_checkpoint(
            path, tag=tag, client_state=client_state, exclude_frozen_parameters=exclude_frozen
        )

    def load(self, path: str, tag: str | None, strict: bool) -> dict | None:
        load_path, client = self.ds.load_checkpoint(path, tag=tag, load_module_strict=strict)
        return client if load_path is not None else None
