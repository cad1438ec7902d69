"""The service under a real systemd: a systemd-nspawn machine booted from this
box's own file system (``--volatile=yes``: a tmpfs root, /usr read-only from the
host), with this checkout installed into a venv and both deployment modes
installed by ``ringd service install`` as the README tells a user to.

What it checks, in each mode: readiness (``Type=notify``), ``STATUS=``, a root
shell's ``ringd status`` and ``ringd skip`` (the units' ``ProtectProc=invisible``
gives them a procfs of their own), the watchdog replacing a SIGSTOPped main
process, recovery from a SIGKILLed driver and watcher with the run's status and
the agent's counters right, ``systemctl stop`` with a run in flight (the run
``interrupted``, never ``failed``: ``KillMode=control-group`` SIGTERMs the agent
with the driver) leaving no process and no cgroup, and ``systemd-analyze
security`` on the live units.

One machine for the whole module, started and stopped here: it runs in a cgroup
of its own, and the finaliser stops it by its pid, kills by pid whatever is left
in that cgroup and removes it. Skipped, with the reason, only where a machine
cannot be booted (not root, no systemd-nspawn, no writable cgroup tree).
"""
from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional

import pytest

from conftest import REPO, wait_until

# The module's tests share one xdist worker (pyproject's --dist loadgroup), and
# one machine; a lock keeps machines of concurrent runs of the suite one at a time.
pytestmark = pytest.mark.xdist_group("systemd-nspawn")
LOCK = Path("/run/ring-test-nspawn.lock") if Path("/run").is_dir() else Path("/var/lib/ring-test-nspawn.lock")

NSPAWN = shutil.which("systemd-nspawn")
MAX_EXPOSURE = 6.0            # SPEC: systemd-analyze security rates the units 6.0 or better
WATCHDOG_SEC = 6              # a drop-in shortens the units' WatchdogSec=60, as `systemctl edit` would
RESTART_SEC = 5               # the units' RestartSec= and the watcher's restart_sec (the config's default)
BOOT_TIMEOUT = 60
ROSTER = "tick true\nslow sleep 300\n"
PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


# --- the machine ------------------------------------------------------------------------

def _own_cgroups() -> List[Path]:
    """This process's cgroup in each hierarchy systemd-nspawn uses: the cgroup2
    one, and on a hybrid box the v1 ``name=systemd`` one."""
    rel = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        num, controllers, path = line.split(":", 2)
        if num == "0":
            rel["cgroup2"] = path
        elif controllers == "name=systemd":
            rel["name=systemd"] = path
    found = []
    for line in Path("/proc/self/mounts").read_text().splitlines():
        _dev, where, fstype, opts = line.split()[:4]
        key = "cgroup2" if fstype == "cgroup2" else "name=systemd" if "name=systemd" in opts.split(",") else None
        if key in rel:
            found.append(Path(where + rel.pop(key)))
    return found


def _cgroup_procs(root: Path) -> List[int]:
    pids = []
    for dirpath, _dirs, files in os.walk(root):
        if "cgroup.procs" in files:
            try:
                pids += [int(p) for p in Path(dirpath, "cgroup.procs").read_text().split()]
            except OSError:
                pass
    return pids


def _remove_cgroup(root: Path) -> None:
    """SIGKILL by pid whatever is still in ``root`` (nothing, after a clean
    shutdown), wait until it is empty, then remove it, deepest first."""
    if not root.exists():
        return
    deadline = time.monotonic() + 20
    while _cgroup_procs(root) and time.monotonic() < deadline:
        for pid in _cgroup_procs(root):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.1)
    for dirpath, _dirs, _files in sorted(os.walk(root), key=lambda w: -len(w[0])):
        try:
            os.rmdir(dirpath)
        except OSError:
            pass


