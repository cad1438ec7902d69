"""Processes: spawn an agent in its own session, signal it safely, and make sure
nothing it started outlives its run.

The driver (a child subreaper) recognises a run's processes as every live
descendant of its own except its helpers: one run is in flight at a time.
Where a per-run cgroup exists (ringd.host.cgroup) that is stronger still. A reaper,
whose run's driver is dead, recognises them by the process group and a key in
their environment unique to this ring *and* run (``RING_STATE`` +
``RING_RUN_ID``), so two rings on one host never touch each other's processes.
Single processes are signalled through a pidfd after checking their identity
(pid + start ticks, see procid), so a recycled pid is never hit. Used by the
hop, the reaper, skip, force-fail and the watcher alike.
"""
from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import gc
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Set, Tuple

from ringd.host import earlysig
from ringd.host import procid
from ringd.core.errors import EX_FAILURE

_PROC_CHILDREN = os.path.exists("/proc/self/task")   # Linux's /proc/<pid>/task/<tid>/children

if TYPE_CHECKING:
    # imported where it is needed: a driver whose runs leave nothing behind and
    # that finds no dead driver's run never loads it (0.7 MB of its RSS)
    import psutil

PR_SET_CHILD_SUBREAPER = 36
STRIPPED_ENV_PREFIXES = ("WATCHDOG_",)
STRIPPED_ENV_KEYS = ("NOTIFY_SOCKET", "RING_ECHO_FD")   # (the latter: a watcher's terminal for its driver only)


