"""Per-run cgroup v2 containment: each run's processes live in a cgroup of
their own, however they fork, setsid or clear their environment; the run ends
with ``cgroup.kill`` (every process in it, atomically, no pid races) and its
CPU time is read from ``cpu.stat``.

Where: a child of the driver's own cgroup on the cgroup2 mount. That works as
root on a writable cgroup2 mount (``/sys/fs/cgroup`` or the hybrid
``/sys/fs/cgroup/unified``) and in a subtree systemd delegated to the driver
(``Delegate=yes``): creating a child cgroup and moving a process into it needs
no controllers, and ``cpu.stat`` exists in every cgroup. :func:`detect` finds
it and :meth:`Containment.prove` proves the whole mechanism once (create, step
in and back out, remove); where that fails the driver falls back to the
subreaper rule (proctree) and says why once.

The agent is born in its cgroup: the driver steps into the run's cgroup for
the fork and back out right after (:meth:`Containment.spawn_into`), so the
agent is inside before it runs a single instruction, and the spawn stays a
vfork with no Python code between fork and exec. A record
``<state>/run.cgroup`` names where this ring's run cgroups live (written once
per driver, as it proves containment, not per run), so a reaper that finds a dead
driver's run kills that run's cgroup too (:func:`kill_recorded`).
"""
from __future__ import annotations

import errno
import importlib
import os
import signal
import time
from pathlib import Path
from typing import Callable, List, Optional, Tuple, TypeVar

from ringd.host.procid import read_list, read_small, same_process, start_ticks

T = TypeVar("T")

RECORD = "run.cgroup"
KILL_WAIT = 5.0        # s: bound on waiting for a killed cgroup to empty
_SELF_CGROUP = "/proc/self/cgroup"
_MOUNTINFO = "/proc/self/mountinfo"


