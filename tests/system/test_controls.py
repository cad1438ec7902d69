"""Operator controls against a real driver: pause / pause NAME / resume [NAME],
next NAME, all kept in the journal (they survive a driver restart); status
shows them; unknown names exit 2."""
from __future__ import annotations

import json
import time

from conftest import wait_until


def set_agent(state_dir, name, **fields):
    """Put an agent in a state the driver would record (back-off, quarantine)."""
    from dataclasses import replace
    from ringd.journal.sqlite import Journal
    j = Journal.open(state_dir)
    try:
        with j.transaction() as tx:
            tx.put_agent(replace(tx.agent(name), **fields))
    finally:
        j.close()


def status(ring):
    res = ring.cli("status", "--json")
    assert res.stdout, res.stderr
    return json.loads(res.stdout)


def agents_run(ring, since=0):
    return [r["agent"] for r in ring.runs() if r["id"] > since and r["status"] != "skipped"]


def test_pause_and_resume_the_ring(ring):
    ring.agent("slow", "sleep 1.5")
    ring.agent("b", "exit 0")
    ring.roster(f"slow {ring.agents_dir}/slow.sh", f"b {ring.agents_dir}/b.sh")
    driver = ring.start_driver()
    wait_until(lambda: any(r["status"] == "running" and r["agent"] == "slow" for r in ring.runs()),
               message="slow running")
    res = ring.cli("pause")
    assert res.returncode == 0 and "ring paused" in res.stdout, res.stderr
    assert ring.cli("pause").stdout.startswith("the ring: already paused")
    # the current run is untouched and ends by itself; nothing new starts
    wait_until(lambda: ring.runs()[-1]["status"] == "ok", timeout=10, message="slow finished by itself")
    n = len(ring.runs())
    doc = status(ring)
    assert doc["driver"]["paused"] is True and doc["driver"]["health"] == "ok" and doc["next"] is None
    plain = ring.cli("status", env=dict(ring.env, NO_COLOR="1")).stdout
    assert "PAUSED" in plain
    # that a paused ring starts nothing and keeps beating for as long as it is paused, and
    # wakes at once on resume: test_driver_unit.test_a_paused_ring_starts_nothing_keeps_beating...
    assert len(ring.runs()) == n and status(ring)["driver"]["health"] == "ok"

    # the pause survives a restart of the driver
    driver.terminate()
    assert driver.wait(timeout=10) == 0
    driver = ring.start_driver()
    wait_until(lambda: status(ring)["driver"]["pid"] == driver.pid, message="new driver")
    # said at its first turn, which it took paused: a fixed 0.5 s after its first
    # beat was not always enough on a loaded box to get there
    wait_until(lambda: "ring paused by the operator" in driver.err_path.read_text(), 20,
               message="the new driver saying the ring is paused")
    assert len(ring.runs()) == n and status(ring)["driver"]["paused"] is True

    res = ring.cli("resume")
    assert res.returncode == 0 and "ring resumed" in res.stdout and "woken" in res.stdout
    wait_until(lambda: len(ring.runs()) > n, timeout=3, message="ring runs again within a beat of resume")
    assert status(ring)["driver"]["paused"] is False
    assert ring.cli("resume").stdout.startswith("the ring was not paused")
    kinds = [r["kind"] for r in ring.rows("SELECT kind FROM events WHERE source = 'operator'")]
    assert "paused" in kinds and "unpaused" in kinds


def test_a_paused_once_runs_nothing(ring):
    """docs/operating.md: a paused ``ringd run --once`` runs nothing
    (it exits 0, no row); resumed, the same command runs its lap."""
    ring.agent("a", "exit 0")
    ring.roster(f"a {ring.agents_dir}/a.sh")
    assert ring.cli("pause").returncode == 0
    once = ring.start_driver("--once")
    assert once.wait(timeout=20) == 0
    assert ring.runs() == []
    assert ring.cli("resume").returncode == 0
    assert ring.start_driver("--once").wait(timeout=20) == 0
    assert [(r["agent"], r["status"]) for r in ring.runs()] == [("a", "ok")]


