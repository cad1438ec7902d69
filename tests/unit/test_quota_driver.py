"""Shared quotas in the driver loop, against the scripted environment
(tests/fakeenv.py) and a real SQLite journal: agents report what they spent
as their runs end, the turn passes over agents their pool holds, the driver
waits for the reset, the scheduled agent gets its reserve, an exhausted pool
with exit 75 waits for the pool and not a back-off. Minutes of ring time in
milliseconds."""
import signal

from fakeenv import WALL0, Behaviour, FakeEnv, make_driver
from ringd.core.quota import Pool
from ringd.host.notify import Heard
from ringd.inputs.config import AgentOverride


class FakeNotify:
    """A run's notify socket that hears, once the run has ended, what its
    agent's script says it reported (``FakeEnv.reports``)."""

    def __init__(self, env, run_id):
        self.env, self.run_id, self.agent = env, run_id, None
        self.told = False

    def fileno(self):
        return -5 - self.run_id

    def set_agent(self, pid):
        self.agent = next(c.agent for c in self.env.children if c.pid == pid)

    def drain(self, cap=256):
        if self.told or self.agent is None:
            return Heard()
        self.told = True
        say = self.env.reports.get(self.agent)
        return Heard(reports=list(say(self.env) if callable(say) else say or ()))


class QuotaEnv(FakeEnv):
    """FakeEnv whose runs have a notify socket, and whose agents' environments are kept."""

    def __init__(self, behaviours=None, **kw):
        super().__init__(behaviours, **kw)
        self.reports = {}
        self.envs = []   # (agent, RING_QUOTA_LEFT, clock) of every start

    def open_notify(self, run_id):
        return FakeNotify(self, run_id)

    def write_notes(self, notes, now):
        notes.written_at, notes.dirty = now, False

    def spawn(self, argv, *, env, **kw):
        self.envs.append((env["RING_AGENT"], env.get("RING_QUOTA_LEFT"), self.t))
        return super().spawn(argv, env=env, **kw)


def quota_driver(tmp_path, names, pools, agents, **kw):
    d, env, j = make_driver(tmp_path, names, env_class=QuotaEnv, agents=agents, **kw)
    d.config = d.config.__class__(**{**d.config.__dict__, "quotas": pools})
    return d, env, j


def test_the_meeting_gets_its_reserve_and_the_others_wait_for_the_reset(tmp_path):
    """100 units in a 60 s window, 40 kept for a meeting due every 100 s. Each
    ordinary run spends 30: two run, then the pool holds them (no rows) and the
    driver waits, beating, for the oldest use to leave; the meeting, due, runs
    with 40 or more left whatever the others did; nothing is ever spent past the
    limit in any window."""
    pools = {"model": Pool("model", 100, 60.0, {"meeting": 40})}
    agents = {"a": AgentOverride(quota="model"), "b": AgentOverride(quota="model"),
              "meeting": AgentOverride(every=100.0, quota="model")}
    d, env, j = quota_driver(tmp_path, ["meeting", "a", "b"], pools, agents, heartbeat_interval=5.0)
    env.reports = {"a": [("X_RING_USED", "model:30")], "b": [("X_RING_USED", "model:30")],
                   "meeting": [("X_RING_USED", "model:40")]}
    env.default = Behaviour(runs_for=1.0)
    env.send(400.0, signal.SIGTERM)
    assert d.run() == 0
    runs = j.history(limit=1000)[::-1]
    assert {r.status for r in runs} == {"ok"}
    meetings = [(t, int(left)) for name, left, t in env.envs if name == "meeting"]
    assert len(meetings) == 4 and all(left >= 40 for _, left in meetings), meetings
    # spent per sliding window never over the limit: each run spends at its end
    used = j.used_by_runs([r.id for r in runs])
    spends = [(r.ended_at, used[r.id]["model"]) for r in runs]
    for t, _ in spends:
        assert sum(u for at, u in spends if t - 60 < at <= t) <= 100
    # while held, nothing started: the driver waited, beating, for a reset
    starts = [t for _, _, t in env.envs]
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    assert max(gaps) > 30
    beats = [t for t, _ in env.beats]
    assert max(b - a for a, b in zip(beats, beats[1:])) <= 5.0 + 1e-6
    logs = [m for _, m in env.logs]
    assert any(m.startswith("quota model spent") and "its agents wait until" in m for m in logs), logs
    assert any(m.startswith("quota model: open again") for m in logs)
    assert len(logs) < 200   # said once a hold, not once a turn


def test_an_exhausted_report_with_exit_75_defers_the_pool_not_the_agent(tmp_path):
    """A run reports its pool refused for 120 s and exits 75: deferred, and not
    backed off (a back-off of 500 s here), but retried once the pool reopens;
    every agent of the pool waits the 120 s; an agent of no pool goes on."""
    pools = {"model": Pool("model", 1000, 3600.0)}
    agents = {"a": AgentOverride(quota="model"), "b": AgentOverride(quota="model")}
    d, env, j = quota_driver(tmp_path, ["a", "b", "free"], pools, agents, backoff_initial=500.0,
                             backoff_max=1000.0)
    first = []

    def a_says(env):
        if not first:
            first.append(env.t)
            return [("X_RING_EXHAUSTED", "model:120"), ("X_RING_USED", "model:5")]
        return [("X_RING_USED", "model:5")]
    env.reports = {"a": a_says}
    env.behaviours = {"a": Behaviour(runs_for=1.0, code=75), "b": Behaviour(runs_for=1.0),
                      "free": Behaviour(runs_for=5.0)}
    env.send(200.0, signal.SIGTERM)
    assert d.run() == 0
    runs = j.history(limit=1000)[::-1]
    a_runs = [r for r in runs if r.agent == "a"]
    refused_at = first[0]
    assert a_runs[0].status == "deferred"
    assert refused_at + 120 <= a_runs[1].started_at - WALL0 < refused_at + 130   # no back-off: the pool's wait
    pooled = [r.started_at - WALL0 for r in runs if r.agent in ("a", "b")]
    assert not [t for t in pooled if refused_at < t < refused_at + 120]   # the pool waited
    assert [t for t in pooled if t >= refused_at + 120]                    # and then went on
    assert [r for r in runs if r.agent == "free" and refused_at < r.started_at - WALL0 < refused_at + 120]
    assert any("reports quota model exhausted for 120s" in m for _, m in env.logs)


def test_bad_reports_are_said_once_a_run_and_change_nothing(tmp_path):
    pools = {"model": Pool("model", 100, 3600.0)}
    d, env, j = quota_driver(tmp_path, ["a"], pools, {"a": AgentOverride(quota="model")}, once=True)
    env.reports = {"a": [("X_RING_USED", "model:-5"), ("X_RING_USED", "model:1e400"),
                         ("X_RING_USED", "nope:5"), ("X_RING_USED", "model:" + "9" * 4000),
                         ("X_RING_EXHAUSTED", "model:soon"), ("X_RING_USED", "model:7")]}
    assert d.run() == 0
    assert j.used_by_runs([1]) == {1: {"model": 7}}
    said = [m for _, m in env.logs if "quota report that is ignored" in m]
    assert len(said) == 3 and all(len(m) < 300 for m in said), said   # number, pool, parse: once each
