"""Issue 6 with real processes: quarantine of repeat offenders, alert commands
that can never hurt the ring, and metrics.prom that agree with status."""
import json
import os
import time


from conftest import wait_until

WEDGE = "trap '' TERM\nwhile :; do sleep 0.05; done"


def quarantine_rows(ring, agent="wedge"):
    return [r for r in ring.runs() if r["agent"] == agent and r["status"] == "skipped"
            and "quarantined" in (r["reason"] or "")]


def fast_wedge_ring(ring, cooloff=600, extra_agent_body="true", stall=0.3):
    ring.write_config(ring={"quarantine_after": 3, "quarantine_cooloff": cooloff},
                      agents={"wedge": {"run_budget": 0.1, "stall_threshold": stall}})
    ring.agent("wedge", WEDGE)
    ring.agent("fine", extra_agent_body)
    ring.roster(f"wedge {ring.agents_dir}/wedge.sh", f"fine {ring.agents_dir}/fine.sh")


def test_three_stalls_quarantine_and_the_next_laps_take_no_stall_time(ring):
    fast_wedge_ring(ring, stall=1.0)   # five laps that paid it would take 5 s: headroom for a loaded box
    ring.start_driver()
    wait_until(lambda: quarantine_rows(ring), timeout=30, message="wedge quarantined")
    wedge_runs = [r["status"] for r in ring.runs() if r["agent"] == "wedge"]
    assert wedge_runs == ["stalled", "stalled", "stalled", "skipped"]
    n = len(ring.runs())
    t0 = time.monotonic()
    wait_until(lambda: len(ring.runs()) >= n + 5, timeout=20, message="five more laps")
    elapsed = time.monotonic() - t0
    later = ring.runs()[n:]
    assert {r["agent"] for r in later} == {"fine"}, "a quarantined agent was started"
    assert elapsed < 5 * 1.0, f"laps still paid the stall threshold ({elapsed:.2f}s)"
    assert len(quarantine_rows(ring)) == 1, "one skipped row on entry, not one per lap"
    (state,) = ring.rows("SELECT quarantined_until FROM agents WHERE name = 'wedge'")
    assert state["quarantined_until"] > time.time() + 500


def test_resume_ends_the_quarantine(ring):
    fast_wedge_ring(ring)
    ring.start_driver()
    wait_until(lambda: quarantine_rows(ring), timeout=30, message="wedge quarantined")
    status = json.loads(ring.cli("status", "--json").stdout)
    wedge = [a for a in status["agents"] if a["name"] == "wedge"][0]
    assert wedge["quarantined_until"] is not None
    assert ring.cli("resume", "nosuch").returncode == 2
    r = ring.cli("resume", "wedge")
    assert r.returncode == 0, r.stderr
    n = len(ring.runs())
    wait_until(lambda: any(x["agent"] == "wedge" and x["status"] == "stalled" for x in ring.runs()[n:]),
               timeout=20, message="wedge runs again after resume")


def test_cooloff_gives_one_probation_run_which_can_end_or_renew_it(ring):
    marker = ring.base / "wedged-runs"
    # wedges on its first three runs, then behaves
    body = f"""
        echo x >> {marker}
        if [ $(wc -l < {marker}) -le 3 ]; then
            trap '' TERM
            while :; do sleep 0.05; done
        fi
        exit 0
        """
    fast_wedge_ring(ring, cooloff=1.0)
    ring.agent("wedge", body)
    ring.start_driver()
    wait_until(lambda: quarantine_rows(ring), timeout=30, message="wedge quarantined")
    wait_until(lambda: any(r["agent"] == "wedge" and r["status"] == "ok" for r in ring.runs()),
               timeout=20, message="probation run after the cool-off")
    (state,) = ring.rows("SELECT quarantined_until, bad_streak FROM agents WHERE name = 'wedge'")
    assert state["quarantined_until"] is None and state["bad_streak"] == 0


