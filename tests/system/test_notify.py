"""The notify protocol (ringd/notify.py): parsing is pure; the socket is real
(a unix datagram socket in a temp dir, real senders in other processes)."""
from __future__ import annotations

import array
import os
import select
import signal
import socket
import stat
import struct
import subprocess
import sys
import time
from typing import Tuple

import pytest
from pathlib import Path

from ringd.host import notify
from ringd.host.notify import (IDLE_SOCKET, MAX_DATAGRAM, Heard, Notes, NotifyError, NotifySocket, ProcStat, RunMembers,
                          Message, clean_phase, parse_datagram, read_message, read_notes, send, watchdog_usec, write_notes)

from conftest import REPO, wait_until


# --- pure ------------------------------------------------------------------------------

@pytest.mark.parametrize("data,fields", [
    (b"STATUS=fetching page 3", {"STATUS": "fetching page 3"}),
    (b"WATCHDOG=1\nSTATUS=a\nSTATUS=b\n", {"WATCHDOG": "1", "STATUS": "b"}),
    (b"READY=1", {"READY": "1"}),
    (b"STATUS=", {"STATUS": ""}),
    (b"STATUS=x=y", {"STATUS": "x=y"}),
    (b"STATUS=caf\xc3\xa9", {"STATUS": "caf\u00e9"}),
])
def test_well_formed_datagrams_parse(data, fields):
    assert parse_datagram(data) == fields


@pytest.mark.parametrize("data", [
    b"", b"\n\n", b"hello", b"STATUS", b"status=lower", b"=1", b"STATUS=a\x00b", b"1X=2",
    b"STATUS=a\njunk", b"S" * 10 + b"=" + b"x" * MAX_DATAGRAM,
])
def test_malformed_or_oversized_datagrams_are_none(data):
    assert parse_datagram(data) is None


def test_exactly_four_kib_is_heard():
    data = b"STATUS=" + b"x" * (MAX_DATAGRAM - 7)
    assert len(data) == MAX_DATAGRAM and parse_datagram(data) is not None


def test_phase_is_one_line_cut_to_200_characters():
    assert clean_phase("a" * 500) == "a" * 200
    assert clean_phase("red \x1b[31mtext\r\tand\x07") == "red  [31mtext  and"
    assert read_message({"STATUS": "x" * 300, "WATCHDOG": "1"}) == Message("x" * 200, ping=True)
    assert read_message({"WATCHDOG": "0"}) == Message()
    assert read_message({"WATCHDOG": "trigger"}) == Message(trigger=True)     # systemd: act as if it starved
    for ignored in ("WATCHDOG_USEC", "EXTEND_TIMEOUT_USEC", "MAINPID", "READY"):   # not the agent's to change
        assert read_message({ignored: "1"}) == Message()


def test_phase_is_one_line_in_unicode_aware_tools_too():
    # line/paragraph separators split a line; bidi overrides and isolates reorder what is shown
    assert clean_phase("a\u2028b\u2029c\u202ed\u2066e\u200ff\ufeffg\u061ch") == "a b c d e f g h"
    assert clean_phase("caf\u00e9 \u2013 \U0001f680 \u4e2d") == "caf\u00e9 \u2013 \U0001f680 \u4e2d"   # text stays


def test_watchdog_usec_is_never_zero():
    # 0 reads as "no watchdog" to libsystemd, while the driver would still end the run
    assert watchdog_usec(1.0e-7) == "1"
    assert watchdog_usec(1.5) == "1500000"


def _stats(table):
    return lambda pid: table.get(pid)


def test_run_members_by_group_session_ancestry_or_key():
    # pid: (ppid, pgrp, session, start)
    table = {
        200: ProcStat(100, 100, 100, 5),     # in the agent's group
        300: ProcStat(200, 300, 100, 6),     # own group, agent's session
        400: ProcStat(300, 400, 400, 7),     # setsid below 300: ancestry reaches the agent
        500: ProcStat(1, 500, 500, 8),       # a stranger (child of init)
        600: ProcStat(10, 600, 600, 9),      # an orphan re-parented to the driver (pid 10) with the key
        700: ProcStat(10, 700, 700, 9),      # a driver helper (no key)
        800: ProcStat(900, 800, 800, 9),     # parent unknown (gone)
    }
    members = RunMembers("/state", 7, driver_pid=10, stat=_stats(table),
                         environ_has=lambda pid, key: pid == 600 and key == {"RING_STATE": "/state",
                                                                             "RING_RUN_ID": "7"})
    assert 100 not in members                      # no agent yet: nobody is heard
    members.agent_pid = 100
    assert [pid in members for pid in (100, 200, 300, 400, 500, 600, 700, 800, 0, -1)] == \
        [True, True, True, True, False, True, False, False, False, False]


