"""Local security: private files whatever the umask, StrictModes-like refusals,
no descriptor or systemd socket leaks into agents, no write through a symlink
planted in the state dir, and control commands only for users who can write
the state dir. Real processes throughout; as root where the test needs it.
"""
from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import List

import psutil
import pytest

from conftest import line_written, one_line, wait_until
from ringd.host import safefile

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux semantics")

NOBODY = 65534


def finish(proc, timeout=30.0):
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"pid {proc.pid} did not exit within {timeout}s")
    return proc.returncode, (err or b"").decode(errors="replace")


def mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


# --- private files -----------------------------------------------------------------------

def test_everything_in_the_state_dir_is_private_whatever_the_umask(ring, tmp_path):
    """ringwatch + ringd started with umask 000 on a state dir that does not exist
    yet: every directory they create is 0700, every file 0600 (journal and its WAL
    and SHM, heartbeat, locks, ringwatch.json, metrics, driver log, run logs)."""
    ring.state = tmp_path / "fresh" / "state"     # the fixture's cleanup scans this one
    (tmp_path / "fresh").mkdir()
    roster = tmp_path / "roster.txt"
    ring.agent("a", "echo hi")
    ring.agent("b", "echo there >&2; exit 3")
    roster.write_text(f"a {ring.agents_dir}/a.sh\nb {ring.agents_dir}/b.sh\n")
    os.chmod(roster, 0o600)
    ring.write_config(ring={"roster": str(roster)})
    w = ring.start_watcher(preexec_fn=lambda: os.umask(0))
    wait_until(lambda: len(ring.runs()) >= 4, 30, message="a few runs under the watcher")
    w.send_signal(signal.SIGTERM)
    code, err = finish(w)
    assert code == 0, err
    assert mode(ring.state) == 0o700
    seen = set()
    for root, dirs, files in os.walk(ring.state):
        for d in dirs:
            assert mode(Path(root) / d) == 0o700, f"{root}/{d} is {mode(Path(root) / d):04o}"
        for f in files:
            p = Path(root) / f
            assert mode(p) & 0o077 == 0, f"{p} is {mode(p):04o}"
            seen.add(str(p.relative_to(ring.state)))
    for must in ("journal.db", "ringd.heartbeat", "ringd.lock", "ringwatch.json", "logs/ringd.log"):
        assert must in seen, f"{must} missing (have {sorted(seen)})"
    for agent in ("a", "b"):
        assert [x for x in seen if x.startswith(f"logs/{agent}/") and x.endswith(".log")], sorted(seen)


@pytest.mark.parametrize("what, bad_mode", [
    ("state", 0o770), ("state", 0o777), ("state", 0o1777), ("state", 0o720),
    ("roster", 0o620), ("roster", 0o602), ("roster", 0o666),
    ("roster-symlink", 0o666), ("config", 0o660), ("config", 0o606),
])
def test_refuses_state_dir_roster_or_config_writable_by_others(ring, tmp_path, what, bad_mode):
    ring.agent("a", "true")
    ring.roster(f"a {ring.agents_dir}/a.sh")
    if what == "state":
        target = ring.state
    elif what == "roster":
        target = ring.roster_path
    elif what == "roster-symlink":
        target = tmp_path / "elsewhere.txt"
        target.write_text(f"a {ring.agents_dir}/a.sh\n")
        ring.roster_path.unlink()
        os.symlink(target, ring.roster_path)
    else:
        target = ring.config_path
    os.chmod(target, bad_mode)
    code, err = finish(ring.start_driver("--once"))
    assert code == 78, err
    line = one_line(err)
    assert str(target if what != "roster-symlink" else ring.roster_path) in line
    assert "writable by group or others" in line and f"{bad_mode & 0o7777:04o}"[-3:] in line
    assert not ring.runs(), "nothing may run"
    if what == "state":       # the watcher refuses the same state dir
        code, err = finish(ring.start_watcher())
        assert code == 78, err
        assert "writable by group or others" in one_line(err)


# --- nothing leaks into agents ----------------------------------------------------------------

PROBE = textwrap.dedent("""\
    import json, os, sys
    fds = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            fds[fd] = os.readlink("/proc/self/fd/" + fd)
        except OSError:
            pass
    out = {"fds": fds, "env": dict(os.environ), "ppid": os.getppid()}
    with open(os.path.join(sys.argv[1], os.environ["RING_RUN_ID"] + "-" + sys.argv[2] + ".json"), "w") as f:
        json.dump(out, f)
    """)


def _probe_agent(ring, out: Path):
    probe = ring.base / "probe.py"
    probe.write_text(PROBE)
    # the agent itself, and a grandchild that escaped into its own session
    ring.agent("probe", f"""
        {sys.executable} {probe} {out} agent
        setsid {sys.executable} {probe} {out} grandchild
        """)
    ring.roster(f"probe {ring.agents_dir}/probe.sh")