def test_pause_one_agent_and_resume_lifts_everything(ring):
    for name in ("a", "b", "c"):
        ring.agent(name, "exit 0")
    ring.roster(*(f"{n} {ring.agents_dir}/{n}.sh" for n in ("a", "b", "c")))
    assert ring.cli("pause", "ghost").returncode == 2
    assert ring.cli("next", "ghost").returncode == 2
    assert ring.cli("resume", "ghost").returncode == 2
    res = ring.cli("pause", "b")   # before any driver ran: kept in a new journal
    assert res.returncode == 0 and "b: paused" in res.stdout, res.stderr
    ring.start_driver()
    wait_until(lambda: len(agents_run(ring)) >= 6, timeout=20, message="two laps")
    assert "b" not in agents_run(ring)
    assert not any(r["agent"] == "b" for r in ring.runs())   # passed over: no row at all
    doc = status(ring)
    assert [a["paused"] for a in doc["agents"]] == [False, True, False]
    assert "paused" in ring.cli("status", env=dict(ring.env, NO_COLOR="1")).stdout

    # resume b also lifts a back-off and a quarantine
    set_agent(ring.state, "b", backoff_until=time.time() + 3600, consecutive_deferrals=3,
              quarantined_until=time.time() + 3600, bad_streak=3)
    res = ring.cli("resume", "b")
    assert res.returncode == 0, res.stderr
    assert "pause lifted" in res.stdout and "quarantine lifted" in res.stdout and "back-off lifted" in res.stdout
    st = ring.rows("SELECT * FROM agents WHERE name = 'b'")[0]
    assert st["backoff_until"] is None and st["quarantined_until"] is None and st["bad_streak"] == 0
    wait_until(lambda: "b" in agents_run(ring), timeout=10, message="b runs again")


def test_next_takes_the_very_next_turn_once(ring):
    # back-offs of an hour (the fast config's 2 s maximum would end d's at once)
    ring.write_config(ring={"run_budget": 20, "stall_threshold": 30, "backoff_initial": 3600, "backoff_max": 3600})
    ring.agent("slow", "sleep 3")
    for name in ("b", "c", "d"):
        ring.agent(name, "exit 0")
    ring.roster(f"slow {ring.agents_dir}/slow.sh", *(f"{n} {ring.agents_dir}/{n}.sh" for n in ("b", "c", "d")))
    # d is backing off for an hour: next runs it anyway
    set_agent(ring.state, "d", backoff_until=time.time() + 3600, consecutive_deferrals=5)
    ring.start_driver()
    wait_until(lambda: any(r["status"] == "running" and r["agent"] == "slow" for r in ring.runs()),
               message="slow running")
    mark = ring.runs()[-1]["id"] - 1
    res = ring.cli("next", "d")
    assert res.returncode == 0 and "d: takes the next turn" in res.stdout, res.stderr
    doc = status(ring)
    assert doc["next"]["agent"] == "d" and doc["next"]["after_current_run"] is True
    wait_until(lambda: len(agents_run(ring, mark)) >= 5, timeout=20, message="runs after next")
    order = agents_run(ring, mark)[:5]
    # slow (current) -> d (next, once, despite its back-off) -> then on from where
    # it was: b, c, and d in its own place (its ok run ended the back-off)
    assert order == ["slow", "d", "b", "c", "d"], order
    assert ring.rows("SELECT value FROM meta WHERE key = 'next'") == []


def test_next_survives_a_restart(ring):
    ring.agent("a", "exit 0")
    ring.agent("b", "exit 0")
    ring.roster(f"a {ring.agents_dir}/a.sh", f"b {ring.agents_dir}/b.sh")
    assert ring.start_driver("--once").wait(timeout=20) == 0     # last run: b
    assert ring.cli("next", "b").returncode == 0                   # requested with no driver running
    assert status(ring)["next"]["agent"] == "b"
    assert ring.start_driver("--once").wait(timeout=20) == 0
    assert agents_run(ring)[2:] == ["b", "a", "b"]


# --- the next turn, as status estimates it (pure) ------------------------------------------

