"""Root pytest hooks.

Doctests run only from modules that have some: importing every module under services/ a second
time (as ``services.x`` beside ``relayrl.x``) would register Prometheus metrics twice. Helper
modules under tests/ (process launchers, plugins, scripts run under torchrun) are imported by
tests, never collected themselves.
"""

from pathlib import Path


def pytest_ignore_collect(collection_path: Path, config):
    if collection_path.suffix != ".py" or not collection_path.is_file():
        return None
    if "services" in collection_path.parts:
        return ">>>" not in collection_path.read_text(errors="ignore")
    if "tests" in collection_path.parts:
        return not collection_path.name.startswith(("test_", "conftest"))
    return None
