"""Pure parts of reload, problems and ringwatch status: what a reload changed, the watcher's
status document and exit code, the driver's facts as status reads them, and
the mode rule judged for the ring's own user."""
from __future__ import annotations

import os
import stat
from pathlib import Path

from ringd.cli.found import driver_facts, with_pace
from ringd.cli.reload import MAX_DETAIL_CHARS, ReloadResult, outcome_event, seq_of
from ringd.cli.status import status_exit_code
from ringd.core.settings import RingSettings
from ringd.host.safefile import others_can_change
from ringd.inputs.config import Config, config_changes, parse_config
from ringd.inputs.roster import Agent, roster_changes
from ringd.host.watchstate import Clock, status_doc
from ringd.host.watchstate import status_exit_code as watcher_exit_code


def test_config_changes_name_each_key_and_never_a_password():
    old = parse_config({"ring": {"run_budget": 20, "stall_threshold": 30}, "agents": {"web": {"run_budget": 5}}})
    new = parse_config({"ring": {"run_budget": "15s", "stall_threshold": 30},
                        "agents": {"web": {"run_budget": 6}, "db": {"cwd": "/srv"}},
                        "watch": {"restart_command": ["systemctl", "restart", "ringd"]}})
    assert config_changes(old, new) == [
        "ring.run_budget: 20 -> 15", "watch.restart_command: null -> [systemctl, restart, ringd]",
        "agents.db: added", "agents.web.run_budget: 5 -> 6"]
    assert config_changes(new, new) == []
    pools = parse_config({"quotas": {"model": {"limit": 100, "window": "5h"}}})
    more = parse_config({"quotas": {"model": {"limit": 200, "window": "5h"}}})
    assert config_changes(pools, more) == ["quotas.model.limit: 100 -> 200"]
    pg = Config(ring=RingSettings(journal="postgresql://ring:s3cret@db/ring"))
    assert "s3cret" not in " ".join(config_changes(Config(), pg))


def test_roster_changes_say_added_removed_edited_and_moved():
    a, b, c = (Agent(n, ("true",), i + 1, f"{n} true") for i, n in enumerate("abc"))
    b2 = Agent("b", ("false",), 2, "b false")
    assert roster_changes([a, b], [a, b2, c]) == ["roster: c added", "roster: b has a new command line"]
    assert roster_changes([a, b, c], [c, a]) == ["roster: b removed", "roster: order is now c, a"]
    assert roster_changes([a], [a]) == []


def test_a_reload_answer_and_its_exit_code():
    assert seq_of({"seq": 3}) == 3 and seq_of(None) == 0 and seq_of({"seq": True}) == 0
    ok = ReloadResult(driver_pid=1, record={"seq": 1, "changed": ["x"], "errors": []}, waited=0.1)
    assert ok.exit_code == 0 and ok.changed == ["x"]
    refused = ReloadResult(driver_pid=1, record={"seq": 2, "errors": [{"kind": "config", "detail": "bad"}]},
                           waited=0.1)
    assert refused.exit_code == 78
    assert ReloadResult(driver_pid=1, record=None, waited=5.0).exit_code == 1


def test_a_reload_answer_as_its_event_says_what_changed_why_refused_or_no_answer():
    assert outcome_event(ReloadResult(7, None, 5.01)) == ("reload-unanswered", "driver pid 7: no answer within 5.0s")
    ok = ReloadResult(7, {"seq": 1, "changed": ["ring.run_budget: 20 -> 15", "roster: c added"]}, 0.1)
    assert outcome_event(ok) == ("reloaded", "ring.run_budget: 20 -> 15; roster: c added")
    assert outcome_event(ReloadResult(7, {"seq": 2, "changed": []}, 0.1)) == ("reloaded", "nothing changed")
    bad = ReloadResult(7, {"seq": 3, "errors": [{"kind": "config", "detail": "run_budget:\n 5 parsecs"}]}, 0.1)
    assert outcome_event(bad) == ("reload-refused", "config: run_budget: 5 parsecs")
    huge = ReloadResult(7, {"seq": 4, "errors": [{"kind": "roster", "detail": "x" * 100_000}]}, 0.1)
    assert len(outcome_event(huge)[1]) == MAX_DETAIL_CHARS


def test_status_strict_turns_problems_into_exit_1_only_when_healthy():
    def doc(health, problems):
        return {"driver": {"health": health}, "problems": problems}
    problem = [{"kind": "roster", "path": "/r", "detail": "x"}]
    assert status_exit_code(doc("ok", problem)) == 0
    assert status_exit_code(doc("ok", problem), strict=True) == 1
    assert status_exit_code(doc("ok", []), strict=True) == 0
    assert status_exit_code(doc("stopped", problem), strict=True) == 3
    assert status_exit_code(doc("dead", problem), strict=True) == 1


def test_the_watchers_status_document_and_exit_code():
    clock = Clock(boot_id="b", boot=1000.0, wall=1_800_000_000.0)
    # two restarts this boot: r1 100 s ago (in the 600 s window), r2 900 s ago (out of it)
    data = {"pid": 42, "mode": "owner", "started_at": "2027-01-15T08:00:00Z", "last_poll_at": "x",
            "restarts": ["r1", "r2"], "restart_clock": {"boot_id": "b", "since_boot": {"r1": 900.0, "r2": 100.0}},
            "driver": {"pid": 7, "health": "ok"}}
    doc = status_doc(Path("/s"), data, alive=True, given_up=False, driver_alive=True, clock=clock,
                     start_limit_burst=5, start_limit_interval=600)
    assert doc["pid"] == 42 and doc["restarts"] == 1 and doc["driver"] == {"pid": 7, "alive": True, "health": "ok"}
    assert watcher_exit_code(doc) == 0
    gone = status_doc(Path("/s"), data, alive=False, given_up=False, driver_alive=False, clock=clock,
                      start_limit_burst=5, start_limit_interval=600)
    assert gone["pid"] is None and watcher_exit_code(gone) == 3
    assert watcher_exit_code(dict(gone, gave_up=True)) == 1


def test_driver_facts_take_only_what_has_the_right_type():
    facts = driver_facts({"config": "/c", "roster_agents": ["a", 3, "b"], "heartbeat_interval": True,
                          "config_signature": [1, 2, 3, 4], "roster_error": 5})
    assert facts["config"] == "/c" and facts["roster_agents"] == ["a", "b"]
    assert facts["heartbeat_interval"] is None and facts["roster_error"] is None
    assert facts["config_signature"] == (1, 2, 3, 4)
    assert with_pace(Config(), driver_facts({"heartbeat_interval": 0.5})).ring.heartbeat_interval == 0.5
    assert with_pace(Config(), driver_facts({})).ring.heartbeat_interval == 10


def test_ownership_is_judged_for_the_rings_user_and_the_fix_is_theirs():
    def st(mode=0o600, uid=61000):
        return os.stat_result((stat.S_IFREG | mode, 0, 0, 1, uid, uid, 0, 0, 0, 0))
    p = Path("/var/lib/ring/ring.txt")
    assert others_can_change(p, st(), 61000, "the ring's user") is None
    assert others_can_change(p, st(uid=0), 61000, "the ring's user") is None
    problem, fix = others_can_change(p, st(uid=1234), 61000, "the ring's user")
    assert "neither the ring's user (uid 61000) nor root" in problem and fix == f"chown 61000 {p}"
    problem, fix = others_can_change(p, st(mode=0o664), 61000)
    assert "0664" in problem and fix == f"chmod go-w {p}"
