"""The driver's pure decisions (microseconds each, no processes)."""
import signal

import pytest

from ringd.core.settings import RingSettings
from ringd.core.policy import (Action, Spin, TurnInputs, after_run, alerts_after, backoff_delay, classify,
                          decide, died_of_term, plan_turn, seen_at, spin_after_run, spin_at_lap_end,
                          wait_timeout)
from ringd.core.records import AgentState
from ringd.host.wakeup import requests_from

RING = RingSettings(backoff_initial=60, backoff_max=3600, quarantine_after=3, quarantine_cooloff=100)
A = AgentState(name="a")


def test_classify():
    c = dict(tempfail_exit_code=75)
    assert classify(0, None, ended_by=None, termed_at_budget=False, **c) == "ok"
    assert classify(2, None, ended_by=None, termed_at_budget=False, **c) == "failed"
    assert classify(None, 11, ended_by=None, termed_at_budget=False, **c) == "failed"
    assert classify(75, None, ended_by=None, termed_at_budget=False, **c) == "deferred"
    assert classify(None, 15, ended_by=None, termed_at_budget=True, **c) == "timeout"
    assert classify(0, None, ended_by=None, termed_at_budget=True, **c) == "timeout"
    assert classify(None, 9, ended_by="stall", termed_at_budget=True, **c) == "stalled"
    assert classify(None, 15, ended_by="skip", termed_at_budget=False, **c) == "skipped"
    assert classify(None, 15, ended_by="stop", termed_at_budget=False, **c) == "interrupted"


def test_a_death_by_sigterm_while_the_driver_stops_is_interrupted_whoever_sent_it():
    """KillMode=control-group: systemd SIGTERMs the agent with the driver. Not the
    agent's fault, never ``failed``; any other ending keeps its own status."""
    c = dict(tempfail_exit_code=75, termed_at_budget=False, ended_by=None)
    assert classify(None, 15, stopping=True, **c) == "interrupted"
    assert classify(143, None, stopping=True, **c) == "interrupted"     # a shell saying its child died of it
    assert classify(None, 15, stopping=False, **c) == "failed"
    assert classify(0, None, stopping=True, **c) == "ok"                # it finished: its own ending
    assert classify(1, None, stopping=True, **c) == "failed"
    assert classify(75, None, stopping=True, **c) == "deferred"
    assert classify(None, 9, stopping=True, **c) == "failed"
    assert classify(None, 15, stopping=True, **dict(c, termed_at_budget=True)) == "timeout"
    assert classify(None, 15, stopping=True, **dict(c, ended_by="skip")) == "skipped"
    assert died_of_term(None, 15) and died_of_term(143, None) and not died_of_term(15, None)


def test_backoff_doubles_and_caps():
    assert [backoff_delay(n, 60, 3600) for n in (1, 2, 3, 4, 7, 8, 500)] == \
        [60, 120, 240, 480, 3600, 3600, 3600]


def test_deferral_sets_backoff_and_success_resets_it():
    s = after_run(A, "deferred", "driver", 1000.0, RING).state
    assert s.backoff_until == 1060 and s.consecutive_deferrals == 1
    s = after_run(s, "deferred", "driver", 2000.0, RING).state
    assert s.backoff_until == 2120 and s.consecutive_deferrals == 2
    s = after_run(s, "ok", "driver", 3000.0, RING).state
    assert s.backoff_until is None and s.consecutive_deferrals == 0


def test_error_backs_off_like_a_deferral_and_counts_as_a_failure():
    s = after_run(A, "error", "driver", 1000.0, RING, "a ./x").state
    assert s.backoff_until == 1060 and s.consecutive_failures == 1 and s.quarantine_line == "a ./x"
    s = after_run(s, "error", "driver", 1100.0, RING, "a ./x").state
    assert s.backoff_until == 1220
    assert decide(s, 1200.0, "a ./x").action is Action.PASS
    d = decide(s, 1200.0, "a ./y")   # the line was fixed: run now
    assert d.action is Action.RUN and d.line_changed


