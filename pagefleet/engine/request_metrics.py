"""Per-request timing, the source of a server's latency histograms."""

from __future__ import annotations

import msgspec


class RequestMetrics(msgspec.Struct, array_like=True):
    """When one request reached each milestone, in `time.monotonic()` seconds.

    None until the milestone is reached. A server derives vLLM's histograms
    from these: queue time (first_scheduled - arrival), time to first token
    (first_token - arrival), inter-token latency (differences of successive
    last_token values), end-to-end latency (finished - arrival). Each
    RequestOutput carries its own copy, so a value a caller holds never moves.
    A Struct encoded as an array: every delta of the engine core carries one.
    """

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None

    def copy(self) -> RequestMetrics:
        """A copy of its own (spelled out: this runs per request per step)."""
        return RequestMetrics(
            self.arrival_time,
            self.first_scheduled_time,
            self.first_token_time,
            self.last_token_time,
            self.finished_time,
        )

    @property
    def queue_time(self) -> float | None:
        return _since(self.arrival_time, self.first_scheduled_time)

    @property
    def time_to_first_token(self) -> float | None:
        return _since(self.arrival_time, self.first_token_time)

    @property
    def e2e_latency(self) -> float | None:
        return _since(self.arrival_time, self.finished_time)


def _since(start: float, end: float | None) -> float | None:
    return None if end is None else end - start
