"""Alert admission without a ring: a storm of alerts starts a bounded number
of alert commands (each one is a supervisor process, a Python interpreter)."""
from __future__ import annotations

import os
import time

from ringd.host import alerts
from ringd.core import events


def test_admit_is_a_token_bucket():
    bucket = (2.0, None)
    bucket, ok1 = alerts.admit(bucket, 100.0, rate=1.0, burst=2)
    bucket, ok2 = alerts.admit(bucket, 100.0, rate=1.0, burst=2)
    bucket, ok3 = alerts.admit(bucket, 100.5, rate=1.0, burst=2)
    assert (ok1, ok2, ok3) == (True, True, False)
    bucket, ok4 = alerts.admit(bucket, 101.0, rate=1.0, burst=2)
    assert ok4
    bucket, _ = alerts.admit(bucket, 10_000.0, rate=1.0, burst=2)   # refills to the burst, no further
    assert bucket[0] == 1.0


def test_an_alert_storm_starts_a_bounded_number_of_alert_commands(tmp_path, monkeypatch):
    """200 failures at once with a command that ends at once (so the cap on
    alert commands running never bites): before, every one started a
    supervisor, and the box spent its CPU on them."""
    monkeypatch.setattr(alerts, "_bucket", (16.0, None), raising=False)   # a full bucket
    monkeypatch.setattr(alerts, "_dropped", 0)
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    said = []
    say = lambda m, level: said.append(m)   # noqa: E731
    pids = []
    try:
        for i in range(200):
            pid = alerts.fire(["/bin/true"], events.FAILURES, f"a{i}", "failed", state, log=say,
                              reaped_by_caller=True)
            if pid is not None:
                pids.append(pid)
                os.waitpid(pid, 0)   # ended at once: never more than one running
    finally:
        for pid in pids:
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass
    assert alerts.MAX_ALERTS_RUNNING <= len(pids) <= alerts.MAX_ALERTS_RUNNING + 5, len(pids)
    assert sum("not sent" in m for m in said) == 1, said


def test_the_rate_limit_drops_only_the_alert_a_failing_ring_raises_at_every_run(tmp_path, monkeypatch):
    """A storm is of ``failures`` alerts; a quarantine (once per agent), a watcher
    that gave up or a reaped run is never dropped for the rate, only for the cap
    on commands running at once."""
    monkeypatch.setattr(alerts, "_bucket", (0.0, time.monotonic()))   # an empty bucket: the storm is on
    monkeypatch.setattr(alerts, "_dropped", 0)
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    said = []
    say = lambda m, level: said.append(m)   # noqa: E731
    assert alerts.fire(["/bin/true"], events.FAILURES, "a", "failed", state, log=say,
                       reaped_by_caller=True) is None
    for kind in (events.QUARANTINED, events.WATCHER_GAVE_UP, events.RUN_REAPED):
        pid = alerts.fire(["/bin/true"], kind, "a", "x", state, log=say, reaped_by_caller=True)
        assert pid is not None, (kind, said)
        os.waitpid(pid, 0)