def _check_probe(ring, doc):
    fds = {int(k): v for k, v in doc["fds"].items()}
    extra = {fd: t for fd, t in fds.items() if fd > 2}
    assert not extra, f"agent inherited descriptors: {extra}"
    assert fds[0] == "/dev/null"
    assert fds[1] == fds[2] and "/logs/probe/" in fds[1]
    env = doc["env"]
    # never the driver's systemd socket: the run's own, in the state dir
    assert env.get("NOTIFY_SOCKET", "").startswith(str(ring.state / "notify-"))
    assert not [k for k in env if k.startswith("WATCHDOG_")]
    assert env["RING_STATE"] == str(ring.state)


@pytest.fixture
def notify_socket(tmp_path):
    path = str(tmp_path / "notify.sock")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(path)
    s.settimeout(0.2)
    yield path, s
    s.close()


def _received(sock) -> str:
    got = []
    while True:
        try:
            got.append(sock.recv(4096).decode(errors="replace"))
        except (socket.timeout, BlockingIOError):
            return "\n".join(got)


@pytest.mark.parametrize("under", ["driver", "watcher"])
def test_agents_inherit_no_lock_journal_or_notify_socket(ring, tmp_path, notify_socket, under):
    out = tmp_path / "probes"
    out.mkdir()
    _probe_agent(ring, out)
    path, sock = notify_socket
    env = dict(ring.env, NOTIFY_SOCKET=path, WATCHDOG_USEC="60000000", WATCHDOG_PID=str(os.getpid()))
    # the daemon inherits an open descriptor from whoever starts it (a shell, a
    # supervisor): it is marked close-on-exec at start-up, so no agent gets it
    inherited_r, inherited_w = os.pipe()
    os.set_inheritable(inherited_w, True)
    passed = {"pass_fds": (inherited_w,)}
    try:
        if under == "driver":
            started = ring.start_driver("--once", env=env, **passed)
        else:
            started = ring.start_watcher(env=env, **passed)
    finally:
        os.close(inherited_r)
        os.close(inherited_w)
    if under == "driver":
        code, err = finish(started)
        assert code == 0, err
        assert "READY=1" in _received(sock), "the driver itself must speak to systemd"
    else:
        w = started
        wait_until(lambda: len(list(out.glob("*-grandchild.json"))) >= 2, 30, message="two probe runs")
        w.send_signal(signal.SIGTERM)
        code, err = finish(w)
        assert code == 0, err
    docs = [json.loads(p.read_text()) for p in sorted(out.glob("*.json"))]
    assert len(docs) >= 2
    for doc in docs:
        _check_probe(ring, doc)


def test_lock_is_free_once_the_driver_dies_even_with_its_agent_alive(ring):
    """If an agent inherited the lock descriptor, a SIGKILLed driver's lock would
    outlive it and no new driver could start."""
    pid_file = ring.base / "agent.pid"
    ring.agent("long", f"[ -e {pid_file} ] && exit 0\necho $$ > {pid_file}; exec sleep 60")
    ring.write_config(ring={"run_budget": 30, "stall_threshold": 40})
    ring.roster(f"long {ring.agents_dir}/long.sh")
    drv = ring.start_driver()
    agent = int(line_written(pid_file, 20, message="agent running"))
    drv.send_signal(signal.SIGKILL)
    drv.wait(timeout=10)
    assert psutil.Process(agent).status() != psutil.STATUS_ZOMBIE, "agent should outlive the driver here"
    fd = os.open(ring.state / "ringd.lock", os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)   # raises if the agent holds it
        fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)
    code, err = finish(ring.start_driver("--once"), timeout=30)   # the next driver reaps it
    assert code == 0, err
    assert ring.runs()[0]["status"] == "interrupted"
    wait_until(lambda: not psutil.pid_exists(agent) or psutil.Process(agent).status() == psutil.STATUS_ZOMBIE,
               10, message="orphaned agent killed by the reaper")


# --- no write through planted symlinks -----------------------------------------------------------

@pytest.fixture
def victim(tmp_path):
    d = tmp_path / "victim"
    d.mkdir()
    f = d / "precious.txt"
    f.write_text("precious\n")
    os.utime(f, (1_000_000_000, 1_000_000_000))
    return d, f


def _untouched(victim_dir: Path, precious: Path):
    assert sorted(os.listdir(victim_dir)) == ["precious.txt"], os.listdir(victim_dir)
    assert precious.read_text() == "precious\n"
    assert os.stat(precious).st_mtime == 1_000_000_000


def _aside(folder: Path, name: str) -> List[Path]:
    return sorted(folder.glob(f"{name}.aside-*"))


