"""Pure scheduling (ringd/schedule.py): when a scheduled agent is due, with a
controllable clock and DST zones. No processes, microseconds per case."""
from __future__ import annotations

from collections import Counter
from datetime import datetime, timedelta
from zoneinfo import ZoneInfo

import pytest

from ringd.inputs.config import ConfigError, parse_config

from ringd.inputs.schedule import (Entry, Schedule, ScheduleError, check_cron, due, local_zone,
                            next_due, wall_clock)

BERLIN = ZoneInfo("Europe/Berlin")
NEW_YORK = ZoneInfo("America/New_York")


def ts(zone, *parts, fold=0) -> float:
    return datetime(*parts, tzinfo=zone, fold=fold).timestamp()


def local(t: float, zone) -> datetime:
    return datetime.fromtimestamp(t, tz=zone)


def simulate(schedule: Schedule, start: float, end: float, step: float, zones) -> list:
    """A driver that looks at every hop boundary (every ``step`` s) and runs the
    agent whenever it is due; ``zones(now)`` is the box's zone at that moment
    (a TZ change mid-way). Returns the start times of the runs."""
    since, last, wall, starts = start, None, None, []
    now = start
    while now < end:
        if due([Entry("job", schedule, last, since, wall)], now, zones(now)):
            starts.append(now)
            last, wall = now, wall_clock(now, zones(now))
        now += step
    return starts


def test_every_never_run_is_due_at_once_then_every_n_seconds_after_its_start():
    s = Schedule(every=2)
    assert next_due(s, None, since=100.0) == 100.0
    assert due([Entry("a", s, None, 100.0)], now=100.0) == ["a"]
    assert next_due(s, 100.5, since=100.0) == 102.5
    assert due([Entry("a", s, 100.5, 100.0)], now=102.4) == []
    assert due([Entry("a", s, 100.5, 100.0)], now=102.5) == ["a"]


def test_cron_never_run_waits_for_the_next_matching_minute():
    s = Schedule(cron="* * * * *")
    since = ts(BERLIN, 2026, 6, 1, 12, 59, 30)
    assert next_due(s, None, since, BERLIN) == ts(BERLIN, 2026, 6, 1, 13, 0)
    assert due([Entry("a", s, None, since)], since + 29.9, BERLIN) == []
    assert due([Entry("a", s, None, since)], since + 30, BERLIN) == ["a"]
    # a schedule seen at 10:17 is not "behind" on the 10:00 slot
    hourly = Schedule(cron="0 * * * *")
    assert next_due(hourly, ts(BERLIN, 2026, 6, 1, 3, 0), ts(BERLIN, 2026, 6, 1, 10, 17),
                    BERLIN) == ts(BERLIN, 2026, 6, 1, 11, 0)


def test_slots_missed_while_down_run_once():
    s = Schedule(cron="*/5 * * * *")
    since = ts(BERLIN, 2026, 6, 1, 0, 0)
    last = ts(BERLIN, 2026, 6, 1, 0, 5, 2)            # ran, then the ring was down for hours
    now = ts(BERLIN, 2026, 6, 1, 7, 41, 10)
    assert due([Entry("a", s, last, since)], now, BERLIN) == ["a"]
    # it runs now; the next due is the next slot after that start, not the 06:10 backlog
    assert next_due(s, now + 1, since, BERLIN) == ts(BERLIN, 2026, 6, 1, 7, 45)
    every = Schedule(every=600)
    assert next_due(every, now + 1, since) == now + 601


def test_several_due_are_listed_in_roster_order():
    entries = [Entry("z", Schedule(every=10), 0.0, 0.0), Entry("a", Schedule(every=5), 0.0, 0.0),
               Entry("m", Schedule(every=100), 0.0, 0.0)]
    assert due(entries, 20.0) == ["z", "a"]


