"""Agents that talk back: the per-run notify socket (systemd's sd_notify
protocol), what a datagram means, who may speak, and the small file that shows
the current run's phase to ``ringd status``.

Each run gets ``<state>/notify-<run_id>.sock`` (in a short private directory if
that path is too long for a socket address): a SOCK_DGRAM unix socket, mode
0600, with SO_PASSCRED, so every datagram carries its sender's pid
(SCM_CREDENTIALS). Only processes of the current run are heard: the agent, a
member of its session or process group, or a process whose ancestry reaches the
agent (``systemd-notify`` run by a script), or an orphan of the run re-parented
to the subreaper driver that carries the run's key (``RING_STATE`` +
``RING_RUN_ID``). Datagrams over 4 KiB, malformed ones and strangers' are
dropped; file descriptors passed along (sd_notify_barrier's) are closed at once,
never waiting on one (:func:`bury`). The driver drains the
socket non-blocking with a cap per wake-up, so a flood can never keep it from
beating.

This module is on the path of ``ringd notify``: stdlib only at import time.
"""
from __future__ import annotations

import array
import os
import re
import socket
import stat
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, Optional, Tuple

MAX_DATAGRAM = 4096        # bytes; anything larger is dropped (SPEC)
PHASE_CHARS = 200          # a longer STATUS= is cut to this many characters
DRAIN_CAP = 256            # datagrams read per wake-up: a flood never starves the loop
PURGE_CAP = 1024           # datagrams purged from a parked socket before its reuse (then a fresh one)
NOTES_MIN_INTERVAL = 1.0   # s between writes of notify.json (phase, last ping)
NOTES_FILE = "notify.json"
SOCKET_PREFIX = "notify-"
IDLE_SOCKET = SOCKET_PREFIX + "idle.sock"   # a parked socket between runs (swept like the others)
# fds one datagram can carry (the kernel's SCM_MAX_FD): room for all of them, since
# those that do not fit are released by the kernel inside our recvmsg - a release
# that can block as a close can (bury)
_MAX_FDS = 253
_UCRED = struct.Struct("3i")
_CMSG_SPACE = socket.CMSG_SPACE(_UCRED.size) + socket.CMSG_SPACE(_MAX_FDS * 4)
# passed fds arrive close-on-exec: none can reach an agent started before it is closed
_RECV_FLAGS = getattr(socket, "MSG_CMSG_CLOEXEC", 0)
_KEY = re.compile(r"[A-Z][A-Z0-9_]*")
# C0 and C1 controls (escape sequences, newlines), and what splits a line or
# reorders its text in Unicode-aware tools: the line and paragraph separators,
# bidirectional marks, embeddings, overrides and isolates, and the BOM
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028-\u202e\u2066-\u2069\ufeff]")
_SUN_PATH_MAX = 107        # bytes usable in sockaddr_un.sun_path (108 with the NUL)


# --- what a datagram says (pure) ----------------------------------------------------

def parse_datagram(data: bytes) -> Optional[Dict[str, str]]:
    """``KEY=VALUE`` lines -> dict, or None when the datagram is empty, too big
    or malformed (a line without ``=``, a key that is not upper-case
    ``[A-Z0-9_]``, a NUL byte). Later keys win over earlier ones."""
    if not data or len(data) > MAX_DATAGRAM or b"\x00" in data:
        return None
    text = data.decode("utf-8", errors="replace")
    fields: Dict[str, str] = {}
    for line in text.split("\n"):
        if not line:
            continue
        key, sep, value = line.partition("=")
        if not sep or not _KEY.fullmatch(key):
            return None
        fields[key] = value
    return fields or None


def without_controls(text: str) -> str:
    """``text`` with its control characters (escape sequences, newlines, Unicode
    line separators and bidirectional controls) made spaces: text someone else
    wrote that an operator's terminal shows (a phase, a force-fail reason) can
    neither move its cursor nor reorder what is shown beside it."""
    return _CONTROL.sub(" ", text)


