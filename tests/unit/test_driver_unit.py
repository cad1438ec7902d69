"""The driver loop and the hop against a scripted environment (tests/fakeenv.py):
a fake clock, scripted agents and signals, a real SQLite journal in tmp_path.
Each test runs minutes of ring time in milliseconds."""
import json
import os
import signal

import pytest

from fakeenv import RING, WALL0, Behaviour, FakeEnv, make_driver
from ringd.inputs.config import AgentOverride, Config, RingSettings
from ringd.loops.driver import Driver
from ringd.core.errors import EX_CONFIG
from ringd.journal.sqlite import Journal, JournalError
from ringd.inputs.roster import RosterSource
from ringd.host.notify import IDLE_SOCKET

make = make_driver


def rows(journal):
    return journal.history(limit=100000)[::-1]


def test_a_sigterm_between_runs_starts_no_further_run(tmp_path):
    d, env, j = make(tmp_path, "ab")
    env.after_run.append((7, signal.SIGTERM))   # lands after the 7th run ended, before the 8th
    assert d.run() == 0
    assert [r.status for r in rows(j)] == ["ok"] * 7
    assert env.beats[-1][1].get("stopped") is True


def test_an_unstartable_ring_backs_off_beats_and_hears_sigterm(tmp_path):
    d, env, j = make(tmp_path, "ab", default=Behaviour(cannot_start=True))
    env.send(60.0, signal.SIGTERM)
    assert d.run() == 0
    rs = rows(j)
    assert {r.status for r in rs} == {"error"}
    assert len(rs) <= 2 * (1 + 60 / 5)            # back-off: 5 s, doubling, capped at 8 s
    assert env.t < 61.0                           # the SIGTERM was acted on within a second
    gaps = [b - a for (a, _), (b, _) in zip(env.beats, env.beats[1:])]
    assert max(gaps) <= 1.0 + 1e-9                # beats every heartbeat while idle
    assert sum("nothing to run" in m for _, m in env.logs) <= len(rs)


def test_a_ring_whose_every_run_fails_at_once_does_not_spin(tmp_path):
    d, env, j = make(tmp_path, "abc", default=Behaviour(runs_for=0.001, code=1), backoff_max=16.0)
    env.send(120.0, signal.SIGTERM)
    d.run()
    rs = rows(j)
    assert len(rs) / 120 < 2                      # under 2 rows/s averaged over the run
    waits = [m for _, m in env.logs if "failed within" in m]
    assert len(waits) == 1                        # said once


def test_a_fast_ok_ring_keeps_beating_and_is_never_stale(tmp_path):
    d, env, j = make(tmp_path, "ab", default=Behaviour(runs_for=0.01))
    env.send(3.0, signal.SIGTERM)
    d.run()
    times = [t for t, _ in env.beats]
    assert len(times) >= 3 and max(b - a for a, b in zip(times, times[1:])) <= 1.0 + 0.011
    assert len(rows(j)) > 200


def test_exit_zero_at_the_moment_of_a_sigterm_is_ok(tmp_path):
    d, env, j = make(tmp_path, "a", default=Behaviour(runs_for=2.0))
    env.send(2.0, signal.SIGTERM)
    d.run()
    assert [r.status for r in rows(j)] == ["ok"]


def test_an_agent_sigtermed_with_its_driver_is_interrupted_whichever_death_is_seen_first(tmp_path):
    """systemctl stop (KillMode=control-group) SIGTERMs the agent and the driver at
    once: the agent's death can be seen with, or just before, the driver's own
    signal. The run is interrupted, never failed: the agent did nothing wrong."""
    for lag in (0.0, 0.05, 0.4):
        (tmp_path / f"lag{lag}").mkdir()
        d, env, j = make(tmp_path / f"lag{lag}", "a", default=Behaviour(runs_for=5.0, code=None, signal=signal.SIGTERM))
        env.send(5.0 + lag, signal.SIGTERM)
        assert d.run() == 0
        (r,) = rows(j)
        assert (r.status, r.signal) == ("interrupted", signal.SIGTERM), lag
        assert j.agent_state("a").consecutive_failures == 0 and j.agent_state("a").bad_streak == 0


def test_an_agent_sigtermed_by_someone_else_while_the_driver_goes_on_is_failed(tmp_path):
    d, env, j = make(tmp_path, "a", default=Behaviour(runs_for=5.0, code=None, signal=signal.SIGTERM))
    env.send(7.0, signal.SIGTERM)
    d.run()
    first = rows(j)[0]
    assert (first.status, first.signal) == ("failed", signal.SIGTERM)
    assert j.agent_state("a").consecutive_failures >= 1


def test_sigterm_mid_run_interrupts_and_counts_nothing(tmp_path):
    d, env, j = make(tmp_path, "a", default=Behaviour(runs_for=100.0))
    env.send(2.0, signal.SIGTERM)
    d.run()
    (r,) = rows(j)
    assert r.status == "interrupted" and env.t < 2.0 + 3.5
    assert j.agent_state("a").consecutive_failures == 0 and j.agent_state("a").bad_streak == 0


def test_roster_edit_is_read_while_everything_backs_off(tmp_path):
    d, env, j = make(tmp_path, "a", default=Behaviour(cannot_start=True), backoff_initial=3600.0,
                     backoff_max=3600.0)
    def edit():
        (tmp_path / "ring.txt").write_text("a /bin/a\nb /bin/b\n")
    env.at(30.0, edit)
    env.send(40.0, signal.SIGTERM)
    env.behaviours["b"] = Behaviour(runs_for=0.5)
    d.run()
    b = [r for r in rows(j) if r.agent == "b"]
    assert b and b[0].started_at - 2_000_000_000.0 <= 31.0 + 1e-6   # within a heartbeat of the edit


def test_a_changed_line_lifts_an_error_back_off(tmp_path):
    d, env, j = make(tmp_path, "a", default=Behaviour(cannot_start=True), backoff_initial=3600.0,
                     backoff_max=3600.0)
    def fix():
        (tmp_path / "ring.txt").write_text("a /bin/a --fixed\n")
        env.default = Behaviour(runs_for=0.5)
    env.at(30.0, fix)
    env.send(40.0, signal.SIGTERM)
    d.run()
    assert [r.status for r in rows(j)][:2] == ["error", "ok"]


def test_stalled_and_timeout_runs(tmp_path):
    d, env, j = make(tmp_path, "ab", {"a": Behaviour(runs_for=100.0, term_delay=None),
                                      "b": Behaviour(runs_for=100.0, term_delay=1.0)}, once=True)
    d.run()
    a, b = rows(j)
    assert (a.status, a.signal) == ("stalled", signal.SIGKILL) and a.duration == pytest.approx(15.0)
    assert (b.status, b.signal) == ("timeout", signal.SIGTERM) and b.duration == pytest.approx(11.0)


