"""The per-job secrets of a Slurm run: removed when the job ends for good, kept over a requeue.

``deploy/slurm/relayrl.sbatch`` makes a CA, a certificate naming the job's nodes and a token for
one job (on several nodes, where the experiment brings none) in ``<submit folder>/.relayrl-slurm/
<job id>/``, then ``exec``s ``relayrl launch slurm``: no shell is left to run a trap, and an
epilog is the cluster's, not the job's. So the launcher, the job's batch step, removes them:

- when its run ends, however (``services.job``'s ``finally``): unless the job is being requeued, which
  Slurm tells by a restart count above the one this run started with (``scontrol requeue``,
  preemption: the count is raised before the batch step is signalled). The requeued job runs the
  script again, which finds the folder and keeps it (or makes a new set on other nodes);
- at its start, the folders of this submit folder's jobs that Slurm reports ended, or no longer
  knows: what a batch step killed outright (SIGKILL past KillWait, a failed node) left behind.

Only ``.relayrl-slurm/<job id>`` folders are touched, never a ``RELAYRL_SLURM_SECRETS`` the user
set; any doubt (Slurm not answering, a state that may still requeue) keeps a folder.
"""

from __future__ import annotations

import logging
import re
import shutil
import subprocess
from pathlib import Path

logger = logging.getLogger(__name__)
FOLDER = ".relayrl-slurm"
"""Where ``relayrl.sbatch`` makes a job's secrets, in the submit folder: ``FOLDER/<job id>``."""
ENDED = frozenset({"COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"})
"""Job states after which a job never runs again (NODE_FAIL and PREEMPTED may requeue it)."""
MAX_SWEEP = 256
"""Most leftover folders one start looks at (one ``squeue`` call)."""


def secrets_dir(submit_dir: str | Path, job_id: str) -> Path:
    return Path(submit_dir) / FOLDER / job_id


def forget(submit_dir: str | Path, job_id: str, restarts: int) -> bool:
    """At the end of a job's run (its ``SLURM_RESTART_COUNT`` is ``restarts``): remove its
    secrets unless it is being requeued. True when they are gone."""
    path = secrets_dir(submit_dir, job_id)
    if not path.exists() and not path.is_symlink():
        return True
    now = _slurm(["scontrol", "show", "job", job_id])
    m = re.search(r"\bRestarts=(\d+)", now.stdout if now else "")
    if m is None:
        logger.warning(
            "job %s: Slurm did not say whether it is requeued; its secrets stay in %s", job_id, path
        )
        return False
    if int(m.group(1)) > restarts:
        logger.info("job %s is requeued: its secrets stay for the next run (%s)", job_id, path)
        return False
    return _remove(path)


def sweep(submit_dir: str | Path, job_id: str) -> list[str]:
    """Remove the secrets of this submit folder's other jobs that have ended (Slurm reports a
    final state or no longer knows the job). Returns the job ids whose secrets went."""
    root = Path(submit_dir) / FOLDER
    try:
        ids = sorted(p.name for p in root.iterdir() if p.name.isdigit() and p.name != job_id)[:MAX_SWEEP]
    except OSError:  # no folder: no secrets were ever made here
        return []
    if not ids:
        return []
    got = _slurm(["squeue", "-h", "--states=all", "--jobs", ",".join(ids), "-o", "%A %T"])
    if got is None:
        return []
    if got.returncode:  # every id unknown ("Invalid job id specified"), or Slurm not answering
        if "invalid job id" not in got.stderr.lower():
            logger.warning("squeue: %s: leftover job secrets stay", got.stderr.strip()[:300])
            return []
        known: dict[str, str] = {}
    else:
        known = dict(line.split(None, 1) for line in got.stdout.splitlines() if len(line.split()) == 2)
    ended = [i for i in ids if i not in known or known[i].strip() in ENDED]
    return [i for i in ended if _remove(root / i)]


def _remove(path: Path) -> bool:
    try:
        if path.is_symlink() or not path.is_dir():
            path.unlink()
        else:
            shutil.rmtree(path)
    except OSError as e:
        logger.warning("job secrets not removed: %s", e)
        return False
    logger.info("job secrets removed: %s", path)
    return True


def _slurm(cmd: list[str]) -> subprocess.CompletedProcess | None:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        logger.warning("%s: %r", cmd[0], e)
        return None
