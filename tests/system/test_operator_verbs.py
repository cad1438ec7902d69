"""Operator verbs (SPEC): status NAME, force-fail NAME/--run, who did it
(--reason, the actor, ringd events, history's actor), completion, times a person
can read, messages that say what happened, and silence - with real drivers,
real processes and a real journal."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from datetime import datetime, timedelta
from pathlib import Path

import pytest

import conftest
from conftest import ring_cmd, wait_until

NOTIFY = f"{sys.executable} -m ringd notify"


def running_of(ring, name):
    rows = ring.rows("SELECT * FROM runs WHERE status = 'running' AND agent = ? AND pid IS NOT NULL", name)
    return rows[0] if rows else None


def one_line(res) -> str:
    """The one line a command's refusal writes to stderr (conftest.one_line)."""
    return conftest.one_line(res.stderr)


def as_json(res):
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


# --- status NAME --------------------------------------------------------------------------------

def test_status_name_shows_the_agent_its_line_state_current_run_and_last_ten_runs(ring):
    ring.agent("quick", "exit 0")
    ring.agent("talker", f'{NOTIFY} --status "reading the queue" --ping\nexec sleep 60')
    ring.write_config(ring={"run_budget": 30, "stall_threshold": 40})
    ring.roster(f"quick {ring.agents_dir}/quick.sh", f"talker {ring.agents_dir}/talker.sh --fast")
    from ringd.journal.sqlite import Journal
    Journal.open(ring.state).close()   # quick has 12 runs of history already
    import sqlite3
    con = sqlite3.connect(ring.journal_path)
    con.executemany("INSERT INTO runs(agent, position, status, started_at, ended_at, duration, exit_code)"
                    " VALUES ('quick', 0, 'ok', ?, ?, 0.5, 0)", [(1e9 + i, 1e9 + i + 0.5) for i in range(12)])
    con.commit()
    con.close()
    ring.start_driver()
    wait_until(lambda: (as_json(ring.cli("status", "talker", "--json"))["current"] or {}).get("phase")
               == "reading the queue", timeout=30, message="talker's phase in status NAME")
    doc = as_json(ring.cli("status", "talker", "--json"))
    assert doc["agent"]["name"] == "talker" and doc["agent"]["on_roster"] is True
    assert doc["agent"]["line"] == f"talker {ring.agents_dir}/talker.sh --fast"
    assert doc["agent"]["position"] == 1
    c = doc["current"]
    assert c["agent"] == "talker" and c["phase"] == "reading the queue" and c["agent_beat_age"] is not None
    assert all(r["agent"] == "talker" for r in doc["runs"])
    quick = as_json(ring.cli("status", "quick", "--json"))
    assert quick["current"] is None and len(quick["runs"]) == 10
    assert [r["id"] for r in quick["runs"]] == sorted((r["id"] for r in quick["runs"]), reverse=True)
    text = ring.cli("status", "talker")
    assert text.returncode == 0, text.stderr
    assert "phase: reading the queue" in text.stdout and "talker.sh --fast" in text.stdout
    assert "times in " in ring.cli("status", "quick").stdout
    res = ring.cli("status", "nosuch")
    assert res.returncode == 2 and "unknown agent" in one_line(res) and res.stdout == ""