def test_run_members_cache_is_keyed_by_start_time():
    table = {500: ProcStat(1, 500, 500, 8)}
    members = RunMembers("/s", 1, driver_pid=10, stat=_stats(table), environ_has=lambda *_: False)
    members.agent_pid = 100
    assert 500 not in members
    table[500] = ProcStat(100, 500, 500, 9)        # the pid was reused by a child of the agent
    assert 500 in members


def test_notes_are_written_at_most_once_a_second(tmp_path):
    notes = Notes(run_id=3)
    assert notes.due_at() is None
    notes.hear(Heard(phase="one"), wall_now=1000.0)
    assert notes.due_at() == float("-inf")         # first change: write at once
    write_notes(tmp_path, notes, mono_now=50.0)
    notes.hear(Heard(phase="two", pings=2), wall_now=1001.0)
    assert notes.due_at() == 51.0
    notes.hear(Heard(phase="two", dropped=3), wall_now=1001.5)
    write_notes(tmp_path, notes, mono_now=51.0)
    assert notes.due_at() is None
    assert read_notes(tmp_path, 3) == {"phase": "two", "agent_beat_at": 1001.0, "dropped": 3}
    assert read_notes(tmp_path, 4) == {} and read_notes(tmp_path, None) == {}
    assert stat.S_IMODE(os.stat(tmp_path / "notify.json").st_mode) == 0o600


@pytest.mark.parametrize("beat", ["-1e999", "1e999", "NaN", "1e308", "true", "\"soon\""])
def test_notes_written_by_someone_else_never_reach_status_raw(tmp_path, beat):
    """notify.json is in a state dir every agent can write: a stamp no clock can
    show made ``status --json`` print ``Infinity`` (not JSON) and ``ringd status``
    an internal error; a phase is what the driver would have kept of it
    (one line, 200 characters), since the reaper and force-fail record it."""
    (tmp_path / "notify.json").write_text(
        '{"run_id": 3, "phase": "\\u001b[31mred\\nnext' + "x" * 300 + '", "agent_beat_at": ' + beat + '}')
    notes = read_notes(tmp_path, 3)
    assert notes["agent_beat_at"] is None and notes["dropped"] is None
    assert notes["phase"] == clean_phase("\x1b[31mred\nnext" + "x" * 300) and "\x1b" not in notes["phase"]
    (tmp_path / "notify.json").write_text('{"run_id": true, "phase": "p", "agent_beat_at": 1000.0}')
    assert read_notes(tmp_path, 1) == {}


# --- the real socket --------------------------------------------------------------------

def _sender(code: str, env_socket: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, NOTIFY_SOCKET=env_socket, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=30)


def _raw_send(path: str, data: bytes) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.sendto(data, path)


@pytest.fixture
def sock(tmp_path):
    ns = NotifySocket.open(tmp_path, 17)
    yield ns
    ns.close()


def test_socket_file_is_0600_in_the_state_dir_and_removed_at_close(tmp_path):
    ns = NotifySocket.open(tmp_path, 5)
    assert ns.env == str(tmp_path / "notify-5.sock")
    st = os.stat(ns.env)
    assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
    ns.close()
    assert not os.path.exists(tmp_path / "notify-5.sock")


def test_a_socket_left_by_a_dead_driver_is_replaced(tmp_path):
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    stale.bind(str(tmp_path / "notify-4.sock"))
    stale.close()                                   # its file stays, as after a crash
    (tmp_path / "notify-keep.txt").write_text("not a socket")
    ns = NotifySocket.open(tmp_path, 5)
    try:
        assert not (tmp_path / "notify-4.sock").exists() and (tmp_path / "notify-keep.txt").exists()
    finally:
        ns.close()