class Machine:
    """A booted systemd-nspawn machine and a root shell in it (nsenter)."""

    def __init__(self, name: str, work: Path, proc: subprocess.Popen, init: int):
        self.name, self.work, self.proc, self.init = name, work, proc, init
        self.bin = work / "venv" / "bin"
        self.env = {"PATH": PATH, "LANG": "C.UTF-8", "HOME": "/root", "TERM": "dumb",
                    "SYSTEMD_PAGER": "cat", "SYSTEMD_COLORS": "0"}

    def run(self, *argv: str, timeout: float = 60, check: bool = True) -> subprocess.CompletedProcess:
        r = subprocess.run(["nsenter", "-t", str(self.init), "-a", "--", *argv], capture_output=True, text=True,
                           timeout=timeout, env=self.env, cwd="/")
        if check and r.returncode != 0:
            raise AssertionError(f"{' '.join(argv)}: exit {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
        return r

    def sh(self, script: str, **kw) -> subprocess.CompletedProcess:
        return self.run("sh", "-c", script, **kw)

    def show(self, unit: str, *props: str) -> Dict[str, str]:
        out = self.run("systemctl", "show", unit, *[f"--property={p}" for p in props]).stdout
        return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)

    def write(self, path: str, text: str, mode: str = "0644") -> None:
        r = subprocess.run(["nsenter", "-t", str(self.init), "-a", "--", "sh", "-c",
                            f'mkdir -p "$(dirname "$1")" && cat > "$1" && chmod {mode} "$1"', "sh", path],
                           input=text, capture_output=True, text=True, timeout=30, env=self.env, cwd="/")
        assert r.returncode == 0, r.stderr

    def journal(self, unit: str) -> str:
        return self.run("journalctl", "-b", "-u", unit, "--no-pager", "-o", "cat").stdout


def _install_checkout(work: Path) -> None:
    """This checkout into a venv of the machine's Python, as the README's
    ``python3 -m venv /opt/ring && /opt/ring/bin/pip install .`` does."""
    src = work / "src"
    src.mkdir()
    for name in ("ringd", "ringwatch", "config", "pyproject.toml", "README.md"):
        (shutil.copytree if (REPO / name).is_dir() else shutil.copy2)(
            REPO / name, src / name, **({"symlinks": True, "ignore": shutil.ignore_patterns("__pycache__")}
                                        if (REPO / name).is_dir() else {}))
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", "--system-site-packages", str(work / "venv")],
                   check=True, timeout=120)
    try:   # offline when the build backend is at hand (setuptools + wheel), else pip's usual isolated build
        import wheel  # noqa: F401
        isolation = ["--no-build-isolation", "--no-index"]
    except ImportError:
        isolation = []
    pip = subprocess.run([sys.executable, "-m", "pip", "--python", str(work / "venv/bin/python"), "install",
                          "--quiet", "--no-deps", "--disable-pip-version-check", *isolation, str(src)],
                         capture_output=True, text=True, timeout=300, cwd=work)
    assert pip.returncode == 0, pip.stdout + pip.stderr
    # a checkout cloned under umask 077 is the tester's alone: the service's own user must read it
    for path in [work, *work.rglob("*")]:
        if not path.is_symlink():
            mode = path.stat().st_mode
            path.chmod(mode | 0o444 | (0o111 if mode & 0o100 or path.is_dir() else 0))


def _binds(work: Path) -> List[str]:
    """What the machine needs of the host beyond /usr: the venv, the Python it
    was made from (pyenv keeps it under /root), and nsswitch.conf (its /etc is
    a fresh tmpfs; a dynamic user's name resolves through nss-systemd)."""
    binds = [f"--bind-ro={work}", "--bind-ro=/etc/nsswitch.conf"]
    base = Path(sys.base_prefix).resolve()
    if not str(base).startswith("/usr/"):
        binds.append(f"--bind-ro={base}")
    return binds


def _boot(name: str, work: Path, cgroups: List[Path], log) -> subprocess.Popen:
    def into_own_cgroup():   # (in the child, before exec: nspawn's payload and supervisor cgroups go under it)
        for cg in cgroups:
            with open(cg / "cgroup.procs", "w") as f:
                f.write("0")
    return subprocess.Popen([NSPAWN, "-D", "/", "--volatile=yes", "-M", name, "--register=no", "--keep-unit",
                             "--console=passive", "--quiet", *_binds(work), "--boot", "--",
                             "systemd.firstboot=off"],
                            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                            preexec_fn=into_own_cgroup)


def _init_of(proc: subprocess.Popen) -> Optional[int]:
    """The machine's PID 1 as the host sees it: nspawn's child running systemd."""
    try:
        children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
    except OSError:
        return None
    for pid in children:
        try:
            if Path(f"/proc/{pid}/comm").read_text().strip() == "systemd":
                return int(pid)
        except OSError:
            pass
    return None