@pytest.mark.parametrize("where", ["logs/a", "logs"])
def test_a_symlinked_log_dir_is_set_aside_never_followed_and_the_agent_runs(ring, victim, where):
    """A symlink at ``logs/`` or ``logs/<agent>/`` made the agent ``error`` and back
    off. It is set aside (renamed, never followed), the log dir made afresh, and
    the agent runs ``ok``; the driver says so once."""
    vdir, precious = victim
    ring.agent("a", "echo secret output")
    ring.roster(f"a {ring.agents_dir}/a.sh")
    if where == "logs/a":
        (ring.state / "logs").mkdir(mode=0o700)
    os.symlink(vdir, ring.state / where)
    code, err = finish(ring.start_driver("--once"))
    assert code == 0, err
    (row,) = ring.runs()
    assert row["status"] == "ok", dict(row)
    parent, name = (ring.state / where).parent, (ring.state / where).name
    (moved,) = _aside(parent, name)
    assert moved.is_symlink() and os.readlink(moved) == str(vdir)
    assert (ring.state / "logs" / "a" / "1.log").read_text() == "secret output\n"
    assert [ln for ln in err.splitlines() if "set aside" in ln and "symbolic link" in ln], err
    _untouched(vdir, precious)


PLANT = {"symlink": 'ln -s {precious} "$next"', "file": 'echo planted > "$next"', "fifo": 'mkfifo "$next"',
         "directory": 'mkdir "$next"'}


@pytest.mark.parametrize("plant", sorted(PLANT))
def test_anything_planted_at_the_next_run_log_is_set_aside_and_the_run_is_ok(ring, victim, plant):
    """A symlink (or a file, a FIFO, a directory) planted at the next run's log
    path - here by the agent itself, every run - made that run ``error`` and its
    agent back off (60 s, doubling). It is set aside, never written through or
    opened; every run is ``ok``, its log a new file; said once in the driver's
    log, not at every run."""
    vdir, precious = victim
    plant_it = PLANT[plant].format(precious=precious)
    ring.agent("a", f"""
        echo run $RING_RUN_ID
        next="$RING_STATE/logs/a/$((RING_RUN_ID + 1)).log"
        {plant_it}
        """)
    ring.roster(f"a {ring.agents_dir}/a.sh")
    ring.write_config(ring={"keep_logs": 1000})
    drv = ring.start_driver()
    try:
        wait_until(lambda: len([r for r in ring.runs() if r["status"] == "ok"]) >= 4, timeout=30,
                   message="four runs ok")
    finally:
        drv.send_signal(signal.SIGTERM)
        code, err = finish(drv)
    assert code == 0, err
    runs = [dict(r) for r in ring.runs()]
    assert all(r["status"] == "ok" for r in runs[:4]), runs
    logs = ring.state / "logs" / "a"
    for r in runs[1:4]:
        path = logs / f"{r['id']}.log"
        assert path.read_text() == f"run {r['id']}\n" and not path.is_symlink()
        (moved,) = _aside(logs, path.name)
        assert moved.is_symlink() if plant == "symlink" else os.path.lexists(moved)
    said = [ln for ln in err.splitlines() if "set aside" in ln]
    assert len(said) == 1 and "2.log" in said[0], err
    _untouched(vdir, precious)


def test_a_drivers_log_dirs_are_listed_once_at_start_up_not_at_each_agents_first_run(tmp_path, monkeypatch):
    """Listed back to back at start-up (RealEnv.index_run_logs), not at each
    agent's first run; what was listed is what the runs prune."""
    from ringd.host.env import RealEnv
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    for agent in ("a", "b"):
        d = state / "logs" / agent
        d.mkdir(parents=True)
        for i in (1, 2):
            (d / f"{i}.log").write_text("old\n")
    os.symlink(tmp_path, state / "logs" / "d")   # never listed through, nor written through
    listed = []
    real = safefile.run_log_ids
    monkeypatch.setattr(safefile, "run_log_ids", lambda folder: listed.append(folder) or real(folder))
    env = RealEnv(state, lambda m, level: None, prove_containment=False)
    try:
        env.index_run_logs(["a", "b", "c", "d"])   # "c": no log dir yet
        assert len(listed) == 2
        for agent, run_id in (("a", 3), ("c", 4)):
            fd, _ = env.open_run_log(agent, run_id)
            os.close(fd)
            env.keep_logs(agent, run_id, keep=2)
        assert len(listed) == 2, "listed again at a run"
        assert sorted(os.listdir(state / "logs" / "a")) == ["2.log", "3.log"]   # 1.log pruned
        assert os.listdir(state / "logs" / "c") == ["4.log"]
        fd, _ = env.open_run_log("d", 5)   # the symlink is set aside, never written through
        os.close(fd)
        assert (state / "logs" / "d").is_dir() and os.listdir(tmp_path / "state" / "logs" / "d") == ["5.log"]
    finally:
        env.close()


