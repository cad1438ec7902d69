"""The run state machine: every ordering that matters, in microseconds."""
from ringd.core.runstate import (STOP_GRACE, SKIP_GRACE, TERM_SETTLE, Beat, Close, Exited, Phase, Ping, SetPhase, Skip,
                            Stop, Tick, Trigger, WATCHDOG_GRACE, next_deadline, start, step)


def new(**kw):
    args = dict(budget=10.0, stall=20.0, beat_at=5.0, beat_every=5.0)
    args.update(kw)
    return start(0.0, **args)


def run(s, *timeline):
    """Feed (now, event) pairs; return the final state and every action in order."""
    out = []
    for now, ev in timeline:
        s, acts = step(s, ev, now)
        out += acts
    return s, out


def closes(actions):
    return [a for a in actions if isinstance(a, Close)]


def kinds(actions):
    return [type(a).__name__ for a in actions if not isinstance(a, Beat) and type(a).__name__ != "Log"]


def test_an_agent_that_exits_by_itself():
    s, acts = run(new(), (1.0, Exited(0, None)))
    assert kinds(acts) == ["KillTree", "Close"]   # nothing it started survives it
    assert closes(acts)[0].status == "ok" and closes(acts)[0].source == "driver"
    assert run(new(), (1.0, Exited(75, None)))[1][-1].status == "deferred"
    assert run(new(), (1.0, Exited(3, None)))[1][-1].status == "failed"


def test_beats_keep_their_rhythm():
    s = new()
    assert next_deadline(s) == 5.0
    s, acts = step(s, Tick(), 5.0)
    assert acts == [Beat()] and next_deadline(s) == 10.0   # the budget and the next beat coincide
    s, acts = step(s, Tick(), 10.0)
    assert kinds(acts) == ["Term"] and Beat() in acts and next_deadline(s) == 15.0


def test_budget_then_exit_is_a_timeout_and_budget_then_stall_is_stalled():
    s, acts = run(new(), (10.0, Tick()), (11.0, Exited(None, 15)))
    assert kinds(acts) == ["Term", "KillTree", "Close"] and closes(acts)[0].status == "timeout"
    assert closes(acts)[0].reason == "run budget of 10s reached"
    s, acts = run(new(), (10.0, Tick()), (20.0, Tick()), (20.01, Exited(None, 9)))
    assert kinds(acts) == ["Term", "KillTree", "KillTree", "Close"]
    assert closes(acts)[0].status == "stalled" and closes(acts)[0].reason == "no exit 20s after start"


def test_a_stall_at_the_same_instant_as_an_exit_is_the_agents_own_ending():
    # the hop feeds the exit first when both are seen in one wake
    s, acts = run(new(), (20.0, Exited(0, None)), (20.0, Tick()))
    assert [c.status for c in closes(acts)] == ["ok"] and kinds(acts) == ["KillTree", "Close"]


def test_exit_zero_seen_with_a_stop_is_never_interrupted():
    s, acts = run(new(), (3.0, Exited(0, None)), (3.0, Stop()))
    assert [c.status for c in closes(acts)] == ["ok"]


def test_stop_terms_then_kills_after_its_grace():
    s, acts = run(new(), (3.0, Stop()))
    assert kinds(acts) == ["Term"] and s.kill_at == 3.0 + STOP_GRACE and next_deadline(s) == 5.0  # a beat first
    s, acts = run(s, (3.0 + STOP_GRACE, Tick()), (3.0 + STOP_GRACE, Exited(None, 9)))
    assert kinds(acts) == ["KillTree", "KillTree", "Close"]
    c = closes(acts)[0]
    assert c.status == "interrupted" and c.source == "driver" and c.reason == "driver stopping"


def test_a_skip_during_the_budgets_grace_is_a_skip():
    s, acts = run(new(), (10.0, Tick()), (12.0, Skip()), (12.0 + SKIP_GRACE, Tick()), (12.6, Exited(None, 9)))
    c = closes(acts)[0]
    assert c.status == "skipped" and c.source == "operator"
    assert kinds(acts) == ["Term", "Term", "KillTree", "KillTree", "Close"]