def set_child_subreaper() -> bool:
    """Make orphaned descendants re-parent to us (Linux), so escaped processes of
    a run can be found among our descendants and are reaped by us."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except OSError:
        return False


def clean_env(base: Mapping[str, str], extra: Mapping[str, str]) -> Dict[str, str]:
    """The environment for a child that must never speak to systemd as us."""
    env = {k: v for k, v in base.items()
           if k not in STRIPPED_ENV_KEYS and not k.startswith(STRIPPED_ENV_PREFIXES)}
    env.update(extra)
    return env


@dataclass
class Child:
    """A process we started as the leader of a new session."""
    pid: int
    pidfd: Optional[int]
    ticks: Optional[int] = None

    @property
    def start_time(self) -> Optional[int]:
        """Boot-relative start ticks (procid), never an epoch time; read when
        first asked, which is safe until we reap it (its pid cannot be reused).
        Not at the spawn: /proc/<pid>/stat then waits for the child's exec to
        finish (0.5 ms and more), time the caller can spend on its own work."""
        if self.ticks is None:
            self.ticks = procid.start_ticks(self.pid)
        return self.ticks

    def close(self) -> None:
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None


# Every signal a child can catch starts at its default, as a systemd service's
# do: whatever the driver inherited ignored (a shell's SIGINT/SIGQUIT for a
# background job, nohup's SIGHUP) or ignores itself (Python: SIGPIPE, SIGXFSZ)
# is not passed on. Naming them all is also the cheaper spawn: glibc's child
# then sets each once, instead of reading each disposition before setting it.
_DEFAULT_SIGNALS = frozenset(signal.valid_signals()) - {signal.SIGKILL, signal.SIGSTOP}


def spawn(argv: Sequence[str], *, cwd: Optional[str], env: Mapping[str, str], stdout_fd: int,
          umask: int = -1, signals_held: bool = False, pid_var: Optional[str] = None,
          pass_fd: Optional[Tuple[int, int]] = None) -> Child:
    """Start ``argv`` in its own session (so it leads a new process group),
    stdin /dev/null, stdout and stderr to ``stdout_fd``. One ``posix_spawn``
    (glibc's is a vfork: no Python code between fork and exec, and a fraction
    of Popen's cost); it inherits no descriptor of ours, as they are all
    close-on-exec (:func:`close_on_exec_all` at start-up, Python's default
    after). ``cwd`` and ``umask`` are ours for the instant of the spawn
    (posix_spawn has no chdir in Python 3.11), then restored.
    ``signals_held``: it starts with SIGTERM/SIGINT/SIGHUP/SIGUSR1 blocked (a
    daemon of ours, which unblocks them once it can handle them: earlysig).
    ``pid_var``: also give it that variable set to its own pid (``WATCHDOG_PID``,
    as systemd does): :func:`_fork_exec`, since the pid exists only after the fork.
    ``pass_fd`` (ours, its number; not with ``pid_var``): one more descriptor it
    gets (a terminal the watcher hands its driver).
    Raises OSError if it cannot be started (not found, not executable, not a
    format the kernel runs ...)."""
    if pid_var is not None and pass_fd is not None:
        raise ValueError("spawn: pass_fd is for posix_spawn, not with pid_var")
    actions = [(os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
               (os.POSIX_SPAWN_DUP2, stdout_fd, 1), (os.POSIX_SPAWN_DUP2, stdout_fd, 2)]
    if pass_fd is not None:
        actions.append((os.POSIX_SPAWN_DUP2, pass_fd[0], pass_fd[1]))
    with earlysig.held() if signals_held else contextlib.nullcontext(), _cwd_and_umask(cwd, umask):
        # looked up in the child's cwd, as exec in a child that chdir'ed would
        path = executable(argv[0], env)
        if pid_var is None:
            pid = os.posix_spawn(path, list(argv), env, file_actions=actions, setsid=True,
                                 setsigdef=_DEFAULT_SIGNALS)
        else:
            pid = _fork_exec(path, list(argv), env, stdout_fd, pid_var)
    pidfd = None
    if hasattr(os, "pidfd_open"):
        try:
            pidfd = os.pidfd_open(pid)
        except OSError:
            pidfd = None
    return Child(pid=pid, pidfd=pidfd)


def _fork_exec(path: str, argv: List[str], env: Mapping[str, str], stdout_fd: int, pid_var: str) -> int:
    """What :func:`spawn`'s posix_spawn does, by hand, for a child that sets
    ``pid_var`` to its own pid before its exec: no shell in between, so a
    program exec refuses (ENOEXEC: a script without ``#!``) raises OSError
    here as it does there. Between fork and exec the child only makes system
    calls: the collector is off and every signal blocked around the fork, so
    no finaliser or handler of the driver's runs in it. Exec's error comes back
    over a close-on-exec pipe; the child that failed is reaped here, by its
    pid - nothing else ever knew it."""
    env = dict(env)
    r, w = os.pipe2(os.O_CLOEXEC)
    collecting = gc.isenabled()
    gc.disable()
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
    try:
        pid = os.fork()
        if pid == 0:
            _exec_child(path, argv, env, stdout_fd, pid_var, w, mask)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        if collecting:
            gc.enable()
        os.close(w)
    try:
        failed = b""
        while chunk := os.read(r, 4):
            failed += chunk
    finally:
        os.close(r)
    if failed:
        os.waitpid(pid, 0)
        code = int.from_bytes(failed[:4], "little") or errno.EINVAL
        raise OSError(code, os.strerror(code), argv[0])
    return pid


def _exec_child(path: str, argv: List[str], env: Dict[str, str], stdout_fd: int, pid_var: str, w: int,
                mask) -> None:
    """The forked child's part of :func:`_fork_exec`: never returns."""
    code = errno.EINVAL
    try:
        os.setsid()
        os.dup2(stdout_fd, 1)
        os.dup2(stdout_fd, 2)
        null = os.open(os.devnull, os.O_RDONLY)
        if null != 0:
            os.dup2(null, 0)
            os.close(null)
        for sig in _DEFAULT_SIGNALS:
            try:
                signal.signal(sig, signal.SIG_DFL)
            except (OSError, ValueError):
                pass   # one the C library keeps for itself
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        env[pid_var] = str(os.getpid())
        os.execve(path, argv, env)
    except OSError as e:
        code = e.errno or code
    finally:
        try:
            os.write(w, code.to_bytes(4, "little"))
        finally:
            os._exit(127)


def executable(prog: str, env: Mapping[str, str]) -> str:
    """The file exec would run for ``prog``: a path as given; a bare name looked
    up on the child's PATH as execvp does (the first executable match; if none,
    the first match at all, so the spawn fails with its EACCES). Raises
    FileNotFoundError when there is no match."""
    if "/" in prog:
        return prog
    denied = None
    for folder in os.get_exec_path(env):
        path = os.path.join(folder, prog)
        if os.access(path, os.X_OK) and not os.path.isdir(path):
            return path
        if denied is None and os.path.exists(path):
            denied = path
    if denied is None:
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), prog)
    return denied