def test_a_parked_socket_is_the_next_runs_and_hears_nothing_of_the_last(tmp_path):
    """Between runs the socket file is renamed aside (no inode allocated per
    run); the next run's path is the same bound socket, with nothing queued."""
    ns = NotifySocket.open(tmp_path, 5)
    ino = os.lstat(ns.env).st_ino
    assert ns.park(tmp_path)
    idle = tmp_path / IDLE_SOCKET
    assert not (tmp_path / "notify-5.sock").exists() and idle.exists()   # run 5's path is gone
    _raw_send(str(idle), b"STATUS=from run 5")     # queued between runs: never heard
    nxt = ns.reuse(tmp_path, 6)
    try:
        assert nxt is not None and nxt.env == str(tmp_path / "notify-6.sock") and not idle.exists()
        st = os.lstat(nxt.env)
        assert st.st_ino == ino and stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
        nxt.set_agent(os.getpid())
        _raw_send(nxt.env, b"STATUS=run 6")
        heard = nxt.drain()
        assert (heard.phase, heard.accepted, heard.dropped) == ("run 6", 1, 0)
    finally:
        nxt.close()
    assert not os.path.exists(tmp_path / "notify-6.sock")


@pytest.mark.parametrize("tamper", ["removed", "replaced", "chmod"])
def test_a_parked_socket_whose_file_was_tampered_with_is_not_reused(tmp_path, tamper):
    ns = NotifySocket.open(tmp_path, 5)
    assert ns.park(tmp_path)
    idle = tmp_path / IDLE_SOCKET
    if tamper == "chmod":   # its agent opened it to everyone: the next run's socket is 0600 again
        os.chmod(idle, 0o666)
    else:
        idle.unlink()
    other = None
    if tamper == "replaced":   # someone else's socket at the idle path
        other = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        other.bind(str(idle))
    try:
        assert ns.reuse(tmp_path, 6) is None
        assert ns.sock.fileno() == -1                  # the parked socket is closed
        assert not (tmp_path / "notify-6.sock").exists()
    finally:
        if other is not None:
            other.close()


def _fd_gone(fd: int, ino: int) -> bool:
    """Does our descriptor ``fd`` no longer name the file of inode ``ino``?"""
    try:
        return os.stat(f"/proc/self/fd/{fd}").st_ino != ino
    except FileNotFoundError:
        return True


class _FloodedSocket:
    """A parked socket someone writes to as fast as it is read: recvmsg never
    runs dry (until a test-only bound, so a regression fails instead of hanging)."""
    def __init__(self, real):
        self.real, self.reads = real, 0

    def recvmsg(self, *a):
        self.reads += 1
        if self.reads > 100_000:
            raise BlockingIOError("test bound")
        return b"STATUS=flood", [], 0, None

    def recv(self, *a):   # (the peek before its close finds a datagram too)
        return b"S"

    def shutdown(self, how):
        self.real.shutdown(how)

    def close(self):
        self.real.close()

    def detach(self):
        return self.real.detach()

    def fileno(self):
        return self.real.fileno()


def test_a_parked_socket_flooded_between_runs_is_given_up_not_drained_for_ever(tmp_path):
    ns = NotifySocket.open(tmp_path, 5)
    assert ns.park(tmp_path)
    flooded = ns.sock = _FloodedSocket(ns.sock)
    fd, ino = flooded.fileno(), os.fstat(flooded.fileno()).st_ino
    assert ns.reuse(tmp_path, 6) is None            # the caller binds a fresh socket
    assert flooded.reads == notify.PURGE_CAP == 1024 and flooded.real.fileno() == -1   # (README: 1024)
    # buried (its queue, left unread, may hold descriptors whose close blocks)
    wait_until(lambda: _fd_gone(fd, ino), message="the given-up socket closed")
    fresh = NotifySocket.open(tmp_path, 6)          # (sweeping the idle file it left)
    try:
        assert fresh.env == str(tmp_path / "notify-6.sock") and not (tmp_path / IDLE_SOCKET).exists()
    finally:
        fresh.close()


def _long_state_dir(parent) -> "Path":
    deep = parent / ("d" * 100)
    deep.mkdir()
    return deep


# another user's python: the test's own may be under root's home, which that user cannot enter
OTHER_PYTHON = "/usr/bin/python3"

_CONNECT = """import socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
try:
    s.sendto(b"STATUS=stranger", sys.argv[1])
except PermissionError:
    sys.exit(3)
"""