def test_status_name_states_what_holds_it_and_shows_an_agent_only_the_journal_knows(ring):
    """The state SPEC names for status NAME, each from a real lap: a back-off
    (exit 75), a quarantine (a timeout with quarantine_after 1), a pause, a
    scheduled agent's next due; and an agent removed from the roster, shown
    from the journal."""
    ring.agent("defer", "exit 75")
    ring.agent("wedge", "exec sleep 30")
    ring.agent("ok", "exit 0")
    ring.agent("gone", "exit 0")
    ring.agent("sched", "exit 0")
    ring.write_config(ring={"run_budget": 30, "stall_threshold": 40, "quarantine_after": 1,
                            "backoff_initial": 600, "backoff_max": 1200},
                      agents={"wedge": {"run_budget": 1, "stall_threshold": 2},
                              "sched": {"schedule": "0 0 * * *"}})
    lines = [f"{n} {ring.agents_dir}/{n}.sh" for n in ("defer", "wedge", "ok", "gone", "sched")]
    ring.roster(*lines)
    assert ring.start_driver("--once").wait(timeout=60) == 0
    assert ring.cli("pause", "ok").returncode == 0
    ring.roster(*[ln for ln in lines if not ln.startswith("gone ")])

    def state(name):
        doc = as_json(ring.cli("status", name, "--json"))
        text = ring.cli("status", name, env=dict(ring.env, COLUMNS="200"))
        assert text.returncode == 0, text.stderr
        line = next(ln for ln in text.stdout.splitlines() if ln.startswith("state"))
        return doc, line
    doc, line = state("defer")
    assert doc["agent"]["backoff_until"] is not None and "back-off " in line and " left" in line, line
    doc, line = state("wedge")
    assert doc["agent"]["quarantined_until"] is not None and "QUARANTINED" in line, line
    assert [r["status"] for r in doc["runs"]] == ["skipped", "timeout"]
    assert "quarantined until" in doc["runs"][0]["reason"]
    doc, line = state("ok")
    assert doc["agent"]["paused"] is True and "paused" in line, line
    doc, line = state("sched")
    assert doc["agent"]["next_due"] is not None and "next due in " in line, line
    doc = as_json(ring.cli("status", "gone", "--json"))
    assert doc["agent"]["on_roster"] is False and doc["agent"]["line"] is None
    assert [r["status"] for r in doc["runs"]] == ["ok"]
    assert "not on the roster (known to the journal)" in ring.cli("status", "gone").stdout


# --- force-fail: only the run named ---------------------------------------------------------

def test_force_fail_closes_only_the_named_agents_run_and_bare_force_fail_refuses(ring):
    """The issue's two innocent runs: `ringd force-fail` closed whatever ran at
    that moment. Now another agent's run is never touched (exit 1), and with
    neither NAME nor --run it refuses (exit 2), naming the run and how to target it."""
    ring.agent("victim", "exec sleep 60")
    ring.agent("stuck", "exec sleep 60")
    ring.write_config(ring={"run_budget": 30, "stall_threshold": 40})
    ring.roster(f"victim {ring.agents_dir}/victim.sh", f"stuck {ring.agents_dir}/stuck.sh")
    ring.start_driver()
    row = wait_until(lambda: running_of(ring, "victim"), timeout=20, message="victim running")
    res = ring.cli("force-fail", "stuck")
    assert res.returncode == 1 and f"the running run is {row['id']} of victim" in one_line(res)
    res = ring.cli("force-fail")
    assert res.returncode == 2
    assert one_line(res) == (f"ringd: run {row['id']} of victim is running; say which run to close: "
                             f"ringd force-fail victim (or --run {row['id']})")
    res = ring.cli("force-fail", "--run", str(row["id"] + 1))
    assert res.returncode == 1 and "not running" in one_line(res)
    res = ring.cli("force-fail", "stuck", "--run", str(row["id"]))
    assert res.returncode == 1
    res = ring.cli("force-fail", "ghost")
    assert res.returncode == 2 and "unknown agent" in one_line(res)
    assert ring.rows("SELECT status FROM runs WHERE id = ?", row["id"])[0]["status"] == "running"
    assert ring.rows("SELECT consecutive_failures FROM agents WHERE name = 'victim'")[0][0] == 0
    # the named one is closed, by its id
    res = ring.cli("skip", "victim")
    assert res.returncode == 0, res.stderr
    target = wait_until(lambda: running_of(ring, "stuck"), timeout=20, message="stuck running")
    res = ring.cli("force-fail", "stuck", "--reason", "wedged on the lock")
    assert res.returncode == 0, res.stderr
    assert f"run {target['id']} of stuck closed as interrupted" in res.stdout
    assert ring.rows("SELECT status FROM runs WHERE id = ?", row["id"])[0]["status"] == "skipped"


# --- who did it -------------------------------------------------------------------------------

