"""A routing policy run in a child process, beside the simulated fleet's loop.

Why: a 64-replica fleet spends about a third of a run in the router (the choice, then
its bookkeeping: reservations, sent prompts, the owner LRU) and most of the rest in the
replicas' engines, one after the other on one core. The router needs nothing from the
engines but what a real router gets (reports, completions), so it can run on the other
core, and the two halves overlap:

- the fleet's loop queues what the policy hears (`on_completed`) and sends it, in
  order, with the next report (`report`) or the next arrival to choose for (`ask`),
  whichever comes first;
- the replicas' prefix digests live in the child: the loop's block managers only log
  their adds and removes (`_DigestFeed`), each report carries its replica's log since
  the last one, and the child applies it to its copy of the real digest and builds the
  report's load there (the bitset is never copied or pickled in the loop); the digests
  come back to the loop at the end (`close`);
- the child applies those calls, chooses, and answers the replica at once; only then
  does it record the choice (`choose_deferred`'s second half: the owner LRU, the
  ledgers), while the loop runs the engines until the next arrival;
- while the child chooses, the loop builds the prompt of the arrival after (`ask`'s
  `upcoming`) and sends it ahead (its block hashes; those of a shared prefix the child
  has its own copy of, the same int objects in every prompt as in the loop:
  `Fleet.shared_hashes`). Then, until the answer comes (`choose`), it applies the
  replicas' decode runs up to now (`Fleet.catch_up`: what any look would apply, so
  the same results, and less left to apply when each run ends), and then builds the
  prompts of the arrivals after that one (a few ahead: `_BUILD_AHEAD`), which it
  would otherwise build later on its own critical path;
- once it has recorded a choice, the child builds the route of the arrival sent ahead
  and does what the next choice would do first (`MostFreeBlocks.prepare`): reconcile
  its state with the reports at that arrival's time, look up what depends on nothing
  but the prompt and the owners (the owner's leading run, the digests' probe
  positions), and work out the prompt's hits on every replica (they depend only on the
  reports and the prompts sent); again after each report, which comes as it is made,
  unless a message already waits (the choice, which would do it anyway, or a report).
  All while the loop still runs the engines.

The critical path of an arrival is still the choice and then the engines' work until
the next arrival: the two are serial by nature (the next choice reads the completions
and reports of that work). What overlaps is the bookkeeping, the prompts, the look
ahead (the reconciling and the prompt's hits included) and the decode runs' catching
up. (Tried and dropped, measured in BENCHMARKS.md: the child running a share of the
replicas' engines too, and the child building the prompts.)

The policy sees the same calls with the same arguments in the same order as in the
fleet's own process, so a run's results are identical (`tests/cluster/
test_bench_simulate.py` runs both). Only policies that read nothing but their reports,
their own state and `Fleet.live` (`runs_apart`) run here, and only without the
autoscaler in the loop (it asks the policy after every event).

The child is forked from the fleet's process as the run starts: it inherits the fleet
(never stepped there) and the policy as built, so nothing is pickled but the calls.
Each of the two keeps a core of its own for the run (`_pin`), so neither starts on a
cache the other has just used.
"""

from __future__ import annotations

import contextlib
import itertools
import multiprocessing
import os
import pickle
import select
import time
import traceback
from collections.abc import Callable, Iterable, Iterator
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

import numpy as np

from pagefleet.cluster.routing.reports import STAT_PREFIX_DIGEST, ReplicaLoad
from pagefleet.engine import PrefixDigest
from pagefleet.engine.prefix_hash import DigestCalls, DigestLog

if TYPE_CHECKING:  # the fleet imports this module: no import at run time the other way
    from pagefleet.cluster.routing.policy import RouteRequest
    from pagefleet_lab.sim.fleet import Fleet, InFlightRequest, Policy
    from pagefleet_lab.sim.workloads import SimRequest

