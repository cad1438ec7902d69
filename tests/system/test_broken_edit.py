"""A broken edit never locks the operator out (SPEC "Operator commands keep
working when an edit is broken"): with a real driver running, a config or
roster that does not load, or that is refused for its mode, leaves every
operator command working, and ``status`` shows what the ring really runs and
every problem that keeps the edit from taking effect.
"""
from __future__ import annotations

import json
import os
import subprocess

from conftest import ring_cmd, wait_until


def warnings_of(res) -> list:
    return [x for x in res.stderr.splitlines() if x.strip()]


def status_doc(ring, *args):
    res = ring.cli("status", "--json", *args)
    assert res.stdout.strip(), res.stderr
    return json.loads(res.stdout), res


def running(ring, agent: str):
    return wait_until(lambda: (ring.heartbeat() or {}).get("agent") == agent and ring.heartbeat(), 20,
                      message=f"{agent} running")


def test_a_config_typo_leaves_every_operator_command_working(ring):
    ring.write_config(ring={"run_budget": 5, "stall_threshold": 8})
    ring.agent("a", "echo a at work; sleep 30")
    ring.agent("b", "sleep 30")
    ring.roster(f"a {ring.agents_dir}/a.sh", f"b {ring.agents_dir}/b.sh")
    ring.start_driver()
    loaded = running(ring, "a")["config_loaded_at"]
    ring.config_path.write_text(ring.config_path.read_text().replace("run_budget: 5", "run_budget: 5 parsecs"))
    for args in (("status",), ("history",), ("logs", "a"), ("pause",), ("resume",)):
        res = ring.cli(*args)
        said = warnings_of(res)
        assert res.returncode == 0 and res.stdout, (args, res.returncode, res.stderr)
        assert len(said) == 1 and "ring.run_budget" in said[0] and said[0].startswith("ringd: warning: "), said
    doc, res = status_doc(ring)
    assert res.returncode == 0 and doc["driver"]["health"] == "ok"
    assert [(p["kind"], p["path"]) for p in doc["problems"]] == [("config", str(ring.config_path))]
    assert "parsecs" in doc["problems"][0]["detail"] and doc["current"]["run_budget"] == 5
    assert ring.cli("status", "--strict").returncode == 1
    text = ring.cli("status").stdout
    assert "ERROR: config:" in text and "parsecs" in text, text
    # the emergency brake works: skip ends the run, and the driver goes on with its config
    res = ring.cli("skip")
    assert res.returncode == 0 and len(warnings_of(res)) == 1, res.stderr
    running(ring, "b")
    assert ring.heartbeat()["config_loaded_at"] == loaded
    report = ring.cli("report", "-o", str(ring.base / "report.html"))
    assert report.returncode == 0 and len(warnings_of(report)) == 1, report.stderr
    # only the daemons refuse it
    assert ring.cli("run", "--once").returncode == 78


def test_a_config_that_is_not_yaml_still_lets_commands_act_on_the_state_dir(ring):
    ring.agent("a", "sleep 30")
    ring.roster(f"a {ring.agents_dir}/a.sh")
    ring.start_driver()
    running(ring, "a")
    ring.config_path.write_text("ring: [unclosed\n")
    doc, res = status_doc(ring)
    assert res.returncode == 0 and doc["current"]["agent"] == "a", res.stderr
    assert "invalid YAML" in doc["problems"][0]["detail"]
    assert ring.cli("pause").returncode == 0
    wait_until(lambda: status_doc(ring)[0]["driver"]["paused"], 10, message="the pause seen")


def test_the_state_dir_a_broken_config_should_name_is_a_configuration_error(ring, tmp_path):
    """No --state and a config that cannot be read: where its ring.state_dir points
    cannot be known, so neither can the journal: 78, one line."""
    here = tmp_path / "here"
    (here / "config").mkdir(parents=True)
    (here / "config/ring.yaml").write_text("ring: {state_dir: /x\n")
    os.chmod(here / "config/ring.yaml", 0o600)
    env = {k: v for k, v in ring.env.items() if not k.startswith("RING_")}
    res = subprocess.run(ring_cmd("status"), cwd=here, env=env, capture_output=True, text=True, timeout=30)
    assert res.returncode == 78 and len(warnings_of(res)) == 1, res.stderr
    assert "ring.state_dir points cannot be known" in res.stderr and "--state" in res.stderr


def test_status_shows_the_roster_the_driver_runs_not_the_broken_file(ring):
    ring.agent("a", "sleep 30")
    ring.roster(f"a {ring.agents_dir}/a.sh", "b sleep 30")
    ring.start_driver()
    running(ring, "a")
    ring.roster(f"a {ring.agents_dir}/a.sh", "escaper sleep 1", "b sleep 30", "c 'unbalanced")
    wait_until(lambda: (ring.heartbeat() or {}).get("roster_error"), 10, message="the driver's roster error")
    doc, res = status_doc(ring)
    assert [a["name"] for a in doc["agents"]] == ["a", "b"], doc["agents"]
    assert doc["roster"]["agents"] == 2 and "ring.txt:4" in doc["roster"]["error"]
    assert [p["kind"] for p in doc["problems"]] == ["roster"]
    assert res.returncode == 0 and ring.cli("status", "--strict").returncode == 1
    ring.roster(f"a {ring.agents_dir}/a.sh", "b sleep 30")
    wait_until(lambda: not (ring.heartbeat() or {}).get("roster_error"), 10, message="the fix taken")
    doc, _ = status_doc(ring)
    assert doc["problems"] == [] and ring.cli("status", "--strict").returncode == 0


def test_a_roster_the_driver_refuses_for_its_mode_is_a_problem(ring):
    ring.agent("a", "sleep 30")
    ring.roster(f"a {ring.agents_dir}/a.sh")
    ring.start_driver()
    running(ring, "a")
    os.chmod(ring.roster_path, 0o664)
    wait_until(lambda: (ring.heartbeat() or {}).get("roster_error"), 10, message="the driver refusing it")
    doc, res = status_doc(ring)
    assert res.returncode == 0 and doc["roster"]["error"] and "writable by group or others" in doc["roster"]["error"]
    assert [p["kind"] for p in doc["problems"]] == ["roster"]
    assert "ERROR: roster:" in ring.cli("status").stdout
    assert ring.cli("status", "--strict").returncode == 1


def test_a_reading_commands_warning_judges_files_for_the_rings_own_user(ring):
    """Root reading a ring a service user runs (its heartbeat, state dir, config
    and roster that user's, as systemd's DynamicUser leaves them): nothing to
    warn of - and never "Fix: chown 0". A file a third user owns is a problem,
    and the fix named is the ring user's."""
    if os.geteuid() != 0:
        import pytest
        pytest.skip("needs root to give files away")
    ring.agent("a", "exit 0")
    ring.roster(f"a {ring.agents_dir}/a.sh")
    assert ring.start_driver("--once").wait(timeout=30) == 0
    for path in (ring.state, ring.state / "ringd.heartbeat", ring.roster_path, ring.config_path):
        os.chown(path, 65534, 65534)
    res = ring.cli("status")
    assert res.returncode == 3 and warnings_of(res) == [], res.stderr
    os.chown(ring.roster_path, 12345, 12345)
    res = ring.cli("status")
    said = warnings_of(res)
    assert len(said) == 1 and "neither the ring's user (uid 65534) nor root" in said[0], said
    assert f"Fix: chown 65534 {ring.roster_path}" in said[0] and "chown 0" not in said[0]
    doc, _ = status_doc(ring)
    assert [p["kind"] for p in doc["problems"]] == ["roster"]