@pytest.mark.parametrize("zone,spring,fall", [
    (BERLIN, (2026, 3, 29), (2026, 10, 25)),
    (NEW_YORK, (2026, 3, 8), (2026, 11, 1)),
])
@pytest.mark.parametrize("expr", ["30 2 * * *", "0 2 * * *", "30 1 * * *", "0 3 * * *"])
def test_a_daily_job_runs_exactly_once_a_day_across_both_dst_transitions(zone, spring, fall, expr):
    for day in (spring, fall):
        start = ts(zone, *day) - 2 * 86400
        starts = simulate(Schedule(cron=expr), start, start + 5 * 86400, 900.0, lambda _: zone)
        per_day = Counter(local(t, zone).date() for t in starts)
        days = [(datetime(*day) + timedelta(days=d)).date() for d in range(-2, 3)]
        assert [per_day[d] for d in days] == [1, 1, 1, 1, 1], (expr, per_day)


def test_spring_forward_runs_a_skipped_time_right_after_the_jump():
    s = Schedule(cron="30 2 * * *")   # 02:30 does not exist in Berlin on 2026-03-29
    before = ts(BERLIN, 2026, 3, 29, 1, 59)
    assert local(next_due(s, before, before, BERLIN), BERLIN) == datetime(2026, 3, 29, 3, 0, tzinfo=BERLIN)


def test_fall_back_never_runs_a_job_twice_in_its_slot():
    s = Schedule(cron="30 2 * * *")   # 02:30 happens twice in Berlin on 2026-10-25
    first = ts(BERLIN, 2026, 10, 25, 2, 30, 1, fold=0)
    second = ts(BERLIN, 2026, 10, 25, 2, 30, 1, fold=1)
    assert second - first == 3600
    assert due([Entry("a", s, first, first - 86400)], second, BERLIN) == []
    assert local(next_due(s, first, first - 86400, BERLIN), BERLIN).date().day == 26


def test_hourly_jobs_run_every_real_hour_through_fall_back():
    """A wildcard job (``*`` in its hour field) runs the repeated hour again, as
    Debian's cron does: 02:00 CEST, then 02:00 CET an hour later."""
    zone = BERLIN
    start = ts(zone, 2026, 10, 24, 22, 0)
    starts = simulate(Schedule(cron="0 * * * *"), start, start + 8 * 3600, 30.0, lambda _: zone)
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    walls = [local(t, zone).strftime("%H:%M%z") for t in starts]
    assert walls == ["23:00+0200", "00:00+0200", "01:00+0200", "02:00+0200", "02:00+0100", "03:00+0100",
                     "04:00+0100"], walls
    assert all(3600 - 30 <= g <= 3600 + 30 for g in gaps), gaps


FALL_BACK = [(BERLIN, (2026, 10, 25), 2), (NEW_YORK, (2026, 11, 1), 1)]   # the day, the repeated hour


@pytest.mark.parametrize("zone,day,hour,expr", [
    *[(z, d, h, e) for z, d, h in FALL_BACK for e in ("0 * * * *", "*/30 * * * *", "15 * * * *")],
    (BERLIN, (2026, 10, 25), 2, "*/20 2 * * *"), (NEW_YORK, (2026, 11, 1), 1, "*/20 1 * * *"),
])
def test_a_wildcard_job_runs_the_repeated_hour_of_fall_back(zone, day, hour, expr):
    """Each slot of the repeated hour is a slot of its own for a wildcard job:
    due once at its first reading and once at its second (fold=1), never twice
    at either. ``*/20 2 * * *`` is a wildcard job too (its minute field)."""
    start = ts(zone, *day, 0, 0) - 3600
    starts = simulate(Schedule(cron=expr), start, start + 6 * 3600, 20.0, lambda _: zone)
    assert len(set(starts)) == len(starts)
    repeated = [t for t in starts if local(t, zone).hour == hour]
    first = [t for t in repeated if not local(t, zone).fold]
    second = [t for t in repeated if local(t, zone).fold]
    assert first and len(first) == len(second), [local(t, zone).isoformat() for t in repeated]
    assert [local(t, zone).minute for t in first] == [local(t, zone).minute for t in second]
    for a, b in zip(first, second):
        assert b - a == pytest.approx(3600, abs=20)