def test_probation_that_wedges_again_renews_the_quarantine(ring):
    fast_wedge_ring(ring, cooloff=1.0)
    ring.start_driver()
    wait_until(lambda: len(quarantine_rows(ring)) >= 2, timeout=30, message="quarantine renewed")
    statuses = [r["status"] for r in ring.runs() if r["agent"] == "wedge"]
    assert statuses[:6] == ["stalled", "stalled", "stalled", "skipped", "stalled", "skipped"]


def test_a_changed_roster_line_lifts_the_quarantine(ring):
    fast_wedge_ring(ring)
    ring.start_driver()
    wait_until(lambda: quarantine_rows(ring), timeout=30, message="wedge quarantined")
    ring.agent("fixed", "exit 0")
    ring.roster(f"wedge {ring.agents_dir}/fixed.sh", f"fine {ring.agents_dir}/fine.sh")
    wait_until(lambda: any(r["agent"] == "wedge" and r["status"] == "ok" for r in ring.runs()),
               timeout=20, message="wedge runs with its new line")


def test_hanging_alert_command_is_killed_and_never_slows_the_ring(ring):
    seen = ring.base / "alerts.jsonl"
    pids = ring.base / "alert.pids"
    alert = ring.agent("alert", f"echo $$ >> {pids}\ncat >> {seen}\necho \"$RING_EVENT $RING_AGENT|$RING_DETAIL\" >> {seen}.env\nexec sleep 60")
    # fast_fail below the agent's run time: this ring must turn at full speed (no spin wait)
    ring.write_config(ring={"fast_fail": 0.01},
                      alerts={"command": [str(alert)], "failures_in_a_row": 2, "timeout": 1.0})
    ring.agent("bad", "sleep 0.05; exit 1")
    ring.roster(f"bad {ring.agents_dir}/bad.sh")
    ring.start_driver()
    # alerts run concurrently (each hangs): on a loaded box the alert for 4
    # failures can write before the one for 2, so look for it, not at line 1
    env_seen = seen.parent / "alerts.jsonl.env"
    wait_until(lambda: seen.exists() and '2 times' in seen.read_text() and env_seen.exists()
               and env_seen.read_text().endswith("\n"), timeout=15, message="alert received")
    event = next(e for e in map(json.loads, seen.read_text().splitlines()) if "2 times" in e["detail"])
    assert event["event"] == "failures" and event["agent"] == "bad"
    env_event, env_detail = env_seen.read_text().split("\n")[0].split("|")
    assert env_event == "failures bad" and env_detail.startswith("bad failed ")   # RING_DETAIL
    assert event["detail"].startswith("bad failed ") and isinstance(event["run_id"], int)
    n = len(ring.runs())
    wait_until(lambda: len(ring.runs()) >= n + 6, timeout=10, message="ring keeps turning during the alert")
    import psutil
    first = int(pids.read_text().split()[0])
    def killed():
        try:
            return psutil.Process(first).status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True
    wait_until(killed, timeout=10, message="hanging alert killed at its limit")
    wait_until(lambda: "killed after 1s" in (ring.state / "logs" / "alerts.log").read_text(),
               timeout=5, message="alert log says it was killed")


def test_missing_alert_command_never_stops_the_ring(ring):
    ring.write_config(alerts={"command": ["/no/such/alerter"], "failures_in_a_row": 1},
                      ring={"backoff_max": 0.5})   # five runs in seconds, not a doubling back-off's 7.5
    ring.agent("bad", "exit 1")
    ring.roster(f"bad {ring.agents_dir}/bad.sh")
    ring.start_driver()
    wait_until(lambda: len(ring.runs()) >= 5, timeout=15, message="ring turning")
    wait_until(lambda: "cannot start" in (ring.state / "logs" / "alerts.log").read_text(),
               timeout=10, message="alert failure logged")