def test_every_control_verb_records_who_asked_and_why(ring):
    """skip, pause, resume, next and force-fail with --reason: each event names
    the caller's user and uid, SUDO_USER, the terminal and SSH_CLIENT; events
    shows them, history --json has the actor of the run's closing event."""
    ring.agent("a", "exec sleep 60")
    ring.agent("b", "exit 0")
    ring.write_config(ring={"run_budget": 30, "stall_threshold": 40})
    ring.roster(f"a {ring.agents_dir}/a.sh", f"b {ring.agents_dir}/b.sh")
    ring.start_driver()
    run = wait_until(lambda: running_of(ring, "a"), timeout=20, message="a running")
    env = dict(ring.env, SUDO_USER="alice", SSH_CLIENT="192.0.2.7 50000 22")

    def cli(*args):
        r = subprocess.run(ring_cmd(args[0], *ring.common(), *args[1:]), env=env, capture_output=True,
                           text=True, timeout=30, stdin=subprocess.DEVNULL)
        assert r.returncode == 0, (args, r.stderr)
        return r
    cli("pause", "b", "--reason", "b's API is down")
    cli("resume", "b", "--reason", "back up")
    cli("next", "b", "--reason", "rerun the export")
    cli("skip", "a", "--reason", "hung on the\nnetwork")
    wait_until(lambda: ring.rows("SELECT status FROM runs WHERE id = ?", run["id"])[0]["status"] == "skipped",
               timeout=10, message="a skipped")
    again = wait_until(lambda: running_of(ring, "a"), timeout=20, message="a running again")
    cli("skip", "b", "--reason", "not today")   # b's next turn: a skipped row, never started
    cli("force-fail", "a", "--reason", "wedged")
    turn = wait_until(lambda: ring.rows("SELECT * FROM runs WHERE agent = 'b' AND status = 'skipped'"),
                      timeout=20, message="b's turn skipped")[0]
    events = as_json(ring.cli("events", "--json"))
    mine = {e["kind"]: e for e in events if e["source"] == "operator" and e["agent"] == "a"}
    mine.update((e["kind"], e) for e in events if e["source"] == "operator" and e["kind"] in ("paused", "unpaused",
                                                                                            "next-requested"))
    expected_actor = {"user": "root" if os.getuid() == 0 else mine["paused"]["actor"]["user"],
                      "uid": os.getuid(), "sudo_user": "alice", "tty": None, "ssh_client": "192.0.2.7"}
    for kind, reason in (("paused", "b's API is down"), ("unpaused", "back up"), ("next-requested", "rerun the export"),
                         ("skip-requested", "hung on the network"), ("interrupted", "wedged")):
        assert mine[kind]["actor"] == expected_actor, (kind, mine[kind])
        assert mine[kind]["reason"] == reason, (kind, mine[kind])
    assert mine["paused"]["agent"] == "b" and mine["skip-requested"]["run_id"] == run["id"]
    hist = {r["id"]: r for r in as_json(ring.cli("history", "--json"))}
    assert hist[run["id"]]["actor"] == expected_actor and hist[run["id"]]["reason"].endswith(": hung on the network")
    assert hist[again["id"]]["actor"] == expected_actor and hist[again["id"]]["reason"] == "forced by operator: wedged"
    assert hist[turn["id"]]["actor"] == expected_actor and hist[turn["id"]]["reason"].endswith(": not today")
    assert all(r["actor"] is None for r in hist.values() if r["status"] == "ok")
    table = ring.cli("events", "a")
    assert table.returncode == 0 and "via sudo from alice" in table.stdout and "from 192.0.2.7" in table.stdout
    assert all(e["agent"] == "a" for e in as_json(ring.cli("events", "a", "--json")))
    assert "times in " in table.stdout.splitlines()[0]