_STATS, _COMPLETED, _AHEAD, _CHOOSE, _STOP = range(5)
# The largest a pipe may grow here (Linux's default limit): a report carries its
# replica's digest log (a few hundred hashes, thousands after a burst of evictions), and
# the loop should not wait for the child to read one.
_PIPE_BYTES = 1 << 20
_SPIN_S = 0.05  # `_Receiver.recv`: past this a wait sleeps
# `PolicyProcess.choose` builds the prompts of at most this many arrivals to come (each
# ~60 KB of tokens held until it arrives).
_BUILD_AHEAD = 4


def can_fork_a_policy() -> bool:
    """Whether this process may run a policy apart: it has two cores or more to run on,
    and the system forks."""
    if "fork" not in multiprocessing.get_all_start_methods() or not hasattr(select, "poll"):
        return False
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return (cores or 1) > 1


def runs_apart(policy: Policy) -> bool:
    """Whether `policy` can run in a child process (module docstring): it says so, and it
    can answer a choice before recording it (`choose_deferred`)."""
    return (
        bool(getattr(policy, "runs_apart", False))
        and hasattr(policy, "choose_deferred")
        and not policy.live_engine
    )


class PolicyProcess:
    """`policy`, run in a child process (module docstring); the loop's side of it.

    Use as a context manager: the child ends with the block."""

    live_engine = False

    def __init__(self, fleet: Fleet, policy: Policy) -> None:
        self.name = policy.name
        self._fleet = fleet
        self._calls: list[tuple[Any, ...]] = []  # queued for the next message
        self._asked: str | None = None  # the request id whose answer is due
        # Prompts built ahead (`ask`'s upcoming), by request id.
        self._built: dict[int, tuple[list[int], RouteRequest]] = {}
        self._later: Callable[[int], list[SimRequest]] | None = None
        ctx = multiprocessing.get_context("fork")
        to_child, self._send = _pipe()
        receiving, from_child = _pipe()
        self._recv = _Receiver(receiving)
        self._proc = ctx.Process(
            target=_child, args=(fleet, policy, to_child, from_child), daemon=True
        )
        self._proc.start()
        self._cores = _pin(self._proc.pid)
        to_child.close()
        from_child.close()
        # The replicas' digests live in the child from now on (`report`): here, feeds.
        self._feeds: list[_DigestFeed] = []
        for r in fleet.replicas:
            bm = r.engine.block_manager
            self._feeds.append(_DigestFeed(bm.digest))
            bm.digest = self._feeds[-1]  # type: ignore[assignment]

    def __enter__(self) -> PolicyProcess:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        self.close(bring_home=exc_type is None)

    def close(self, bring_home: bool = True) -> None:
        """End the child; with `bring_home`, the replicas' digests come back to the
        loop's block managers first, as the child has them (the feeds' last logs
        applied), so the fleet after a run is as if the policy had run here. Otherwise
        (a run that failed) the feeds stay, and reading them raises."""
        if self._cores:
            with contextlib.suppress(OSError):
                os.sched_setaffinity(0, self._cores)
        try:
            if self._proc.exitcode is None:
                logs = [feed.take() for feed in self._feeds] if bring_home else None
                with contextlib.suppress(OSError):  # it has gone already
                    _put(self._send, [(_STOP, logs)])
                if logs is not None:
                    self._bring_home()
        finally:
            self._proc.join(timeout=30)
            if self._proc.exitcode is None:
                self._proc.kill()
                self._proc.join()
            self._send.close()
            self._recv.conn.close()

    def _bring_home(self) -> None:
        """Each replica's digest from the child (its answer to `_STOP`), in place of its
        feed."""
        try:
            answer = _get(self._recv.conn) if self._recv.conn.poll(30) else None
        except EOFError:
            answer = None
        if answer is None:
            raise RuntimeError("the policy process did not send the digests back")
        if isinstance(answer, str):
            raise RuntimeError(f"the policy process failed:\n{answer}")
        for r, feed, counts in zip(self._fleet.replicas, self._feeds, answer, strict=True):
            digest = PrefixDigest.from_counts(counts, feed.num_probes, len(feed))
            r.engine.block_manager.digest = digest

    # -- what the policy hears: queued, sent with the next report or arrival ----------

    def report(self, replica: int, now: float) -> None:
        """Replica `replica`'s report now (`Fleet.routing_stats`), sent at once with what
        was queued before it: the child reconciles it while the loop runs the engines,
        not when it chooses (`_serve`). Its prefix digest is the child's copy, brought
        up to date with the feed's log since the last report: the loop never applies
        the log or copies the bitset (`_DigestFeed`)."""
        stats = self._fleet.routing_stats(self._fleet.replicas[replica], now, with_digest=False)
        self._calls.append((_STATS, replica, stats, self._feeds[replica].take(), now))
        _put(self._send, self._calls)
        self._calls = []

    def on_stats(self, replica: int, load: ReplicaLoad, now: float) -> None:
        raise NotImplementedError("a policy process builds its reports itself: `report`")

    def on_completed(self, request: InFlightRequest, now: float) -> None:
        self._calls.append((_COMPLETED, request.route.request_id, now))

    # The replica set changes only with the autoscaler in the loop, which never runs a
    # policy apart (the child's `Fleet.live` would not follow).
    def on_replicas(self, now: float) -> None:
        raise NotImplementedError("a policy in a child process runs without the autoscaler")

    def on_scale_in_notice(self, leaving: int, now: float) -> None:
        raise NotImplementedError("a policy in a child process runs without the autoscaler")

    def take_warm_ups(self, now: float) -> list[tuple[int, SimRequest]]:
        return []

    # -- the choice ------------------------------------------------------------------

    def ask(
        self,
        req: SimRequest,
        now: float,
        upcoming: SimRequest | None = None,
        later: Callable[[int], list[SimRequest]] | None = None,
    ) -> tuple[list[int], RouteRequest]:
        """Send what was queued and `req` to choose for; then build `upcoming`'s prompt
        (the arrival after it, if known) while the child chooses, and send it ahead.
        `req`'s prompt tokens and route, for the loop (built now unless built before).
        `later(n)`: the `n` arrivals after `upcoming`, if known, whose prompts `choose`
        builds while it waits."""
        if self._asked is not None:
            raise RuntimeError(f"request {self._asked}'s answer has not been read")
        fleet = self._fleet
        built = self._built.pop(req.request_id, None)
        tokens, route = built or fleet.route_request(req)
        if built is None:  # not sent ahead (the first arrival)
            self._calls.append(self._ahead(req, route))
        self._calls.append((_CHOOSE, req.request_id, now))
        _put(self._send, self._calls)
        self._calls = []
        self._asked = route.request_id
        self._later = later
        if upcoming is not None:
            ahead = self._built.get(upcoming.request_id)
            if ahead is None:
                self._built[upcoming.request_id] = ahead = fleet.route_request(upcoming)
            _put(self._send, [self._ahead(upcoming, ahead[1])])
        return tokens, route

    def _build_later(self) -> Iterator[None]:
        """Build the prompts of the arrivals after the next (`ask`'s `later`), a step
        each: the loop's work whenever it is done, here done where the loop would
        otherwise only wait for the child."""
        if self._later is None:
            return
        for req in self._later(_BUILD_AHEAD):
            if req.request_id not in self._built:
                self._built[req.request_id] = self._fleet.route_request(req)
                yield

    def _ahead(self, req: SimRequest, route: RouteRequest) -> tuple[Any, ...]:
        """The call that sends `req` ahead of its choice (`_serve`): the child knows the
        shared prefix's hashes (`Fleet.shared_hashes`); the rest travel as bytes, 8 a
        hash (the hashes are unsigned 64-bit)."""
        shared = len(self._fleet.shared_hashes(req))
        tail = np.array(route.prompt_block_hashes[shared:], dtype=np.uint64).tobytes()
        return (_AHEAD, req, route.prompt_tokens, tail)

    def choose(self, request: InFlightRequest, now: float) -> int:
        """The replica for `request`: the answer to `ask`."""
        if self._asked != request.route.request_id:
            raise RuntimeError(f"asked for {self._asked}, not {request.route.request_id}")
        self._asked = None
        # The engines' catching up and the prompts to come are off the critical path here.
        answer = self._recv.recv(itertools.chain(self._fleet.catch_up(now), self._build_later()))
        if isinstance(answer, str):
            raise RuntimeError(f"the policy process failed:\n{answer}")
        return answer


