"""A scripted stand-in for ringd.host.watchenv.RealWatcherEnv: a clock that jumps
to the next event, fake driver processes that beat, hang, die, exit with a code,
ignore SIGTERM or are SIGSTOPped, a fake restart command and alert helper, and
signals delivered at given times. Lets the watcher's loop be tested in
microseconds of real time."""
from __future__ import annotations

import contextlib
import errno
import itertools
import json
import math
import signal
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

from ringd.core.errors import EX_TEMPFAIL, RingError
from ringd.core.timefmt import iso
from ringd.core.watchpolicy import Clock

WALL0 = 2_000_000_000.0   # the wall clock at fake time 0
BOOT0 = 5_000.0           # seconds since boot at fake time 0
BOOT_ID = "fake-boot"


@dataclass
class Driver:
    """How a fake driver behaves, in seconds from its start. It beats every
    ``beat_every`` from ``first_beat`` (None: never) until it exits or, from
    ``hangs_at``, stays alive without beating (its loop stuck). At ``exits_at``
    it exits ``code`` (negative: killed by that signal). On SIGTERM it writes a
    stopped beat and exits 0 after ``term_delay`` (None: deaf to SIGTERM);
    ``unkillable``: not even SIGKILL ends it (uninterruptible sleep). Its
    beats carry ``status`` (what it last told systemd) from ``status_from`` on."""
    first_beat: Optional[float] = 0.1
    beat_every: float = 0.2
    hangs_at: Optional[float] = None
    exits_at: Optional[float] = None
    code: int = 0
    term_delay: Optional[float] = 0.05
    unkillable: bool = False
    last_words: str = ""
    cannot_start: bool = False
    status: str = "idle"
    status_from: float = 0.0


@dataclass
class Command:
    """How the fake restart command behaves: exits ``code`` after ``runs_for``
    (None: runs until killed), having started ``starts`` (a driver not ours)."""
    runs_for: Optional[float] = 0.05
    code: int = 0
    starts: Optional[Driver] = field(default_factory=Driver)
    killable: bool = True
    cannot_start: bool = False


@dataclass
class Process:
    """A fake process: a driver, a restart command or an alert helper."""
    pid: int
    start_time: int
    started: float
    ours: bool
    script: Any = None
    exit_at: Optional[float] = None
    code: Optional[int] = None
    clean: bool = False                 # it ended writing a stopped heartbeat
    quiet_at: Optional[float] = None    # no beat from then on (stuck, SIGSTOPped)
    stopped: bool = False               # SIGSTOPped
    term_pending: bool = False
    signals: List[Tuple[float, int]] = field(default_factory=list)

    def alive(self, t: float) -> bool:
        return self.exit_at is None or self.exit_at > t


@dataclass
class Handle:
    """The watcher's hold on a fake driver (RealWatcherEnv's DriverProc)."""
    proc: Process
    ours: bool
    fd: Optional[int]
    status: Optional[int] = None   # its exit code, once reaped

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def start_time(self) -> int:
        return self.proc.start_time


@dataclass
class CommandHandle:
    proc: Process
    fd: Optional[int]

    @property
    def pid(self) -> int:
        return self.proc.pid