class BrokenJournal:
    """A journal whose writes fail (unusable) once armed: the run in flight must
    still be supervised to its end before the driver gives up."""

    def __init__(self, journal):
        self._j, self.armed = journal, False

    def __getattr__(self, name):
        return getattr(self._j, name)

    def transaction(self, patient=True):
        if self.armed:
            raise JournalError("journal.db: database disk image is malformed", transient=False)
        return self._j.transaction(patient)


def test_an_unusable_journal_mid_run_stops_the_agent_first_then_exits_78(tmp_path):
    d, env, j = make(tmp_path, "a", default=Behaviour(runs_for=5.0))
    d.journal = broken = BrokenJournal(j)
    env.at(1.0, lambda: setattr(broken, "armed", True))
    assert d.run() == EX_CONFIG
    (child,) = env.children
    assert child.exit_at == pytest.approx(5.0) and env.t >= 5.0   # it ran to its end, supervised
    assert any("journal unusable" in m for _, m in env.logs)


class LockedForPidRecords:
    """Another process holds the journal's write lock until ``until``: a write
    that must not wait for it (``patient=False``) fails busy meanwhile."""

    def __init__(self, journal, env, until):
        self._j, self._env, self.until, self.impatient = journal, env, until, []

    def __getattr__(self, name):
        return getattr(self._j, name)

    def transaction(self, patient=True):
        if not patient:
            self.impatient.append(self._env.t)
            if self._env.t < self.until:
                raise JournalError("journal.db: journal is busy: another process holds its write lock",
                                   transient=True)
        return self._j.transaction(patient)


def test_a_pid_record_the_journal_cannot_take_now_is_tried_again_later_never_waited_for(tmp_path):
    """The agent's pid is written 0.1 s into its run without waiting for the
    journal's write lock (the budget comes first: see test_driver.py), and tried
    again each second until it is written, while the run goes on; said once."""
    d, env, j = make(tmp_path, "a", default=Behaviour(runs_for=3.5), once=True)
    d.journal = locked = LockedForPidRecords(j, env, until=2.5)
    on_row = []
    env.at(3.3, lambda: on_row.append(Journal.open(tmp_path).running_row()))
    d.run()
    assert locked.impatient == pytest.approx([0.1, 1.1, 2.1, 3.1])
    (row,) = on_row
    assert row.pid == env.children[0].pid, "recorded while the run went on"
    said = [m for _, m in env.logs if "pid" in m]
    assert len([m for m in said if "cannot record its pid yet" in m]) == 1 and any("pid recorded" in m for m in said)
    assert [r.status for r in rows(j)] == ["ok"]


class ScriptedLock:
    path = "ringd.lock"

    def __init__(self, verdicts):
        self.verdicts = verdicts

    def verify(self):
        return self.verdicts(self)


def test_a_lock_lost_for_a_moment_is_not_a_loss_but_a_lasting_one_stops_the_driver(tmp_path):
    from ringd.core.errors import EX_TEMPFAIL
    d, env, j = make(tmp_path, "a", default=Behaviour(runs_for=100.0))
    d.lock = ScriptedLock(lambda _l: "lost" if 3.0 <= env.t < 3.5 else "ok")   # a second driver backing off
    env.send(10.0, signal.SIGTERM)
    assert d.run() == 0
    d, env, j = make(tmp_path / "x" if (tmp_path / "x").mkdir() is None else None, "a",
                     default=Behaviour(runs_for=100.0))
    d.lock = ScriptedLock(lambda _l: "lost" if env.t >= 3.0 else "ok")
    assert d.run() == EX_TEMPFAIL
    assert 4.0 <= env.t <= 4.0 + 3.5          # gave way after the grace, its agent stopped first
    assert [r.status for r in rows(j)] == ["interrupted"]


class CountingJournal:
    """Counts the journal's write transactions (each one commit)."""

    def __init__(self, journal):
        self._j, self.commits = journal, 0

    def __getattr__(self, name):
        return getattr(self._j, name)

    def transaction(self, patient=True):
        self.commits += 1
        return self._j.transaction(patient)


def test_an_ordinary_hop_is_one_commit_and_a_run_ends_on_disk_before_the_next_starts(tmp_path):
    """Issue 12: the end of run N is committed in the transaction that starts run
    N+1 - still before N+1's process starts - so an ordinary hop costs one commit."""
    d, env, j = make(tmp_path, "abcdef", once=True)
    d.journal = counting = CountingJournal(j)
    reader = Journal.open(tmp_path)
    seen = []   # at each spawn: (commits so far, running rows on disk, statements so far)
    statements = []

    def traced(sql):   # the trace repeats a statement once per trigger it fires: each counts once
        if not sql.startswith(("--", "BEGIN", "COMMIT")) and (not statements or statements[-1] != sql):
            statements.append(sql)
    j.con.set_trace_callback(traced)
    spawn = env.spawn

    def spawn_and_look(argv, **kw):
        seen.append((counting.commits, [(r.id, r.agent) for r in reader.history(limit=100) if r.status == "running"],
                     len(statements)))
        return spawn(argv, **kw)
    env.spawn = spawn_and_look
    assert d.run() == 0
    assert [r.status for r in rows(j)] == ["ok"] * 6, "the last end is committed at the stop"
    for (commits, running, _), agent in zip(seen, "abcdef"):
        assert [a for _, a in running] == [agent], "only the run about to start is running on disk"
    gaps = [b[0] - a[0] for a, b in zip(seen, seen[1:])]
    assert gaps == [1] * 5, f"commits between two starts: {gaps}"
    # the last end, the controls, the next agent's state and start, both events; an ok run of a
    # healthy agent leaves its decided state as it was, so the agent's row is not written again
    per_hop = [b[2] - a[2] for a, b in zip(seen, seen[1:])]
    assert per_hop == [6] * 5, (per_hop, statements[seen[1][2]:seen[2][2]])


