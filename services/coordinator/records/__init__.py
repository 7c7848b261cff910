"""What a run leaves behind: its folder (``runfolder.py``: the resolved config, checkpoints and
per-step records, created once and read back on resume), the trackers a user asked for
(``trackers.py``: TensorBoard, W&B), what a person sees (``progress.py``: the progress bar and the
reward curve). The coordinator's Prometheus metrics stay in its top-level ``metrics.py``, where
every service keeps its own. They import nothing of the coordinator but its config."""
