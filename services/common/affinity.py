"""Which replica a key goes to: highest random weight (rendezvous) hashing, so a key keeps its
replica while that replica serves, and only the keys of a replica that leaves move. A stable
hash, the same in every process: a multi-turn episode's calls find their prefix in one replica's
cache whichever process sends them (the coordinator, or the gateway for a black-box agent)."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable


def ranked(key: str, names: Iterable[str]) -> list[str]:
    """``names`` in the order ``key`` prefers them: the first is its replica, the next the one it
    moves to when the first is gone.

    >>> ranked("e1", ["gen-0", "gen-1", "gen-2"]) == ranked("e1", ["gen-2", "gen-1", "gen-0"])
    True
    >>> len({ranked(f"e{i}", ["gen-0", "gen-1", "gen-2"])[0] for i in range(50)})
    3
    """

    def weight(name: str) -> bytes:
        return hashlib.blake2b(f"{key}\0{name}".encode(), digest_size=8).digest()

    return sorted(names, key=weight, reverse=True)
