"""ringd.core.watchpolicy: pure decisions, no processes, no files, no real clock."""
from __future__ import annotations

import pytest

from ringd.core import watchpolicy
from ringd.core.watchpolicy import DEAD, OK, STALE, STARTING

STALE_AFTER = 10.0


def hb(pid=100, start=1000.0, seq=1, at=5000.0, **extra):
    return {"pid": pid, "pid_start": start, "seq": seq, "at_epoch": at, "at": f"t{at}", **extra}


def judge(view, now, alive=True, **kw):
    return watchpolicy.judge(view, alive=alive, now=now, stale_after=STALE_AFTER, **kw)


# --- heartbeat keys ------------------------------------------------------------------

@pytest.mark.parametrize("bad", [None, "x", 3, [], {}, {"pid": "12"}, {"pid": 0}, {"pid": True},
                                 {"pid": -5, "seq": 1}])
def test_beat_key_rejects_garbage(bad):
    assert watchpolicy.beat_key(bad) is None


def test_beat_key_rejects_a_pid_no_kernel_gives():
    """pid_t is 32 bits: a bigger pid made os.pidfd_open raise OverflowError when
    the watcher followed that heartbeat (restart_command mode), a traceback."""
    assert watchpolicy.beat_key(hb(pid=2 ** 31)) is None
    assert watchpolicy.beat_key(hb(pid=10 ** 400)) is None
    assert watchpolicy.beat_key(hb(pid=2 ** 31 - 1)) is not None


@pytest.mark.parametrize("start", [10 ** 400, -10 ** 400, float("inf"), float("nan"), "x", True],
                         ids=["huge", "-huge", "inf", "nan", "str", "bool"])
def test_a_start_time_no_process_can_have_is_no_start_time(start):
    """A 400-digit pid_start (JSON reads it as an int) raised OverflowError in
    beat_key: the watcher died at its next poll (exit 70, read as "gave up")
    and left its driver running unwatched."""
    key = watchpolicy.beat_key(hb(start=start))
    assert key is not None and key[1] is None
    assert watchpolicy.adopted(hb(start=start), 0.0).pid_start is None


def test_beat_key_changes_with_seq_and_identity():
    assert watchpolicy.beat_key(hb(seq=1)) != watchpolicy.beat_key(hb(seq=2))
    assert watchpolicy.beat_key(hb(pid=1)) != watchpolicy.beat_key(hb(pid=2))
    assert watchpolicy.beat_key(hb(start=1.0)) != watchpolicy.beat_key(hb(start=2.0))
    assert watchpolicy.beat_key(hb()) == watchpolicy.beat_key(hb())


# --- a driver we started: grace, first beat, staleness --------------------------------

def test_fresh_driver_is_starting_until_grace_then_stale():
    old = hb(pid=50, seq=99)                       # the predecessor's file
    v = watchpolicy.started(100, 1000.0, old, now=0.0)
    assert judge(v, 0.0).health == STARTING
    v = watchpolicy.observe(v, old, 5.0)                # still the old file: no news
    assert judge(v, 5.0).health == STARTING
    assert judge(v, STALE_AFTER - 0.01).health == STARTING
    verdict = judge(v, STALE_AFTER + 0.01)
    assert verdict.health == STALE and verdict.unhealthy
    assert "no heartbeat" in verdict.reason and "100" in verdict.reason


def test_fresh_driver_custom_grace():
    v = watchpolicy.started(100, 1000.0, None, now=0.0)
    assert judge(v, 15.0, grace=20.0).health == STARTING
    assert judge(v, 21.0, grace=20.0).health == STALE


def test_fresh_driver_that_exits_before_beating_is_dead():
    v = watchpolicy.started(100, 1000.0, None, now=0.0)
    verdict = judge(v, 0.5, alive=False)
    assert verdict.health == DEAD and "before its first heartbeat" in verdict.reason