def test_a_stop_during_a_skips_grace_keeps_it_skipped():
    s, acts = run(new(), (3.0, Skip()), (3.1, Stop()), (3.2, Exited(None, 15)))
    assert closes(acts)[0].status == "skipped"
    assert kinds(acts) == ["Term", "KillTree", "Close"]   # no second SIGTERM


def test_a_skip_during_a_stop_changes_nothing():
    s, acts = run(new(), (3.0, Stop()), (3.1, Skip()), (3.2, Exited(None, 15)))
    assert closes(acts)[0].status == "interrupted"


def test_a_stop_during_the_budgets_grace_keeps_the_timeout_and_shortens_the_wait():
    s, _ = run(new(), (10.0, Tick()), (11.0, Stop()))
    assert s.kill_at == 11.0 + STOP_GRACE and next_deadline(s) == 11.0 + STOP_GRACE
    s, acts = run(s, (11.5, Exited(None, 15)))
    assert closes(acts)[0].status == "timeout"


def test_the_watchdog_starves_into_a_stall_unless_pinged():
    s = new(watchdog=2.0)
    s, acts = run(s, (1.5, Ping()), (3.0, Tick()))
    assert kinds(acts) == []
    assert next_deadline(s) == 3.5
    s, acts = run(s, (3.5, Tick()), (3.6, Exited(None, 15)))
    c = closes(acts)[0]
    assert kinds(acts) == ["Term", "KillTree", "Close"]
    assert c.status == "stalled" and c.reason.startswith("watchdog:")


def test_the_watchdog_starves_no_run_the_budget_is_already_ending():
    """After the budget's SIGTERM the run is ending (the first ending decided
    stays decided): an agent cleaning up without pinging - as systemd, which
    stops watching a service once it is stopping, lets it - keeps its grace up to
    the stall threshold and ends ``timeout``, never ``stalled`` by a watchdog."""
    s, acts = run(new(watchdog=2.0), (9.5, Ping()), (10.0, Tick()))
    assert kinds(acts) == ["Term"] and next_deadline(s) == 15.0   # the next beat, not 11.5
    s, acts = run(s, (11.5, Tick()), (13.0, Tick()), (14.0, Exited(None, 15)))
    c = closes(acts)[0]
    assert kinds(acts) == ["KillTree", "Close"]
    assert c.status == "timeout" and c.reason == "run budget of 10s reached"


def test_watchdog_trigger_ends_the_run_as_a_starved_watchdog_with_or_without_one():
    for watchdog in (None, 30.0):
        s, acts = run(new(watchdog=watchdog), (1.0, Trigger()))
        assert kinds(acts) == ["Term"] and next_deadline(s) == 1.0 + WATCHDOG_GRACE
        s, acts = run(s, (1.0 + WATCHDOG_GRACE, Tick()), (1.6, Exited(None, 9)))
        c = closes(acts)[0]
        assert kinds(acts) == ["KillTree", "KillTree", "Close"]
        assert c.status == "stalled" and c.reason.startswith("watchdog:") and "WATCHDOG=trigger" in c.reason
    # an ending already decided stays (a skip is a skip)
    s, _ = run(new(), (1.0, Skip()))
    s, acts = run(s, (1.1, Trigger()), (1.2, Exited(None, 15)))
    assert closes(acts)[0].status == "skipped"


def test_phase_is_kept():
    # (cut to 200 characters where it is heard: notify.clean_phase, tests/system/test_notify.py)
    s, acts = step(new(), Phase("x" * 200), 1.0)
    assert s.phase == "x" * 200 and acts == [SetPhase("x" * 200)]


def test_nothing_after_close():
    s, _ = run(new(), (1.0, Exited(0, None)))
    assert step(s, Tick(), 100.0) == (s, [])
    assert step(s, Stop(), 100.0) == (s, [])


def test_a_stall_the_agent_beat_by_exiting_is_its_own_ending():
    # termed at the budget, it exits from that SIGTERM just as the stall threshold falls due
    s, acts = run(new(), (10.0, Tick()), (20.0, Tick()), (20.0, Exited(None, 15)))
    assert closes(acts)[0].status == "timeout"