def test_metrics_parse_and_agree_with_status(ring):
    from prometheus_client.parser import text_string_to_metric_families
    ring.write_config(ring={"backoff_initial": 60, "backoff_max": 60})  # c still backs off on lap 2
    ring.agent("a", "exit 0")
    ring.agent("b", "exit 2")
    ring.agent("c", "exit 75")
    ring.roster(*(f"{n} {ring.agents_dir}/{n}.sh" for n in "abc"))
    # c's back-off must outlast the second driver's start-up on a loaded box
    ring.write_config(ring={"backoff_initial": 600, "backoff_max": 1200})
    for _ in range(2):
        code = ring.start_driver("--once").wait(timeout=30)
        assert code == 0
    text = (ring.state / "metrics.prom").read_text()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    runs = {}
    for s in families["ring_runs"].samples:   # the parser strips _total from counters
        if s.name == "ring_runs_total":
            runs.setdefault(s.labels["agent"], 0)
            runs[s.labels["agent"]] += s.value
    status = json.loads(ring.cli("status", "--json").stdout)
    assert {a["name"]: a["runs"] for a in status["agents"]} == runs == {"a": 2, "b": 2, "c": 1}
    assert families["ring_deferred_agents"].samples[0].value == 1
    assert "ring_driver_heartbeat_timestamp_seconds" in families
    last = {s.labels["agent"]: s.value for s in families["ring_last_run_duration_seconds"].samples}
    assert set(last) == {"a", "b", "c"}


def test_the_laps_counter_says_what_it_counts_across_drivers(ring):
    """ring_laps_total's HELP said "by the current driver", but the count is the
    journal's and goes on across drivers: each of three drivers (run --once,
    one lap each) shows the laps finished before its own."""
    from prometheus_client.parser import text_string_to_metric_families
    ring.agent("a", "exit 0")
    ring.roster(f"a {ring.agents_dir}/a.sh")
    for n in range(3):
        assert ring.start_driver("--once").wait(timeout=30) == 0
        text = (ring.state / "metrics.prom").read_text()
        (family,) = [f for f in text_string_to_metric_families(text) if f.name == "ring_laps"]
        assert family.samples[0].value == n == ring.heartbeat()["lap"] - 1
    assert "# HELP ring_laps_total Laps of the ring finished before the current one, counted in the journal " \
           "across driver restarts." in text


def test_watcher_alerts_when_it_replaces_the_driver(ring):
    import signal as sig
    seen = ring.base / "watch-alerts"
    alert = ring.agent("alert", f"cat >> {seen}; echo >> {seen}")
    ring.write_config(alerts={"command": [str(alert)]})
    ring.agent("a", "sleep 0.1")
    ring.roster(f"a {ring.agents_dir}/a.sh")
    ring.start_watcher()
    first = wait_until(lambda: (ring.heartbeat() or {}).get("pid"), timeout=15, message="driver up")
    os.kill(first, sig.SIGKILL)
    wait_until(lambda: seen.exists() and "driver-replaced" in seen.read_text(), timeout=20,
               message="driver-replaced alert")
    event = json.loads(seen.read_text().strip().splitlines()[0])
    assert event["event"] == "driver-replaced" and event["state_dir"] == str(ring.state)


def test_metrics_are_never_half_written_when_the_disk_fills(tmp_path):
    """A write cut short (a full disk, a file size limit) leaves the old
    metrics.prom whole: the collector never reads half a file."""
    import subprocess
    import sys
    import textwrap
    from conftest import REPO
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    (state / "metrics.prom").write_text("# old\n")
    # RLIMIT_FSIZE: write() stores what fits and returns a short count, as on a full disk
    code = textwrap.dedent(f"""
        import resource
        from pathlib import Path
        from ringd.loops.metrics import write_metrics
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
        try:
            write_metrics(Path({str(state)!r}), "x" * 10000 + "\\n")
        except OSError as e:
            print("refused", e.errno)
        """)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    assert "refused" in r.stdout
    assert (state / "metrics.prom").read_text() == "# old\n"
    assert [p.name for p in state.iterdir()] == ["metrics.prom"], "a temp file was left behind"


def _fresh_journal(tmp_path):
    """A new journal in a state dir of its own (the caller closes it)."""
    from ringd.journal.sqlite import Journal
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    return Journal.open(state)