def test_a_too_long_state_dir_gets_a_0600_socket_file_in_a_private_dir_no_other_user_reaches(tmp_path):
    """A state dir's path too long for a socket address: the socket is a file,
    mode 0600, in /run/ring-<id> (0700, ours) - never an abstract socket, which
    every local user can reach. Another user cannot send to it; the run's own
    processes can. Socket and directory go with the run."""
    from ringd.host.cgroup import ring_prefix
    deep = _long_state_dir(tmp_path)
    ns = NotifySocket.open(deep, 5)
    path = Path(ns.env)
    try:
        assert path == Path("/run") / ring_prefix(deep) / "notify-5.sock" and ns.path == ns.env
        st, folder = path.lstat(), path.parent.lstat()
        assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
        assert stat.S_ISDIR(folder.st_mode) and stat.S_IMODE(folder.st_mode) == 0o700
        assert folder.st_uid == os.geteuid()
        other = subprocess.run(["runuser", "-u", "nobody", "--", OTHER_PYTHON, "-I", "-c", _CONNECT, ns.env],
                               timeout=30)
        assert other.returncode == 3                    # EACCES: not even queued
        ns.set_agent(os.getpid())
        _raw_send(ns.env, b"STATUS=deep")
        assert ns.drain().phase == "deep"
    finally:
        ns.close()
    assert not path.exists() and not path.parent.exists()


_AS_USER = """import json, os, stat, sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from ringd.host.notify import NotifySocket
ns = NotifySocket.open(Path(sys.argv[2]), 7)
st, folder = os.lstat(ns.env), os.lstat(os.path.dirname(ns.env))
print(json.dumps({"env": ns.env, "mode": stat.S_IMODE(st.st_mode), "sock": stat.S_ISSOCK(st.st_mode),
                  "folder": stat.S_IMODE(folder.st_mode), "uid": folder.st_uid, "me": os.getuid()}))
ns.close()
print(json.dumps({"left": os.path.exists(ns.env) or os.path.exists(os.path.dirname(ns.env))}))
"""


