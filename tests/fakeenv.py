"""A scripted stand-in for ringd.host.env.RealEnv: a clock that jumps to the next
event, agents whose exits are scripted by name, signals delivered at given
times. Lets the driver loop and the hop be tested in microseconds of real time."""
from __future__ import annotations

import errno
import itertools
import signal
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple


WALL0 = 2_000_000_000.0


@dataclass
class Behaviour:
    """How a fake agent behaves: exits after ``runs_for`` s with ``code`` (or
    ``signal``); on SIGTERM exits after ``term_delay`` (None: ignores it)."""
    runs_for: float = 0.001
    code: Optional[int] = 0
    signal: Optional[int] = None
    term_delay: Optional[float] = 0.01
    cannot_start: bool = False


@dataclass
class FakeChild:
    pid: int
    pidfd: int
    agent: str
    exit_at: float
    code: Optional[int]
    signal: Optional[int]
    term_delay: Optional[float]
    termed: List[float] = field(default_factory=list)
    start_time: Optional[float] = None
    exited: bool = False   # seen exited (RealEnv's Child likewise)


class FakeEnv:
    def __init__(self, behaviours: Optional[Dict[str, Behaviour]] = None, *, default: Behaviour = Behaviour()):
        self.t = 0.0
        self.wall_step = 0.0   # s the wall clock was stepped by (NTP, an operator, a resume from suspend)
        self.behaviours = behaviours or {}
        self.default = default
        self.pending: List[Tuple[float, int]] = []   # (time, signal)
        self.children: List[FakeChild] = []
        self.logs: List[Tuple[float, str]] = []
        self.levels: List[Tuple[str, int]] = []   # (message, level) of each log call
        self.beats: List[Tuple[float, dict]] = []
        self.proved: List[Tuple[int, int]] = []   # prove_containment calls
        self.notes: List[str] = []
        self.waits = 0
        self.reaped: List[int] = []
        self.killed_now: List[Tuple[float, int, int]] = []   # kill_run_now calls: (time, pid, run id)
        self.pid, self.pid_start, self.started_at = 4242, 1.0, WALL0
        self._pids = itertools.count(1000)
        self.hooks: List[Tuple[float, Callable[[], None]]] = []   # run at a time (e.g. edit the roster)
        self.after_run: List[Tuple[int, int]] = []   # (n, signal): arrives right after the n-th run ends

    # clocks
    def monotonic(self) -> float:
        return self.t

    def wall(self) -> float:
        return WALL0 + self.t + self.wall_step

    # scripting
    def send(self, at: float, sig: int) -> None:
        self.pending.append((at, sig))

    def at(self, when: float, fn: Callable[[], None]) -> None:
        self.hooks.append((when, fn))

    def _due_signals(self) -> set:
        got = {s for t, s in self.pending if t <= self.t}
        self.pending = [(t, s) for t, s in self.pending if t > self.t]
        for when, fn in [h for h in self.hooks if h[0] <= self.t]:
            self.hooks.remove((when, fn))
            fn()
        return got

    def wait(self, timeout, fds=()):
        self.waits += 1
        if self.waits > 1_000_000:
            raise AssertionError("the driver spins")
        live = [c for c in self.children if c.pidfd in fds]
        candidates = [self.t + max(0.0, timeout)] if timeout is not None else []
        candidates += [t for t, _ in self.pending] + [t for t, _ in self.hooks] + [c.exit_at for c in live]
        if not candidates:
            raise AssertionError("the driver waits forever with nothing to wake it")
        self.t = max(self.t, min(candidates))
        ready = {c.pidfd for c in live if c.exit_at <= self.t}
        return self._due_signals(), ready

    def signals(self):
        return self._due_signals()

    def stop_pending(self):
        return any(t <= self.t and s in (signal.SIGTERM, signal.SIGINT) for t, s in self.pending)

    # agents
    def spawn(self, argv, *, cwd, env, stdout_fd, umask, pid_var=None, run_cgroup=None):
        name = env["RING_AGENT"]
        b = self.behaviours.get(name, self.default)
        if b.cannot_start:
            raise OSError(errno.ENOENT, "No such file or directory")
        pid = next(self._pids)
        c = FakeChild(pid, pid + 100000, name, self.t + b.runs_for, b.code, b.signal, b.term_delay)
        self.children.append(c)
        return c

    def make_cgroup(self, run_id):
        return None   # the runs here are contained by nothing: they are not processes

    def remove_cgroup(self, cg):
        pass

    def open_notify(self, run_id):
        return None   # no notify socket: the agents here never talk

    def close_notify(self, sock):
        pass

    def write_notes(self, notes, now):
        pass

    def watch(self, fd):
        pass

    def unwatch(self, fd):
        pass

    def start_time(self, child):
        return 123.0

    def exit_status(self, child):
        if child.exit_at <= self.t:
            child.exited = True
            return child.code, child.signal
        return None

    def term(self, child):
        child.termed.append(self.t)
        if child.term_delay is not None and child.exit_at > self.t + child.term_delay:
            child.exit_at, child.code, child.signal = self.t + child.term_delay, None, signal.SIGTERM

    def kill_tree(self, child, state_key, run_id):
        if child.exit_at > self.t:
            child.exit_at, child.code, child.signal = self.t, None, signal.SIGKILL
        return 0

    def reap(self, child):
        self.reaped.append(child.pid)
        for n, sig in list(self.after_run):
            if n == len(self.children):   # delivered between this run and the next
                self.pending.append((self.t, sig))
                self.after_run.remove((n, sig))

    def reap_helpers(self, keep=(), helpers_only=False):
        pass

    def kill_run_now(self, pid, ticks, state_key, run_id, run_cgroup=None):
        """The lease watchdog's kill (another thread): the agent ``pid`` dies now."""
        self.killed_now.append((self.t, pid, run_id))
        for c in self.children:
            if c.pid == pid and c.exit_at > self.t:
                c.exit_at, c.code, c.signal = self.t, None, signal.SIGKILL
        return 1

    def lease_clock(self):
        return self.t

    @staticmethod
    def hostname():
        return "fakehost"

    def prove_containment(self):
        # no cgroups here (make_cgroup always says None); when it was asked: (beats, agents started) so far
        self.proved.append((len(self.beats), len(self.children)))

    # files
    def beat(self, **fields):
        self.beats.append((self.t, fields))

    def notify(self, message):
        self.notes.append(message)

    def ready(self):
        self.notify("READY=1")

    def index_run_logs(self, agents):
        pass

    def open_run_log(self, agent, run_id):
        return -1, f"/fake/logs/{agent}/{run_id}.log"

    def write_fd(self, fd, text):
        pass

    def close_fd(self, fd):
        pass

    def keep_logs(self, agent, run_id, keep):
        pass

    def roster_is(self, agents):
        pass

    def drop_logs(self, agent, run_ids):
        pass

    @staticmethod
    def errno_reason(e):
        return e.strerror or str(e)

    def log(self, message, level):
        self.logs.append((self.t, message))
        self.levels.append((message, level))

    def close(self):
        pass