def test_an_agent_that_swaps_its_oldest_log_for_a_symlink_writes_nothing_through_it(ring, victim):
    """The driver knows its logs from one listing; run 3 swaps 2.log (the
    oldest, due for pruning after run 4 starts) for a symlink to a victim file."""
    vdir, precious = victim
    ring.write_config(ring={"keep_logs": 2})
    ring.agent("a", f"""
        echo run $RING_RUN_ID
        if [ "$RING_RUN_ID" = 3 ]; then rm "$RING_STATE/logs/a/2.log"; ln -s {precious} "$RING_STATE/logs/a/2.log"; fi
        if [ "$RING_RUN_ID" -ge 4 ]; then sleep 30; fi
        """)
    ring.roster(f"a {ring.agents_dir}/a.sh")
    drv = ring.start_driver()
    logs = ring.state / "logs" / "a"
    try:
        wait_until(lambda: (logs / "4.log").exists() and (logs / "4.log").read_text() == "run 4\n",
                   timeout=30, message="run 4 started and wrote its log")
        assert sorted(os.listdir(logs)) == ["2.log", "3.log", "4.log"] and (logs / "2.log").is_symlink()
        assert not (logs / "4.log").is_symlink()
        _untouched(vdir, precious)
    finally:
        drv.send_signal(signal.SIGTERM)
        finish(drv)
    assert sorted(os.listdir(logs)) == ["3.log", "4.log"]      # the symlink is pruned, never followed
    _untouched(vdir, precious)


def test_an_agent_that_swaps_its_log_dir_for_a_symlink_gets_nothing_unlinked_through_it(ring, victim):
    """Run 1's log is pruned by name after run 3. Run 3 swaps its log dir for a
    symlink to a victim dir holding a ``1.log``: the prune unlinked the victim's
    file through the link. Never: the victim is untouched, the ring goes on (the
    symlink is set aside at run 4, and its log dir made afresh)."""
    vdir, precious = victim
    other = vdir / "1.log"
    other.write_text("not ring's\n")
    ring.write_config(ring={"keep_logs": 2})
    ring.agent("a", f"""
        if [ "$RING_RUN_ID" = 3 ]; then
            mv "$RING_STATE/logs/a" "$RING_STATE/logs/a.moved" && ln -s {vdir} "$RING_STATE/logs/a"
        fi
        if [ "$RING_RUN_ID" -ge 4 ]; then sleep 30; fi
        """)
    ring.roster(f"a {ring.agents_dir}/a.sh")
    drv = ring.start_driver()
    try:
        wait_until(lambda: any(r["id"] >= 4 for r in ring.runs()), timeout=30, message="run 4's turn")
        wait_until(lambda: [r["status"] for r in ring.runs()][:3] == ["ok"] * 3, timeout=30,
                   message="runs 1-3 recorded")
    finally:
        drv.send_signal(signal.SIGTERM)
        finish(drv)
    assert other.read_text() == "not ring's\n", "unlinked through the planted symlink"
    assert sorted(os.listdir(vdir)) == ["1.log", "precious.txt"]
    (moved,) = _aside(ring.state / "logs", "a")
    assert moved.is_symlink() and (ring.state / "logs" / "a").is_dir()


def test_logs_never_reads_through_a_symlinked_log_dir(ring, victim):
    """`ringd logs` refused a symlink only at the log itself: a log dir swapped
    for a link to another dir had that dir's ``<run_id>.log`` printed as the run's."""
    vdir, _ = victim
    ring.agent("a", "echo ring output")
    ring.roster(f"a {ring.agents_dir}/a.sh")
    code, err = finish(ring.start_driver("--once"))
    assert code == 0 and [r["id"] for r in ring.runs()] == [1], err
    (vdir / "1.log").write_text("not ring's\n")
    logs = ring.state / "logs"
    os.rename(logs / "a", ring.base / "a.moved")
    os.symlink(vdir, logs / "a")
    for args in (("a",), ("a", "--lines", "1"), ("a", "--run", "1", "-f")):
        res = ring.cli("logs", *args)
        assert res.returncode == 1 and "not ring's" not in res.stdout, (args, res.stdout)
        assert f"{logs / 'a'}: log dir is a symbolic link" in one_line(res.stderr), (args, res.stderr)


def test_symlinked_heartbeat_and_journal_are_never_written_through(ring, victim):
    vdir, precious = victim
    ring.agent("a", "true")
    ring.roster(f"a {ring.agents_dir}/a.sh")
    os.symlink(precious, ring.state / "ringd.heartbeat")
    code, err = finish(ring.start_driver("--once"))
    assert code == 0, err
    assert not (ring.state / "ringd.heartbeat").is_symlink(), "heartbeat must replace the link, not follow it"
    _untouched(vdir, precious)
    # a journal replaced by a symlink is refused, the target untouched
    ring.journal_path.unlink()
    for suffix in ("-wal", "-shm"):
        Path(f"{ring.journal_path}{suffix}").unlink(missing_ok=True)
    os.symlink(precious, ring.journal_path)
    code, err = finish(ring.start_driver("--once"))
    assert code == 78, err
    assert "symbolic link" in one_line(err)
    _untouched(vdir, precious)