def test_a_runs_files_are_made_only_once_its_row_is_committed(tmp_path):
    """The run's log, notify socket and cgroup are made after the transaction
    that writes its row has committed, just before the spawn: a commit that
    fails leaves none behind, and the retried turn makes them under the same
    run id. (Made during the commit by a helper thread until 2026-12-02: each
    hop then paid more in cross-core wake-ups than the overlap saved.)"""
    from contextlib import contextmanager
    from ringd.host.env import RealEnv

    roster = tmp_path / "ring.txt"
    roster.write_text("a /bin/true\n")
    roster.chmod(0o600)
    src = RosterSource(roster)
    src.refresh(force=True)
    journal = Journal.open(tmp_path)
    reader = Journal.open(tmp_path)
    seen, on_disk = [], []

    class FailsFirstCommit:
        def __init__(self, j):
            self._j, self.calls = j, 0

        def __getattr__(self, name):
            return getattr(self._j, name)

        @contextmanager
        def transaction(self, patient=True):
            self.calls += 1
            # the parked notify socket (notify-idle.sock) is the driver's, not a run's
            seen.append(sorted(p.name for p in tmp_path.rglob("*")
                               if p.suffix in (".log", ".sock") and p.name != IDLE_SOCKET) + run_cgroups())
            with self._j.transaction() as tx:
                yield tx
                if self.calls == 1:
                    raise JournalError("journal.db: database or disk is full", transient=True)

    env = RealEnv(tmp_path, lambda m, level: None)
    parent, prefix = env.containment.parent, env.containment.prefix

    def run_cgroups():
        return [] if parent is None else [p for p in os.listdir(parent) if p.startswith(prefix)]
    real_open_run_log = env.open_run_log

    def open_run_log(agent, run_id):
        row = reader.run(run_id)   # another connection: what is on disk
        on_disk.append(None if row is None else row.status)
        return real_open_run_log(agent, run_id)
    env.open_run_log = open_run_log
    cfg = Config(ring=RingSettings(**{**RING, "heartbeat_interval": 0.2}))
    d = Driver(env, tmp_path, None, cfg, src, FailsFirstCommit(journal), once=True)
    try:
        assert d.run() == 0
    finally:
        env.close()
        reader.close()
    (row,) = rows(journal)
    assert row.status == "ok"
    assert seen[1] == [], f"files or cgroups of the uncommitted run were left: {seen[1]}"
    assert on_disk == ["running"]
    assert (tmp_path / "logs" / "a" / f"{row.id}.log").exists()
    assert not (tmp_path / IDLE_SOCKET).exists()   # the driver's close removes it


def test_the_last_runs_end_is_said_before_the_next_start_and_after_its_spawn(tmp_path):
    """The previous run's log line (and alerts) are done once the next agent is
    spawned (Hop.after_start), yet the log still reads in order."""
    d, env, j = make(tmp_path, "abc", once=True, default=Behaviour(runs_for=0.5))
    spawned_before_said = []
    real_spawn = env.spawn

    def spawn(*a, **k):
        child = real_spawn(*a, **k)
        spawned_before_said.append((int(k["env"]["RING_RUN_ID"]), len([m for _, m in env.logs if " ok " in f"{m} "])))
        return child
    env.spawn = spawn
    assert d.run() == 0
    said = [m for _, m in env.logs if m.startswith("run ")]
    assert [m.split(":")[0] for m in said] == ["run 1", "run 1", "run 2", "run 2", "run 3", "run 3"]
    assert [("started" in m, "ok" in m) for m in said] == [(True, False), (False, True)] * 3
    # run 2 was spawned before run 1's end was said; run 3 before run 2's
    assert spawned_before_said == [(1, 0), (2, 0), (3, 1)]


def test_a_follow_up_that_raises_after_the_spawn_never_leaves_the_agent_unsupervised(tmp_path):
    """The last run's follow-up (log line, alerts) runs once the next agent is
    started; if it raises, that agent is still supervised to its end (reaped)
    before the error surfaces, never left running without a driver."""
    d, env, j = make(tmp_path, "ab", once=True, default=Behaviour(runs_for=0.5))
    real = d.after_run
    calls = []

    def after_run(result):
        calls.append(result.run_id)
        if len(calls) == 1:
            raise RuntimeError("stderr is gone")
        real(result)
    d.after_run = after_run
    with pytest.raises(RuntimeError, match="stderr is gone"):
        d.run()
    assert len(env.children) == 2 and env.children[1].exit_at <= env.t   # run 2's agent ran to its end
    assert env.reaped == [c.pid for c in env.children]                    # and was reaped


def test_a_slot_missed_while_down_runs_once_at_start(tmp_path):
    """The driver is down for two and a half periods of an ``every: 3`` agent.
    At the restart the job runs at once, and once, not once per missed slot.
    (Was a process test that slept 7.5 s; the rule itself is
    test_schedule.test_slots_missed_while_down_run_once, the wiring of ``every``
    in a real ring test_talk.test_an_every_agent_runs_every_2s_between_fast_agents_never_beside_one.)"""
    d, env, j = make(tmp_path, ["a", "job"], default=Behaviour(runs_for=0.2), agents={"job": AgentOverride(every=3.0)})
    env.send(1.0, signal.SIGTERM)
    assert d.run() == 0
    assert [r.agent for r in rows(j) if r.agent == "job"] == ["job"]
    env.t += 7.5                       # down for two and a half periods
    restarted = env.wall()
    again = Driver(env, tmp_path, None, d.config, d.roster, j)
    env.send(env.t + 4.0, signal.SIGTERM)
    assert again.run() == 0
    jobs = [r.started_at for r in rows(j) if r.agent == "job"]
    assert len(jobs) == 3
    assert jobs[1] - restarted < 0.5         # caught up at once ...
    assert jobs[2] - jobs[1] >= 3.0 - 1e-6   # ... once, not once per missed slot


def test_a_paused_ring_starts_nothing_keeps_beating_and_wakes_on_resume(tmp_path):
    """``ringd pause`` between runs: the ring starts nothing for a minute of fake
    time yet beats every heartbeat; ``ringd resume`` (the journal written, then
    SIGUSR1) starts the next run at once, and the ring goes on from its place.
    (The process test test_controls.test_pause_and_resume_the_ring keeps the
    CLI's side and the pause's survival across a restart.)"""
    d, env, j = make(tmp_path, "abc", default=Behaviour(runs_for=0.5))
    env.at(0.7, lambda: j.set_paused(None, True))          # during b's run (0.5-1.0): b ends by itself
    env.at(61.0, lambda: (j.set_paused(None, False), env.send(61.0, signal.SIGUSR1)))
    env.send(63.0, signal.SIGTERM)
    assert d.run() == 0
    runs = rows(j)
    starts = [(r.agent, r.started_at - WALL0) for r in runs]
    assert [a for a, _ in starts[:2]] == ["a", "b"] and all(r.status == "ok" for r in runs[:2])
    assert not [t for _, t in starts if 0.7 < t < 61.0], starts        # nothing started while paused
    assert starts[2][0] == "c" and 61.0 <= starts[2][1] < 61.1           # at once on resume, from its place
    paused_beats = [t for t, _ in env.beats if 2.0 <= t <= 60.0]
    assert max(b - a for a, b in zip(paused_beats, paused_beats[1:])) <= 1.0 + 1e-9
    assert sum("ring paused by the operator" in m for _, m in env.logs) == 1


