"""The driver's effects, behind one small object: clocks, the event wait,
spawning and signalling an agent, killing its tree, the heartbeat, sd_notify,
run logs and the daemon log. The driver and the hop only decide and call these;
:class:`RealEnv` does them, and tests pass a fake with a scripted clock, exits
and signals (tests/fakeenv.py).

Extra event sources (the per-run notify socket) register a descriptor with
:meth:`RealEnv.watch`; a wait then reports it ready like the agent's pidfd.
"""
from __future__ import annotations

import errno
import os
import signal
import socket
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Deque, Dict, Iterable, List, Mapping, Optional, Sequence, Set, Tuple

from ringd.core.levels import ERR, WARNING
from ringd.host import cgroup
from ringd.host import logline
from ringd.host import proctree
from ringd.host import safefile
from ringd.host import notify as voice
from ringd.host.heartbeat import Heartbeat
from ringd.host.servicemanager import Notifier
from ringd.host.procid import same_process, start_ticks
from ringd.host.wakeup import Wakeups

SPENT_KEPT = 16      # ended runs' cgroups whose rmdir is retried at each wait
# Run logs an agent's run end prunes at most (keep_logs lowered below a full folder:
# the excess goes over its next runs; all 100,000 at once took one hop 5 s, the
# driver deaf to its signals meanwhile). An ordinary run end prunes one.
PRUNE_LOGS_AT_ONCE = 64
STUCK_RETRY = 1.0    # s between two tries at those whose runs left processes SIGKILL could not end


@dataclass
class Child:
    """An agent process we started as the leader of a new session. Until we reap
    it, its pid (and process group id) cannot be reused, so signalling it and its
    group stays safe."""
    pid: int
    pidfd: Optional[int]
    cgroup: Optional[cgroup.RunCgroup] = None   # its run's cgroup, when the driver can make one
    cpu_seconds: Optional[float] = None          # that cgroup's CPU time, read as the run ends
    start_time: Optional[int] = None     # boot-relative start ticks (procid), read when first needed
    exited: bool = False                 # seen exited (a zombie until reaped)
    # its leader or a descendant outlived SIGKILL (kill_tree): its cgroup will not
    # empty soon, so the run's end does not wait for it to
    unkillable: bool = False

    def close(self) -> None:
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None


@dataclass
class LogIndex:
    """The run-log ids of one agent we know of, oldest first (read from the
    directory once, then kept in step as runs are added and pruned)."""
    ids: Deque[int] = field(default_factory=deque)


