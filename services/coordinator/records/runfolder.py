"""Run folders: ``<runs_dir>/<run id>`` with the resolved ``config.yaml``, ``checkpoints/`` and
``metrics.jsonl`` (one record per step), created once and read back on resume."""

from __future__ import annotations

import json
import time
from pathlib import Path

from relayrl.common import config as cfg_mod
from relayrl.common.data.dataset import atomic_write
from relayrl.coordinator.config import ExperimentConfig


def new_run_dir(cfg: ExperimentConfig, run_id: str = "") -> Path:
    """A new run folder: ``<runs_dir>/<run_id>``, or ``<name>-<timestamp>`` with a suffix when
    that exists (runs started in the same second). FileExistsError for a taken ``run_id``."""
    runs = Path(cfg.runs_dir)
    runs.mkdir(parents=True, exist_ok=True)
    stamp = f"{cfg.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    names = [run_id] if run_id else [stamp, *(f"{stamp}-{i}" for i in range(2, 10_000))]
    for name in names:
        try:
            (runs / name).mkdir()  # atomic: of two runs asking for one name, one gets it
        except FileExistsError:
            if run_id:
                raise
            continue
        run = runs / name
        (run / "checkpoints").mkdir()
        (run / "config.yaml").write_text(cfg_mod.dump_yaml(cfg))
        return run
    raise FileExistsError(f"no free run folder name under {runs} for {stamp}")


def load_records(run_dir: Path, name: str = "metrics.jsonl") -> list[dict]:
    """The records of ``run_dir/name``, one JSON object a line. A last line cut short (the run
    was killed while appending it: no newline, not JSON) is left out; any other line that does
    not parse is damage a person must look at: ValueError naming the file and line.

    >>> import tempfile; d = Path(tempfile.mkdtemp())
    >>> _ = (d / "metrics.jsonl").write_text('{"step": 1}\\n{"step": 2, "rew')
    >>> load_records(d)
    [{'step': 1}]
    """
    path = run_dir / name
    if not path.exists():
        return []
    text = path.read_text()
    lines = text.splitlines()
    out = []
    for i, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError as e:
            if i == len(lines) and not text.endswith("\n"):
                break  # torn by a kill mid-append: that step is done again after the resume
            raise ValueError(f"{path}: line {i} is not a JSON record ({e})") from None
    return out


def rewind_records(run_dir: Path, step: int, name: str = "metrics.jsonl") -> list[dict]:
    """The records of ``run_dir/name`` (``metrics.jsonl``, ``ledger.jsonl``) up to ``step`` (the
    checkpoint a resume starts from). A run that went on past its last checkpoint before it
    stopped (a crash) recorded steps that the resume does again: those move to
    ``<name>.rewound.jsonl`` (appended, nothing is lost), so the file and the curves hold each
    step once, from the run that continued.

    >>> import tempfile; d = Path(tempfile.mkdtemp())
    >>> _ = (d / "metrics.jsonl").write_text("".join(json.dumps({"step": i}) + "\\n" for i in range(4)))
    >>> [r["step"] for r in rewind_records(d, 2)], [r["step"] for r in load_records(d)]
    ([0, 1, 2], [0, 1, 2])
    >>> (d / "metrics.rewound.jsonl").read_text()
    '{"step": 3}\\n'
    """
    records = load_records(run_dir, name)
    kept = [r for r in records if r.get("step", 0) <= step]
    later = [r for r in records if r.get("step", 0) > step]
    path = run_dir / name
    torn = path.exists() and not path.read_text().endswith("\n") and path.stat().st_size > 0
    if later or torn:  # a torn last line goes too: the next append would glue onto it
        # A crash between the append and the replace leaves them in both files: not twice here.
        rewound = run_dir / name.replace(".jsonl", ".rewound.jsonl")
        known = {(r.get("step"), r.get("time")) for r in load_records(run_dir, rewound.name)}
        with open(rewound, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in later if (r.get("step"), r.get("time")) not in known)
        text = "".join(json.dumps(r) + "\n" for r in kept)
        atomic_write(path, lambda tmp: tmp.write_text(text))  # one file or the other
    return kept