def test_metrics_hold_only_roster_agents_in_quarantine_or_back_off(tmp_path):
    """An agent renamed or removed from the roster while quarantined or backing
    off is no longer held: metrics say so, as status does (and ``ringd resume``
    could not lift it: unknown name). Its run counter stays (counters never go back)."""
    from ringd.core.settings import RingSettings
    from ringd.loops.metrics import render, snapshot
    from ringd.core.records import AgentState
    now = time.time()
    journal = _fresh_journal(tmp_path)
    try:
        with journal.transaction() as tx:
            tx.put_agent(AgentState(name="old-name", quarantined_until=now + 600, bad_streak=3,
                                    consecutive_failures=3))
            tx.put_agent(AgentState(name="gone", backoff_until=now + 60, consecutive_deferrals=1))
            tx.put_agent(AgentState(name="kept", quarantined_until=now + 600, bad_streak=3))
            tx.put_agent(AgentState(name="edited", quarantined_until=now + 600, bad_streak=3,
                                    quarantine_line="edited ./old"))   # its line fixed since
            tx.add_skipped("old-name", 0, "quarantined", "driver", now)
        snap = snapshot(journal, now=now, roster=[("new-name", "new-name ./x"), ("kept", "kept ./k"),
                                                  ("edited", "edited ./new")], ring=RingSettings())
    finally:
        journal.close()
    assert snap.quarantined == ["kept"] and snap.deferred == []
    assert set(snap.consecutive_failures) == {"kept", "edited"}
    assert snap.roster_agents == 3
    text = render(snap)
    assert "ring_quarantined_agents 1\n" in text and "ring_deferred_agents 0\n" in text
    assert 'ring_runs_total{agent="old-name",status="skipped"} 1' in text
    # nor is its last run late forever (an alert on the last run's age)
    assert 'ring_last_run_end_timestamp_seconds{agent="old-name"}' not in text


def _pid_gone(pid):
    import psutil
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_what_an_alert_command_leaves_behind_ends_at_its_timeout(ring):
    """An alert command that forks a daemon (setsid, double fork) and exits: the
    daemon ends at the alert's timeout, even when the ring then runs nothing
    more (here: the driver is gone), never lives on."""
    pids = ring.base / "daemon.pid"
    alert = ring.agent("alert", f"setsid sh -c 'echo $$ > {pids}.tmp; mv {pids}.tmp {pids}; exec sleep 300' &\nexit 0")
    ring.write_config(alerts={"command": [str(alert)], "failures_in_a_row": 1, "timeout": 1.0})
    ring.agent("bad", "exit 1")
    ring.roster(f"bad {ring.agents_dir}/bad.sh")
    assert ring.start_driver("--once").wait(timeout=30) == 0
    daemon = int(wait_until(lambda: pids.exists() and pids.read_text().strip(), timeout=15,
                            message="the alert's daemon started"))
    wait_until(lambda: _pid_gone(daemon), timeout=10, message="the alert's daemon ended at the alert's timeout")


def test_an_alert_command_that_floods_its_output_cannot_fill_the_disk(ring):
    """alerts.log keeps the first part of one alert's output, and says how much
    it dropped: a command printing without end cannot fill the state dir."""
    alert = ring.agent("alert", "head -c 3000000 /dev/zero | tr '\\0' x\necho; echo done >&2")
    ring.write_config(alerts={"command": [str(alert)], "failures_in_a_row": 1, "timeout": 10.0})
    ring.agent("bad", "exit 1")
    ring.roster(f"bad {ring.agents_dir}/bad.sh")
    assert ring.start_driver("--once").wait(timeout=30) == 0
    log = ring.state / "logs" / "alerts.log"
    wait_until(lambda: log.exists() and b"not kept" in log.read_bytes(), timeout=15,
               message="alerts.log says the output was cut")
    assert log.stat().st_size < 100 * 1024