def test_after_02_00_cest_an_hourly_job_is_next_due_at_02_00_cet():
    s = Schedule(cron="0 * * * *")
    ran = ts(BERLIN, 2026, 10, 25, 2, 0, 4, fold=0)
    nxt = next_due(s, ran, ran - 86400, BERLIN, wall_clock(ran, BERLIN))
    assert nxt == ts(BERLIN, 2026, 10, 25, 2, 0, fold=1)
    assert due([Entry("a", s, ran, ran - 86400, wall_clock(ran, BERLIN))], nxt - 1, BERLIN) == []
    assert due([Entry("a", s, ran, ran - 86400, wall_clock(ran, BERLIN))], nxt, BERLIN) == ["a"]


@pytest.mark.parametrize("zone,day,hour", FALL_BACK)
@pytest.mark.parametrize("expr", ["0 {h} * * *", "30 {h} * * *", "0,30 {h} * * *", "45 1,2 * * *"])
def test_a_fixed_hour_job_runs_once_in_the_repeated_hour(zone, day, hour, expr):
    expr = expr.format(h=hour)
    start = ts(zone, *day, 0, 0) - 3600
    starts = simulate(Schedule(cron=expr), start, start + 6 * 3600, 20.0, lambda _: zone)
    walls = [local(t, zone).replace(tzinfo=None) for t in starts]
    assert len(set(walls)) == len(walls), walls   # no wall-clock reading run twice
    assert any(w.hour == hour for w in walls), walls


@pytest.mark.parametrize("zone,spring", [(BERLIN, (2026, 3, 29)), (NEW_YORK, (2026, 3, 8))])
def test_spring_forward_runs_a_wildcard_job_on_the_new_time_once(zone, spring):
    """The skipped hour has no slots: an hourly job runs at 01:00 and then at
    03:00 once (the new time), a job fixed in the skipped hour right after the
    jump."""
    start = ts(zone, *spring, 0, 0) - 1800
    starts = simulate(Schedule(cron="0 * * * *"), start, start + 5 * 3600, 20.0, lambda _: zone)
    walls = [local(t, zone).strftime("%H:%M") for t in starts]
    assert walls == ["00:00", "01:00", "03:00", "04:00", "05:00"], walls
    assert all(b - a == pytest.approx(3600, abs=20) for a, b in zip(starts, starts[1:]))
    fixed = simulate(Schedule(cron="30 2 * * *"), start, start + 5 * 3600, 20.0, lambda _: zone)
    assert [local(t, zone).strftime("%H:%M") for t in fixed] == ["03:00"]


def test_wildcard_is_the_minute_or_hour_field_starting_with_a_star():
    from ringd.inputs.schedule import wildcard
    assert wildcard("0 * * * *") and wildcard("* 2 * * *") and wildcard("*/5 3 * * *")
    assert wildcard("15 */2 * * *")
    assert not wildcard("0 2 * * *") and not wildcard("0,30 1-3 * * *") and not wildcard("30 2 * * 0")


def test_an_every_minute_job_goes_on_after_a_two_hour_fall_back():
    """Antarctica/Troll falls back two hours (03:00 +02 -> 01:00 +00): an
    every-minute job is a wildcard job, so it runs on, a minute apart, through
    the 120 repeated readings - never stopped for good (a next due of
    infinity), never twice in one minute."""
    zone = ZoneInfo("Antarctica/Troll")
    s = Schedule(cron="* * * * *")
    ran = ts(zone, 2026, 10, 25, 2, 59, 10)
    assert next_due(s, ran, ran - 60, zone, wall_clock(ran, zone)) == ran + 50
    start = ts(zone, 2026, 10, 25, 2, 30)
    starts = simulate(s, start, start + 4 * 3600, 30.0, lambda _: zone)
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    assert len(starts) >= 4 * 60 - 2 and all(30 <= g <= 90 for g in gaps), gaps


def test_a_time_zone_change_neither_repeats_nor_skips_a_day():
    s = Schedule(cron="0 9 * * *")
    start = ts(BERLIN, 2026, 6, 1, 0, 0)
    switch = start + 2.5 * 86400                       # the box moves from Berlin to New York
    zones = lambda now: BERLIN if now < switch else NEW_YORK
    starts = simulate(s, start, start + 6 * 86400, 300.0, zones)
    slots = [local(t, zones(t)).replace(tzinfo=None) for t in starts]
    assert len(set(slots)) == len(slots)                  # never twice in one slot
    assert all(slot.time().hour == 9 for slot in slots)
    days = sorted({slot.date() for slot in slots})
    assert len(days) == 6 and (days[-1] - days[0]).days == 5  # never a skipped day