def clean_phase(text: str) -> str:
    """A STATUS= text as a one-line phase (:func:`without_controls`), cut to
    :data:`PHASE_CHARS`."""
    return without_controls(text)[:PHASE_CHARS].strip()


def watchdog_usec(seconds: float) -> str:
    """``WATCHDOG_USEC`` for a watchdog of ``seconds``: at least 1, since 0 means
    "no watchdog" to libsystemd (``sd_watchdog_enabled``), and the driver would
    still end the run."""
    return str(max(1, int(seconds * 1_000_000)))


@dataclass(frozen=True)
class Message:
    """What one heard datagram says, as the driver acts on it."""
    phase: Optional[str] = None     # STATUS=, as a one-line phase
    ping: bool = False              # WATCHDOG=1
    trigger: bool = False           # WATCHDOG=trigger


def read_message(fields: Dict[str, str]) -> Message:
    """What one parsed datagram means: the one place a key of the protocol is
    understood. ``WATCHDOG=trigger`` is systemd's "I detected an internal
    error: act as if my watchdog starved" (with or without a configured
    watchdog). What else systemd's protocol says is not the agent's to change
    here: ``WATCHDOG_USEC=`` (its watchdog is the operator's setting),
    ``EXTEND_TIMEOUT_USEC=`` (the budget is), ``MAINPID=`` (the run's process
    is the one the driver started), ``READY=1``, ``FDSTORE=1`` ...: heard and
    ignored."""
    watchdog = fields.get("WATCHDOG")
    return Message(phase=clean_phase(fields["STATUS"]) if "STATUS" in fields else None,
                   ping=watchdog == "1", trigger=watchdog == "trigger")


REPORT_KEYS = ("X_RING_USED", "X_RING_EXHAUSTED")   # SPEC "Agents on a shared quota"


def quota_reports(fields: Dict[str, str]) -> list:
    """The quota reports of one parsed datagram, as (key, value): what they
    say is ringd.core.quota.parse_report's to decide."""
    return [(k, fields[k]) for k in REPORT_KEYS if k in fields]


# --- who may speak -------------------------------------------------------------------

@dataclass(frozen=True)
class ProcStat:
    ppid: int
    pgrp: int
    session: int
    start_ticks: int


