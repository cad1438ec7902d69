"""What the operator reads, as pure functions: who asked (ringd.cli.actor), what
a resume lifted, local times with their date and zone, the notes of an agent
that `ringd next` started."""
from __future__ import annotations

import time
from datetime import datetime, timezone

import pytest

from ringd.cli.actor import actor_from, describe
from ringd.cli.render import agent_notes, fmt_local, zone_line
from ringd.core.policy import holds_lifted
from ringd.core.records import AgentState
from ringd.core.settings import RingSettings


def test_the_actor_names_user_uid_sudo_user_terminal_and_ssh_address():
    env = {"SUDO_USER": "alice", "SSH_CLIENT": "10.0.0.5 51234 22"}
    a = actor_from(0, "root", env, "/dev/pts/3")
    assert a == {"user": "root", "uid": 0, "sudo_user": "alice", "tty": "/dev/pts/3", "ssh_client": "10.0.0.5"}
    assert describe(a) == "root (uid 0) via sudo from alice on /dev/pts/3 from 10.0.0.5"
    plain = actor_from(1000, "bob", {}, None)
    assert plain == {"user": "bob", "uid": 1000, "sudo_user": None, "tty": None, "ssh_client": None}
    assert describe(plain) == "bob (uid 1000)"
    assert describe(actor_from(4242, None, {"SSH_CONNECTION": "fe80::1 1 fe80::2 22"}, None)) \
        == "uid 4242 from fe80::1"
    assert describe(None) == "-"


def test_the_actor_never_carries_a_long_or_controlled_environment_value():
    a = actor_from(0, "root", {"SUDO_USER": "al\x1b[31mice\n" + "x" * 10_000, "SSH_CLIENT": ""}, None)
    assert "\x1b" not in a["sudo_user"] and "\n" not in a["sudo_user"] and len(a["sudo_user"]) <= 200
    assert a["ssh_client"] is None


R = RingSettings(backoff_initial=60, backoff_max=3600)


@pytest.mark.parametrize("state, words", [
    (AgentState("a", backoff_until=1100.0, consecutive_deferrals=2), ["back-off lifted"]),
    (AgentState("a", backoff_until=900.0, consecutive_deferrals=3),
     ["back-off already over; the next one starts at 60s again"]),
    (AgentState("a", quarantined_until=5000.0, bad_streak=3), ["quarantine lifted"]),
    (AgentState("a", bad_streak=2), ["2 bad endings toward quarantine forgotten"]),
    (AgentState("a"), []),
])
def test_resume_names_a_back_off_a_back_off(state, words):
    """``streak lifted`` was what resume said of a back-off that had run out."""
    assert holds_lifted(state, 1000.0, R) == words
    assert all("streak lifted" not in w for w in words)


def test_local_times_have_their_date_unless_today_and_the_zone_once(monkeypatch):
    monkeypatch.setenv("TZ", "CET-1CEST,M3.5.0,M10.5.0/3")
    time.tzset()
    try:
        now = datetime(2026, 12, 6, 19, 0, tzinfo=timezone.utc).timestamp()
        today = datetime(2026, 12, 6, 13, 0, 48, tzinfo=timezone.utc).isoformat()
        earlier = datetime(2026, 12, 5, 13, 0, 48, tzinfo=timezone.utc).isoformat()
        assert fmt_local(today, now) == "14:00:48"
        assert fmt_local(earlier, now) == "2026-12-05 14:00:48"
        assert zone_line([today, earlier], now)[0][0] == "times in CET (+01:00)"
        summer = datetime(2026, 7, 1, 12, tzinfo=timezone.utc).isoformat()
        assert zone_line([summer], now)[0][0] == "times in CEST (+02:00) / CET (+01:00)"
    finally:
        monkeypatch.delenv("TZ")
        time.tzset()


def test_an_agent_started_by_ringd_next_is_not_shown_held_while_it_runs():
    a = {"name": "web", "quarantined_until": "2099-01-01T00:00:00+00:00", "paused": True,
         "backoff_until": "2099-01-01T00:00:00+00:00"}
    notes, _ = agent_notes(a, 0.0, forced=True)
    assert notes == ["started by ringd next"]
    notes, _ = agent_notes(a, 0.0)
    assert any(n.startswith("QUARANTINED") for n in notes) and "paused" in notes
    assert agent_notes({"name": "x", "silent": True, "silent_for": 90000.0}, 0.0)[0] == \
        ["SILENT: no ok run for 25h00m"]