def test_reload_records_who_asked_why_and_the_drivers_answer(ring):
    """``ringd reload --reason``: the request (before the signal) and the
    driver's answer are events naming the caller, as every control verb's;
    a refused config's answer says why; no driver, no event."""
    ring.agent("a", "exec sleep 60")
    ring.write_config(ring={"run_budget": 30, "stall_threshold": 40})
    ring.roster(f"a {ring.agents_dir}/a.sh")
    res = ring.cli("reload", "--reason", "nobody home")
    assert res.returncode == 1 and "no driver is running" in one_line(res)
    ring.start_driver()
    wait_until(lambda: running_of(ring, "a"), timeout=20, message="a running")
    env = dict(ring.env, SUDO_USER="alice", SSH_CLIENT="192.0.2.7 50000 22")

    def reload(reason):
        return subprocess.run(ring_cmd("reload", *ring.common(), "--reason", reason), env=env,
                              capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL)
    ring.write_config(ring={"run_budget": 20, "stall_threshold": 40})
    res = reload("shorter budget\nfor the demo")
    assert res.returncode == 0 and "ring.run_budget: 30 -> 20" in res.stdout, (res.stdout, res.stderr)
    ring.config_path.write_text("ring: {run_budget: 5 parsecs}\n")
    assert reload("typo test").returncode == 78
    events = [e for e in as_json(ring.cli("events", "--json")) if e["kind"].startswith("reload")]
    assert [e["kind"] for e in events] == ["reload-refused", "reload-requested", "reloaded", "reload-requested"]
    assert all(e["source"] == "operator" and e["agent"] is None for e in events)
    assert all(e["actor"]["sudo_user"] == "alice" and e["actor"]["uid"] == os.getuid()
               and e["actor"]["ssh_client"] == "192.0.2.7" for e in events), events
    assert [e["reason"] for e in events] == ["typo test", "typo test", "shorter budget for the demo",
                                             "shorter budget for the demo"]
    assert "ring.run_budget: 30 -> 20" in events[2]["detail"]
    assert events[0]["detail"].startswith("config: ") and "parsecs" in events[0]["detail"]
    table = ring.cli("events")
    assert table.returncode == 0 and "reloaded" in table.stdout and "via sudo from alice" in table.stdout


def test_events_and_history_read_since_and_until_and_refuse_bad_input_in_one_line(ring, tmp_path):
    ring.agent("a", "exit 0")
    ring.roster(f"a {ring.agents_dir}/a.sh")
    assert ring.start_driver("--once").wait(timeout=30) == 0
    import sqlite3   # the first run two days old, as a long-running ring's would be
    con = sqlite3.connect(ring.journal_path)
    con.execute("UPDATE runs SET started_at = started_at - 172800, ended_at = ended_at - 172800")
    con.execute("UPDATE events SET at = at - 172800")
    con.commit()
    con.close()
    assert ring.start_driver("--once").wait(timeout=30) == 0
    old_day = (datetime.now() - timedelta(days=2)).strftime("%Y-%m-%d")
    assert len(as_json(ring.cli("history", "--since", "today", "--json"))) == 1
    assert len(as_json(ring.cli("history", "--until", "yesterday", "--json"))) == 1
    assert len(as_json(ring.cli("history", "--since", old_day, "--until", "1d", "--json"))) == 1
    assert len(as_json(ring.cli("history", "--since", f"{old_day} 00:00", "--json"))) == 2
    assert len(as_json(ring.cli("events", "--since", "1h", "--json"))) == 2   # started, ok
    assert len(as_json(ring.cli("events", "--until", "1d ago", "--json"))) == 2
    table = ring.cli("history")
    assert old_day in table.stdout, table.stdout   # a run of another day shows its date
    for args in (("history", "--since", "soon"), ("events", "--until", "2026-02-30"),
                 ("events", "--since", "x" * 100_000), ("events", "nosuch")):
        res = ring.cli(*args)
        assert res.returncode == 2, (args, res)
        assert len(one_line(res)) < 400
    afile = tmp_path / "a-file"
    afile.write_text("")
    for args in (("events",), ("status", "a"), ("force-fail", "a"), ("reload", "--reason", "x")):
        res = subprocess.run(ring_cmd(args[0], "--state", str(afile), "--config", str(ring.config_path), *args[1:]),
                             env=ring.env, capture_output=True, text=True, timeout=30)
        assert res.returncode != 0 and "is not a directory" in one_line(res), (args, res)


# --- completion -------------------------------------------------------------------------------

