"""The lease's decisions, pure: no database, no processes, microseconds each;
and the leader's watchdog hand-over, with a stand-in journal."""
import pytest

from ringd.core.lease import (NOBODY, RENEW, TAKE, WAIT, LeaseRow, beat_every, decide, holder_host,
                              holder_name, must_stop)

ME = holder_name("box-a", 100, 555)
OTHER = holder_name("box-b", 200, 777)


def test_a_fresh_ring_is_taken_at_epoch_1():
    d = decide(None, ME, None, 1000.0)
    assert (d.action, d.epoch, d.previous) == (TAKE, 1, None)


def test_a_released_lease_is_taken_with_a_new_epoch_and_no_one_to_reap_for():
    d = decide(LeaseRow(None, 7, 990.0), ME, None, 1000.0)
    assert (d.action, d.epoch, d.previous) == (TAKE, 8, None)


def test_my_live_lease_is_renewed_at_the_same_epoch():
    d = decide(LeaseRow(ME, 3, 1010.0), ME, 3, 1000.0)
    assert (d.action, d.epoch) == (RENEW, 3)


def test_a_live_lease_of_another_host_makes_me_wait_until_it_can_lapse():
    d = decide(LeaseRow(OTHER, 3, 1010.0), ME, None, 1000.0)
    assert (d.action, d.epoch, d.retry_in) == (WAIT, 3, 10.0)


def test_an_expired_lease_of_another_host_is_taken_over_naming_it():
    d = decide(LeaseRow(OTHER, 3, 1000.0), ME, None, 1000.0)  # expiry instant: already lapsed
    assert (d.action, d.epoch, d.previous) == (TAKE, 4, OTHER)
    assert holder_host(d.previous) == "box-b"


def test_my_own_lapsed_lease_is_taken_anew_never_renewed():
    # I froze past my TTL and nobody took over: my old epoch may have unfenced
    # writes in flight, so I take a new epoch (and reap my own old run).
    d = decide(LeaseRow(ME, 3, 999.0), ME, 3, 1000.0)
    assert (d.action, d.epoch, d.previous) == (TAKE, 4, ME)


def test_a_lease_moved_on_while_i_was_frozen_is_not_mine():
    d = decide(LeaseRow(OTHER, 4, 1010.0), ME, 3, 1000.0)
    assert d.action == WAIT


def test_same_holder_text_with_another_epoch_is_not_renewed():
    d = decide(LeaseRow(ME, 5, 1010.0), ME, 3, 1000.0)
    assert d.action == WAIT


def test_a_lease_row_made_again_is_taken_at_once_by_the_leader_whose_lease_is_still_good():
    """The lease table dropped (or its row deleted) under a running ring: made
    again as held by nobody for one TTL. The leader whose own lease is still good
    on the server's clock takes it at once, a new epoch above both, and its run
    goes on; nobody else can have led meanwhile. Anyone else waits out the TTL."""
    made_again = LeaseRow(NOBODY, 0, 1030.0)
    d = decide(made_again, ME, 7, 1000.0, my_expires_at=1020.0)
    assert (d.action, d.epoch, d.previous) == (TAKE, 8, None)
    assert decide(made_again, OTHER, None, 1000.0).action == WAIT          # a standby
    assert decide(made_again, ME, 7, 1000.0, my_expires_at=999.0).action == WAIT   # my lease lapsed
    assert decide(made_again, ME, 7, 1000.0).action == WAIT                # expiry not known
    assert decide(LeaseRow(OTHER, 9, 1030.0), ME, 7, 1000.0, my_expires_at=1020.0).action == WAIT
    assert decide(LeaseRow(NOBODY, 0, 999.0), OTHER, None, 1000.0).action == TAKE   # its TTL out


def test_the_leader_stops_at_half_the_ttl_of_its_own_clock():
    assert not must_stop(100.0, 30, 114.99)
    assert must_stop(100.0, 30, 115.0)
    assert must_stop(None, 30, 0.0)  # never renewed: never lead


def test_beats_come_at_least_twice_per_half_ttl():
    assert beat_every(30, 10) == 6.0
    assert beat_every(3, 0.2) == 0.2
    assert beat_every(3, 10) * 2 <= 3 / 2


