"""CLI conventions (SPEC "Operator controls", conventions) against a real driver:
global --state/--config, --version, one-line usage errors on both commands,
reading commands that warn on unsafe modes, never-cut piped output, check's
program warnings and --strict, the next turn and the live lap in status, the
log line of a fixed roster, shell completion of agent names, systemd time spans.
"""
from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from conftest import ring_cmd, wait_until, watch_cmd
from ringd.inputs.config import ConfigError, parse_config
from ringd.inputs.timespan import parse_timespan


def run(argv, ring, **kw):
    return subprocess.run(argv, env=kw.pop("env", ring.env), capture_output=True, text=True, timeout=30, **kw)


def one_line(res, prog="ringd"):
    assert "Traceback" not in res.stderr, res.stderr
    lines = [x for x in res.stderr.splitlines() if x.strip()]
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith(f"{prog}: "), lines[0]
    return lines[0]


# --- options, version, usage errors --------------------------------------------------

def test_global_locations_version_and_usage_errors(ring):
    ring.agent("a", "exec sleep 30")
    ring.roster(f"a {ring.agents_dir}/a.sh")
    driver = ring.start_driver()
    wait_until(lambda: (ring.heartbeat() or {}).get("pid") == driver.pid, message="driver beating")

    # --state/--config before the subcommand, after it, and mixed
    before = run(ring_cmd(*ring.common(), "status", "--json"), ring)
    assert before.returncode == 0, before.stderr
    assert json.loads(before.stdout)["driver"]["pid"] == driver.pid
    mixed = run(ring_cmd("--state", str(ring.state), "history", "--config", str(ring.config_path), "--json"), ring)
    assert mixed.returncode == 0 and json.loads(mixed.stdout)
    # after the subcommand wins over before it
    res = run(ring_cmd("--state", "/nonexistent-state", "status", "--state", str(ring.state),
                       "--config", str(ring.config_path), "--json"), ring)
    assert res.returncode == 0, res.stderr

    for cmd, prog in ((ring_cmd, "ringd"), (watch_cmd, "ringwatch")):
        v = run(cmd("--version"), ring)
        assert v.returncode == 0 and v.stdout.strip() == f"{prog}, version 0.1.0", v.stdout
        bad = run(cmd("--bogus"), ring)
        assert bad.returncode == 2 and "No such option" in one_line(bad, prog)
    bad = run(watch_cmd("reset", "--nope"), ring)
    assert bad.returncode == 2 and "--nope" in one_line(bad, "ringwatch")
    bad = run(watch_cmd("frobnicate"), ring)
    assert bad.returncode == 2 and one_line(bad, "ringwatch")
    bad = run(ring_cmd("status", "--limit", "x"), ring)
    assert bad.returncode == 2 and one_line(bad)


# --- unsafe modes: reading commands warn, run and ringwatch refuse ---------------------

def test_reading_commands_warn_on_writable_config_and_roster(ring):
    marker = ring.base / "alert-ran"
    ring.agent("a", "echo hello from a")
    ring.roster(f"a {ring.agents_dir}/a.sh")
    once = ring.start_driver("--once")
    assert once.wait(timeout=20) == 0
    ring.write_config(alerts={"command": ["touch", str(marker)]})
    os.chmod(ring.config_path, 0o664)
    os.chmod(ring.roster_path, 0o666)

    for args in (("status",), ("status", "--json"), ("history", "a"), ("logs", "a")):
        res = ring.cli(*args)
        assert res.returncode in (0, 3), (args, res.stderr)
        lines = [x for x in res.stderr.splitlines() if x.strip()]
        assert len(lines) == 2, (args, res.stderr)   # one line per file, once each
        assert any(str(ring.config_path) in x and "0664" in x and x.startswith("ringd: warning: ")
                   for x in lines), res.stderr
        assert any(str(ring.roster_path) in x and "0666" in x for x in lines), res.stderr
    assert "hello from a" in ring.cli("logs", "a").stdout

    refused = run(ring_cmd("run", "--once", *ring.common()), ring)
    assert refused.returncode == 78 and "writable by group or others" in refused.stderr
    checked = run(ring_cmd("check", *ring.common()), ring)   # check validates for run
    assert checked.returncode == 78 and "writable by group or others" in checked.stderr
    refused = run(watch_cmd(*ring.common()), ring)
    assert refused.returncode == 78 and "writable by group or others" in refused.stderr
    assert not marker.exists()   # a reading command never ran the untrusted alert command