class RunCgroup:
    """One run's cgroup."""

    def __init__(self, path: "Path | str"):
        self.dir = os.fspath(path)   # a str: the hop's path operations are f-strings, not pathlib
        # cgroup.procs, cgroup.events and cpu.stat, when opened ahead (open_ahead)
        self._procs: Optional[int] = None
        self._events: Optional[int] = None
        self._stat: Optional[int] = None
        # still populated when its run ended (a process SIGKILL cannot end): the
        # driver's exit does not wait for it to empty (Containment.finish)
        self.stuck = False

    def open_ahead(self) -> None:
        """Open the three files a run's start and end touch (``cgroup.procs``
        to step in, ``cgroup.events`` and ``cpu.stat`` at its end) now: while
        another agent runs, not between two runs. Best effort: a file not
        opened here is opened when it is used, as before. Closed by
        :meth:`remove` (or :meth:`close_files`)."""
        if self._stat is not None:
            return
        try:
            self._procs = os.open(f"{self.dir}/cgroup.procs", os.O_WRONLY | os.O_CLOEXEC)
            self._events = os.open(f"{self.dir}/cgroup.events", os.O_RDONLY | os.O_CLOEXEC)
            self._stat = os.open(f"{self.dir}/cpu.stat", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            self.close_files()

    def close_files(self) -> None:
        for fd in (self._procs, self._events, self._stat):
            if fd is not None:
                os.close(fd)
        self._procs = self._events = self._stat = None

    def _read(self, fd: Optional[int], name: str) -> bytes:
        """A cgroup file read whole: through its descriptor opened ahead (a
        cgroupfs file read from offset 0 is generated afresh), else by path."""
        return os.pread(fd, 65536, 0) if fd is not None else read_small(f"{self.dir}/{name}")

    @property
    def path(self) -> Path:
        return Path(self.dir)

    def join(self) -> None:
        """Move the calling process into this cgroup."""
        fd, self._procs = self._procs, None   # (of no use once we are in)
        if fd is None:
            _write_pid0(f"{self.dir}/cgroup.procs")
            return
        try:
            os.write(fd, b"0")   # "0": the writer itself
        finally:
            os.close(fd)

    def pids(self) -> List[int]:
        """Every process in the cgroup's subtree: an agent running as root can
        make sub-cgroups of its run's and move processes into them."""
        out: List[int] = []
        for d in self.subtree():
            try:
                out.extend(int(x) for x in read_list(f"{d}/cgroup.procs").split())   # (past its first page)
            except (OSError, ValueError):
                pass
        return out

    def subtree(self) -> List[str]:
        """This cgroup's directory and every sub-cgroup's, children after their parents."""
        dirs, i = [self.dir], 0
        while i < len(dirs):
            try:
                with os.scandir(dirs[i]) as it:
                    dirs.extend(e.path for e in it if e.is_dir(follow_symlinks=False))
            except OSError:
                pass
            i += 1
        return dirs

    def populated(self) -> bool:
        try:
            for line in self._read(self._events, "cgroup.events").splitlines():
                if line.startswith(b"populated "):
                    return line.split()[1] != b"0"
        except OSError:
            return False
        return bool(self.pids())

    def kill(self, timeout: float = KILL_WAIT, reap: Callable[[], object] = lambda: None,
             spare: Optional[Tuple[int, int]] = None) -> bool:
        """SIGKILL every process in the cgroup and wait (bounded) until it is
        empty; ``reap`` collects exited children of ours meanwhile. True if empty.
        ``spare``: a live driver, (pid, start ticks), that may be inside (see
        :func:`kill_recorded`): never signalled, and no ``cgroup.kill``; True
        once nothing else is left."""
        deadline = time.monotonic() + timeout
        while True:
            if not self.populated():
                return True   # empty (or gone)
            if spare is None:
                self.signal_kill()
            elif not self._kill_all_but(spare):
                return True   # nothing but the driver
            reap()
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.005)

    def signal_kill(self) -> None:
        """SIGKILL everything in the cgroup now, without waiting."""
        try:
            _write_small(f"{self.dir}/cgroup.kill", b"1")
        except OSError:
            self._freeze_and_kill()   # a kernel before 5.14: no cgroup.kill

    def _freeze_and_kill(self) -> None:
        """Frozen, nothing in the cgroup can fork while we kill each process."""
        freeze = f"{self.dir}/cgroup.freeze"
        try:
            _write_small(freeze, b"1")
        except OSError:
            pass
        for pid in self.pids():
            try:
                os.kill(pid, signal.SIGKILL)   # a pid listed in a frozen cgroup cannot be recycled
            except OSError:
                pass
        try:
            _write_small(freeze, b"0")
        except OSError:
            pass

    def _kill_all_but(self, spare: Tuple[int, int]) -> int:
        """SIGKILL each process in the cgroup but ``spare``; returns how many.
        Not frozen (a driver inside would freeze with them, and stay frozen
        should we die before thawing it): each listed pid's start ticks are
        read, and it is signalled only if still listed and still that process
        (proctree.signal_process), so a pid recycled meanwhile is either the
        run's own new process or not signalled at all."""
        from ringd.host.proctree import signal_process
        ticks = {pid: start_ticks(pid) for pid in self.pids()
                 if not (pid == spare[0] and same_process(*spare))}
        listed = set(self.pids())
        return sum(1 for pid, t in ticks.items()
                   if t is not None and pid in listed and signal_process(pid, t, signal.SIGKILL))

    def cpu_seconds(self) -> Optional[float]:
        """CPU time (user + system) of everything that ran in the cgroup."""
        try:
            for line in self._read(self._stat, "cpu.stat").splitlines():
                if line.startswith(b"usage_usec "):
                    return int(line.split()[1]) / 1e6
        except (OSError, ValueError):
            pass
        return None

    def remove(self, timeout: float = KILL_WAIT) -> bool:
        """rmdir the cgroup and any sub-cgroups (it must be empty; retried while
        the kernel releases the last exited task). True if it is gone."""
        self.close_files()
        deadline = time.monotonic() + timeout
        while True:
            gone = _rmdir(self.dir)
            if gone is None and _has_subdirs(self.dir):
                # Busy with sub-cgroups the agent (as root) made: rmdir never
                # takes them along. (Else the kernel still releases a task.)
                for sub in reversed(self.subtree()[1:]):   # deepest first
                    _rmdir(sub)
                gone = _rmdir(self.dir)
            if gone is not None:
                return gone
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.005)


