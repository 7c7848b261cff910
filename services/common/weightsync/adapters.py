"""LoRA adapters as weight pushes carry them: PEFT's tensor names and shapes, checked before any
byte is loaded, and the folder an adapter is written to (what vLLM's LoRA API and PEFT read).

A push of an adapter (``UpdateWeightsRequest.lora``) carries only the ``lora_A`` / ``lora_B``
tensors, under the names PEFT saves them with (``adapter_model.safetensors``), so the folder a
replica writes from them is exactly the folder ``ExportModel`` writes: loading either gives the
same adapter. Shared by the learner (what it sends and exports) and the generator (what it
takes), so neither knows the other.

A replica checks a push against its base model before any byte arrives (``adapter_problems``):
each tensor must adapt a linear layer the model has (``adapter_layers``: the checkpoint's 2-D
``<module>.weight``, [out, in]) with exactly lora_A [rank, in] and lora_B [out, rank]. vLLM
does not: it zero-pads a smaller tensor into its LoRA buffers and serves it, and skips tensors
for modules the model lacks.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from relayrl.common.weightsync.plan import TensorMeta

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
MAX_TARGETS = 64
MAX_ADAPTER_TENSORS = 100_000
MAX_SHOWN = 10  # problems a refusal lists (then "and N more"): an answer stays small
_NAME = re.compile(r"base_model\.model\.((?:[A-Za-z0-9_]+\.)*([A-Za-z0-9_]+))\.lora_([AB])\.weight")
_FLOAT = {"float32", "bfloat16", "float16"}


@dataclass(frozen=True)
class AdapterSpec:
    """An adapter's shape (PEFT's LoraConfig, the proto's ``LoraAdapter``)."""

    rank: int
    alpha: float
    target_modules: tuple[str, ...] = field(default_factory=tuple)

    def problem(self) -> str:
        """Why this is no adapter a replica can take, or "".

        >>> AdapterSpec(16, 32.0, ("q_proj",)).problem(), AdapterSpec(0, 1.0, ("q",)).problem()
        ('', 'lora.rank must be 1 to 512')
        """
        if not 1 <= self.rank <= 512:
            return "lora.rank must be 1 to 512"
        if not (math.isfinite(self.alpha) and self.alpha > 0):
            return "lora.alpha must be finite and positive"
        if not 1 <= len(self.target_modules) <= MAX_TARGETS:
            return f"lora.target_modules must name 1 to {MAX_TARGETS} modules"
        if any(not re.fullmatch(r"[A-Za-z0-9_.\-]{1,128}", t) for t in self.target_modules):
            return "lora.target_modules: each is 1 to 128 letters, digits, '_', '-' or '.'"
        return ""

    def config_json(self, base_model: str = "") -> str:
        """The ``adapter_config.json`` PEFT writes for this adapter (what vLLM and PEFT read)."""
        return json.dumps(
            {
                "peft_type": "LORA",
                "task_type": "CAUSAL_LM",
                "base_model_name_or_path": base_model,
                "r": self.rank,
                "lora_alpha": self.alpha,
                "lora_dropout": 0.0,
                "target_modules": sorted(self.target_modules),
                "bias": "none",
                "fan_in_fan_out": False,
                "inference_mode": True,
                "modules_to_save": None,
                "use_rslora": False,
                "use_dora": False,
            },
            indent=2,
        )


def adapter_layers(shapes: Mapping[str, Sequence[int]]) -> dict[str, tuple[int, int]]:
    """The layers of a model an adapter may adapt, from its checkpoint's tensor shapes (name ->
    shape, as its safetensors headers give them): each 2-D ``<module>.weight`` as module ->
    (out_features, in_features). Read from the model folder, so the same on every device and
    tensor-parallel size (an adapter holds full, unsharded tensors: vLLM shards them itself).

    >>> adapter_layers({"model.layers.0.mlp.up_proj.weight": (512, 256), "model.norm.weight": (256,)})
    {'model.layers.0.mlp.up_proj': (512, 256)}
    """
    return {
        name.removesuffix(".weight"): (shape[0], shape[1])
        for name, shape in shapes.items()
        if name.endswith(".weight") and len(shape) == 2
    }