@pytest.mark.parametrize("what", ["roster", "config", "state dir"])
def test_a_file_another_user_owns_is_refused_like_a_writable_one(ring, what):
    """A roster, config or state dir owned by another user, mode 0600 or 0700:
    its owner can chmod it and write it, so a root driver ran what that user
    put there (sshd's StrictModes checks the owner too). run and ringwatch
    refuse it in one line (78); reading commands warn."""
    if os.geteuid() != 0:
        pytest.skip("needs root to give a file away")
    ring.agent("a", "echo hello from a")
    ring.roster(f"a {ring.agents_dir}/a.sh")
    assert ring.start_driver("--once").wait(timeout=20) == 0
    target, called = {"roster": (ring.roster_path, "roster"), "config": (ring.config_path, "config file"),
                      "state dir": (ring.state, "state dir")}[what]
    os.chown(target, 65534, 65534)   # nobody
    refused = run(ring_cmd("run", "--once", *ring.common()), ring)
    lines = [x for x in refused.stderr.splitlines() if x.strip()]
    assert refused.returncode == 78 and len(lines) == 1, refused.stderr
    assert f"{target}: {called} is owned by uid 65534" in lines[0], lines[0]
    refused = run(watch_cmd(*ring.common()), ring)   # (the roster: through the driver it starts)
    assert refused.returncode == 78 and f"{called} is owned by uid 65534" in refused.stderr, refused.stderr
    if what != "state dir":   # (a reading command does not judge the state dir)
        res = ring.cli("status")
        assert res.returncode in (0, 3) and f"{called} is owned by uid 65534" in res.stderr, res.stderr
    os.chown(target, 0, 0)
    assert ring.start_driver("--once").wait(timeout=20) == 0


# --- check -------------------------------------------------------------------------------

def test_check_warns_about_programs_and_strict_fails(ring):
    ring.agent("good", "exit 0")
    plain = ring.agents_dir / "plain.sh"
    plain.write_text("#!/bin/sh\nexit 0\n")
    plain.chmod(0o644)
    bare = ring.agents_dir / "bare.sh"       # executable, but no #! line: exec(2) says ENOEXEC
    bare.write_text("exit 0\n")
    bare.chmod(0o755)
    ring.roster(f"good {ring.agents_dir}/good.sh", "typo pyhton3 -c pass", f"noexec {plain}",
                "gone ./missing.sh", "ok2 sh -c 'exit 0'", f"bare {bare}")
    res = ring.cli("check")
    assert res.returncode == 0, res.stderr
    warns = [x for x in res.stderr.splitlines() if x.strip()]
    assert len(warns) == 4, res.stderr
    assert any("agent bare:" in w and "has no #! line" in w for w in warns)
    assert any("agent typo:" in w and "'pyhton3' not found on PATH" in w for w in warns)
    assert any("agent noexec:" in w and "not executable" in w for w in warns)
    assert any("agent gone:" in w and f"{ring.state}/missing.sh not found" in w for w in warns)
    assert "4 warning(s)" in res.stdout
    strict = ring.cli("check", "--strict")
    assert strict.returncode == 1 and len(strict.stderr.splitlines()) == 4
    ring.roster(f"good {ring.agents_dir}/good.sh", "ok2 sh -c 'exit 0'")
    res = ring.cli("check", "--strict")
    assert res.returncode == 0 and res.stderr == "", res.stderr
    # what check accepts, run runs
    assert ring.start_driver("--once").wait(timeout=20) == 0
    assert [r["status"] for r in ring.runs()] == ["ok", "ok"]