def test_a_scheduled_job_that_came_due_during_a_pause_runs_first_on_resume(tmp_path):
    """``ringd pause`` lands while an ``every: 10`` job runs (the ring paused before
    any ordinary turn followed it). Its next slot passes during the pause. On
    ``ringd resume`` it is a due job like any other: it runs at that hop boundary,
    before the ordinary next agent (SPEC "Scheduled agents") - it used to be taken
    for a job "due again" within the round it had run in, and waited for a's run."""
    d, env, j = make(tmp_path, ["a", "b", "job"], default=Behaviour(runs_for=0.5),
                     agents={"job": AgentOverride(every=10.0)})
    env.at(0.2, lambda: j.set_paused(None, True))          # during job's first run (0-0.5)
    env.at(30.0, lambda: (j.set_paused(None, False), env.send(30.0, signal.SIGUSR1)))
    env.send(32.0, signal.SIGTERM)
    assert d.run() == 0
    starts = [(r.agent, r.started_at - WALL0) for r in rows(j)]
    assert starts[0][0] == "job" and not [t for _, t in starts if 0.2 < t < 30.0], starts
    assert starts[1][0] == "job" and 30.0 <= starts[1][1] < 30.1, starts   # first, at once on resume
    assert [a for a, _ in starts[2:4]] == ["a", "b"], starts               # then the ring, from its place


def test_a_schedule_first_seen_during_a_pause_runs_its_slot_that_passed_in_it_on_resume(tmp_path, monkeypatch):
    """A driver starts on a paused ring with a new hourly job (first seen at
    03:33:20). Its first slot, 04:00, passes during the pause: on ``ringd resume``
    (04:03:20) it runs at once, as a slot that came due during a pause does - the
    driver used to record when it first saw the schedule only at an unpaused
    turn, so the job counted from the resume and waited for 05:00."""
    monkeypatch.setenv("TZ", "UTC")
    d, env, j = make(tmp_path, ["a", "job"], default=Behaviour(runs_for=0.5),
                     agents={"job": AgentOverride(schedule="0 * * * *")}, heartbeat_interval=60.0)
    j.set_paused(None, True)
    env.at(1800.0, lambda: (j.set_paused(None, False), env.send(1800.0, signal.SIGUSR1)))
    env.send(1802.0, signal.SIGTERM)
    assert d.run() == 0
    starts = [(r.agent, r.started_at - WALL0) for r in rows(j)]
    assert starts[0][0] == "job" and 1800.0 <= starts[0][1] < 1800.1, starts


def test_containment_is_proven_once_just_before_the_first_run(tmp_path):
    """The proof's cgroup migration waits out the kernel's grace period; the first
    run's step into its cgroup, a grace period later, would wait again. So it is
    proven after everything slow at start-up - the first metrics included - and
    before the first heartbeat, which says what contains the runs."""
    d, env, j = make(tmp_path, "ab", once=True)
    calls = []
    write_metrics = d.write_metrics
    d.write_metrics = lambda *a, **k: (calls.append(("metrics", len(env.proved))), write_metrics(*a, **k))[1]
    assert d.run() == 0
    assert env.proved == [(0, 0)], "once, before any heartbeat and any agent"
    assert calls[0] == ("metrics", 0), "the start-up metrics are written before the proof"
    assert [r.status for r in rows(j)] == ["ok", "ok"]


def test_a_wall_clock_stepped_forward_runs_a_scheduled_job_when_due_on_the_wall_clock(tmp_path):
    """An idle ring sleeps towards a wall-clock due time. The wall clock jumps
    50 minutes ahead meanwhile (NTP, an operator, a resume from suspend: the
    monotonic clock did not move). The job is due on the wall clock 10 minutes
    later and runs then, within a heartbeat - not after the 60 minutes the
    driver first meant to sleep."""
    d, env, j = make(tmp_path, ["job"], agents={"job": AgentOverride(every=3600.0)})
    env.at(10.0, lambda: setattr(env, "wall_step", 3000.0))
    env.send(1200.0, signal.SIGTERM)
    assert d.run() == 0
    starts = [r.started_at - WALL0 for r in rows(j) if r.agent == "job"]
    assert len(starts) == 2, starts
    assert 3600.0 <= starts[1] <= 3600.0 + RING["heartbeat_interval"] + 1e-6, starts   # on the wall clock


def test_a_wall_clock_stepped_back_a_day_stretches_no_back_off_nor_every_schedule(tmp_path):
    """The wall clock is stepped back a day (an operator fixing a clock that ran
    ahead) while agent ``d`` backs off (it defers: exit 75) and an ``every: 30``
    job waits for its next run. Each was set on the old clock, a day ahead of
    the new one; read as it stands (policy.seen_at, schedule.entry), neither
    waits a day: both run again within their longest wait (``backoff_max``, the
    period)."""
    d, env, j = make(tmp_path, ["d", "job"], behaviours={"d": Behaviour(runs_for=0.1, code=75)},
                     default=Behaviour(runs_for=0.1), agents={"job": AgentOverride(every=30.0)})
    env.at(3.0, lambda: setattr(env, "wall_step", -86400.0))
    env.send(60.0, signal.SIGTERM)
    assert d.run() == 0
    after = [r for r in rows(j) if r.started_at < WALL0]   # started on the new clock, a day behind
    assert {r.agent for r in rows(j) if r.started_at >= WALL0} == {"d", "job"}   # both ran before the step
    for name, longest in (("d", RING["backoff_max"]), ("job", 30.0)):
        starts = [r.started_at - WALL0 + 86400.0 for r in after if r.agent == name]   # fake-clock seconds
        assert starts, f"{name} never ran again after the clock stepped back a day"
        assert starts[0] <= 3.0 + longest + RING["heartbeat_interval"] + 1e-6, (name, starts)


def test_a_cron_job_that_never_ran_is_due_at_its_next_match_after_the_clock_stepped_back_a_day(tmp_path):
    """An hourly job first seen at WALL0 (03:33:20 UTC) waits for 04:00. The wall
    clock is stepped back a day meanwhile. It never ran, so it has no slot to run
    twice: it is due at the next full hour of the new clock (SPEC: "at the next
    matching minute"), 04:00 again - the idle driver wakes at the step to look -
    not a day later, when the clock is back where it first saw the schedule; and
    then hourly, never chasing a match it cannot reach."""
    d, env, j = make(tmp_path, ["job"], default=Behaviour(runs_for=0.5),
                     agents={"job": AgentOverride(schedule="0 * * * *")}, heartbeat_interval=60.0)
    env.at(3.0, lambda: setattr(env, "wall_step", -86400.0))
    env.send(4 * 3600.0, signal.SIGTERM)
    assert d.run() == 0
    starts = [r.started_at - WALL0 + 86400.0 for r in rows(j)]   # fake-clock seconds (all on the new clock)
    assert starts and all(r.started_at < WALL0 for r in rows(j)), starts
    assert 1600.0 <= starts[0] <= 1600.0 + 60.0 + 1e-6, starts   # 04:00 on the new clock (a beat is 60 s)
    assert len(starts) >= 3 and all(abs(b - a - 3600.0) < 1.0 for a, b in zip(starts, starts[1:])), starts


