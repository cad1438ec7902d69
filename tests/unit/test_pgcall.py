"""The client-side bound on a PostgreSQL call (ringd.journal.pgcall): its decisions,
pure, and its wait loop driven on a socket pair with a stand-in for psycopg's
generator (no server, no psycopg)."""
import signal
import socket
import time

import pytest

from taps import Tap

from ringd.core.lease import beat_every, must_stop
from ringd.journal.pgcall import (OVERDUE, STOP_GRACE, STOPPING, Abandoned, call_bound, ends_call, poll_ms, verdict,
                          wait)


# --- decisions --------------------------------------------------------------------

def test_a_call_may_go_unanswered_for_one_beat_period_of_the_lease():
    assert call_bound(30) == 6.0
    assert call_bound(3) == 0.6
    # never longer than a many-host driver's beat period, and two of them end
    # a tenth of the TTL before the half-TTL switch of the last good renewal
    for ttl in (3, 30, 600):
        assert call_bound(ttl) == beat_every(ttl, 10 ** 6)
        assert not must_stop(0.0, ttl, 2 * call_bound(ttl) + ttl / 10 - 1e-9)


def test_a_call_is_overdue_at_its_deadline_not_before():
    assert verdict(9.999, 10.0, None) is None
    assert verdict(10.0, 10.0, None) == OVERDUE


def test_a_stop_signal_leaves_the_call_a_short_grace_then_ends_it():
    assert verdict(5.0, 10.0, 5.0) is None
    assert verdict(5.0 + STOP_GRACE - 0.001, 10.0, 5.0) is None
    assert verdict(5.0 + STOP_GRACE, 10.0, 5.0) == STOPPING
    assert verdict(10.0, 10.0, 9.99) == OVERDUE   # whichever end comes first
    assert STOP_GRACE < 0.5   # well within the SPEC's 1 s


def test_the_poll_sleeps_until_the_nearer_end_never_less_than_zero():
    assert poll_ms(0.0, 7.5, None) == 7500
    assert poll_ms(1.0, 7.5, 1.0) == round(STOP_GRACE * 1000)
    assert poll_ms(0.0, 0.0004, None) == 1      # rounded up: no wake-up just short of the end
    assert poll_ms(9.0, 7.5, None) == 0


# --- the loop ------------------------------------------------------------------------

def query(sock, sends):
    """A generator like psycopg's: write the query, then read the answer."""
    ready = yield 2          # WAIT_W
    sends.append(ready)
    sock.send(b"Q")
    ready = yield 1          # WAIT_R
    sends.append(ready)
    return sock.recv(64)


@pytest.fixture
def pair():
    a, b = socket.socketpair()
    tap = Tap()
    yield a, b, tap
    a.close()
    b.close()
    tap.close()


def test_an_answered_call_returns_its_answer(pair):
    a, b, tap = pair
    b.send(b"answer")
    sends = []
    assert wait(query(a, sends), a.fileno(), 5.0, tap) == b"answer"
    assert sends == [2, 1] and tap.drains == 0


def test_a_call_never_answered_is_abandoned_at_its_bound(pair):
    a, b, tap = pair
    t0 = time.monotonic()
    with pytest.raises(Abandoned, match="no answer within 0.3s"):
        wait(query(a, []), a.fileno(), 0.3, tap)
    took = time.monotonic() - t0
    assert 0.3 <= took < 2.0, took


def test_a_stop_signal_ends_a_hung_call_after_the_grace_and_is_put_back(pair):
    a, b, tap = pair
    tap.send(signal.SIGCHLD)
    tap.send(signal.SIGTERM)
    t0 = time.monotonic()
    with pytest.raises(Abandoned, match="stopping"):
        wait(query(a, []), a.fileno(), 30.0, tap)
    took = time.monotonic() - t0
    assert STOP_GRACE <= took < 1.0, took
    assert tap.drain() == {signal.SIGCHLD, signal.SIGTERM}   # the driver hears them next


