"""``build_status`` is pure: health, shapes and edge cases without processes."""
from pathlib import Path

from ringd.inputs.config import Config
from ringd.journal.sqlite import RunRow
from ringd.cli.status import StatusInputs, build_status, status_exit_code, unknown_agent

NOW = 1_800_000_000.0


def doc(**kw):
    args = dict(state_dir=Path("/s"), config=Config(), now=NOW, heartbeat=None, driver_alive=False,
                watcher=None, watcher_is_alive=False, running=None, agent_rows={},
                roster_path=Path("/s/ring.txt"), roster=["a", "b"], roster_error=None)
    args.update(kw)
    return build_status(StatusInputs(**args))


def hb(age, **kw):
    return dict({"pid": 42, "pid_start": 1.0, "started_at": "2027-01-15T08:00:00+00:00",
                 "at_epoch": NOW - age, "lap": 7, "stopped": False}, **kw)


def test_health_and_exit_codes():
    never = doc()
    assert never["driver"]["health"] == "stopped" and status_exit_code(never) == 3
    ok = doc(heartbeat=hb(5), driver_alive=True)  # default interval 10 s
    assert ok["driver"] | {} == ok["driver"] and ok["driver"]["health"] == "ok" and status_exit_code(ok) == 0
    assert ok["driver"]["pid"] == 42 and ok["driver"]["lap"] == 7 and ok["driver"]["heartbeat_age"] == 5
    stale = doc(heartbeat=hb(21), driver_alive=True)
    assert stale["driver"]["health"] == "stale" and status_exit_code(stale) == 1
    dead = doc(heartbeat=hb(1), driver_alive=False)
    assert dead["driver"]["health"] == "dead" and dead["driver"]["pid"] is None and status_exit_code(dead) == 1
    stopped = doc(heartbeat=hb(100, stopped=True), driver_alive=False)
    assert stopped["driver"]["health"] == "stopped" and status_exit_code(stopped) == 3


def test_agents_current_and_times():
    run = RunRow(id=9, agent="b", position=1, status="running", started_at=NOW - 12.5, ended_at=None,
                 duration=None, exit_code=None, signal=None, reason=None, pid=77, pid_start=1.0,
                 run_budget=60, stall_threshold=90, log_path=None, driver_pid=42, driver_start=1.0)
    rows = {"a": {"runs": 4, "consecutive_failures": 2, "backoff_until": NOW + 60, "skip_requested": 1,
                  "quarantined_until": NOW - 1, "last_status": "deferred", "last_started_at": NOW - 30,
                  "last_ended_at": NOW - 29, "last_duration": 1.23456, "last_exit_code": 75}}
    d = doc(heartbeat=hb(1), driver_alive=True, running=run, agent_rows=rows)
    assert d["current"]["agent"] == "b" and d["current"]["run_id"] == 9 and d["current"]["elapsed"] == 12.5
    assert d["current"]["budget_left"] == 47.5
    a, b = d["agents"]
    assert a["runs"] == 4 and a["consecutive_failures"] == 2 and a["skip_requested"] is True
    assert a["backoff_until"].endswith("+00:00") and a["quarantined_until"] is None  # passed: over
    assert a["last_duration"] == 1.235 and a["last_exit_code"] == 75
    assert b["last_status"] == "running" and b["runs"] == 0 and b["position"] == 1


def test_broken_roster_falls_back_to_journal_agents():
    rows = {"z": {"last_position": 0, "runs": 1}, "y": {"last_position": 1, "runs": 1}}
    d = doc(roster=None, roster_error="ring.txt:3: bad", agent_rows=rows)
    assert [a["name"] for a in d["agents"]] == ["z", "y"] and d["roster"]["error"] == "ring.txt:3: bad"


def test_watcher_restarts_in_window():
    w = {"pid": 5, "restarts": [NOW - 10, "2020-01-01T00:00:00+00:00", NOW - 5], "gave_up": True,
         "last_poll_at": NOW - 2}
    d = doc(watcher=w, watcher_is_alive=True, gave_up=True)
    assert d["watcher"] == {"pid": 5, "alive": True, "last_poll_at": d["watcher"]["last_poll_at"],
                            "restarts": 2, "gave_up": True}
    assert doc(watcher=w, watcher_is_alive=False)["watcher"]["pid"] is None
    # gave_up is what gather_status judged (heartbeat.watcher_gave_up), a marker-only give-up too
    assert doc(watcher=None, gave_up=True)["watcher"] == {"pid": None, "alive": False, "last_poll_at": None,
                                                          "restarts": 0, "gave_up": True}


def test_unknown_agent_message_is_short():
    e = unknown_agent("q" * 10_000, [f"agent-{i}" for i in range(500)])
    assert e.code == 2 and len(e.message) < 800 and "more)" in e.message


def test_an_orphans_cause_names_a_dead_driver_or_this_one_still_running():
    """The reason a reaped row carries (and its alert): a dead driver's run, or -
    in a journal restored under the driver - this live driver's own, long ended."""
    from ringd.journal.sqlite import RunRow
    from ringd.loops.reaper import orphan_cause
    row = RunRow(id=5, agent="a", position=0, status="running", started_at=1.0, ended_at=None,
                 duration=None, exit_code=None, signal=None, reason=None, pid=77, pid_start=9,
                 run_budget=None, stall_threshold=None, log_path=None, driver_pid=42, driver_start=1000)
    assert orphan_cause(row) == "driver (pid 42) died while it ran"
    assert orphan_cause(row, me=(42, 999)) == "driver (pid 42) died while it ran"   # same pid, another process
    assert orphan_cause(row, me=(42, 1000)).startswith("its driver (pid 42, still running) no longer runs it")


