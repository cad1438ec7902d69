"""Pure decisions of the watcher: is the driver healthy, and may it be restarted?

Nothing here touches a process, a file or a clock: every function takes what
was observed and the time as arguments, so the whole policy is unit-tested in
microseconds.

Health is judged on the watcher's *monotonic* clock, never by comparing the
heartbeat's own timestamp with the wall clock: a heartbeat is fresh when its
content (driver identity, ``seq``, ``at``) changed within ``stale_after``
seconds of monotonic time. A wall-clock jump (a heartbeat "from the future" or
from long ago), a corrupt file or a half-written one therefore never kills a
healthy driver nor keeps a hung one alive.

A driver that exits 69 (``EX_UNAVAILABLE``: a full state dir, a journal it
cannot reach) met an outage: it is started again after a back-off
(:func:`outage_backoff`), and such an exit never counts toward the start limit
(:func:`is_outage`), so an outage never makes the watcher give up.

The restart window mirrors systemd's ``StartLimitBurst`` /
``StartLimitIntervalSec``. It is persisted across restarts of the watcher and
kept in seconds since boot (:class:`Clock`), so a step of the wall
clock moves no restart into or out of it; restarts from an earlier boot are
placed by their wall time and pruned robustly against clock jumps.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, List, Mapping, Optional, Sequence, Tuple

from ringd.core.errors import EX_UNAVAILABLE
from ringd.core.records import number  # (one rule for a number read from a file)

OK = "ok"              # beating, process alive
STARTING = "starting"  # no beat from this driver yet, still within its grace period
STALE = "stale"        # alive (as far as we know) but the heartbeat stopped changing
DEAD = "dead"          # its process is gone
UNHEALTHY = (STALE, DEAD)

BeatKey = Tuple[Any, ...]


@dataclass(frozen=True)
class Clock:
    """One reading of the clocks the restart window needs: ``boot``, seconds since
    boot (CLOCK_BOOTTIME: never stepped, and it counts a suspend, as the window
    should); ``boot_id``, which boot that is; ``wall``, epoch seconds, only for the
    ISO times ringwatch.json shows."""
    boot_id: Optional[str]
    boot: float
    wall: float
PID_LIMIT = 2 ** 31   # pid_t is 32 bits: no kernel gives a pid this big (os.pidfd_open overflows)


def beat_key(hb: Any) -> Optional[BeatKey]:
    """What identifies one beat: driver identity plus sequence and time stamp.
    None for anything that is not a plausible heartbeat (corrupt, wrong shape)."""
    if not isinstance(hb, Mapping):
        return None
    pid = hb.get("pid")
    if isinstance(pid, bool) or not isinstance(pid, int) or not 0 < pid < PID_LIMIT:
        return None
    return (pid, number(hb.get("pid_start")), hb.get("seq"), hb.get("at_epoch"), hb.get("at"),
            bool(hb.get("stopped")))


def same_start(a: Optional[float], b: Optional[float]) -> bool:
    """Start ticks since boot (ringd.host.procid) are exact: equal or another process."""
    return a is not None and a == b


@dataclass(frozen=True)
class DriverView:
    """What the watcher knows about the driver it supervises.

    ``pinned``: the identity (pid + start time) is fixed - a driver we started or
    adopted; heartbeats written by any other process do not count for it.
    Not pinned ("follow"): the driver is whoever writes the heartbeat
    (``restart_command`` mode); the identity follows the newest beat.
    """
    pid: Optional[int]
    pid_start: Optional[float]
    pinned: bool
    since: float                         # monotonic: when we began watching this driver
    last_key: Optional[BeatKey] = None   # the last heartbeat seen (of anyone)
    beat_at: Optional[float] = None      # monotonic: when this driver's beat last changed
    beats: int = 0                       # changes seen from this driver


def started(pid: int, pid_start: Optional[float], hb: Any, now: float) -> DriverView:
    """A driver we have just started: the heartbeat on disk is its predecessor's,
    so it has no beat yet and gets a grace period from ``now``."""
    return DriverView(pid=pid, pid_start=pid_start, pinned=True, since=now, last_key=beat_key(hb))


def not_started(now: float) -> DriverView:
    """A driver we could not start (fork or exec failed: EAGAIN, ENOMEM, the
    interpreter gone, a log we cannot open). It is dead at once, as a child that
    exited at once: judged now (:func:`next_check`), replaced ``restart_sec``
    later under the start limit - as systemd takes an exec failure."""
    return DriverView(pid=None, pid_start=None, pinned=True, since=now)


def adopted(hb: Mapping[str, Any], now: float) -> DriverView:
    """A live driver we found running: pinned to the heartbeat's identity, and given
    the benefit of the doubt (its current beat counts as seen now) - we cannot know
    how long ago it really beat without trusting the wall clock."""
    return DriverView(pid=hb.get("pid"), pid_start=number(hb.get("pid_start")), pinned=True,
                      since=now, last_key=beat_key(hb), beat_at=now, beats=1)


def following(hb: Any, now: float, *, fresh: bool) -> DriverView:
    """Judge by the heartbeat alone. ``fresh=False`` (after a restart command, or
    at start-up with no live driver): the current file does not count, a new beat
    must appear within the grace period. ``fresh=True``: the current beat is
    taken as live now (a running driver found at start-up)."""
    key = beat_key(hb)
    if fresh and key is not None:
        return DriverView(pid=key[0], pid_start=key[1], pinned=False, since=now,
                          last_key=key, beat_at=now, beats=1)
    return DriverView(pid=None, pid_start=None, pinned=False, since=now, last_key=key)


def observe(view: DriverView, hb: Any, now: float) -> DriverView:
    """Fold one read of the heartbeat file into the view (pure)."""
    key = beat_key(hb)
    if key is None or key == view.last_key:
        return view  # unreadable, corrupt or unchanged: no news
    pid, pid_start = key[0], key[1]
    if view.pinned:
        if pid != view.pid or not same_start(pid_start, view.pid_start):
            return replace(view, last_key=key)  # another process's beat: not ours
        return replace(view, last_key=key, beat_at=now, beats=view.beats + 1)
    if pid != view.pid or not same_start(pid_start, view.pid_start):
        # a new driver took over the heartbeat (restart command): follow it
        return replace(view, pid=pid, pid_start=pid_start, last_key=key, beat_at=now, beats=1)
    return replace(view, last_key=key, beat_at=now, beats=view.beats + 1)


@dataclass(frozen=True)
class Verdict:
    health: str
    reason: str

    @property
    def unhealthy(self) -> bool:
        return self.health in UNHEALTHY


def judge(view: DriverView, *, alive: bool, now: float, stale_after: float,
          grace: Optional[float] = None) -> Verdict:
    """The driver's health. ``alive``: its process (view.pid + start time) exists
    and is not a zombie - meaningless while no identity is known. ``grace``: how
    long a new driver may take to beat first (default ``stale_after``)."""
    grace = stale_after if grace is None else grace
    if view.beat_at is None:
        if view.pinned and not alive:
            if view.pid is None:
                return Verdict(DEAD, "the driver could not be started")
            return Verdict(DEAD, f"driver (pid {view.pid}) exited before its first heartbeat")
        waited = now - view.since
        if waited > grace:
            who = f"driver (pid {view.pid})" if view.pid else "the driver"
            return Verdict(STALE, f"no heartbeat from {who} within {_s(grace)} of its start")
        return Verdict(STARTING, f"waiting for the first heartbeat ({_s(waited)} of {_s(grace)})")
    if not alive:
        return Verdict(DEAD, f"driver (pid {view.pid}) is gone")
    quiet = now - view.beat_at
    if quiet > stale_after:
        return Verdict(STALE, f"heartbeat of driver (pid {view.pid}) unchanged for {_s(quiet)} "
                              f"(stale_after {_s(stale_after)})")
    return Verdict(OK, f"driver (pid {view.pid}) beating")


def next_check(view: DriverView, *, last_poll: float, poll_interval: float,
               stale_after: float, grace: Optional[float] = None) -> float:
    """Monotonic time of the next health check: the next poll, or earlier the
    moment the driver would turn stale (so a grace period or a stale deadline
    never waits a whole extra ``poll_interval``)."""
    grace = stale_after if grace is None else grace
    if view.pinned and view.pid is None:
        return last_poll   # could not be started (not_started): dead now, no poll to wait for
    due = last_poll + poll_interval
    edge = (view.since + grace) if view.beat_at is None else (view.beat_at + stale_after)
    return min(due, edge + 1e-3) if edge + 1e-3 > last_poll else due


# --- an outage: the driver exited 69 --------------------------------------------------

OUTAGE_BACKOFF_MIN = 1.0    # s; the first wait after an outage, whatever restart_sec (0 would spin)
OUTAGE_BACKOFF_MAX = 60.0   # s; the longest wait between two tries through an outage


def is_outage(exit_code: Optional[int]) -> bool:
    """Is this exit of the driver an outage: 69, ``EX_UNAVAILABLE`` (try again
    later)? Retried after :func:`outage_backoff`; never counted toward the
    start limit, so it never makes the watcher give up."""
    return exit_code == EX_UNAVAILABLE


def outage_backoff(outages: int, restart_sec: float, cap: float = OUTAGE_BACKOFF_MAX) -> float:
    """The wait before starting the driver again after the ``outages``-th exit
    69 in a row (1 for the first): ``restart_sec`` (at least OUTAGE_BACKOFF_MIN)
    doubling with each, up to ``cap`` (or ``restart_sec``, if that is longer)."""
    base = max(restart_sec, OUTAGE_BACKOFF_MIN)
    return min(max(cap, base), base * 2.0 ** min(max(outages, 1) - 1, 64))


# --- the restart window (systemd StartLimitBurst / StartLimitIntervalSec) ---------

def prune(restarts: Sequence[Any], now: float, interval: float) -> List[float]:
    """Restart times (seconds on one clock) still inside the window ending at ``now``,
    oldest first. Non-numbers (:func:`number`) are dropped. A time in the future
    (the wall clock was set back) is clamped to ``now``: it still counts, but
    expires within ``interval`` instead of lingering for as long as the clock jump."""
    kept = []
    for t in map(number, restarts):
        if t is None:
            continue
        t = min(t, now)
        if now - t < interval:
            kept.append(t)
    return sorted(kept)


def may_restart(restarts: Sequence[Any], now: float, burst: int, interval: float) -> bool:
    """True while fewer than ``burst`` restarts happened in the last ``interval``
    seconds: the (burst+1)-th restart within the window is refused, as systemd does."""
    return len(prune(restarts, now, interval)) < burst


def record_restart(restarts: Sequence[Any], now: float, interval: float) -> List[float]:
    """The window after one more restart at ``now``."""
    return prune(list(restarts) + [now], now, interval)


def _s(seconds: float) -> str:
    return f"{seconds:.1f}s" if seconds < 100 else f"{seconds:.0f}s"


# --- the watcher's stop of its driver: one deadline in all -------------------------

@dataclass(frozen=True)
class StopPlan:
    """When each step of a stop of the driver ends (monotonic seconds). ``kill_at``:
    SIGKILL the driver then if it still lives. ``end``: everything the stop does
    - the wait after the SIGKILL, the orphaned run's reap, the state's save - is
    over by then, whatever each step's own bound: one deadline in all, so the
    stop never outlasts its service manager's (TimeoutStopSec)."""
    kill_at: float
    end: float