def test_next_turn_pure():
    from ringd.inputs.config import Config, parse_config
    from ringd.journal.sqlite import RunRow
    from ringd.cli.status import next_turn
    now = 1_800_000_000.0
    roster = [("a", "a x"), ("b", "b x"), ("c", "c x")]

    def last(agent, pos, ended=now - 1):
        return RunRow(id=5, agent=agent, position=pos, status="ok", started_at=ended - 1, ended_at=ended,
                      duration=1.0, exit_code=0, signal=None, reason=None, pid=None, pid_start=None,
                      run_budget=None, stall_threshold=None, log_path=None, driver_pid=None, driver_start=None)
    c = Config()
    assert next_turn(roster, {}, None, now, c) == ("a", now)
    assert next_turn(roster, {}, last("a", 0), now, c) == ("b", now)
    assert next_turn(roster, {}, last("a", 0), now, c, paused=["b"]) == ("c", now)
    assert next_turn(roster, {}, last("a", 0), now, c, requested="a") == ("a", now)
    assert next_turn(roster, {}, last("a", 0), now, c, requested="gone") == ("b", now)
    from ringd.core.records import AgentState
    backing = {"b": AgentState("b", backoff_until=now + 50), "c": AgentState("c", quarantined_until=now + 20)}
    assert next_turn(roster, backing, last("a", 0), now, c) == ("a", now)
    everyone = dict(backing, a=AgentState("a", backoff_until=now + 30))
    assert next_turn(roster, everyone, last("a", 0), now, c) == ("c", now + 20)
    assert next_turn(roster, {}, last("a", 0), now, c, paused=["a", "b", "c"]) is None
    # after the last agent, the lap pause counts from the end of the last run
    paused_lap = parse_config({"ring": {"lap_pause": 10}})
    assert next_turn(roster, {}, last("c", 2, ended=now - 4), now, paused_lap) == ("a", now + 6)
    assert next_turn(roster, {}, last("a", 0, ended=now - 4), now, paused_lap) == ("b", now)
    # scheduled agents (next due times): passed over until due, a due one first
    assert next_turn(roster, {}, last("a", 0), now, c, next_due={"b": now + 99}) == ("c", now)
    assert next_turn(roster, {}, last("a", 0), now, c, next_due={"c": now - 1}) == ("c", now)
    assert next_turn([("b", "b x")], {}, None, now, c, next_due={"b": now + 99}) == ("b", now + 99)


def test_history_since(ring):
    ring.agent("a", "exit 0")
    ring.agent("b", "exit 0")
    ring.roster(f"a {ring.agents_dir}/a.sh", f"b {ring.agents_dir}/b.sh")
    assert ring.start_driver("--once").wait(timeout=20) == 0
    # make the first lap two hours old (the journal's start times, as a long-running ring would have)
    import sqlite3
    con = sqlite3.connect(ring.journal_path)
    con.execute("UPDATE runs SET started_at = started_at - 7200, ended_at = ended_at - 7200")
    con.commit()
    con.close()
    assert ring.start_driver("--once").wait(timeout=20) == 0
    recent = json.loads(ring.cli("history", "--since", "1h", "--json").stdout)
    assert [r["agent"] for r in recent] == ["b", "a"] and recent[0]["id"] > recent[1]["id"]
    assert len(json.loads(ring.cli("history", "--since", "3h", "--json").stdout)) == 4
    assert len(json.loads(ring.cli("history", "--since", "3h", "-n", "3", "--json").stdout)) == 3
    assert [r["agent"] for r in json.loads(ring.cli("history", "a", "--since", "90min", "--json").stdout)] == ["a"]
    assert json.loads(ring.cli("history", "--since", "0", "--json").stdout) == []   # since now: none yet
    for bad in ("soon", "2026-13-01", "5min later", "x" * 100):
        res = ring.cli("history", "--since", bad)
        assert res.returncode == 2 and len(res.stderr.splitlines()) == 1 and "Traceback" not in res.stderr, bad


def test_plan_turn_with_operator_controls():
    """policy.plan_turn (pure): paused agents are passed over with no due time of
    their own; a ``ringd next`` request is a forced turn, whatever the agent's state."""
    from ringd.core.policy import Action, TurnInputs, plan_turn
    from ringd.core.records import AgentState
    now = 1_800_000_000.0
    roster = [("a", "a x"), ("b", "b x"), ("c", "c x")]
    plan = plan_turn(TurnInputs(roster, 1, {}, now, paused=frozenset({"b"})))
    assert plan.index == 2 and plan.passed == [1] and not plan.forced
    plan = plan_turn(TurnInputs(roster, 0, {}, now, paused=frozenset({"a", "b", "c"})))
    assert plan.index is None and plan.until is None and plan.passed == [0, 1, 2]
    held = {"c": AgentState("c", quarantined_until=now + 99), "b": AgentState("b", backoff_until=now + 9)}
    plan = plan_turn(TurnInputs(roster, 0, held, now, paused=frozenset({"a", "c"}), requested="c"))
    assert plan.index == 2 and plan.forced and plan.decision.action is Action.RUN
    plan = plan_turn(TurnInputs(roster, 0, held, now, paused=frozenset({"a"}), requested="gone"))
    assert plan.index is None and plan.until == now + 9 and not plan.forced