class FakeWatcherEnv:
    def __init__(self, drivers: Sequence[Driver] = (), *, default: Driver = Driver(),
                 command: Command = Command(), watchdog_every: float = 0.0, notifying: bool = False,
                 state_dir: str = "/fake/state"):
        self.t = 0.0
        self.wall_step = 0.0        # s the wall clock was stepped by (NTP, an operator)
        self.scripts = list(drivers)
        self.default = default
        self.command = command
        self.watchdog_every = watchdog_every
        self.notifying = notifying
        self.state_dir = state_dir
        self.pid, self.pid_start = 4343, 77
        self.procs: List[Process] = []        # every process of the fake world, in start order
        self.started: List[Process] = []      # the drivers the watcher started
        self.commands: List[Tuple[float, List[str]]] = []
        self.alerts: List[Tuple[float, str, str]] = []
        self.alert_runs_for: Optional[float] = 0.05   # an alert helper's life (None: never ends)
        self.logs: List[Tuple[float, str, int]] = []
        self.notes: List[Tuple[float, str]] = []
        self.written: List[Tuple[float, Dict[str, Any]]] = []   # heartbeats a test wrote itself
        self.state: Dict[str, Any] = {}        # ringwatch.json
        self.marker = False                    # ringwatch.gave-up
        self.disk_full = False
        self.state_lock_held_until: Optional[float] = None   # ringwatch.json's write lock, held by another
        self.lock_holder: Optional[int] = None                # another watcher's pid holding ringwatch.lock
        self.lock_verdicts: List[str] = []
        self.listening = False
        self.open_fds: Dict[int, Process] = {}
        self.pending: List[Tuple[float, int]] = []   # (time, signal) sent to the watcher
        self.hooks: List[Tuple[float, Callable[[], None]]] = []
        self.freezes: List[Tuple[float, float]] = []  # (at, for): the watcher itself SIGSTOPped
        self.waits = 0
        self._idle_waits = 0
        self._heard: set = set()
        self._chld_seen = 0.0
        self._pids = itertools.count(1000)
        self._fds = itertools.count(100)

    # --- scripting --------------------------------------------------------------------
    def send(self, at: float, sig: int) -> None:
        self.pending.append((at, sig))

    def at(self, when: float, fn: Callable[[], None]) -> None:
        self.hooks.append((when, fn))

    def freeze(self, at: float, seconds: float) -> None:
        """The watcher is SIGSTOPped at ``at`` for ``seconds``: its wait returns no
        earlier than that, while the drivers run on."""
        self.freezes.append((at, seconds))

    def spawn(self, script: Driver, ours: bool = False) -> Process:
        """A driver process (ours: the watcher's child) starting now."""
        pid = next(self._pids)
        p = Process(pid=pid, start_time=pid * 7, started=self.t, ours=ours, script=script)
        if script.exits_at is not None:
            p.exit_at, p.code = self.t + script.exits_at, script.code
        if script.hangs_at is not None:
            p.quiet_at = self.t + script.hangs_at
        self.procs.append(p)
        return p

    def sigstop(self, p: Process) -> None:
        if p.alive(self.t):
            p.stopped, p.quiet_at = True, min(self.t, p.quiet_at if p.quiet_at is not None else math.inf)

    def write_heartbeat(self, hb: Dict[str, Any]) -> None:
        """A heartbeat file written now by someone other than a fake driver."""
        self.written.append((self.t, dict(hb)))

    def said(self, text: str) -> List[Tuple[float, str]]:
        return [(t, m) for t, m, _ in self.logs if text in m]

    # --- clocks and the one wait ------------------------------------------------------
    def monotonic(self) -> float:
        return self.t

    def wall(self) -> float:
        return WALL0 + self.t + self.wall_step

    def clock(self) -> Clock:
        return Clock(boot_id=BOOT_ID, boot=BOOT0 + self.t, wall=self.wall())

    def listen(self) -> None:
        self.listening = True

    def close(self) -> None:
        self.listening = False

    def wait(self, timeout, fds=()):
        self.waits += 1
        fds = [fd for fd in fds if fd is not None]
        for fd in fds:
            assert fd in self.open_fds, f"a wait on descriptor {fd}, closed (EBADF)"
        before = self.t
        if not self._heard:
            self.t = max(self.t, self._next_event(timeout, fds))
            self._thaw()
        self._idle_waits = self._idle_waits + 1 if self.t == before else 0
        if self._idle_waits > 1000:
            raise AssertionError(f"the watcher spins at t={self.t}")
        ready = {fd for fd in fds if not self.open_fds[fd].alive(self.t)}
        return self._due_signals(), ready

    def _next_event(self, timeout, fds) -> float:
        when = [self.t + max(0.0, timeout)] if timeout is not None else []
        when += [t for t, _ in self.pending] + [t for t, _ in self.hooks]
        when += [self.open_fds[fd].exit_at for fd in fds if self.open_fds[fd].exit_at is not None]
        when += [p.exit_at for p in self.procs if p.ours and p.exit_at is not None and p.exit_at > self._chld_seen]
        if not when:
            raise AssertionError("the watcher waits forever with nothing to wake it")
        return min(when)

    def _thaw(self) -> None:
        for at, seconds in list(self.freezes):
            if at <= self.t:
                self.freezes.remove((at, seconds))
                self.t = max(self.t, at + seconds)

    def _due_signals(self) -> set:
        for when, fn in sorted([h for h in self.hooks if h[0] <= self.t], key=lambda h: h[0]):
            self.hooks.remove((when, fn))
            fn()
        got = {s for t, s in self.pending if t <= self.t} | self._heard
        self.pending = [(t, s) for t, s in self.pending if t > self.t]
        self._heard = set()
        if any(p.ours and p.exit_at is not None and self._chld_seen < p.exit_at <= self.t for p in self.procs):
            got.add(signal.SIGCHLD)
        self._chld_seen = self.t
        return got

    def signals(self):
        return self._due_signals() if self.listening else set()

    def put_back(self, sigs) -> None:
        self._heard |= set(sigs)

    def notify(self, message: str) -> None:
        self.notes.append((self.t, message))

    @staticmethod
    def errno_reason(e: OSError) -> str:
        return e.strerror or str(e)

    def log(self, message: str, level: int) -> None:
        self.logs.append((self.t, message, level))

    # --- the state dir ------------------------------------------------------------------
    def prepare(self) -> None:
        pass

    def lock(self) -> None:
        if self.lock_holder is not None:
            raise RingError(f"another ringwatch (pid {self.lock_holder}) is already watching {self.state_dir}; "
                            f"only one watcher per state dir", EX_TEMPFAIL)

    def verify_lock(self) -> str:
        return self.lock_verdicts.pop(0) if self.lock_verdicts else "ok"

    def unlock(self) -> None:
        pass

    def whose(self) -> Dict[str, Any]:
        return {"state_dir": self.state_dir, "state_id": [1, 2], "boot_id": BOOT_ID}

    def heartbeat(self) -> Optional[Dict[str, Any]]:
        """The newest beat any fake driver (or the test) wrote, if of this boot."""
        beats = [b for b in (self._last_beat(p) for p in self.procs if p.script is not None) if b is not None]
        beats += [(t, hb) for t, hb in self.written if t <= self.t]
        if not beats:
            return None
        hb = dict(max(beats, key=lambda b: b[0])[1])
        return hb if hb.get("boot_id") == BOOT_ID else None

    def _last_beat(self, p: Process) -> Optional[Tuple[float, Dict[str, Any]]]:
        s = p.script
        if not isinstance(s, Driver) or s.first_beat is None:
            return None
        first = p.started + s.first_beat
        end = min(x for x in (self.t, p.quiet_at, p.exit_at) if x is not None)
        seq, at = 0, None
        if end >= first:
            k = math.floor((end - first) / s.beat_every + 1e-9)
            seq, at = k + 1, first + k * s.beat_every
        stopped = p.clean and p.exit_at is not None and p.exit_at <= self.t
        if stopped:
            seq, at = seq + 1, p.exit_at
        if at is None:
            return None
        wall = WALL0 + at + self.wall_step
        status = s.status if at - p.started >= s.status_from else "starting"
        return at, {"pid": p.pid, "pid_start": p.start_time, "seq": seq, "at_epoch": wall, "at": iso(wall),
                    "stopped": stopped, "boot_id": BOOT_ID, "status": status}

    def load_state(self) -> Dict[str, Any]:
        return json.loads(json.dumps(self.state))

    def save_state(self, data: Dict[str, Any]) -> None:
        if self.disk_full:
            raise OSError(errno.ENOSPC, "No space left on device")
        self.state = json.loads(json.dumps(data))

    @contextlib.contextmanager
    def state_lock(self, wait: float, give_up: Callable[[], bool]) -> Iterator[None]:
        """ringwatch.json's write lock: held by another until ``state_lock_held_until``."""
        deadline = self.t + wait
        while self.state_lock_held_until is not None and self.t < self.state_lock_held_until:
            if self.t >= deadline or give_up():
                raise RingError(f"{self.state_dir}/ringwatch.json: still being written by another process",
                                EX_TEMPFAIL)
            self.t = min([deadline, self.state_lock_held_until] + [t for t, _ in self.pending if t > self.t])
        yield

    def gave_up(self, data: Dict[str, Any]) -> bool:
        return bool((data or {}).get("gave_up")) or self.marker

    def mark_gave_up(self) -> None:
        self.marker = True

    # --- the driver ---------------------------------------------------------------------
    def _fd(self, p: Process) -> int:
        fd = next(self._fds)
        self.open_fds[fd] = p
        return fd

    def start_driver(self) -> Handle:
        script = self.scripts.pop(0) if self.scripts else self.default
        if script.cannot_start:
            raise OSError(errno.EAGAIN, "Resource temporarily unavailable")
        p = self.spawn(script, ours=True)
        self.started.append(p)
        return Handle(p, ours=True, fd=self._fd(p))

    def adopt(self, pid, start_time) -> Optional[Handle]:
        p = self._find(pid, start_time)
        return Handle(p, ours=False, fd=self._fd(p)) if p is not None else None

    def _find(self, pid, start_time) -> Optional[Process]:
        return next((p for p in self.procs if p.pid == pid and p.start_time == start_time and p.alive(self.t)), None)

    def live_driver(self, hb) -> Optional[Tuple[int, Any]]:
        if not isinstance(hb, dict) or hb.get("stopped"):
            return None
        pid, start = hb.get("pid"), hb.get("pid_start")
        return (pid, start) if self._find(pid, start) is not None and hb.get("boot_id") == BOOT_ID else None

    def same_process(self, pid, start_time) -> bool:
        return self._find(pid, start_time) is not None

    def driver_alive(self, proc: Handle) -> bool:
        return proc.status is None and proc.proc.alive(self.t)

    def driver_exit(self, proc: Handle) -> Optional[int]:
        if not proc.ours:
            return None
        if proc.status is None and not proc.proc.alive(self.t):
            proc.status = proc.proc.code
            self.close_driver(proc)
        return proc.status

    def signal_driver(self, proc: Handle, sig: int) -> None:
        self.deliver(proc.proc, sig)

    def deliver(self, p: Process, sig: int) -> None:
        """A signal to a fake process, acted on as a driver would."""
        if not p.alive(self.t):
            return
        p.signals.append((self.t, sig))
        s = p.script
        if sig == signal.SIGKILL:
            if not getattr(s, "unkillable", False):
                p.exit_at, p.code, p.clean = self.t, -signal.SIGKILL, False
        elif sig == signal.SIGCONT and p.stopped:
            p.stopped = False
            if p.term_pending:
                self._terminate(p)
        elif sig == signal.SIGTERM:
            if p.stopped:
                p.term_pending = True
            else:
                self._terminate(p)

    def _terminate(self, p: Process) -> None:
        """SIGTERM acted on: a clean stop after its term_delay (if it hears it)."""
        s = p.script
        if isinstance(s, Driver) and s.term_delay is not None:
            end = self.t + s.term_delay
            if p.exit_at is None or p.exit_at > end:
                p.exit_at, p.code, p.clean = end, 0, True

    def close_driver(self, proc) -> None:
        if proc.fd is not None:
            del self.open_fds[proc.fd]
            proc.fd = None

    def driver_log_tail(self) -> str:
        ended = [p for p in self.started if not p.alive(self.t)]
        return ended[-1].script.last_words if ended else ""

    # --- the restart command and the alert helper -----------------------------------------
    def run_command(self, argv) -> CommandHandle:
        self.commands.append((self.t, list(argv)))
        c = self.command
        if c.cannot_start:
            raise OSError(errno.ENOENT, "No such file or directory")
        pid = next(self._pids)
        p = Process(pid=pid, start_time=pid * 7, started=self.t, ours=True, script=c)
        if c.runs_for is not None:
            p.exit_at, p.code = self.t + c.runs_for, c.code
        self.procs.append(p)
        if c.starts is not None:
            self.spawn(c.starts)   # detached: the service manager's, not ours
        return CommandHandle(p, fd=self._fd(p))

    def command_exit(self, cmd: CommandHandle) -> Optional[int]:
        return None if cmd.proc.alive(self.t) else cmd.proc.code

    def kill_command(self, cmd: CommandHandle, wait: float) -> bool:
        cmd.proc.signals.append((self.t, signal.SIGKILL))
        if self.command.killable:
            if cmd.proc.alive(self.t):
                cmd.proc.exit_at, cmd.proc.code = self.t, -signal.SIGKILL
            return True
        self.t += wait   # waited for it in vain
        return False

    def close_command(self, cmd: CommandHandle) -> None:
        self.close_driver(cmd)

    def fire_alert(self, command, kind: str, detail: str, timeout: float) -> Optional[int]:
        self.alerts.append((self.t, kind, detail))
        if not command:
            return None
        pid = next(self._pids)
        p = Process(pid=pid, start_time=pid * 7, started=self.t, ours=True)
        if self.alert_runs_for is not None:
            p.exit_at, p.code = self.t + self.alert_runs_for, 0
        self.procs.append(p)
        return pid

    def pidfd(self, pid: int) -> Optional[int]:
        p = next((p for p in self.procs if p.pid == pid), None)
        return self._fd(p) if p is not None else None

    def helper_ended(self, pid: int) -> bool:
        p = next((p for p in self.procs if p.pid == pid), None)
        return p is None or not p.alive(self.t)

    def close_fd(self, fd: int) -> None:
        del self.open_fds[fd]


# A watcher's settings for fake-clock tests: the system tests' (tests/conftest.py).
WATCH = dict(poll_interval=0.2, stale_after=1.5, restart_sec=0.2, start_limit_burst=5, start_limit_interval=30)


def make_watcher(tmp_path, drivers: Sequence[Driver] = (), *, default: Driver = Driver(), alerts=None,
                 env_args=None, config_path=None, ring=None, **watch):
    """A Watcher on a FakeWatcherEnv (``drivers`` scripted in start order, then
    ``default``), state dir ``tmp_path``, ``ring`` settings and ``watch``
    settings over the system tests' (WATCH). Returns (watcher, env)."""
    from ringd.core.settings import AlertSettings, RingSettings, WatchSettings
    from ringd.inputs.config import Config
    from ringd.loops.watcher import Watcher
    env = FakeWatcherEnv(drivers, default=default, state_dir=str(tmp_path), **(env_args or {}))
    cfg = Config(ring=RingSettings(**(ring or {})), watch=WatchSettings(**{**WATCH, **watch}),
                 alerts=alerts or AlertSettings())
    return Watcher(tmp_path, config_path, cfg, env=env), env