def test_driver_that_could_not_be_started_is_dead():
    v = watchpolicy.DriverView(pid=None, pid_start=None, pinned=True, since=0.0)
    verdict = judge(v, 0.1, alive=False)
    assert verdict.health == DEAD and "could not be started" in verdict.reason


def test_first_beat_of_our_driver_makes_it_ok_and_restarts_the_clock():
    v = watchpolicy.started(100, 1000.0, hb(pid=50), now=0.0)
    v = watchpolicy.observe(v, hb(pid=100, seq=1), 8.0)
    assert v.beat_at == 8.0 and v.beats == 1
    assert judge(v, 8.0 + STALE_AFTER - 0.01).health == OK
    assert judge(v, 8.0 + STALE_AFTER + 0.01).health == STALE


def test_beats_from_another_process_do_not_count_for_a_pinned_driver():
    v = watchpolicy.started(100, 1000.0, None, now=0.0)
    v = watchpolicy.observe(v, hb(pid=77, seq=5), 1.0)          # someone else's heartbeat
    v = watchpolicy.observe(v, hb(pid=100, start=999.0), 2.0)    # recycled pid, other start time
    assert v.beat_at is None
    assert judge(v, STALE_AFTER + 1).health == STALE


def test_unchanged_heartbeat_goes_stale_on_the_monotonic_clock():
    v = watchpolicy.started(100, 1000.0, None, now=0.0)
    v = watchpolicy.observe(v, hb(seq=1), 1.0)
    for t in range(2, 11):
        v = watchpolicy.observe(v, hb(seq=1), float(t))          # same content: a hung driver
    assert v.beat_at == 1.0
    assert judge(v, 11.5).health == STALE
    v = watchpolicy.observe(v, hb(seq=2), 11.6)                  # it beats again
    assert judge(v, 11.6).health == OK


def test_dead_process_is_dead_even_with_a_fresh_heartbeat():
    v = watchpolicy.observe(watchpolicy.started(100, 1000.0, None, 0.0), hb(), 1.0)
    verdict = judge(v, 1.1, alive=False)
    assert verdict.health == DEAD and verdict.unhealthy


# --- clock jumps and corrupt files --------------------------------------------------

@pytest.mark.parametrize("at", [5000.0, 1e12, -1e9, 0.0])
def test_wall_clock_in_heartbeat_is_irrelevant(at):
    """A heartbeat 'from the future' (clock set back) or from long ago (clock set
    forward) is judged by whether it changes, not by its time stamp."""
    v = watchpolicy.started(100, 1000.0, None, 0.0)
    v = watchpolicy.observe(v, hb(seq=1, at=at), 1.0)
    assert judge(v, 2.0).health == OK
    assert judge(v, 1.0 + STALE_AFTER + 0.1).health == STALE


def test_corrupt_heartbeat_is_no_news_not_a_verdict():
    v = watchpolicy.observe(watchpolicy.started(100, 1000.0, None, 0.0), hb(seq=1), 1.0)
    for junk in (None, "garbage", {"pid": "x"}, {}):
        v2 = watchpolicy.observe(v, junk, 5.0)
        assert v2 == v
    assert judge(v, 5.0).health == OK
    v = watchpolicy.observe(v, hb(seq=2), 6.0)                    # the next good beat counts
    assert v.beat_at == 6.0


# --- adopting a running driver, following the heartbeat -------------------------------

def test_adopted_driver_gets_the_benefit_of_the_doubt():
    v = watchpolicy.adopted(hb(pid=100, at=1.0), now=50.0)        # its time stamp is ancient
    assert v.pinned and v.pid == 100 and v.beat_at == 50.0
    assert judge(v, 55.0).health == OK
    assert judge(v, 50.0 + STALE_AFTER + 0.1).health == STALE