def test_symlinked_logs_dir_is_not_followed_by_the_watcher(ring, victim):
    """ringwatch appends the driver's output to logs/ringd.log: a symlinked logs/
    must not make it create or write a file elsewhere."""
    vdir, precious = victim
    ring.agent("a", "true")
    ring.roster(f"a {ring.agents_dir}/a.sh")
    os.symlink(vdir, ring.state / "logs")
    w = ring.start_watcher()
    try:
        wait_until(lambda: w.poll() is not None or (ring.heartbeat() or {}).get("seq", 0) > 2
                   or len(os.listdir(vdir)) > 1, 10, message="watcher and driver up (or refused)")
    finally:
        if w.poll() is None:
            w.kill()          # the fixture ends its driver by pid
        code, err = finish(w)
    assert "Traceback" not in err, err[-2000:]
    _untouched(vdir, precious)


# --- control path: only for users who can write the state dir -----------------------------------

def _as_nobody(argv, env, cwd):
    """Run ``argv`` as uid/gid 65534 in a private mount namespace where /root (the
    home of this interpreter, mode 0700) is replaced by a tmpfs holding only a bind
    of the Python install - nothing outside the namespace changes."""
    if os.geteuid() != 0:
        pytest.skip("needs root to switch users")
    for tool in ("unshare", "setpriv"):
        if not shutil.which(tool):
            pytest.skip(f"{tool} not available")
    exe = argv[0]
    setup = []
    if exe.startswith("/root/"):
        top = "/root/" + exe.split("/")[2]            # e.g. /root/.pyenv
        stash = tempfile.mkdtemp(prefix="ring-py-")
        setup = [f"mount --bind {top} {stash}", "mount -t tmpfs -o mode=755,size=1m tmpfs /root",
                 f"mkdir -p {top}", f"mount --bind {stash} {top}"]
    script = " && ".join(setup + [
        f"exec setpriv --reuid {NOBODY} --regid {NOBODY} --clear-groups " + " ".join(map(_q, argv))])
    r = subprocess.run(["unshare", "-m", "sh", "-c", script], env=env, cwd=cwd, capture_output=True,
                       text=True, timeout=60)
    if setup:
        try:
            os.rmdir(stash)
        except OSError:
            pass
    if r.returncode != 0 and ("unshare failed" in r.stderr or "setpriv:" in r.stderr):
        pytest.skip(f"cannot switch users here: {r.stderr.strip()[:200]}")
    return r


# What `nobody` imports: ring's packages and its runtime dependencies (rich is
# only for rendering and large, so it is left to the interpreter's own site dir).
_NOBODY_MODULES = ("ringd", "ringwatch", "psutil", "yaml", "_yaml", "click", "sdnotify")


@pytest.fixture
def nobody_install():
    """A copy of the code `nobody` runs, in a world-readable temp dir (issue 14):
    the checkout may live in a private dir (a 0700 home, `mktemp -d`) and its
    files may be 0600 (umask 077), and a site dir's editable-install hook may be
    unreadable too. So the interpreter runs without site processing (-S), with
    PYTHONPATH naming this copy first, then the site dirs (skipped if unreadable).
    What is tested - ring refusing a user who cannot write the state dir - is
    unchanged; where the checkout lives no longer matters."""
    import importlib.util
    import site
    base = Path(tempfile.mkdtemp(prefix="ring-nobody-"))
    try:
        for name in _NOBODY_MODULES:
            spec = importlib.util.find_spec(name)
            if spec is None or not spec.origin:
                continue
            if spec.submodule_search_locations:
                shutil.copytree(list(spec.submodule_search_locations)[0], base / name,
                                ignore=shutil.ignore_patterns("__pycache__"))
            else:
                shutil.copy2(spec.origin, base / Path(spec.origin).name)
        for root, dirs, files in os.walk(base):
            os.chmod(root, 0o755)
            for f in files:
                os.chmod(os.path.join(root, f), 0o644)
        exe = os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)
        path = [str(base), *site.getsitepackages(), *site.getsitepackages([sys.base_prefix])]
        yield [exe, "-S"], os.pathsep.join(path), base
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _q(s: str) -> str:
    import shlex
    return shlex.quote(s)


@pytest.fixture
def shared_ring(ring):
    """The ring moved to a world-traversable place, state dir 0755 and journal files
    0644: other users may *read* it, only root may write it."""
    base = Path(tempfile.mkdtemp(prefix="ring-sec-"))
    os.chmod(base, 0o755)
    ring.state = base / "state"
    ring.state.mkdir(mode=0o755)
    os.chmod(ring.state, 0o755)
    ring.config_path = base / "ring.yaml"
    ring.write_config()
    os.chmod(ring.config_path, 0o644)
    agents = base / "agents"
    agents.mkdir(mode=0o755)
    ring.agents_dir = agents
    try:
        yield ring
    finally:
        ring.cleanup()
        shutil.rmtree(base, ignore_errors=True)