def proc_stat(pid: int) -> Optional[ProcStat]:
    """ppid, process group, session and boot-relative start of ``pid`` from
    /proc/<pid>/stat; None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read(1024)
    except OSError:
        return None
    # the command name (field 2) may hold spaces and parentheses: split after the last ')'
    rest = raw[raw.rfind(b")") + 2:].split()
    try:
        return ProcStat(int(rest[1]), int(rest[2]), int(rest[3]), int(rest[19]))
    except (IndexError, ValueError):
        return None


def _environ_has(pid: int, wanted: Dict[str, str]) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            blob = f.read(1 << 20)
    except OSError:
        return False
    found = {}
    for item in blob.split(b"\x00"):
        key, _, value = item.partition(b"=")
        k = key.decode(errors="replace")
        if k in wanted:
            found[k] = value.decode(errors="replace")
    return found == wanted


class RunMembers:
    """Is a sender pid a process of the current run? Cheap for the usual
    senders: the agent itself costs nothing, anything else one or a few reads of
    /proc/<pid>/stat; verdicts are cached per (pid, start time)."""

    MAX_DEPTH = 64

    def __init__(self, state_key: str, run_id: int, driver_pid: Optional[int] = None,
                 stat: Callable[[int], Optional[ProcStat]] = proc_stat,
                 environ_has: Callable[[int, Dict[str, str]], bool] = _environ_has):
        self.agent_pid: Optional[int] = None
        self.driver_pid = driver_pid if driver_pid is not None else os.getpid()
        self.key = {"RING_STATE": state_key, "RING_RUN_ID": str(run_id)}
        self._stat = stat
        self._environ_has = environ_has
        self._cache: Dict[int, Tuple[int, bool]] = {}

    def __contains__(self, pid: int) -> bool:
        agent = self.agent_pid
        if agent is None or pid <= 0:
            return False
        if pid == agent:
            return True
        st = self._stat(pid)
        if st is None:
            return False   # gone before we could look: unknown, so not heard
        cached = self._cache.get(pid)
        if cached is not None and cached[0] == st.start_ticks:
            return cached[1]
        verdict = self._judge(pid, st, agent)
        if len(self._cache) > 4096:
            self._cache.clear()
        self._cache[pid] = (st.start_ticks, verdict)
        return verdict

    def _judge(self, pid: int, st: ProcStat, agent: int) -> bool:
        # The agent leads its own session and group, and stays an unreaped
        # zombie until the run ends: its pid cannot name anyone else meanwhile.
        for _ in range(self.MAX_DEPTH):
            if st.pgrp == agent or st.session == agent or st.ppid == agent:
                return True
            if st.ppid == self.driver_pid:
                # a child of ours that is not the agent: an orphan of the run
                # re-parented to us (subreaper), or one of our own helpers
                return self._environ_has(pid, self.key)
            if st.ppid <= 1:
                return False
            pid = st.ppid
            nxt = self._stat(pid)
            if nxt is None:
                return False
            st = nxt
        return False


# --- the socket ----------------------------------------------------------------------

@dataclass
class Heard:
    """What one drain of the socket brought."""
    phase: Optional[str] = None     # the last STATUS= among accepted datagrams
    pings: int = 0                  # accepted WATCHDOG=1
    triggered: bool = False         # an accepted WATCHDOG=trigger
    accepted: int = 0
    dropped: int = 0
    more: bool = False              # the cap was reached: datagrams may be waiting
    reports: list = field(default_factory=list)   # (key, value) of accepted quota reports, in order

    def add(self, message: Message) -> None:
        """One accepted datagram's message."""
        self.accepted += 1
        if message.phase is not None:
            self.phase = message.phase
        if message.ping:
            self.pings += 1
        self.triggered = self.triggered or message.trigger


