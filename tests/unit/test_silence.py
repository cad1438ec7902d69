"""Silence and long pauses (ringd.core.silence): the pure rules on a fake clock,
and the driver raising one alert per silence on a real journal (FakeEnv)."""
from __future__ import annotations

import dataclasses
import signal

from fakeenv import WALL0, Behaviour, make_driver
from ringd.core.records import AgentState
from ringd.core.settings import AlertSettings
from ringd.core.silence import (PAUSED_TOO_LONG, RING, SILENT, alerts_due, mark_key, pauses_too_long,
                                silent_agents, silent_for, silent_since)


def st(name="a", ok=None, joined=None) -> AgentState:
    return AgentState(name=name, last_ok_at=ok, joined_at=joined)


def test_silence_counts_from_the_last_ok_run_or_the_join_whichever_is_later():
    assert silent_since(st(ok=None, joined=100.0)) == 100.0          # never ok: from the join
    assert silent_since(st(ok=500.0, joined=100.0)) == 500.0         # from its last ok run
    assert silent_since(st(ok=50.0, joined=100.0)) == 100.0          # an old ok run, then it (re)joined
    assert silent_since(st(ok=500.0, joined=None)) is None           # not on the roster the driver runs
    assert silent_since(None) is None


def test_silent_once_the_quiet_reaches_silent_after_and_never_when_off():
    a = st(ok=1000.0, joined=10.0)
    assert silent_for(a, 1000.0 + 59.9, 60) is None
    assert silent_for(a, 1000.0 + 60, 60) == 60
    assert silent_for(a, 1000.0 + 86400, None) is None               # alerts.silent_after: null
    states = {"a": a, "b": st("b", ok=1050.0, joined=10.0), "gone": st("gone", ok=0.0, joined=None)}
    assert silent_agents(states, ["a", "b", "gone", "new"], 1100.0, 60) == {"a": 1000.0}
    assert silent_agents(states, ["a"], 1100.0, None) == {}


def test_a_pause_is_too_long_only_past_the_limit():
    pauses = {RING: 100.0, "web": 900.0}
    assert pauses_too_long(pauses, 1000.0, 500) == {RING: 100.0}
    assert pauses_too_long(pauses, 1000.0, None) == {}
    assert pauses_too_long(pauses, 600.0, 500) == {}


def test_one_alert_per_silence_until_an_ok_run_ends_it():
    """A silence alerts once, however often it is looked at; an ok run ends it
    (its mark goes); the next silence, from that ok run, alerts again."""
    marks: dict = {}
    fired = []
    clock = [(2000.0, {"a": 1000.0}), (2010.0, {"a": 1000.0}), (5000.0, {"a": 1000.0}),
             (5100.0, {}),                      # a ran ok at 5050: no longer silent
             (9000.0, {"a": 5050.0}),           # silent again, counted from that ok run
             (9010.0, {"a": 5050.0})]
    for _now, silent in clock:
        due = alerts_due(silent, {}, marks)
        fired += due.fire
        marks = due.marks
    assert fired == [(SILENT, "a", 1000.0), (SILENT, "a", 5050.0)]


def test_a_long_pause_alerts_once_and_a_new_pause_again():
    marks: dict = {}
    fired = []
    for paused in ({RING: 10.0}, {RING: 10.0, "web": 20.0}, {RING: 10.0, "web": 20.0}, {}, {RING: 99.0}):
        due = alerts_due({}, paused, marks)
        fired += due.fire
        assert due.changed == bool(due.fire) or set(due.marks) != set(marks)
        marks = due.marks
    assert fired == [(PAUSED_TOO_LONG, RING, 10.0), (PAUSED_TOO_LONG, "web", 20.0), (PAUSED_TOO_LONG, RING, 99.0)]
    assert marks == {mark_key(PAUSED_TOO_LONG, RING): 99.0}


def test_nothing_to_change_is_no_write():
    due = alerts_due({"a": 1.0}, {}, {mark_key(SILENT, "a"): 1.0})
    assert (due.fire, due.changed) == ([], False)


# --- the driver, on a fake clock and a real journal -------------------------------------------

def silence_driver(tmp_path, names, behaviours, **alerts):
    d, env, j = make_driver(tmp_path, names, behaviours, heartbeat_interval=1.0)
    d.config = dataclasses.replace(d.config, alerts=AlertSettings(**alerts))
    raised = []

    def alert(kind, agent, detail, **extra):
        if kind in (SILENT, PAUSED_TOO_LONG):   # (not the failures-in-a-row ones)
            raised.append((env.t, kind, agent, detail, extra))
    d.alert = alert
    return d, env, j, raised