@pytest.mark.parametrize("names", [["j1", "j2"], ["a", "j1"]])
def test_once_ends_its_lap_though_a_scheduled_agent_is_due_again(tmp_path, names):
    """``ringd run --once`` (one lap, each agent once) with ``every: 0.5`` jobs
    whose runs last 1 s: each is due again as soon as it ends. The lap still
    ends - each agent ran once - instead of running the job again and again."""
    d, env, j = make(tmp_path, names, once=True, default=Behaviour(runs_for=1.0),
                     agents={n: AgentOverride(every=0.5) for n in names if n.startswith("j")})
    env.send(300.0, signal.SIGTERM)   # a bound: the lap takes 2 s
    assert d.run() == 0
    assert sorted(r.agent for r in rows(j)) == sorted(names) and env.t < 10.0, (env.t, len(rows(j)))


class TakenOver:
    """A many-host driver's leadership just taken over from a lapsed leader
    (the part of ringd.loops.leader.Leader that Driver.lead uses)."""
    took_over = True

    @staticmethod
    def must_stop():
        return False

    def settle_takeover(self, config, on_reaped=None):
        self.took_over = False


def test_a_driver_taking_over_resumes_after_the_last_ordinary_run_not_a_scheduled_one(tmp_path):
    """The newest row is a scheduled agent's run, which is not a turn: a driver
    that takes the lease over resumes after the last ordinary run (b's turn),
    as a driver starting up does - never after the scheduled one (a's again)."""
    d, env, j = make(tmp_path, ["a", "b", "job"], agents={"job": AgentOverride(every=3600.0)})
    with j.transaction() as tx:
        for name, position in (("a", 0), ("job", 2)):
            run_id = tx.start_run(name, position, now=WALL0, run_budget=10.0, stall_threshold=15.0,
                                  driver_pid=1, driver_start=1.0)
            tx.close_run(run_id, "ok", source="driver", now=WALL0 + 1.0, exit_code=0)
    d.leader = TakenOver()
    assert d.lead() is True
    assert d.cursor == ("a", 0)


def test_the_agents_log_dirs_are_listed_once_before_the_first_run(tmp_path):
    """(RealEnv.index_run_logs: back to back at start-up, not one per hop of the first lap)"""
    d, env, j = make(tmp_path, "abc", once=True)
    calls = []
    env.index_run_logs = lambda agents: calls.append((list(agents), len(env.children)))
    assert d.run() == 0
    assert calls == [(["a", "b", "c"], 0)]


@pytest.mark.parametrize("job", [AgentOverride(every=3600.0), AgentOverride(schedule="0 0 1 1 *")])
def test_a_scheduled_job_whose_last_run_was_pruned_is_not_run_again(tmp_path, job):
    """Retention (``ring.keep_runs``) deletes the oldest runs, whoever ran them:
    a fast ring soon prunes an hourly (or yearly) job's last run. The job's last
    start is kept with its schedule, so it is not due again at once - its
    next due time never moves back because history was pruned."""
    d, env, j = make(tmp_path, ["a", "job"], default=Behaviour(runs_for=0.1), agents={"job": job}, keep_runs=5)
    with j.transaction() as tx:   # the yearly job last ran a minute ago (first seen a year back)
        run_id = tx.start_run("job", 1, now=WALL0 - 60.0, run_budget=10.0, stall_threshold=15.0,
                              driver_pid=1, driver_start=1.0)
        tx.close_run(run_id, "ok", source="driver", now=WALL0 - 59.0, exit_code=0)
        tx.set_meta("schedule:job", json.dumps({"spec": d.config.schedule_for("job").describe(),
                                                "since": WALL0 - 366 * 86400.0, "last_wall": None}))
    env.send(30.0, signal.SIGTERM)
    assert d.run() == 0
    assert len(rows(j)) <= 5 + 500 and len(env.children) > 100   # pruned as it went
    assert not [m for _, m in env.logs if m.startswith("job: due")], "the job ran again"


def test_a_ring_of_scheduled_agents_whose_every_run_fails_at_once_does_not_spin(tmp_path):
    """A roster of ``every`` jobs only has no ordinary turn, hence no lap: the
    fast-fail guard, which waits after a lap of runs that all failed at once,
    never engaged, and an ``every: 0.01`` job failing at once wrote a hundred
    rows a second. A scheduled agent due again with no ordinary agent wanting a
    turn starts a new round, which waits like a lap (SPEC: under 2 rows/s);
    a healthy job still runs back to back."""
    d, env, j = make(tmp_path, ["job", "tick"], default=Behaviour(runs_for=0.001, code=1), backoff_max=16.0,
                     agents={"job": AgentOverride(every=0.01), "tick": AgentOverride(every=0.5)})
    env.send(120.0, signal.SIGTERM)
    assert d.run() == 0
    assert len(rows(j)) / 120 < 2, len(rows(j))
    assert {r.agent for r in rows(j)} == {"job", "tick"}
    assert sum("failed within" in m for _, m in env.logs) == 1
    (tmp_path / "ok").mkdir()
    d, env, j = make(tmp_path / "ok", ["job"], default=Behaviour(runs_for=0.2), agents={"job": AgentOverride(every=0.01)})
    env.send(10.0, signal.SIGTERM)
    assert d.run() == 0
    assert len(rows(j)) >= 45


@pytest.mark.parametrize("removed", [["a"], ["a", "b"]])
def test_removing_agents_before_the_running_one_counts_no_lap(tmp_path, removed):
    """Agents ahead of the running one removed mid-lap: the ring goes on after it
    (its next agent now sits at or before the old position) - the same lap, not
    a new one (a lap counted, and ``lap_pause`` waited, for nothing)."""
    d, env, j = make(tmp_path, "abcd", default=Behaviour(runs_for=1.0))
    def edit():
        (tmp_path / "ring.txt").write_text("".join(f"{n} /bin/{n}\n" for n in "abcd" if n not in removed))
    env.at(2.5, edit)                # c is running
    env.send(4.5, signal.SIGTERM)    # d ran (3-4); the next lap began with the first agent left
    d.run()
    assert [r.agent for r in rows(j)] == ["a", "b", "c", "d", "abcd".replace("".join(removed), "")[0]]
    assert d.lap == 2 and j.meta("lap") == "2"


def test_an_agent_put_where_the_running_one_was_runs_in_the_same_lap(tmp_path):
    """The running agent renamed (or removed): the ring goes on from the position
    it held, in the same lap."""
    d, env, j = make(tmp_path, "abc", default=Behaviour(runs_for=1.0))
    env.at(1.5, lambda: (tmp_path / "ring.txt").write_text("a /bin/a\nb2 /bin/b2\nc /bin/c\n"))
    env.send(3.5, signal.SIGTERM)
    d.run()
    assert [r.agent for r in rows(j)] == ["a", "b", "b2", "c"]
    assert d.lap == 1


