"""Agents that talk back and scheduled agents, against a real driver and real
agents: phases in status and history, the watchdog, strangers ignored, an
``every`` agent between fast ones, catch-up after a restart, bad schedules."""
from __future__ import annotations

import json
import os
import signal
import socket
import stat
import subprocess
import sys
import time

import pytest

from conftest import history_json, kill_tree, status_json, wait_until

NOTIFY = f"{sys.executable} -m ringd notify"


def current(ring) -> dict:
    if not ring.runs():   # the journal is being created: status would say so, not what runs
        return {}
    return status_json(ring).get("current") or {}


def stop(ring, drv) -> None:
    drv.send_signal(signal.SIGTERM)
    assert drv.wait(timeout=20) == 0


def test_phases_show_in_status_and_history(ring):
    go = ring.base / "go"
    env_out = ring.base / "agent-env"
    ring.agent("talker", f"""
        env > {env_out}
        {NOTIFY} --status "phase one: fetching"
        while [ ! -e {go} ]; do sleep 0.05; done
        {NOTIFY} --status "phase two: $(printf 'x%.0s' $(seq 300))"
        """)
    ring.roster(f"talker {ring.agents_dir}/talker.sh")
    ring.write_config(ring={"run_budget": 30, "stall_threshold": 40})
    drv = ring.start_driver()
    cur = wait_until(lambda: (c := current(ring)).get("phase") == "phase one: fetching" and c,
                     timeout=20, message="phase in status --json")
    sock = ring.state / f"notify-{cur['run_id']}.sock"
    st = os.stat(sock)
    assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
    env = dict(line.split("=", 1) for line in env_out.read_text().splitlines() if "=" in line)
    assert env["NOTIFY_SOCKET"] == str(sock) and "WATCHDOG_USEC" not in env
    wide = dict(ring.env, COLUMNS="400")   # the tables fit any width; this one shows it all
    table = ring.cli("status", env=wide)
    assert "phase one: fetching" in table.stdout
    go.write_text("")
    rows = wait_until(lambda: [r for r in history_json(ring) if r["status"] == "ok"], timeout=20,
                      message="run done")
    assert rows[0]["phase"] == "phase two: " + "x" * 189          # cut to 200 characters
    assert not sock.exists()                                        # removed when the run ended
    assert "phase two" in ring.cli("history", env=wide).stdout
    stop(ring, drv)


def test_a_run_force_failed_or_reaped_keeps_the_last_phase_it_said(ring):
    """SPEC: the last STATUS= is kept on the run (``phase`` in history). A run an
    operator force-fails, and one whose driver dies (SIGKILL) and that the
    reaper closes, keep it too - they are the runs whose phase says most."""
    ring.agent("talker", f'{NOTIFY} --status "phase of run $RING_RUN_ID"\nexec sleep 60')
    ring.write_config(ring={"run_budget": 30, "stall_threshold": 40})
    ring.roster(f"talker {ring.agents_dir}/talker.sh")
    drv = ring.start_driver()
    wait_until(lambda: current(ring).get("phase") == "phase of run 1", timeout=20, message="run 1's phase")
    assert ring.cli("force-fail", "talker").returncode == 0
    wait_until(lambda: current(ring).get("phase") == "phase of run 2", timeout=20, message="run 2's phase")
    drv.kill()                      # the driver dies; its agent is an orphan until a reaper runs
    drv.wait(timeout=10)
    runs = {r["id"]: r for r in history_json(ring)}   # history reaps first
    assert (runs[1]["status"], runs[1]["phase"]) == ("interrupted", "phase of run 1"), runs[1]
    assert (runs[2]["status"], runs[2]["phase"]) == ("interrupted", "phase of run 2"), runs[2]
    assert "died" in runs[2]["reason"]


def test_watchdog_ends_a_silent_agent_in_about_n_seconds(ring):
    out = ring.base / "wd-env"
    ring.agent("silent", f'echo "$WATCHDOG_USEC $WATCHDOG_PID $$" > {out}\nexec sleep 60')
    ring.write_config(ring={"watchdog": 1.0, "run_budget": 30, "stall_threshold": 40})
    ring.roster(f"silent {ring.agents_dir}/silent.sh")
    drv = ring.start_driver()
    row = wait_until(lambda: [r for r in ring.runs() if r["status"] != "running"], timeout=30,
                     message="watchdog ended the run")[0]
    stop(ring, drv)
    assert row["status"] == "stalled"
    assert row["reason"].startswith("watchdog: no ping for 1 s"), row["reason"]
    assert 0.9 <= row["duration"] <= 4.0, row["duration"]
    usec, wd_pid, pid = out.read_text().split()
    assert usec == "1000000" and wd_pid == pid                     # WATCHDOG_PID is the agent itself
    agent = [a for a in status_json(ring)["agents"] if a["name"] == "silent"][0]
    assert agent["consecutive_failures"] >= 1                      # a bad ending ("Whose fault")