@pytest.mark.parametrize("shell", ["bash", "zsh", "fish"])
def test_completion_prints_the_shells_script(ring, shell):
    res = ring.cli("completion", shell)
    assert res.returncode == 0, res.stderr
    assert "_RINGD_COMPLETE" in res.stdout
    if shutil.which(shell) is None:
        return
    if shell == "bash":   # sourced, it completes agent names through the real command
        ring.agent("a", "exit 0")
        ring.roster(f"alpha {ring.agents_dir}/a.sh", f"beta {ring.agents_dir}/a.sh")
        bin_dir = ring.base / "bin"
        bin_dir.mkdir()
        (bin_dir / "ringd").write_text(f'#!/bin/sh\nexec {sys.executable} -m ringd "$@"\n')
        (bin_dir / "ringd").chmod(0o755)
        script = ('eval "$(ringd completion bash)"; complete -p ringd; '
                  f'COMP_WORDS=(ringd status --state {ring.state} al); COMP_CWORD=4; '
                  '_ringd_completion ringd; echo "${COMPREPLY[@]}"')
        env = dict(ring.env, PATH=f"{bin_dir}{os.pathsep}{ring.env.get('PATH', '')}")
        out = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, timeout=60)
        assert "complete -o nosort -F _ringd_completion ringd" in out.stdout, out
        assert out.stdout.strip().endswith("alpha"), out


def test_an_unknown_shell_is_a_usage_error(ring):
    res = ring.cli("completion", "tcsh")
    assert res.returncode == 2 and "tcsh" in one_line(res)


# --- messages say what happened ---------------------------------------------------------------

def test_a_skip_says_how_long_the_run_had_been_going(ring):
    """`run 27 ended as skipped after 0.04s` for a run that had been going 3.1 s:
    the figure was the skip's own wait."""
    ring.agent("a", "exec sleep 60")
    ring.write_config(ring={"run_budget": 30, "stall_threshold": 40})
    ring.roster(f"a {ring.agents_dir}/a.sh")
    ring.start_driver()
    row = wait_until(lambda: running_of(ring, "a"), timeout=20, message="a running")
    wait_until(lambda: time.time() - row["started_at"] >= 2.0, timeout=10, message="two seconds of run")
    res = ring.cli("skip")
    assert res.returncode == 0, res.stderr
    going = float(res.stdout.split(" skipped after ")[1].split("s of running")[0])
    final = ring.rows("SELECT * FROM runs WHERE id = ?", row["id"])[0]
    assert going >= 2.0 and abs(going - final["duration"]) < 0.06, (res.stdout, final["duration"])


@pytest.mark.parametrize("backoff, words", [(60, "back-off lifted"),
                                            (0.2, "back-off already over; the next one starts at 0.2s again")])
def test_resume_calls_a_back_off_a_back_off(ring, backoff, words):
    """A back-off that had run out by the time of `ringd resume` was lifted as a `streak`."""
    ring.agent("deferring", "exit 75")
    ring.write_config(ring={"backoff_initial": backoff, "backoff_max": 120})
    ring.roster(f"deferring {ring.agents_dir}/deferring.sh")
    assert ring.start_driver("--once").wait(timeout=30) == 0
    wait_until(lambda: ring.rows("SELECT backoff_until FROM agents WHERE name = 'deferring'")[0][0] < time.time()
               or backoff == 60, timeout=10, message="the back-off over")
    res = ring.cli("resume", "deferring")
    assert res.returncode == 0, res.stderr
    assert words in res.stdout and "streak" not in res.stdout, res.stdout