@pytest.mark.parametrize("runtime_dir", [True, False])
def test_a_users_too_long_state_dir_gets_its_socket_in_its_runtime_dir_or_a_fresh_tmp_dir(request, runtime_dir):
    """Not root: ``$XDG_RUNTIME_DIR/ring-<id>``, or without one a fresh
    ``/tmp/ring-<id>-<random>`` (a fixed name in /tmp could be taken first by
    another user) - 0700 and the socket 0600 either way, both gone at close."""
    import json
    import pwd
    import shutil
    import tempfile
    from ringd.host.cgroup import ring_prefix
    nobody = pwd.getpwnam("nobody")
    top = Path(tempfile.mkdtemp(prefix="ring-user-"))
    request.addfinalizer(lambda: shutil.rmtree(top, ignore_errors=True))
    top.chmod(0o755)
    home = top / "u"
    home.mkdir(mode=0o700)
    os.chown(home, nobody.pw_uid, nobody.pw_gid)
    env = {"PATH": os.environ["PATH"]}
    if runtime_dir:
        env["XDG_RUNTIME_DIR"] = str(home)
    state = home / ("s" * 110)
    r = subprocess.run(["runuser", "-u", "nobody", "--", "mkdir", "-m", "0700", str(state)], timeout=30)
    assert r.returncode == 0
    r = subprocess.run(["runuser", "-u", "nobody", "--", "env", "-i", *(f"{k}={v}" for k, v in env.items()),
                        OTHER_PYTHON, "-I", "-c", _AS_USER, str(REPO), str(state)],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    made, after = (json.loads(line) for line in r.stdout.splitlines())
    folder = os.path.dirname(made["env"])
    if runtime_dir:
        assert folder == f"{home}/{ring_prefix(state)}"
    else:
        assert folder.startswith(f"/tmp/{ring_prefix(state)}-") and len(folder) == len(f"/tmp/{ring_prefix(state)}-") + 8
    assert (made["sock"], made["mode"], made["folder"], made["uid"]) == (True, 0o600, 0o700, made["me"])
    assert after == {"left": False}


def test_the_agent_is_heard_and_a_stranger_is_not(sock):
    sock.set_agent(os.getpid())                      # this test process plays the agent
    _raw_send(sock.env, b"STATUS=from the agent\nWATCHDOG=1")
    heard = sock.drain()
    assert (heard.phase, heard.pings, heard.accepted, heard.dropped) == ("from the agent", 1, 1, 0)
    # a process outside the run (not our descendant: started by a helper that exits at once)
    stranger = subprocess.run(
        ["sh", "-c", f"( {sys.executable} -c \"import socket; s=socket.socket(socket.AF_UNIX, "
                     f"socket.SOCK_DGRAM); s.sendto(b'STATUS=stranger', '{sock.env}'); import time; "
                     f"time.sleep(1)\" & ) ; exit 0"], timeout=30)
    assert stranger.returncode == 0
    wait_until(lambda: select.select([sock.fileno()], [], [], 0)[0], timeout=10, message="datagram")
    heard = sock.drain()
    assert (heard.phase, heard.accepted, heard.dropped) == (None, 0, 1)


def test_a_child_of_the_agent_is_heard_through_ringd_notify(sock):
    sock.set_agent(os.getpid())
    # `ringd notify` waits until the driver read its datagram (barrier): drain meanwhile
    p = subprocess.Popen([sys.executable, "-m", "ringd", "notify", "--status", "step 2", "--ping"],
                         env=dict(os.environ, NOTIFY_SOCKET=sock.env, PYTHONPATH=str(REPO)))
    got = Heard()
    deadline = time.monotonic() + 20
    while p.poll() is None and time.monotonic() < deadline:
        select.select([sock.fileno()], [], [], 0.05)
        h = sock.drain()
        got.accepted += h.accepted
        got.pings += h.pings
        got.phase = h.phase or got.phase
    assert p.wait(timeout=10) == 0
    assert (got.phase, got.pings) == ("step 2", 1)


def test_ringd_notify_sends_a_status_that_is_not_utf_8_with_u_fffd(sock):
    """``$n`` in ``ringd notify --status "fetching $n"`` may be a Latin-1 file
    name: argv is bytes, not text. Sent as the UTF-8 its bytes spell, U+FFFD for
    the undecodable byte (cli.ArgText) - never a traceback."""
    code, err, phase = _notify_heard(sock, [sys.executable.encode(), b"-m", b"ringd", b"notify", b"--status",
                                            b"caf\xe9 \xc3\xa9"], LC_ALL="C.UTF-8")
    assert code == 0 and b"Traceback" not in err, err
    assert phase == "caf\ufffd \u00e9"
    with pytest.raises(NotifyError, match="lone surrogate"):   # a caller's str that no bytes ever were
        send("STATUS=\ud800", address=sock.env)


def test_ringd_notify_cuts_a_long_status_to_the_phase_the_ring_keeps(sock):
    """SPEC: a longer STATUS= text is cut to its first 200 characters. ``ringd
    notify --status "$(cat report)"`` with 10 000 of them is that phase, exit 0 -
    not a datagram over 4 KiB refused with exit 1."""
    text = "".join(chr(0x4e00 + i % 500) for i in range(10_000))   # 3 bytes each in UTF-8
    code, err, phase = _notify_heard(sock, [sys.executable, "-m", "ringd", "notify", "--status", text])
    assert code == 0, err
    assert phase == text[:200]


def _notify_heard(sock, argv, **env):
    """Run ``ringd notify`` (argv) as the run's agent would, at ``sock``:
    (exit code, stderr, the phase the socket heard)."""
    sock.set_agent(os.getpid())
    p = subprocess.Popen(argv, env=dict(os.environ, NOTIFY_SOCKET=sock.env, PYTHONPATH=str(REPO), **env),
                         stderr=subprocess.PIPE)
    got = Heard()
    deadline = time.monotonic() + 20
    while p.poll() is None and time.monotonic() < deadline:
        select.select([sock.fileno()], [], [], 0.05)
        got.phase = sock.drain().phase or got.phase
    _, err = p.communicate(timeout=10)
    got.phase = sock.drain().phase or got.phase
    return p.returncode, err, got.phase


def test_oversized_and_malformed_datagrams_are_dropped(sock):
    sock.set_agent(os.getpid())
    _raw_send(sock.env, b"STATUS=" + b"x" * MAX_DATAGRAM)
    _raw_send(sock.env, b"garbage")
    _raw_send(sock.env, b"STATUS=fine")
    heard = sock.drain()
    assert (heard.phase, heard.accepted, heard.dropped) == ("fine", 1, 2)


def test_passed_descriptors_are_closed_so_a_barrier_returns(sock):
    r, w = os.pipe()
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.connect(sock.env)
        s.sendmsg([b"BARRIER=1"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [w]))])
    os.close(w)
    poller = select.poll()
    poller.register(r, select.POLLHUP)
    assert not poller.poll(0)                       # the driver holds the write end while queued
    sock.drain()                                    # (from a stranger, even: dropped, fd closed)
    assert poller.poll(1000)
    os.close(r)