# --- status: next turn, live lap; driver: fixed roster logged ---------------------------

def test_status_names_next_agent_and_live_lap(ring):
    ring.write_config(ring={"lap_pause": 2, "heartbeat_interval": 5})
    ring.agent("a", "exit 0")
    ring.agent("b", "exit 0")
    ring.roster(f"a {ring.agents_dir}/a.sh", f"b {ring.agents_dir}/b.sh")
    driver = ring.start_driver()
    # after b, the lap pause: between runs, status names a and when it starts
    wait_until(lambda: len(ring.runs()) >= 4 and ring.runs()[-1]["status"] == "ok"
               and ring.runs()[-1]["agent"] == "b", timeout=30, message="second lap done")
    doc = json.loads(ring.cli("status", "--json").stdout)
    if doc["current"] is None:
        nxt = doc["next"]
        assert nxt["agent"] == "a" and 0 < nxt["in"] <= 2.0, nxt
        table = ring.cli("status", env=dict(ring.env, NO_COLOR="1"))
        assert "next: a in " in table.stdout and " s" in table.stdout, table.stdout
    # lap 2 began with the second run of a, long before the next heartbeat (5 s);
    # the pause after a lap is the next lap's (the driver counts it when the ring wraps)
    assert doc["driver"]["lap"] == (3 if doc["current"] is None else 2), doc["driver"]
    # laps go on across a restart of the driver
    driver.terminate()
    driver.wait(timeout=10)
    driver = ring.start_driver()
    wait_until(lambda: json.loads(ring.cli("status", "--json").stdout)["driver"]["pid"] == driver.pid,
               message="new driver")
    assert json.loads(ring.cli("status", "--json").stdout)["driver"]["lap"] >= 2


def test_fixed_roster_is_logged(ring):
    ring.agent("a", "exit 0")
    ring.roster(f"a {ring.agents_dir}/a.sh")
    ring.write_config(ring={"lap_pause": 0.2})
    driver = ring.start_driver()
    wait_until(lambda: ring.runs(), message="first run")
    ring.roster("a b c 'unbalanced")
    wait_until(lambda: "roster error" in driver.err_path.read_text(), message="error logged")
    ring.roster(f"a {ring.agents_dir}/a.sh", f"b {ring.agents_dir}/a.sh")
    wait_until(lambda: "roster fixed" in driver.err_path.read_text(), message="fix logged")
    line = [x for x in driver.err_path.read_text().splitlines() if "roster fixed" in x][0]
    assert str(ring.roster_path) in line and "2 agent(s)" in line


# --- completion ----------------------------------------------------------------------------

def test_shell_completion_of_agent_names(ring):
    ring.agent("a", "exit 0")
    ring.roster(f"alpha {ring.agents_dir}/a.sh", f"beta {ring.agents_dir}/a.sh", f"alps {ring.agents_dir}/a.sh")
    for words, cword in ((f"ringd --state {ring.state} logs al", 4),
                         (f"ringd skip --state {ring.state} al", 4),
                         (f"ringd history --config {ring.config_path} --state {ring.state} al", 6)):
        env = dict(ring.env, _RINGD_COMPLETE="bash_complete", COMP_WORDS=words, COMP_CWORD=str(cword))
        res = run(ring_cmd(), ring, env=env)
        assert res.returncode == 0, res.stderr
        assert res.stdout.split() == ["plain,alpha", "plain,alps"], (words, res.stdout)
    # an unreadable roster completes nothing and prints no error
    env = dict(ring.env, _RINGD_COMPLETE="bash_complete", COMP_WORDS="ringd --state /nowhere logs a",
               COMP_CWORD="4")
    res = run(ring_cmd(), ring, env=env)
    assert res.returncode == 0 and res.stdout.strip() == "" and res.stderr == ""
    script = run(ring_cmd(), ring, env=dict(ring.env, _RINGD_COMPLETE="bash_source"))
    assert "_RINGD_COMPLETE=bash_complete" in script.stdout