def test_an_agent_that_ringd_next_started_is_not_shown_quarantined_while_it_runs(ring):
    ring.agent("wedgy", "exec sleep 60")
    ring.agent("other", "exec sleep 60")
    ring.write_config(ring={"run_budget": 30, "stall_threshold": 40})
    ring.roster(f"other {ring.agents_dir}/other.sh", f"wedgy {ring.agents_dir}/wedgy.sh")
    from ringd.journal.sqlite import AgentState, Journal
    j = Journal.open(ring.state)
    with j.transaction() as tx:
        tx.put_agent(AgentState("wedgy", quarantined_until=time.time() + 3600, bad_streak=3))
    j.close()
    ring.start_driver()
    wait_until(lambda: running_of(ring, "other"), timeout=20, message="other running")
    assert "QUARANTINED" in ring.cli("status").stdout
    assert ring.cli("next", "wedgy").returncode == 0
    assert ring.cli("skip").returncode == 0
    wait_until(lambda: running_of(ring, "wedgy"), timeout=20, message="wedgy started by ringd next")
    doc = as_json(ring.cli("status", "--json"))
    assert doc["current"]["agent"] == "wedgy" and doc["current"]["out_of_turn"] is True
    line = [x for x in ring.cli("status").stdout.splitlines() if x.split()[:2] == ["1", "wedgy"]][0]
    assert "QUARANTINED" not in line and "started by ringd next" in line, line
    assert "QUARANTINED" not in ring.cli("status", "wedgy").stdout


# --- silence ----------------------------------------------------------------------------------

def test_a_silent_agent_raises_one_alert_is_marked_and_counted_until_an_ok_run(ring):
    """A real driver and a real alert command: `flaky` fails until a flag file
    exists. With silent_after 1.5 s it raises one `silent` alert, status marks
    it silent, metrics count it; an ok run ends the silence."""
    flag = ring.state / "be-ok"
    ring.agent("flaky", f'[ -e "{flag}" ] && exit 0\nsleep 0.2; exit 1')
    sink = ring.base / "alerts.jsonl"
    ring.agent("alert", f'cat >> "{sink}"; echo >> "{sink}"')
    ring.write_config(alerts={"command": [str(ring.agents_dir / "alert.sh")], "silent_after": 1.5,
                              "failures_in_a_row": 1000})
    ring.roster(f"flaky {ring.agents_dir}/flaky.sh")
    ring.start_driver()

    def silent_alerts():
        if not sink.exists():
            return []
        return [a for a in (json.loads(x) for x in sink.read_text().splitlines() if x.strip())
                if a["event"] == "silent"]
    first = wait_until(silent_alerts, timeout=20, message="the silent alert")
    assert first[0]["agent"] == "flaky" and first[0]["seconds"] >= 1.5
    doc = as_json(ring.cli("status", "--json"))
    assert doc["agents"][0]["silent"] is True
    assert "SILENT" in ring.cli("status").stdout
    wait_until(lambda: "ring_agents_silent 1" in (ring.state / "metrics.prom").read_text(), timeout=10,
               message="ring_agents_silent 1")
    time.sleep(1.0)   # more beats look at the same silence: no second alert
    assert len(silent_alerts()) == 1
    flag.touch()
    wait_until(lambda: not as_json(ring.cli("status", "--json"))["agents"][0]["silent"], timeout=20,
               message="an ok run ends the silence")
    wait_until(lambda: "ring_agents_silent 0" in (ring.state / "metrics.prom").read_text(), timeout=10,
               message="ring_agents_silent 0")
    flag.unlink()
    wait_until(lambda: len(silent_alerts()) == 2, timeout=20, message="a new silence, a new alert")


def test_a_pause_forgotten_past_paused_longer_than_raises_one_alert(ring):
    sink = ring.base / "alerts.jsonl"
    ring.agent("alert", f'cat >> "{sink}"; echo >> "{sink}"')
    ring.agent("a", "sleep 0.1")
    ring.write_config(alerts={"command": [str(ring.agents_dir / "alert.sh")], "paused_longer_than": 1})
    ring.roster(f"a {ring.agents_dir}/a.sh")
    ring.start_driver()
    wait_until(lambda: ring.runs(), timeout=20, message="a first run")
    assert ring.cli("pause", "--reason", "maintenance").returncode == 0

    def paused_alerts():
        text = sink.read_text() if sink.exists() else ""
        return [a for a in (json.loads(x) for x in text.splitlines() if x.strip()) if a["event"] == "paused_too_long"]
    got = wait_until(paused_alerts, timeout=20, message="the paused_too_long alert")
    assert got[0]["agent"] is None and "ringd resume" in got[0]["detail"]
    time.sleep(1.0)
    assert len(paused_alerts()) == 1