def test_agents_watchdog_null_exempts_one_agent_from_the_rings_watchdog(ring):
    """``ring.watchdog: 1`` for every agent, ``agents.legacy.watchdog: null`` for
    one that does not speak the protocol: it runs its 2.5 s to ``ok``, with no
    WATCHDOG_USEC to honour, while a silent agent without the exemption is ended."""
    seen = ring.base / "legacy-env"
    ring.agent("legacy", f'echo "${{WATCHDOG_USEC:-none}}" > {seen}\nsleep 2.5')
    ring.agent("silent", "exec sleep 30")
    ring.write_config(ring={"watchdog": 1.0, "run_budget": 30, "stall_threshold": 40},
                      agents={"legacy": {"watchdog": None}})
    ring.roster(f"legacy {ring.agents_dir}/legacy.sh", f"silent {ring.agents_dir}/silent.sh")
    drv = ring.start_driver("--once")
    out, err = drv.communicate(timeout=60)
    assert drv.returncode == 0, err.decode()
    rows = {r["agent"]: r for r in ring.runs()}
    assert rows["legacy"]["status"] == "ok" and rows["legacy"]["duration"] >= 2.4, dict(rows["legacy"])
    assert seen.read_text().strip() == "none"
    assert rows["silent"]["status"] == "stalled" and rows["silent"]["reason"].startswith("watchdog:")


def test_watchdog_never_ends_an_agent_that_pings(ring):
    agent = ring.agents_dir / "pinger.py"
    agent.write_text("import sdnotify, time\n"
                     "n = sdnotify.SystemdNotifier(debug=True)\n"
                     "for i in range(20):\n"
                     "    n.notify(f'WATCHDOG=1\\nSTATUS=tick {i}')\n"
                     "    time.sleep(0.15)\n")
    ring.write_config(agents={"pinger": {"watchdog": 1.5, "run_budget": 30, "stall_threshold": 40}})
    ring.roster(f"pinger {sys.executable} {agent}")
    drv = ring.start_driver()
    beat = wait_until(lambda: current(ring).get("agent_beat_age") is not None and current(ring),
                      timeout=20, message="agent_beat_age in status")
    assert 0 <= beat["agent_beat_age"] < 1.5
    row = wait_until(lambda: [r for r in ring.runs() if r["status"] != "running"], timeout=30,
                     message="run done")[0]
    stop(ring, drv)
    assert row["status"] == "ok", dict(row)
    assert row["duration"] >= 2.5


def test_watchdog_trigger_ends_the_run_as_stalled_at_once_without_a_watchdog(ring):
    """systemd's WATCHDOG=trigger ("I found an internal error: act as if my
    watchdog starved", WatchdogSec= or not): the run ends ``stalled`` at once,
    reason ``watchdog: ...``, its tree killed - not at its 30 s budget."""
    agent = ring.agents_dir / "wedged.py"
    agent.write_text("import sdnotify, subprocess, time\n"
                     "subprocess.Popen(['sleep', '60'])\n"
                     "sdnotify.SystemdNotifier(debug=True).notify('STATUS=stuck\\nWATCHDOG=trigger')\n"
                     "time.sleep(60)\n")
    ring.write_config(ring={"run_budget": 30, "stall_threshold": 40})
    ring.roster(f"wedged {sys.executable} {agent}")
    drv = ring.start_driver()
    row = wait_until(lambda: [r for r in ring.runs() if r["status"] != "running"], timeout=20,
                     message="the triggered run ended")[0]
    stop(ring, drv)
    assert row["status"] == "stalled" and row["reason"].startswith("watchdog:"), dict(row)
    assert row["duration"] < 10 and row["phase"] == "stuck"
    assert "WATCHDOG=trigger" in drv.communicate()[1].decode()


