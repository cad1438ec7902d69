"""``ringd reload`` (SPEC "Operator verbs, round 2"): SIGHUP with an answer. A
real driver re-reads its config and roster now - during a run too - and
confirms in its heartbeat; the command prints what changed, or the error that
kept the old config (78), and exits 1 when no driver runs.
"""
from __future__ import annotations

import json
import signal
import time

from conftest import wait_until


def running(ring, agent: str):
    return wait_until(lambda: (ring.heartbeat() or {}).get("agent") == agent and ring.heartbeat(), 20,
                      message=f"{agent} running")


def long_ring(ring):
    ring.write_config(ring={"run_budget": 20, "stall_threshold": 25})
    ring.agent("a", "sleep 30")
    ring.roster(f"a {ring.agents_dir}/a.sh")


def test_reload_during_a_run_confirms_and_says_what_changed(ring):
    long_ring(ring)
    ring.start_driver()
    before = running(ring, "a")
    ring.write_config(ring={"run_budget": 15})
    ring.roster(f"a {ring.agents_dir}/a.sh", "c sleep 1")
    t0 = time.monotonic()
    res = ring.cli("reload")
    took = time.monotonic() - t0
    assert res.returncode == 0, res.stderr
    assert "ring.run_budget: 20 -> 15" in res.stdout and "roster: c added" in res.stdout, res.stdout
    assert took < 5.0, took
    hb = ring.heartbeat()
    assert hb["agent"] == "a" and hb["run_id"] == before["run_id"], "reloaded while the run went on"
    assert hb["reload"]["seq"] == 1 and hb["config_loaded_at"] > before["config_loaded_at"]
    again = ring.cli("reload")
    assert again.returncode == 0 and "nothing changed" in again.stdout, again.stdout


def test_a_refused_config_keeps_the_old_one_and_exits_78(ring):
    long_ring(ring)
    ring.start_driver()
    before = running(ring, "a")
    ring.config_path.write_text("ring: {run_budget: 5 parsecs}\n")
    res = ring.cli("reload")
    assert res.returncode == 78, (res.returncode, res.stdout, res.stderr)
    assert "config not reloaded, the driver keeps the old one" in res.stderr and "parsecs" in res.stderr
    hb = ring.heartbeat()
    assert hb["config_loaded_at"] == before["config_loaded_at"] and "parsecs" in hb["config_error"]
    doc = json.loads(ring.cli("status", "--json").stdout)
    assert any("parsecs" in p["detail"] for p in doc["problems"]), doc["problems"]


def test_reload_without_a_driver_exits_1(ring):
    long_ring(ring)
    res = ring.cli("reload")
    assert res.returncode == 1 and "no driver is running" in res.stderr, res.stderr


def test_reload_under_the_watcher_reloads_the_driver_once_and_the_watcher_too(ring):
    """The watcher passes SIGHUP on to the driver it owns: signalled by both, the
    driver would reload twice. Both confirm."""
    long_ring(ring)
    watcher = ring.start_watcher()
    first = running(ring, "a")
    wait_until(lambda: json.loads((ring.state / "ringwatch.json").read_text()).get("driver", {}).get("pid")
               == first["pid"], 20, message="the watcher watching its driver")
    ring.write_config(ring={"run_budget": 15})
    res = ring.cli("reload")
    assert res.returncode == 0, res.stderr
    assert "ring.run_budget: 20 -> 15" in res.stdout and f"watcher pid {watcher.pid} reloaded" in res.stdout
    log = (ring.state / "logs" / "ringd.log").read_text()
    assert log.count("config reloaded") == 1, log
    assert ring.heartbeat()["reload"]["seq"] == 1
    watcher.send_signal(signal.SIGTERM)
    assert watcher.wait(timeout=30) == 0
