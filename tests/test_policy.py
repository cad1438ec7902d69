"""The driver's pure decisions."""
from ringd.config import RingSettings
from ringd.policy import after_run, backoff_delay, classify, turn_decision

RING = RingSettings(backoff_initial=60, backoff_max=3600, quarantine_after=3, quarantine_cooloff=100)


def test_classify():
    c = dict(tempfail_exit_code=75)
    assert classify(0, None, ended_by=None, termed_at_budget=False, **c) == "ok"
    assert classify(2, None, ended_by=None, termed_at_budget=False, **c) == "failed"
    assert classify(None, 11, ended_by=None, termed_at_budget=False, **c) == "failed"
    assert classify(75, None, ended_by=None, termed_at_budget=False, **c) == "deferred"
    assert classify(None, 15, ended_by=None, termed_at_budget=True, **c) == "timeout"
    assert classify(0, None, ended_by=None, termed_at_budget=True, **c) == "timeout"
    assert classify(None, 9, ended_by="stall", termed_at_budget=True, **c) == "stalled"
    assert classify(None, 15, ended_by="skip", termed_at_budget=False, **c) == "skipped"
    assert classify(None, 15, ended_by="stop", termed_at_budget=False, **c) == "interrupted"


def test_backoff_doubles_and_caps():
    assert [backoff_delay(n, 60, 3600) for n in (1, 2, 3, 4, 7, 8, 500)] == \
        [60, 120, 240, 480, 3600, 3600, 3600]


def test_deferral_sets_backoff_and_success_resets_it():
    s = after_run({}, "deferred", 1000.0, RING)
    assert s["backoff_until"] == 1060 and s["consecutive_deferrals"] == 1
    s2 = after_run(s, "deferred", 2000.0, RING)
    assert s2["backoff_until"] == 2120 and s2["consecutive_deferrals"] == 2
    s3 = after_run({**s, **s2}, "ok", 3000.0, RING)
    assert s3["backoff_until"] is None and s3["consecutive_deferrals"] == 0


def test_turn_decision():
    assert turn_decision({}, 0) == ("run", None)
    assert turn_decision({"backoff_until": 10}, 5)[0] == "pass"
    assert turn_decision({"backoff_until": 10}, 11)[0] == "run"
    assert turn_decision({"skip_requested": 1, "backoff_until": 10}, 5)[0] == "skip"
    assert turn_decision({"quarantined_until": 10, "quarantine_line": "a x"}, 5, "a x")[0] == "pass"
    assert turn_decision({"quarantined_until": 10, "quarantine_line": "a x"}, 11, "a x")[0] == "run"
    assert turn_decision({"quarantined_until": 10, "quarantine_line": "a x"}, 5, "a y")[0] == "run"


def test_failures_count_and_bad_streak_quarantines():
    s = {}
    for status in ("stalled", "timeout"):
        s.update(after_run(s, status, 0.0, RING))
    assert s["consecutive_failures"] == 2 and "quarantined_until" not in s
    s.update(after_run(s, "interrupted", 50.0, RING, "a x"))
    assert s["quarantined_until"] == 150 and s["quarantine_line"] == "a x"
    s.update(after_run(s, "ok", 200.0, RING))
    assert s["quarantined_until"] is None and s["consecutive_failures"] == 0 and s["bad_streak"] == 0
