"""Bad input, each with a real test: hostile rosters and configs, a corrupt
journal, a full or read-only state dir, corrupt or time-travelling heartbeats.

Every start-up error must be one short line on stderr (an excerpt of the
offending input at most, never a traceback) and exit 78. While running, a bad
roster never stops the ring: the driver keeps the last good roster, records the
error, and picks the file up again once it is fixed.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
import unicodedata
from pathlib import Path

import psutil
import pytest

from conftest import fill_up, mounted_tmpfs, processes_of, use_up_inodes, wait_until

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux process semantics")

MAX_ERROR_CHARS = 400   # "one clear line": an excerpt, never the 100 kB input


# --- helpers -----------------------------------------------------------------------

def finish(proc: subprocess.Popen, timeout: float = 30.0):
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"pid {proc.pid} did not exit within {timeout}s")
    return proc.returncode, (err or b"").decode(errors="replace")


def assert_one_clear_line(err: str, *must_contain: str) -> str:
    assert "Traceback" not in err, err[-2000:]
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, f"expected one line, got {len(lines)}: {err[:1000]!r}"
    assert len(lines[0]) <= MAX_ERROR_CHARS, f"error line too long ({len(lines[0])} chars): {lines[0][:300]!r}"
    for text in must_contain:
        assert text in lines[0], f"{text!r} not in {lines[0]!r}"
    return lines[0]


def start_refused(ring, *extra, timeout=30.0):
    """``ringd run --once``: must exit 78 with one clear line and run nothing."""
    code, err = finish(ring.start_driver("--once", *extra), timeout=timeout)
    assert code == 78, f"exit {code}: {err[-1500:]}"
    return err


def driver_stderr(ring, name="driver.err"):
    path = ring.base / name
    return path, open(path, "wb")


def read_text(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def roster_error(ring):
    """The roster error as the driver records it: heartbeat and journal meta."""
    hb = ring.heartbeat() or {}
    meta = ring.rows("SELECT value FROM meta WHERE key = 'roster_error'")
    return hb.get("roster_error"), (meta[0]["value"] if meta else None)


def runs_after(ring, n_before: int, more: int, timeout: float = 20.0, message: str = "more runs"):
    return wait_until(lambda: len(ring.runs()) >= n_before + more, timeout, message=message)


def marks_of(path: Path):
    return set(read_text(path).split())


# --- roster: at start-up -------------------------------------------------------------------

def _garbage(ring):
    ring.roster_path.write_bytes(bytes(range(256)) * 16 + os.urandom(4096))


def _ten_megabytes(ring):
    with open(ring.roster_path, "wb") as f:
        line = b"a /bin/true " + b"x" * 100 + b"\n"
        for _ in range(10 * 1024 * 1024 // len(line) + 1):
            f.write(line)


def _long_line(ring):
    ring.roster_path.write_text("a /bin/true " + "y" * 100_000 + "\n")


def _nul_bytes(ring):
    ring.roster_path.write_bytes(b"a /bin/tr\x00ue\n")


def _nul_in_name(ring):
    ring.roster_path.write_bytes(b"ok /bin/true\nev\x00il /bin/true\n")


def _non_utf8_name(ring):
    ring.roster_path.write_bytes(b"ok /bin/true\ncaf\xe9 /bin/true\n")


def _directory(ring):
    ring.roster_path.mkdir()


def _dangling_symlink(ring):
    os.symlink(ring.base / "no-such-roster", ring.roster_path)


def _empty(ring):
    ring.roster_path.write_text("# nothing here\n\n")


def _empty_program(ring):
    ring.roster_path.write_text("ok /bin/true\nnil '' --flag\n")   # exec takes no empty program


def _cr_line_endings(ring):
    # old Mac line endings: split() and shlex read this as one agent, ok, with
    # the rest as its arguments, and b was silently lost
    ring.roster_path.write_bytes(b"ok /bin/true\rb /bin/false\r")


def _no_break_space(ring):
    ring.roster_path.write_bytes("ok\u00a0/bin/true\n".encode())


def _bidi_override(ring):
    # shows as "ok /bin/echo safe ..." with the rest reversed: not what runs
    ring.roster_path.write_text("ok /bin/true\nshow /bin/echo safe \u202e; txt.gnir\n")


def _zero_width_in_program(ring):
    ring.roster_path.write_text("ok /bin/true\nlook /bin/tr\u200bue\n")   # shows as /bin/true


def _names_differing_in_case(ring):
    # two agents, one log folder (logs/web = logs/WEB) on a case-insensitive file system
    ring.roster_path.write_text("web /bin/true\nWEB /bin/false\n")


STARTUP_ROSTERS = [
    ("binary-garbage", _garbage, "not UTF-8"),
    ("ten-megabytes", _ten_megabytes, "larger than"),
    ("100k-char-line", _long_line, "longer than"),
    ("nul-bytes", _nul_bytes, "NUL"),
    ("nul-in-name", _nul_in_name, "ring.txt:2"),
    ("non-utf8-name", _non_utf8_name, "ring.txt:2"),
    ("directory", _directory, "not a regular file"),
    ("dangling-symlink", _dangling_symlink, "not found"),
    ("no-agents", _empty, "no agents"),
    ("empty-program", _empty_program, "ring.txt:2: agent 'nil': the program name is empty"),
    ("cr-line-endings", _cr_line_endings, "ring.txt:1: line contains a control character (U+000D)"),
    ("no-break-space", _no_break_space, "ring.txt:1: bad agent name"),
    ("bidi-override", _bidi_override, "ring.txt:2: line contains an invisible format character (U+202E"),
    ("zero-width", _zero_width_in_program, "ring.txt:2: line contains an invisible format character (U+200B"),
    ("case-duplicate", _names_differing_in_case, "ring.txt:2: duplicate agent name 'WEB' (first on line 1 as 'web'"),
]


@pytest.mark.parametrize("case, make, reason", STARTUP_ROSTERS, ids=[c[0] for c in STARTUP_ROSTERS])
def test_bad_roster_at_startup_is_one_line_and_exit_78(ring, case, make, reason):
    make(ring)
    if ring.roster_path.is_file() and not ring.roster_path.is_symlink():
        os.chmod(ring.roster_path, 0o600)
    err = start_refused(ring)
    assert_one_clear_line(err, str(ring.roster_path), reason)
    assert not ring.runs(), "nothing may run on a roster that does not parse"
    # what run refuses, check refuses, with the same line
    r = ring.cli("check")
    assert r.returncode == 78, r.stdout + r.stderr
    checked = assert_one_clear_line(r.stderr, str(ring.roster_path), reason)
    assert checked.split(str(ring.roster_path), 1)[1] == err.strip().split(str(ring.roster_path), 1)[1]


@pytest.mark.parametrize("name", [
    "x';DROP", "x';DROP_TABLE_runs;--", "a;b", "a|b", "a&&b", "$(id)", "`id`", "a$b", "a>b",
    "a*", "../up", "-rf", ".hidden", "a\\b", "\u00e9t\u00e9", "a\u200bb", "'quoted'", "a\"b",
])
def test_agent_names_with_sql_or_shell_metacharacters_are_refused(ring, name):
    ring.roster("fine /bin/true", f"{name} /bin/true")
    err = start_refused(ring)
    invisible = any(unicodedata.category(c) == "Cf" for c in name)   # refused as such anywhere in a line
    line = assert_one_clear_line(err, "ring.txt:2", "invisible format character" if invisible else "bad agent name")
    assert len(line) < 300


def test_commands_with_metacharacters_never_go_through_a_shell(ring):
    """The command is split like a shell would, never run by one: ``$( )``, ``;``,
    ``|``, backticks and redirections reach the program as literal arguments."""
    canary = ring.base / "pwned"
    ring.roster(f"literal /bin/echo $(touch {canary}) ; touch {canary} | `touch {canary}` > {canary} "
                f"&& rm -rf {ring.base}/nothing")
    code, err = finish(ring.start_driver("--once"))
    assert code == 0, err
    (row,) = ring.runs()
    assert row["status"] == "ok"
    assert not canary.exists(), "a metacharacter was interpreted by a shell"
    log = (ring.state / "logs" / "literal" / f"{row['id']}.log").read_text()
    assert f"$(touch {canary})" in log and "`touch" in log and "|" in log


# --- roster: while running -------------------------------------------------------------------

def test_roster_trouble_while_running_keeps_the_last_good_roster(ring):
    """Every kind of bad roster, written while the driver runs: the ring keeps
    turning on the last good roster, the error is recorded (heartbeat and journal)
    as one short line, and the fixed file is picked up again."""
    marks = ring.base / "marks"
    for n in ("a", "b", "c"):
        ring.agent(n, f"echo $RING_RUN_ID >> {marks}")
    good = [f"a {ring.agents_dir}/a.sh", f"b {ring.agents_dir}/b.sh"]
    ring.roster(*good)
    path, err_file = driver_stderr(ring)
    drv = ring.start_driver(stderr=err_file)
    err_file.close()
    runs_after(ring, 0, 2, message="first runs")
    tmp = ring.state / ".bad.tmp"

    def install(writer):
        """Replace ring.txt atomically (rename) with whatever ``writer`` makes at tmp."""
        if tmp.is_dir() and not tmp.is_symlink():
            shutil.rmtree(tmp)
        elif tmp.exists() or tmp.is_symlink():
            tmp.unlink()
        writer(tmp)
        if tmp.is_file() and not tmp.is_symlink():
            os.chmod(tmp, 0o600)
        if ring.roster_path.is_dir() and not ring.roster_path.is_symlink():
            shutil.rmtree(ring.roster_path)
        elif tmp.is_dir() and not tmp.is_symlink():
            ring.roster_path.unlink(missing_ok=True)   # a directory cannot be renamed over a file
        os.replace(tmp, ring.roster_path)

    breakages = [
        ("binary garbage", lambda p: p.write_bytes(os.urandom(8192)), "not UTF-8"),
        ("10 MB", lambda p: p.write_bytes((b"a /bin/true\n" * 900_000)), "larger than"),
        ("100k-char line", lambda p: p.write_text("a /bin/true " + "z" * 100_000 + "\n"), "longer than"),
        ("NUL", lambda p: p.write_bytes(b"a /bin/true\nb \x00\n"), "NUL"),
        ("non-UTF-8 name", lambda p: p.write_bytes(b"a /bin/true\n\xff\xfe /bin/true\n"), "UTF-8"),
        ("SQL name", lambda p: p.write_text("a /bin/true\nx');DROP_TABLE_runs;-- /bin/true\n"), "bad agent name"),
        ("empty program", lambda p: p.write_text("a /bin/true\nb '' x\n"), "program name is empty"),
        ("CR line endings", lambda p: p.write_bytes(b"a /bin/true\rb /bin/true\r"), "U+000D"),
        ("directory", lambda p: p.mkdir(), "not a regular file"),
        ("dangling symlink", lambda p: os.symlink(ring.base / "nowhere", p), "not found"),
        ("group-writable", lambda p: (p.write_text("\n".join(good) + "\n"), os.chmod(p, 0o620)), "writable"),
    ]
    for what, writer, reason in breakages:
        install(writer)
        if what == "group-writable":
            os.chmod(ring.roster_path, 0o620)   # install() set 0600
        hb_err, meta_err = wait_until(lambda: all(roster_error(ring)) and roster_error(ring),
                                      20, message=f"roster error recorded for {what}")
        assert reason in hb_err and reason in meta_err, (what, hb_err, meta_err)
        assert len(hb_err) < MAX_ERROR_CHARS and "\n" not in hb_err, (what, hb_err[:300])
        n = len(ring.runs())
        runs_after(ring, n, 2, message=f"ring keeps turning on the last good roster ({what})")
        assert {r["agent"] for r in ring.runs()[n:]} <= {"a", "b"}, what
        install(lambda p: p.write_text("\n".join(good) + "\n"))
        wait_until(lambda: not any(roster_error(ring)), 20, message=f"error cleared after fixing {what}")

    # deleted while running, then brought back with a new agent
    ring.roster_path.unlink()
    hb_err, _ = wait_until(lambda: all(roster_error(ring)) and roster_error(ring), 20,
                           message="missing roster recorded")
    assert "not found" in hb_err
    n = len(ring.runs())
    runs_after(ring, n, 2, message="ring turns while the roster is missing")
    ring.roster(*good, f"c {ring.agents_dir}/c.sh")
    wait_until(lambda: not any(roster_error(ring)), 20, message="roster picked up again")
    wait_until(lambda: any(r["agent"] == "c" for r in ring.runs()), 20, message="the new agent runs")

    drv.send_signal(signal.SIGTERM)
    code, _ = finish(drv, 20)
    assert code == 0, read_text(path)[-2000:]
    log = read_text(path)
    assert "Traceback" not in log, log[-3000:]
    assert max(len(line) for line in log.splitlines()) < 1000, "a log line echoed the bad input"
    rows = ring.runs()
    assert not [r for r in rows if r["status"] == "running"]
    assert marks_of(marks) <= {str(r["id"]) for r in rows}
    assert {r["agent"] for r in rows} == {"a", "b", "c"}, "only roster agents ever ran"


def test_sighup_with_ring_roster_naming_another_file_runs_that_roster(ring):
    """SIGHUP re-reads config and roster: when ``ring.roster`` now names another
    file, the driver runs that file's agents (relative programs and cwd in its
    folder), as status and check already read it; a new path that does not
    parse keeps the last good roster, which still runs from its own folder."""
    ring.agent("a", "true")
    ring.roster(f"a {ring.agents_dir}/a.sh")
    other = ring.base / "other"
    other.mkdir()
    b = other / "b.sh"
    b.write_text(f"#!/bin/sh\npwd >> {ring.base}/b-cwd\nsleep 0.1\n")
    b.chmod(0o755)
    (other / "ring2.txt").write_text("b ./b.sh\n")
    os.chmod(other / "ring2.txt", 0o600)
    path, err_file = driver_stderr(ring)
    drv = ring.start_driver(stderr=err_file)
    err_file.close()
    runs_after(ring, 0, 1, message="a runs")
    ring.write_config(ring={"roster": str(other / "ring2.txt")})
    drv.send_signal(signal.SIGHUP)
    wait_until(lambda: any(r["agent"] == "b" for r in ring.runs()), 20, message="the new roster's agent runs")
    first_b = min(r["id"] for r in ring.runs() if r["agent"] == "b")
    runs_after(ring, len(ring.runs()), 2, message="more runs of the new roster")
    later = [r for r in ring.runs() if r["id"] > first_b and r["status"] != "running"]
    assert {(r["agent"], r["status"]) for r in later} == {("b", "ok")}, [tuple(r) for r in later]
    assert set(read_text(ring.base / "b-cwd").split()) == {str(other)}

    ring.write_config(ring={"roster": str(ring.base / "missing.txt")})
    drv.send_signal(signal.SIGHUP)
    hb_err, _ = wait_until(lambda: all(roster_error(ring)) and roster_error(ring), 20,
                           message="the missing roster recorded")
    assert "missing.txt" in hb_err and "not found" in hb_err
    n = len(ring.runs())
    runs_after(ring, n, 2, message="the last good roster keeps turning")
    assert {(r["agent"], r["status"]) for r in ring.runs()[n:] if r["status"] != "running"} == {("b", "ok")}

    drv.send_signal(signal.SIGTERM)
    code, _ = finish(drv, 20)
    log = read_text(path)
    assert code == 0 and "Traceback" not in log, log[-3000:]


# --- config ---------------------------------------------------------------------------------------

DURATION = ["soon", "", "1e3", [1], {"a": 1}, True, None, float("inf"), float("nan"), "x" * 100_000]
INTEGER = ["3", 2.5, [1], {"a": 1}, True, None, "x" * 100_000]
ARGV = ["systemctl restart ringd", [1], [], [""], {"a": 1}, True, 5, [["nested"]]]
SECTION = [5, "text", [1, 2], True]

WRONG = (
    [(("ring", k), v) for k in ("run_budget", "stall_threshold", "heartbeat_interval", "backoff_initial",
                                "backoff_max", "quarantine_cooloff", "lap_pause") for v in DURATION]
    + [(("ring", k), v) for k in ("tempfail_exit_code", "keep_logs", "quarantine_after") for v in INTEGER]
    + [(("ring", "roster"), v) for v in (5, [1], {"a": 1}, True, "")]
    + [(("watch", k), v) for k in ("poll_interval", "stale_after", "restart_sec", "start_limit_interval")
       for v in DURATION]
    + [(("watch", "start_limit_burst"), v) for v in INTEGER]
    + [(("watch", "restart_command"), v) for v in ARGV]
    + [(("alerts", "command"), v) for v in ARGV]
    + [(("alerts", "failures_in_a_row"), v) for v in INTEGER]
    + [(("agents", "web", k), v) for k in ("run_budget", "stall_threshold") for v in DURATION]
    + [(("agents", "web", "cwd"), v) for v in (5, [1], True, "", None)]
    + [(("agents", "web"), v) for v in SECTION]
    + [((s,), v) for s in ("ring", "watch", "alerts", "agents") for v in SECTION]
)


def _doc_with(path, value):
    doc = {"ring": {"run_budget": 1, "stall_threshold": 2}}
    node = doc
    for k in path[:-1]:
        node = node.setdefault(k, {})
    node[path[-1]] = value
    return doc


def test_every_wrong_type_in_the_config_is_one_line_exit_78(ring):
    """Every key with every kind of wrong value, through ``ringd run``'s own entry
    point (click, run_driver): exit 78, one short line naming the key, no traceback.
    In-process (CliRunner) so the whole matrix takes well under a second."""
    import yaml
    from click.testing import CliRunner
    from ringd.cli.commands import main
    from ringd.inputs.config import ConfigError, load_config

    ring.roster("a /bin/true")
    runner = CliRunner()
    cfg = ring.base / "wrong.yaml"
    failures = []
    for path, value in WRONG:
        key = ".".join(path)
        cfg.write_text(yaml.safe_dump(_doc_with(path, value), width=10**9))
        os.chmod(cfg, 0o600)
        try:   # never start a real driver in-process: a value accepted here is a failure
            load_config(cfg)
            failures.append(f"{key}={value!r:.40}: accepted")
            continue
        except ConfigError:
            pass
        result = runner.invoke(main, ["run", "--once", "--state", str(ring.state), "--config", str(cfg)])
        err = result.stderr if hasattr(result, "stderr") else result.output
        if not isinstance(result.exception, SystemExit) or result.exit_code != 78:
            failures.append(f"{key}={value!r:.40}: exit {result.exit_code} {result.exception!r}")
            continue
        lines = [x for x in err.splitlines() if x.strip()]
        if len(lines) != 1 or len(lines[0]) > MAX_ERROR_CHARS or key not in lines[0] \
                or "Traceback" in err or str(cfg) not in lines[0]:
            failures.append(f"{key}={value!r:.40}: {err[:300]!r}")
    assert not failures, "\n".join(failures)
    assert not ring.runs()


@pytest.mark.parametrize("what", ["billion-laughs", "garbage", "nul", "huge", "top-level-list",
                                  "directory", "dangling-symlink", "world-writable", "unreadable-scalar",
                                  "key-with-newline"])
def test_hostile_config_files_are_one_line_exit_78(ring, what):
    ring.roster("a /bin/true")
    cfg = ring.base / "hostile.yaml"
    if what == "billion-laughs":
        bomb = 'a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]\n'
        for i in range(ord("b"), ord("k")):
            p = chr(i - 1)
            bomb += f"{chr(i)}: &{chr(i)} [*{p},*{p},*{p},*{p},*{p},*{p},*{p},*{p},*{p}]\n"
        cfg.write_text(bomb)
        reason = "alias"
    elif what == "garbage":
        cfg.write_bytes(os.urandom(4096))
        reason = ""
    elif what == "nul":
        cfg.write_bytes(b"ring:\n  run_budget: 1\x00\n")
        reason = "NUL"
    elif what == "huge":
        cfg.write_text("ring:\n  run_budget: 1\n# " + "x" * (2 * 1024 * 1024) + "\n")
        reason = "larger than"
    elif what == "top-level-list":
        cfg.write_text("- ring\n- watch\n")
        reason = "mapping"
    elif what == "directory":
        cfg.mkdir()
        reason = "directory"
    elif what == "dangling-symlink":
        os.symlink(ring.base / "nowhere.yaml", cfg)
        reason = "cannot read"
    elif what == "key-with-newline":   # echoed raw, the key split the error over two lines
        cfg.write_text('alerts: {"timeout\\nFAKE: all is well": 1}\n')
        reason = "alerts.'timeout\\nFAKE: all is well': unknown key"
    elif what == "unreadable-scalar":   # a date no calendar has: PyYAML raised a bare ValueError
        cfg.write_text("ring:\n  run_budget: 2\n  stall_threshold: 2001-02-30\n")
        reason = "line 3: invalid YAML: cannot read '2001-02-30' as timestamp"
    else:
        cfg.write_text("ring: {}\n")
        reason = "writable by group or others"
    if cfg.is_file() and not cfg.is_symlink():
        os.chmod(cfg, 0o666 if what == "world-writable" else 0o600)
    t0 = time.monotonic()
    code, err = finish(ring.start(["python3" if False else sys.executable, "-m", "ringd", "run", "--once",
                                   "--state", str(ring.state), "--config", str(cfg)]), timeout=30)
    assert code == 78, err[-1500:]
    assert_one_clear_line(err, str(cfg), reason)
    assert time.monotonic() - t0 < 20, "an alias bomb or a huge file must be refused, not expanded"
    assert not ring.runs()


def test_empty_config_file_means_builtin_defaults(ring):
    """An empty config file is an empty YAML document: the built-in defaults (which
    equal the shipped config/ring.yaml). ``ringd check`` says so cleanly."""
    ring.roster("a /bin/true")
    ring.config_path.write_text("")
    r = ring.cli("check")
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    ring.config_path.write_text("# only comments\n\n")
    r = ring.cli("check")
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr


# --- journal ------------------------------------------------------------------------------------

def _real_journal(ring, laps=6):
    ring.agent("a", "true")
    ring.agent("b", "exit 1")
    ring.roster(f"a {ring.agents_dir}/a.sh", f"b {ring.agents_dir}/b.sh")
    for _ in range(laps):
        code, err = finish(ring.start_driver("--once"))
        assert code == 0, err
    con = sqlite3.connect(ring.journal_path)
    con.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    pages = {r[0]: r[1] for r in con.execute("SELECT name, rootpage FROM sqlite_master WHERE rootpage > 0")}
    page_size = con.execute("PRAGMA page_size").fetchone()[0]
    con.close()
    for suffix in ("-wal", "-shm"):
        Path(f"{ring.journal_path}{suffix}").unlink(missing_ok=True)
    return pages, page_size


def _scribble(path: Path, page: int, page_size: int) -> None:
    with open(path, "r+b") as f:
        f.seek((page - 1) * page_size)
        f.write(bytes((i * 13 + 5) & 0xFF for i in range(page_size)))


@pytest.mark.parametrize("damage", ["truncated", "header-only", "overwritten",
                                    "runs-page", "running-index-page", "events-page"])
def test_corrupt_journal_is_refused_and_left_in_place(ring, damage):
    pages, page_size = _real_journal(ring)
    path = ring.journal_path
    if damage == "truncated":
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) // 3)
    elif damage == "header-only":
        with open(path, "r+b") as f:
            f.truncate(60)
    elif damage == "overwritten":
        path.write_bytes(b"#!/bin/sh\necho this is not a database\n" * 100)
    else:
        table = {"runs-page": "runs", "running-index-page": "runs_one_running", "events-page": "events"}[damage]
        _scribble(path, pages[table], page_size)
    before = path.read_bytes()
    n_logs = sum(len(f) for _, _, f in os.walk(ring.state / "logs"))
    code, err = finish(ring.start_driver("--once"))
    assert code == 78, f"exit {code}: {err[-2000:]}"
    line = assert_one_clear_line(err, str(path))
    assert "journal" in line
    assert path.read_bytes() == before, "the damaged journal must be left exactly as it was"
    assert sum(len(f) for _, _, f in os.walk(ring.state / "logs")) == n_logs, "nothing ran"


# --- state dir full or read-only --------------------------------------------------------------

@pytest.fixture
def small_state(ring):
    """ring.state on its own small tmpfs (unmounted afterwards, lazily if busy).
    16 MiB: SQLite's WAL grows to ~4 MiB before its automatic checkpoint, so a
    smaller file system would be filled by the ring itself."""
    with mounted_tmpfs(ring.state, "16m"):
        try:
            yield ring
        finally:
            ring.cleanup()
            subprocess.run(["mount", "-o", "remount,rw", str(ring.state)], capture_output=True)


def _lines_with(path: Path, *words) -> list:
    return [x for x in read_text(path).splitlines() if any(w in x for w in words)]


def _check_truthful(ring, marks: Path):
    rows = ring.runs()
    recorded = {str(r["id"]) for r in rows}
    assert marks_of(marks) <= recorded, f"agents ran without a row: {marks_of(marks) - recorded}"
    con = sqlite3.connect(f"file:{ring.journal_path}?mode=ro", uri=True)
    assert con.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    con.close()
    return rows


TROUBLE_WORDS = ("No space left", "disk is full", "Read-only", "readonly", "read-only",
                 "Operation not permitted", "disk I/O error")


def _fault_and_recover(ring, inject, repair):
    """Drive a ring, inject a state-dir fault, check the driver says why and
    neither dies nor lies, repair it, check the ring turns again and every
    agent that ran has its row."""
    marks = ring.base / "marks"
    ring.agent("a", f"echo $RING_RUN_ID >> {marks}; echo out")
    ring.agent("b", f"echo $RING_RUN_ID >> {marks}; sleep 0.1")
    ring.roster(f"a {ring.agents_dir}/a.sh", f"b {ring.agents_dir}/b.sh")
    err_path, err_file = driver_stderr(ring)
    drv = ring.start_driver(stderr=err_file)
    err_file.close()
    runs_after(ring, 0, 3, message="ring turning before the fault")
    inject()
    try:
        wait_until(lambda: _lines_with(err_path, *TROUBLE_WORDS), 20, message="the driver says why")
        time.sleep(1.5)   # a while in trouble: the driver must neither die nor lie
        assert drv.poll() is None, f"driver died: {read_text(err_path)[-2000:]}"
        assert all(len(x) < 600 for x in _lines_with(err_path, *TROUBLE_WORDS))
    finally:
        repair()
    n = len(ring.runs())
    runs_after(ring, n, 3, timeout=30, message="ring turns again once the state dir is usable")
    drv.send_signal(signal.SIGTERM)
    code, _ = finish(drv, 20)
    log = read_text(err_path)
    assert code == 0, log[-3000:]
    assert "Traceback" not in log, log[-3000:]
    rows = _check_truthful(ring, marks)
    assert not [r for r in rows if r["status"] == "running"]
    assert not processes_of(ring.state)
    return log


def test_state_dir_full_says_why_keeps_alive_and_recovers(small_state):
    ring = small_state
    filler = ring.state / "filler"
    log = _fault_and_recover(ring, lambda: fill_up(ring.state), lambda: filler.unlink())
    assert not list(ring.state.glob(".*.tmp")), "failed atomic writes left temp files"
    assert "No space left" in log or "disk is full" in log


def test_a_state_dir_out_of_inodes_is_an_outage_never_the_agents_fault(ring):
    """The state dir out of inodes for a few seconds: each run's log could not
    be made, so each agent was recorded ``error`` and backed off for 60 s. An
    outage is never the agent's fault: no ``error`` row, no back-off, no
    quarantine count; the driver waits (beating, hearing signals), says so
    once, and the agent runs ``ok`` once there is room."""
    marks = ring.base / "marks"
    ring.write_config(ring={"keep_logs": 1000, "backoff_initial": 60, "backoff_max": 600})
    ring.agent("a", f"echo $RING_RUN_ID >> {marks}; echo out")
    ring.agent("b", f"echo $RING_RUN_ID >> {marks}")
    with mounted_tmpfs(ring.state, "16m", inodes=400):
        try:
            ring.roster(f"a {ring.agents_dir}/a.sh", f"b {ring.agents_dir}/b.sh")
            err_path, err_file = driver_stderr(ring)
            drv = ring.start_driver(stderr=err_file)
            err_file.close()
            runs_after(ring, 0, 4, message="ring turning before the fault")
            fillers = use_up_inodes(ring.state)
            try:
                waiting = wait_until(lambda: _lines_with(err_path, "cannot make its run log yet"), 20,
                                     message="the driver says it waits for room")
                stuck = ring.rows("SELECT * FROM runs WHERE status = 'running'")
                end = time.monotonic() + 3.0   # a few seconds of outage, inodes freed meanwhile taken again
                while time.monotonic() < end:
                    fillers += use_up_inodes(ring.state)
                    time.sleep(0.05)
                assert drv.poll() is None, read_text(err_path)[-2000:]
                assert (ring.heartbeat() or {}).get("pid") == drv.pid
            finally:
                for f in fillers:
                    f.unlink(missing_ok=True)
            wait_until(lambda: ring.rows("SELECT * FROM runs WHERE id = ? AND status = 'ok'", stuck[0]["id"]),
                       20, message="the waiting run runs ok once there is room")
            runs_after(ring, len(ring.runs()), 2, message="the ring turns on")
            drv.send_signal(signal.SIGTERM)
            code, _ = finish(drv, 20)
        finally:
            ring.cleanup()
    log = read_text(err_path)
    assert code == 0 and "Traceback" not in log, log[-3000:]
    rows = ring.runs()
    assert not [dict(r) for r in rows if r["status"] in ("error", "failed")], [dict(r) for r in rows]
    assert len(waiting) == 1 and len(_lines_with(err_path, "cannot make its run log yet")) == 1, log[-3000:]
    assert len(stuck) == 1 and "run log made: starting it" in log
    agents = ring.rows("SELECT name, consecutive_failures, backoff_until, bad_streak FROM agents")
    assert all(a["consecutive_failures"] == 0 and a["backoff_until"] is None and not a["bad_streak"]
               for a in agents), [dict(a) for a in agents]


@pytest.fixture
def immutable(ring):
    """chattr +i on paths (ext4 refuses every write, even through descriptors
    already open: the closest thing to a state dir gone read-only under a running
    driver, which a remount cannot do while files are open for writing)."""
    if not shutil.which("chattr"):
        pytest.skip("chattr not available")
    probe = ring.base / "probe"
    probe.write_text("x")
    if subprocess.run(["chattr", "+i", str(probe)], capture_output=True).returncode != 0:
        pytest.skip("this file system does not support chattr +i")
    subprocess.run(["chattr", "-i", str(probe)], capture_output=True)
    done = []

    def freeze(*paths):
        for p in paths:
            if os.path.exists(p) and subprocess.run(["chattr", "+i", str(p)]).returncode == 0:
                done.append(p)

    def thaw():
        while done:
            subprocess.run(["chattr", "-i", str(done.pop())], capture_output=True)

    try:
        yield freeze, thaw
    finally:
        thaw()


def test_state_dir_unwritable_says_why_keeps_alive_and_recovers(ring, immutable):
    freeze, thaw = immutable
    j = str(ring.journal_path)
    # not the -shm file: SQLite maps it into memory, and a store into a mapped
    # page of an immutable file is a SIGBUS - an artefact of chattr, which no
    # full or read-only file system produces (SQLite pre-allocates -shm pages)
    _fault_and_recover(ring, lambda: freeze(ring.state, j, j + "-wal"), thaw)


def test_a_removed_journal_that_cannot_be_made_again_at_once_is_taken_up_once_it_can(ring, immutable):
    """journal.db removed while the driver runs, and the state dir unwritable
    just then: the driver cannot make the new journal; it says why, keeps
    beating, tries again, and takes up the journal once the state dir is
    writable again - never a traceback, never an exit."""
    freeze, thaw = immutable
    ring.agent("a", "sleep 0.05")
    ring.roster(f"a {ring.agents_dir}/a.sh")
    driver = ring.start_driver()
    wait_until(lambda: ring.journal_path.exists() and len(ring.runs()) >= 2, timeout=20, message="runs")
    os.kill(driver.pid, signal.SIGSTOP)   # so the removal and the freeze land together
    try:
        os.unlink(ring.journal_path)
        freeze(ring.state)
    finally:
        os.kill(driver.pid, signal.SIGCONT)
    wait_until(lambda: "journal failure, turn not taken" in driver.err_path.read_text(), timeout=20,
               message="the driver saying it cannot make the journal")
    assert driver.poll() is None
    thaw()
    wait_until(lambda: ring.journal_path.exists() and len(ring.runs()) >= 2, timeout=20,
               message="runs recorded in a journal at the path again")
    log = driver.err_path.read_text()
    assert driver.poll() is None and "Traceback" not in log, log[-2000:]
    assert "was removed or replaced under the driver" in log


@pytest.mark.parametrize("daemon", ["driver", "watcher"])
def test_read_only_state_dir_at_startup_is_one_line_and_no_configuration_error(ring, daemon):
    """The state dir on a read-only bind mount: refuse in one line, record
    nothing, exit 69 - an outage, never 78: the driver's lock (and the
    watcher's) said "cannot lock: Read-only file system" with 78, after which
    ringwatch and systemd (RestartPreventExitStatus=78) never start the ring
    again once the file system is writable."""
    if os.geteuid() != 0:
        pytest.skip("needs root for a bind mount")
    ring.agent("a", "true")
    ring.roster(f"a {ring.agents_dir}/a.sh")
    code, err = finish(ring.start_driver("--once"))
    assert code == 0, err
    (ring.state / "logs").mkdir(mode=0o700, exist_ok=True)
    n = len(ring.runs())
    st = str(ring.state)
    r = subprocess.run(["mount", "--bind", st, st], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot bind-mount here: {r.stderr.strip()}")
    try:
        r = subprocess.run(["mount", "-o", "remount,bind,ro", st], capture_output=True, text=True)
        if r.returncode != 0:
            pytest.skip(f"cannot make a read-only bind mount here: {r.stderr.strip()}")
        proc = ring.start_driver("--once") if daemon == "driver" else ring.start_watcher()
        code, err = finish(proc)
        assert code == 69, (code, err)
        line = assert_one_clear_line(err)
        assert any(w in line for w in TROUBLE_WORDS + ("cannot", "not usable")), line
    finally:
        if subprocess.run(["umount", st], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", st], capture_output=True)
    assert len(ring.runs()) == n, "a run was recorded on a read-only state dir?"


def test_full_state_dir_at_startup_is_one_line(small_state):
    ring = small_state
    ring.roster("a /bin/true")
    fill_up(ring.state)
    code, err = finish(ring.start_driver("--once"))
    assert code != 0 and "Traceback" not in err, err[-2000:]
    assert_one_clear_line(err)
    assert any(w in err for w in ("No space left", "disk is full")), err
    # 69, never 78, a configuration error, after which ringwatch and systemd (RestartPreventExitStatus=78)
    # would never start the ring again once space returns
    assert code == 69, err


# --- heartbeat corrupt or from another time ---------------------------------------------------

def _watched_driver(ring):
    ring.agent("a", "sleep 0.05")
    ring.roster(f"a {ring.agents_dir}/a.sh")
    err_path, err_file = driver_stderr(ring, "watch.err")
    w = ring.start_watcher(stderr=err_file)
    err_file.close()
    hb = wait_until(lambda: (lambda h: h if h and not h.get("stopped") and h.get("seq", 0) > 2 else None)(
        ring.heartbeat()), 20, message="a beating driver")
    return w, hb, err_path


def _replaced(ring, old_pid):
    def new():
        hb = ring.heartbeat()
        return hb if hb and hb.get("pid") not in (None, old_pid) and not hb.get("stopped") else None
    return new


@pytest.mark.parametrize("forgery", ["from-the-future", "corrupt", "from-the-past-but-beating"])
def test_watcher_judges_by_process_and_monotonic_view_not_the_timestamp(ring, forgery):
    """A hung (SIGSTOPped) driver whose heartbeat claims to be from tomorrow, or
    is garbage, is still replaced after stale_after; a healthy driver whose last
    beat carries a timestamp from 1970 is left alone."""
    w, hb, err_path = _watched_driver(ring)
    pid = hb["pid"]
    path = ring.state / "ringd.heartbeat"
    if forgery == "from-the-past-but-beating":
        old = dict(hb, at_epoch=1.0, at="1970-01-01T00:00:01+00:00")
        path.write_text(json.dumps(old))
        time.sleep(ring.config["watch"]["stale_after"] * 2.5)
        now = ring.heartbeat()
        assert now and now["pid"] == pid, f"a healthy driver was replaced: {read_text(err_path)[-1500:]}"
        assert psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    else:
        os.kill(pid, signal.SIGSTOP)
        try:
            if forgery == "from-the-future":
                future = time.time() + 86400
                fake = dict(hb, at_epoch=future, seq=hb.get("seq", 0) + 1000,
                            at=time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime(future)))
                path.write_text(json.dumps(fake))
            else:
                path.write_bytes(b"\x00\xff{not json" * 50)
            new = wait_until(_replaced(ring, pid), 30, message="hung driver replaced despite the forgery")
        finally:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        assert new["pid"] != pid
        wait_until(lambda: not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE,
                   15, message="old driver gone")
    w.send_signal(signal.SIGTERM)
    code, _ = finish(w, 30)
    log = read_text(err_path)
    assert code == 0, log[-2000:]
    assert "Traceback" not in log


def test_status_health_is_not_fooled_by_a_heartbeat_from_the_future():
    """``heartbeat_health`` (what ``ringd status`` shows): a beat stamped well in the
    future means the clock jumped since the driver last beat - stale, not ok."""
    from ringd.core.health import heartbeat_health
    now = 1_000_000.0
    fresh = {"pid": 1, "at_epoch": now - 0.1}
    future = {"pid": 1, "at_epoch": now + 3600}
    assert heartbeat_health(fresh, True, now, 10) == "ok"
    assert heartbeat_health({"pid": 1, "at_epoch": now + 1}, True, now, 10) == "ok"   # small skew
    assert heartbeat_health(future, True, now, 10) == "stale"
    assert heartbeat_health({"pid": 1, "at": "garbage"}, True, now, 10) == "stale"
    assert heartbeat_health(None, False, now, 10) == "stopped"
    assert heartbeat_health(None, False, now, 10, locked=True) == "stale"   # alive, unable to beat


def test_watcher_keeps_watching_on_a_full_state_dir(small_state):
    """ringwatch.json cannot be written: the watcher says so once and watches on
    (its state in memory), instead of exiting and leaving the driver unsupervised."""
    ring = small_state
    ring.write_config(watch={"stale_after": 30, "poll_interval": 0.2})
    ring.agent("a", "sleep 0.2")
    ring.roster(f"a {ring.agents_dir}/a.sh")
    err_path, err_file = driver_stderr(ring, "watch.err")
    w = ring.start_watcher(stderr=err_file)
    err_file.close()
    wait_until(lambda: (ring.state / "ringwatch.json").exists() and ring.heartbeat(), 20,
               message="watcher and driver up")
    filler = fill_up(ring.state)
    try:
        wait_until(lambda: _lines_with(err_path, "watching on with the state in memory"), 20,
                   message="watcher reports the unwritable state")
        deadline = time.monotonic() + 2
        while time.monotonic() < deadline:   # several polls on the full disk
            assert w.poll() is None, read_text(err_path)[-2000:]
            time.sleep(0.1)
    finally:
        filler.unlink()
    wait_until(lambda: _lines_with(err_path, "written again"), 20, message="state written again")
    assert w.poll() is None


@pytest.mark.parametrize("when", ["1e999", "-1e999", "NaN", "1e308", "-1e308", "1" + "0" * 400,
                                  '"0001-01-01T00:00:00+01:00"'])
def test_status_survives_a_heartbeat_and_watcher_file_with_an_impossible_time(ring, when):
    """A time no date can show (JSON's 1e999 is inf, NaN, 1e308, an ISO time
    before year 1 in UTC) in the heartbeat or ringwatch.json is no time at all:
    status still reports (a stopped ring: exit 3) in valid JSON, never an
    internal error whose exit 1 reads as "driver dead"."""
    ring.roster("a true")
    for name in ("ringd.heartbeat", "ringwatch.json"):
        (ring.state / name).write_text(
            f'{{"pid": 1, "pid_start": 1, "started_at": {when}, "at": {when}, "at_epoch": {when},'
            f' "last_poll_at": {when}, "restarts": [{when}], "lap": 1}}')
    for args in (("status",), ("status", "--json")):
        r = ring.cli(*args)
        assert "Traceback" not in r.stderr and "internal error" not in r.stderr, r.stderr
        assert r.returncode == 1, (r.returncode, r.stderr)   # pid 1 is not this driver: dead
    doc = json.loads(r.stdout, parse_constant=lambda c: pytest.fail(f"not JSON: {c}"))
    assert doc["driver"]["started_at"] is None and doc["watcher"]["last_poll_at"] is None


@pytest.mark.parametrize("kind", ["zero-bytes", "header-only"])
def test_a_journal_with_no_tables_yet_reads_as_a_ring_that_never_ran(ring, kind):
    """The first driver creates its journal as 0 bytes, then a header (WAL mode),
    then its schema: meanwhile (or with an empty file the driver would take as a
    new database) status exited 4 "journal is not usable: no such table: runs"
    and history 1. Read-only: the file is left as it was."""
    ring.roster("a true")
    ring.journal_path.write_bytes(b"")
    if kind == "header-only":
        con = sqlite3.connect(ring.journal_path, isolation_level=None)
        con.execute("PRAGMA journal_mode=WAL")
        con.close()
    before = ring.journal_path.read_bytes()
    r = ring.cli("status", "--json")
    assert r.returncode == 3 and json.loads(r.stdout)["driver"]["health"] == "stopped", r.stderr
    r = ring.cli("history", "--json")
    assert r.returncode == 0 and json.loads(r.stdout) == [], r.stderr
    assert ring.journal_path.read_bytes() == before


NO_SUCH_USER = "no-such-user-of-ring-tests"


@pytest.mark.parametrize("key, spec", [("ring.roster", {"ring": {"roster": f"~{NO_SUCH_USER}/ring.txt"}}),
                                       ("agents.a.cwd", {"agents": {"a": {"cwd": f"~{NO_SUCH_USER}"}}})])
def test_a_tilde_path_that_cannot_expand_is_a_configuration_error_naming_the_key(key, spec):
    """``~user`` for a user that does not exist: ``ring.roster`` made every command
    die in ``Path.expanduser`` (``ringd run`` with a traceback, ``check`` an
    "internal error", exit 1), and a cwd named a folder "~user" beside the roster.
    Refused where the config is read, so check, run and a SIGHUP reload agree."""
    import pwd
    from ringd.inputs.config import ConfigError, parse_config
    with pytest.raises(KeyError):
        pwd.getpwnam(NO_SUCH_USER)
    with pytest.raises(ConfigError) as e:
        parse_config(spec)
    assert str(e.value).startswith(f"{key}: cannot expand") and NO_SUCH_USER in str(e.value), str(e.value)
    assert parse_config({"ring": {"roster": "~/ring.txt"}}).roster_path(Path("/s")).is_absolute()


def test_check_and_run_refuse_a_roster_under_an_unknown_users_home_alike(ring):
    """The CLI wiring of the test above: the same exit 78 and one line from both."""
    ring.roster("a /bin/true")
    ring.write_config(ring={"roster": f"~{NO_SUCH_USER}/ring.txt"})
    r = ring.cli("check")
    assert r.returncode == 78, r.stderr
    assert_one_clear_line(r.stderr, "ring.roster: cannot expand")
    err = start_refused(ring)
    assert_one_clear_line(err, "ring.roster: cannot expand")
    assert not ring.runs()


def test_a_daemon_log_line_is_one_line_whatever_the_input_it_quotes():
    """The daemons' error lines quote paths from the config and the command line;
    a newline or an escape sequence there split a configuration error in two
    (the second half free for a forger) or reached the terminal."""
    from ringd.host.logline import ERR, format_line
    line = format_line("ringd", "configuration error: /x\nFAKE: all is well\x1b[2J: roster file not found",
                       at=0, pid=7, level=ERR)
    assert line.endswith("\n") and line.count("\n") == 1, line
    assert "\x1b" not in line and "FAKE: all is well" in line


def test_run_refuses_a_roster_path_with_a_newline_in_one_line_as_check_does(ring):
    """The CLI wiring: ``ringd run``'s start-up error is one line, as ``check``'s is."""
    ring.roster("a /bin/true")
    ring.write_config(ring={"roster": "x\nFAKE: all is well"})
    r = ring.cli("check")
    assert r.returncode == 78, r.stderr
    assert_one_clear_line(r.stderr, "roster file not found")
    err = start_refused(ring)
    assert_one_clear_line(err, "configuration error", "FAKE: all is well: roster file not found")
