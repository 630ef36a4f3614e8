"""The engine replicas Serve offers and those it stopped offering, as this process's
routers last saw them.

Serve stops offering a replica the moment it starts stopping it (a scale-in, a redeploy)
or finds it dead; the routers hear it in `update_replicas` and record it here
(`offered`). The ingress reads `left_at` to hand a stopping replica's streams to others
once its short drain is over (`migration.py`), and `any_offered` to know that a request
not yet admitted waits for a running replica's room, not for a replica to exist.
Routers may run on a loop of their own, in another thread: the record is behind a lock.
Departures older than `_KEEP_S` are dropped.
"""

from __future__ import annotations

import threading
import time

_KEEP_S = 3600.0

_lock = threading.Lock()
_offered: set[str] = set()
_left: dict[str, float] = {}  # replica -> when it stopped being offered (monotonic)


def offered(live: set[str]) -> None:
    """The replicas a router offers now; those it offered before and not now have left."""
    now = time.monotonic()
    with _lock:
        for gone in _offered - live:
            _left.setdefault(gone, now)
        _offered.clear()
        _offered.update(live)
        for replica in [r for r, t in _left.items() if now - t > _KEEP_S or r in live]:
            del _left[replica]


def any_offered() -> bool:
    """Whether a router offers at least one replica now."""
    with _lock:
        return bool(_offered)


def left_at(replica: str) -> float | None:
    """When `replica` stopped being offered (`time.monotonic()`), or None while it is."""
    with _lock:
        return _left.get(replica)
