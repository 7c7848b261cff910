"""A learner's DeepSpeed configuration: the ZeRO stage each of its models runs at, the config
dict handed to ``deepspeed.initialize`` (and to transformers, so ``from_pretrained`` partitions at
ZeRO-3), and the learning-rate schedule."""

from __future__ import annotations

import math

from relayrl.learner.config import ONE_RANK_STAGE, LearnerConfig


def zero_stage(cfg: LearnerConfig, frozen: bool = False) -> int:
    """The ZeRO stage a model of this learner runs at (``zero_stage``; see its docstring); 0 is
    no DeepSpeed (``engines.PlainEngine``). ``frozen``: a model without an optimizer (ZeRO-1 and 2
    partition optimizer state only: nothing of it at one rank).

    >>> zero_stage(LearnerConfig(world_size=2)), zero_stage(LearnerConfig()), zero_stage(LearnerConfig(), True)
    (3, 0, 0)
    >>> zero_stage(LearnerConfig(zero_stage=2)), zero_stage(LearnerConfig(zero_stage=2), True)
    (2, 0)
    """
    if cfg.world_size > 1:
        return 3 if frozen else (cfg.zero_stage or 3)
    if frozen:
        return 0
    return ONE_RANK_STAGE if cfg.zero_stage is None else cfg.zero_stage


def ds_config(cfg: LearnerConfig, hidden_size: int, stage: int, cuda: bool) -> dict:
    # Communication buckets sized to the model, as the HF integration's "auto" does: DeepSpeed's
    # defaults (5e8 elements for reduction) are sized for billions of parameters and hold memory
    # a smaller model never needs.
    bucket = hidden_size * hidden_size
    persist = cfg.param_persistence_threshold
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,  # accumulation is driven by hand (see train_step)
        "gradient_clipping": cfg.optim.grad_clip,
        "zero_optimization": {
            "stage": stage,
            "stage3_param_persistence_threshold": 10 * hidden_size if persist is None else persist,
            "stage3_gather_16bit_weights_on_model_save": True,
            "overlap_comm": cuda if cfg.overlap_comm is None else cfg.overlap_comm,
            "reduce_bucket_size": bucket,
            "allgather_bucket_size": bucket,
            "stage3_prefetch_bucket_size": int(0.9 * bucket),
        },
        "bf16": {"enabled": cfg.dtype == "bfloat16"},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1 << 62,
        "wall_clock_breakdown": False,
    }


def lr_lambda(cfg: LearnerConfig):
    o = cfg.optim

    def f(step: int) -> float:
        if o.warmup_steps and step < o.warmup_steps:
            return (step + 1) / o.warmup_steps
        if o.schedule == "constant":
            return 1.0
        progress = min(1.0, (step - o.warmup_steps) / max(1, o.total_steps - o.warmup_steps))
        if o.schedule == "linear":
            return 1.0 - progress
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    return f