def stop_plan(now: float, *, grace: float, budget: float) -> StopPlan:
    """A stop begun at ``now``: the driver's ``grace`` after SIGTERM, all of it
    within ``budget``."""
    return StopPlan(kill_at=now + min(grace, budget), end=now + budget)


def stop_heard(plan: StopPlan, now: float, *, stopping: bool) -> StopPlan:
    """SIGTERM/SIGINT heard during a stop. ``stopping``: the watcher is already
    on its way out (this is a second signal): hurry - SIGKILL the driver now.
    Else (a stop to replace an unhealthy driver) the stop goes on as planned
    and the watcher exits after it."""
    return replace(plan, kill_at=min(plan.kill_at, now)) if stopping else plan


def stop_step(plan: StopPlan, now: float, killed_at: Optional[float], kill_wait: float) -> Tuple[str, float]:
    """What a stop does next, with the driver still alive: ``("kill", now)``,
    ``("wait", until)`` (for its exit, or a signal) or ``("give up", now)`` (it
    survived SIGKILL for ``kill_wait``, or the plan ran out)."""
    if killed_at is None:
        return ("kill", now) if now >= plan.kill_at else ("wait", plan.kill_at)
    until = min(killed_at + kill_wait, plan.end)
    return ("give up", now) if now >= until else ("wait", until)


def left(plan: Optional[StopPlan], now: float, bound: float, least: float = 0.0) -> float:
    """A wait's own ``bound``, cut to what is left of the stop's plan (no plan:
    the bound), never below ``least``."""
    if plan is None:
        return bound
    return max(least, min(bound, plan.end - now))