class NotifySocket:
    """The notify socket of one run. ``env`` is what to put in NOTIFY_SOCKET."""

    def __init__(self, sock: socket.socket, path: Optional[str], env: str, members: RunMembers,
                 ident: Optional[Tuple[int, int]] = None):
        self.sock = sock
        self.path = path
        self.env = env
        self.members = members
        self.ident = ident   # (st_dev, st_ino) of the socket file we bound: renames must find it
        self.folder: Optional[str] = None   # the private dir it is in, removed with it (private_dir)

    @classmethod
    def open(cls, state_dir: Path, run_id: int, state_key: Optional[str] = None,
             sweep: bool = True) -> "NotifySocket":
        """Create and bind the run's socket (0600). ``sweep``: sockets left by a
        dead driver (or a close that could not unlink) are removed first (we
        hold the lock: no other run of this ring exists). A state dir whose
        path is too long for a socket address gets its socket in a short
        private directory instead (:func:`private_dir`), never an abstract
        one: those have no permissions. Raises OSError."""
        if sweep:
            remove_stale(state_dir)
        name = f"{SOCKET_PREFIX}{run_id}.sock"
        folder = None
        path = f"{state_dir}/{name}"
        if len(os.fsencode(path)) > _SUN_PATH_MAX:
            folder = private_dir(state_dir, len(name) + 1, sweep)
            path = f"{folder}/{name}"
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC | socket.SOCK_NONBLOCK)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
            old = os.umask(0o177)   # born 0600 (bind applies the umask): no window, no chmod
            try:
                sock.bind(path)
            finally:
                os.umask(old)
            st = os.lstat(path)
        except BaseException:
            _close_socket(sock)   # bound, it may have been sent to already
            if folder is not None:
                _rmdir_quietly(folder)
            raise
        members = RunMembers(state_key or str(state_dir), run_id)
        ns = cls(sock, path, path, members, (st.st_dev, st.st_ino))
        ns.folder = folder
        return ns

    def park(self, state_dir: Path) -> bool:
        """The run has ended: its socket file leaves its path (renamed to
        :data:`IDLE_SOCKET`) and the bound socket is kept for the next run
        (:meth:`reuse`), instead of being closed, unlinked and bound again.
        A rename costs no inode; on a file system that avoids reusing recently
        freed inodes (ext4 without a journal) every fresh bind scans for one.
        False (nothing parked) for a socket in a private dir (its state dir's
        path is too long for one) or when the rename fails."""
        if self.path is None or self.ident is None or self.folder is not None:
            return False
        idle = f"{state_dir}/{IDLE_SOCKET}"
        try:
            os.rename(self.path, idle)
        except OSError:
            return False
        self.path = idle   # what close() removes, if it is never reused
        return True

    def reuse(self, state_dir: Path, run_id: int, state_key: Optional[str] = None) -> Optional["NotifySocket"]:
        """A parked socket as ``run_id``'s (its file renamed to the run's path,
        anything still queued from earlier runs dropped); None (and the
        parked socket closed) when the file at the idle path is not the one we
        bound - it was removed or replaced - or no longer 0600, or when the
        purge of what is queued did not finish (:data:`PURGE_CAP` datagrams):
        the caller binds a fresh socket."""
        idle = self.path
        path = f"{state_dir}/{SOCKET_PREFIX}{run_id}.sock"
        try:
            if idle is None:
                raise FileNotFoundError(path)
            st = os.lstat(idle)
            # (a run's agent may have chmod'ed it: SPEC says 0600, so that one is not reused either)
            if (st.st_dev, st.st_ino) != self.ident or not stat.S_ISSOCK(st.st_mode) \
                    or stat.S_IMODE(st.st_mode) != 0o600:
                raise FileNotFoundError(idle)
        except OSError:
            self._close_sock()   # (what was sent to it between runs may still be queued)
            return None
        # datagrams of an earlier run (its processes are gone): never heard. A
        # bounded purge: whoever keeps writing to the idle socket as fast as we
        # read (the path is well known) would otherwise hold the driver here for
        # ever; past the bound the socket is given up and a fresh one bound.
        purged = False
        for _ in range(PURGE_CAP):
            try:
                _, anc, _, _ = self.sock.recvmsg(MAX_DATAGRAM + 1, _CMSG_SPACE, _RECV_FLAGS)
            except OSError:
                purged = True
                break
            _sender_and_close_fds(anc)
        if not purged:
            self._close_sock()
            return None
        try:
            os.rename(idle, path)
        except OSError:
            self._close_sock()
            return None
        members = RunMembers(state_key or str(state_dir), run_id)
        return NotifySocket(self.sock, path, path, members, self.ident)

    def fileno(self) -> int:
        return self.sock.fileno()

    def set_agent(self, pid: int) -> None:
        self.members.agent_pid = pid

    def drain(self, cap: int = DRAIN_CAP) -> Heard:
        """Read up to ``cap`` waiting datagrams without blocking."""
        heard = Heard()
        for _ in range(cap):
            try:
                data, anc, flags, _ = self.sock.recvmsg(MAX_DATAGRAM + 1, _CMSG_SPACE, _RECV_FLAGS)
            except (BlockingIOError, InterruptedError):
                return heard
            except OSError:
                return heard
            pid = _sender_and_close_fds(anc)
            fields = None if flags & socket.MSG_TRUNC else parse_datagram(data)
            if fields is None or pid is None or pid not in self.members:
                heard.dropped += 1
                continue
            heard.add(read_message(fields))
            heard.reports += quota_reports(fields)
        heard.more = True
        return heard

    def close(self) -> bool:
        """Close and unlink; False if the socket file is left behind (a read-only
        or immutable state dir: the next open sweeps it)."""
        self._close_sock()
        if self.path is not None:
            try:
                st = os.lstat(self.path)
                if self.ident is None or (st.st_dev, st.st_ino) == self.ident:   # never a file put in its place
                    os.unlink(self.path)
            except FileNotFoundError:
                pass
            except OSError:
                return False
        if self.folder is not None:
            _rmdir_quietly(self.folder)
        return True

    def _close_sock(self) -> None:
        _close_socket(self.sock)


