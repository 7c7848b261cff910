"""What leaves a learner as files: the policy exported as a Hugging Face folder (or a LoRA
adapter's folder, or the merged model), and the check that a folder can be written before any
rank starts a collective that writes it."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from relayrl.common.weightsync.adapters import write_adapter
from relayrl.common.weightsync.buckets import dtype_name
from relayrl.common.weightsync.plan import plan_buckets
from relayrl.learner import lora


def export_policy(trainer, out: Path, bucket_bytes: int, adapter: bool = False) -> None:
    """Write ``trainer``'s current policy as a Hugging Face folder: all ranks gather, rank 0
    writes (beside ``out``, then renamed into place). With LoRA: the merged model (the base with
    the adapter folded in), or with ``adapter`` PEFT's adapter folder."""
    from safetensors.torch import save_file

    params = trainer.pushed
    if trainer.peft is not None and not adapter:  # merged: the base weights too
        params = {**lora.base_params(trainer.lm), **trainer.pushed}
    buckets = plan_buckets(trainer.param_metas(dtype_name(trainer.dtype), params), bucket_bytes)
    state: dict[str, torch.Tensor] = {}
    for b, tensors in zip(buckets, trainer.gathered_buckets(buckets, params), strict=True):
        if tensors is not None:
            state.update({m.name: t.cpu().clone() for m, t in zip(b.tensors, tensors, strict=True)})
    if trainer.rank != 0:
        return
    meta = json.dumps({"step": trainer.step, "policy_version": trainer.version}) + "\n"
    if trainer.peft is not None:
        s = lora.spec(trainer.cfg.lora)
        if adapter:
            write_adapter(out, s, state, base_model=trainer.cfg.model)
            (out / "relayrl_export.json").write_text(meta)
            return
        state = lora.merged({n: state[n] for n in lora.base_params(trainer.lm)}, state, s)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    src = Path(trainer.cfg.model)
    for f in src.iterdir():  # tokenizer, generation config, model card: everything but weights
        if f.is_file() and not f.name.endswith((".safetensors", ".bin", ".safetensors.index.json", ".pt")):
            shutil.copy2(f, tmp / f.name)
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / "relayrl_export.json").write_text(meta)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)


def writable_problem(target: Path) -> str:
    """Why ``target`` (a folder that may not exist yet) could not be created and written, or "".
    Looks, creates nothing: a refused request leaves no trace.

    >>> writable_problem(Path("/dev/null/x"))
    '/dev/null is not a folder'
    """
    p = target
    while not os.path.lexists(p) and p != p.parent:
        p = p.parent
    if not p.is_dir():
        return f"{p} is not a folder"
    if not os.access(p, os.W_OK | os.X_OK):
        return f"{p} is not writable"
    return ""
