"""``ringwatch status`` (SPEC "Operator verbs, round 2"): the watcher's own state
- pid, restarts in the window, gave up, last poll, the driver it watches - from
a real watcher; exit 0 running, 3 not running, 1 gave up."""
from __future__ import annotations

import json
import os
import signal
import subprocess

from conftest import wait_until, watch_cmd


def ringwatch(ring, *args):
    return subprocess.run(watch_cmd("status", *ring.common(), *args), env=ring.env, capture_output=True,
                          text=True, timeout=30)


def doc_of(ring):
    res = ringwatch(ring, "--json")
    assert "Traceback" not in res.stderr, res.stderr
    return json.loads(res.stdout), res.returncode


def driver_pid(ring, not_pid=None):
    def beating():
        hb = ring.heartbeat() or {}
        return hb.get("pid") if hb.get("pid") not in (None, not_pid) and not hb.get("stopped") else None
    return wait_until(beating, 20, message="a beating driver")


def test_running_restarting_and_stopped(ring):
    ring.agent("a", "sleep 0.3")
    ring.roster(f"a {ring.agents_dir}/a.sh")
    doc, code = doc_of(ring)
    assert code == 3 and doc["alive"] is False and doc["pid"] is None
    watcher = ring.start_watcher()
    first = driver_pid(ring)
    wait_until(lambda: doc_of(ring)[0]["driver"]["pid"] == first, 20, message="a poll naming the driver")
    doc, code = doc_of(ring)
    assert code == 0 and doc["pid"] == watcher.pid and doc["restarts"] == 0 and not doc["gave_up"]
    assert doc["driver"]["alive"] and doc["last_poll_at"] and doc["mode"] == "owner"
    os.kill(first, signal.SIGKILL)
    second = driver_pid(ring, not_pid=first)
    wait_until(lambda: doc_of(ring)[0]["restarts"] == 1, 20, message="the restart counted")
    wait_until(lambda: doc_of(ring)[0]["driver"]["pid"] == second, 20, message="the new driver named")
    text = ringwatch(ring)
    assert text.returncode == 0 and text.stdout.startswith(f"watcher  running  pid {watcher.pid}"), text.stdout
    assert "1 in the last 30s" in text.stdout and f"pid {second} (alive" in text.stdout, text.stdout
    watcher.send_signal(signal.SIGTERM)
    assert watcher.wait(timeout=30) == 0
    doc, code = doc_of(ring)
    assert code == 3 and not doc["alive"]


def test_a_watcher_that_gave_up_is_exit_1(ring):
    ring.write_config(watch={"start_limit_burst": 1, "start_limit_interval": 60, "restart_sec": 0.05})
    ring.agent("a", "sleep 5")
    ring.roster(f"a {ring.agents_dir}/a.sh")
    watcher = ring.start_watcher()
    for n in range(2):   # one restart is allowed; the second death gives up
        pid = driver_pid(ring)
        os.kill(pid, signal.SIGKILL)
        wait_until(lambda: (ring.heartbeat() or {}).get("pid") != pid or watcher.poll() is not None, 20,
                   message="the driver replaced or the watcher gone")
    assert watcher.wait(timeout=30) == 70
    doc, code = doc_of(ring)
    assert code == 1 and doc["gave_up"] and doc["gave_up_reason"], doc
    text = ringwatch(ring)
    assert text.returncode == 1 and "GAVE UP" in text.stdout