def test_a_clock_stepped_back_never_runs_a_slot_again():
    s = Schedule(cron="0 0 * * *")
    ran = ts(BERLIN, 2026, 6, 2, 0, 0, 3)
    stepped_back = ran - 3 * 3600
    assert due([Entry("a", s, ran, ran - 86400)], stepped_back, BERLIN) == []
    assert due([Entry("a", s, ran, ran - 86400)], ran + 3600, BERLIN) == []


def test_local_zone_follows_tz(monkeypatch):
    monkeypatch.setenv("TZ", "Europe/Berlin")
    assert local_zone().key == "Europe/Berlin"
    monkeypatch.setenv("TZ", ":America/New_York")
    assert local_zone().key == "America/New_York"
    monkeypatch.setenv("TZ", "Europe/Berlin")
    s = Schedule(cron="0 12 * * *")
    since = ts(BERLIN, 2026, 1, 5, 11, 0)
    assert next_due(s, None, since) == ts(BERLIN, 2026, 1, 5, 12, 0)   # zone taken from TZ


def test_the_zone_file_is_read_again_only_once_it_has_changed(monkeypatch, tmp_path):
    """The driver asks for its zone at every turn a scheduled agent is on the
    roster: each ask read and parsed the zone file (16 us a turn). It is read
    once while the file is the same, and again once it is replaced (as
    timedatectl set-timezone retargets /etc/localtime) - never stale."""
    import shutil
    from ringd.inputs import schedule as sched
    reads = Counter()
    real = sched._read_zone_file

    def counted(path, key):
        reads[path] += 1
        return real(path, key)
    monkeypatch.setattr(sched, "_read_zone_file", counted)
    zone_file = tmp_path / "localtime"
    shutil.copyfile("/usr/share/zoneinfo/Europe/Paris", zone_file)
    monkeypatch.setenv("TZ", f":{zone_file}")
    july = datetime(2026, 7, 5, 12, 0)
    first = local_zone()
    assert first.utcoffset(july) == timedelta(hours=2)
    assert all(local_zone() is first for _ in range(50)) and reads[str(zone_file)] == 1, reads
    replacement = tmp_path / "localtime.new"
    shutil.copyfile("/usr/share/zoneinfo/America/New_York", replacement)
    replacement.replace(zone_file)
    assert local_zone().utcoffset(july) == timedelta(hours=-4) and reads[str(zone_file)] == 2, reads


def test_a_cron_agents_due_time_is_worked_out_once_for_the_same_inputs(monkeypatch):
    """At every turn the driver asks when each scheduled agent is due; a cron
    agent's answer changes only when it runs (or its zone or the clock's step
    does), and working it out cost 20 us an agent a turn. The same question is
    answered once; another last start, zone or step is worked out afresh."""
    import cronsim
    made = Counter()
    real = cronsim.CronSim

    class Counted(real):
        def __init__(self, *a, **kw):
            made["CronSim"] += 1
            super().__init__(*a, **kw)
    monkeypatch.setattr(cronsim, "CronSim", Counted)
    s = Schedule(cron="*/7 3 * * *")   # an expression no other test asks about
    ran = ts(BERLIN, 2026, 3, 1, 3, 7)
    answers = {next_due(s, ran, ran - 86400, BERLIN) for _ in range(50)}
    assert answers == {ts(BERLIN, 2026, 3, 1, 3, 14)} and made["CronSim"] == 1, made
    assert next_due(s, ran + 420, ran - 86400, BERLIN) == ts(BERLIN, 2026, 3, 1, 3, 21) and made["CronSim"] == 2
    assert next_due(s, ran, ran - 86400, NEW_YORK) != ts(BERLIN, 2026, 3, 1, 3, 14) and made["CronSim"] == 3