LINGER = 5   # s a passed TCP socket's close blocks (SO_LINGER on unsent data)


def _lingering_tcp_socket(request, linger: int) -> Tuple[socket.socket, socket.socket]:
    """A connected TCP socket whose last close blocks for ``linger`` seconds (its
    peer reads nothing, its send buffer is full, SO_LINGER is on), and its peer."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    c = socket.socket()
    c.connect(srv.getsockname())
    peer, _ = srv.accept()
    request.addfinalizer(srv.close)
    request.addfinalizer(peer.close)   # then a close still lingering ends at once
    c.setblocking(False)
    try:
        while True:
            c.send(b"x" * 65536)
    except BlockingIOError:
        pass
    c.setblocking(True)
    c.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, linger))
    return c, peer


def _holds_socket(ino: int) -> bool:
    """Does this process (the driver, in these tests) hold a descriptor of socket inode ``ino``?"""
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}") == f"socket:[{ino}]":
                return True
        except OSError:
            pass
    return False


def _sees_the_end(peer: socket.socket) -> bool:
    """Has ``peer`` read all its TCP socket sent, then the end (its close's FIN)?"""
    peer.setblocking(False)
    try:
        while peer.recv(1 << 20):
            pass
        return True
    except BlockingIOError:
        return False


@pytest.mark.parametrize("pipes_before", [0, 8, 252])
def test_a_passed_descriptor_whose_close_blocks_never_stops_the_drain(sock, request, pipes_before):
    """A hostile agent passes a TCP socket whose close lingers (and drops its own
    copy): the driver's is the last close. The drain returns at once, the
    barrier pipes beside it are closed at once (the ninth fd of a datagram too,
    and the 253rd, the kernel's most per message: one that did not fit would be
    released by the kernel inside our recvmsg), and the slow one is closed off
    the loop - and closed."""
    sock.set_agent(os.getpid())
    pipes = [os.pipe() for _ in range(pipes_before)]
    slow, peer = _lingering_tcp_socket(request, LINGER)
    ino = os.fstat(slow.fileno()).st_ino
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.connect(sock.env)
        s.sendmsg([b"STATUS=take this"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                           array.array("i", [w for _, w in pipes] + [slow.fileno()]))])
    slow.close()
    for _, w in pipes:
        os.close(w)
    t0 = time.monotonic()
    heard = sock.drain()
    assert time.monotonic() - t0 < LINGER / 2   # (a close that waited takes LINGER)
    assert heard.phase == "take this"
    for r, _ in pipes:
        poller = select.poll()
        poller.register(r, select.POLLHUP)
        assert poller.poll(1000)
        os.close(r)
    wait_until(lambda: not _holds_socket(ino), message="the slow one out of the driver's descriptors")
    wait_until(lambda: _sees_the_end(peer), message="the slow one's peer to see its close")


def _pass_fds(address: str, text: bytes, fd: int, copies: int) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.connect(address)
        s.sendmsg([text], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd] * copies))])


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_a_barrier_pipe_is_closed_by_the_drain_itself(sock):
    """A barrier's pipe is closed at once, in the drain: ``systemd-notify``
    waits for exactly that (the other descriptor passed beside it goes into a
    grave, released by the kernel a little later)."""
    sock.set_agent(os.getpid())
    r, w = os.pipe()
    with open(os.devnull) as f:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            s.connect(sock.env)
            s.sendmsg([b"BARRIER=1"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [w, f.fileno()]))])
    os.close(w)
    try:
        fds = _fds()
        assert sock.drain().accepted == 1
        poller = select.poll()
        poller.register(r, select.POLLHUP)
        assert poller.poll(0), "the barrier's pipe is still open"
        assert _fds() == fds                           # and nothing passed is left in our table
    finally:
        os.close(r)