# --- who did it, as a real second user ----------------------------------------------------------

NOBODY = 65534


def _runuser_nobody(argv, env, cwd):
    """``argv`` as the real user nobody (``runuser -u nobody``), in a private
    mount namespace where /root (this interpreter's home, 0700) is a tmpfs
    holding a bind of the Python install only - nothing outside it changes."""
    if os.geteuid() != 0:
        pytest.skip("needs root to run as another user")
    for tool in ("unshare", "runuser"):
        if not shutil.which(tool):
            pytest.skip(f"{tool} not available")
    import shlex
    import tempfile
    setup, stash = [], None
    if argv[0].startswith("/root/"):
        top = "/root/" + argv[0].split("/")[2]            # e.g. /root/.pyenv
        stash = tempfile.mkdtemp(prefix="ring-py-")
        setup = [f"mount --bind {top} {stash}", "mount -t tmpfs -o mode=755,size=1m tmpfs /root",
                 f"mkdir -p {top}", f"mount --bind {stash} {top}"]
    script = " && ".join(setup + ["exec runuser -u nobody -- " + " ".join(map(shlex.quote, argv))])
    try:
        r = subprocess.run(["unshare", "-m", "sh", "-c", script], env=env, cwd=cwd, capture_output=True,
                           text=True, timeout=60, stdin=subprocess.DEVNULL)
    finally:
        if stash:
            os.rmdir(stash)
    if r.returncode != 0 and ("unshare failed" in r.stderr or "runuser:" in r.stderr):
        pytest.skip(f"cannot switch users here: {r.stderr.strip()[:200]}")
    return r


from test_security import nobody_install  # noqa: E402,F401 - the code nobody runs: a world-readable copy


def _ring_in(base, ring):
    """The ring's files under ``base`` (world-traversable), config 0644."""
    os.chmod(base, 0o755)
    ring.state = base / "state"
    ring.state.mkdir(mode=0o700)
    ring.config_path = base / "ring.yaml"
    ring.write_config()
    os.chmod(ring.config_path, 0o644)
    ring.agent("a", "exit 0")
    ring.roster(f"a {ring.agents_dir}/a.sh")
    os.chmod(ring.roster_path, 0o644)


