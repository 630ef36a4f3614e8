"""PrefillDrain: the rate from report pairs, the backlog's queue model, exact figures."""

from __future__ import annotations

from pagefleet.cluster.routing.prefill_drain import PrefillDrain


def no_sends() -> list[tuple[float, int]]:
    return []


def test_the_rate_is_the_best_throughput_over_the_window() -> None:
    d = PrefillDrain()
    assert d.rate("a") == 0.0  # never reported
    d.observe("a", 10.0, 1_000, window=2)
    assert d.rate("a") == 0.0  # one report: no interval yet
    d.observe("a", 12.0, 9_000, window=2)  # 8,000 tokens in 2 s
    d.observe("a", 12.0, 9_500, window=2)  # the same report again: nothing changes
    assert d.rate("a") == 4_000.0
    d.observe("a", 14.0, 11_000, window=2)  # 1,000/s: idle part of the time
    assert d.rate("a") == 4_000.0  # the best of the last two
    d.observe("a", 16.0, 13_000, window=2)  # 1,000/s again: 4,000 left the window
    assert d.rate("a") == 1_000.0
    d.observe("a", 18.0, 500, window=2)  # the counter went back: a restarted replica
    assert d.rate("a") == 0.0
    d.observe("b", 1.0, 0, window=0)
    d.observe("b", 2.0, 5_000, window=0)  # window 0: no rate, nothing ever drains
    assert d.rate("b") == 0.0


def test_the_backlog_drains_at_the_rate_between_sends_and_never_below_zero() -> None:
    d = PrefillDrain()
    d.observe("a", 0.0, 0, window=8)
    d.observe("a", 10.0, 10_000, window=8)  # 1,000 tokens/s
    sends = [(10.5, 3_000), (14.0, 500), (14.2, 1_000)]
    # From the report's 2,000 at t=10: 2,000 - 500 + 3,000 = 4,500 at 10.5; drained to
    # 1,000 at 14.0, + 500; 1,300 at 14.2, + 1,000 = 2,300; at 15.0: 1,500.
    assert d.backlog("a", 10.0, 2_000, lambda: sends, 15.0) == 1_500
    assert d.backlog("a", 10.0, 2_000, lambda: sends, 20.0) == 0
    # A send now, on the cached model: 2,300 at 14.2 -> 0 at 16.5, + 700.
    d.sent("a", 700, 16.5)
    assert d.backlog("a", 10.0, 2_000, no_sends, 16.5) == 700  # cached: no replay
    assert d.backlog("a", 10.0, 2_000, no_sends, 16.9) == 300
    # A new report starts the model over from it, replaying what is still unreported.
    assert d.backlog("a", 16.0, 4_000, lambda: [(16.5, 700)], 17.0) == 4_000 - 500 + 700 - 500


def test_without_a_rate_the_backlog_is_the_report_plus_every_send() -> None:
    d = PrefillDrain()
    sends = [(1.0, 300), (2.0, 400)]
    assert d.backlog("new", None, 0, lambda: sends, 50.0) == 700  # no report yet
    d.observe("a", 5.0, 100, window=8)  # one report: no rate
    assert d.backlog("a", 5.0, 1_000, lambda: sends, 50.0) == 1_700


def test_a_send_that_leaves_early_is_replayed_out() -> None:
    d = PrefillDrain()
    d.observe("a", 0.0, 0, window=8)
    d.observe("a", 1.0, 100, window=8)  # 100 tokens/s
    sends = [(1.0, 1_000), (1.0, 2_000)]
    assert d.backlog("a", 1.0, 0, lambda: sends, 3.0) == 2_800
    sends.pop(0)  # it completed before the next report
    assert d.backlog("a", 1.0, 0, lambda: sends, 3.0) == 2_800  # still cached
    d.changed("a")
    assert d.backlog("a", 1.0, 0, lambda: sends, 3.0) == 1_800


def test_forget_drops_replicas_and_their_rates() -> None:
    d = PrefillDrain()
    for rid in ("a", "b"):
        d.observe(rid, 0.0, 0, window=8)
        d.observe(rid, 1.0, 50, window=8)
    d.forget(lambda rid: rid == "b")
    assert (d.rate("a"), d.rate("b")) == (0.0, 50.0)