# --- time spans ------------------------------------------------------------------------------

@pytest.mark.parametrize("text, seconds", [
    ("90", 90), ("90s", 90), ("15min", 900), ("1h 30min", 5400), ("1h30min", 5400), ("2d", 172800),
    ("1.5h", 5400), ("500ms", 0.5), (" 5 min 30 s ", 330), ("1w", 604800), ("2 hours", 7200),
    ("0.25", 0.25), ("1M", 2629800), ("1y", 31557600), ("250us", 0.00025),
    ("1 2 3", 6), ("12.34 .56", 12.9), ("12.34s.56", 12.9),   # as systemd reads them
])
def test_timespan(text, seconds):
    assert parse_timespan(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["", "  ", "5 parsecs", "-5s", "infinity", "1h x", "s", "1e3", "5m" * 40,
                                  "1.5.5", "12.34.56", "1..5"])
def test_timespan_refused(text):
    with pytest.raises(ValueError):
        parse_timespan(text)


def test_config_durations_accept_time_spans():
    c = parse_config({"ring": {"run_budget": "15min", "stall_threshold": "1h 30min", "lap_pause": "0",
                               "quarantine_cooloff": "2d"},
                      "agents": {"web": {"run_budget": "10min", "stall_threshold": 900}},
                      "watch": {"restart_sec": "500ms", "start_limit_interval": "10min"},
                      "alerts": {"timeout": "30s"}})
    assert (c.ring.run_budget, c.ring.stall_threshold, c.ring.quarantine_cooloff) == (900, 5400, 172800)
    assert c.limits_for("web").run_budget == 600 and c.watch.restart_sec == 0.5
    for bad, key in ((("ring", "run_budget", "15 parsecs"), "ring.run_budget"),
                     (("ring", "stall_threshold", "10s"), "ring.stall_threshold"),
                     (("watch", "poll_interval", "0s"), "watch.poll_interval"),
                     (("ring", "heartbeat_interval", "x" * 5000), "ring.heartbeat_interval")):
        section, k, v = bad
        with pytest.raises(ConfigError) as e:
            parse_config({section: {k: v}})
        assert str(e.value).startswith(key) and len(str(e.value)) < 200, str(e.value)


def test_driver_runs_with_time_span_config(ring):
    ring.write_config(ring={"run_budget": "1500ms", "stall_threshold": "2s 500ms", "heartbeat_interval": "200ms"})
    ring.agent("slow", "exec sleep 30")
    ring.roster(f"slow {ring.agents_dir}/slow.sh")
    assert ring.cli("check").returncode == 0
    t0 = time.monotonic()
    assert ring.start_driver("--once").wait(timeout=20) == 0
    assert ring.runs()[0]["status"] == "timeout" and ring.runs()[0]["run_budget"] == 1.5
    assert time.monotonic() - t0 < 15


# --- log levels ---------------------------------------------------------------------

def test_every_log_call_states_its_level():
    """A log line's journald priority is data: each call to a logger (``log``,
    ``logger``, ``say``, ``logline.emit``) in ringd and ringwatch passes one
    (a second argument or ``level=``), never leaving it to be read from words."""
    import ast
    root = Path(__file__).resolve().parents[2]
    missing = []
    for path in sorted([*(root / "ringd").rglob("*.py"), *(root / "ringwatch").rglob("*.py")]):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            f = node.func
            name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
            is_emit = isinstance(f, ast.Attribute) and name == "emit" and ast.unparse(f.value) == "logline"
            if name in ("log", "logger", "say") or is_emit:
                wanted = 3 if is_emit else 2
                if len(node.args) < wanted and not any(k.arg == "level" for k in node.keywords):
                    missing.append(f"{path.relative_to(root)}:{node.lineno}: {ast.unparse(node)[:80]}")
    assert not missing, "log calls without a level:\n" + "\n".join(missing)