class Containment:
    """How a driver contains its runs: ``kind`` is ``"cgroup"`` or ``"subreaper"``
    (``driver.containment`` in ``ringd status --json``)."""

    def __init__(self, state_dir: Path, parent: Optional[Path], reason: Optional[str] = None):
        self.state_dir = state_dir
        self.parent = parent
        self.reason = reason       # why not cgroup, for the one log line
        self.prefix = ring_prefix(state_dir)
        self.recorded = False      # the record a reaper reads is written (once per driver)
        self.stranded: Optional[str] = None   # why we could not step back out of a run cgroup
        self._home: Optional[int] = None      # our own cgroup.procs, kept open for every step back out
        self.proven = False        # prove() has run: no run cgroup before

    @property
    def kind(self) -> str:
        return "cgroup" if self.parent is not None else "subreaper"

    def prove(self) -> None:
        """Prove the whole mechanism once, the way every spawn will use it: make a
        probe cgroup, step in and back out, remove it. Where that fails, the
        driver contains its runs with the subreaper rule alone (``kind``,
        ``reason``). Never raises.

        The driver proves it just before its first run (RealEnv.prove_containment),
        not at start-up: the first cgroup migration after a quiet spell waits for
        an RCU grace period (4-30 ms here, in the kernel's cgroup lock),
        and a second one within the next grace period does not - so the first
        run's step into its cgroup no longer waits."""
        if self.proven or self.parent is None:
            return
        self.proven = True
        parent = self.parent
        try:   # the record a reaper reads: here, off the first run (an fsync'd write); else at the first create
            _write_record(self.state_dir, parent)
            self.recorded = True
        except OSError:
            pass
        try:
            probe = RunCgroup(parent / f"{self.prefix}-probe-{os.getpid()}")
            try:
                os.mkdir(probe.path)
            except FileExistsError:
                pass
            inside = False
            try:
                if not (probe.path / "cgroup.kill").exists() and not (probe.path / "cgroup.freeze").exists():
                    self.parent, self.reason = None, "the kernel has neither cgroup.kill nor cgroup.freeze"
                    return
                probe.join()   # the way every spawn will: step in, then back home
                inside = True
                _write_pid0(f"{parent}/cgroup.procs")
                inside = False
            finally:
                if not inside:   # a cgroup that holds us is never killed
                    probe.kill()
                    probe.remove()
        except OSError as e:
            self.parent, self.reason = None, f"cannot use cgroup v2: {e.strerror or e}"

    def create(self, run_id: int) -> Optional[RunCgroup]:
        """A fresh cgroup for ``run_id`` (None in subreaper mode, or if it cannot
        be made now - the run is then contained by the subreaper rule alone).
        The record for a later reaper is written first, if :meth:`prove` could not."""
        if self.parent is None or not self.proven:
            return None
        cg = RunCgroup(f"{self.parent}/{self.prefix}-run-{run_id}")
        try:
            if not self.recorded:
                _write_record(self.state_dir, self.parent)
                self.recorded = True
            os.mkdir(cg.dir)
        except FileExistsError:
            pass   # a dead driver's cgroup of the same run id: reused, it is ours
        except OSError:
            return None
        return cg

    def spawn_into(self, cg: RunCgroup, spawn: Callable[[], T]) -> "tuple[T, Optional[RunCgroup]]":
        """Call ``spawn`` (one fork/exec) from inside ``cg``: a child is born in
        its parent's cgroup. Then step back home, to our own cgroup. Returns
        (what ``spawn`` returned, the cgroup the child is contained by). Should
        we fail to get back out, that cgroup is never killed (it holds us): the
        child is left to the subreaper rule, and so is every later run
        (``stranded`` says why). Raises OSError if we cannot step in."""
        cg.join()
        try:
            result = spawn()
        finally:
            try:
                self._step_home()
            except OSError as e:
                self.stranded = f"cannot leave {cg.dir}: {e.strerror or e}"
                self.parent, self.reason = None, self.stranded
        return result, (None if self.stranded else cg)

    def finish(self, cg: RunCgroup, reap: Callable[[], object] = lambda: None, remove: bool = True,
               wait: float = KILL_WAIT) -> Optional[float]:
        """End of a run: kill everything in its cgroup (waiting up to ``wait`` for
        it to empty), read its CPU time, remove it (``remove=False``: the caller
        removes it later, empty). Returns cpu_seconds (None if unknown)."""
        cg.stuck = not cg.kill(timeout=wait, reap=reap)
        cpu = cg.cpu_seconds()
        if remove:
            cg.remove()
        return cpu

    def _step_home(self) -> None:
        """Back to our own cgroup: one write to its ``cgroup.procs``, kept open."""
        if self._home is None:
            self._home = os.open(f"{self.parent}/cgroup.procs", os.O_WRONLY | os.O_CLOEXEC)
        os.write(self._home, b"0")

    def close(self) -> None:
        """The driver is done (RealEnv.close)."""
        home, self._home = self._home, None
        if home is not None:
            os.close(home)