def _pin(child: int) -> set[int]:
    """Keep this process on one of its cores and `child` on another, where the system
    lets a process choose: the cores this process could run on before (to restore), or
    an empty set where it pinned nothing.

    Why: the two processes hand each arrival back and forth and each works over its own
    large heap; left free to move, the scheduler now and then puts them on each other's
    core (or both on one for a moment), and each then starts from a cold cache. Pinned,
    a 600 s probe at 64 replicas ran 4-9% faster here (BENCHMARKS.md)."""
    if not (hasattr(os, "sched_getaffinity") and hasattr(os, "sched_setaffinity")):
        return set()
    cores = os.sched_getaffinity(0)
    if len(cores) < 2:
        return set()
    mine, theirs = sorted(cores)[:2]
    try:
        os.sched_setaffinity(child, {theirs})
        os.sched_setaffinity(0, {mine})
    except OSError:  # not allowed here: both keep every core
        with contextlib.suppress(OSError):
            os.sched_setaffinity(child, cores)
        return set()
    return cores


def _put(conn: Connection, obj: Any) -> None:
    """Send `obj` (plain pickle: `Connection.send`'s pickler is built anew each call, a
    copy of its reducer table included, ~10 us; the two sides send ~200k messages an
    hour of 64 replicas, an answer per arrival on the critical path)."""
    conn.send_bytes(pickle.dumps(obj, pickle.HIGHEST_PROTOCOL))