def _unix_carrying(request, slow: socket.socket) -> socket.socket:
    """A unix socket holding ``slow`` in flight (in a queued datagram): its
    last close releases ``slow``, a last close of that too."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    a.sendmsg([b"x"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [slow.fileno()]))])
    a.close()
    request.addfinalizer(b.close)
    return b


@pytest.mark.parametrize("kind", ["tcp", "unix carrying tcp"])
def test_a_flood_of_descriptors_whose_close_blocks_is_read_at_once_and_kept_nowhere(sock, request, kind):
    """Three datagrams of 200 descriptors each, every one a last copy whose close
    blocks (a lingering TCP socket, or a unix socket holding one in flight):
    one drain reads all three at once (no cap of descriptors waiting to be
    closed holds the socket), starts no thread, leaves none of them in the
    driver's table, and the kernel still releases them in the end."""
    import threading
    sock.set_agent(os.getpid())
    slow, peer = _lingering_tcp_socket(request, LINGER)
    passed = slow if kind == "tcp" else _unix_carrying(request, slow)
    for i in range(3):
        _pass_fds(sock.env, b"STATUS=%d" % i, passed.fileno(), 200)
    passed.close()
    slow.close()
    fds, threads = _fds(), threading.active_count()
    t0 = time.monotonic()
    heard = sock.drain()
    assert time.monotonic() - t0 < LINGER / 2      # (a close that waited takes LINGER)
    assert (heard.accepted, heard.phase, heard.more) == (3, "2", False)
    assert _fds() == fds and threading.active_count() == threads
    wait_until(lambda: _sees_a_close(peer), message="the lingering socket released by the kernel")


def test_a_socket_closed_with_datagrams_left_unread_never_waits(sock, request):
    """Closing a socket releases the descriptors its queued datagrams carry, a
    last close of each that may block: the socket goes into a grave instead."""
    slow, peer = _lingering_tcp_socket(request, LINGER)
    _pass_fds(sock.env, b"STATUS=slow", slow.fileno(), 1)
    slow.close()
    t0 = time.monotonic()
    sock.close()
    assert time.monotonic() - t0 < LINGER / 2   # (a close that waited takes LINGER)
    wait_until(lambda: _sees_a_close(peer), message="the lingering socket released by the kernel")


def test_drain_is_capped_per_wake(sock):
    sock.set_agent(os.getpid())
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.connect(sock.env)
        s.setblocking(False)
        sent = 0
        for _ in range(300):
            try:
                s.send(b"WATCHDOG=1")
                sent += 1
            except BlockingIOError:
                break
    assert sent >= 5   # the kernel queues few datagrams (net.unix.max_dgram_qlen); then the sender waits
    first = sock.drain(cap=4)
    assert first.accepted == 4 and first.more
    rest = sock.drain(cap=1000)
    assert first.accepted + rest.accepted == sent and not rest.more


