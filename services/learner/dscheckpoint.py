"""A one-rank DeepSpeed checkpoint read as a plain engine's state: what every learner wrote before
the plain engine became the one-rank default (ZeRO-2, and stage 0 for a frozen reference), so a
run resumes across the change.

DeepSpeed's ZeRO-1/2 optimizer keeps its float32 master weights and Adam moments as one flat
tensor per parameter group, parameters end to end in the order the model file's ``param_shapes``
lists them (padding at the end, cut off here). Split back by those shapes, they become per-parameter
master weights and AdamW state, keyed by the parameters' names, so the order of the plain
engine's own parameters does not matter. Checkpoints of several ranks (partitions to stitch) or
of ZeRO-3 are refused with what to do instead.
"""

from __future__ import annotations

from pathlib import Path

import torch

MODEL_FILE = "mp_rank_00_model_states.pt"
OPTIM_FILES = ("zero_pp_rank_0_mp_rank_00_optim_states.pt", "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt")
DS_KEYS = frozenset(
    {
        "module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
        "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd", "skipped_steps",
        "global_steps", "global_samples", "dp_world_size", "mp_world_size", "ds_config", "ds_version",
        "checkpoint_parallel_dimensions", "universal_checkpoint_info",
    }
)  # fmt: skip
"""DeepSpeed's own entries of a model file; everything else is the caller's client state."""


def read(
    folder: Path,
    module: torch.nn.Module,
    params: list[torch.nn.Parameter],
    optimizer: torch.optim.Optimizer | None,
) -> dict | None:
    """The checkpoint in ``folder`` as ``PlainEngine`` state (``module``, ``master``,
    ``optimizer``, ``scheduler``, ``client_state``), or None when ``folder`` holds none.
    ``params`` and ``optimizer``: the plain engine's (None for a frozen model)."""
    model_file = folder / MODEL_FILE
    if not model_file.exists():
        return None
    sd = torch.load(model_file, map_location="cpu", weights_only=False)
    ranks = sd.get("dp_world_size", 1)
    if ranks != 1:
        raise ValueError(
            f"{folder} was saved by {ranks} DeepSpeed ranks: load it with learner.world_size {ranks} "
            "(or consolidate it with DeepSpeed's zero_to_fp32 and start from the folder it writes)"
        )
    state = {
        "module": sd["module"],
        "master": None,
        "optimizer": None,
        "scheduler": sd.get("lr_scheduler"),
        "client_state": {k: v for k, v in sd.items() if k not in DS_KEYS},
    }
    if optimizer is None:
        return state
    optim_file = next((folder / f for f in OPTIM_FILES if (folder / f).exists()), None)
    if optim_file is None or not sd.get("param_shapes"):
        raise ValueError(f"{folder} holds no ZeRO-1/2 optimizer state to resume training from")
    osd = torch.load(optim_file, map_location="cpu", weights_only=False)["optimizer_state_dict"]
    if "single_partition_of_fp32_groups" not in osd:
        raise ValueError(
            f"{optim_file.name}: not a ZeRO-1/2 optimizer state (ZeRO-3 needs learner.zero_stage 3)"
        )
    base = osd["base_optimizer_state"]
    if isinstance(base, dict):  # torch's state_dict of the flat groups
        moments = [base["state"].get(i, {}) for i in range(len(base["param_groups"]))]
        hyper = base["param_groups"]
    else:  # elastic: one state per group
        moments, hyper = list(base), [{}] * len(base)
    by_name: dict[str, tuple[torch.Tensor, dict]] = {}
    for g, (flat, shapes) in enumerate(
        zip(osd["single_partition_of_fp32_groups"], sd["param_shapes"], strict=True)
    ):
        offset = 0
        for name, shape in shapes.items():
            n = torch.Size(shape).numel()
            part = {
                k: v.reshape(-1)[offset : offset + n].view(shape).clone()
                for k, v in moments[g].items()
                if _flat(v)
            }
            # One step tensor each: AdamW adds 1 to every parameter's in place (shared, one
            # tensor would count the step once per parameter).
            part["step"] = torch.as_tensor(moments[g].get("step", 0.0), dtype=torch.float32).clone()
            by_name[name] = (flat[offset : offset + n].view(shape).clone(), part)
            offset += n
    names = {id(p): n for n, p in module.named_parameters()}
    missing = [names[id(p)] for p in params if names[id(p)] not in by_name]
    if missing:
        raise ValueError(f"{optim_file.name} holds no optimizer state for {', '.join(missing[:5])}")
    ours = optimizer.state_dict()
    ours["state"] = {i: by_name[names[id(p)]][1] for i, p in enumerate(params)}
    for group, saved in zip(ours["param_groups"], hyper, strict=False):
        group.update({k: v for k, v in saved.items() if k != "params"})
    state["master"] = [by_name[names[id(p)]][0] for p in params]
    state["optimizer"] = ours
    return state


def _flat(v: object) -> bool:
    return torch.is_tensor(v) and v.dim() > 0