def test_following_a_restart_command_waits_for_a_new_beat():
    old = hb(pid=50, seq=7)
    v = watchpolicy.following(old, now=0.0, fresh=False)
    assert not v.pinned and v.pid is None
    # the old driver is dead, but its file does not count: starting, not dead
    assert judge(v, 1.0, alive=False).health == STARTING
    v = watchpolicy.observe(v, hb(pid=60, start=2000.0, seq=1), 2.0)   # the new driver
    assert (v.pid, v.pid_start, v.beat_at) == (60, 2000.0, 2.0)
    assert judge(v, 3.0).health == OK
    v = watchpolicy.observe(v, hb(pid=61, start=3000.0, seq=1), 4.0)   # replaced again
    assert (v.pid, v.beats) == (61, 1)


def test_following_times_out_without_a_beat():
    v = watchpolicy.following(None, now=0.0, fresh=False)
    assert judge(v, STALE_AFTER + 0.1, alive=False).health == STALE


def test_following_a_live_driver_at_start_up():
    v = watchpolicy.following(hb(pid=60, start=2000.0), now=0.0, fresh=True)
    assert v.pid == 60 and v.beat_at == 0.0
    assert judge(v, 1.0).health == OK
    assert judge(v, 1.0, alive=False).health == DEAD


# --- when to check next --------------------------------------------------------------

def test_next_check_is_the_poll_or_the_stale_edge_whichever_first():
    v = watchpolicy.started(100, 1000.0, None, now=0.0)
    assert watchpolicy.next_check(v, last_poll=0.0, poll_interval=300, stale_after=10) == pytest.approx(10.0, abs=0.01)
    assert watchpolicy.next_check(v, last_poll=0.0, poll_interval=2, stale_after=10) == 2
    v = watchpolicy.observe(v, hb(), 5.0)
    assert watchpolicy.next_check(v, last_poll=6.0, poll_interval=300, stale_after=10) == pytest.approx(15.0, abs=0.01)


# --- the restart window -----------------------------------------------------------------

def test_may_restart_allows_burst_restarts_then_refuses():
    times = []
    now = 100.0
    for i in range(5):
        assert watchpolicy.may_restart(times, now + i, burst=5, interval=600)
        times = watchpolicy.record_restart(times, now + i, 600)
    assert len(times) == 5
    assert not watchpolicy.may_restart(times, now + 5, burst=5, interval=600)


def test_window_slides():
    times = [0.0, 10.0, 20.0]
    assert not watchpolicy.may_restart(times, 25.0, burst=3, interval=30)
    assert watchpolicy.may_restart(times, 30.0, burst=3, interval=30)       # 0.0 left the window
    assert watchpolicy.prune(times, 30.0, 30) == [10.0, 20.0]


def test_prune_drops_garbage_and_clamps_future_times():
    assert watchpolicy.prune(["x", None, True, float("nan"), 5.0], 10.0, 30) == [5.0]
    # the wall clock was set back a day: the entries still count, but expire
    # one interval from now rather than in a day
    future = [86400.0 + 50, 86400.0 + 60]
    kept = watchpolicy.prune(future, 100.0, 30)
    assert kept == [100.0, 100.0]
    assert not watchpolicy.may_restart(future, 100.0, burst=2, interval=30)
    assert watchpolicy.prune(kept, 131.0, 30) == []


def test_prune_drops_numbers_no_clock_can_show():
    """A 400-digit restart time raised OverflowError (float() of it)."""
    assert watchpolicy.prune([10 ** 400, -10 ** 400, float("inf"), float("-inf"), 5.0], 10.0, 30) == [5.0]


def test_record_restart_prunes_and_sorts():
    assert watchpolicy.record_restart([50.0, 1.0], 60.0, 30) == [50.0, 60.0]


# --- the persisted window: seconds since boot (ringd.host.watchstate, pure given a Clock) -------