def _open_up(ring):
    for p in [ring.journal_path, Path(f"{ring.journal_path}-wal"), Path(f"{ring.journal_path}-shm"),
              ring.roster_path, ring.state / "ringd.heartbeat"]:
        if p.exists():
            os.chmod(p, 0o644)


@pytest.mark.parametrize("layout", ["private", "readable"])
def test_skip_and_force_fail_refused_for_users_who_cannot_write_the_state_dir(shared_ring, nobody_install,
                                                                            layout):
    ring = shared_ring
    python, pythonpath, install = nobody_install
    if layout == "private":
        os.chmod(ring.state, 0o700)
    ring.agent("long", "exec sleep 60")
    ring.agent("short", "true")
    ring.write_config(ring={"run_budget": 30, "stall_threshold": 40})
    os.chmod(ring.config_path, 0o644)
    ring.roster(f"long {ring.agents_dir}/long.sh", f"short {ring.agents_dir}/short.sh")
    os.chmod(ring.roster_path, 0o644)
    ring.start_driver(stderr=subprocess.DEVNULL)
    wait_until(lambda: [r for r in ring.runs() if r["status"] == "running" and r["agent"] == "long"
                        and r["pid"] is not None and r["log_path"] is not None],
               20, message="long agent running, its pid recorded")
    if layout == "readable":
        wait_until(lambda: Path(f"{ring.journal_path}-shm").exists(), 5, message="WAL files")
        _open_up(ring)
    env = dict(ring.env)
    env["PYTHONPATH"] = pythonpath
    env.pop("RINGD_DEBUG", None)
    common = ["--state", str(ring.state), "--config", str(ring.config_path)]
    before = [tuple(r) for r in ring.runs()]
    before_agents = [tuple(r) for r in ring.rows("SELECT * FROM agents")]
    for args in (["skip"], ["skip", "short"], ["force-fail", "long", "--reason", "not yours"]):
        r = _as_nobody([*python, "-m", "ringd", args[0], *common, *args[1:]], env, cwd=install)
        assert r.returncode not in (0, None), f"{args} as nobody succeeded: {r.stdout} {r.stderr}"
        line = one_line(r.stderr)
        assert line.startswith("ringd:"), line
    time.sleep(0.5)
    assert [tuple(r) for r in ring.runs()] == before, "a refused control command changed the journal"
    assert [tuple(r) for r in ring.rows("SELECT * FROM agents")] == before_agents
    assert ring.runs()[-1]["status"] == "running"
    # the same commands as the ring's own user work (the refusal above was not an accident)
    r = ring.cli("skip")
    assert r.returncode == 0, r.stderr
    wait_until(lambda: ring.rows("SELECT status FROM runs WHERE agent = 'long' ORDER BY id LIMIT 1")[0]["status"]
               == "skipped", 10, message="skip works for the owner")


# --- root reaping another user's ring ----------------------------------------------------------

@pytest.mark.parametrize("whose,owned", [("root", "state dir"), ("root", "journal only"),
                                         ("the ring's user", "state dir")])
def test_root_reaping_another_users_ring_kills_only_what_that_user_could(ring, whose, owned):
    """The ring's user owns its state dir, so it can write any row the reaper
    trusts: a `running` row of a dead driver naming a process of root's (pid
    and start ticks are public); so can the owner of its journal in a state
    dir of root's. Root running `ringd status` on that ring
    reaps the row but kills with the ring user's privileges: root's process
    lives; the user's own orphan still dies."""
    if os.geteuid() != 0 or not shutil.which("setpriv"):
        pytest.skip("needs root and setpriv")
    import sqlite3
    from ringd.host import procid
    ring.agent("a", "exit 0")
    ring.roster(f"a {ring.agents_dir}/a.sh")
    assert ring.start_driver("--once").wait(timeout=30) == 0   # a journal, as the ring makes it
    drop = [] if whose == "root" else ["setpriv", "--reuid", str(NOBODY), "--regid", str(NOBODY),
                                       "--clear-groups"]
    target = subprocess.Popen([*drop, "sleep", "300"], start_new_session=True)
    try:
        ticks = wait_until(lambda: psutil.Process(target.pid).name() == "sleep"
                           and procid.start_ticks(target.pid), 10, message="the target exec'd sleep")
        con = sqlite3.connect(ring.journal_path)
        con.execute("INSERT INTO runs(agent, status, started_at, pid, pid_start, driver_pid, driver_start)"
                    " VALUES ('a', 'running', ?, ?, ?, ?, 1)", (time.time(), target.pid, ticks, 2 ** 23))
        con.commit()
        con.close()
        for root, dirs, files in os.walk(ring.state):   # the ring is the user's (nobody's)
            for name in [root, *(os.path.join(root, f) for f in files)]:
                if owned == "state dir" or os.path.basename(name).startswith("journal.db"):
                    os.chown(name, NOBODY, NOBODY)
        ring.cli("status", "--json")   # as root
        assert ring.rows("SELECT status FROM runs ORDER BY id DESC LIMIT 1")[0]["status"] == "interrupted"
        if whose == "root":
            # any kill was sent before status returned: a second is headroom for it to land
            with pytest.raises(subprocess.TimeoutExpired):
                target.wait(timeout=1)
        else:
            assert target.wait(timeout=10) == -signal.SIGKILL, "the ring user's own orphan survived"
    finally:
        if target.poll() is None:
            target.kill()
        target.wait(timeout=10)