def test_a_run_that_gets_no_notify_socket_is_not_ended_by_a_watchdog_it_cannot_ping(ring):
    """Run 1 leaves a directory where run 2's socket goes: run 2 gets no
    socket (logged), so no voice - and no watchdog to starve: it runs its
    2.5 s to its end ``ok``, not ``stalled`` after 1 s."""
    seen = ring.base / "run2-env"   # one file per run: run 3 may start before the driver is stopped
    ring.agent("a", f"""
        if [ "$RING_RUN_ID" = 1 ]; then mkdir "$RING_STATE/notify-2.sock"; exit 0; fi
        echo "${{NOTIFY_SOCKET:-none}} ${{WATCHDOG_USEC:-none}}" > {seen}-$RING_RUN_ID
        sleep 2.5
        """)
    ring.write_config(ring={"watchdog": 1.0, "run_budget": 30, "stall_threshold": 40})
    ring.roster(f"a {ring.agents_dir}/a.sh")
    drv = ring.start_driver()
    rows = wait_until(lambda: (r := [r for r in ring.runs() if r["status"] != "running"])[1:] and r, timeout=30,
                      message="two runs ended")
    stop(ring, drv)
    assert (rows[0]["status"], rows[1]["status"]) == ("ok", "ok"), [dict(r) for r in rows]
    assert rows[1]["duration"] >= 2.4
    assert (ring.base / "run2-env-2").read_text().split() == ["none", "none"]   # run 3, if any, has its own
    log = drv.communicate()[1].decode()
    assert "run 2: a gets no notify socket" in log and "watchdog is off for this run" in log, log


def test_a_strangers_datagrams_change_nothing(ring):
    ring.agent("quiet", f'{NOTIFY} --status "mine"\nexec sleep 60')
    ring.write_config(agents={"quiet": {"watchdog": 2.0}}, ring={"run_budget": 30, "stall_threshold": 40})
    ring.roster(f"quiet {ring.agents_dir}/quiet.sh")
    drv = ring.start_driver()
    cur = wait_until(lambda: (c := current(ring)).get("phase") == "mine" and c, timeout=20,
                     message="the agent's own phase")
    path = str(ring.state / f"notify-{cur['run_id']}.sock")
    # this test process is not of the run: its STATUS and pings must be ignored,
    # so the silent agent still starves its watchdog
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        deadline = time.monotonic() + 6
        while time.monotonic() < deadline and not [r for r in ring.runs() if r["status"] != "running"]:
            try:
                s.sendto(b"STATUS=stranger\nWATCHDOG=1", path)
            except OSError:
                break   # the run ended and its socket is gone
            assert current(ring).get("phase") in ("mine", None)
            time.sleep(0.1)
    row = wait_until(lambda: [r for r in ring.runs() if r["status"] != "running"], timeout=20,
                     message="watchdog")[0]
    stop(ring, drv)
    assert row["status"] == "stalled" and row["reason"].startswith("watchdog:"), dict(row)
    assert history_json(ring)[-1]["phase"] == "mine"


def test_an_every_agent_runs_every_2s_between_fast_agents_never_beside_one(ring):
    for n in "abc":
        ring.agent(n, "sleep 0.1")
    ring.agent("tick", "sleep 0.05")
    ring.write_config(agents={"tick": {"every": 2}})
    a = ring.agents_dir
    ring.roster(f"a {a}/a.sh", f"tick {a}/tick.sh", f"b {a}/b.sh", f"c {a}/c.sh")
    drv = ring.start_driver()
    wait_until(lambda: len([r for r in ring.runs() if r["agent"] == "tick"]) >= 3, timeout=40,
               message="three ticks")
    stop(ring, drv)
    rows = [r for r in ring.runs() if r["status"] != "interrupted"]
    ticks = [r["started_at"] for r in rows if r["agent"] == "tick"]
    gaps = [b - a for a, b in zip(ticks, ticks[1:])]
    assert all(1.5 <= g <= 2.5 for g in gaps), gaps
    spans = sorted((r["started_at"], r["ended_at"]) for r in ring.runs() if r["ended_at"])
    for (s1, e1), (s2, _) in zip(spans, spans[1:]):
        assert e1 <= s2, "two runs overlapped"
    assert {r["agent"] for r in rows} == {"a", "b", "c", "tick"}
    doc = status_json(ring)
    due = {x["name"]: x["next_due"] for x in doc["agents"]}
    assert due["a"] is None and due["tick"] is not None