@pytest.mark.parametrize("running, left, follower", [("c", "bd", "d"), ("b", "cd", "c")])
def test_the_running_agent_removed_with_one_before_it_is_followed_by_its_follower(tmp_path, running, left,
                                                                                  follower):
    """``a b c d``: the running agent and ``a`` before it removed. The ring goes
    on with the agent that followed it, in the same lap - never at the old index
    (past the end of ``b d``: a lap counted and b run again, d passed over; in
    ``c d`` d, c passed over)."""
    d, env, j = make(tmp_path, "abcd", default=Behaviour(runs_for=1.0))
    at = "abcd".index(running) + 0.5
    env.at(at, lambda: (tmp_path / "ring.txt").write_text("".join(f"{n} /bin/{n}\n" for n in left)))
    env.send(at + 1.0, signal.SIGTERM)   # the follower is running
    d.run()
    assert [r.agent for r in rows(j)] == list("abcd"[:"abcd".index(running) + 1]) + [follower]
    assert d.lap == 1


def test_a_lap_that_ends_at_a_restart_is_counted_once(tmp_path):
    """``ringd run --once`` from cron (or any driver restarted after the last
    agent of a lap): the next lap begins with the new driver's first turn. It
    counted no lap - only a turn of its own driver did - so a cron ring of
    ``--once`` runs stayed at lap 1 forever (heartbeat, status, metrics), and a
    restart at the end of a lap skipped ``lap_pause``."""
    d, env, j = make(tmp_path, "abc", once=True)
    assert d.run() == 0
    laps = [d.lap]
    for _ in range(2):
        again = Driver(env, tmp_path, None, d.config, d.roster, j, once=True)
        assert again.run() == 0
        laps.append(again.lap)
    assert laps == [1, 2, 3] and j.meta("lap") == "3"
    assert [r.agent for r in rows(j)] == list("abc" * 3)
    tail = Driver(env, tmp_path, None, d.config, d.roster, j)   # mid-lap: no lap of its own
    with j.transaction() as tx:
        run_id = tx.start_run("a", 0, now=env.wall(), run_budget=10.0, stall_threshold=15.0,
                              driver_pid=1, driver_start=1.0)
        tx.close_run(run_id, "ok", source="driver", now=env.wall(), exit_code=0)
    env.after_run.append((len(env.children) + 1, signal.SIGTERM))
    assert tail.run() == 0
    assert tail.lap == 3 and rows(j)[-1].agent == "b"


class SigtermDuringBusyWait(FakeEnv):
    """SIGTERM arrives while the driver waits for a write lock another process
    holds: the first time the journal's wait asks whether to go on waiting."""
    sent = False

    def stop_pending(self):
        if not self.sent:
            self.sent = True
            self.send(self.t, signal.SIGTERM)
        return super().stop_pending()


@pytest.mark.parametrize("release", [None, 2.5], ids=["held", "released"])
@pytest.mark.parametrize("during", ["turn", "run"])
def test_a_stop_while_another_writer_holds_the_journal_records_the_end_within_a_bound(tmp_path, during, release):
    """Another writer (a ``sqlite3`` shell's BEGIN EXCLUSIVE) holds the journal's
    write lock when a SIGTERM comes: between runs (the last end held back for
    the next start) or during a run. SQLite's busy wait is deaf to signals, so
    the driver waits for the lock in short tries, hearing signals between them;
    the end it saw is recorded once the lock is let go within END_WRITE_WAIT
    (an ``ok`` run was left ``running`` and reaped as ``interrupted``), and only
    a lock held past that bound leaves the row to the next driver's reaper."""
    import sqlite3
    import time
    from ringd.loops.driver import END_WRITE_WAIT
    d, env, j = make(tmp_path, "a", default=Behaviour(runs_for=1.0))
    if during == "turn":
        env = d.env = SigtermDuringBusyWait(default=Behaviour(runs_for=1.0))
        d.log = env.log
    else:
        env.send(0.7, signal.SIGTERM)
    env.send(3.0, signal.SIGTERM)   # (a second one changes nothing: the bound holds)
    j._busy_timeout = 2.0
    holder = sqlite3.connect(str(j.path), isolation_level=None)
    env.at(0.5, lambda: holder.execute("BEGIN EXCLUSIVE"))
    if release is not None:
        env.at(release, lambda: holder.execute("ROLLBACK"))
    try:
        t0 = time.monotonic()
        assert d.run() == 0
        assert time.monotonic() - t0 < 15.0   # (headroom for a busy box: some 20 tries of 0.1 s)
    finally:
        if holder.in_transaction:
            holder.execute("ROLLBACK")
        holder.close()
    if release is None:
        assert [r.status for r in rows(j)] == ["running"]
        assert any(f"could not be recorded within {END_WRITE_WAIT:g}s" in m for _, m in env.logs)
        assert env.t <= 1.0 + END_WRITE_WAIT + 0.5
    else:
        assert [r.status for r in rows(j)] == ["ok" if during == "turn" else "interrupted"]
        assert any("end recorded" in m for _, m in env.logs)
        assert env.t <= release + 0.5


def test_a_driver_that_takes_over_goes_on_at_the_lap_the_journal_holds(tmp_path):
    """A many-host driver that leads again after another leader ran the ring
    (Driver.lead -> resume_from_journal) went on counting from its own, older
    lap: the journal's - and status's - lap went back. It is read with the cursor."""
    d, env, j = make(tmp_path, "ab")
    d.resume_from_journal()
    assert d.lap == 1
    j.set_meta("lap", "7")   # laps the other leader counted
    d.resume_from_journal()
    assert d.lap == 7


def test_a_journal_no_restart_can_help_is_refused_even_with_a_stop_pending():
    """A stop that ends a start-up journal call is a clean stop (exit 0); a
    damaged journal is a configuration error (78) whatever signal came with it."""
    from ringd.loops.driver import startup_journal_exit
    from ringd.core.errors import EX_OK, EX_UNAVAILABLE

    class StopPending:
        def wait(self, timeout):
            return {signal.SIGTERM}, set()

    class Quiet:
        def wait(self, timeout):
            return set(), set()
    damaged = JournalError("/s/journal.db: journal is not a valid SQLite database (truncated or overwritten)")
    outage = JournalError("journal unreachable", transient=True)
    said = []
    say = lambda m, level: said.append(m)   # noqa: E731
    assert startup_journal_exit(damaged, StopPending(), say) == EX_CONFIG
    assert startup_journal_exit(outage, StopPending(), say) == EX_OK
    assert startup_journal_exit(outage, Quiet(), say) == EX_UNAVAILABLE
    assert said[1].startswith("stopped while starting")