def test_restarts_of_this_boot_keep_their_boot_time_whatever_the_wall_clock_did():
    """Three restarts 100-80 s ago by the boot clock; the wall clock was then set
    back an hour. Their ISO times are now an hour in the future: placed by the
    wall clock (clamped to now) they were a burst in the window and the watcher
    gave up; by their boot time they are long out of a 30 s window."""
    from ringd.host.watchstate import Clock, encode_restarts, restart_times
    before = Clock(boot_id="b1", boot=1000.0, wall=1_800_000_000.0)
    saved = encode_restarts([900.0, 910.0, 920.0], before)
    assert saved["restarts"][0] == "2027-01-15T07:58:20+00:00"
    after = Clock(boot_id="b1", boot=1000.0 + 5, wall=before.wall - 3600 + 5)   # stepped back an hour
    times = restart_times(saved, after)
    assert times == [900.0, 910.0, 920.0]
    assert watchpolicy.prune(times, after.boot, 30) == []
    # and stepped forward a day: still in a 200 s window, not forgotten
    ahead = Clock(boot_id="b1", boot=1005.0, wall=before.wall + 86400)
    assert watchpolicy.prune(restart_times(saved, ahead), ahead.boot, 200) == [900.0, 910.0, 920.0]


def test_restarts_of_another_boot_or_an_older_ringwatch_are_placed_by_wall_time():
    from ringd.host.watchstate import Clock, encode_restarts, restart_times
    old = Clock(boot_id="b1", boot=1000.0, wall=1_800_000_000.0)
    saved = encode_restarts([990.0], old)
    rebooted = Clock(boot_id="b2", boot=30.0, wall=old.wall + 60)   # 60 s later by the wall clock
    assert restart_times(saved, rebooted) == [30.0 - 70.0]
    legacy = {"restarts": saved["restarts"] + [old.wall - 5, "garbage", None, True]}
    assert restart_times(legacy, old) == [990.0, 995.0]
    # a hand-edited or stale restart_clock never gives a bad number
    bad = dict(saved, restart_clock={"boot_id": "b1", "since_boot": {saved["restarts"][0]: "x"}})
    assert restart_times(bad, old) == [990.0]
    bad = dict(saved, restart_clock={"boot_id": "b1", "since_boot": {saved["restarts"][0]: float("nan")}})
    assert restart_times(bad, old) == [990.0]
    assert restart_times({"restarts": "x", "restart_clock": []}, old) == []


def test_restart_times_too_big_for_a_float_are_dropped_not_raised():
    """ringwatch.json with a 400-digit restart (or its boot time) made the watcher
    and `ringwatch reset` - the operator's way out - an internal error."""
    from ringd.host.watchstate import Clock, encode_restarts, restart_times
    old = Clock(boot_id="b1", boot=1000.0, wall=1_800_000_000.0)
    saved = encode_restarts([990.0], old)
    assert restart_times({"restarts": [10 ** 400, -10 ** 400, old.wall - 5]}, old) == [995.0]
    huge = dict(saved, restart_clock={"boot_id": "b1", "since_boot": {saved["restarts"][0]: 10 ** 400}})
    assert restart_times(huge, old) == [990.0]   # placed by its wall time instead


def test_a_driver_that_could_not_be_started_is_judged_dead_at_once():
    """A failed fork/exec waited for the next poll (poll_interval, 300 s by default)
    to be judged: restarts a poll apart never hit the start limit. It is due now."""
    v = watchpolicy.not_started(now=50.0)
    assert watchpolicy.next_check(v, last_poll=50.0, poll_interval=300, stale_after=300) == 50.0
    assert watchpolicy.judge(v, alive=False, now=50.0, stale_after=300).health == DEAD
    assert watchpolicy.judge(v, alive=False, now=50.0, stale_after=300).unhealthy


# --- the watcher's stop of its driver: one deadline -------------------------------------