class RealEnv:
    def __init__(self, state_dir: Path, logger, prove_containment: bool = True):
        self.state_dir = state_dir
        self.log = logger
        self.notifier = Notifier()
        self.wakeups = Wakeups()
        self.heartbeat = Heartbeat(state_dir, self.notifier)
        self.pid = self.heartbeat.pid
        self.pid_start = self.heartbeat.pid_start
        self.started_at = self.heartbeat.started_at
        self.status_text = "starting"   # the last STATUS= it sent (or would send, without systemd)
        self._watched: Set[int] = set()
        self._logs: Dict[str, LogIndex] = {}
        self._aside_said: Set[str] = set()   # agents whose run log path had something set aside (said once)
        # the roster's names (roster_is): the log indexes kept are theirs only, so
        # a ring whose agents are renamed or replaced keeps none of the old ones'
        self._roster: Optional[frozenset] = None
        self._sweep_sockets = True   # a dead driver's notify sockets go before our first run's
        self._parked_notify = None   # the last run's notify socket, kept bound for the next run
        self._notes_written = True   # and its notes file with our first run's end
        self._spent_cgroups: List[cgroup.RunCgroup] = []   # ended runs' cgroups, empty, removed at the next wait
        self._stuck_retry_at = float("-inf")   # monotonic: when those left populated (stuck) are tried again
        # The likely next run's cgroup, made (and its files opened) at a wait
        # while this run's agent runs, so the next hop does not: the next run's
        # id is this one's + 1 unless a turn is skipped, or another driver of a
        # many-host ring took ids, in between. One a run does not take is removed.
        self._ahead: Optional[Tuple[int, cgroup.RunCgroup]] = None
        self._ahead_id: Optional[int] = None   # the run id to make one for, at the next wait
        self._stuck: Dict[int, int] = {}   # pid -> start ticks: processes that outlived SIGKILL (kill_tree, reap)
        # SPEC "Process containment": a cgroup per run where we can make one
        # (proven once: here, or by the driver just before its first run), else
        # the subreaper rule alone - said once.
        self.containment = cgroup.detect(state_dir, prove=False)
        logline.rotate_stderr(state_dir)   # stderr is logs/ringd.log (under ringwatch): rotated as it grows
        if prove_containment:
            self.prove_containment()

    def prove_containment(self) -> None:
        """Prove per-run cgroups work here (cgroup.Containment.prove), once; until
        then no run gets one. Says so if the subreaper rule alone will contain runs."""
        if self.containment.proven:
            return
        self.containment.prove()
        if self.containment.kind != "cgroup":
            self.log(f"containment: subreaper rule only, no per-run cgroup ({self.containment.reason})", WARNING)

    # --- clocks and the wait ---------------------------------------------------------
    monotonic = staticmethod(time.monotonic)
    wall = staticmethod(time.time)

    def watch(self, fd: int) -> None:
        """Report ``fd`` from every wait until :meth:`unwatch` (e.g. a run's notify socket)."""
        self._watched.add(fd)

    def unwatch(self, fd: int) -> None:
        self._watched.discard(fd)

    def wait(self, timeout: Optional[float], fds: Iterable[Optional[int]] = ()) -> Tuple[Set[int], Set[int]]:
        """Sleep until a signal arrives, a descriptor is ready, or ``timeout`` passes.
        Returns (signals, ready descriptors)."""
        if self._spent_cgroups:
            self._remove_spent_cgroups()
        if self._ahead_id is not None:
            self._make_cgroup_ahead()
        return self.wakeups.wait(timeout, [*fds, *self._watched])   # (which clamps the timeout)

    def signals(self) -> Set[int]:
        """Signals that arrived since the last wait, without sleeping."""
        return self.wakeups.drain()

    def stop_pending(self) -> bool:
        """Has SIGTERM or SIGINT arrived since the last wait? (Looked at, left for the next wait to hear.)"""
        sigs = self.wakeups.drain()
        self.wakeups.put_back(sigs)
        return bool(sigs & {signal.SIGTERM, signal.SIGINT})

    # --- the agent ---------------------------------------------------------------------
    def make_cgroup(self, run_id: int) -> Optional[cgroup.RunCgroup]:
        """The run's cgroup, made before its spawn, or ahead of it (None: the
        subreaper rule alone contains the run)."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead[0] == run_id and self.containment.parent is not None:
            cg: Optional[cgroup.RunCgroup] = ahead[1]
        else:
            if ahead is not None:
                self._spent_cgroups.append(ahead[1])   # empty: removed at the next wait
            cg = self.containment.create(run_id)
        if cg is not None:
            self._ahead_id = run_id + 1
        return cg

    def _make_cgroup_ahead(self) -> None:
        run_id, self._ahead_id = self._ahead_id, None
        cg = self.containment.create(run_id)
        if cg is not None:
            cg.open_ahead()
            self._ahead = (run_id, cg)

    def remove_cgroup(self, cg: Optional[cgroup.RunCgroup]) -> None:
        """A cgroup made for a run that never started."""
        if cg is not None:
            self.containment.finish(cg)

    def spawn(self, argv: Sequence[str], *, cwd: Optional[str], env: Mapping[str, str], stdout_fd: int,
              umask: int, pid_var: Optional[str] = None, run_cgroup: Optional[cgroup.RunCgroup] = None) -> Child:
        """Start ``argv`` in its own session (and in ``run_cgroup``, made by
        :meth:`make_cgroup`: the child is born in it). Raises OSError if it cannot
        be started. ``pid_var``: also give the child that variable set to its own
        pid (``WATCHDOG_PID``, as systemd does)."""
        def start() -> proctree.Child:
            return proctree.spawn(argv, cwd=cwd, env=env, stdout_fd=stdout_fd, umask=umask, pid_var=pid_var)
        cg = run_cgroup
        try:
            if cg is None:
                started = start()
            else:
                started, cg = self.containment.spawn_into(cg, start)
        except OSError:
            if not self.containment.stranded:   # a cgroup that holds us is never killed
                self.remove_cgroup(run_cgroup)
            raise
        if run_cgroup is not None and cg is None:
            run_cgroup.close_files()   # never removed: it holds us
            self.log(f"containment: subreaper rule only from now on ({self.containment.stranded})", WARNING)
        return Child(pid=started.pid, pidfd=started.pidfd, cgroup=cg)   # start ticks: read when needed

    def start_time(self, child: Child) -> Optional[int]:
        if child.start_time is None:
            child.start_time = start_ticks(child.pid)
        return child.start_time

    @staticmethod
    def exit_status(child: Child) -> Optional[Tuple[Optional[int], Optional[int]]]:
        """(exit code, signal) once the leader has exited, without reaping it."""
        ws = proctree.peek_exit(child.pid)
        if ws is None:
            return None
        child.exited = True
        return proctree.decode_status(ws)

    @staticmethod
    def term(child: Child) -> None:
        """SIGTERM to the agent's group, and SIGCONT so a stopped agent can act on it."""
        proctree.signal_group(child.pid, signal.SIGTERM)
        proctree.signal_group(child.pid, signal.SIGCONT)

    def kill_tree(self, child: Child, state_key: str, run_id: int) -> int:
        """SIGKILL the run's whole tree; returns how many leftovers were killed.
        The leader is kept as an unreaped zombie meanwhile so its group id
        cannot be reused."""
        dead = child.exited
        if not dead:
            if child.pidfd is not None:
                try:
                    signal.pidfd_send_signal(child.pidfd, signal.SIGKILL)
                except OSError:
                    pass
            else:
                proctree.signal_group(child.pid, signal.SIGKILL)
            # Let the leader finish dying first: until it is a zombie its escaped
            # children are still being re-parented to us, and a walk of our process
            # tree at that moment misses them (found by the soak).
            dead = proctree.wait_exit(child.pidfd, timeout=2.0)
        unkillable: Dict[int, int] = {}
        killed = proctree.kill_run(state_key, run_id, child.pid, keep_unreaped=[child.pid, *self._stuck_pids()],
                                   dead=[child.pid] if dead else [], unkillable=unkillable)
        child.unkillable = not dead or bool(unkillable)
        if unkillable:
            # spared by every later kill (as a stuck leader is): a later run must
            # not spend its kill's whole bound on them, nor count them as its own
            self._stuck.update(unkillable)
            self.log(f"run {run_id}: {len(unkillable)} process(es) did not die of SIGKILL "
                     f"(uninterruptible sleep?): left behind (pids {', '.join(map(str, sorted(unkillable)))})", ERR)
        return killed

    def reap(self, child: Child) -> None:
        """The run's end: empty its cgroup (reading its CPU time) while the leader
        still holds its pid, then collect the leader. The empty cgroup is removed
        at the driver's next wait - on a turning ring, while the next agent execs.
        A run whose processes outlived SIGKILL (kill_tree) has its cgroup killed
        once, not waited on: its tree kill has spent its bounds on them already."""
        if child.cgroup is not None:
            child.cpu_seconds = self.containment.finish(
                child.cgroup, reap=lambda: proctree.reap_zombie_children(keep=[child.pid]), remove=False,
                wait=0.0 if child.unkillable else cgroup.KILL_WAIT)
            self._spent_cgroups.append(child.cgroup)
            child.cgroup = None
        try:
            if child.exited:
                os.waitpid(child.pid, 0)   # a zombie: at once
            elif os.waitpid(child.pid, os.WNOHANG)[0] == 0:
                # Closed without its exit: SIGKILL could not end it (runstate.UNKILLABLE_WAIT).
                # Collected whenever it dies (reap_helpers); never walked again meanwhile,
                # or every later run's tree kill would spend its whole bound on it.
                ticks = self.start_time(child)
                if ticks is not None:
                    self._stuck[child.pid] = ticks
        except ChildProcessError:
            pass
        child.close()

    def _stuck_pids(self) -> List[int]:
        """Processes of earlier runs that outlived SIGKILL and still live."""
        if self._stuck:
            self._stuck = {pid: t for pid, t in self._stuck.items() if same_process(pid, t)}
        return list(self._stuck)

    @staticmethod
    def kill_run_now(pid: int, ticks: Optional[int], state_key: str, run_id: int,
                     run_cgroup: Optional[cgroup.RunCgroup] = None) -> int:
        """SIGKILL a run's cgroup (everything in it, atomically), its group and
        every descendant of ours but our helpers (setsid env -i escapes
        included), from any thread: signals only, never a reap (the loop owns
        every exit status). Returns how many descendants were killed."""
        if run_cgroup is not None:
            run_cgroup.signal_kill()
        killed = set()
        for _ in range(5):
            # walk first, then signal, and walk again: a child of a dying process
            # is re-parented to us meanwhile and one walk can miss it
            victims = [v for v in proctree.run_descendants() if v[0] not in killed]
            if same_process(pid, ticks):
                proctree.signal_group(pid, signal.SIGKILL)
            for victim, start in victims:   # identity as listed: a pid recycled since is not hit
                if proctree.signal_process(victim, start, signal.SIGKILL):
                    killed.add(victim)
            if not victims and killed:
                break
            time.sleep(0.02)
        return len(killed)

    @staticmethod
    def lease_clock() -> float:
        """The local clock of a many-host ring's lease: boot time, never the wall clock."""
        return time.clock_gettime(time.CLOCK_BOOTTIME)

    hostname = staticmethod(socket.gethostname)

    @staticmethod
    def reap_helpers(keep: Iterable[int] = (), helpers_only: bool = False) -> None:
        """Collect exited children other than ``keep`` (alert helpers, orphans
        re-parented to us). ``helpers_only``: nothing to do unless we started
        helpers (the run's own orphans are collected by its tree kill)."""
        if helpers_only and not proctree.has_helpers():
            return
        proctree.reap_zombie_children(keep)

    # --- files -------------------------------------------------------------------------
    def beat(self, **fields) -> None:
        extra = dict(fields.pop("extra", None) or {})
        extra["containment"] = self.containment.kind   # driver.containment in status
        extra["status"] = self.status_text   # what it last told systemd: a watcher passes it on
        self.heartbeat.beat(extra=extra, **fields)

    def notify(self, message: str) -> None:
        if message.startswith("STATUS="):
            self.status_text = message[len("STATUS="):]
        self.notifier.notify(message)

    def ready(self) -> None:
        """Started: READY=1 to the service manager, and from now on a SIGHUP or
        SIGUSR1 ends a journal call in flight as a stop does (pgcall.ends_call);
        before, it waits for the loop, which acts on it."""
        self.wakeups.ready = True
        self.notify("READY=1")

    def open_run_log(self, agent: str, run_id: int) -> Tuple[int, str]:
        """Create ``logs/<agent>/<run_id>.log`` (0600), a new file, without following
        any symlink a local user planted in the state dir. Always a new inode: a
        follower's descriptor on an older run's log never sees this run's bytes.
        Anything in the way (a symlink, a file, a FIFO or a directory at the log,
        or a non-directory at ``logs/`` or ``logs/<agent>/``; an old log whose id a
        new journal hands out again) is set aside, never written through, and
        said once per agent; the run goes on."""
        moved: List[safefile.Aside] = []
        name = f"{run_id}.log"
        try:
            dfd = safefile.open_dir(self.state_dir, ("logs", agent), moved=moved)
            try:
                fd = safefile.create_in(dfd, name, moved, f"logs/{agent}/")
            finally:
                os.close(dfd)
        finally:
            if moved:
                self._said_aside(agent, moved)
        index = self._logs.get(agent)
        if moved and index is not None and run_id in index.ids:
            index.ids.remove(run_id)   # that log was set aside: this run's id goes last, as the newest
        return fd, f"{self.state_dir}/logs/{agent}/{name}"

    def _said_aside(self, agent: str, moved: List[safefile.Aside]) -> None:
        if agent in self._aside_said:
            return
        self._aside_said.add(agent)
        what = "; ".join(f"{old}: {kind} was in the way, set aside as {new}" for old, kind, new in moved)
        self.log(f"{agent}: run log path: {what} (never written through; said once for {agent})", WARNING)

    def _remove_logs(self, agent: str, run_ids: List[int]) -> None:
        """Unlink run logs in ``logs/<agent>`` (best effort), never through a
        symlink: an agent that swaps its log dir (or ``logs/``) for a link to
        another dir would have its files named like run logs unlinked."""
        try:
            dfd = safefile.open_dir(self.state_dir, ("logs", agent), create=False)
        except OSError:
            return
        try:
            for run_id in run_ids:
                try:
                    os.unlink(f"{run_id}.log", dir_fd=dfd)
                except OSError:
                    pass
        finally:
            os.close(dfd)

    @staticmethod
    def write_fd(fd: int, text: str) -> None:
        os.write(fd, text.encode())

    @staticmethod
    def close_fd(fd: int) -> None:
        os.close(fd)

    def keep_logs(self, agent: str, run_id: int, keep: int) -> None:
        """Keep the newest ``keep`` run logs of an agent. The directory is listed
        once per agent; after that each run costs at most one unlink (an excess
        over ``keep``: PRUNE_LOGS_AT_ONCE)."""
        index = self._log_index(agent)
        if not index.ids or index.ids[-1] != run_id:
            index.ids.append(run_id)
        old = []
        while len(index.ids) > max(keep, 0) and len(old) < PRUNE_LOGS_AT_ONCE:
            old.append(index.ids.popleft())
        if old:
            self._remove_logs(agent, old)
        if self._roster is not None and agent not in self._roster:
            del self._logs[agent]   # (the last run of an agent since removed: listed again if it returns)

    def drop_logs(self, agent: str, run_ids: List[int]) -> None:
        """Unlink these logs of an agent no longer on the roster (their runs were
        pruned from the journal: Driver.prune_journal), and its log dir once
        empty (a file an agent left there that is not a run log keeps it:
        never ours to remove)."""
        self._remove_logs(agent, run_ids)
        try:
            dfd = safefile.open_dir(self.state_dir, ("logs",), create=False)
        except OSError:
            return
        try:
            os.rmdir(agent, dir_fd=dfd)   # (a symlink there is not removed: ENOTDIR)
        except OSError:
            pass
        finally:
            os.close(dfd)

    def roster_is(self, agents: Iterable[str]) -> None:
        """The roster now (at each reload): forget the log index of every agent
        not on it. Kept, one index an agent ever run (its ids, up to keep_logs)
        grew with every rename or replacement for the driver's life; an agent
        put back is listed again at its next run, as at a driver's first."""
        self._roster = frozenset(agents)
        for gone in [a for a in self._logs if a not in self._roster]:
            del self._logs[gone]

    def index_run_logs(self, agents: Iterable[str]) -> None:
        """List the log dirs of ``agents`` now, in one pass at start-up, instead of
        each at the agent's first run: one listing each either way, but back to
        back they cost 9 us each (200 agents: 1.8 ms), where each made its hop
        of a fresh driver's first lap 24 us longer. Best effort: a dir that
        cannot be listed here is listed at the agent's first run, as before."""
        try:
            logs = safefile.open_dir(self.state_dir, ("logs",), create=False)
        except OSError:
            return
        try:
            for agent in agents:
                if agent in self._logs:
                    continue
                try:
                    dfd = safefile.open_dir_in(logs, agent)
                except FileNotFoundError:
                    self._logs[agent] = LogIndex()   # no logs yet: made at its first run
                    continue
                except OSError:
                    continue
                try:
                    self._log_index(agent, dfd)
                finally:
                    os.close(dfd)
        finally:
            os.close(logs)

    def _log_index(self, agent: str, dfd: Optional[int] = None) -> LogIndex:
        """``dfd``: the agent's log dir, open already (listed without a path walk)."""
        index = self._logs.get(agent)
        if index is None:
            folder = self.state_dir / "logs" / agent if dfd is None else dfd
            index = self._logs[agent] = LogIndex(deque(safefile.run_log_ids(folder)))
        return index

    @staticmethod
    def errno_reason(e: OSError) -> str:
        return proctree.errno_reason(e)

    def _remove_spent_cgroups(self, patient: bool = False) -> None:
        """rmdir the ended runs' cgroups. At a wait, one try each: the wait may be
        the one that supervises the next agent, so a cgroup the kernel still
        holds is tried again at the next wait (the newest SPENT_KEPT at most; an
        older one is left as a failed rmdir always was). ``patient`` (at close):
        retried for up to cgroup.KILL_WAIT in all - but not one its run left
        populated (``stuck``: processes that outlived SIGKILL), which a stop
        would wait out in vain; the next driver's sweep removes it. A stuck
        one is tried at a wait once every STUCK_RETRY at most: its processes
        outlived SIGKILL and seldom die soon, and each try (an rmdir, a stat,
        a listing of its sub-cgroups) cost every hop 3.6-21 us, 16 of them
        58-344 us."""
        now = time.monotonic()
        deadline = now + (cgroup.KILL_WAIT if patient else 0.0)
        stuck_due = patient or now >= self._stuck_retry_at
        kept = []
        for cg in self._spent_cgroups:
            if cg.stuck and not stuck_due:
                kept.append(cg)
            elif not cg.remove(0.0 if cg.stuck else cgroup.left(deadline)):
                kept.append(cg)
        if stuck_due:
            self._stuck_retry_at = now + STUCK_RETRY
        self._spent_cgroups = kept[-SPENT_KEPT:]

    def close(self) -> None:
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            self._spent_cgroups.append(ahead[1])
        self._remove_spent_cgroups(patient=True)
        self.containment.close()
        self.wakeups.close()
        parked, self._parked_notify = self._parked_notify, None
        if parked is not None:
            parked.close()   # and its idle file (whatever is queued on it goes into a grave: notify.bury)

    # --- the run's notify socket (ringd.host.notify) ----------------------------------------
    def open_notify(self, run_id: int):
        parked, self._parked_notify = self._parked_notify, None
        if parked is not None:
            sock = parked.reuse(self.state_dir, run_id)
            if sock is not None:
                return sock
            self._sweep_sockets = True   # whatever replaced the parked file goes too
        sock = voice.NotifySocket.open(self.state_dir, run_id, sweep=self._sweep_sockets)
        self._sweep_sockets = False   # once per driver, then only after a close that left one behind
        return sock

    def close_notify(self, sock) -> None:
        """The run's socket file is gone from its path: parked for the next run
        (NotifySocket.park), else closed and unlinked."""
        if sock.park(self.state_dir):
            self._parked_notify = sock
        elif not sock.close():
            self._sweep_sockets = True
        if self._notes_written:
            voice.remove_notes(self.state_dir)
            self._notes_written = False

    def write_notes(self, notes, now: float) -> None:
        self._notes_written = True   # set first: a partial write is removed too
        voice.write_notes(self.state_dir, notes, now)


def log_open_reason(e: OSError) -> str:
    """Say plainly when the log path was tampered with (never followed)."""
    if e.errno in (errno.ELOOP, errno.ENOTDIR):
        return "a symbolic link (or a non-directory) is in the way; refusing to follow it"
    if e.errno == errno.EEXIST:
        return "a file or symbolic link is already there; refusing to write through it"
    return proctree.errno_reason(e)


def stderr_logger(message: str, level: int = logline.INFO) -> None:
    """The driver's log line (``ringd.host.logline``: UTC Z, priorities under
    journald). Every call states its level (tests/unit/test_conventions.py
    checks it); the default only keeps a call that does not from failing."""
    logline.emit("ringd", message, level)