@pytest.mark.parametrize("step,expected", [
    # the clock jumps two days ahead for 90 s: the job runs then (a slot was due on that
    # clock), and once the clock is set right, daily at 04:00 again - it skipped two days
    (2 * 86400.0, ["05-20 03:33:30", "05-18 04:00:00", "05-19 04:00:00", "05-20 04:00:00"]),
    # an hour ahead (less than the daily spacing): the slot it ran early is not run again
    (3600.0, ["05-18 04:33:30", "05-19 04:00:00", "05-20 04:00:00"]),
])
def test_a_cron_job_after_the_wall_clock_jumped_ahead_past_its_slot_and_back(tmp_path, monkeypatch, step,
                                                                               expected):
    """A daily 04:00 job first seen at 03:33:20 UTC. The wall clock jumps ahead
    past its slot (a bad step), then NTP sets it back 90 s later. A jump longer
    than the schedule's spacing is a clock that was set: the slots it ran ahead
    belong to days that have not come, and the job keeps its 04:00 of each real
    day (it waited until the clock was back past the bad run: two days here, a
    year for a year's jump). A shorter jump is a correction: the slot it ran
    early is not run again (schedule.next_due)."""
    from datetime import datetime, timezone
    monkeypatch.setenv("TZ", "UTC")
    d, env, j = make(tmp_path, ["job"], default=Behaviour(runs_for=0.5),
                     agents={"job": AgentOverride(schedule="0 4 * * *")}, heartbeat_interval=60.0)
    env.at(10.0, lambda: setattr(env, "wall_step", step))
    env.at(100.0, lambda: setattr(env, "wall_step", 0.0))
    env.send(3 * 86400.0, signal.SIGTERM)
    assert d.run() == 0
    starts = [datetime.fromtimestamp(r.started_at, timezone.utc) for r in rows(j)]
    assert [t.strftime("%m-%d %H:%M:%S") for t in starts] == expected


def test_status_names_the_agent_the_driver_starts_next_while_a_job_outlasts_its_period(tmp_path, monkeypatch):
    """An ``every: 10`` job whose runs last 15 s is due again before each run
    ends; the driver then gives the ordinary next agent its turn (the job ran in
    this round: policy.round_after). ``ringd status`` looked at all along names
    the agent the driver starts next - it named the job again, having no memory
    of the round, for the last 5 s of each of its runs. (Status runs on the fake
    clock here; the driver's heartbeat is not a file, so it is taken as alive.)"""
    from ringd.cli import status
    monkeypatch.setattr(status, "live_writer", lambda *a, **k: 4242)
    d, env, j = make(tmp_path, ["a", "b", "job"], behaviours={"job": Behaviour(runs_for=15.0)},
                     default=Behaviour(runs_for=1.0), agents={"job": AgentOverride(every=10.0)},
                     run_budget=100.0, stall_threshold=200.0)
    named = []
    for k in range(1, 115):   # (between the starts, all at whole seconds)
        env.at(k / 2 + 0.25, lambda: named.append((env.t, status.gather_status(tmp_path, d.config, now=env.wall())["next"])))
    env.send(58.0, signal.SIGTERM)
    assert d.run() == 0
    starts = [(r.started_at - WALL0, r.agent) for r in rows(j)]
    assert [a for _, a in starts[:5]] == ["job", "a", "job", "b", "job"], starts
    checked = 0
    for t, nxt in named:
        following = [a for s, a in starts if s > t]
        if following and nxt is not None:
            assert nxt["agent"] == following[0], (t, nxt, starts)
            checked += 1
    assert checked > 90
    # stopped during the job's run: its round is in the journal, but no driver is alive to
    # keep it (status, told so, names the job due again), and the next one starts anew
    from ringd.inputs.schedule import ROUND_KEY
    assert j.meta(ROUND_KEY) == '["job"]'
    monkeypatch.setattr(status, "live_writer", lambda *a, **k: None)
    assert status.gather_status(tmp_path, d.config, now=env.wall())["next"]["agent"] == "job"
    Driver(env, tmp_path, None, d.config, d.roster, j).resume_from_journal()
    assert j.meta(ROUND_KEY) is None


def _renaming_ring(tmp_path, lines, **ring):
    """A real-env driver (RealEnv, /bin/true agents) on a roster that ``write(gen)``
    rewrites with ``lines(gen)``, the test's way to rename agents between runs.
    Returns (driver, env, journal, write)."""
    from ringd.host.env import RealEnv
    roster = tmp_path / "ring.txt"

    def write(gen):
        roster.write_text(lines(gen))
        roster.chmod(0o600)
    write(0)
    src = RosterSource(roster)
    src.refresh(force=True)
    journal = Journal.open(tmp_path)
    env = RealEnv(tmp_path, lambda m, level: None)
    d = Driver(env, tmp_path, None, Config(ring=RingSettings(**{**RING, **ring})), src, journal)
    return d, env, journal, write


def test_a_driver_keeps_the_log_index_of_the_rosters_agents_only(tmp_path):
    """RealEnv keeps each agent's run-log ids (keep_logs' index). A roster whose
    agents are renamed at every edit left one index per agent ever run, for the
    driver's life: 200 renames, 200 indexes. Only the roster's are kept now -
    and the renamed agents' logs are still pruned by the run that ends them."""
    d, env, journal, write = _renaming_ring(tmp_path, lambda gen: f"a{gen} /bin/true\nb{gen} /bin/true\n",
                                            keep_logs=1)
    runs, kept = [], []
    real_keep_logs = env.keep_logs

    def keep_logs(agent, run_id, keep):
        real_keep_logs(agent, run_id, keep)
        runs.append(agent)
        kept.append(len(env._logs))
        write(len(runs))   # every agent renamed: read before the next turn
        if len(runs) >= 200:
            d.stop_requested = True
    env.keep_logs = keep_logs
    try:
        assert d.run() == 0
    finally:
        env.close()
    assert len(set(runs)) >= 190   # (each run was a new agent's)
    assert max(kept) <= 2, f"log indexes kept: {kept[-1]} after {len(runs)} runs"
    assert sum(len(files) for _, _, files in os.walk(tmp_path / "logs")) == len(set(runs))