def adapter_problems(
    spec: AdapterSpec, metas: list[TensorMeta], layers: Mapping[str, tuple[int, int]]
) -> list[str]:
    """What keeps ``metas`` from being ``spec``'s adapter tensors for a model with ``layers``
    (``adapter_layers``), or nothing: PEFT's names of a target module the model has, in pairs,
    lora_A exactly [rank, in] and lora_B exactly [out, rank] of that layer, float dtypes. Each
    problem names its tensor (its first 200 characters: a name a caller sent is not echoed whole).

    >>> q = "base_model.model.m.up_proj.lora_{}.weight"
    >>> A, B = TensorMeta(q.format("A"), "float32", (8, 64)), TensorMeta(q.format("B"), "float32", (32, 8))
    >>> layers = {"m.up_proj": (32, 64)}
    >>> adapter_problems(AdapterSpec(8, 16.0, ("up_proj",)), [A, B], layers)
    []
    >>> for p in adapter_problems(AdapterSpec(8, 16.0, ("v_proj",)), [A], {}):
    ...     print(p)
    base_model.model.m.up_proj.lora_A.weight: up_proj is not a target module
    base_model.model.m.up_proj.lora_A.weight: the model has no layer m.up_proj
    m.up_proj: lora_A without lora_B
    >>> small = TensorMeta(q.format("B"), "float32", (16, 8))
    >>> print(*adapter_problems(AdapterSpec(8, 16.0, ("up_proj",)), [A, small], layers))
    base_model.model.m.up_proj.lora_B.weight: shape [16, 8], the layer takes [32, 8] (lora_B [out, rank])
    """
    if len(metas) > MAX_ADAPTER_TENSORS:
        return [f"{len(metas)} tensors: an adapter has at most {MAX_ADAPTER_TENSORS}"]
    out, halves = [], {}
    for m in metas:
        name = m.name[:200]
        got = _NAME.fullmatch(m.name)
        if got is None:
            out.append(f"{name}: not a LoRA tensor name (base_model.model.<module>.lora_A|B.weight)")
            continue
        module, leaf, half = got.groups()
        if leaf not in spec.target_modules:
            out.append(f"{name}: {leaf[:128]} is not a target module")
        if m.dtype not in _FLOAT:
            out.append(f"{name}: dtype {m.dtype}, not a float ({', '.join(sorted(_FLOAT))})")
        if module not in layers:
            out.append(f"{name}: the model has no layer {module[:200]}")
        else:
            features_out, features_in = layers[module]
            want = (spec.rank, features_in) if half == "A" else (features_out, spec.rank)
            if tuple(m.shape) != want:
                which = "lora_A [rank, in]" if half == "A" else "lora_B [out, rank]"
                shape = list(m.shape) if len(m.shape) <= 4 else f"of {len(m.shape)} dimensions"
                out.append(f"{name}: shape {shape}, the layer takes {list(want)} ({which})")
        if (module, half) in halves:
            out.append(f"{name}: sent twice")
        halves[(module, half)] = m
    for module, half in sorted(halves):
        other = "B" if half == "A" else "A"
        if (module, other) not in halves:
            out.append(f"{module[:200]}: lora_{half} without lora_{other}")
    return out


def summary(problems: list[str]) -> str:
    """``problems`` in one bounded line: the first ``MAX_SHOWN``, then how many more.

    >>> summary(["a: bad"] * 12)
    'a: bad; a: bad; a: bad; a: bad; a: bad; a: bad; a: bad; a: bad; a: bad; a: bad; and 2 more'
    """
    more = len(problems) - MAX_SHOWN
    return "; ".join(problems[:MAX_SHOWN] + ([f"and {more} more"] if more > 0 else []))


def write_adapter(folder: str | Path, spec: AdapterSpec, tensors: dict, base_model: str = "") -> Path:
    """Write an adapter folder (``adapter_config.json``, ``adapter_model.safetensors``), whole
    or not at all: it is written beside ``folder`` and renamed into place."""
    from safetensors.torch import save_file

    folder = Path(folder)
    tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
    try:
        tmp.mkdir(parents=True, exist_ok=True)
        (tmp / ADAPTER_CONFIG).write_text(spec.config_json(base_model))
        save_file(
            {k: v.contiguous() for k, v in tensors.items()},
            str(tmp / ADAPTER_WEIGHTS),
            metadata={"format": "pt"},
        )
        if folder.exists():
            shutil.rmtree(folder)
        tmp.rename(folder)
    except BaseException:  # a full disk: no half-written folder stays behind
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return folder