# SPEC "Whose fault": (status, source) -> (failures delta, streak delta, reset)
WHOSE_FAULT = [
    ("ok", "driver", "reset", "reset"),
    ("failed", "driver", +1, 0),
    ("error", "driver", +1, 0),
    ("deferred", "driver", 0, 0),
    ("timeout", "driver", +1, +1),
    ("stalled", "driver", +1, +1),
    ("interrupted", "operator", +1, +1),
    ("interrupted", "driver", 0, 0),
    ("interrupted", "reaper", 0, 0),
    ("skipped", "operator", 0, 0),
    ("skipped", "driver", 0, 0),
]


@pytest.mark.parametrize("status,source,fails,streak", WHOSE_FAULT)
def test_whose_fault(status, source, fails, streak):
    before = A.with_(consecutive_failures=1, bad_streak=1)
    s = after_run(before, status, source, 0.0, RING).state
    assert s.consecutive_failures == (0 if fails == "reset" else 1 + fails)
    assert s.bad_streak == (0 if streak == "reset" else 1 + streak)
    failures_alert = bool(alerts_after("a", status, source, after_run(before, status, source, 0.0, RING), 2))
    assert failures_alert == (fails == +1)


def test_three_clean_stops_quarantine_nothing():
    s = A
    for source in ("driver", "reaper", "driver"):
        settled = after_run(s, "interrupted", source, 0.0, RING)
        assert not settled.entered_quarantine
        s = settled.state
    assert s.quarantined_until is None and s.consecutive_failures == 0


def test_wedges_quarantine_and_a_good_probation_ends_it():
    s = A
    for status in ("stalled", "timeout"):
        s = after_run(s, status, "driver", 0.0, RING).state
    assert s.consecutive_failures == 2 and s.quarantined_until is None
    settled = after_run(s, "interrupted", "operator", 50.0, RING, "a x")
    assert settled.entered_quarantine
    s = settled.state
    assert s.quarantined_until == 150 and s.quarantine_line == "a x"
    assert decide(s, 100.0, "a x").action is Action.PASS
    assert decide(s, 100.0, "a y").line_changed
    assert decide(s, 151.0, "a x").action is Action.RUN
    s = after_run(s, "ok", "driver", 200.0, RING).state
    assert s.quarantined_until is None and s.consecutive_failures == 0 and s.bad_streak == 0


def test_decide_order():
    assert decide(A, 0).action is Action.RUN
    assert decide(A.with_(backoff_until=10), 5).action is Action.PASS
    assert decide(A.with_(backoff_until=10), 5).until == 10
    assert decide(A.with_(backoff_until=10), 11).action is Action.RUN
    assert decide(A.with_(skip_requested=True, backoff_until=10), 5).action is Action.SKIP


def test_plan_steps_over_passes_and_says_when_to_wake():
    roster = [("a", "a x"), ("b", "b x"), ("c", "c x")]
    states = {"a": A.with_(backoff_until=50), "b": AgentState("b", backoff_until=20)}
    p = plan_turn(TurnInputs(roster, 0, states, now=10))
    assert p.index == 2 and p.passed == [0, 1]
    states["c"] = AgentState("c", quarantined_until=30)
    p = plan_turn(TurnInputs(roster, 1, states, now=10))
    assert p.index is None and p.until == 20 and p.passed == [1, 2, 0]
    p = plan_turn(TurnInputs(roster, 1, states, now=10, limit=1))
    assert p.index is None and p.passed == [1]


def test_a_ring_that_fails_at_once_waits_doubling_and_resets():
    spin = Spin()
    delays = []
    for _ in range(5):
        for _ in range(3):
            spin = spin_after_run(spin, "failed", 0.01, fast_fail=1.0)
        spin = spin_at_lap_end(spin, backoff_max=6)
        delays.append(spin.delay)
    assert delays == [1, 2, 4, 6, 6]
    spin = spin_after_run(spin, "error", 0.0, 1.0)
    spin = spin_after_run(spin, "failed", 1.5, 1.0)   # one slow failure: not a spinning lap
    assert spin_at_lap_end(spin, 6).delay == 0
    spin = spin_after_run(Spin(delay=4), "ok", 0.01, 1.0)
    assert spin_at_lap_end(spin, 6).delay == 0