def _get(conn: Connection) -> Any:
    """What `_put` sent."""
    return pickle.loads(conn.recv_bytes())


def _pipe() -> tuple[Connection, Connection]:
    """A one-way pipe (reader, writer), grown to `_PIPE_BYTES` where the system lets it."""
    reader, writer = multiprocessing.Pipe(duplex=False)
    with contextlib.suppress(ImportError, AttributeError, OSError):  # else: only slower
        import fcntl

        fcntl.fcntl(writer.fileno(), fcntl.F_SETPIPE_SZ, _PIPE_BYTES)  # type: ignore[attr-defined]
    return reader, writer


class _Receiver:
    """A pipe's reading end, polled for a message through one `select.poll` kept for it
    (`Connection.poll` builds and registers a selector each call, ~10 us here).

    Each side waits for the other once per arrival, hundreds of thousands of times a run,
    mostly for well under a millisecond. A sleep costs a wake-up each time, and on a
    virtual machine those added up to more than the overlap saved: a 600 s probe at 64
    replicas took 158 s with sleeping reads, 120 s polling, 124-147 s in one process. So
    `recv` polls for up to `_SPIN_S` before it sleeps; a long wait (the other side busy
    elsewhere, or gone) sleeps, so a stalled run does not hold a core."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self._poll = select.poll()
        self._poll.register(conn.fileno(), select.POLLIN)

    def waiting(self) -> bool:
        """Whether a message (or the other end's close) is there to read now."""
        return bool(self._poll.poll(0))

    def recv(self, meanwhile: Iterable[None] = ()) -> Any:
        """The next message; until it comes, `meanwhile`'s steps, then polling."""
        ready = self._poll.poll
        for _ in meanwhile:
            if ready(0):
                break
        if not ready(0):
            deadline = time.perf_counter() + _SPIN_S
            while not ready(0):
                if time.perf_counter() > deadline:
                    ready()  # sleeps until a message (or the other end's close)
                    break
        return _get(self.conn)


def _child(fleet: Fleet, policy: Policy, calls: Connection, answers: Connection) -> None:
    """The child's loop: apply each message's calls in order; answer each choice, then
    record it."""
    code = 0
    try:
        _serve(fleet, policy, calls, answers)
    except BaseException:  # reported to the loop, which raises
        code = 1
        with contextlib.suppress(OSError):
            _put(answers, traceback.format_exc())
    finally:
        # Not `sys.exit`: the fork's copies of the parent's buffers and exit hooks are not
        # this process's to flush or run.
        os._exit(code)


def _serve(fleet: Fleet, policy: Policy, calls: Connection, answers: Connection) -> None:
    receiver = _Receiver(calls)
    flying: dict[str, InFlightRequest] = {}  # chosen here, not yet completed
    ahead: dict[int, InFlightRequest] = {}  # sent ahead of their choice, by request id
    choose_deferred = policy.choose_deferred  # type: ignore[attr-defined]
    prepare = getattr(policy, "prepare", None)
    while True:
        chose = False
        for call in receiver.recv():
            kind = call[0]
            if kind == _STATS:
                index, stats, log, now = call[1:]
                replica = fleet.replicas[index]
                digest = replica.engine.block_manager.digest
                digest.replay(log)
                stats[STAT_PREFIX_DIGEST] = digest.to_bytes()
                policy.on_stats(index, ReplicaLoad.from_routing_stats(replica.id, stats), now)
            elif kind == _COMPLETED:
                policy.on_completed(flying.pop(call[1]), call[2])
            elif kind == _AHEAD:
                # Mostly while the loop runs the engines: its route built now, and what
                # the policy can look up ahead (`MostFreeBlocks.prepare`), not at choice.
                req, prompt_tokens, tail = call[1:]
                hashes = itertools.chain(
                    fleet.shared_hashes(req), np.frombuffer(tail, dtype=np.uint64).tolist()
                )
                flight = fleet.flight_of(fleet.route_of(req, prompt_tokens, hashes), req)
                ahead[req.request_id] = flight
            elif kind == _CHOOSE:
                flight = ahead.pop(call[1])
                if call[2] != flight.req.arrival_s:  # `prepare` looked ahead to then
                    raise RuntimeError(f"request {call[1]} chosen at {call[2]}, not its arrival")
                chose = True
                index, record = choose_deferred(flight, call[2])
                _put(answers, index)
                record()
                flight.replica = index
                flying[flight.route.request_id] = flight
            else:  # the end: the digests' last logs applied, and sent back
                if call[1] is not None:
                    counts = []
                    for r, log in zip(fleet.replicas, call[1], strict=True):
                        r.engine.block_manager.digest.replay(log)
                        counts.append(r.engine.block_manager.digest.counts())
                    _put(answers, counts)
                return
        if not chose and ahead and prepare is not None and not receiver.waiting():
            # Between two choices (an arrival sent ahead, or a report): what the next
            # choice can look up or reconcile now, at its arrival time. Not while a
            # message waits: it may be the choice (which does it anyway) or a report
            # (after which it is done again).
            prepare(next(iter(ahead.values())), receiver.waiting)


class _DigestFeed(DigestCalls):
    """A replica's prefix digest as the loop keeps it while the policy runs apart: the
    block manager's adds and removes (`PrefixDigest`'s calls, which it makes as it
    registers and evicts blocks), only logged, and taken with each report
    (`PolicyProcess.report`) to the child. The child applies them to its copy of the
    real digest, forked with the fleet, and reads the report's bitset there.

    Why: applying the log and copying a bitset of up to 256 KiB for every report, and
    pickling it through the pipe, was about a tenth of the loop's work at 64 replicas;
    a log since the last report is a few hundred hashes. The child's digest gets the
    same calls in the same order, so its counts and bits are those the loop's would
    have had (`PrefixDigest`: a log applied at any point gives the calls' result).
    Nothing in the loop reads a digest meanwhile: its reads raise."""

    def __init__(self, digest: PrefixDigest) -> None:
        super().__init__()
        self.num_bits = digest.num_bits
        self.num_probes = digest.num_probes
        self._len = len(digest)  # what the block manager's accounting check reads

    def take(self) -> DigestLog:
        """The calls logged since the last `take`."""
        log, self._log = self._log, []
        return log

    def _elsewhere(self, *args: object) -> Any:
        raise RuntimeError("this replica's prefix digest is in the policy process")

    to_bytes = counts = __contains__ = _elsewhere
