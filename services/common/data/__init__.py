"""Data kit: task generators (``tasks.TASKS``, the registry of task names) and the verl-schema
loader."""