def test_an_alert_storm_runs_a_bounded_number_of_alert_commands_at_once(ring):
    """A whole ring failing while the alert command hangs: at most
    MAX_ALERTS_RUNNING alert commands (and their supervisors) live at once, the
    rest are dropped, and the driver says so, instead of a process (and a Python
    interpreter) per alert piling up until the box runs out of memory."""
    from ringd.host.alerts import MAX_ALERTS_RUNNING
    started = ring.base / "alerts.started"
    alert = ring.agent("alert", f"echo $$ >> {started}\nexec sleep 60")
    ring.write_config(ring={"fast_fail": 0.01},
                      alerts={"command": [str(alert)], "failures_in_a_row": 1, "timeout": 30.0})
    ring.agent("bad", "sleep 0.05; exit 1")
    ring.roster(f"bad {ring.agents_dir}/bad.sh")
    driver = ring.start_driver()
    wait_until(lambda: len(ring.runs()) >= MAX_ALERTS_RUNNING + 10, timeout=30,
               message="more failures than alert commands may run")
    wait_until(lambda: "not sent" in driver.err_path.read_text(), timeout=10,
               message="the driver says alerts were dropped")
    wait_until(lambda: started.exists() and started.read_text().strip(), timeout=15,
               message="alert commands started")
    lines = started.read_text().split()
    assert len(lines) <= MAX_ALERTS_RUNNING, f"{len(lines)} alert commands started at once"


def test_alerts_log_is_rotated_like_ringd_log(ring):
    """logs/alerts.log past its rotation size is moved to alerts.log.1 (one old
    copy) before the next alert writes: it never grows without end."""
    from ringd.host.safefile import LOG_ROTATE_BYTES
    logs = ring.state / "logs"
    logs.mkdir(mode=0o700)
    log = logs / "alerts.log"
    with open(log, "wb") as f:
        f.truncate(LOG_ROTATE_BYTES + 1)   # sparse: no 16 MiB written
    os.chmod(log, 0o600)
    alert = ring.agent("alert", "echo alert-ran")
    ring.write_config(alerts={"command": [str(alert)], "failures_in_a_row": 1})
    ring.agent("bad", "exit 1")
    ring.roster(f"bad {ring.agents_dir}/bad.sh")
    assert ring.start_driver("--once").wait(timeout=30) == 0
    wait_until(lambda: log.exists() and b"alert-ran" in log.read_bytes(), timeout=15, message="alert output")
    assert log.stat().st_size < 1024
    assert (logs / "alerts.log.1").stat().st_size == LOG_ROTATE_BYTES + 1


def test_a_quarantine_a_force_fail_completed_says_so(tmp_path):
    """The quarantine's skipped row names the ending that completed the streak:
    a force-failed run is no 'stalled or timeout'."""
    from ringd.core.settings import RingSettings
    from ringd.core.records import AgentState
    from ringd.journal.transitions import close_in
    now = time.time()
    journal = _fresh_journal(tmp_path)
    try:
        with journal.transaction() as tx:
            tx.put_agent(AgentState(name="w", bad_streak=2))
            run_id = tx.start_run("w", 0, now=now, run_budget=1.0, stall_threshold=2.0,
                                  driver_pid=os.getpid(), driver_start=None)
            closed = close_in(tx, run_id, "w", 0, "interrupted", source="operator", now=now + 1,
                              ring=RingSettings(quarantine_after=3), line="w ./w")
        assert closed.settled.entered_quarantine
        (row,) = [r for r in journal.history("w") if r.status == "skipped"]
    finally:
        journal.close()
    assert "quarantined" in row.reason and "3 bad endings in a row" in row.reason
    assert "interrupted" in row.reason and "stalled or timeout" not in row.reason


def test_a_journal_removed_under_the_driver_is_taken_up_again(ring):
    """``rm journal.db`` while the driver runs (to start afresh): the driver
    wrote on into the removed file, so status showed no run ever again, its
    counters and metrics disagreed, and ``ringd pause`` went to a journal the
    driver never read. The driver takes up the journal at the path."""
    ring.agent("a", "sleep 0.1")
    ring.roster(f"a {ring.agents_dir}/a.sh")
    driver = ring.start_driver()
    wait_until(lambda: ring.journal_path.exists() and len(ring.runs()) >= 2, timeout=20, message="runs")
    old_ids = {r["id"] for r in ring.runs()}
    os.unlink(ring.journal_path)   # alone: its -wal and -shm stay (the old journal's, in use)
    wait_until(lambda: ring.journal_path.exists()   # (finished ones: the agent's counter counts those)
               and len([r for r in ring.runs() if r["status"] != "running"]) >= 2, timeout=20,
               message="runs recorded in a journal at the path again")
    assert not {r["id"] for r in ring.runs()} & old_ids, "the new journal took up the old one's log"
    assert ring.rows("PRAGMA integrity_check")[0][0] == "ok"
    doc = json.loads(ring.cli("status", "--json").stdout)
    assert doc["agents"][0]["runs"] >= 2
    assert ring.cli("pause").returncode == 0
    wait_until(lambda: "ring paused by the operator" in driver.err_path.read_text(), timeout=20,
               message="the driver heard the pause")
    assert "was removed or replaced under the driver" in driver.err_path.read_text()