def ring_prefix(state_dir: Path) -> str:
    """Names this ring's cgroups: two rings on one host never share one."""
    return "ring-" + _sha256_hex(str(state_dir).encode())[:12]


def _sha256_hex(data: bytes) -> str:
    """SHA-256 by CPython's own implementation: ``hashlib`` loads OpenSSL's
    libcrypto, 3.7 MB of a daemon's RSS for this one digest at start-up. The
    module is ``_sha256`` in Python 3.11 and ``_sha2`` from 3.12; hashlib
    where neither exists. (The same digest: the prefix must not change under
    a ring whose dead driver left cgroups behind.)"""
    for name in ("_sha2", "_sha256"):
        try:
            return importlib.import_module(name).sha256(data).hexdigest()
        except (ImportError, AttributeError):
            continue
    import hashlib
    return hashlib.sha256(data).hexdigest()


def detect(state_dir: Path, prove: bool = True) -> Containment:
    """Find a cgroup2 hierarchy where we may create run cgroups and (``prove``)
    prove it works: :meth:`Containment.prove`. Never raises."""
    try:
        parent = _own_cgroup_dir()
        if parent is None:
            return Containment(state_dir, None, "no cgroup2 hierarchy (cgroup v1 only, or not Linux)")
        if not os.access(parent, os.W_OK):
            return Containment(state_dir, None, f"{parent} is not writable (not root, no Delegate=yes)")
    except OSError as e:
        return Containment(state_dir, None, f"cannot use cgroup v2: {e.strerror or e}")
    c = Containment(state_dir, parent)
    if prove:
        c.prove()
    return c


def _rmdir(path: str) -> Optional[bool]:
    """rmdir a cgroup: True if it is gone, None if it is busy, False if it cannot be."""
    try:
        os.rmdir(path)
        return True
    except FileNotFoundError:
        return True
    except OSError as e:
        return None if e.errno == errno.EBUSY else False


def _has_subdirs(path: str) -> bool:
    """One stat: cgroupfs (kernfs) counts a directory's sub-directories in its links."""
    try:
        return os.stat(path).st_nlink > 2
    except OSError:
        return False


def _write_pid0(procs: str) -> None:
    _write_small(procs, b"0")   # "0": the writer itself