# A ring's settings for fake-env drivers: short bounds, quick quarantine.
RING = dict(run_budget=10.0, stall_threshold=15.0, heartbeat_interval=1.0, backoff_initial=5.0,
            backoff_max=8.0, quarantine_after=3, quarantine_cooloff=1000.0)


def make_driver(tmp_path, names, behaviours=None, once=False, default=Behaviour(), agents=None,
                env_class=None, env_args=None, **ring):
    """A Driver on a real journal and roster in ``tmp_path`` (agents ``names``,
    each running /bin/NAME), with a FakeEnv (or ``env_class``). Returns
    (driver, env, journal)."""
    from ringd.inputs.config import Config, RingSettings
    from ringd.loops.driver import Driver
    from ringd.journal.sqlite import Journal
    from ringd.inputs.roster import RosterSource
    roster = tmp_path / "ring.txt"
    roster.write_text("".join(f"{n} /bin/{n}\n" for n in names))
    roster.chmod(0o600)
    src = RosterSource(roster)
    src.refresh(force=True)
    journal = Journal.open(tmp_path)
    env = (env_class or FakeEnv)(behaviours, default=default, **(env_args or {}))
    cfg = Config(ring=RingSettings(**{**RING, **ring}), agents=agents or {})
    return Driver(env, tmp_path, None, cfg, src, journal, once=once), env, journal