@contextlib.contextmanager
def _cwd_and_umask(cwd: Optional[str], umask: int):
    home = None
    if cwd is not None:
        try:
            home = os.open(".", getattr(os, "O_PATH", os.O_RDONLY) | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError:
            home = None   # our own folder is gone: come back to / instead
        try:
            os.chdir(cwd)
        except BaseException:
            if home is not None:
                os.close(home)
            raise
    old_umask = os.umask(umask) if umask >= 0 else None
    try:
        yield
    finally:
        # never raises: an error here would lose a child that has started
        if old_umask is not None:
            os.umask(old_umask)
        if cwd is not None:
            try:
                if home is None:
                    raise FileNotFoundError
                os.fchdir(home)
            except OSError:
                os.chdir("/")
            finally:
                if home is not None:
                    os.close(home)


def close_on_exec_all() -> None:
    """Mark every descriptor above stderr close-on-exec: one a daemon inherited
    from whoever started it (a shell, a supervisor) would otherwise leak into
    every agent it spawns. Called once at a daemon's start."""
    try:
        fds = [int(n) for n in os.listdir("/proc/self/fd")]
    except OSError:
        fds = list(range(3, 1024))
    for fd in fds:
        if fd > 2:
            try:
                os.set_inheritable(fd, False)
            except OSError:
                pass


def wait_exit(pidfd: Optional[int], timeout: float) -> bool:
    """Bounded wait until the process behind ``pidfd`` has exited (a pidfd turns
    readable then). True if it has; without a pidfd, False at once."""
    if pidfd is None:
        return False
    import select
    try:
        ready, _, _ = select.select([pidfd], [], [], timeout)
    except (OSError, ValueError):
        return False
    return bool(ready)


def peek_exit(pid: int) -> Optional[int]:
    """The wait status of our child ``pid`` if it has exited, without reaping it:
    while it is an unreaped zombie its pid and process group id cannot be reused,
    so signalling the group stays safe until we reap it."""
    try:
        res = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return None
    if res is None or res.si_pid == 0:
        return None
    if res.si_code == os.CLD_EXITED:
        return res.si_status << 8
    return res.si_status  # killed by a signal (CLD_KILLED / CLD_DUMPED)


def decode_status(status: int) -> "tuple[Optional[int], Optional[int]]":
    """(exit_code, signal) from a wait status."""
    if os.WIFSIGNALED(status):
        return None, os.WTERMSIG(status)
    if os.WIFEXITED(status):
        return os.WEXITSTATUS(status), None
    return None, None


def signal_group(pgid: int, sig: int) -> bool:
    try:
        os.killpg(pgid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def signal_process(pid: int, start_time: Optional[int], sig: int) -> bool:
    """Signal ``pid`` only if it is still the process that started at ``start_time``
    (start ticks, procid; None: signal whatever has that pid now). With a pidfd
    the check and the signal cannot race with pid reuse; without one (no
    ``pidfd_open`` before Linux 5.3) the check comes just before the signal."""
    fd = None
    if hasattr(os, "pidfd_open"):
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            return False
        except OSError:
            fd = None
    if fd is not None:
        try:
            if start_time is not None and not procid.same_process(pid, start_time):
                return False
            signal.pidfd_send_signal(fd, sig)
            return True
        except OSError:
            return False
        finally:
            os.close(fd)
    if start_time is not None and not procid.same_process(pid, start_time):
        return False
    try:
        os.kill(pid, sig)
        return True
    except OSError:
        return False


def _belongs_to_run(p: psutil.Process, state_key: str, run_id: int, pgid: Optional[int]) -> bool:
    import psutil
    try:
        if pgid is not None and os.getpgid(p.pid) == pgid:
            return True
        env = p.environ()
    except (psutil.Error, OSError):
        return False
    return env.get("RING_STATE") == state_key and env.get("RING_RUN_ID") == str(run_id)


# Our own helpers (alert commands): live descendants of the driver that are not
# the current run's. pid -> start ticks, so a recycled pid is not a helper.
_helpers: Dict[int, int] = {}


def register_helper(pid: int) -> None:
    """Mark a process we started for ourselves (not for a run): kill_run spares
    it and its descendants."""
    ticks = procid.start_ticks(pid)
    if ticks is not None:
        _helpers[pid] = ticks
    for old in [h for h, t in _helpers.items() if not procid.same_process(h, t)]:
        del _helpers[old]


def has_helpers() -> bool:
    """Have we started helpers that may still need reaping?"""
    return bool(_helpers)


def _live_helpers() -> Set[int]:
    return {h for h, t in _helpers.items() if procid.same_process(h, t)}


def helpers_running() -> int:
    """How many of our helpers are still running (or not yet reaped)."""
    return len(_live_helpers())


def run_descendants(exclude: Iterable[int] = (), dead: Iterable[int] = ()) -> List[Tuple[int, int]]:
    """The current run's processes as the driver sees them: every live
    descendant of ours except our helpers and theirs (one run in flight at a
    time; the driver is a subreaper, so escapees re-parent to us), and except
    ``exclude`` itself (its descendants are still listed). ``dead``: processes
    known to have exited (a zombie's children are already ours): not walked.
    Each as (pid, start ticks), the ticks read as it was listed: signalled by
    :func:`signal_process` with them, a pid that died and was recycled after
    the walk is never hit."""
    excluded = set(exclude)
    return [(pid, t) for pid, t in _descendant_ids(set(_live_helpers()) | set(dead)) if pid not in excluded]


def run_processes(state_key: str, run_id: int, pgid: Optional[int]) -> List[Tuple[int, int]]:
    """Live processes of a run anywhere on the host: members of its process
    group, and processes whose environment carries this ring's and run's key.
    Each as (pid, start ticks), the ticks read before it was judged the run's:
    a pid recycled meanwhile is then never signalled (:func:`signal_process`)."""
    import psutil
    me = os.getpid()
    out = []
    for p in psutil.process_iter():
        ticks = procid.start_ticks(p.pid) if p.pid != me else None
        if ticks is not None and _belongs_to_run(p, state_key, run_id, pgid):
            out.append((p.pid, ticks))
    return out


def _descendant_ids(spare: Set[int]) -> List[Tuple[int, int]]:
    """Our live descendants but the subtrees rooted at ``spare``, as (pid,
    start ticks). On Linux walk /proc/<pid>/task/*/children down from us (a
    few small reads) instead of scanning every process on the host; a child
    is listed with the ticks read together with its parent's pid, and only if
    that is still the parent it was found under (not a pid recycled since)."""
    found = _descendant_ids_linux(spare)
    if found is not None:
        return found
    import psutil   # no CONFIG_PROC_CHILDREN (or not Linux): a full scan
    try:
        procs = psutil.Process().children(recursive=True)
    except psutil.Error:
        return []
    spared = set(spare)
    out = []
    for p in procs:   # children(recursive) lists parents before their children
        try:
            if p.pid in spared or p.ppid() in spared:
                spared.add(p.pid)
                continue
        except psutil.Error:
            continue
        ticks = procid.start_ticks(p.pid)
        if ticks is not None:
            out.append((p.pid, ticks))
    return out


def _children_of(pid: int) -> Optional[List[int]]:
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return []
    except OSError:
        return None
    kids: List[int] = []
    for tid in tids:
        try:
            kids.extend(int(x) for x in procid.read_list(f"/proc/{pid}/task/{tid}/children").split())
        except FileNotFoundError:
            continue
        except OSError:
            return None
    return kids


def _own_children() -> Optional[List[int]]:
    """Our direct children. A child hangs off the thread that started it, and an
    orphan re-parented to us off our main thread (the kernel's first live
    thread of the subreaper): while we are one thread - the driver always is
    (tests/system/test_footprint.py) - that is one file, not a listing of our threads."""
    if not _PROC_CHILDREN:
        return None
    if threading.active_count() == 1:
        me = os.getpid()
        try:
            return [int(x) for x in procid.read_list(f"/proc/{me}/task/{me}/children").split()]
        except OSError:
            return None
    return _children_of(os.getpid())


def _descendant_ids_linux(spare: Set[int]) -> Optional[List[Tuple[int, int]]]:
    found: List[Tuple[int, int]] = []
    todo: List[int] = []
    parent, kids = os.getpid(), _own_children()
    while kids is not None:
        for kid in kids:
            if kid in spare:
                continue
            seen = procid.parent_and_ticks(kid)
            if seen is None or seen[0] != parent:
                continue   # gone, a zombie, or re-parented (found under us next walk) or recycled
            found.append((kid, seen[1]))
            todo.append(kid)
        if not todo:
            return found
        parent = todo.pop()
        kids = _children_of(parent)
    return None  # no CONFIG_PROC_CHILDREN: fall back to a full scan


def reap_zombie_children(keep: Iterable[int] = ()) -> Dict[int, int]:
    """waitpid every exited child of ours except ``keep`` (the agent leader we
    still want to read). Returns {pid: status}."""
    keep = set(keep)
    reaped: Dict[int, int] = {}
    if not keep:   # any exited child will do: one wait each, no walk of /proc
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return reaped
            if not pid:
                return reaped
            reaped[pid] = status
    for child in child_pids():
        if child in keep:
            continue
        try:
            pid, status = os.waitpid(child, os.WNOHANG)
        except ChildProcessError:
            continue
        if pid:
            reaped[pid] = status
    return reaped


def child_pids() -> List[int]:
    """Pids of our direct children (cheap on Linux: /proc/self/task/*/children)."""
    pids = _own_children()
    if pids is not None:
        return pids
    import psutil
    try:
        return [c.pid for c in psutil.Process().children()]
    except psutil.Error:
        return []


KILL_RUN_WAIT = 3.0   # s: bound on waiting for a run's SIGKILLed processes to be gone


def kill_run(state_key: str, run_id: int, pgid: Optional[int], *, scope: str = "descendants",
             keep_unreaped: Iterable[int] = (), dead: Iterable[int] = (), timeout: float = KILL_RUN_WAIT,
             unkillable: Optional[Dict[int, int]] = None) -> int:
    """SIGKILL every process of a run and wait (bounded) until none is left.

    ``scope="descendants"`` (the driver, at the end of its run): every live
    descendant of ours except our helpers (register_helper). One run is in
    flight at a time and the driver is a subreaper, so every other descendant
    is that run's, whatever its session, group or environment (``setsid env -i``
    included). ``scope="host"``: processes anywhere on the host that carry the
    run's key or group (the reaper, when the run's driver is dead). ``dead``:
    our children known to have exited (not walked into). ``pgid`` is signalled
    and matched in every round: only for a group whose id cannot be reused
    meanwhile (its leader our own child, kept an unreaped zombie).
    ``unkillable``: filled with the processes (pid: start ticks) still alive
    at the bound though SIGKILLed at least half of it before (uninterruptible
    sleep, a cgroup v1 freezer; or not ours to signal: a setuid program under
    a driver that is not root), for the caller to spare from then on - never
    a fork bomb's newest children, first signalled only just now.
    Returns how many processes were signalled."""
    keep = set(keep_unreaped)
    first: Dict[Tuple[int, int], float] = {}   # (pid, start ticks) -> when first listed to be SIGKILLed
    killed: Set[Tuple[int, int]] = set()
    deadline = time.monotonic() + timeout
    while True:
        if pgid is not None:
            signal_group(pgid, signal.SIGKILL)
        if scope == "descendants":
            victims = run_descendants(exclude=keep, dead=dead)
        else:
            victims = [(pid, t) for pid, t in run_processes(state_key, run_id, pgid) if pid not in keep]
        if not victims:
            # (the run's zombies are collected on their SIGCHLD, as helpers are)
            return len(killed)
        now = time.monotonic()
        for victim in victims:   # identity as listed: a pid recycled since is not hit
            first.setdefault(victim, now)
            if signal_process(*victim, signal.SIGKILL):
                killed.add(victim)
        reap_zombie_children(keep)
        if now >= deadline:
            if unkillable is not None:
                unkillable.update(v for v in victims
                                  if first[v] <= now - timeout / 2 and procid.same_process(*v))
            return len(killed)
        time.sleep(0.01)


def call_as(uid: int, gid: int, fn: Callable[[], int]) -> int:
    """``fn()`` (a count) in a forked child that has become ``uid``/``gid`` (no
    supplementary groups): its kills and its reads of other processes are
    then held to what that user may do by the kernel itself. 0 if the child
    cannot switch or fails."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:   # the child: never returns into the caller's code
        code = EX_FAILURE
        try:
            os.close(r)
            os.setgroups([])
            os.setresgid(gid, gid, gid)
            os.setresuid(uid, uid, uid)
            os.write(w, str(int(fn())).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    try:
        with os.fdopen(r, "rb") as f:
            out = f.read()
    finally:
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:
            pass   # collected by a subreaper's own reaping meanwhile
    try:
        return int(out or b"0")
    except ValueError:
        return 0


def errno_reason(e: OSError) -> str:
    name = errno.errorcode.get(e.errno or 0, "")
    return f"{e.strerror or e}{f' ({name})' if name else ''}"