def _close_socket(sock: socket.socket) -> None:
    """Close a notify socket: its close would release whatever its queued
    datagrams carry, so it goes into a grave (:func:`bury`), never waiting."""
    bury([sock.detach()], sockets=True)


def _sender_and_close_fds(ancdata) -> Optional[int]:
    """The sender's pid from SCM_CREDENTIALS; every passed fd is closed (:func:`bury`)."""
    pid = None
    for level, kind, data in ancdata:
        if level != socket.SOL_SOCKET:
            continue
        if kind == socket.SCM_CREDENTIALS and len(data) >= _UCRED.size:
            pid = _UCRED.unpack_from(data)[0]
        elif kind == socket.SCM_RIGHTS:
            fds = array.array("i")
            fds.frombytes(data[: len(data) - len(data) % fds.itemsize])
            bury(fds)   # sd_notify_barrier waits for exactly this
    return pid


# SCM_RIGHTS installs a sender's fds in our process before we can see who sent
# them, and the last close of some blocks for as long as their maker likes: a TCP
# socket lingering on unsent data, a unix socket holding such a one in flight. A
# pipe's close never waits (a barrier's: the common case), so it is closed at once.
# Any other fd goes into a grave: a fresh unix socket pair whose two ends are passed
# into one of its own queues, then the fds into the other's. Once we close our
# copies, the pair is a cycle only the kernel's garbage collector reaches, and it
# releases all of it on a kernel worker (Linux 6.10 and later): none of our closes
# is the last one, so none waits, whoever sent the fds and however many.

def bury(fds, sockets: bool = False) -> None:
    """Close ``fds`` (passed to us: never trusted) without waiting on any.
    ``sockets``: none is a pipe (no need to look)."""
    rest = []
    for fd in fds:
        if not sockets and _is_pipe(fd):
            _close_quietly(fd)
        else:
            rest.append(fd)
    for i in range(0, len(rest), _MAX_FDS):
        batch = rest[i:i + _MAX_FDS]
        if not _into_grave(batch):
            for fd in batch:   # the kernel refused a grave (docs/agents.md): the last resort
                _close_quietly(fd)


def _into_grave(fds) -> bool:
    """Pass ``fds`` into a grave and close our copies; False (ours kept) if the
    kernel refused (no memory, or a non-root process with more fds in flight
    than its open-file limit: ETOOMANYREFS)."""
    try:
        a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
    except OSError:
        return False
    try:
        b.sendmsg([b"."], [_rights([a.fileno(), b.fileno()])], socket.MSG_DONTWAIT)   # both ends in a's queue
        a.sendmsg([b"."], [_rights(fds)], socket.MSG_DONTWAIT)                       # the fds in b's
    except OSError:
        return False
    finally:
        a.close()
        b.close()
    for fd in fds:
        _close_quietly(fd)
    return True


def _rights(fds):
    return socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds)


def _is_pipe(fd: int) -> bool:
    """An anonymous pipe? (The fd's link in /proc: fstat could ask a FUSE daemon.)"""
    try:
        return os.readlink(f"/proc/self/fd/{fd}").startswith("pipe:")
    except OSError:
        return False