@pytest.mark.parametrize("command", [("pause",), ("resume", "a"), ("next", "a"), ("skip", "a")])
@pytest.mark.parametrize("whose", ["root", "the ring's user"])
def test_root_waking_another_users_driver_signals_only_what_that_user_could(ring, command, whose):
    """Operator commands wake the driver the heartbeat names with SIGUSR1, whose
    default action ends a process. The ring's user writes that heartbeat (pid,
    start ticks and boot id are public): root running ``ringd pause`` on the
    ring SIGUSR1ed a process of root's it named. Woken with the ring user's
    privileges: root's process lives; the user's own process is still woken."""
    if os.geteuid() != 0 or not shutil.which("setpriv"):
        pytest.skip("needs root and setpriv")
    from ringd.host import procid
    from ringd.host.atomicfile import write_json_atomic
    ring.agent("a", "exit 0")
    ring.roster(f"a {ring.agents_dir}/a.sh")
    assert ring.start_driver("--once").wait(timeout=30) == 0   # a journal and a heartbeat, as the ring makes them
    drop = [] if whose == "root" else ["setpriv", "--reuid", str(NOBODY), "--regid", str(NOBODY),
                                       "--clear-groups"]
    target = subprocess.Popen([*drop, "sleep", "300"], start_new_session=True)
    try:
        ticks = wait_until(lambda: psutil.Process(target.pid).name() == "sleep"
                           and procid.start_ticks(target.pid), 10, message="the target exec'd sleep")
        if command[0] == "resume":
            assert ring.cli("pause", "a").returncode == 0   # something to lift (no driver to wake yet)
        beat = ring.heartbeat()
        beat.update(pid=target.pid, pid_start=ticks, stopped=False, at=time.time())
        write_json_atomic(ring.state / "ringd.heartbeat", beat)
        for root, dirs, files in os.walk(ring.state):   # the ring is the user's (nobody's)
            for name in [root, *(os.path.join(root, f) for f in files)]:
                os.chown(name, NOBODY, NOBODY)
        r = ring.cli(*command)   # as root
        assert r.returncode == 0, r.stderr
        if whose == "root":
            with pytest.raises(subprocess.TimeoutExpired):   # headroom for a signal sent to land
                target.wait(timeout=1)
        else:
            assert target.wait(timeout=10) == -signal.SIGUSR1, "the ring user's own driver was not woken"
    finally:
        if target.poll() is None:
            target.kill()
        target.wait(timeout=10)


@pytest.mark.parametrize("command", [("status",), ("pause",)])
@pytest.mark.parametrize("companion", ["-wal", "-shm"])
def test_root_opening_another_users_journal_never_takes_a_hard_linked_companion(ring, tmp_path, command,
                                                                                 companion):
    """SQLite run by root opens the journal's -wal and -shm by name, chowns them to
    the journal's owner and writes them. The ring's user can plant there a hard
    link to a file of root's (where fs.protected_hardlinks allows, or to a file it
    may write but not own): ``sudo ringd status`` gave that file to the user and
    overwrote it. A companion with another link is refused, and left in place."""
    if os.geteuid() != 0:
        pytest.skip("needs root")
    ring.agent("a", "exit 0")
    ring.roster(f"a {ring.agents_dir}/a.sh")
    assert ring.start_driver("--once").wait(timeout=30) == 0
    victim = tmp_path / "root-only"
    victim.write_text("root's secret\n" * 100)
    os.chmod(victim, 0o600)
    for suffix in ("-wal", "-shm"):
        Path(f"{ring.journal_path}{suffix}").unlink(missing_ok=True)
    os.link(victim, f"{ring.journal_path}{companion}")
    for root, dirs, files in os.walk(ring.state):   # the ring is the user's (nobody's)
        for name in [root, *(os.path.join(root, f) for f in files)]:
            if not os.path.samefile(name, victim):
                os.chown(name, NOBODY, NOBODY)
    r = ring.cli(*command)   # as root
    assert "Traceback" not in r.stderr, r.stderr
    st = os.stat(victim)
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (0, 0, 0o600), "root's file changed hands"
    assert victim.read_text() == "root's secret\n" * 100, "root's file was written"
    assert f"journal.db{companion}" in r.stderr and "link" in r.stderr, r.stderr