def test_a_leader_that_outlives_sigkill_is_closed_a_bounded_while_after_the_kill():
    from ringd.core.runstate import UNKILLABLE_WAIT
    # stalled: killed at 20, no exit ever (uninterruptible sleep) -> closed at 20 + UNKILLABLE_WAIT
    s, acts = run(new(beat_at=1e9), (20.0, Tick()))
    assert kinds(acts) == ["KillTree"] and next_deadline(s) == 20.0 + UNKILLABLE_WAIT
    s, acts = run(s, (20.0 + UNKILLABLE_WAIT - 0.1, Tick()))
    assert not closes(acts)
    s, acts = run(s, (20.0 + UNKILLABLE_WAIT, Tick()), (21.0 + UNKILLABLE_WAIT, Exited(None, 9)))
    assert kinds(acts) == ["Close"] and s.closed   # closed once; the late exit changes nothing
    c = closes(acts)[0]
    assert c.status == "stalled" and c.exit_code is None and "did not die of SIGKILL" in c.reason
    # a skip's or a stop's kill that does not land ends the same way, as that ending
    for ev, status, source in ((Skip(), "skipped", "operator"), (Stop(), "interrupted", "driver")):
        s, acts = run(new(beat_at=1e9), (1.0, ev), (1.0 + STOP_GRACE, Tick()),
                      (1.0 + STOP_GRACE + UNKILLABLE_WAIT, Tick()))
        c = closes(acts)[0]
        assert (c.status, c.source) == (status, source), c


def test_a_death_by_sigterm_heard_with_the_drivers_stop_is_interrupted():
    """A service manager stopping the unit SIGTERMs the agent and the driver at
    once: the agent's death may come first, in the same wake or just before."""
    for timeline in ([(3.0, Exited(None, 15)), (3.0, Stop())],
                     [(3.0, Exited(None, 15)), (3.0, Tick()), (3.0 + TERM_SETTLE / 2, Stop())],
                     [(3.0, Exited(143, None)), (3.1, Stop())]):          # a shell's report of it
        s, acts = run(new(), *timeline)
        (c,) = closes(acts)
        assert (c.status, c.source, c.reason) == ("interrupted", "driver", "driver stopping"), timeline
        assert s.closed and kinds(acts) == ["KillTree", "KillTree", "Close"]   # its tree at once, and at the close


def test_a_death_by_sigterm_without_a_stop_is_the_agents_own_after_the_settle():
    s, acts = run(new(), (3.0, Exited(None, 15)), (3.0, Tick()))
    assert closes(acts) == [] and next_deadline(s) == 3.0 + TERM_SETTLE
    s, acts = run(s, (3.0 + TERM_SETTLE / 2, Skip()), (3.0 + TERM_SETTLE / 2, Ping()),
                  (3.0 + TERM_SETTLE, Tick()))
    (c,) = closes(acts)
    assert (c.status, c.signal, c.source) == ("failed", 15, "driver")   # a skip after its death changes nothing
    assert run(s, (4.0, Stop()))[1] == []                               # closed is closed


def test_only_a_sigterm_death_waits_for_the_stop():
    for ev, status in ((Exited(0, None), "ok"), (Exited(1, None), "failed"), (Exited(None, 9), "failed")):
        s, acts = run(new(), (3.0, ev), (3.0, Stop()))
        assert [c.status for c in closes(acts)] == [status]
    # an ending the driver chose stays its own: the budget's SIGTERM, a skip
    s, acts = run(new(), (10.0, Tick()), (10.5, Exited(None, 15)))
    assert [c.status for c in closes(acts)] == ["timeout"]
    s, acts = run(new(), (3.0, Skip()), (3.1, Exited(None, 15)))
    assert [c.status for c in closes(acts)] == ["skipped"]


def test_beats_go_on_while_a_sigterm_death_settles():
    s = new(beat_at=3.2, beat_every=5.0)
    s, acts = run(s, (3.0, Exited(None, 15)))
    assert next_deadline(s) == 3.2
    s, acts = step(s, Tick(), 3.2)
    assert acts == [Beat()]