def test_a_stop_kills_after_the_grace_and_waits_for_the_kill_within_one_deadline():
    plan = watchpolicy.stop_plan(100.0, grace=10, budget=20)
    assert plan == watchpolicy.StopPlan(kill_at=110.0, end=120.0)
    assert watchpolicy.stop_step(plan, 100.0, None, 5) == ("wait", 110.0)
    assert watchpolicy.stop_step(plan, 110.0, None, 5) == ("kill", 110.0)
    assert watchpolicy.stop_step(plan, 110.0, 110.0, 5) == ("wait", 115.0)
    assert watchpolicy.stop_step(plan, 115.0, 110.0, 5) == ("give up", 115.0)
    # a SIGKILL late in the plan waits only for what is left of it
    assert watchpolicy.stop_step(plan, 118.0, 118.0, 5) == ("wait", 120.0)
    assert watchpolicy.stop_step(plan, 120.0, 118.0, 5) == ("give up", 120.0)
    # a grace longer than the budget never outlasts it
    assert watchpolicy.stop_plan(0.0, grace=30, budget=20).kill_at == 20.0


def test_a_second_stop_signal_hurries_a_stop_a_first_one_during_a_replace_does_not():
    plan = watchpolicy.stop_plan(100.0, grace=10, budget=20)
    hurried = watchpolicy.stop_heard(plan, 101.0, stopping=True)
    assert hurried == watchpolicy.StopPlan(kill_at=101.0, end=120.0)
    assert watchpolicy.stop_step(hurried, 101.0, None, 5) == ("kill", 101.0)
    assert watchpolicy.stop_heard(plan, 101.0, stopping=False) == plan   # replacing: the stop goes on
    assert watchpolicy.stop_heard(hurried, 105.0, stopping=True) == hurried   # never later


def test_a_wait_within_a_stop_gets_what_is_left_of_it():
    plan = watchpolicy.stop_plan(100.0, grace=10, budget=20)
    assert watchpolicy.left(None, 119.0, 10.0) == 10.0            # no stop under way: its own bound
    assert watchpolicy.left(plan, 101.0, 10.0) == 10.0
    assert watchpolicy.left(plan, 115.0, 10.0) == 5.0
    assert watchpolicy.left(plan, 125.0, 10.0, 0.2) == 0.2          # past the plan: the least


def test_the_watchers_stop_budget_fits_its_steps_and_the_units_stop_timeout():
    """The whole stop (grace, the SIGKILL's wait, the orphan's kill) fits the budget,
    and the budget fits the unit's TimeoutStopSec / launchd's ExitTimeOut with room
    for the rest (the short journal and lock waits, an interpreter's exit)."""
    from ringd.host import cgroup
    from ringd.cli.service import STOP_GRACE_WATCHER
    from ringd.host import driverproc
    from ringd.loops import watcher
    assert watcher.STOP_GRACE + driverproc.KILL_WAIT + cgroup.KILL_WAIT <= watcher.STOP_BUDGET
    assert watcher.STOP_BUDGET + watcher.REAP_BUSY_AT_STOP + watcher.SAVE_LOCK_AT_STOP + 5 <= STOP_GRACE_WATCHER


# --- an outage: the driver exited 69 ---------------------------------------------------

def test_only_exit_69_is_an_outage():
    assert watchpolicy.is_outage(69)
    for code in (0, 1, 70, 75, 78, -9, -15, None):
        assert not watchpolicy.is_outage(code), code


def test_the_outage_back_off_doubles_from_restart_sec_to_a_cap():
    waits = [watchpolicy.outage_backoff(n, 5.0) for n in range(1, 8)]
    assert waits == [5.0, 10.0, 20.0, 40.0, 60.0, 60.0, 60.0]
    assert watchpolicy.outage_backoff(1, 0.0) == watchpolicy.OUTAGE_BACKOFF_MIN   # restart_sec 0 never spins
    assert watchpolicy.outage_backoff(3, 0.2) == 4 * watchpolicy.OUTAGE_BACKOFF_MIN
    assert watchpolicy.outage_backoff(1, 300.0) == 300.0                          # never below restart_sec
    assert watchpolicy.outage_backoff(10 ** 6, 300.0) == 300.0                    # no overflow, however long
    assert watchpolicy.outage_backoff(0, 5.0) == 5.0