def test_metrics_prom_that_is_a_fifo_a_symlink_or_a_directory(ring):
    """Whatever was put at metrics.prom, the ring turns: a FIFO or a symlink is
    replaced (never opened, never written through), a directory makes the driver
    say once that it cannot write its metrics."""
    ring.agent("a", "exit 0")
    ring.roster(f"a {ring.agents_dir}/a.sh")
    prom = ring.state / "metrics.prom"
    outside = ring.base / "outside.txt"
    outside.write_text("keep\n")
    os.mkfifo(prom)
    assert ring.start_driver("--once").wait(timeout=30) == 0
    assert prom.is_file() and "ring_runs_total" in prom.read_text()
    prom.unlink()
    prom.symlink_to(outside)
    assert ring.start_driver("--once").wait(timeout=30) == 0
    assert not prom.is_symlink() and outside.read_text() == "keep\n"
    prom.unlink()
    prom.mkdir()
    driver = ring.start_driver("--once")
    assert driver.wait(timeout=30) == 0
    err = driver.err_path.read_text()
    assert err.count("cannot write metrics") == 1, err
    assert len([r for r in ring.runs() if r["status"] == "ok"]) == 3


def _prom_runs(ring):
    from prometheus_client.parser import text_string_to_metric_families
    text = (ring.state / "metrics.prom").read_text()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    runs = {}
    for s in families["ring_runs"].samples:
        if s.name == "ring_runs_total":
            runs[s.labels["agent"]] = runs.get(s.labels["agent"], 0) + s.value
    current = families["ring_current_run_elapsed_seconds"].samples[0].value
    return runs, current


def test_metrics_follow_a_run_the_reaper_closed_when_no_driver_runs(ring):
    """The driver died during a run; ``ringd status`` reaps it: metrics.prom no
    longer says a run is in flight, and its counters equal status's runs (no
    driver would rewrite it before one starts again)."""
    import signal as sig
    ring.write_config(ring={"run_budget": 60, "stall_threshold": 90})
    ring.agent("a", "exit 0")
    ring.agent("long", "sleep 60")
    ring.roster(f"a {ring.agents_dir}/a.sh", f"long {ring.agents_dir}/long.sh")
    driver = ring.start_driver()
    wait_until(lambda: (ring.state / "metrics.prom").exists() and _prom_runs(ring)[1] > 0, timeout=20,
               message="metrics with the long run in flight")
    os.kill(driver.pid, sig.SIGKILL)
    driver.wait(timeout=10)
    doc = json.loads(ring.cli("status", "--json").stdout)   # reaps the dead driver's run
    runs, current = _prom_runs(ring)
    assert {a["name"]: a["runs"] for a in doc["agents"]} == runs == {"a": 1, "long": 1}
    assert current == 0


def test_metrics_follow_a_force_fail_when_no_driver_runs(ring):
    import signal as sig
    ring.write_config(ring={"run_budget": 60, "stall_threshold": 90})
    ring.agent("long", "sleep 60")
    ring.roster(f"long {ring.agents_dir}/long.sh")
    driver = ring.start_driver()
    wait_until(lambda: (ring.state / "metrics.prom").exists() and _prom_runs(ring)[1] > 0, timeout=20,
               message="metrics with the run in flight")
    os.kill(driver.pid, sig.SIGKILL)
    driver.wait(timeout=10)
    assert ring.cli("force-fail", "long").returncode == 0
    runs, current = _prom_runs(ring)
    assert runs == {"long": 1} and current == 0
    (row,) = ring.runs()
    assert row["status"] == "interrupted"
