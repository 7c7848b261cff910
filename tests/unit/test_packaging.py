"""Install layout: one import root, light imports, a fast CLI."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "vllm", "deepspeed", "transformers")


def test_every_package_folder_is_listed_in_pyproject():
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {
        ".".join(("relayrl", *p.parent.relative_to(ROOT / "services").parts))
        for p in (ROOT / "services").rglob("__init__.py")
        if "__pycache__" not in p.parts
    }
    assert found == listed, f"missing from pyproject: {found - listed}; stale there: {listed - found}"


def _modules_after(code: str) -> set[str]:
    out = subprocess.run(
        [sys.executable, "-c", code + "\nimport sys; print(' '.join(sys.modules))"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return set(out.split())


def test_configs_and_cli_parser_import_no_heavy_package():
    mods = _modules_after(
        "import relayrl.coordinator.config, relayrl.generator.config, relayrl.learner.config, "
        "relayrl.reward.config\nfrom relayrl.cli import build_parser; build_parser()"
    )
    assert not {m for m in mods if m.split(".")[0] in HEAVY}


def test_cli_help_answers_fast():
    import time

    t0 = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-m", "relayrl.cli", "--help"], capture_output=True, text=True, check=True
    )
    elapsed = time.monotonic() - t0
    for cmd in ("model", "data"):
        assert cmd in out.stdout
    # About a second on a loaded 2-core machine; the heavy imports alone would take 5-10 s.
    assert elapsed < 3.0, f"relayrl --help took {elapsed:.1f}s"


def test_console_script_installed():
    exe = Path(sys.executable).parent / "relayrl"
    assert exe.exists(), "the relayrl console script is missing: pip install -e '.[cpu,dev]'"
