"""Shared test fixtures: a private ring (state dir, fast config, roster, agents),
bounded waits, and finalisers that end every process a test started, by pid.

Processes are found for cleanup by pid: the ones a test spawned directly, their
descendants, and any process whose environment carries this test's
``RING_STATE`` (escaped agent grandchildren) or whose command line names the
test's state dir. Never by name.
"""
from __future__ import annotations

import contextlib
import errno
import importlib
import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional

import psutil
import pytest

from ringd.host import cgroup
from ringd.host.atomicfile import read_json

REPO = Path(__file__).resolve().parent.parent

# A suite started in the background by a non-interactive shell (`pytest &`, CI
# wrappers) inherits SIGINT ignored, and an ignored signal stays ignored across
# exec: every ringd a test starts would ignore its Ctrl-C and the tests that send
# one would hang. A handled signal is reset to the default at exec instead.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# ringwatch.cli blocks SIGTERM, SIGINT, SIGHUP and SIGUSR1 as its first instruction
# when its argv names no subcommand (a bare `ringwatch`: ringd.host.earlysig) - and an
# xdist worker's argv is ['-c']. A test importing it in-process (test_watch's
# internal-error test) left them blocked in the worker, and a blocked mask is
# inherited across fork and exec: every process that worker started afterwards
# never saw its SIGINT or SIGTERM (`ringd status --watch` outlived its Ctrl-C in
# test_cli, about one run in ten under -n 2, as the tests' order on the workers
# varied). Imported here, once, with the mask put back; the autouse fixture below
# fails any test that leaves a signal blocked or ignored all the same.
_mask = signal.pthread_sigmask(signal.SIG_BLOCK, [])
for _module in ("ringd.cli.commands", "ringwatch.cli"):
    importlib.import_module(_module)
signal.pthread_sigmask(signal.SIG_SETMASK, _mask)
del _mask, _module

# signals whose blocking or ignoring outlives exec and would make the ring's
# daemons and commands deaf to what the tests send them
_INHERITED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGQUIT)


@pytest.fixture(autouse=True)
def _signals_as_found():
    """Fail a test that leaves a signal blocked or ignored in the test process
    (and put it back): every child the process starts after it would inherit it,
    and a later test, not this one, would hang waiting for a process to stop."""
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    ignored = {s for s in _INHERITED if signal.getsignal(s) is signal.SIG_IGN}
    yield
    leaked = signal.pthread_sigmask(signal.SIG_SETMASK, mask) - mask
    now_ignored = {s for s in _INHERITED if signal.getsignal(s) is signal.SIG_IGN} - ignored
    for s in now_ignored:
        signal.signal(s, signal.default_int_handler if s == signal.SIGINT else signal.SIG_DFL)
    if leaked or now_ignored:
        pytest.fail(f"the test left signals blocked {sorted(s.name for s in leaked)} or ignored "
                    f"{sorted(s.name for s in now_ignored)} in the test process: every process "
                    f"started after it would inherit them", pytrace=False)

# A throwaway PostgreSQL cluster for the many-host tests (fixtures pg_cluster, pg_dsn).
pytest_plugins = ["pgcluster"]

FAST_CONFIG = {
    "ring": {
        "run_budget": 2.0,
        "stall_threshold": 3.0,
        "heartbeat_interval": 0.2,
        "lap_pause": 0,
        "backoff_initial": 0.5,
        "backoff_max": 2.0,
        "keep_logs": 5,
    },
    "watch": {
        "poll_interval": 0.2,
        "stale_after": 1.5,
        "restart_sec": 0.2,
        "start_limit_burst": 5,
        "start_limit_interval": 30,
    },
}


@contextlib.contextmanager
def mounted_tmpfs(where: Path, size: str = "64k", inodes: Optional[int] = None):
    """A small tmpfs (``size``, 0700; at most ``inodes`` files if given) at
    ``where``, root only (else the test is skipped), unmounted afterwards -
    lazily if something still holds it."""
    if os.geteuid() != 0 or not shutil.which("mount"):
        pytest.skip("needs root to mount a tmpfs")
    where.mkdir(mode=0o700, exist_ok=True)
    options = f"size={size},mode=0700" + (f",nr_inodes={inodes}" if inodes else "")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        yield where
    finally:
        if subprocess.run(["umount", str(where)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(where)], capture_output=True)