def test_a_call_of_a_stopping_driver_has_the_stops_grace_only(pair):
    """Its stop signal heard before the call (a stop's own calls: the run's end,
    the lease's release): each waited out its whole bound on a server that
    never answers. One that answers within the grace is answered."""
    a, b, tap = pair
    t0 = time.monotonic()
    with pytest.raises(Abandoned, match="the driver is stopping"):
        wait(query(a, []), a.fileno(), 30.0, tap, stopping=True)
    took = time.monotonic() - t0
    assert STOP_GRACE <= took < 5.0, took   # (its whole bound, 30 s, before)
    b.send(b"answer")
    assert wait(query(a, []), a.fileno(), 30.0, tap, stopping=True) == b"answer"


def test_a_call_answered_within_the_grace_is_not_ended(pair):
    a, b, tap = pair
    tap.send(signal.SIGINT)
    b.send(b"answer")
    assert wait(query(a, []), a.fileno(), 30.0, tap) == b"answer"
    assert tap.drain() == {signal.SIGINT}


@pytest.mark.parametrize("sig", [signal.SIGHUP, signal.SIGUSR1])
def test_a_reload_or_wake_up_ends_a_hung_call_within_the_specs_second(pair, sig):
    """SPEC: the driver acts on SIGHUP and SIGUSR1 within 1 s. Heard during a
    hung call they were put back only at its bound (7.5 s at the default TTL)."""
    a, b, tap = pair
    tap.send(sig)
    t0 = time.monotonic()
    with pytest.raises(Abandoned, match="a signal to act on"):
        wait(query(a, []), a.fileno(), 30.0, tap)
    took = time.monotonic() - t0
    assert STOP_GRACE <= took < 1.0, took
    assert tap.drain() == {sig}   # the driver's loop acts on it next


@pytest.mark.parametrize("sig", [signal.SIGHUP, signal.SIGUSR1])
def test_a_reload_or_wake_up_during_start_up_waits_for_the_loop(pair, sig):
    """SPEC: a signal during start-up is honoured once the driver is ready.
    Ending a start-up call for it (the migration lock, a first connection)
    failed the start: exit 69. It is kept for the loop instead."""
    a, b, tap = pair
    tap.ready = False
    tap.send(sig)
    t0 = time.monotonic()
    with pytest.raises(Abandoned, match="no answer"):   # only its bound ends it
        wait(query(a, []), a.fileno(), 1.0, tap)
    assert time.monotonic() - t0 >= 1.0
    assert tap.drain() == {sig}


def test_which_signals_end_a_call():
    assert ends_call({signal.SIGTERM}, ready=False) and ends_call({signal.SIGINT}, ready=False)
    assert not ends_call({signal.SIGHUP, signal.SIGUSR1, signal.SIGCHLD}, ready=False)
    assert ends_call({signal.SIGHUP}, ready=True) and ends_call({signal.SIGUSR1, signal.SIGCHLD}, ready=True)
    assert not ends_call({signal.SIGCHLD}, ready=True) and not ends_call(set(), ready=True)


def test_other_signals_neither_end_the_call_nor_spin_and_are_kept(pair):
    a, b, tap = pair
    tap.send(signal.SIGCHLD)   # an agent's exit: no reason to give up a renewal in flight
    with pytest.raises(Abandoned, match="no answer"):
        wait(query(a, []), a.fileno(), 0.3, tap)
    assert tap.drains == 1   # read once, then the (empty) pipe is not ready again
    assert tap.drain() == {signal.SIGCHLD}


def test_a_peer_that_hangs_up_is_libpqs_to_report_never_a_spin(pair):
    a, b, tap = pair

    def read_answer():
        yield 1
        return a.recv(64)
    b.close()
    assert wait(read_answer(), a.fileno(), 5.0, tap) == b""   # (libpq: "server closed the connection")


def test_without_a_tap_only_the_bound_applies(pair):
    a, b, _ = pair
    with pytest.raises(Abandoned, match="no answer"):
        wait(query(a, []), a.fileno(), 0.1)