def _write_small(path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


def _own_cgroup_dir() -> Optional[Path]:
    """Our cgroup's directory on the cgroup2 mount ("0::/path" in /proc/self/cgroup)."""
    try:
        with open(_SELF_CGROUP) as f:
            rel = next((ln.rstrip("\n")[3:] for ln in f if ln.startswith("0::")), None)
        with open(_MOUNTINFO) as f:
            mounts = [ln.split() for ln in f]
    except OSError:
        return None
    if rel is None:
        return None
    for fields in mounts:
        # "36 25 0:31 <root> <mountpoint> <opts> [optional...] - cgroup2 cgroup2 rw"
        sep = fields.index("-") if "-" in fields else -1
        if sep > 0 and len(fields) > sep + 1 and fields[sep + 1] == "cgroup2":
            root, mountpoint = fields[3], fields[4]
            inner = os.path.relpath(rel, root) if rel.startswith(root) else None
            if inner is None:
                continue
            path = Path(mountpoint) / ("" if inner == "." else inner)
            if path.is_dir():
                return path
    return None


# --- the record a reaper reads ---------------------------------------------------

def _write_record(state_dir: Path, parent: Path) -> None:
    from ringd.host.atomicfile import write_json_atomic
    write_json_atomic(state_dir / RECORD, {"parent": str(parent)})


def _recorded_parent(state_dir: Path) -> Optional[Path]:
    from ringd.host.atomicfile import read_json
    try:
        parent = Path((read_json(state_dir / RECORD) or {})["parent"])
    except (KeyError, TypeError):
        return None
    return parent if parent.is_absolute() else None


def left(deadline: float) -> float:
    """Seconds until the monotonic ``deadline`` (0 once it has passed): what a
    wait that shares a bound with the waits before it may still take."""
    return max(0.0, deadline - time.monotonic())


def sweep(state_dir: Path, also: Optional[Path] = None, deadline: Optional[float] = None) -> int:
    """Kill and remove every run (and probe) cgroup of this ring: where the record
    says they live, and under ``also`` (the driver's own cgroup). Only for a
    caller that holds the ring's lock with no other driver alive (the driver at
    start-up): every such cgroup is then a dead driver's, e.g. one whose row an
    operator closed before that driver was killed, or the probe of one killed
    while it proved containment. Returns how many were removed.
    Waits until ``deadline`` (monotonic; default KILL_WAIT from now) in all,
    not per cgroup: each is killed before any is waited on, and one that
    processes SIGKILL cannot end (a hung mount) hold on to is left as it is -
    the driver starts anyway."""
    deadline = time.monotonic() + KILL_WAIT if deadline is None else deadline
    prefixes = tuple(ring_prefix(state_dir) + kind for kind in ("-run-", "-probe-"))
    found = []
    for parent in {p for p in (_recorded_parent(state_dir), also) if p is not None}:
        try:
            found += [RunCgroup(parent / n) for n in os.listdir(parent) if n.startswith(prefixes)]
        except OSError:
            continue
    for cg in found:
        cg.kill(timeout=0.0)
    gone = 0
    for cg in found:
        cg.kill(timeout=left(deadline))
        gone += cg.remove(timeout=left(deadline))
    return gone


def kill_recorded(state_dir: Path, run_id: int, driver: Optional[Tuple[int, int]] = None,
                  deadline: Optional[float] = None) -> int:
    """Kill everything in ``run_id``'s cgroup, found where the record says this
    ring's run cgroups live: a dead driver's run (the reaper), or an operator's
    force-fail. Returns how many processes were in it.

    ``driver``: the run's driver, (pid, start ticks). While it lives, it may be
    in that cgroup: for the instant of each spawn (it steps in so that the
    agent is born there), and for good if it could not step back out. A
    ``cgroup.kill`` would then kill the driver too, so every other process is
    killed one by one instead, and the cgroup is left for the driver to remove
    (it does at the run's end). A dead driver's run cgroup is killed and removed.
    Its emptying and its removal wait until ``deadline`` (monotonic; default
    KILL_WAIT from now) in all: a cgroup that processes SIGKILL cannot end hold
    on to waited a bound for each."""
    deadline = time.monotonic() + KILL_WAIT if deadline is None else deadline
    parent = _recorded_parent(state_dir)
    if parent is None:
        return 0
    cg = RunCgroup(parent / f"{ring_prefix(state_dir)}-run-{run_id}")
    if not cg.path.is_dir():
        return 0
    if driver is not None and same_process(*driver):
        n = len([pid for pid in cg.pids() if pid != driver[0]])
        cg.kill(spare=driver, timeout=left(deadline))
        return n
    n = len(cg.pids())
    cg.kill(timeout=left(deadline))
    cg.remove(timeout=left(deadline))
    return n