def _close_quietly(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


def private_dir(state_dir: Path, room: int, sweep: bool = False) -> str:
    """A short directory of ours, mode 0700, named after the ring, for the
    sockets of a ring whose state dir's path is too long for a socket address
    (with ``room`` bytes to spare for a name in it): ``/run/ring-<id>`` as root,
    else ``$XDG_RUNTIME_DIR/ring-<id>``, else a fresh ``/tmp/ring-<id>-<random>``
    (a fixed name there could be taken first by another user). Its sockets are
    0600 as in the state dir: no other user can reach them. ``sweep``: also
    remove what a dead driver left there. Raises OSError."""
    from ringd.host.cgroup import ring_prefix
    name = ring_prefix(state_dir)
    xdg = os.environ.get("XDG_RUNTIME_DIR", "")
    for base in (["/run"] if os.geteuid() == 0 else []) + ([xdg] if xdg.startswith("/") else []):
        folder = f"{base}/{name}"
        if len(os.fsencode(folder)) + room > _SUN_PATH_MAX:
            continue
        try:
            os.mkdir(folder, 0o700)
        except FileExistsError:
            pass
        except OSError:
            continue
        if _is_private(folder) and _is_private(base, shared=True):
            if sweep:
                remove_stale(Path(folder))
            return folder
    if sweep:
        _remove_stale_folders("/tmp", name + "-")
    for _ in range(16):
        folder = f"/tmp/{name}-{os.urandom(4).hex()}"
        try:
            os.mkdir(folder, 0o700)
        except FileExistsError:
            continue
        if _is_private(folder):   # (a umask cannot add bits; an odd file system could)
            return folder
        _rmdir_quietly(folder)
        break
    raise PermissionError(13, "no private directory for the notify socket (/run, $XDG_RUNTIME_DIR, /tmp)")


def _is_private(folder: str, shared: bool = False) -> bool:
    """A directory (not a symlink) that we own and no one else may enter;
    ``shared``: root's or ours, not writable by others (a base like /run)."""
    try:
        st = os.lstat(folder)
    except OSError:
        return False
    if not stat.S_ISDIR(st.st_mode):
        return False
    if shared:
        return st.st_uid in (0, os.geteuid()) and not st.st_mode & 0o022
    return st.st_uid == os.geteuid() and not st.st_mode & 0o077


def _remove_stale_folders(base: str, prefix: str) -> None:
    try:
        names = os.listdir(base)
    except OSError:
        return
    for name in names:
        folder = f"{base}/{name}"
        if name.startswith(prefix) and _is_private(folder):
            remove_stale(Path(folder))
            _rmdir_quietly(folder)


def _rmdir_quietly(folder: str) -> None:
    try:
        os.rmdir(folder)
    except OSError:
        pass   # not empty (a file someone put there), or gone: left as it is


def remove_stale(state_dir: Path) -> None:
    """Unlink notify sockets left in the state dir (never following a symlink,
    never removing anything that is not a socket)."""
    try:
        names = os.listdir(state_dir)
    except OSError:
        return
    for name in names:
        if name.startswith(SOCKET_PREFIX) and name.endswith(".sock"):
            p = state_dir / name
            try:
                if stat.S_ISSOCK(os.lstat(p).st_mode):
                    os.unlink(p)
            except OSError:
                pass


# --- the notes status reads ------------------------------------------------------------

@dataclass
class Notes:
    """The current run's phase and last ping, published to ``notify.json`` at
    most once a second (a flood of STATUS= lines costs one small write a
    second, never a journal commit per datagram)."""
    run_id: int
    phase: Optional[str] = None
    ping_at: Optional[float] = None      # wall clock of the last WATCHDOG=1
    pings: int = 0
    dropped: int = 0                     # datagrams not heard (a stranger's, malformed, a sender gone)
    dirty: bool = False
    written_at: float = float("-inf")    # monotonic

    def hear(self, heard: Heard, wall_now: float) -> None:
        if heard.phase is not None and heard.phase != self.phase:
            self.phase, self.dirty = heard.phase, True
        if heard.pings:
            self.ping_at, self.dirty = wall_now, True
            self.pings += heard.pings
        if heard.dropped:
            self.dropped, self.dirty = self.dropped + heard.dropped, True

    def due_at(self) -> Optional[float]:
        """Monotonic time of the next write (None: nothing to write)."""
        return self.written_at + NOTES_MIN_INTERVAL if self.dirty else None

    def as_json(self) -> Dict:
        return {"run_id": self.run_id, "phase": self.phase, "agent_beat_at": self.ping_at,
                "pings": self.pings, "dropped": self.dropped}


def write_notes(state_dir: Path, notes: Notes, mono_now: float) -> None:
    from ringd.host.atomicfile import write_json_atomic
    notes.written_at, notes.dirty = mono_now, False
    write_json_atomic(state_dir / NOTES_FILE, notes.as_json())


def read_notes(state_dir: Path, run_id: Optional[int]) -> Dict:
    """``phase``, ``agent_beat_at`` and ``dropped`` of run ``run_id`` as last published
    (empty when the file is about another run, missing or corrupt). The file
    is in a state dir agents can write: it is read as input, never trusted -
    the phase as :func:`clean_phase` keeps one (status shows it, the reaper
    and force-fail record it), the ping's time only if a clock can show it
    (heartbeat.epoch: an infinite one made status print ``Infinity``, and
    fail)."""
    if run_id is None:
        return {}
    from ringd.host.atomicfile import read_json
    from ringd.core.timefmt import epoch
    data = read_json(state_dir / NOTES_FILE)
    if data is None or type(data.get("run_id")) is not int or data["run_id"] != run_id:
        return {}
    phase, dropped = data.get("phase"), data.get("dropped")
    return {"phase": clean_phase(phase) if isinstance(phase, str) else None,
            "agent_beat_at": epoch(data.get("agent_beat_at")),
            "dropped": dropped if type(dropped) is int and dropped >= 0 else None}


def remove_notes(state_dir: Path) -> None:
    try:
        os.unlink(state_dir / NOTES_FILE)
    except OSError:
        pass


# --- the sending side: ``ringd notify`` ------------------------------------------------

class NotifyError(Exception):
    """``ringd notify`` could not deliver; the message says why."""


def send(message: str, address: Optional[str] = None, barrier_timeout: float = 5.0) -> None:
    """Send ``message`` to ``address`` (default ``$NOTIFY_SOCKET``), then wait
    until the receiver has read it (sd_notify_barrier: a pipe's write end goes
    along, the receiver closes it). Without the wait a short-lived sender may be
    gone before the driver checks who sent the datagram, and be ignored."""
    address = address if address is not None else os.environ.get("NOTIFY_SOCKET")
    if not address:
        raise NotifyError("NOTIFY_SOCKET is not set (not running under ring or systemd)")
    if address.startswith("@"):
        address = "\0" + address[1:]
    try:
        blob = message.encode()   # (``ringd notify`` made argv's stray bytes U+FFFD: cli.ArgText)
    except UnicodeEncodeError:
        raise NotifyError("message is not text: it holds a lone surrogate") from None
    if len(blob) > MAX_DATAGRAM:
        raise NotifyError(f"message is {len(blob)} bytes; at most {MAX_DATAGRAM} are heard")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
        try:
            s.connect(address)
            s.send(blob)
        except OSError as e:
            raise NotifyError(f"cannot send to {address.lstrip(chr(0))}: {e.strerror or e}") from None
        r, w = os.pipe()
        try:
            try:
                s.sendmsg([b"BARRIER=1"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [w]))])
            finally:
                os.close(w)
            _wait_hangup(r, barrier_timeout)
        except OSError:
            pass   # the message itself was sent; only the wait for its reading failed
        finally:
            os.close(r)


def _wait_hangup(fd: int, timeout: float) -> None:
    """Until every write end of the pipe ``fd`` is closed, or ``timeout``."""
    import select
    poller = select.poll()
    poller.register(fd, select.POLLHUP)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if poller.poll(max(0.0, deadline - time.monotonic()) * 1000):
            return