def test_local_zone_reads_tz_as_libc_does_and_never_raises(monkeypatch):
    """A POSIX rule is a zone with its DST; an empty or unusable TZ is UTC (as
    libc takes it) - never ZoneInfoNotFoundError out of every turn of the driver."""
    monkeypatch.setenv("TZ", "CET-1CEST,M3.5.0,M10.5.0/3")
    rule = local_zone()
    for t in (ts(BERLIN, 2026, 1, 5, 12, 0), ts(BERLIN, 2026, 7, 5, 12, 0),
              ts(BERLIN, 2026, 10, 25, 2, 30, fold=0), ts(BERLIN, 2026, 10, 25, 2, 30, fold=1)):
        assert local(t, rule).replace(tzinfo=None) == local(t, BERLIN).replace(tzinfo=None)
    assert next_due(Schedule(cron="0 12 * * *"), None, ts(BERLIN, 2026, 7, 5, 11, 0)) == ts(BERLIN, 2026, 7, 5, 12, 0)
    for unusable in ("Nowhere/Land", "", ":", "/nonexistent", "/etc/passwd", "CET-1CEST", "\u00e9", "../../etc/passwd"):
        monkeypatch.setenv("TZ", unusable)
        assert local_zone().utcoffset(datetime(2026, 7, 5)) == timedelta(0), unusable


@pytest.mark.parametrize("expr,why", [
    ("* * * *", "five fields"), ("* * * * * *", "five fields"), ("61 * * * *", "minute"),
    ("0 0 30 2 *", "day-of-month"), (5, "cron expression in quotes"), ("@daily", "five fields"),
])
def test_bad_cron_expressions_are_refused_with_a_reason(expr, why):
    with pytest.raises(ScheduleError, match=why):
        check_cron(expr)


def test_a_good_cron_expression_is_normalised():
    assert check_cron(" 0  0 * * MON-FRI ") == "0 0 * * MON-FRI"


@pytest.mark.parametrize("spec,key,why", [
    ({"schedule": "61 * * * *"}, "agents.job.schedule", "bad minute"),
    ({"schedule": "* * * *"}, "agents.job.schedule", "five fields"),
    ({"every": 0}, "agents.job.every", "greater than zero"),
    ({"every": -5}, "agents.job.every", "greater than zero"),
    ({"every": "soon"}, "agents.job.every", ""),
    ({"every": 5, "schedule": "* * * * *"}, "agents.job.every", "not both"),
    ({"watchdog": 0}, "agents.job.watchdog", "greater than zero"),
])
def test_bad_schedule_or_watchdog_is_a_config_error_naming_the_key(spec, key, why):
    with pytest.raises(ConfigError) as e:
        parse_config({"agents": {"job": spec}})
    assert str(e.value).startswith(key + ":") and why in str(e.value)


def test_schedule_and_watchdog_keys_reach_the_config():
    cfg = parse_config({"ring": {"watchdog": 30},
                        "agents": {"a": {"schedule": "0 0 * * *"}, "b": {"every": 2, "watchdog": 5}}})
    assert cfg.schedule_for("a") == Schedule(cron="0 0 * * *")
    assert cfg.schedule_for("b") == Schedule(every=2)
    assert cfg.schedule_for("c") is None
    assert (cfg.watchdog_for("a"), cfg.watchdog_for("b")) == (30, 5)
    # null turns the ring's watchdog off for one agent (an agent that does not speak the protocol)
    cfg = parse_config({"ring": {"watchdog": 30}, "agents": {"legacy": {"watchdog": None}, "c": {"cwd": "/"}}})
    assert (cfg.watchdog_for("legacy"), cfg.watchdog_for("c"), cfg.watchdog_for("other")) == (None, 30, 30)
    assert parse_config({}).watchdog_for("a") is None


# --- the turn choice with scheduled agents (ringd.core.policy.plan_turn) -------------------

from ringd.core.policy import Action, TurnInputs, plan_turn   # noqa: E402
from ringd.core.records import AgentState   # noqa: E402

ROSTER = [("a", "a.sh"), ("tick", "tick.sh"), ("b", "b.sh"), ("nightly", "n.sh")]


def plan(start=0, scheduled=None, ran=(), states=None, now=100.0, limit=None):
    return plan_turn(TurnInputs(ROSTER, start, states or {}, now, limit=limit,
                                scheduled=scheduled or {}, ran_scheduled=frozenset(ran)))


