"""Data kit: task generators (countdown, arithmetic, reverse) and the verl-schema loader."""
