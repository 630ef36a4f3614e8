"""Each replica's prefill backlog now, from its last report, the rate it computes prompts
and what this router sent it since: the router's `backlog(r)` (`routing.policy`).

A replica reports its backlog (prompt tokens it has still to compute,
`EngineStats.num_prefill_tokens`) once per stats period; between reports the router models
it as a queue fed by its own sends and drained at the replica's rate (docs/routing.md,
"The prefill drain", says why).

Model. A replica is a queue that computes `rate` prompt tokens a second. From its report
(backlog Q at time t), each prompt sent to it since, in the order sent (at t_i, with q_i
tokens to compute there), does

    Q <- max(0, Q - rate * (t_i - t)) + q_i;   t <- t_i

(Lindley's recursion for a queue's content), and the backlog now is
max(0, Q - rate * (now - t)). Sends the report may already include (sent less than
`stats_include_slack_s` before it) count too: a little over, as before.

Rate. The replica reports the prompt tokens it has computed in all
(`EngineStats.prompt_tokens_total`, a counter); between two reports it computed
`delta` tokens in `dt` seconds. That is its capacity only if it had prompts to compute the
whole time, which the router cannot tell, so the rate is the highest such throughput over
the last `window` intervals: what the replica has lately shown it can do, at most its
capacity. A replica idle most of the time shows a low rate, so what is sent to it drains
slowly in the model: the error is on the side the router took before (counting a sent
prompt until a report includes it), and such a replica's backlog is small anyway. A
loaded one shows its capacity. No two reports yet (a new replica, or a counter that went
back: a restarted one): rate 0, nothing drains, the old count.

Several routers (one per ingress replica) each see only their own sends, but the rate is
the replica's whole throughput, so each drains its own sends a little fast; the reported
backlog, which carries everyone's, corrects it every period.

Cost. The model is cached per replica on the report it started from: a send updates it
in O(1) (`sent`); a new report or a send leaving early (a completion, a withdrawal:
`changed`) makes the next read replay the replica's sends since its report, once.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field


@dataclass(slots=True)
class _Replica:
    # The last report observed: its time, the counter, the rate samples (tokens/s).
    report_time: float | None = None
    computed: int = 0
    samples: deque[float] = field(default_factory=deque)
    rate: float = 0.0  # max(samples): read on every choice, changed only by a report
    # The model's state, valid for `base` (report time, reported backlog; None: stale):
    # the backlog `queue` right after the send at `queue_time`.
    base: tuple[float | None, int] | None = None
    queue: float = 0.0
    queue_time: float | None = None  # None: no report and no send yet, nothing to drain


@dataclass
class PrefillDrain:
    """Per replica: its prefill rate from its reports (`observe`), and its backlog now
    (`backlog`) under the module's model."""

    _replicas: dict[str, _Replica] = field(default_factory=dict)

    def observe(self, replica_id: str, report_time: float, computed: int, window: int) -> None:
        """A report: its time and the replica's prompt tokens computed in all. A report
        seen before changes nothing; `window` 0 keeps no rate (nothing drains)."""
        r = self._replicas.setdefault(replica_id, _Replica())
        if r.report_time == report_time:
            return
        if r.report_time is not None and report_time > r.report_time and computed >= r.computed:
            r.samples.append((computed - r.computed) / (report_time - r.report_time))
        elif r.report_time is not None:
            r.samples.clear()  # the counter went back (a restart) or the clock did
        while len(r.samples) > window:
            r.samples.popleft()
        r.rate = max(r.samples, default=0.0)
        r.report_time, r.computed = report_time, computed
        r.base = None

    def rate(self, replica_id: str) -> float:
        """Prompt tokens a second the replica computes, as far as its reports show."""
        r = self._replicas.get(replica_id)
        return r.rate if r is not None else 0.0

    def sent(self, replica_id: str, tokens: int, now: float) -> None:
        """A prompt with `tokens` to compute was sent to the replica at `now` (its entry is
        among those `backlog` replays from then on)."""
        r = self._replicas.get(replica_id)
        if r is None or r.base is None:
            return  # no model cached: the next read replays the sends, this one with them
        r.queue = self._drained(r, now) + tokens
        r.queue_time = now if r.queue_time is None else max(r.queue_time, now)

    def changed(self, replica_id: str) -> None:
        """A send to the replica left before a report included it: replay on next read."""
        r = self._replicas.get(replica_id)
        if r is not None:
            r.base = None

    def backlog(
        self,
        replica_id: str,
        report_time: float | None,
        reported: int,
        sends: Callable[[], Iterable[tuple[float, int]]],
        now: float,
    ) -> int:
        """Prompt tokens the replica has still to compute at `now`: `reported` at
        `report_time` (None: no report, nothing), drained, plus `sends()` (time sent,
        tokens to compute there; every send since the report, oldest first)."""
        r = self._replicas.setdefault(replica_id, _Replica())
        if r.base != (report_time, reported):
            # `sent`'s steps over every send since the report.
            rate = r.rate
            queue, t = float(reported), report_time
            for routed_at, tokens in sends():
                if t is None:
                    t = routed_at
                elif routed_at > t:
                    queue = max(0.0, queue - rate * (routed_at - t))
                    t = routed_at
                queue += tokens
            r.base, r.queue, r.queue_time = (report_time, reported), queue, t
        return round(self._drained(r, now))

    def _drained(self, r: _Replica, now: float) -> float:
        """The model's backlog at `now` (no earlier than its last event)."""
        if r.queue_time is None or now <= r.queue_time:
            return r.queue
        return max(0.0, r.queue - r.rate * (now - r.queue_time))

    def forget(self, keep: Callable[[str], bool]) -> None:
        """Drop the replicas `keep` refuses."""
        for rid in [rid for rid in self._replicas if not keep(rid)]:
            del self._replicas[rid]
