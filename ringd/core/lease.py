"""Leadership of a many-host ring: pure decisions about the lease.

The lease is one row in PostgreSQL (holder, epoch, expiry on the server's
clock); the SQL that reads and writes it lives in ``journal_pg``. Here are
only the decisions, functions of (lease row, me, the server's now) and of a
local clock, unit-tested without a database:

- ``decide``: at each beat, take, renew, or wait as a standby.
- ``must_stop``: the leader's own dead man's switch. Its lease is good on the
  server until ``sent + ttl`` at the earliest (the server computed the expiry
  after the renewal was sent), so a leader that has not renewed for half the
  TTL on its own clock stops its agent while its lease is still surely valid:
  no other host can be leading yet. Measured on CLOCK_BOOTTIME (monotonic,
  and it keeps counting while the box is suspended), never the wall clock.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

TAKE, RENEW, WAIT = "take", "renew", "wait"
NOBODY = "nobody (the lease row was deleted)"   # the holder of a lease row made again


@dataclass(frozen=True)
class LeaseRow:
    holder: Optional[str]        # "host pid=N start=TICKS", None once released
    epoch: int                   # the fencing token: +1 at every change of hands
    expires_at: Optional[float]  # server epoch seconds


@dataclass(frozen=True)
class Decision:
    action: str                  # TAKE | RENEW | WAIT
    epoch: int                   # my epoch after the action (WAIT: the holder's)
    previous: Optional[str]      # TAKE: the holder whose lease lapsed (None: free or released)
    retry_in: float              # WAIT: seconds until the lease can lapse (server clock)


def decide(row: Optional[LeaseRow], me: str, my_epoch: Optional[int], server_now: float,
           my_expires_at: Optional[float] = None) -> Decision:
    """What to do with the lease at this beat. ``my_expires_at``: when the lease
    of ``my_epoch`` expires (server epoch seconds, as the server set it)."""
    if row is None or row.holder is None:
        return Decision(TAKE, (row.epoch if row else 0) + 1, None, 0.0)
    expired = row.expires_at is None or server_now >= row.expires_at
    if row.holder == NOBODY and not expired and my_epoch is not None and my_expires_at is not None \
            and server_now < my_expires_at:
        # The row made again (dropped or deleted by hand) while my own lease is good
        # on the server's clock: nobody else can have led since, so it is mine at once
        # (a new epoch, above both), and my run goes on.
        return Decision(TAKE, max(row.epoch, my_epoch) + 1, None, 0.0)
    if row.holder == me and row.epoch == my_epoch and not expired:
        return Decision(RENEW, row.epoch, None, 0.0)
    if expired:
        # Taking over from a lapsed holder, our own earlier lease included: a new
        # epoch fences off every write the lapsed holder might still attempt.
        return Decision(TAKE, row.epoch + 1, row.holder, 0.0)
    return Decision(WAIT, row.epoch, None, max(0.0, row.expires_at - server_now))


def must_stop(renew_sent_at: Optional[float], ttl: float, now: float) -> bool:
    """A leader whose last successful renewal was sent at ``renew_sent_at``
    (local CLOCK_BOOTTIME) must stop its agent and its writes at ``now``."""
    return renew_sent_at is None or now >= renew_sent_at + ttl / 2


def stop_deadline(renew_sent_at: float, ttl: float) -> float:
    return renew_sent_at + ttl / 2


# Five beats per TTL, and a call bounded at one beat (pgcall.call_bound): a renewal
# that fails, at once or after its whole bound, is followed by another at most two
# beats after the last good one, a tenth of the TTL before the half-TTL switch.
# (At four, that retry came due exactly at the switch, and one failed renewal
# stopped a healthy leader.)
BEATS_PER_TTL = 5


def beat_every(ttl: float, heartbeat_interval: float) -> float:
    """How often a PostgreSQL driver beats (and renews): so often that a renewal
    after one failed renewal still comes before the half-TTL switch."""
    return min(heartbeat_interval, ttl / BEATS_PER_TTL)


def retry_margin(ttl: float, heartbeat_interval: float) -> float:
    """How long before the half-TTL switch the renewal after one failed renewal
    comes due at the latest (the failed one sent a beat after the last good
    one, and took its whole bound, ``pgcall.call_bound``)."""
    return ttl / 2 - beat_every(ttl, heartbeat_interval) - ttl / BEATS_PER_TTL


def holder_name(host: str, pid: int, start_ticks: Optional[int]) -> str:
    """Who holds the lease: host, pid and the process's boot-relative start ticks
    (a pid alone repeats; the pair names one process of one boot)."""
    return f"{host} pid={pid} start={start_ticks if start_ticks is not None else '?'}"


def holder_host(holder: Optional[str]) -> Optional[str]:
    return holder.split(" ", 1)[0] if holder else None