def test_signals_become_requests():
    r = requests_from({signal.SIGTERM})
    assert r.stop and not r.reload and r.any
    r = requests_from({signal.SIGHUP, signal.SIGCHLD})
    assert r.reload and r.children and not r.stop
    assert requests_from({signal.SIGUSR1}).wake
    assert not requests_from({signal.SIGCHLD}).any


def test_idle_wait_never_sleeps_past_a_beat_or_a_roster_look():
    assert wait_timeout(100, until=86400, next_beat=110, roster_check=105) == 5
    assert wait_timeout(100, until=101, next_beat=110, roster_check=105) == 1
    assert wait_timeout(100, until=None, next_beat=103, roster_check=105) == 3
    assert wait_timeout(100, until=90, next_beat=103, roster_check=105) == 0


def test_a_wait_set_before_the_wall_clock_stepped_back_ends_now():
    # a back-off or quarantine stretched past twice its own length ends now
    now = 10_000.0
    backing = A.with_(backoff_until=now + 3600, consecutive_deferrals=7)   # backoff_max: 3600 (a fresh maximum)
    assert seen_at(backing, now, RING) == backing
    assert seen_at(backing, now - 2, RING) == backing            # an NTP step: stretched, kept
    assert seen_at(backing, now - 3600, RING) == backing         # stretched to twice backoff_max at most: kept
    stepped = seen_at(backing, now - 86400, RING)                # a day back: it ends now
    assert stepped.backoff_until == now - 86400 and decide(stepped, now - 86400).action is Action.RUN
    held = A.with_(quarantined_until=now + 100, bad_streak=3)   # quarantine_cooloff: 100
    assert seen_at(held, now, RING) == held
    probation = seen_at(held, now - 86400, RING)
    assert decide(probation, now - 86400).reason == "probation run after quarantine cool-off"
    assert probation.bad_streak == 3                             # only the clock's reading changed


def test_the_spec_defaults_of_quarantine_back_off_and_alerts():
    """SPEC "Configuration" and "Quarantine, alerts and metrics": the numbers."""
    from ringd.inputs.config import AlertSettings
    ring, alerts = RingSettings(), AlertSettings()
    assert (ring.quarantine_after, ring.quarantine_cooloff) == (3, 86400)
    assert (ring.tempfail_exit_code, ring.backoff_initial, ring.backoff_max) == (75, 60, 3600)
    assert ring.fast_fail == 1
    assert (alerts.command, alerts.failures_in_a_row) == (None, 5)
    # the default failures alert comes at the 5th failure in a row, and each 5th after
    s, fired = A, []
    for n in range(1, 11):
        settled = after_run(s, "failed", "driver", float(n), ring)
        s = settled.state
        if alerts_after("a", "failed", "driver", settled, alerts.failures_in_a_row):
            fired.append(n)
    assert fired == [5, 10]


def test_quarantine_after_zero_never_quarantines():
    off = RingSettings(quarantine_after=0)
    s = A
    for _ in range(50):
        settled = after_run(s, "stalled", "driver", 0.0, off)
        assert not settled.entered_quarantine
        s = settled.state
    assert s.quarantined_until is None and decide(s, 1.0).action is Action.RUN


def test_back_off_never_overflows_and_a_max_below_the_initial_caps_it():
    assert backoff_delay(2 ** 1000, 60, 3600) == 3600
    assert backoff_delay(1, 60, 10) == 10 and backoff_delay(5, 60, 10) == 10
    s = A.with_(consecutive_deferrals=10 ** 18)
    s = after_run(s, "deferred", "driver", 1000.0, RingSettings(backoff_initial=60, backoff_max=30)).state
    assert s.backoff_until == 1030