ESC = "\x1b]0;pwned\x07\x1b[2J\x1b[1A\r\n  9  forged  ok\u202e"


def test_text_from_the_journal_never_carries_a_control_character_to_the_terminal():
    """An agent's name, reason and phase as the journal holds them (any process of
    the ring's user can write it), a heartbeat's pid, a roster error: shown with
    their control characters as spaces, in plain output and rich's alike."""
    from ringd.cli.render import history_lines, status_lines
    run = RunRow(id=9, agent="b" + ESC, position=1, status="running", started_at=NOW - 1, ended_at=None,
                 duration=None, exit_code=None, signal=None, reason=None, pid=77, pid_start=1.0,
                 run_budget=60, stall_threshold=90, log_path=None, driver_pid=42, driver_start=1.0)
    d = doc(heartbeat=hb(1, pid="7" + ESC), driver_alive=False, running=run, roster=None,
            roster_error="ring.txt:3: bad" + ESC, agent_rows={"z" + ESC: {"last_position": 0, "runs": 1}},
            notes={"phase": "p" + ESC})
    runs = [{"id": 9, "agent": "b" + ESC, "status": "ok", "started_at": None, "duration": 1.0, "exit_code": 0,
             "signal": None, "reason": "r" + ESC, "phase": "p" + ESC}]
    for lines in (status_lines(d, now=NOW, plain=True), status_lines(d, now=NOW, plain=False, width=200),
                  history_lines(runs), history_lines(runs, plain=False, width=60)):
        shown = "\n".join("".join(t for t, _ in line) for line in lines)
        assert not any(c in shown for c in "\x1b\x07\r\u202e"), shown
        assert "forged" not in "".join(line[0][0] for line in lines if line)   # no line of its own
    texts = ["".join(t for t, _ in line) for line in status_lines(d, now=NOW, width=200)]
    assert any(t.startswith(" " * 9 + "[") and "%" in t for t in texts), texts   # the budget bar keeps its own line


def test_the_notes_the_failure_behaviour_tables_quote():
    """docs/failures.md: what ``ringd status`` shows in each case, as
    the tables quote it - over budget, skip requested, back-off, quarantine, a
    dead driver's pid, a watcher that is gone or gave up, restarts in window."""
    from ringd.cli.render import status_lines
    run = RunRow(id=9, agent="b", position=1, status="running", started_at=NOW - 70, ended_at=None,
                 duration=None, exit_code=None, signal=None, reason=None, pid=77, pid_start=1.0,
                 run_budget=60, stall_threshold=90, log_path=None, driver_pid=42, driver_start=1.0)
    rows = {"a": {"runs": 3, "consecutive_failures": 2, "backoff_until": NOW + 60, "skip_requested": 1,
                  "quarantined_until": NOW + 3600, "last_status": "failed", "last_started_at": NOW - 30,
                  "last_ended_at": NOW - 29, "last_duration": 1.0, "last_exit_code": None, "last_signal": 9}}
    w = {"pid": 5, "restarts": [NOW - 10], "gave_up": True, "last_poll_at": NOW - 12}

    def text(d):
        return "\n".join("".join(t for t, _ in line) for line in status_lines(d, now=NOW, plain=True, width=200))
    shown = text(doc(heartbeat=hb(1), driver_alive=True, running=run, agent_rows=rows, watcher=w, gave_up=True))
    for note in ("over budget", "skip requested", "back-off 1m", "QUARANTINED 1h", "not running  (last poll 12s ago)",
                 "1 restart in window", "GAVE UP (ringwatch reset clears it)"):
        assert note in shown, (note, shown)
    a = doc(heartbeat=hb(1), driver_alive=True, agent_rows=rows)["agents"][0]
    assert a["last_status"] == "failed" and a["last_signal"] == 9 and a["consecutive_failures"] == 2
    over = dict(rows["a"], backoff_until=NOW - 1, quarantined_until=NOW - 1)
    a = doc(heartbeat=hb(1), driver_alive=True, agent_rows={"a": over})["agents"][0]
    assert a["backoff_until"] is None and a["quarantined_until"] is None   # null once their time has passed
    dead = doc(heartbeat=hb(30), driver_alive=False)
    assert dead["driver"]["pid"] is None and dead["driver"]["last_pid"] == 42   # only ever a live driver's pid
    assert dead["driver"]["heartbeat_at"].endswith("+00:00")
    assert "DEAD" in text(dead) and "pid 42 gone without a clean stop" in text(dead)
    stale = text(doc(heartbeat=hb(25), driver_alive=True))
    assert "STALE" in stale and "likely stuck: heartbeat 25 s old" in stale


def test_notify_dropped_for_the_run_and_the_drivers_life():
    run = RunRow(id=9, agent="b", position=1, status="running", started_at=NOW - 2, ended_at=None,
                 duration=None, exit_code=None, signal=None, reason=None, pid=77, pid_start=1.0,
                 run_budget=60, stall_threshold=90, log_path=None, driver_pid=42, driver_start=1.0)
    d = doc(heartbeat=hb(1, notify_dropped=31), driver_alive=True, running=run, notes={"dropped": 9})
    assert (d["driver"]["notify_dropped"], d["current"]["notify_dropped"]) == (31, 9)
    for junk in (-1, 1.5, True, "9"):   # the heartbeat is in a state dir agents can write
        assert doc(heartbeat=hb(1, notify_dropped=junk), driver_alive=True)["driver"]["notify_dropped"] is None
    assert doc()["driver"]["notify_dropped"] is None and doc(running=run)["current"]["notify_dropped"] is None