def test_the_logs_of_pruned_runs_of_agents_since_removed_go_with_their_runs(tmp_path):
    """``ringd logs`` reaches a log through its run's row; keep_logs prunes an
    agent's logs only as it runs. So the logs of a removed agent stayed for good,
    its runs long pruned (ring.keep_runs): a roster renamed at every edit left a
    log dir and a log per agent ever run (200 runs: 200 dirs, 200 logs). They go
    with their runs now: the state dir holds at most keep_runs' logs (and the
    roster's agents' newest) - an agent on the roster keeps its own."""
    d, env, journal, write = _renaming_ring(tmp_path, lambda gen: f"a{gen} /bin/true\nstay /bin/true\n",
                                            keep_logs=3, keep_runs=20, heartbeat_interval=0.05)
    runs = []
    real_keep_logs = env.keep_logs

    def keep_logs(agent, run_id, keep):
        real_keep_logs(agent, run_id, keep)
        runs.append(agent)
        if agent == "stay":
            write(len(runs))   # the other renamed: each a* runs once
        if len(runs) >= 400:
            d.stop_requested = True
    env.keep_logs = keep_logs
    (tmp_path / "logs" / "a0").mkdir(parents=True)
    (tmp_path / "logs" / "a0" / "notes.txt").write_text("an agent's own file\n")   # never ours
    try:
        assert d.run() == 0
    finally:
        env.close()
    logs = tmp_path / "logs"
    dirs = sorted(p.name for p in logs.iterdir() if p.is_dir())
    files = [p for p in logs.rglob("*.log")]
    assert len(set(runs)) >= 150
    assert len(dirs) <= 20 + 3, f"{len(dirs)} log dirs, {len(files)} logs after {len(set(runs))} agents"
    assert len(files) <= 20 + 3 + 1, f"{len(files)} logs kept at keep_runs 20"
    assert "a0" in dirs and (logs / "a0" / "notes.txt").exists() and not list((logs / "a0").glob("*.log"))
    assert len(list((logs / "stay").glob("*.log"))) == 3   # the roster's agent: its newest, keep_logs
    kept = {r.id for r in journal.history(limit=1000)}
    assert all(int(f.stem) in kept or f.parent.name == "stay" for f in files)   # none reached by no run


class Lapsing:
    """A many-host driver's leadership (the part of ringd.loops.leader.Leader the
    driver and the hop use) that is lost from ``lost_at`` until ``back_at`` (fake
    time): the journal away past the half-TTL switch, then back. Its take-over
    records the row it finds ``running`` instead of reaping it."""
    host, lease_holder, lease_expires_at, killed_pid = "box", None, None, None

    def __init__(self, env, journal, lost_at, back_at):
        self.env, self.journal, self.lost_at, self.back_at = env, journal, lost_at, back_at
        self.took_over, self.lost, self.found_running = False, False, []

    def _leading(self):
        return not (self.lost_at <= self.env.t < self.back_at)

    @property
    def role(self):
        return "leader" if self._leading() else "standby"

    def must_stop(self):
        self.lost = self.lost or not self._leading()
        return not self._leading()

    def seconds_left(self):
        if self.env.t < self.lost_at:
            return self.lost_at - self.env.t
        return 10.0 if self._leading() else 0.0   # (renewed again: its switch a while off)

    def beat(self):
        if self._leading() and self.lost:
            self.took_over, self.lost = True, False

    def guard(self, *args, **kwargs):
        pass

    def settle_takeover(self, config, on_reaped=None):
        self.found_running.append(self.journal.running_row())
        self.took_over = False

    def release(self):
        pass


def test_a_run_that_ended_as_the_lease_lapsed_keeps_its_end_and_is_never_reaped(tmp_path):
    """The agent exits 0 at the very moment its driver passes the half-TTL switch
    (the journal away): the hop killed "its" tree and dropped the exit it had
    seen, the driver dropped the end it could not write, and on taking the lease
    again the driver's reaper closed its own row `interrupted`. A driver never
    reaps a run it saw end: the end is kept and written once it leads again."""
    d, env, j = make(tmp_path, "ab", default=Behaviour(runs_for=2.0))
    d.leader = leader = Lapsing(env, j, lost_at=2.0, back_at=4.0)
    env.send(5.0, signal.SIGTERM)
    assert d.run() == 0
    first = rows(j)[0]
    assert (first.status, first.exit_code) == ("ok", 0), [(r.status, r.exit_code) for r in rows(j)]
    assert leader.found_running == [None, None]   # at start, and on leading again: nothing of ours to reap
    assert not any("lost its leadership" in m for _, m in env.logs)


# --- a state dir out of room: an outage, never the agent's fault ------------------------------

class FullUntil(FakeEnv):
    """The state dir has no room (ENOSPC) for a run log until ``room_at``."""
    room_at = 5.0
    code = 28   # errno.ENOSPC

    def open_run_log(self, agent, run_id):
        if self.t < self.room_at:
            raise OSError(self.code, os.strerror(self.code))
        return super().open_run_log(agent, run_id)


@pytest.mark.parametrize("code", [28, 122, 30])   # ENOSPC, EDQUOT, EROFS
def test_a_run_log_that_cannot_be_made_for_want_of_room_waits_and_blames_no_one(tmp_path, code):
    FullUntil.code = code
    d, env, j = make(tmp_path, "ab", once=True, env_class=FullUntil)
    assert d.run() == 0
    assert [(r.agent, r.status) for r in rows(j)] == [("a", "ok"), ("b", "ok")]
    for name in "ab":
        s = j.agent_state(name)
        assert (s.consecutive_failures, s.bad_streak, s.backoff_until) == (0, 0, None)
    said = [m for _, m in env.logs if "cannot make its run log yet" in m]
    assert len(said) == 1 and "not the agent's fault" in said[0], env.logs
    times = [t for t, _ in env.beats if t <= FullUntil.room_at]
    assert max(b - a for a, b in zip(times, times[1:])) <= 1.0 + 1e-9   # beating while it waits
    assert env.children[0].exit_at >= FullUntil.room_at   # started once there was room
    assert env.waits < 100   # no spin: waits of 0.2 s doubling to 5 s, or a beat


def test_a_stop_while_waiting_for_room_interrupts_the_run_and_counts_nothing(tmp_path):
    FullUntil.code = 28
    d, env, j = make(tmp_path, "a", env_class=FullUntil)
    env.send(2.0, signal.SIGTERM)
    assert d.run() == 0
    (r,) = rows(j)
    assert r.status == "interrupted" and "before it could start" in r.reason and env.t < 3.0
    s = j.agent_state("a")
    assert (s.consecutive_failures, s.bad_streak, s.backoff_until) == (0, 0, None)
    assert env.children == []


def test_a_skip_while_waiting_for_room_skips_the_run(tmp_path):
    from ringd.journal import transitions
    FullUntil.code = 28
    d, env, j = make(tmp_path, "ab", once=True, env_class=FullUntil)
    env.at(1.0, lambda: (transitions.request_skip(j, None, 1, now=WALL0 + 1.0), env.send(1.0, signal.SIGUSR1)))
    assert d.run() == 0
    assert [(r.agent, r.status) for r in rows(j)] == [("a", "skipped"), ("b", "ok")]
    assert j.agent_state("a").consecutive_failures == 0