def test_ringd_notify_without_socket_exits_1():
    env = {k: v for k, v in os.environ.items() if k != "NOTIFY_SOCKET"}
    env["PYTHONPATH"] = str(REPO)
    r = subprocess.run([sys.executable, "-m", "ringd", "notify", "--ping"], env=env,
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 1 and "NOTIFY_SOCKET" in r.stderr and "Traceback" not in r.stderr
    with pytest.raises(NotifyError):
        send("WATCHDOG=1", address="")


def test_ringd_notify_to_a_gone_socket_is_one_line_exit_1(tmp_path):
    env = dict(os.environ, NOTIFY_SOCKET=str(tmp_path / "gone.sock"), PYTHONPATH=str(REPO))
    r = subprocess.run([sys.executable, "-m", "ringd", "notify", "--status", "x"], env=env,
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr


def test_ringd_notify_imports_no_rich_journal_or_psutil():
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop("NOTIFY_SOCKET", None)
    r = subprocess.run([sys.executable, "-X", "importtime", "-m", "ringd", "notify", "--ping"], env=env,
                       capture_output=True, text=True, timeout=30)
    modules = {line.split("|")[-1].strip() for line in r.stderr.splitlines() if "|" in line}
    heavy = {m for m in modules if m.split(".")[0] in ("rich", "psutil", "sqlite3", "yaml")
             or m in ("ringd.journal.sqlite", "ringd.cli.status", "ringd.cli.render")}
    assert not heavy, heavy


def test_closing_a_parked_socket_removes_its_idle_file_and_never_a_replacement(tmp_path):
    ns = NotifySocket.open(tmp_path, 5)
    assert ns.park(tmp_path)
    idle = tmp_path / IDLE_SOCKET
    assert ns.close() and not idle.exists()            # the driver's stop removes it
    ns = NotifySocket.open(tmp_path, 6)
    assert ns.park(tmp_path)
    idle.unlink()
    other = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    other.bind(str(idle))                               # someone else's file in its place
    try:
        ns.close()
        assert idle.exists()
    finally:
        other.close()


# --- every close of a notify socket: never on the loop while datagrams wait ----------------
# Closing a unix socket releases the descriptors its queued datagrams carry, a last
# close of each that may block (here: 5 s, the lingering TCP socket's SO_LINGER).
# Measured on Linux 6.18: such a close() takes the linger time; the process's own
# exit with the socket still open does not (the kernel's exit-time close never
# lingers), but Python's exit closes a socket object still open with a close() that does.

def _late_pass(request, address: str, linger: int = LINGER) -> socket.socket:
    """A lingering TCP socket passed to ``address`` (our copy dropped: the
    datagram's is the last); its peer, which sees its close in the end."""
    slow, peer = _lingering_tcp_socket(request, linger)
    _pass_fds(address, b"STATUS=late", slow.fileno(), 1)
    slow.close()
    return peer


def _sees_a_close(peer: socket.socket) -> bool:
    try:
        return _sees_the_end(peer)
    except ConnectionResetError:   # a close at exit (no linger) may reset it instead
        return True


@pytest.mark.parametrize("where", ["state dir", "private dir"])
def test_a_datagram_that_came_after_the_last_drain_never_makes_the_close_wait(tmp_path, request, where):
    """The run ends: its socket was drained to the end, then a process of the run
    (or of the ring's user) passes a descriptor whose close blocks. The socket's
    close (a private dir's at every run end; a state dir's when it cannot be
    parked) never waits for it."""
    state = tmp_path if where == "state dir" else _long_state_dir(tmp_path)
    ns = NotifySocket.open(state, 5)
    ns.set_agent(os.getpid())
    assert ns.drain().accepted == 0                 # drained: nothing was left unread
    peer = _late_pass(request, ns.env)
    t0 = time.monotonic()
    ns.close()
    assert time.monotonic() - t0 < LINGER / 2   # (a close that waited takes LINGER)
    wait_until(lambda: _sees_a_close(peer), message="the passed descriptor closed off the loop")


@pytest.mark.parametrize("tamper", ["removed", "replaced", "chmod", "rename fails"])
def test_a_parked_socket_given_up_never_makes_the_reuse_wait(tmp_path, request, monkeypatch, tamper):
    """Between runs a process of the ring's user passes a descriptor whose close
    blocks to the idle socket, then removes, replaces or opens up its file; or
    passes it just after the purge, and the rename to the run's path fails: the
    parked socket is not reused, and its close (releasing that descriptor) is
    not the driver's to wait for."""
    ns = NotifySocket.open(tmp_path, 5)
    assert ns.park(tmp_path)
    idle = tmp_path / IDLE_SOCKET
    peers = []
    if tamper == "rename fails":
        def rename(src, dst):
            peers.append(_late_pass(request, str(idle)))
            raise OSError(18, "Invalid cross-device link")
        monkeypatch.setattr(os, "rename", rename)
    else:
        peers.append(_late_pass(request, str(idle)))
        if tamper == "chmod":
            os.chmod(idle, 0o666)
        else:
            idle.unlink()
        if tamper == "replaced":
            other = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            request.addfinalizer(other.close)
            other.bind(str(idle))
    t0 = time.monotonic()
    assert ns.reuse(tmp_path, 6) is None
    assert time.monotonic() - t0 < LINGER / 2   # (a close that waited takes LINGER)
    monkeypatch.undo()
    (peer,) = peers
    wait_until(lambda: _sees_a_close(peer), message="the passed descriptor closed off the loop")


def test_a_driver_stopping_with_a_descriptor_queued_on_its_parked_socket_exits_at_once(ring, request):
    """A real driver between runs (lap_pause): a process of the ring's user
    passes a descriptor whose close blocks to ``notify-idle.sock``. The stop
    closes the parked socket off the loop and exits without waiting for it."""
    ring.write_config(ring={"lap_pause": 60})
    ring.roster("a /bin/true")
    drv = ring.start_driver()
    idle = ring.state / IDLE_SOCKET
    wait_until(lambda: idle.exists() and [r for r in ring.runs() if r["status"] == "ok"], timeout=30,
               message="the first run over, its socket parked")
    _late_pass(request, str(idle), linger=20)   # (a driver's exit that waited: 20 s and more)
    t0 = time.monotonic()
    drv.send_signal(signal.SIGTERM)
    assert drv.wait(timeout=40) == 0
    assert time.monotonic() - t0 < 8.0, "the driver's exit waited for the passed descriptor's close"
    assert not idle.exists()
