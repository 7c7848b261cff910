"""A reward plugin whose module stops importing once the file named by ``RELAYRL_TEST_BREAK``
exists: scoring workers start while it is absent, and no replacement can start after it appears
(a plugin broken on disk under a running replica)."""

from __future__ import annotations

import os

if os.path.exists(os.environ.get("RELAYRL_TEST_BREAK", "/nonexistent")):
    raise ImportError("this plugin was broken on purpose (RELAYRL_TEST_BREAK exists)")


def length(completion, ground_truth, extra_info):
    return float(len(completion))


length.data_sources = ["test/fragile-length"]