def test_a_due_scheduled_agent_runs_before_the_ordinary_next_agent_once():
    p = plan(start=2, scheduled={"tick": 99.0, "nightly": 500.0})
    assert (p.index, p.scheduled, p.decision.action) == (1, True, Action.RUN)
    p = plan(start=2, scheduled={"tick": 99.0, "nightly": 500.0}, ran={"tick"})
    assert (p.index, p.scheduled) == (2, False)           # then the ordinary turn (b)


def test_scheduled_agents_take_no_ordinary_turn():
    p = plan(start=1, scheduled={"tick": 150.0, "nightly": 500.0})
    assert (p.index, p.scheduled, p.passed) == (2, False, [1])   # tick passed over, b runs
    p = plan(start=3, scheduled={"tick": 150.0, "nightly": 500.0})
    assert (p.index, p.passed) == (0, [3])


def test_several_due_run_in_roster_order():
    due = {"tick": 99.0, "nightly": 50.0}
    assert plan(start=2, scheduled=due).index == 1
    assert plan(start=2, scheduled=due, ran={"tick"}).index == 3
    assert plan(start=2, scheduled=due, ran={"tick", "nightly"}).index == 2


def test_due_again_at_once_waits_for_the_ordinary_turn_unless_none_wants_it():
    held = {n: AgentState(name=n, backoff_until=200.0) for n in ("a", "b")}
    p = plan(scheduled={"tick": 99.0, "nightly": 500.0}, ran={"tick"}, states=held)
    assert (p.index, p.scheduled) == (1, True)
    p = plan(scheduled={"tick": 120.0, "nightly": 500.0}, ran={"tick"}, states=held)
    assert (p.index, p.until) == (None, 120.0)           # nothing due: sleep until tick is


def test_a_scheduled_agent_backing_off_is_not_run_when_due():
    states = {"tick": AgentState(name="tick", backoff_until=130.0)}
    p = plan(scheduled={"tick": 99.0}, states=states)
    assert (p.index, p.scheduled) == (0, False)
    only = plan_turn(TurnInputs([("tick", "t")], 0, states, 100.0, scheduled={"tick": 99.0}))
    assert (only.index, only.until) == (None, 130.0)


def test_once_counts_scheduled_agents_as_passed_positions():
    p = plan_turn(TurnInputs([("tick", "t"), ("nightly", "n")], 0, {}, 100.0, limit=2,
                             scheduled={"tick": 300.0, "nightly": 200.0}))
    assert (p.index, p.passed, p.until) == (None, [0, 1], 200.0)
    # due again already (its run outlasted its period): under --once the lap is over
    p = plan_turn(TurnInputs([("tick", "t"), ("nightly", "n")], 0, {}, 100.0, limit=2,
                             scheduled={"tick": 99.0, "nightly": 200.0}, ran_scheduled=frozenset({"tick"})))
    assert (p.index, p.passed) == (None, [0, 1])


def test_the_round_is_one_rule_for_the_driver_and_status():
    """policy.round_after: a scheduled run joins the round; an ordinary turn,
    a job due again, nothing due and a pause end it; ``--once`` and ``ringd
    next`` keep it. status.next_turn, given the round, names what plan_turn
    picks - the ordinary agent, not the job due again within its round."""
    from ringd.inputs.config import Config
    from ringd.core.policy import round_after
    from ringd.cli.status import next_turn
    names = [n for n, _ in ROSTER]
    ran = frozenset({"nightly"})
    assert round_after(ran, plan(start=2, scheduled={"tick": 99.0, "nightly": 500.0}), names) == {"tick", "nightly"}
    ordinary = plan(start=2, scheduled={"tick": 150.0})
    assert round_after(ran, ordinary, names) == frozenset()
    assert round_after(ran, ordinary, names, once=True) == ran
    assert round_after(ran, None, names) == ran                      # a new lap counted first
    assert round_after(ran, None, names, ring_paused=True) == frozenset()
    held = {n: AgentState(name=n, backoff_until=200.0) for n in ("a", "b")}
    again = plan(scheduled={"tick": 99.0, "nightly": 500.0}, ran={"tick"}, states=held)
    assert again.again and round_after(frozenset({"tick"}), again, names) == frozenset()
    idle = plan(scheduled={"tick": 120.0, "nightly": 500.0}, states=held)
    assert idle.index is None and round_after(ran, idle, names) == frozenset()
    # status: tick is due again (its run outlasted its period) but ran in this round: b is next
    assert next_turn(ROSTER, {}, None, 100.0, Config(), next_due={"tick": 99.0}) == ("tick", 100.0)
    assert next_turn(ROSTER, {}, None, 100.0, Config(), next_due={"tick": 99.0},
                     ran_scheduled=["tick"]) == ("a", 100.0)
    # ... and when no ordinary agent wants the turn, the driver ends the round and runs tick again
    assert next_turn(ROSTER, held, None, 100.0, Config(), next_due={"tick": 99.0, "nightly": 500.0},
                     ran_scheduled=["tick"]) == ("tick", 100.0)