def test_a_renewal_after_one_failed_renewal_comes_before_the_half_ttl_switch():
    """One renewal failed (at once, or after its whole bound: pgcall.call_bound);
    the next comes due at the latest one beat plus one bound after the last good
    one. At four beats per TTL that was exactly the half-TTL switch, and one
    dropped connection stopped a healthy leader."""
    from ringd.core.lease import retry_margin
    from ringd.journal.pgcall import call_bound
    for ttl, hb in ((30, 10), (3, 10), (3, 0.2), (8, 1.7), (1e6, 10)):
        latest = beat_every(ttl, hb) + call_bound(ttl)
        assert latest < ttl / 2 and retry_margin(ttl, hb) == pytest.approx(ttl / 2 - latest)
        assert retry_margin(ttl, hb) >= ttl / 10 - 1e-9
        assert not must_stop(0.0, ttl, latest)


def test_holder_names_host_pid_and_start_ticks():
    assert ME == "box-a pid=100 start=555"
    assert holder_host(None) is None


def test_a_regained_lease_starts_nothing_while_the_watchdog_still_kills():
    """The watchdog kills the stuck run by walking all of the driver's
    descendants; if the driver regains the lease meanwhile (its renewal landed
    late), nothing may start before that kill is over - it would kill the new
    run's agent too (seen under load: the next run `failed (signal 9)` after 20 ms)."""
    import threading

    from fakeenv import FakeEnv
    from ringd.loops.leader import Leader

    class NoRunning:
        def running_row(self):
            return None

        def stop_recording(self):
            pass

    release = threading.Event()
    killing = threading.Event()
    env = FakeEnv()
    leader = Leader(NoRunning(), ttl=2.0, log=lambda m, level: None, env=env, host="h")

    def slow_kill(*args):
        killing.set()
        release.wait(10)
    leader._kill_run = slow_kill
    with leader._cond:   # a run in flight, the last renewal long ago: the watchdog fires
        leader.leading, leader.renew_sent_at = True, env.lease_clock() - 10
        leader._agent = (12345, None, "key", 7, None)
        leader._cond.notify()
    assert killing.wait(5), "the watchdog did not fire"
    leader.took_over = True          # the driver regained the lease meanwhile
    settled = threading.Event()
    threading.Thread(target=lambda: (leader.settle_takeover(None), settled.set()), daemon=True).start()
    assert not settled.wait(0.3), "a new run could start while the watchdog still kills"
    release.set()
    assert settled.wait(5)


def test_two_drivers_named_alike_never_both_lead():
    """Two boxes with one host name, each driver pid 1 started at the same tick
    (containers): one holder string for both. The epoch tells them apart: only
    the driver that took it renews; the other waits, and once it takes over
    the first one's epoch is stale, so it waits too (and its writes are fenced)."""
    from ringd.core.lease import LeaseRow, decide
    me = "box pid=1 start=42"
    held = LeaseRow(me, 5, 100.0)
    assert decide(held, me, 5, 50.0).action == RENEW        # the one that took it
    assert decide(held, me, None, 50.0).action == WAIT       # its twin, just started
    assert decide(held, me, 4, 50.0).action == WAIT          # its twin, with an older epoch
    taken = decide(held, me, None, 100.0)                    # lapsed: the twin takes it
    assert (taken.action, taken.epoch) == (TAKE, 6)
    assert decide(LeaseRow(me, 6, 130.0), me, 5, 101.0).action == WAIT   # the first one, back


def test_the_lease_watchdog_reads_the_envs_clock_and_kills_through_the_env():
    """The leader goes only through the driver's env: its name is the env's
    host, pid and start ticks; its watchdog judges the half-TTL switch on the
    env's lease clock and kills the run in flight with DriverEnv.kill_run_now
    (here a fake clock: nothing fires until it is moved past the switch)."""
    import threading

    from conftest import wait_until
    from fakeenv import FakeEnv
    from ringd.loops.leader import Leader

    class Journal:
        def __init__(self):
            self.stopped = threading.Event()

        def stop_recording(self):
            self.stopped.set()

    env, journal, said = FakeEnv(), Journal(), []
    env.t = 100.0
    leader = Leader(journal, ttl=2.0, log=lambda m, level: said.append(m), env=env)
    assert leader.me == holder_name("fakehost", env.pid, env.pid_start)
    leader.guard(1234, 55, "key", 7)
    with leader._cond:   # renewed at 100 on the lease clock: the switch is at 101
        leader.leading, leader.renew_sent_at = True, env.lease_clock()
        leader._cond.notify()
    assert not journal.stopped.wait(0.3) and not env.killed_now, "fired before the env's clock passed the switch"
    with leader._cond:
        env.t = 101.5
        leader._cond.notify()
    wait_until(lambda: any("killed run" in m for m in said), 5, message="the watchdog's kill")
    assert env.killed_now == [(101.5, 1234, 7)] and journal.stopped.is_set() and not leader.leading
    assert leader.killed_pid == 1234 and "killed run 7 (1 process(es), agent pid 1234)" in said[-1]
