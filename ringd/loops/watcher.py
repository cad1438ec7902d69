"""The watcher's loop: keep one healthy driver alive, or give up loudly.

It sleeps in one wait (its env's: a ``poll(2)`` on the signal self-pipe and the
driver's pidfd), with a timeout equal to the next health check
(``poll_interval``, or earlier when the driver's grace period or heartbeat would
run out) or the next systemd watchdog ping. A driver it started is noticed the
moment it exits. Every decision is taken by ``ringd.core.watchpolicy``; every
effect - a clock, a signal, a process, a file, sd_notify - goes through its
env (``ringd.host.seam.WatcherEnv``: ``ringd.host.watchenv.RealWatcherEnv``, or
the tests' fake on a scripted clock). This module only decides what to ask.

Exit codes: 0 stopped by SIGTERM/SIGINT; 70 gave up (start limit hit, now or
earlier - see ``ringwatch reset``); 75 another watcher holds the lock; 78 a
configuration error (its own, or the driver exited 78). A driver that exits 69
(an outage) is started again after a back-off, outside the start limit.
"""
from __future__ import annotations

import contextlib
import signal
from dataclasses import replace
from pathlib import Path
from typing import Any, Dict, Iterable, Optional, Set

from ringd.core import events
from ringd.core import watchpolicy
from ringd.core.levels import ERR, INFO, WARNING
from ringd.core.errors import EX_CONFIG as EXIT_CONFIG
from ringd.core.errors import EX_OK as EXIT_OK
from ringd.core.errors import EX_SOFTWARE as EXIT_GAVE_UP  # the start limit was hit
from ringd.core.errors import EX_TEMPFAIL as EXIT_LOCKED  # another watcher holds the lock
from ringd.core.errors import RingError
from ringd.core.timefmt import iso
from ringd.host.alerts import longest as alert_longest
from ringd.host.cgroup import KILL_WAIT as RUN_KILL_WAIT
from ringd.host.driverproc import DRIVER_LOG, KILL_WAIT
from ringd.host.seam import WatcherEnv
from ringd.host.watchstate import (GAVE_UP_FILE, LOCK_FILE, WRITE_LOCK_WAIT, encode_restarts, reset_fields,
                                   restart_times, state_path)
from ringd.inputs.config import Config, ConfigError, load_config


STOP_GRACE = 10.0       # s; SIGTERM -> SIGKILL for the driver (its own agent grace is 3 s)
# The whole of a stop of the driver - its grace, the wait after the SIGKILL, the
# reap of the run it left, ringwatch.json's save - shares this one deadline
# (watchpolicy.StopPlan): each step had a bound of its own (10 + 5 + the orphan's kill
# 5 + the journal's busy timeout 10 + the write lock 10 s), past the unit's
# TimeoutStopSec (ringd.cli.service.STOP_GRACE_WATCHER, 30 s): systemd's SIGKILL landed mid-reap.
STOP_BUDGET = 20.0
# At the watcher's own stop the orphan's reap waits this long for the journal's
# write lock (the orphan's kill comes first, without it): the next driver and
# `ringd status` close an orphaned row anyway.
REAP_BUSY_AT_STOP = 1.0  # s
SAVE_LOCK_AT_STOP = 1.0  # s; ringwatch.json's write lock, at the stop's end (a live holder lets go in ms)
COMMAND_TIMEOUT = 120.0  # s; a restart_command still running after this is killed
COMMAND_KILL_WAIT = 3.0  # s; a restart_command SIGKILL has not ended by then is left behind
STOP_SIGNALS = frozenset({signal.SIGTERM, signal.SIGINT})
FOLLOW_MIN = 0.2        # s; STATUS= looks at the heartbeat at most this often (a tiny heartbeat_interval)


class Stop(Exception):
    """SIGTERM/SIGINT arrived while waiting: unwind to a clean shutdown."""