def test_every_after_a_clock_stepped_back_waits_at_most_twice_its_period():
    """``every: 600`` last started at t; the wall clock is stepped back. A step
    shorter than the period stretches one wait (due at t + 600, on the new clock
    at most 1200 s away); a longer one would stretch it by the step: due now."""
    from ringd.core.records import AgentState, RunRow
    from ringd.inputs.schedule import entry

    class Journal:   # the reads schedule.entry makes, of a ring whose last run of "job" started at t
        def __init__(self, t):
            self.row = RunRow(id=7, agent="job", position=0, status="ok", started_at=t, ended_at=t + 1,
                              duration=1.0, exit_code=0, signal=None, reason=None, pid=None, pid_start=None,
                              run_budget=None, stall_threshold=None, log_path=None, driver_pid=None,
                              driver_start=None)

        def meta(self, key):
            return None

        def set_meta(self, key, value):
            pass

        def running_row(self):
            return None

        def agent(self, name):
            return AgentState(name, last_run_id=7)

        def run(self, run_id):
            return self.row

    every, t = Schedule(every=600), 1_800_000_000.0
    assert entry(Journal(t), "job", every, t + 10).next_due(BERLIN) == t + 600          # no step
    assert entry(Journal(t), "job", every, t - 300).next_due(BERLIN) == t + 600         # 5 min back: kept
    assert entry(Journal(t), "job", every, t - 86400).next_due(BERLIN) == t - 86400     # a day back: due now


def test_a_schedules_kept_times_that_no_clock_can_show_are_no_times():
    """``schedule:<name>`` in the journal's meta is read, not trusted: a time no
    clock can show (JSON's 400-digit integer, which float() cannot take; 1e999;
    NaN) is no time - never an OverflowError in the driver's turn."""
    import json
    from ringd.inputs.schedule import entry

    class Journal:   # a job that never ran, its meta as a hand (or a bit flip) left it
        def __init__(self, kept):
            self.kept = kept

        def meta(self, key):
            return self.kept

        def set_meta(self, key, value):
            self.kept = value

        def running_row(self):
            return None

        def agent(self, name):
            from ringd.core.records import AgentState
            return AgentState(name)

        def run(self, run_id):
            return None

    every, t = Schedule(every=600), 1_800_000_000.0
    for bad in ("1" + "0" * 400, "-1" + "0" * 400, "1e999", "NaN", "true"):
        kept = f'{{"spec": "{every.describe()}", "since": {t - 60}, "last_start": {bad}}}'
        assert entry(Journal(kept), "job", every, t).next_due(BERLIN) == t - 60, bad   # never ran: due
        j = Journal(f'{{"spec": "{every.describe()}", "since": {bad}}}')
        assert entry(j, "job", every, t).next_due(BERLIN) == t, bad   # first seen now
        assert json.loads(j.kept)["since"] == t


def test_the_ring_resumes_after_its_last_ordinary_run_however_many_scheduled_runs_came_since(tmp_path):
    """A scheduled run is not a turn: the ring resumes after the last ordinary
    run - also when a frequent job ran more than a hundred times since (a day
    of a 10-minute job while the ring was paused; it looked back 100 rows)."""
    from ringd.journal.sqlite import Journal
    from ringd.inputs.schedule import last_turn
    config = parse_config({"agents": {"job": {"every": 600}}})
    j = Journal.open(tmp_path)
    try:
        assert last_turn(j, config, j.last_run()) is None
        with j.transaction() as tx:
            tx.add_skipped("job", 3, "before any ordinary run", "driver", 1.0)
        assert last_turn(j, config, j.last_run()).agent == "job"   # no ordinary run yet
        with j.transaction() as tx:
            tx.add_skipped("a", 0, "x", "driver", 2.0)
            ordinary = tx.add_skipped("b", 1, "x", "driver", 3.0)
            for k in range(150):
                tx.add_skipped("job", 3, "x", "driver", 4.0 + k)
        assert last_turn(j, config, j.last_run()).id == ordinary
    finally:
        j.close()