def test_a_short_back_off_is_never_stretched_to_the_longest_by_a_clock_step():
    """A first back-off (60 s) when the clock is stepped back an hour: it was
    kept as long as it ended within twice backoff_max (3600 s), so the agent
    waited 61 minutes instead of one. It is judged by its own length."""
    now = 10_000.0
    first = after_run(A, "deferred", "driver", now, RING).state
    assert first.backoff_until == now + 60 and first.consecutive_deferrals == 1
    assert seen_at(first, now - 30, RING) == first                # stretched by an NTP-sized step: kept
    stepped = seen_at(first, now - 3600, RING)                    # an hour back: it ends now
    assert stepped.backoff_until == now - 3600 and decide(stepped, now - 3600).action is Action.RUN
    assert stepped.consecutive_deferrals == 1                     # the next one still doubles
    third = after_run(after_run(first, "deferred", "driver", now, RING).state, "error", "driver", now, RING).state
    assert third.backoff_until == now + 240
    assert seen_at(third, now - 200, RING) == third
    assert seen_at(third, now - 3600, RING).backoff_until == now - 3600


@pytest.mark.parametrize("status,source,ends", [
    ("failed", "driver", True), ("error", "driver", True), ("deferred", "driver", True), ("ok", "driver", True),
    ("skipped", "operator", False), ("interrupted", "driver", False), ("interrupted", "reaper", False),
])
def test_a_probation_run_that_fails_is_skipped_or_is_interrupted(status, source, ends):
    """A probation run that did not wedge ends the quarantine; one that was
    skipped or interrupted by the ring's stop is no verdict: the probation is
    due again, and the streak is unchanged."""
    held = A.with_(quarantined_until=100.0, bad_streak=3, quarantine_line="a x")
    settled = after_run(held, status, source, 150.0, RING, "a x")
    assert not settled.entered_quarantine
    s = settled.state
    if ends:
        assert s.quarantined_until is None and decide(s, 151.0, "a x").reason != "probation run after quarantine cool-off"
    else:
        assert s.quarantined_until == 100.0 and s.bad_streak == 3
        assert decide(s, 151.0, "a x").reason == "probation run after quarantine cool-off"


def test_a_reader_sees_a_hold_begun_under_another_roster_line_as_over():
    """status and metrics pass the agent's roster line: a quarantine or back-off
    begun under another line is shown lifted, as the agent's next turn lifts it;
    the driver passes none, so its turn still sees (and records) the change."""
    now = 1000.0
    held = A.with_(quarantined_until=now + 100, bad_streak=3, quarantine_line="a ./old",
                   backoff_until=now + 60, consecutive_deferrals=1)
    assert seen_at(held, now, RING, "a ./old") == held
    shown = seen_at(held, now, RING, "a ./fixed")
    assert shown.quarantined_until is None and shown.backoff_until is None and shown.bad_streak == 0
    assert seen_at(held, now, RING) == held and decide(held, now, "a ./fixed").line_changed


def test_a_state_changed_by_nothing_is_the_very_same_state():
    """An ok run of a healthy agent - most runs - leaves its state as it was: the
    same object, so closing the run compares and stores nothing."""
    s = AgentState("a", runs=3, consecutive_failures=0, backoff_until=None)
    assert s.with_(consecutive_failures=0, backoff_until=None) is s
    t = s.with_(consecutive_failures=1)
    assert t is not s and (t.consecutive_failures, s.consecutive_failures) == (1, 0)
    with pytest.raises(TypeError):
        s.with_(no_such_field=1)
    ring = RingSettings()
    assert after_run(s, "ok", "driver", 100.0, ring).state is s


def test_an_outage_is_a_full_quota_bound_read_only_or_failing_file_system_and_is_retried_doubling():
    import errno
    from ringd.core.policy import OUTAGE_RETRY, is_outage, outage_retry_after
    assert all(is_outage(e) for e in (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO))
    assert not any(is_outage(e) for e in (errno.EEXIST, errno.ELOOP, errno.EACCES, errno.ENOENT, None))
    delays = [outage_retry_after(None)]
    for _ in range(8):
        delays.append(outage_retry_after(delays[-1]))
    assert delays[:4] == [0.2, 0.4, 0.8, 1.6] and delays[-1] == OUTAGE_RETRY[1] == 5.0