class Watcher:
    def __init__(self, state_dir: Path, config_path: Optional[Path], config: Config,
                 env: Optional[WatcherEnv] = None):
        if env is None:
            from ringd.host.watchenv import RealWatcherEnv
            env = RealWatcherEnv(state_dir, config_path)
        self.env = env
        self.log = env.log
        self.state_dir = state_dir
        self._unsaved: Optional[Dict[str, Any]] = None  # state we could not write (full disk)
        self.config_path = config_path
        self.config = config
        self.proc: Any = None                           # the driver's handle (the env's), if we hold one
        self.view: Optional[watchpolicy.DriverView] = None
        self.stop_signal: Optional[int] = None
        self.last_poll = 0.0
        self.last_status = ""
        self.next_ping = 0.0
        self.next_follow = 0.0   # monotonic: when STATUS= next looks at the driver's heartbeat
        self.lock_lost = False
        self.plan: Optional[watchpolicy.StopPlan] = None   # the stop of the driver under way
        self.stops_heard = 0                          # SIGTERM/SIGINT deliveries heard
        self.outages = 0                              # the driver's exits 69 in a row (watchpolicy.is_outage)
        self._deferred: Set[int] = set()              # other signals heard outside _wait

    @property
    def w(self):
        return self.config.watch

    @property
    def command_mode(self) -> bool:
        return self.w.restart_command is not None

    # --- entry point -----------------------------------------------------------
    def run(self) -> int:
        env = self.env
        env.prepare()
        env.lock()
        try:
            self._refuse_if_given_up()
            env.listen()
            try:
                return self._run()
            finally:
                env.close()
                if self.proc is not None:
                    env.close_driver(self.proc)
        finally:
            env.unlock()

    def _refuse_if_given_up(self) -> None:
        data = self.env.load_state()
        if self.env.gave_up(data):
            raise RingError(
                f"gave up at {data.get('gave_up_at') or 'an earlier run'} "
                f"({data.get('gave_up_reason') or 'start limit hit'}); not starting the driver. "
                f"Fix the cause, then run: ringwatch reset --state {self.state_dir}", EXIT_GAVE_UP)

    def _run(self) -> int:
        env = self.env
        self._save(**env.whose(), pid=env.pid, pid_start=env.pid_start,
                   started_at=iso(env.wall()), stopped=False, gave_up=False,
                   mode="restart_command" if self.command_mode else "owner")
        for warning in self._warnings():
            self.log(f"warning: {warning}", WARNING)
        try:
            self._first_driver()
            env.notify("READY=1")
            while True:
                code = self._check()
                if code is not None:
                    return code
                self._wait(self._next_check_at(), self._fds(), follow=True)
        except Stop:
            return self._shutdown()

    def _warnings(self):
        return list(self.config.warnings)   # the config's own (config.parse_config), as ringd check says them

    # --- start-up -------------------------------------------------------------
    def _first_driver(self) -> None:
        env = self.env
        now = env.monotonic()
        hb = env.heartbeat()
        live = env.live_driver(hb)
        mode = f"restart_command {list(self.w.restart_command)}" if self.command_mode else "owner"
        self.log(f"watching {self.state_dir} (pid {env.pid}, mode {mode}, "
                 f"poll {self.w.poll_interval}s, stale after {self.w.stale_after}s)", INFO)
        if live is not None:
            proc = env.adopt(*live)
            if proc is not None:
                self.proc = proc
                self.view = watchpolicy.following(hb, now, fresh=True) if self.command_mode \
                    else watchpolicy.adopted(hb, now)
                self.log(f"driver already running (pid {proc.pid}); watching it", INFO)
                return
        if self.command_mode:
            self.view = watchpolicy.following(hb, now, fresh=False)
            self.log(f"no live driver yet; waiting up to {self.w.stale_after}s for one to beat "
                     f"before running the restart command", INFO)
            return
        self._start_driver("initial start")

    # --- one health check ---------------------------------------------------------
    def _check(self) -> Optional[int]:
        now = self.env.monotonic()
        self.last_poll = now
        self._check_lock()
        hb = self.env.heartbeat()
        self.view = watchpolicy.observe(self.view, hb, now)
        code = self._child_exit(hb, now)
        if code is not None:
            return code
        self._sync_proc()
        verdict = watchpolicy.judge(self.view, alive=self._alive(), now=now, stale_after=self.w.stale_after)
        self._save(last_poll_at=iso(self.env.wall()),
                   driver={"pid": self.view.pid, "pid_start": self.view.pid_start,
                           "health": verdict.health})
        self._status(self._driver_status(verdict, hb))
        if verdict.health == watchpolicy.OK:
            self.outages = 0   # (beating: an outage from now on is a new one)
        if verdict.unhealthy:
            return self._replace(verdict)
        return None

    def _check_lock(self) -> None:
        """ringwatch.lock removed or replaced under us: lock it again, so a second
        watcher is refused by the kernel lock (it also finds us in ringwatch.json)."""
        verdict = self.env.verify_lock()
        path = self.state_dir / LOCK_FILE
        if verdict == "retaken":
            self.log(f"{path} was removed or replaced; locked it again", WARNING)
        elif verdict == "lost" and not self.lock_lost:
            self.log(f"{path} was replaced and another process holds its lock; watching on", WARNING)
        self.lock_lost = verdict == "lost"

    def _child_exit(self, hb: Any, now: float) -> Optional[int]:
        """Handle the exit of a driver we started. Returns an exit code to quit with."""
        proc = self.proc
        code = self.env.driver_exit(proc) if proc is not None and proc.ours else None
        if code is None:
            return None
        why = self.env.driver_log_tail()
        detail = f" ({why})" if why else ""
        if code == EXIT_CONFIG:
            self.log(f"driver (pid {proc.pid}) exited 78, a configuration error{detail}; not restarting it. "
                     f"Fix the configuration (ringd check), then start ringwatch again", ERR)
            self._status("driver configuration error")
            self._save(driver={"pid": proc.pid, "pid_start": proc.start_time, "health": "config-error"},
                       stopped=True)
            self._reap_orphan()   # a run its predecessor left behind must not run on unsupervised
            return EXIT_CONFIG
        if code == EXIT_LOCKED:
            self.log(f"driver (pid {proc.pid}) exited 75: another driver holds ringd.lock{detail}; "
                     f"watching that one by its heartbeat", WARNING)
            self.proc = None
            self.view = watchpolicy.following(hb, now, fresh=False)
            return None
        if watchpolicy.is_outage(code):
            self._after_outage(proc, detail)
            return None
        how = f"was killed by signal {-code}" if code < 0 else f"exited {code}"
        self.log(f"driver (pid {proc.pid}) {how}{detail}", WARNING)
        return None

    def _after_outage(self, proc: Any, detail: str) -> None:
        """The driver exited 69: what it needs cannot be used now (a full state
        dir, a journal it cannot reach). Not a failure of the driver: start it
        again after a back-off (watchpolicy.outage_backoff), never counted
        toward the start limit, as long as the outage lasts."""
        self.outages += 1
        delay = watchpolicy.outage_backoff(self.outages, self.w.restart_sec)
        self.log(f"driver (pid {proc.pid}) exited 69, an outage{detail}; starting it again in {delay:g}s "
                 f"(an outage never counts toward the start limit)", WARNING)
        self._status(f"driver unavailable (exit 69); starting it again in {delay:g}s")
        self.env.close_driver(proc)
        self.proc = None
        self._sleep(self.env.monotonic() + delay)
        self._start_driver(f"after an outage ({self.outages} exit(s) 69 in a row)")

    def _sync_proc(self) -> None:
        """Keep ``self.proc`` (the pidfd we sleep on) on the driver the view names."""
        view, env = self.view, self.env
        if self.proc is not None and not self.proc.ours and not env.driver_alive(self.proc):
            env.close_driver(self.proc)       # an adopted driver died: its pidfd stays readable
            self.proc = None
        if view.pid and view.beat_at is not None and (self.proc is None or self.proc.pid != view.pid):
            if self.proc is not None and not self.proc.ours:
                env.close_driver(self.proc)
                self.proc = None
            if self.proc is None:
                self.proc = env.adopt(view.pid, view.pid_start)

    def _alive(self) -> bool:
        if self.proc is not None and self.proc.pid == self.view.pid:
            return self.env.driver_alive(self.proc)
        return self.env.same_process(self.view.pid, self.view.pid_start)

    def _next_check_at(self) -> float:
        return watchpolicy.next_check(self.view, last_poll=self.last_poll,
                                 poll_interval=self.w.poll_interval, stale_after=self.w.stale_after)

    def _fds(self):
        return [self.proc.fd] if self.proc is not None and self.proc.fd is not None else []

    # --- replacing an unhealthy driver ---------------------------------------------
    def _replace(self, verdict: watchpolicy.Verdict) -> Optional[int]:
        env = self.env
        self.log(f"driver unhealthy ({verdict.health}): {verdict.reason}", WARNING)
        old = self._old_proc()
        if old is not None and not env.driver_alive(old):
            env.driver_exit(old)
            env.close_driver(old)
            old = None
        if old is not None and not self.command_mode:
            self._stop(old, "unhealthy")
        self._sleep(env.monotonic() + self.w.restart_sec)
        # Decide and record in one hold of the write lock: a `ringwatch reset`
        # lands before the decision (which then sees no history) or after the
        # record (which it clears), never in between to be written over.
        with self._write_lock():
            data = self._load()
            clock = env.clock()
            now = clock.boot   # the window is on the boot clock: a stepped wall clock moves nothing
            window = watchpolicy.prune(restart_times(data, clock), now, self.w.start_limit_interval)
            give_up = not watchpolicy.may_restart(window, now, self.w.start_limit_burst, self.w.start_limit_interval)
            if give_up:
                reason = (f"{len(window)} restarts within {self.w.start_limit_interval}s "
                          f"(start_limit_burst {self.w.start_limit_burst}); last: {verdict.reason}")
                self._write(data, gave_up=True, gave_up_at=iso(env.wall()), gave_up_reason=reason,
                            stopped=True)
            else:
                window = watchpolicy.record_restart(window, now, self.w.start_limit_interval)
                self._write(data, **encode_restarts(window, clock))
        if give_up:
            if old is not None and self.command_mode:
                self._stop(old, "unhealthy")
            return self._give_up(reason)
        n = f"restart {len(window)}/{self.w.start_limit_burst} within {self.w.start_limit_interval}s"
        if self.command_mode:
            self._run_restart_command(n)
            if old is not None and env.driver_alive(old):
                self.log(f"old driver (pid {old.pid}) survived the restart command; stopping it", WARNING)
                self._stop(old, "survived restart command")
        else:
            self._start_driver(n)
        self.on_event(events.DRIVER_REPLACED, f"{verdict.reason}; {n}")
        return None

    def on_event(self, kind: str, detail: str) -> Optional[int]:
        """Log the event and run the operator's alert command (detached, time-limited).
        The alert helper's pid, or None if none was started."""
        self.log(f"event: {kind}: {detail}", WARNING)
        return self.env.fire_alert(self.config.alerts.command, kind, detail, self.config.alerts.timeout)

    def _old_proc(self) -> Any:
        view = self.view
        if self.proc is not None and self.proc.pid == view.pid:
            return self.proc
        if view.pid and self.env.same_process(view.pid, view.pid_start):
            return self.env.adopt(view.pid, view.pid_start)
        return None

    def _stop(self, proc: Any, why: str, plan: Optional[watchpolicy.StopPlan] = None) -> str:
        """Stop ``proc`` within ``plan`` (the shutdown's; else one of its own),
        hearing the watcher's signals all along: a SIGTERM/SIGINT while the
        watcher is already stopping SIGKILLs the driver at once."""
        own = plan is None
        self.plan = plan or watchpolicy.stop_plan(self.env.monotonic(), grace=STOP_GRACE, budget=STOP_BUDGET)
        self.log(f"stopping driver (pid {proc.pid}, {why}): SIGTERM, SIGKILL after {STOP_GRACE}s "
                 f"(or at a second SIGTERM)", INFO)
        self._status(f"stopping driver pid {proc.pid}")
        try:
            how = self._end_driver(proc)
            self.log(f"driver (pid {proc.pid}) {how}", WARNING if how in ("killed", "survived") else INFO)
            if how in ("killed", "survived"):
                self._reap_orphan()
        finally:
            if own:
                self.plan = None
        self.env.close_driver(proc)
        if proc is self.proc:
            self.proc = None
        return how

    def _end_driver(self, proc: Any) -> str:
        """SIGTERM + SIGCONT (a SIGSTOPped driver must run to handle SIGTERM),
        SIGKILL at ``self.plan.kill_at``, then wait up to KILL_WAIT, all within
        ``self.plan.end`` (watchpolicy.stop_step). The plan is looked at again
        after each pause, which hears the watcher's signals: a second SIGTERM
        hurries it (watchpolicy.stop_heard). Returns how it ended: ``gone``
        (already), ``terminated`` or ``killed``; ``survived`` if even SIGKILL
        did not end it (a process in uninterruptible sleep)."""
        env = self.env
        if not env.driver_alive(proc):
            env.driver_exit(proc)
            return "gone"
        env.signal_driver(proc, signal.SIGTERM)
        env.signal_driver(proc, signal.SIGCONT)
        killed_at: Optional[float] = None
        while True:
            if (proc.ours and env.driver_exit(proc) is not None) or not env.driver_alive(proc):
                return "terminated" if killed_at is None else "killed"
            now = env.monotonic()
            what, until = watchpolicy.stop_step(self.plan, now, killed_at, KILL_WAIT)
            if what == "kill":
                env.signal_driver(proc, signal.SIGKILL)
                killed_at = now
            elif what == "give up":
                return "survived"
            else:
                self._stop_pause(until, [proc.fd] if proc.fd is not None else [])

    def _start_driver(self, why: str) -> None:
        env = self.env
        try:
            proc = env.start_driver()
        except OSError as e:
            # e.g. the interpreter vanished (upgrade in progress), EAGAIN, ENOMEM:
            # judged dead at once and retried restart_sec later under the start
            # limit (watchpolicy.not_started), never a tight loop
            where = f" ({e.filename})" if getattr(e, "filename", None) else ""
            self.log(f"cannot start the driver: {env.errno_reason(e)}{where}", ERR)
            self.proc = None
            self.view = watchpolicy.not_started(env.monotonic())
            return
        self.proc = proc
        self.view = watchpolicy.started(proc.pid, proc.start_time, env.heartbeat(), env.monotonic())
        self.log(f"started driver (pid {proc.pid}; {why}), output in {self.state_dir / 'logs' / DRIVER_LOG}",
                 INFO)
        self._status(f"started driver pid {proc.pid}")

    def _run_restart_command(self, why: str) -> None:
        env = self.env
        argv = list(self.w.restart_command)
        self.log(f"running restart command {argv} ({why})", INFO)
        self._status(f"running restart command ({why})")
        hb = env.heartbeat()
        try:
            cmd = env.run_command(argv)
        except OSError as e:
            self.log(f"restart command {argv[0]!r} cannot be started: {env.errno_reason(e)}", ERR)
        else:
            self._wait_command(cmd, argv)
        if self.proc is not None and not self.proc.ours:
            env.close_driver(self.proc)
        self.proc = None
        self.view = watchpolicy.following(hb, env.monotonic(), fresh=False)

    def _wait_command(self, cmd: Any, argv) -> None:
        env = self.env
        deadline = env.monotonic() + COMMAND_TIMEOUT
        try:
            while env.command_exit(cmd) is None and env.monotonic() < deadline:
                try:
                    self._wait(deadline, [cmd.fd] if cmd.fd is not None else [], wake_on_child=True)
                except Stop:
                    self._kill_command(cmd)
                    raise
            if env.command_exit(cmd) is None:
                self.log(f"restart command {argv} still running after {COMMAND_TIMEOUT}s; killing it", ERR)
                self._kill_command(cmd)
                return
        finally:
            env.close_command(cmd)
        code = env.command_exit(cmd)
        if code != 0:
            self.log(f"restart command {argv} exited {code}; judging by the heartbeat anyway", WARNING)

    def _kill_command(self, cmd: Any) -> None:
        """SIGKILL the restart command's group, waiting COMMAND_KILL_WAIT at most
        for it to end (RealWatcherEnv.kill_command)."""
        if not self.env.kill_command(cmd, COMMAND_KILL_WAIT):
            self.log(f"restart command (pid {cmd.pid}) did not die of SIGKILL within {COMMAND_KILL_WAIT}s; "
                     f"leaving it behind", ERR)

    # --- giving up, shutting down ---------------------------------------------------
    def _give_up(self, reason: str) -> int:
        """After the give-up is recorded (_replace): say so, clean up, alert."""
        self.log(f"GIVING UP: the driver keeps failing: {reason}. Not restarting it again. "
                 f"Look at {self.state_dir / 'logs' / DRIVER_LOG} and `ringd status`, fix the cause, "
                 f"then run `ringwatch reset --state {self.state_dir}` and start ringwatch again.", ERR)
        if self._unsaved is not None:   # the give-up is not in ringwatch.json (a full disk)
            try:
                self.env.mark_gave_up()
                self.log(f"cannot write {state_path(self.state_dir)}; the give-up is recorded in "
                         f"{self.state_dir / GAVE_UP_FILE} instead", ERR)
            except OSError as e:
                self.log(f"THE GIVE-UP IS NOT RECORDED: cannot write {state_path(self.state_dir)} nor "
                         f"create {self.state_dir / GAVE_UP_FILE} ({e.strerror}); a ringwatch started "
                         f"again will start the driver again, with no restart history", ERR)
        self._reap_orphan()
        self._status("gave up: start limit hit; run `ringwatch reset`")
        self._await_alert(self.on_event(events.WATCHER_GAVE_UP, reason))
        return EXIT_GAVE_UP

    def _await_alert(self, pid: Optional[int]) -> None:
        """Wait (bounded: alerts.longest) for the alert helper ``pid`` to end. The
        give-up alert is the one a human must get, and once we exit the service
        manager stops the unit: systemd (KillMode=control-group) kills what is
        left in its cgroup, the alert's mail or webhook with it. The watchdog
        is still pinged meanwhile; SIGTERM/SIGINT end the wait."""
        if pid is None:
            return
        env = self.env
        fd = env.pidfd(pid)
        deadline = env.monotonic() + alert_longest(self.config.alerts.timeout)
        try:
            while env.monotonic() < deadline:
                if env.helper_ended(pid):
                    return
                self._wait(deadline, [fd] if fd is not None else [], wake_on_child=True)
            self.log(f"alert helper (pid {pid}) still running; exiting without it", WARNING)
        except Stop:
            self.log(f"exiting before the alert helper (pid {pid}) ended", WARNING)
        finally:
            if fd is not None:
                env.close_fd(fd)

    def _shutdown(self) -> int:
        env = self.env
        name = signal.Signals(self.stop_signal).name if self.stop_signal else "signal"
        env.notify("STOPPING=1")
        # one deadline for all of it: the driver's stop, its run's reap, the save below
        self.plan = watchpolicy.stop_plan(env.monotonic(), grace=STOP_GRACE, budget=STOP_BUDGET)
        if self.command_mode:
            self.log(f"{name}: exiting; the driver belongs to the service manager and keeps running", INFO)
        else:
            proc = self._old_proc() if self.view is not None else None
            if proc is not None and env.driver_alive(proc):
                self.log(f"{name}: stopping the driver (pid {proc.pid}) and exiting", INFO)
                self._stop(proc, name, self.plan)
            else:
                self.log(f"{name}: exiting (no driver running)", INFO)
                if proc is not None:
                    env.driver_exit(proc)
        self._save(stopped=True, lock_wait=watchpolicy.left(self.plan, env.monotonic(), SAVE_LOCK_AT_STOP, 0.2))
        return EXIT_OK

    def _reap_orphan(self) -> None:
        """The driver died without stopping its agent and no driver will follow
        soon: close the orphaned run as ``interrupted`` and kill what is left of it
        (the same reaper ``ringd status`` runs). Within the stop's plan, if one is
        under way; the journal's write lock waited for briefly at the watcher's
        own stop (REAP_BUSY_AT_STOP), and never past a SIGTERM/SIGINT heard
        meanwhile - that row is closed by the next driver or ``ringd status``."""
        from ringd.journal.sqlite import BUSY_TIMEOUT, Journal   # (sqlite3: only when there is a run to reap)
        from ringd.loops.reaper import reap
        now = self.env.monotonic()
        busy = watchpolicy.left(self.plan, now, REAP_BUSY_AT_STOP if self.stop_signal else BUSY_TIMEOUT, 0.1)
        kill_by = None if self.plan is None else min(now + RUN_KILL_WAIT, self.plan.end)
        try:
            journal = Journal.open(self.state_dir, create=False, busy_timeout=busy,
                                   give_up=self._told_to_stop())
        except Exception as e:  # noqa: BLE001 - no journal yet, or unusable: nothing to reap
            if "no journal" not in str(e):
                self.log(f"cannot reap the driver's last run: {e}", ERR)
            return
        try:
            reap(journal, self.state_dir, self.config, log=self.log, kill_by=kill_by)
        except Exception as e:  # noqa: BLE001 - best effort; `ringd status` reaps too
            self.log(f"cannot reap the driver's last run: {e}", ERR)
        finally:
            journal.close()

    # --- waiting, signals, sd_notify, ringwatch.json ---------------------------------
    def _wait(self, until: float, fds: Iterable[int] = (), wake_on_child: bool = False,
              follow: bool = False) -> Set[int]:
        """Sleep until ``until`` (monotonic), a ready fd, or a signal; ping the
        systemd watchdog on the way. SIGTERM/SIGINT raise :class:`Stop`; SIGHUP
        reloads the configuration; SIGUSR1 (like SIGHUP) ends the wait, so the
        loop checks the driver at once. ``follow`` (the loop's wait between two
        checks): under systemd, look at the heartbeat once a heartbeat interval
        so STATUS= follows the driver (:meth:`_follow`). Returns the ready fds
        (empty on timeout)."""
        every = self._follow_every() if follow else None
        while True:
            if self.stop_signal:
                raise Stop()   # heard outside a wait (a stop, a lock's wait)
            if self._deferred:
                self.env.put_back(self._deferred)   # heard outside a wait: handled now
                self._deferred = set()
            now = self.env.monotonic()
            self._ping(now)
            left = until - now
            if self.env.watchdog_every:
                left = min(left, self.next_ping - now)
            if every is not None:
                if now >= self.next_follow:
                    self._follow(now)
                    self.next_follow = now + every
                left = min(left, self.next_follow - now)
            sigs, ready = self.env.wait(max(0.0, left), fds)
            self._signals(sigs)
            if ready or (wake_on_child and signal.SIGCHLD in sigs) or self.env.monotonic() >= until:
                return ready
            if sigs - {signal.SIGCHLD} or (signal.SIGCHLD in sigs and self._child_exited()):
                return ready

    def _sleep(self, until: float) -> None:
        """Wait until ``until`` whatever wakes us (SIGTERM still interrupts)."""
        while self.env.monotonic() < until:
            self._wait(until)

    def _stop_pause(self, until: float, fds: Iterable[int]) -> None:
        """The wait of a stop of the driver (:meth:`_end_driver`): until ``until``,
        the driver's exit or a signal, pinging the watchdog; the signals go to :meth:`_take`."""
        now = self.env.monotonic()
        self._ping(now)
        left = until - now
        if self.env.watchdog_every:
            left = min(left, self.next_ping - now)
        fds = list(fds)
        if not fds:
            left = min(left, 0.05)   # no pidfd (an adopted driver, an old kernel): look again soon
        sigs, _ = self.env.wait(max(0.0, left), fds)
        self._take(sigs)

    def _take(self, sigs: Set[int]) -> None:
        """Signals heard outside :meth:`_wait` (a stop of the driver, a lock's
        wait). SIGTERM/SIGINT are counted and recorded - the watcher exits once
        it is through - and hurry a stop already on its way out
        (watchpolicy.stop_heard); the others are handled at the next wait."""
        stop = sigs & STOP_SIGNALS
        if stop:
            if self.plan is not None:
                hurried = watchpolicy.stop_heard(self.plan, self.env.monotonic(),
                                                 stopping=self.stop_signal is not None)
                if hurried != self.plan:
                    self.log(f"{signal.Signals(min(stop)).name} again: killing the driver now", WARNING)
                self.plan = hurried
            self.stop_signal = self.stop_signal or min(stop)
            self.stops_heard += 1
        self._deferred |= sigs - stop

    def _told_to_stop(self):
        """A ``give_up`` for a lock's wait: true once a SIGTERM/SIGINT arrives
        after now (looked for without waiting)."""
        heard = self.stops_heard

        def give_up() -> bool:
            self._take(self.env.signals())
            return self.stops_heard > heard
        return give_up

    def _child_exited(self) -> bool:
        return self.proc is not None and self.proc.ours and self.env.driver_exit(self.proc) is not None

    def _signals(self, sigs: Set[int]) -> None:
        for sig in sigs:
            if sig in (signal.SIGTERM, signal.SIGINT):
                self.stop_signal = sig
        if self.stop_signal:
            raise Stop()
        if signal.SIGHUP in sigs:
            self._reload()

    def _reload(self) -> None:
        """SIGHUP: pass it on to the driver we own (first: the driver reads its
        config itself and says what it made of it, whatever ours does), re-read
        our config, and record the reload in ringwatch.json (``ringd reload``)."""
        if not self.command_mode and self.proc is not None and self.env.driver_alive(self.proc):
            self.env.signal_driver(self.proc, signal.SIGHUP)
        error = None
        try:
            config = load_config(self.config_path)
        except ConfigError as e:
            error = str(e)
            self.log(f"SIGHUP: configuration not reloaded, keeping the previous one: {e}", ERR)
        else:
            if config.watch.restart_command != self.w.restart_command:
                self.log("SIGHUP: watch.restart_command changed; the deployment mode only changes "
                         "when ringwatch is restarted - keeping the current one", WARNING)
                config = replace(config, watch=replace(config.watch, restart_command=self.w.restart_command))
            self.config = config
            for warning in self._warnings():
                self.log(f"warning: {warning}", WARNING)
            self.log("SIGHUP: configuration reloaded", INFO)
        last = self._load().get("reload")
        seq = last.get("seq") if isinstance(last, dict) else None
        seq = seq + 1 if isinstance(seq, int) and not isinstance(seq, bool) and 0 <= seq < 2 ** 53 else 1
        self._save(reload={"seq": seq, "at": iso(self.env.wall()), "error": error})

    def _follow_every(self) -> Optional[float]:
        """How often STATUS= looks at the heartbeat: once a heartbeat interval (not
        under 0.2 s), only when a service manager listens - else never."""
        if not self.env.notifying or self.view is None:
            return None
        return max(self.config.ring.heartbeat_interval, FOLLOW_MIN)

    def _follow(self, now: float) -> None:
        """Fold a read of the heartbeat into the view (watchpolicy.observe: it only
        notes beats) and say the driver's state in STATUS=; acting on it is the
        next check's."""
        hb = self.env.heartbeat()
        self.view = watchpolicy.observe(self.view, hb, now)
        verdict = watchpolicy.judge(self.view, alive=self._alive(), now=now, stale_after=self.w.stale_after)
        self._status(self._driver_status(verdict, hb))

    def _driver_status(self, verdict: watchpolicy.Verdict, hb: Any) -> str:
        """``driver ok (pid 42): lap 3: running web``: the verdict, and what the
        driver last said it does (its heartbeat's ``status``) when the beat is its."""
        text = f"driver {verdict.health}" + (f" (pid {self.view.pid})" if self.view.pid else "")
        said = hb.get("status") if isinstance(hb, dict) and hb.get("pid") == self.view.pid else None
        if isinstance(said, str) and said and verdict.health == watchpolicy.OK:
            text += f": {' '.join(said.split())[:200]}"
        return text

    def _ping(self, now: float) -> None:
        every = self.env.watchdog_every
        if every and now >= self.next_ping:
            self.env.notify("WATCHDOG=1")
            self.next_ping = now + every

    def _status(self, text: str) -> None:
        if text != self.last_status:
            self.last_status = text
            self.env.notify(f"STATUS={text}")

    @contextlib.contextmanager
    def _write_lock(self, wait: float = WRITE_LOCK_WAIT):
        """ringwatch.json's write lock (watchstate.write_lock) around one
        read-modify-write of it. One we cannot take (a stopped reset holding it)
        must not stop the watching: go on without it, and say so. A
        SIGTERM/SIGINT ends the wait too."""
        with contextlib.ExitStack() as stack:
            try:
                stack.enter_context(self.env.state_lock(wait, self._told_to_stop()))
            except (RingError, OSError) as e:
                self.log(f"writing {state_path(self.state_dir)} without its lock: {e}", WARNING)
            yield

    def _load(self) -> Dict[str, Any]:
        """Our state: the file, or what we could not write to it (full disk). A
        ``ringwatch reset`` made since we last wrote (the file's ``reset_gen``
        moved) clears the history we keep in memory too: it is never undone."""
        data = self.env.load_state()
        if self._unsaved is None:
            return data
        mem = dict(self._unsaved)
        gen = data.get("reset_gen")
        if gen is not None and gen != mem.get("reset_gen"):
            self.log("ringwatch reset: restart history cleared", INFO)
            mem.update(reset_fields(gen))
        return mem

    def _save(self, *, lock_wait: float = WRITE_LOCK_WAIT, **fields: Any) -> None:
        """Read-modify-write ringwatch.json under its write lock, so a concurrent
        ``ringwatch reset`` of the history is not overwritten by our next poll."""
        with self._write_lock(lock_wait):
            self._write(self._load(), **fields)

    def _write(self, data: Dict[str, Any], **fields: Any) -> None:
        """Write ``data`` (just read under the write lock) updated with ``fields``.
        A state dir that is full or read-only must not stop the watching: keep
        the state in memory (the start limit still counts), say so once, write
        it when we can again."""
        data = dict(data)
        data.setdefault("gave_up", False)
        data.update(fields)
        # only restarts still inside the window are "in window" (SPEC)
        clock = self.env.clock()
        window = watchpolicy.prune(restart_times(data, clock), clock.boot, self.w.start_limit_interval)
        data.update(encode_restarts(window, clock))
        try:
            self.env.save_state(data)
        except OSError as e:
            if self._unsaved is None:
                self.log(f"cannot write {state_path(self.state_dir)} ({e.strerror}); "
                         f"watching on with the state in memory", ERR)
            self._unsaved = data
            return
        if self._unsaved is not None:
            self.log(f"{state_path(self.state_dir)} written again", INFO)
        self._unsaved = None