def test_the_driver_raises_one_silent_alert_per_silence_and_an_ok_run_ends_it(tmp_path):
    """``bad`` fails at every run from the start: silent 30 s after it joined
    the roster, alerted once however many beats look again; it then succeeds
    once (the silence ends), fails again, and is silent again 30 s after that
    ok run - a second alert. ``good`` is never silent."""
    behaviours = {"bad": Behaviour(runs_for=2.0, code=1), "good": Behaviour(runs_for=2.0, code=0)}
    d, env, j, raised = silence_driver(tmp_path, ["bad", "good"], behaviours, silent_after=30.0)
    env.at(60.0, lambda: behaviours.__setitem__("bad", Behaviour(runs_for=2.0, code=0)))
    env.at(65.0, lambda: behaviours.__setitem__("bad", Behaviour(runs_for=2.0, code=1)))
    env.send(140.0, signal.SIGTERM)
    d.run()
    silent = [(t, agent) for t, kind, agent, _, _ in raised if kind == SILENT]
    assert [agent for _, agent in silent] == ["bad", "bad"], raised
    first, second = silent[0][0], silent[1][0]
    assert 30.0 <= first <= 30.0 + 2.5           # within a beat (and a hop) of the 30 s
    ok_end = j.agent_state("bad").last_ok_at - WALL0
    assert 60.0 <= ok_end <= 67.0 and ok_end + 30.0 <= second <= ok_end + 30.0 + 2.5
    assert all(extra["seconds"] >= 30.0 for _, kind, _, _, extra in raised if kind == SILENT)
    kinds = [e.kind for e in j.events_before(None, "bad", 10_000)]
    assert kinds.count(SILENT) == 2              # and each is in the event trail


def test_a_restarted_driver_does_not_raise_the_same_silence_again(tmp_path):
    behaviours = {"bad": Behaviour(runs_for=2.0, code=1)}
    d, env, j, raised = silence_driver(tmp_path, ["bad"], behaviours, silent_after=10.0)
    env.send(30.0, signal.SIGTERM)
    d.run()
    assert [k for _, k, *_ in raised] == [SILENT]
    j.close()
    d2, env2, j2, raised2 = silence_driver(tmp_path, ["bad"], behaviours, silent_after=10.0)
    env2.t = 40.0   # (its clock goes on from the first driver's)
    env2.send(80.0, signal.SIGTERM)
    d2.run()
    assert raised2 == []


def test_a_pause_older_than_paused_longer_than_raises_one_alert(tmp_path):
    d, env, j, raised = silence_driver(tmp_path, ["a"], {"a": Behaviour(runs_for=1.0)}, paused_longer_than=20.0)
    env.at(5.0, lambda: j.set_paused(None, True, now=env.wall()))
    env.send(60.0, signal.SIGTERM)
    d.run()
    assert [(k, agent) for _, k, agent, _, _ in raised] == [(PAUSED_TOO_LONG, None)]
    assert 25.0 <= raised[0][0] <= 25.0 + 1.5 and "ringd resume" in raised[0][3]


def test_off_means_no_journal_read(tmp_path):
    d, env, j, raised = silence_driver(tmp_path, ["a"], {"a": Behaviour(runs_for=1.0, code=1)})
    j.snapshot = None   # any look at the journal for silence would fail here
    env.send(20.0, signal.SIGTERM)
    d.run()
    assert raised == []


def test_a_journal_replaced_under_the_driver_learns_the_roster_s_joins_again(tmp_path):
    """journal.db removed to start afresh: the new journal knows no join, so no
    silence could be counted from one until the roster changed again."""
    import os
    from ringd.journal.sqlite import Journal
    slow = Behaviour(runs_for=1.0)
    d, env, j, raised = silence_driver(tmp_path, ["a", "b"], {"a": slow, "b": slow}, silent_after=10.0)
    env.at(3.0, lambda: os.unlink(tmp_path / "journal.db"))
    env.send(8.0, signal.SIGTERM)
    d.run()
    fresh = Journal.open_readonly(tmp_path)
    try:
        assert all(st.joined_at is not None for st in fresh.agent_states().values())
        assert set(fresh.agent_states()) == {"a", "b"}
    finally:
        fresh.close()