def test_a_journal_root_makes_in_another_users_ring_is_that_users(ring):
    """``sudo ringd pause`` on a user's ring that never ran made ``journal.db``
    root's, 0600: the ring's own driver could not open its journal any more.
    It is made the state dir owner's (and SQLite, as root, gives its -wal and
    -shm the journal's owner)."""
    if os.geteuid() != 0:
        pytest.skip("needs root")
    ring.agent("a", "exit 0")
    ring.roster(f"a {ring.agents_dir}/a.sh")
    for root, dirs, files in os.walk(ring.state):   # the ring is the user's (nobody's)
        for name in [root, *(os.path.join(root, f) for f in files)]:
            os.chown(name, NOBODY, NOBODY)
    assert not ring.journal_path.exists()
    r = ring.cli("pause")   # as root
    assert r.returncode == 0, r.stderr
    for name in (ring.journal_path, *(Path(f"{ring.journal_path}{s}") for s in ("-wal", "-shm"))):
        if name.exists():
            st = os.stat(name)
            assert (st.st_uid, st.st_gid, st.st_mode & 0o777) == (NOBODY, NOBODY, 0o600), name


# --- the journal's mode made 0600, never through a link swapped in meanwhile ---------------

def _journal_with_a_public_wal(tmp_path):
    """A journal whose -wal is 0644 (SQLite gives it the journal's mode), kept in
    existence by an open connection."""
    from ringd.journal.sqlite import Journal, journal_path
    path = journal_path(tmp_path)
    path.touch()
    os.chmod(path, 0o644)
    j = Journal.open(tmp_path)
    with j.transaction() as tx:
        tx.set_meta("x", "1")
    wal = Path(f"{path}-wal")
    os.chmod(wal, 0o644)
    return j, wal


def test_the_journals_files_made_private_never_follow_a_link_swapped_in_after_the_check(tmp_path, monkeypatch):
    """Journal.open makes journal.db, -wal and -shm 0600. It checked each was a
    regular file, then chmod'ed it by path, which follows a symlink: one swapped
    in between the two (the ring's user racing ``sudo ringd pause``) turned
    whatever file of root's it named 0600. Forced here: the swap happens right
    before the chmod."""
    from ringd.journal.sqlite import Journal
    victim = tmp_path / "victim"
    victim.write_text("root's\n")
    os.chmod(victim, 0o644)
    first, wal = _journal_with_a_public_wal(tmp_path)
    real_chmod = os.chmod

    def swap_then_chmod(path, *a, **kw):   # the swap lands after every check, just before the chmod
        if not stat.S_ISLNK(os.lstat(wal).st_mode):
            os.rename(wal, f"{wal}.moved")
            os.symlink(victim, wal)
        return real_chmod(path, *a, **kw)
    monkeypatch.setattr(os, "chmod", swap_then_chmod)
    try:
        Journal.open(tmp_path).close()
    finally:
        monkeypatch.undo()
        first.close()
    assert stat.S_IMODE(victim.stat().st_mode) == 0o644, "chmod went through the link"


def test_chmod_regular_changes_the_file_it_looked_at_never_a_link_swapped_in(tmp_path, monkeypatch):
    """safefile.chmod_regular holds the file it checks (an O_PATH descriptor):
    a link swapped in at its path after the open is never followed; a link or
    a FIFO there from the start is left alone, without blocking."""
    victim = tmp_path / "victim"
    victim.write_text("root's\n")
    os.chmod(victim, 0o644)
    target = tmp_path / "target"
    target.write_text("ours\n")
    os.chmod(target, 0o644)
    real_fstat = os.fstat

    def fstat_then_swap(fd):
        st = real_fstat(fd)
        if not target.is_symlink():
            os.rename(target, tmp_path / "moved")
            os.symlink(victim, target)
        return st
    monkeypatch.setattr(safefile.os, "fstat", fstat_then_swap)
    try:
        assert safefile.chmod_regular(target, 0o600)
    finally:
        monkeypatch.undo()
    assert stat.S_IMODE(victim.stat().st_mode) == 0o644
    assert stat.S_IMODE((tmp_path / "moved").stat().st_mode) == 0o600, "the file it looked at"
    link = tmp_path / "link"
    os.symlink(victim, link)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    os.chmod(fifo, 0o644)   # (whatever the umask: CI runs under 077)
    assert not safefile.chmod_regular(link, 0o600) and not safefile.chmod_regular(fifo, 0o600)
    assert stat.S_IMODE(victim.stat().st_mode) == 0o644 and stat.S_IMODE(fifo.stat(follow_symlinks=False).st_mode) == 0o644