def wait_until(pred: Callable[[], object], timeout: float = 10.0, interval: float = 0.02,
               message: str = "condition") -> object:
    """Poll ``pred`` until it returns something truthy; fail the test after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {message}")
        time.sleep(interval)


def freezing_agent(ring, name: str, ice) -> None:
    """Agent ``name``: it moves itself into the cgroup v1 freezer ``ice`` and
    freezes it - a process SIGKILL cannot end until the test thaws it (as a
    hung mount's would be)."""
    ring.agent(name, f"""
        echo $$ > {ice}/cgroup.procs
        echo FROZEN > {ice}/freezer.state
        exit 0
        """)


def line_written(path: Path, timeout: float = 20.0, message: str = "a line written") -> str:
    """The first line a process writes to ``path``, once it is whole. A file
    exists as soon as the shell opens it for ``>``, before its write: reading
    it at that moment gives ''."""
    def whole():
        try:
            text = path.read_text()
        except FileNotFoundError:
            return None
        return text.split("\n", 1)[0] if "\n" in text else None
    return wait_until(whole, timeout, message=message)


def read_until(stream, done: Callable[[bytes], object], timeout: float = 10.0,
               message: str = "output") -> bytes:
    """Read a child's pipe until ``done(all bytes read so far)``; fail the test
    after ``timeout`` or at the pipe's end. (A bare ``readline()`` blocks for
    ever on a child that goes quiet: the test hangs and no finaliser runs.)"""
    import select
    fd = stream.fileno()
    data = b""
    deadline = time.monotonic() + timeout
    while not done(data):
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError(f"timed out after {timeout}s waiting for {message}; read {data[-2000:]!r}")
        if select.select([fd], [], [], left)[0]:
            chunk = os.read(fd, 65536)
            if not chunk:
                raise AssertionError(f"the stream ended before {message}; read {data[-2000:]!r}")
            data += chunk
    return data

def status_json(ring) -> dict:
    """``ringd status --json`` of the ring, whatever its exit code (it says the ring's health)."""
    r = ring.cli("status", "--json")
    assert r.stdout, r.stderr
    return json.loads(r.stdout)


def history_json(ring) -> list:
    r = ring.cli("history", "--json", "--limit", "100")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def one_line(err: str) -> str:
    """The one line a refusal writes to stderr (bad input: one line, never a traceback)."""
    assert "Traceback" not in err, err[-2000:]
    lines = [x for x in err.splitlines() if x.strip()]
    assert len(lines) == 1, f"expected one line: {err[:1500]!r}"
    assert len(lines[0]) < 400, lines[0][:400]
    return lines[0]


def ring_cmd(*args: str) -> List[str]:
    return [sys.executable, "-m", "ringd", *args]


def watch_cmd(*args: str) -> List[str]:
    return [sys.executable, "-m", "ringwatch", *args]


def processes_of(state: Path) -> List[psutil.Process]:
    """Every live process that belongs to the ring at ``state``: its environment
    says RING_STATE=<state> or its command line names the state dir."""
    key = str(state)
    found = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        if p.pid == os.getpid():
            continue
        try:
            cmd = p.info["cmdline"] or []
            if any(key in part for part in cmd):
                found.append(p)
                continue
            if p.environ().get("RING_STATE") == key:
                found.append(p)
        except (psutil.Error, OSError):
            continue
    return found


def _not_zombie(p: psutil.Process) -> bool:
    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def kill_tree(pid: int) -> None:
    try:
        root = psutil.Process(pid)
        victims = root.children(recursive=True) + [root]
    except psutil.Error:
        return
    for p in victims:
        try:
            p.send_signal(signal.SIGCONT)
            p.kill()
        except psutil.Error:
            pass


class FileErrPopen(subprocess.Popen):
    """Popen whose stderr may be a file: communicate() then returns its bytes."""
    err_path: Optional[Path] = None

    def communicate(self, input=None, timeout=None):
        out, err = super().communicate(input, timeout)
        if self.err_path is not None:
            err = self.err_path.read_bytes()
            if self.text_mode:
                err = err.decode()
        return out, err


class Ring:
    """A private ring under ``tmp_path``: state dir, config, roster, agent scripts."""

    def __init__(self, tmp_path: Path):
        self.base = tmp_path
        self.state = tmp_path / "state"
        self.state.mkdir(mode=0o700)
        self.agents_dir = tmp_path / "agents"
        self.agents_dir.mkdir()
        self.config_path = tmp_path / "ring.yaml"
        self.config: Dict = json.loads(json.dumps(FAST_CONFIG))
        self.write_config()
        self.procs: List[subprocess.Popen] = []
        self.env = dict(os.environ)
        self.env.pop("NOTIFY_SOCKET", None)
        self.env["PYTHONPATH"] = str(REPO) + os.pathsep + self.env.get("PYTHONPATH", "")

    # --- files ---------------------------------------------------------------
    @property
    def roster_path(self) -> Path:
        return self.state / "ring.txt"

    @property
    def journal_path(self) -> Path:
        return self.state / "journal.db"

    def write_config(self, **sections) -> Path:
        import yaml
        for section, values in sections.items():
            self.config.setdefault(section, {}).update(values)
        self.config_path.write_text(yaml.safe_dump(self.config))
        os.chmod(self.config_path, 0o600)
        return self.config_path

    def agent(self, name: str, body: str) -> Path:
        """Write an executable sh script for an agent; returns its path."""
        path = self.agents_dir / f"{name}.sh"
        path.write_text("#!/bin/sh\n" + textwrap.dedent(body).lstrip("\n"))
        path.chmod(0o755)
        return path

    def roster(self, *lines: str) -> Path:
        """Write ring.txt atomically (the driver may be reading it)."""
        tmp = self.state / ".ring.txt.tmp"
        tmp.write_text("\n".join(lines) + "\n")
        os.chmod(tmp, 0o600)
        os.replace(tmp, self.roster_path)
        return self.roster_path

    # --- processes -------------------------------------------------------------
    def common(self) -> List[str]:
        return ["--state", str(self.state), "--config", str(self.config_path)]

    def start(self, argv: List[str], **kw) -> subprocess.Popen:
        kw.setdefault("stdout", subprocess.PIPE)
        err_path = None
        if "stderr" not in kw:
            # A daemon logs a line per run: a pipe nobody reads fills up and
            # blocks it. Its stderr goes to a file; communicate() returns it.
            err_path = self.base / f"proc-{len(self.procs)}.stderr"
            kw["stderr"] = open(err_path, "wb")
        try:
            p = FileErrPopen(argv, env=kw.pop("env", self.env), start_new_session=True, **kw)
        finally:
            if err_path is not None:
                kw["stderr"].close()
        p.err_path = err_path
        self.procs.append(p)
        return p

    def start_driver(self, *extra: str, **kw) -> subprocess.Popen:
        return self.start(ring_cmd("run", *self.common(), *extra), **kw)

    def start_watcher(self, *extra: str, **kw) -> subprocess.Popen:
        return self.start(watch_cmd(*self.common(), *extra), **kw)

    def cli(self, *args: str, timeout: float = 30, env: Optional[Dict] = None) -> subprocess.CompletedProcess:
        argv = ring_cmd(*args[:1], *self.common(), *args[1:])
        return subprocess.run(argv, env=env or self.env, capture_output=True, text=True, timeout=timeout)

    def cleanup(self) -> None:
        for p in self.procs:
            kill_tree(p.pid)
        # Agents may still be forking while we kill: repeat until none is left
        # (bounded; a zombie whose parent died is reaped by init meanwhile).
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            alive = [p for p in processes_of(self.state) if _not_zombie(p)]
            if not alive:
                break
            for p in alive:
                kill_tree(p.pid)
            time.sleep(0.02)
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
            for stream in (p.stdout, p.stderr):
                if stream:
                    stream.close()
        cgroup.sweep(self.state)   # run cgroups of a driver the test killed

    # --- journal ---------------------------------------------------------------
    def rows(self, sql: str = "SELECT * FROM runs ORDER BY id", *params) -> List[sqlite3.Row]:
        if not self.journal_path.exists():
            return []
        con = sqlite3.connect(f"file:{self.journal_path}?mode=ro", uri=True, timeout=10)
        con.row_factory = sqlite3.Row
        try:
            return con.execute(sql, params).fetchall()
        except sqlite3.OperationalError as e:
            if "no such table" in str(e):
                return []
            raise
        finally:
            con.close()

    def runs(self) -> List[sqlite3.Row]:
        return self.rows()

    def heartbeat(self) -> Optional[Dict]:
        # never a blocking open: a test that plants a FIFO there must not hang with
        # its daemons (a harness killed in a hang runs no finaliser: they leak)
        return read_json(self.state / "ringd.heartbeat")


@pytest.fixture
def ring(tmp_path):
    r = Ring(tmp_path)
    yield r
    r.cleanup()
    leftovers = [p for p in processes_of(r.state) if _not_zombie(p)]
    assert not leftovers, f"processes left behind: {[p.pid for p in leftovers]}"


def use_up_inodes(directory: Path) -> List[Path]:
    """Create empty files in ``directory`` until its file system has no inode
    left (ENOSPC); returns them (the bytes are left free)."""
    made = []
    while True:
        path = directory / f"inode-filler-{len(made)}"
        try:
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        except FileExistsError:
            made.append(path)
            continue
        except OSError as e:
            if e.errno == errno.ENOSPC:
                return made
            raise
        made.append(path)


def fill_up(directory: Path) -> Path:
    """Fill the file system under ``directory`` with one file, to its last byte; returns it."""
    filler = directory / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        for size in (65536, 4096, 512, 1):
            try:
                while True:
                    os.write(fd, b"\0" * size)
            except OSError:
                pass
    finally:
        os.close(fd)
    return filler
