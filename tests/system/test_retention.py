"""Journal retention (``ring.keep_runs``): the oldest runs and their events go in
small batches as the ring turns; the per-agent counters, status's ``runs`` and
the metrics' counters do not move; 0 keeps everything."""
from __future__ import annotations

import json

import pytest

from conftest import wait_until
from ringd.inputs.config import ConfigError, parse_config
from ringd.journal.sqlite import Journal


def _runs(j: Journal, n: int, agents=("a", "b")) -> None:
    for i in range(n):
        with j.transaction() as tx:
            rid = tx.start_run(agents[i % len(agents)], i % len(agents), run_budget=10, stall_threshold=20,
                               driver_pid=1, driver_start=1.0, now=1000.0 + i)
        with j.transaction() as tx:
            tx.close_run(rid, "ok" if i % 3 else "failed", source="driver", exit_code=0 if i % 3 else 1,
                         now=1000.5 + i)


def test_prune_in_batches_keeps_counters(tmp_path):
    j = Journal.open(tmp_path)
    try:
        _runs(j, 40)
        with j.transaction() as tx:   # an operator event, newer than all runs
            tx.event(None, "skip-requested", "operator", "agent=a", 2000.0)
        counts = j.run_counts()
        runs = {a: s.runs for a, s in j.agent_states().items()}
        assert j.prune(0) == 0 and j.prune(100) == 0
        assert j.prune(10, batch=7) == 7
        total = 7
        while True:
            gone = j.prune(10, batch=7)
            if not gone:
                break
            total += gone
        assert total == 30
        ids = [r[0] for r in j.con.execute("SELECT id FROM runs ORDER BY id")]
        assert ids == list(range(31, 41))
        assert j.con.execute("SELECT count(*) FROM events WHERE run_id <= 30").fetchone()[0] == 0
        assert j.con.execute("SELECT count(*) FROM events WHERE run_id > 30").fetchone()[0] == 20
        assert j.con.execute("SELECT count(*) FROM events WHERE run_id IS NULL").fetchone()[0] == 1
        assert j.run_counts() == counts and {a: s.runs for a, s in j.agent_states().items()} == runs
        assert sum(runs.values()) == 40
    finally:
        j.close()


def test_keep_runs_config():
    assert parse_config(None).ring.keep_runs == 100000
    assert parse_config({"ring": {"keep_runs": 0}}).ring.keep_runs == 0
    for bad in (-1, 1.5, "many", True):
        with pytest.raises(ConfigError, match="ring.keep_runs"):
            parse_config({"ring": {"keep_runs": bad}})


def test_driver_prunes_as_the_ring_turns(ring):
    ring.write_config(ring={"keep_runs": 4})
    ring.agent("a", "exit 0")
    ring.agent("b", "exit 3")
    ring.roster(f"a {ring.agents_dir}/a.sh", f"b {ring.agents_dir}/b.sh")
    driver = ring.start_driver()
    def top():
        rows = ring.rows("SELECT max(id) AS m FROM runs")
        return rows[0]["m"] or 0 if rows else 0
    wait_until(lambda: top() >= 16, timeout=30, message="16 runs")
    wait_until(lambda: ring.rows("SELECT count(*) AS n FROM runs")[0]["n"] <= 5, message="pruned")
    driver.terminate()   # compare counters on a ring at rest
    driver.wait(timeout=10)
    oldest = ring.rows("SELECT min(id) AS m FROM runs")[0]["m"]
    assert ring.rows("SELECT count(*) AS n FROM events WHERE run_id < ?", oldest)[0]["n"] == 0
    doc = json.loads(ring.cli("status", "--json").stdout)
    states = {r["name"]: r for r in ring.rows("SELECT * FROM agents")}
    for a in doc["agents"]:
        assert a["runs"] == states[a["name"]]["runs"]
    counted = sum(r["n"] for r in ring.rows("SELECT n FROM run_counts"))
    assert counted >= 15 and counted == sum(s["runs"] for s in states.values())
    # history shows what is kept: a few more than keep_runs at rest (runs that
    # ended after the last batch, between the check above and the stop)
    kept = ring.rows("SELECT count(*) AS n FROM runs")[0]["n"]
    hist = json.loads(ring.cli("history", "--json", "--limit", "100").stdout)
    assert 1 <= len(hist) == kept < counted


def test_keep_runs_zero_keeps_everything(ring):
    ring.write_config(ring={"keep_runs": 0})
    ring.agent("a", "exit 0")
    ring.roster(f"a {ring.agents_dir}/a.sh")
    for _ in range(3):
        assert ring.start_driver("--once").wait(timeout=20) == 0
    assert len(ring.runs()) == 3