@pytest.fixture
def open_base():
    """A world-traversable temp dir (a pytest tmp dir is 0700 root's), removed afterwards."""
    import tempfile
    base = Path(tempfile.mkdtemp(prefix="ring-actor-"))
    try:
        yield base
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_the_actor_is_the_real_caller_sudo_user_recorded_and_nobody_refused_cleanly(ring, nobody_install,
                                                                                    open_base):
    """Root (as ``sudo`` leaves it: SUDO_USER=alice) pauses a root-owned ring: the
    event names root, uid 0, via sudo from alice. The user nobody, who cannot
    reach that ring's journal, is refused in one line and changes nothing; given
    a read path (state dir and journal readable), nobody reads the trail but is
    still refused a pause. On a ring of nobody's own, nobody's pause is recorded
    as nobody, uid 65534 - who the kernel says, not what the environment claims."""
    python, pythonpath, install = nobody_install
    base = open_base
    _ring_in(base, ring)
    assert ring.start_driver("--once").wait(timeout=30) == 0
    sudo_env = dict(ring.env, SUDO_USER="alice", SUDO_UID="1000")
    res = subprocess.run(ring_cmd("pause", *ring.common(), "--reason", "disk swap"), env=sudo_env,
                         capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL)
    assert res.returncode == 0, res.stderr
    (paused,) = [e for e in as_json(ring.cli("events", "--json")) if e["kind"] == "paused"]
    assert paused["actor"] == {"user": "root", "uid": 0, "sudo_user": "alice", "tty": None, "ssh_client": None}
    assert paused["reason"] == "disk swap"

    env = {k: v for k, v in ring.env.items() if not k.startswith("SUDO_")}
    env["PYTHONPATH"] = pythonpath
    common = ["--state", str(ring.state), "--config", str(ring.config_path)]
    nobody = lambda *args: _runuser_nobody([*python, "-m", "ringd", args[0], *common, *args[1:]], env, install)  # noqa: E731
    before = ring.rows("SELECT * FROM events ORDER BY id")
    for args in (("pause", "a", "--reason", "not mine"), ("resume", "--reason", "not mine"), ("events",)):
        r = nobody(*args)
        assert r.returncode not in (0, None), (args, r.stdout)
        assert one_line(r).startswith("ringd:"), (args, r.stderr)
        print(f"nobody: ringd {args[0]}: exit {r.returncode}: {one_line(r)}")
    # a read path: the state dir and the journal readable by others, writable by root only
    os.chmod(ring.state, 0o755)
    for p in ring.state.iterdir():
        if p.is_file():
            os.chmod(p, 0o644)
    r = nobody("events", "--json")
    assert r.returncode == 0, r.stderr
    assert [e["actor"]["sudo_user"] for e in json.loads(r.stdout) if e["kind"] == "paused"] == ["alice"]
    r = nobody("pause", "a", "--reason", "still not mine")
    assert r.returncode not in (0, None) and one_line(r).startswith("ringd:"), r.stderr
    print(f"nobody with a read path: ringd pause: exit {r.returncode}: {one_line(r)}")
    assert [tuple(x) for x in ring.rows("SELECT * FROM events ORDER BY id")] == [tuple(x) for x in before]

    # a ring of nobody's own: nobody's request is recorded as nobody
    own = base / "nobodys"
    own.mkdir(mode=0o700)
    os.chown(own, NOBODY, NOBODY)
    r = _runuser_nobody([*python, "-m", "ringd", "pause", "--state", str(own), "--config", str(ring.config_path),
                         "--reason", "my own ring"], dict(env, SUDO_USER="root-pretender"), install)
    assert r.returncode == 0, r.stderr
    r = _runuser_nobody([*python, "-m", "ringd", "events", "--json", "--state", str(own),
                         "--config", str(ring.config_path)], env, install)
    (mine,) = json.loads(r.stdout)
    assert (mine["actor"]["user"], mine["actor"]["uid"], mine["reason"]) == ("nobody", NOBODY, "my own ring")
    assert mine["actor"]["sudo_user"] == "root-pretender"   # recorded beside the uid, never instead of it


def test_a_reload_by_another_user_is_refused_in_one_line_and_signals_nothing(ring, nobody_install, open_base):
    """nobody, given a read path to root's live ring, asks for a reload: it is
    refused in one line, the driver is never signalled (it has no reload
    record) and no event is written."""
    python, pythonpath, install = nobody_install
    _ring_in(open_base, ring)
    ring.agent("a", "exec sleep 60")
    ring.write_config(ring={"run_budget": 30, "stall_threshold": 40})
    os.chmod(ring.config_path, 0o644)
    ring.start_driver()
    wait_until(lambda: running_of(ring, "a"), timeout=20, message="a running")
    os.chmod(ring.state, 0o755)
    for p in ring.state.iterdir():
        if p.is_file():
            os.chmod(p, 0o644)
    before = ring.rows("SELECT * FROM events ORDER BY id")
    env = {k: v for k, v in ring.env.items() if not k.startswith("SUDO_")}
    env["PYTHONPATH"] = pythonpath
    r = _runuser_nobody([*python, "-m", "ringd", "reload", "--state", str(ring.state), "--config",
                         str(ring.config_path), "--reason", "not mine"], env, install)
    assert r.returncode == 1 and one_line(r).startswith("ringd:"), (r.returncode, r.stdout, r.stderr)
    # (the driver writes its heartbeat 0600 again at each beat: unreadable, or read and the journal unwritable)
    assert "no driver is running" not in one_line(r), one_line(r)
    print(f"nobody: ringd reload: exit {r.returncode}: {one_line(r)}")
    assert (ring.heartbeat() or {}).get("reload") is None, "the driver was signalled"
    assert [tuple(x) for x in ring.rows("SELECT * FROM events ORDER BY id")] == [tuple(x) for x in before]