def test_a_never_run_cron_agent_is_due_at_the_next_minute(ring):
    ring.agent("a", "sleep 0.2")
    ring.agent("nightly", "true")
    ring.write_config(agents={"nightly": {"schedule": "* * * * *"}})
    ring.roster(f"a {ring.agents_dir}/a.sh", f"nightly {ring.agents_dir}/nightly.sh")
    first_minute = (int(time.time()) // 60 + 1) * 60   # the first minute boundary after the driver starts
    drv = ring.start_driver()
    wait_until(lambda: len(ring.runs()) >= 2, timeout=20, message="ring turning")
    due = {x["name"]: x["next_due"] for x in status_json(ring)["agents"]}
    stop(ring, drv)
    from datetime import datetime
    at = datetime.fromisoformat(due["nightly"])
    assert at.second == 0 and at.microsecond == 0 and at.timestamp() - time.time() <= 61
    # never at start: not before the next matching minute (this test may straddle one, when
    # the job runs at it and status then names the minute after)
    assert not [r for r in ring.runs() if r["agent"] == "nightly" and r["started_at"] < first_minute]


def test_scheduled_agents_have_a_next_due_before_any_driver_ran(ring):
    # no journal yet: next_due is null only for an ordinary agent (SPEC), so an
    # `every` agent is due at once and a cron one at its next matching minute
    ring.agent("a", "true")
    ring.write_config(agents={"tick": {"every": 60}, "nightly": {"schedule": "0 0 * * *"}})
    ring.roster(f"a {ring.agents_dir}/a.sh", f"tick {ring.agents_dir}/a.sh", f"nightly {ring.agents_dir}/a.sh")
    before = time.time()
    doc = status_json(ring)
    assert not ring.journal_path.exists()   # status created nothing
    due = {x["name"]: x["next_due"] for x in doc["agents"]}
    from datetime import datetime
    assert due["a"] is None
    assert due["tick"] is not None and abs(datetime.fromisoformat(due["tick"]).timestamp() - before) < 10
    nightly = datetime.fromisoformat(due["nightly"]).astimezone()
    assert (nightly.hour, nightly.minute, nightly.second) == (0, 0, 0)
    assert 0 < nightly.timestamp() - before <= 86400 + 3600


def test_status_names_the_turn_the_driver_takes_around_scheduled_agents(ring):
    # SPEC: status between runs names the next agent; a scheduled agent takes no
    # ordinary turn (passed over until due), a due one goes first, and a scheduled
    # run in flight is not where the ring resumes
    ring.agent("a", "true")
    ring.agent("job", "sleep 30")
    ring.write_config(agents={"job": {"every": 3600}, "nightly": {"schedule": "0 0 1 1 *"}})
    d = ring.agents_dir
    ring.roster(f"a {d}/a.sh", f"b {d}/a.sh")
    assert ring.start_driver("--once").wait(timeout=30) == 0          # a, b: b ran last
    ring.roster(f"a {d}/a.sh", f"job {d}/job.sh", f"b {d}/a.sh", f"nightly {d}/a.sh", f"c {d}/a.sh")
    assert status_json(ring)["next"]["agent"] == "job"                 # never ran: due at once
    drv = ring.start_driver()
    wait_until(lambda: current(ring).get("agent") == "job", timeout=20, message="job running")
    nxt = status_json(ring)["next"]
    assert nxt["agent"] == "c" and nxt["after_current_run"], nxt     # after b; nightly is not due
    assert ring.cli("skip").returncode == 0
    wait_until(lambda: len(ring.runs()) >= 4, timeout=20, message="the turn after job")
    stop(ring, drv)
    assert [r["agent"] for r in ring.runs()][:4] == ["a", "b", "job", "c"]


def test_a_tz_that_names_no_zone_file_still_runs_the_ring_check_accepted(ring):
    """TZ as a POSIX rule (no zone file of that name) or a name no zone has:
    ``ringd check`` accepts the ring, so ``ringd run`` runs it and ``status``
    shows each scheduled agent's next due - never a ZoneInfoNotFoundError."""
    ring.agent("a", "exit 0")
    ring.agent("job", "exit 0")
    ring.write_config(agents={"job": {"every": 3600}, "cron": {"schedule": "0 12 * * *"}})
    ring.roster(f"a {ring.agents_dir}/a.sh", f"job {ring.agents_dir}/job.sh", f"cron {ring.agents_dir}/job.sh")
    for tz in ("CET-1CEST,M3.5.0,M10.5.0/3", "Nowhere/Land"):
        env = dict(ring.env, TZ=tz)
        assert ring.cli("check", env=env).returncode == 0
        drv = ring.start_driver("--once", env=env)
        out, err = drv.communicate(timeout=60)
        assert drv.returncode == 0 and b"Traceback" not in err, err.decode()
        r = ring.cli("status", "--json", env=env)
        assert r.returncode == 3 and "Traceback" not in r.stderr, r.stderr
        due = {a["name"]: a["next_due"] for a in json.loads(r.stdout)["agents"]}
        assert due["a"] is None and due["job"] and due["cron"], due
    assert {r["agent"] for r in ring.runs() if r["status"] == "ok"} == {"a", "job"}


def test_status_reads_cron_times_in_the_drivers_zone_not_its_own(ring):
    """A cron schedule is read in the driver's local time (its ``TZ``). ``status``
    read it in its own: an operator's shell with another ``TZ`` than the service
    showed every cron due time off by the difference (here 9 hours)."""
    from datetime import datetime, timedelta
    from zoneinfo import ZoneInfo
    ring.agent("a", "exit 0")
    ring.write_config(agents={"noon": {"schedule": "0 12 * * *"}})
    ring.roster(f"a {ring.agents_dir}/a.sh", f"noon {ring.agents_dir}/a.sh")
    drv = ring.start_driver("--once", env=dict(ring.env, TZ="Asia/Tokyo"))
    out, err = drv.communicate(timeout=60)
    assert drv.returncode == 0, err.decode()
    r = ring.cli("status", "--json", env=dict(ring.env, TZ="UTC"))
    due = datetime.fromisoformat({a["name"]: a["next_due"] for a in json.loads(r.stdout)["agents"]}["noon"])
    tokyo = due.astimezone(ZoneInfo("Asia/Tokyo"))
    assert (tokyo.hour, tokyo.minute) == (12, 0), due
    assert timedelta(0) < due - datetime.now(due.tzinfo) <= timedelta(days=1, minutes=1), due


def test_bad_cron_exits_78_naming_the_key(ring):
    ring.agent("a", "true")
    ring.roster(f"a {ring.agents_dir}/a.sh")
    ring.write_config(agents={"a": {"schedule": "61 * * * *"}})
    for cmd in (["check"], ["run", "--once"]):
        r = ring.cli(*cmd)
        assert r.returncode == 78, r.stderr
        assert "agents.a.schedule" in r.stderr and "Traceback" not in r.stderr
    ring.write_config(agents={"a": {"every": 0}})
    r = ring.cli("check")
    assert r.returncode == 78 and "agents.a.every" in r.stderr


def test_with_a_watchdog_a_missing_program_is_still_an_error(ring):
    ring.write_config(ring={"watchdog": 1.0})
    ring.roster("ghost ./no/such/program")
    code = ring.start_driver("--once").wait(timeout=30)
    assert code == 0
    row = ring.runs()[0]
    assert row["status"] == "error" and "No such file" in row["reason"], dict(row)


@pytest.mark.parametrize("watchdog", [None, 1.0])
def test_a_script_without_a_shebang_is_an_error_with_or_without_a_watchdog(ring, watchdog):
    """An executable text file without ``#!`` is refused by exec (ENOEXEC): the
    run is an ``error`` and nothing of it runs - with a watchdog too, whose
    WATCHDOG_PID is set without a shell (``sh -c 'exec "$0"'`` ran such a
    file as a shell script)."""
    ran = ring.base / "ran"
    agent = ring.agents_dir / "plain"
    agent.write_text(f"touch {ran}\n")
    agent.chmod(0o755)
    ring.write_config(ring={"watchdog": watchdog})
    ring.roster(f"plain {agent}")
    code = ring.start_driver("--once").wait(timeout=30)
    assert code == 0
    row = ring.runs()[0]
    assert row["status"] == "error" and "Exec format error" in row["reason"], dict(row)
    assert not ran.exists()


def test_a_journal_from_before_phases_gets_the_column(ring):
    import sqlite3
    from ringd.journal.schema_sqlite import SCHEMA
    old = SCHEMA.replace("    phase        TEXT,              -- the agent's last STATUS= (see ringd.host.notify)\n", "")
    assert "phase" not in old
    con = sqlite3.connect(ring.journal_path)
    con.executescript(old + "INSERT INTO runs(agent, position, status, started_at, ended_at, duration)"
                            " VALUES ('a', 0, 'ok', 1.0, 2.0, 1.0);")
    con.close()
    os.chmod(ring.journal_path, 0o600)
    ring.agent("a", f'{NOTIFY} --status "after the upgrade"')
    ring.roster(f"a {ring.agents_dir}/a.sh")
    assert ring.start_driver("--once").wait(timeout=30) == 0
    runs = history_json(ring)
    assert [r["phase"] for r in runs] == ["after the upgrade", None]


def test_a_phase_that_cannot_be_published_is_said_once_a_run_not_once_a_second(ring):
    """notify.json cannot be written (here a directory is in its place; a full
    state dir does the same): the run goes on and the driver says so once, like
    a heartbeat it cannot write - not once a second for as long as its agent
    talks."""
    ring.agent("chatty", f"""
        mkdir "$RING_STATE/notify.json"
        for i in $(seq 40); do {NOTIFY} --ping --status "step $i"; sleep 0.1; done
        """)
    ring.write_config(ring={"run_budget": 30, "stall_threshold": 40})
    ring.roster(f"chatty {ring.agents_dir}/chatty.sh")
    drv = ring.start_driver()
    row = wait_until(lambda: [r for r in ring.runs() if r["status"] != "running"], timeout=40,
                     message="the chatty run ended")[0]
    stop(ring, drv)
    assert row["status"] == "ok" and row["phase"] == "step 40" and row["duration"] > 2.5, dict(row)
    log = drv.communicate()[1].decode()
    assert log.count("cannot publish its phase") == 1, log


# --- a flood of descriptors whose close blocks, from outside the run --------------------------

FLOOD = """import array, json, os, socket, struct, sys, time
seconds, prefixes = float(sys.argv[1]), sys.argv[2:]
srv = socket.socket()
srv.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
srv.bind(("127.0.0.1", 0))
srv.listen(256)
peers = []   # never read: each passed socket's close lingers until this process exits


def lingering():
    c = socket.socket()
    c.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    c.connect(srv.getsockname())
    peers.append(srv.accept()[0])
    c.setblocking(False)
    try:
        while True:
            c.send(b"x" * 4096)
    except BlockingIOError:
        pass
    c.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 5))
    return c


def targets():
    with open("/proc/net/unix") as f:
        for line in list(f)[1:]:
            parts = line.split()
            if len(parts) > 7 and parts[7].startswith(tuple(prefixes)):
                yield parts[7]


got = {"sent": 0, "refused": 0, "full": 0}
out = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
deadline = time.monotonic() + seconds
while time.monotonic() < deadline:
    for name in set(targets()):
        c = lingering()
        fds = array.array("i", [c.fileno()] * 250)
        try:
            out.sendmsg([b"STATUS=flood\\nWATCHDOG=1"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)],
                        socket.MSG_DONTWAIT, "\\0" + name[1:] if name.startswith("@") else name)
            got["sent"] += 1
        except OSError as e:
            kind = {BlockingIOError: "full", PermissionError: "refused"}.get(type(e))
            if kind:
                got[kind] += 1   # (else: that run's socket is gone)
            c.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))   # ours is the last close
        c.close()
    time.sleep(0.05)
print(json.dumps(got))
"""


def _flood_while_pinging(ring, request, as_user=None) -> dict:
    """A well-behaved agent pings every 0.2 s (watchdog 1.5 s) for 1.6 s a
    run, while a process that is not of the run (``as_user``: of another user)
    passes lingering TCP sockets, 250 copies a datagram, to every notify socket
    of the ring for 6 s. Returns what the flood sent and the runs it saw."""
    seen = ring.base / "notify-sockets"
    agent = ring.agents_dir / "pinger.py"
    agent.write_text("import os, socket, time\n"
                     f"open({str(seen)!r}, 'a').write(os.environ['NOTIFY_SOCKET'] + '\\n')\n"
                     "s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)\n"
                     "for _ in range(8):\n"
                     "    s.sendto(b'WATCHDOG=1', os.environ['NOTIFY_SOCKET'])\n"
                     "    time.sleep(0.2)\n")
    agent.chmod(0o644)
    ring.write_config(ring={"watchdog": 1.5, "run_budget": 30, "stall_threshold": 40})
    ring.roster(f"pinger {sys.executable} {agent}")
    drv = ring.start_driver()
    first = wait_until(lambda: seen.exists() and seen.read_text().split("\n")[0], timeout=30,
                       message="the first run's notify socket")
    prefix = first.rsplit("-", 2)[0] + "-" if first.startswith("@") else os.path.dirname(first) + "/notify-"
    argv = [sys.executable if as_user is None else "/usr/bin/python3", "-I", "-c", FLOOD, "6", prefix]
    if as_user is not None:
        argv = ["runuser", "-u", as_user, "--", *argv]
    flood = subprocess.Popen(argv, stdout=subprocess.PIPE, start_new_session=True)
    request.addfinalizer(lambda: kill_tree(flood.pid))
    before = len(ring.runs())
    out, _ = flood.communicate(timeout=60)
    during = [dict(r) for r in ring.runs()[before:] if r["status"] != "running"]
    stop(ring, drv)
    return {**json.loads(out), "runs": during, "first": first}


def test_a_strangers_flood_of_lingering_descriptors_never_delays_the_runs_pings(ring, request):
    """A process of the ring's user but not of the run floods every run's socket
    with descriptors whose close lingers 5 s: they are installed in the driver
    before it can see who sent them, and dropped without waiting on any, so
    the agent's own pings are heard - no run ends ``stalled`` (with a capped
    closer thread, every run did, and the agent was quarantined)."""
    got = _flood_while_pinging(ring, request)
    assert got["sent"] > 20, got
    assert len(got["runs"]) >= 2 and {r["status"] for r in got["runs"]} == {"ok"}, got["runs"]


def test_another_users_flood_never_reaches_a_ring_whose_state_dir_path_is_too_long(ring, request):
    """The state dir's path is too long for a socket address: the socket is a
    0600 file in a private 0700 dir, never an abstract socket. ``nobody``
    flooding it with lingering descriptors is refused every datagram, and the
    agent's runs end ``ok``."""
    deep = ring.base / ("d" * 100) / "state"
    deep.mkdir(mode=0o700, parents=True)
    ring.state = deep
    got = _flood_while_pinging(ring, request, as_user="nobody")
    assert not got["first"].startswith("@") and str(deep) not in got["first"], got["first"]
    assert not os.path.exists(os.path.dirname(got["first"]))   # the private dir went with the last run
    assert got["sent"] == 0 and got["refused"] > 20, got
    assert len(got["runs"]) >= 2 and {r["status"] for r in got["runs"]} == {"ok"}, got["runs"]


def test_datagrams_of_senders_gone_before_they_are_read_are_counted_in_status(ring):
    """docs/agents.md "Talking back": a helper that sends and exits at once may
    be gone (reaped) before the driver reads its datagram, and then cannot be
    told from a stranger. Every such datagram is counted: ``current.notify_dropped``
    while the run goes on, ``driver.notify_dropped`` for the driver's life. Of
    40 pings from send-and-exit helpers, heard plus dropped is 40."""
    agent = ring.agents_dir / "burst.py"
    agent.write_text("import os, socket, time\n"
                     "for _ in range(40):\n"
                     "    pid = os.fork()\n"
                     "    if pid == 0:\n"
                     "        socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM).sendto(\n"
                     "            b'WATCHDOG=1', os.environ['NOTIFY_SOCKET'])\n"
                     "        os._exit(0)\n"
                     "    os.waitpid(pid, 0)\n"
                     "time.sleep(30)\n")
    ring.write_config(ring={"run_budget": 60, "stall_threshold": 70})
    ring.roster(f"burst {sys.executable} {agent}")
    drv = ring.start_driver()

    def counted():
        notes = json.loads((ring.state / "notify.json").read_text()) if (ring.state / "notify.json").exists() else {}
        cur = current(ring)
        if notes.get("pings", 0) + notes.get("dropped", 0) == 40 and cur.get("notify_dropped") == notes["dropped"]:
            return notes
    notes = wait_until(counted, timeout=30, message="40 datagrams heard or dropped, in status")
    wait_until(lambda: status_json(ring)["driver"]["notify_dropped"] == notes["dropped"], timeout=10,
               message="the driver's count in its heartbeat")
    stop(ring, drv)
    assert status_json(ring)["driver"]["notify_dropped"] == notes["dropped"]   # kept by the clean stop
    print(f"send-and-exit helpers: {notes['pings']} heard, {notes['dropped']} dropped of 40")