def test_status_reads_a_wait_set_before_a_clock_step_back_as_the_driver_does(tmp_path):
    """A back-off and a quarantine written three days ahead of ``now`` (the wall
    clock was stepped back since; the longest waits are an hour and a day): ``ringd status`` shows neither, and the next
    turn at once - what the driver will do (policy.seen_at) - not a day's wait."""
    from ringd.inputs.config import Config
    from ringd.journal.sqlite import Journal
    from ringd.core.records import AgentState
    from ringd.cli.status import gather_status
    now = 1_800_000_000.0
    roster = tmp_path / "ring.txt"
    roster.write_text("a /bin/true\nb /bin/true\n")
    roster.chmod(0o600)
    j = Journal.open(tmp_path)
    with j.transaction() as tx:
        tx.put_agent(AgentState("a", backoff_until=now + 3 * 86400, consecutive_deferrals=1))
        tx.put_agent(AgentState("b", quarantined_until=now + 3 * 86400, bad_streak=3))
    j.close()
    doc = gather_status(tmp_path, Config(), now=now)
    agents = {a["name"]: a for a in doc["agents"]}
    assert agents["a"]["backoff_until"] is None and agents["b"]["quarantined_until"] is None
    assert doc["next"]["agent"] == "a" and doc["next"]["in"] == 0.0


def test_status_shows_a_quarantine_lifted_by_a_roster_edit_at_once(ring):
    """The operator fixes a quarantined agent's roster line: status and the
    metrics' gauges no longer show it quarantined (its next turn runs it), not
    'QUARANTINED 23h left' until that turn comes."""
    ring.agent("w", "exit 0")
    ring.agent("fixed", "exit 0")
    ring.roster(f"w {ring.agents_dir}/w.sh")
    set_agent(ring.state, "w", quarantined_until=time.time() + 86400, bad_streak=3,
              quarantine_line=f"w {ring.agents_dir}/w.sh")
    assert status(ring)["agents"][0]["quarantined_until"] is not None
    ring.roster(f"w {ring.agents_dir}/fixed.sh")
    doc = status(ring)
    assert doc["agents"][0]["quarantined_until"] is None
    assert doc["next"]["agent"] == "w"


def test_skip_of_a_run_that_ended_by_itself_meanwhile_exits_1(tmp_path, monkeypatch):
    """``ringd skip`` lands as the run ends on its own: the driver had seen the
    exit but not yet committed it (it commits with the next start), so the row
    still said ``running`` when the request was written. The run then closes
    ``ok``, not ``skipped``: it had already ended - exit 1 (SPEC), never
    0 with 'ended as ok; the ring moves on'."""
    import pytest
    from ringd.cli import control
    from ringd.inputs.config import Config
    from ringd.journal.sqlite import Journal
    from ringd.cli.status import OperatorError
    j = Journal.open(tmp_path)
    with j.transaction() as tx:
        rid = tx.start_run("a", 0, now=time.time(), run_budget=1, stall_threshold=2, driver_pid=1, driver_start=1.0)

    def driver_commits_its_end(state_dir):
        with j.transaction() as tx:
            tx.close_run(rid, "ok", source="driver", now=time.time(), exit_code=0)
        return 4242
    monkeypatch.setattr(control, "reap_if_orphaned", lambda *a: ([], None))
    monkeypatch.setattr(control, "wake_driver", driver_commits_its_end)
    with pytest.raises(OperatorError) as e:
        control.skip(tmp_path, Config(), None, wait=2.0)
    assert e.value.code == 1 and f"run {rid} had already ended" in str(e.value) and "ok" in str(e.value)
    j.close()