def _stop(proc: subprocess.Popen, cgroups: List[Path]) -> List[str]:
    """Stop the machine by nspawn's pid (SIGTERM: the machine powers off), then
    end by pid whatever is left; returns what had to be killed or stayed."""
    trouble = []
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            trouble.append(f"systemd-nspawn (pid {proc.pid}) outlived SIGTERM by 30 s")
            proc.kill()
            proc.wait(timeout=30)
    for cg in cgroups:
        left = _cgroup_procs(cg)
        if left:
            trouble.append(f"{cg}: processes {left} were left")
        _remove_cgroup(cg)
        if cg.exists():
            trouble.append(f"{cg} could not be removed")
    return trouble


@pytest.fixture(scope="module")
def machine():
    if os.geteuid() != 0:
        pytest.skip("booting a systemd-nspawn machine needs root")
    if NSPAWN is None or not shutil.which("nsenter"):
        pytest.skip("systemd-nspawn is not installed (apt-get install systemd-container)")
    if not Path("/usr/lib/systemd/systemd").exists():
        pytest.skip("no systemd in /usr to boot")
    lock = os.open(LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        wait_until(lambda: _locked(lock), 300, interval=0.5, message="another run's machine to stop")
        yield from _machine()
    finally:
        os.close(lock)


def _locked(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


def _machine():
    name = f"ring-test-{os.getpid()}"
    parents = _own_cgroups()
    if not parents:
        pytest.skip("no cgroup hierarchy systemd-nspawn can use")
    cgroups = [p / name for p in parents]
    try:
        for cg in cgroups:
            cg.mkdir()
    except OSError as e:
        for cg in cgroups:
            _remove_cgroup(cg)
        pytest.skip(f"cannot create a cgroup for the machine ({e.strerror}): systemd-nspawn cannot run here")
    work = Path(tempfile.mkdtemp(prefix="ring-test-", dir="/var/lib"))   # not /tmp: PrivateTmp hides it
    work.chmod(0o755)
    proc = None
    log = open(work / "nspawn.log", "wb")
    try:
        _install_checkout(work)
        t0 = time.monotonic()
        proc = _boot(name, work, cgroups, log)
        init = wait_until(lambda: proc.poll() is not None or _init_of(proc), 20, interval=0.1,
                          message="the machine's systemd started")
        if proc.poll() is not None:
            said = (work / "nspawn.log").read_text(errors="replace").strip()
            if re.search(r"Operation not permitted|Permission denied|not supported", said):
                pytest.skip(f"systemd-nspawn cannot run here: {said.splitlines()[-1][:300]}")
            raise AssertionError(f"systemd-nspawn exited {proc.returncode} before booting:\n{said[-3000:]}")
        m = Machine(name, work, proc, init)
        # (until its manager answers: before, systemctl cannot connect and prints nothing)
        state = wait_until(lambda: m.run("systemctl", "is-system-running", "--wait", timeout=BOOT_TIMEOUT,
                                         check=False).stdout.strip(), BOOT_TIMEOUT, interval=0.1,
                           message="the machine's systemd to answer")
        assert state in ("running", "degraded"), (state, (work / "nspawn.log").read_text()[-3000:])
        m.boot_seconds = time.monotonic() - t0
        # this box's Python may live under /root (pyenv): let the services' users reach it
        for p in reversed(Path(sys.base_prefix).resolve().parents):
            if str(p) not in ("/", "/usr") and not str(p).startswith("/usr/"):
                m.run("chmod", "o+x", str(p))
        yield m
    finally:
        log.close()
        if proc is not None:
            trouble = _stop(proc, cgroups)
        else:
            trouble = []
            for cg in cgroups:
                _remove_cgroup(cg)
        out = (work / "nspawn.log").read_text(errors="replace")[-2000:] if trouble else ""
        shutil.rmtree(work, ignore_errors=True)
        assert not trouble, "\n".join(trouble) + "\n" + out


# --- a ring in the machine ---------------------------------------------------------------

SQL = """
import json, sqlite3, sys
c = sqlite3.connect("file:" + sys.argv[1] + "?mode=ro", uri=True)
rows = c.execute("SELECT id, agent, status, signal, reason, (SELECT source FROM events e WHERE e.run_id = r.id"
                 " ORDER BY e.id DESC LIMIT 1) FROM runs r ORDER BY id")
print(json.dumps([dict(zip(("id", "agent", "status", "signal", "reason", "source"), r)) for r in rows]))
"""

LEFT = """
import os, sys
uid, key, out = int(sys.argv[1]), sys.argv[2].encode(), []
for p in filter(str.isdigit, os.listdir("/proc")):
    try:
        st, env = os.stat("/proc/" + p), open("/proc/%s/environ" % p, "rb").read()
    except OSError:
        continue
    if st.st_uid == uid or key in env:
        out.append(p + " " + open("/proc/%s/cmdline" % p, "rb").read().replace(b"\\0", b" ").decode())
print("\\n".join(out))
"""


class Ring:
    """One deployment mode installed in the machine by ``ringd service install``."""

    def __init__(self, m: Machine, mode: str, state: str, config: str, main: str, units: List[str]):
        self.m, self.mode, self.state, self.config, self.main, self.units = m, mode, state, config, main, units
        self.figures: Dict[str, float] = {}

    def cli(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return self.m.run(str(self.m.bin / "ringd"), "--state", self.state, "--config", self.config, *args,
                          check=check)

    def status(self) -> dict:
        r = self.cli("status", "--json", check=False)
        doc = json.loads(r.stdout)
        doc["exit"] = r.returncode
        return doc

    def runs(self) -> List[dict]:
        from ringd.journal.sqlite import JOURNAL_FILE
        return json.loads(self.m.run(str(self.m.bin / "python"), "-c", SQL, f"{self.state}/{JOURNAL_FILE}").stdout)

    def run_row(self, run_id: int) -> dict:
        return next(r for r in self.runs() if r["id"] == run_id)

    def reset_limits(self) -> None:
        """The checks' own starts count against the units' StartLimitBurst= (5 in
        600 s) as an operator's would: clear them as one would."""
        self.m.run("systemctl", "reset-failed", *self.units)

    def main_pid(self) -> int:
        return int(self.m.show(self.main, "MainPID")["MainPID"])

    def slow_running(self, not_run: Optional[int] = None, timeout: float = 40) -> dict:
        """status --json once the agent ``slow`` runs (another run than ``not_run``)
        under a healthy driver."""
        def seen():
            doc = self.status()
            cur = doc.get("current") or {}
            ok = doc["driver"]["health"] == "ok" and cur.get("agent") == "slow" and cur.get("pid")
            return doc if ok and cur.get("run_id") != not_run else None
        return wait_until(seen, timeout, interval=0.2, message=f"{self.mode}: slow running under a healthy driver")

    def closed(self, run_id: int, timeout: float = 30) -> dict:
        return wait_until(lambda: (lambda r: r if r["status"] != "running" else None)(self.run_row(run_id)),
                          timeout, interval=0.2, message=f"{self.mode}: run {run_id} closed")

    def ticks(self, pid: int) -> Optional[int]:
        r = self.m.run("cat", f"/proc/{pid}/stat", check=False)
        if r.returncode != 0:
            return None
        fields = r.stdout[r.stdout.rfind(")") + 2:].split()
        return None if fields[0] == "Z" else int(fields[19])

    def counters_right(self) -> None:
        """The agents' counters after every ending here, none of them the agents'
        fault: no failure counted, nothing quarantined, and ``runs`` is the
        number of its ended runs in the journal."""
        doc, rows = self.status(), self.runs()
        assert not [r for r in rows if r["status"] in ("failed", "error", "stalled", "timeout")], rows
        for agent in doc["agents"]:
            ended = [r for r in rows if r["agent"] == agent["name"] and r["status"] != "running"]
            assert agent["consecutive_failures"] == 0 and agent["quarantined_until"] is None, agent
            assert agent["runs"] == len(ended), (agent, ended)

    def leftovers(self) -> str:
        """Processes of the ring's user, or carrying its state dir, in the machine."""
        real = self.m.run("readlink", "-f", self.state).stdout.strip()
        uid = self.m.run("stat", "-c", "%u", real).stdout.strip()
        return self.m.run(str(self.m.bin / "python"), "-c", LEFT, uid, f"RING_STATE={real}").stdout.strip()


def _install(m: Machine, mode: str, state: str, config: str, main: str, units: List[str]) -> Ring:
    """The README's steps: ``ringd service install``, a roster, then enable it."""
    flags = [] if mode == "systemd" else ["--state", state, "--config", config]
    r = m.run(str(m.bin / "ringd"), "service", "install", "--mode", mode, *flags)
    assert "systemctl daemon-reload && systemctl enable --now" in r.stdout, r.stdout
    m.write(f"{state}/ring.txt", ROSTER, "0600")
    # a shorter watchdog than the units' 60 s, as `systemctl edit UNIT` would add
    m.write(f"/etc/systemd/system/{main}.d/watchdog.conf", f"[Service]\nWatchdogSec={WATCHDOG_SEC}\n")
    m.run("systemctl", "daemon-reload")
    t0 = time.monotonic()
    m.run("systemctl", "enable", "--now", *units, timeout=120)
    ring = Ring(m, mode, state, config, main, units)
    ring.figures["enable --now, s"] = round(time.monotonic() - t0, 2)
    return ring


def _exposure(m: Machine, unit: str) -> float:
    out = m.run("systemd-analyze", "security", unit, "--no-pager", check=False)
    found = re.search(r"Overall exposure level for \S+: ([0-9.]+)", out.stdout + out.stderr)
    assert found, out.stdout[-2000:] + out.stderr[-2000:]
    return float(found.group(1))


def _ready_at_once(ring: Ring, driver_pid: Optional[int], watcher_unit: str) -> None:
    """``Type=notify``: ``systemctl start`` returned only after READY=1, which the
    daemons send once started (the driver after its first heartbeat, the watcher
    once its driver runs): a root shell sees them healthy at once, no waiting."""
    doc = ring.status()
    watcher_pid = int(ring.m.show(watcher_unit, "MainPID")["MainPID"])
    assert (doc["watcher"]["alive"], doc["watcher"]["pid"]) == (True, watcher_pid), doc["watcher"]
    for unit in ring.units:
        p = ring.m.show(unit, "Type", "ActiveState", "SubState", "ExecMainStartTimestampMonotonic",
                        "ActiveEnterTimestampMonotonic")
        assert p["Type"] == "notify" and (p["ActiveState"], p["SubState"]) == ("active", "running"), p
        gap = int(p["ActiveEnterTimestampMonotonic"]) - int(p["ExecMainStartTimestampMonotonic"])
        assert gap > 0, p
        ring.figures[f"{unit}: READY=1 after exec, s"] = round(gap / 1e6, 3)
    if driver_pid is not None:
        assert (doc["driver"]["health"], doc["driver"]["pid"]) == ("ok", driver_pid), doc["driver"]


def _root_shell_sees_the_ring(ring: Ring, driver_pid: int, watcher_pid: int) -> None:
    """A root shell in the machine: ``ringd status`` says the live driver is ok (the
    units' private procfs shows another boot id than the shell's), and ``ringd
    skip`` ends the current run."""
    doc = ring.slow_running()
    assert doc["exit"] == 0 and (doc["driver"]["health"], doc["driver"]["pid"]) == ("ok", driver_pid), doc["driver"]
    assert doc["watcher"]["alive"] is True and doc["watcher"]["pid"] == watcher_pid, doc["watcher"]
    assert re.search(r"^driver\s+ok\b", ring.cli("status").stdout, re.M)
    shell = json.loads(ring.m.run(str(ring.m.bin / "python"), "-c",
                                  "import json; from ringd.host import procid; print(json.dumps(procid.here()))").stdout)
    hb = json.loads(ring.m.run("cat", f"{ring.state}/ringd.heartbeat").stdout)
    # what made the shell say "driver DEAD": the units read the kernel's boot id, the shell nspawn's
    assert (hb["boot_view"], shell["boot_view"]) == ("kernel", "mounted") and hb["boot_id"] != shell["boot_id"]
    assert hb["pid_ns"] == shell["pid_ns"], (hb, shell)
    run_id = doc["current"]["run_id"]
    r = ring.cli("skip", check=False)
    assert r.returncode == 0, (r.stdout, r.stderr)
    assert ring.closed(run_id, 10)["status"] == "skipped"


def _stops_interrupt(ring: Ring, times: int, stop: List[str], start: List[str]) -> None:
    """``systemctl stop`` with a run in flight: systemd SIGTERMs the agent with the
    driver (KillMode=control-group); the run is ``interrupted`` by the driver,
    never ``failed``, whichever death the driver sees first."""
    for _ in range(times):
        ring.reset_limits()
        run_id = ring.slow_running()["current"]["run_id"]
        t0 = time.monotonic()
        ring.m.run("systemctl", "stop", *stop, timeout=60)
        ring.figures["systemctl stop with a run in flight, s"] = round(time.monotonic() - t0, 2)
        row = ring.closed(run_id, 5)
        assert (row["status"], row["source"]) == ("interrupted", "driver"), row
        ring.m.run("systemctl", "start", *start, timeout=60)


def _sigkill_recovered(ring: Ring, what: str, victim: int, unit_restarts: bool, source: str) -> None:
    """SIGKILL ``victim`` with the agent running: the ring comes back by itself, the
    run is ``interrupted`` (``source``: by the reaper of the next driver, or by the
    driver that systemd stopped with its killed watcher), and no counter moves."""
    ring.reset_limits()
    doc = ring.slow_running()
    run_id, agent, main = doc["current"]["run_id"], doc["current"]["pid"], ring.main_pid()
    agent_ticks = ring.ticks(agent)
    restarts = int(ring.m.show(ring.main, "NRestarts")["NRestarts"])
    t0 = time.monotonic()
    ring.m.run("kill", "-KILL", str(victim))
    row = ring.closed(run_id, RESTART_SEC + 20)
    assert (row["status"], row["source"]) == ("interrupted", source), row
    doc = ring.slow_running(not_run=run_id, timeout=RESTART_SEC + 30)
    ring.figures[f"SIGKILL of the {what}: slow running again after, s"] = round(time.monotonic() - t0, 2)
    assert ring.ticks(agent) != agent_ticks, "the killed driver's agent outlived its run"
    assert int(ring.m.show(ring.main, "NRestarts")["NRestarts"]) == restarts + (1 if unit_restarts else 0)
    assert (ring.main_pid() != main) == unit_restarts
    ring.counters_right()


def _watchdog_replaces_a_stopped_main(ring: Ring) -> None:
    """SIGSTOP the unit's main process: it stops sending WATCHDOG=1; systemd aborts
    it after WatchdogSec and starts it again; the next driver reaps the run."""
    ring.reset_limits()
    doc = ring.slow_running()
    run_id, main = doc["current"]["run_id"], ring.main_pid()
    restarts = int(ring.m.show(ring.main, "NRestarts")["NRestarts"])
    t0 = time.monotonic()
    ring.m.run("kill", "-STOP", str(main))
    wait_until(lambda: ring.main_pid() not in (0, main), WATCHDOG_SEC + RESTART_SEC + 30, interval=0.2,
               message=f"{ring.main}: the watchdog replaced the stopped main process")
    ring.figures["SIGSTOP: main process replaced after, s"] = round(time.monotonic() - t0, 2)
    assert f"Watchdog timeout (limit {WATCHDOG_SEC}s)!" in ring.m.journal(ring.main)
    assert int(ring.m.show(ring.main, "NRestarts")["NRestarts"]) == restarts + 1
    row = ring.closed(run_id, 30)
    assert (row["status"], row["source"]) == ("interrupted", "reaper"), row
    ring.slow_running(not_run=run_id)
    ring.counters_right()


def _stop_leaves_nothing(ring: Ring) -> None:
    """``systemctl stop`` of the mode's units: no process of the ring's user or
    carrying its state dir, no unit cgroup (nor any run's, inside it)."""
    groups = {u: ring.m.show(u, "ControlGroup")["ControlGroup"] for u in ring.units}
    assert all(groups.values()), groups
    _stops_interrupt(ring, 1, ring.units, ring.units)
    ring.slow_running()
    ring.m.run("systemctl", "stop", *ring.units, timeout=60)
    assert ring.leftovers() == ""
    mounts = [ln.split()[1] for ln in ring.m.run("cat", "/proc/self/mounts").stdout.splitlines()
              if ln.split()[2] in ("cgroup", "cgroup2")]
    for unit, group in groups.items():
        for mount in mounts:
            assert ring.m.run("test", "-e", mount + group, check=False).returncode != 0, (unit, mount + group)
        assert ring.m.show(unit, "ActiveState")["ActiveState"] == "inactive"
    ring.counters_right()


def _secure_enough(ring: Ring) -> None:
    for unit in ring.units:
        level = _exposure(ring.m, unit)
        ring.figures[f"systemd-analyze security {unit}"] = level
        assert level <= MAX_EXPOSURE, (unit, level)


# --- mode 2: systemd owns the driver -------------------------------------------------------

@pytest.fixture(scope="module")
def systemd_mode(machine):
    ring = _install(machine, "systemd", "/var/lib/ring", "/etc/ring/ring.yaml", "ringd.service",
                    ["ringd.service", "ringwatch-systemd.service"])
    yield ring
    print(f"\nmode systemd, boot {machine.boot_seconds:.1f} s: {json.dumps(ring.figures, indent=1)}")
    machine.run("systemctl", "disable", "--now", *ring.units, timeout=60, check=False)


def test_systemd_mode_is_ready_and_a_root_shell_sees_it(systemd_mode):
    ring = systemd_mode
    _ready_at_once(ring, ring.main_pid(), "ringwatch-systemd.service")
    status = ring.m.show("ringd.service", "StatusText")["StatusText"]
    assert re.fullmatch(r"lap \d+: running (tick|slow)|running the ring of 2 agent\(s\)", status), status
    wait_until(lambda: ring.m.show("ringd.service", "StatusText")["StatusText"].endswith("running slow"), 30,
               interval=0.2, message="STATUS= names the running agent")
    watcher = ring.m.show("ringwatch-systemd.service", "StatusText", "MainPID")
    # (then what the driver last said it does, as its heartbeat has it)
    assert re.fullmatch(rf"driver ok \(pid {ring.main_pid()}\)(: .+)?", watcher["StatusText"]), watcher
    _root_shell_sees_the_ring(ring, ring.main_pid(), int(watcher["MainPID"]))
    _secure_enough(ring)


def test_systemd_mode_stop_interrupts_the_run(systemd_mode):
    _stops_interrupt(systemd_mode, 6, ["ringd.service"], ["ringd.service"])
    systemd_mode.counters_right()


def test_systemd_mode_recovers_a_sigkilled_driver(systemd_mode):
    _sigkill_recovered(systemd_mode, "driver", systemd_mode.main_pid(), unit_restarts=True, source="reaper")


def test_systemd_mode_watchdog_replaces_a_stopped_driver(systemd_mode):
    _watchdog_replaces_a_stopped_main(systemd_mode)


def test_systemd_mode_stop_leaves_nothing(systemd_mode):
    _stop_leaves_nothing(systemd_mode)


# --- mode 1: the watcher owns the driver ---------------------------------------------------

@pytest.fixture(scope="module")
def watcher_mode(machine):
    machine.run("systemctl", "disable", "--now", "ringd.service", "ringwatch-systemd.service", timeout=60,
                check=False)
    ring = _install(machine, "watcher", "/var/lib/ring-w", "/etc/ring-w/ring.yaml", "ringwatch.service",
                    ["ringwatch.service"])
    yield ring
    print(f"\nmode watcher: {json.dumps(ring.figures, indent=1)}")
    machine.run("systemctl", "disable", "--now", *ring.units, timeout=60, check=False)


def test_watcher_mode_is_ready_and_a_root_shell_sees_it(watcher_mode):
    ring = watcher_mode
    _ready_at_once(ring, None, "ringwatch.service")
    doc = ring.slow_running()
    status = ring.m.show("ringwatch.service", "StatusText")["StatusText"]
    # ("starting" until its first poll of the driver's heartbeat, watch.poll_interval after the start)
    assert re.fullmatch(rf"driver (starting|ok) \(pid {doc['driver']['pid']}\)(: .+)?", status), status
    _root_shell_sees_the_ring(ring, doc["driver"]["pid"], ring.main_pid())
    _secure_enough(ring)


def test_watcher_mode_recovers_a_sigkilled_driver(watcher_mode):
    driver = watcher_mode.slow_running()["driver"]["pid"]
    _sigkill_recovered(watcher_mode, "driver", driver, unit_restarts=False, source="reaper")


def test_watcher_mode_recovers_a_sigkilled_watcher(watcher_mode):
    for _ in range(2):
        _sigkill_recovered(watcher_mode, "watcher", watcher_mode.main_pid(), unit_restarts=True, source="driver")


def test_watcher_mode_watchdog_replaces_a_stopped_watcher(watcher_mode):
    _watchdog_replaces_a_stopped_main(watcher_mode)


def test_watcher_mode_stop_leaves_nothing(watcher_mode):
    _stop_leaves_nothing(watcher_mode)