def test_a_clock_stepped_back_further_than_the_schedules_spacing_is_a_clock_set_not_a_slot_run():
    """A daily job ran while the wall clock was a year ahead (a bad RTC read at
    boot); NTP then sets it right. Stepped back further than the schedule's
    spacing (a day), the clock was set, not corrected: the job is due at the
    first match after the step, as cron (a step over three hours) and systemd
    (a trigger time ahead is rewound) take it - it waited a year. A step back
    shorter than the spacing (an NTP correction) still never runs a slot again."""
    s = Schedule(cron="0 3 * * *")
    ran = ts(BERLIN, 2027, 6, 2, 3, 0, 5)
    wall = wall_clock(ran, BERLIN)
    set_back = ts(BERLIN, 2026, 6, 1, 12, 0)
    assert next_due(s, ran, ran - 86400, BERLIN, wall) == ts(BERLIN, 2027, 6, 3, 3, 0)   # (the clock aside)
    assert next_due(s, ran, ran - 86400, BERLIN, wall, set_back) == ts(BERLIN, 2026, 6, 2, 3, 0)
    corrected = ran - 3 * 3600                               # three hours back: within a day
    assert next_due(s, ran, ran - 86400, BERLIN, wall, corrected) == ts(BERLIN, 2027, 6, 3, 3, 0)
    # an every-minute job's spacing is a minute: a five-minute step back runs its minutes again, as cron does
    minutely = Schedule(cron="* * * * *")
    ran = ts(BERLIN, 2026, 6, 1, 12, 5, 1)
    assert next_due(minutely, ran, ran - 3600, BERLIN, wall_clock(ran, BERLIN), ran - 300) == \
        ts(BERLIN, 2026, 6, 1, 12, 1)


def test_status_reads_schedules_on_the_clock_it_is_given(tmp_path):
    """gather_status(now=...) read every other time on that clock but the
    schedules' next due times on the real one: a job never run (due as first
    seen) was shown due at the real time, a cron job at the real clock's next
    match - one clock for the whole read."""
    from ringd.inputs.config import parse_config
    from ringd.journal.sqlite import Journal
    from ringd.cli.status import gather_status
    now = 1_800_000_000.0
    roster = tmp_path / "ring.txt"
    roster.write_text("a /bin/true\njob /bin/true\n")
    roster.chmod(0o600)
    config = parse_config({"agents": {"job": {"every": 600}}})
    for journal in (False, True):
        if journal:
            Journal.open(tmp_path).close()
        doc = gather_status(tmp_path, config, now=now)
        assert {a["name"]: a["next_due"] for a in doc["agents"]}["job"] == "2027-01-15T08:00:00+00:00", journal


def test_a_cron_job_last_started_at_the_end_of_the_year_9999_is_due_once_the_clock_is_set_right():
    """A clock set to the last hour of the year 9999 (a time a date can show:
    heartbeat.epoch keeps it) ran a daily job; set right, the job's next match
    lies past datetime's end. next_due raised OverflowError - out of the
    driver's turn and ``ringd status`` alike; it is no due time, and the clock
    behind that start was set: due at the first match after the step."""
    from ringd.core.timefmt import epoch
    s = Schedule(cron="0 3 * * *")
    far = epoch(ts(ZoneInfo("UTC"), 9999, 12, 31, 23, 30))
    assert far is not None
    assert next_due(s, far, far - 86400, BERLIN) == float("inf")
    set_back = ts(BERLIN, 2026, 6, 1, 12, 0)
    assert next_due(s, far, far - 86400, BERLIN, None, set_back) == ts(BERLIN, 2026, 6, 2, 3, 0)
