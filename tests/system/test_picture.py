"""The picture of a ring, used as a person uses it: ``ringd report`` opened in a real headless
Chromium (its screenshot and its DOM), ``ringd top`` in a real tmux (its screen, q, Ctrl-C,
a resize, NO_COLOR, a stopped driver, its CPU share), and text from agents that holds HTML
and terminal escapes shown as text in both.
"""
from __future__ import annotations

import json
import re
import shlex
import shutil
import sqlite3
import sys
import time
from html.parser import HTMLParser
from pathlib import Path

import pytest

from conftest import REPO, ring_cmd, wait_until
from lookers import Tmux, chromium, chromium_binary, colour_counts, hex_rgb, read_png
from ringd.cli.reporthtml import COLOURS, LABEL_W

# what an agent may say (STATUS=) and an operator may write (--reason)
EVIL = "<script>alert('x')</script> \"q\" & \x1b[2J\x1b[H\x1b]0;owned\x07PWNED"

needs_chromium = pytest.mark.skipif(chromium_binary() is None, reason="needs Debian's chromium (.ci/run installs it)")
needs_tmux = pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux (.ci/run installs it)")


def notify(text: str) -> str:
    """A line of shell that tells the ring the run's phase."""
    return f"{shlex.quote(sys.executable)} -m ringd notify --status {shlex.quote(text)}"


def varied_ring(ring) -> None:
    """Runs that end every way an agent can end them (and an interrupted one by the operator)."""
    ring.write_config(ring={"run_budget": 2.0, "stall_threshold": 3.0, "backoff_initial": 0.2})
    ring.agent("good", "echo fine")
    ring.agent("bad", f"{notify('step 2 of 3')}\nexit 1")
    ring.agent("later", "exit 75")
    ring.agent("slow", "trap 'exit 143' TERM\nsleep 30 & wait")
    ring.agent("hang", f"{notify(EVIL)}\nsleep 60 & wait")
    ring.roster(*(f"{n} {ring.agents_dir}/{n}.sh" for n in ("good", "bad", "later", "slow", "hang")),
                "gone ./no-such-program")


def plant(ring, sql: str, *params) -> None:
    """Write the journal as another process of the ring's user could."""
    con = sqlite3.connect(ring.journal_path, timeout=10)
    try:
        with con:
            con.execute(sql, params)
    finally:
        con.close()


def phase_now(ring) -> str:
    """The current run's phase as ``status --json`` tells it ('' between runs or before one is said)."""
    current = json.loads(ring.cli("status", "--json").stdout)["current"] or {}
    return current.get("phase") or ""


class Dom(HTMLParser):
    def __init__(self):
        super().__init__()
        self.bars, self.tags, self.legend = {}, set(), False

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        self.tags.add(tag)
        if "data-run-id" in a:
            self.bars[int(a["data-run-id"])] = a["data-status"]
        if a.get("id") == "legend":
            self.legend = True


@needs_chromium
def test_report_in_a_real_browser(ring):
    varied_ring(ring)
    driver = ring.start_driver()
    hang = wait_until(lambda: next((r for r in ring.runs() if r["agent"] == "hang" and r["status"] == "running"
                                    and r["phase"] is None), None) or None, timeout=40, message="hang running")
    wait_until(lambda: "PWNED" in phase_now(ring), message="hang's phase")
    res = ring.cli("force-fail", "hang", "--reason", EVIL)
    assert res.returncode == 0, res.stderr
    wait_until(lambda: sum(1 for r in ring.runs() if r["agent"] == "good") >= 2, timeout=40, message="lap 2")
    driver.terminate()
    assert driver.wait(timeout=20) == 0
    # the ring keeps what agents and operators say as one line of text; the journal is any
    # process's of the ring's user to write, so a reader takes what it holds as input
    plant(ring, "UPDATE runs SET reason = ?, phase = ? WHERE agent = 'bad'", EVIL, EVIL)
    history = json.loads(ring.cli("history", "--json", "--limit", "1000").stdout)
    assert {"ok", "failed", "deferred", "timeout", "interrupted", "error"} <= {r["status"] for r in history}
    assert any(r["id"] == hang["id"] and "<script>" in (r["reason"] or "") for r in history)
    assert any(r["agent"] == "bad" and r["reason"] == EVIL for r in history)

    out = ring.base / "report.html"
    res = ring.cli("report", "-o", str(out))
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith(f"wrote {out}: {len(history)} run(s), ")

    dom_text, _ = chromium(ring.base, "--dump-dom", out.as_uri())
    dom = Dom()
    dom.feed(dom_text.decode())
    assert dom.bars == {r["id"]: r["status"] for r in history}
    assert dom.legend and "script" not in dom.tags
    # what the agent and the operator wrote is on the page as text, escapes as spaces
    assert "&lt;script&gt;alert('x')&lt;/script&gt; \"q\" &amp;" in dom_text.decode()
    assert "\x1b" not in dom_text.decode() and "\x07" not in dom_text.decode()
    assert "&amp; [2J [H ]0;owned PWNED" in dom_text.decode()

    shot = ring.base / "report.png"
    chromium(ring.base, "--window-size=1280,900", "--hide-scrollbars", f"--screenshot={shot}", out.as_uri())
    width, height, rows = read_png(shot)
    assert (width, height) == (1280, 900)
    everything = colour_counts(rows)
    white = everything.get((255, 255, 255), 0)
    assert len(everything) > 20 and white < 0.97 * width * height, "blank screenshot"
    # the lanes are where the alternate lanes' shade is; each status seen is drawn there in its colour
    shade = (0xF4, 0xF6, 0xF8)
    lane_rows = [y for y, line in enumerate(rows) if bytes(shade) * 50 in line]
    assert lane_rows, "no lanes on the screenshot"
    lanes = colour_counts(rows, max(0, lane_rows[0] - 20), lane_rows[-1] + 20, left=LABEL_W + 20)
    for status in {r["status"] for r in history}:
        # (the narrowest bar is 2 x 12 px)
        assert lanes.get(hex_rgb(COLOURS[status]), 0) >= 12, f"no {status} bar in colour {COLOURS[status]}"


def test_report_window_output_and_bad_input(ring):
    ring.agent("a", "exit 0")
    ring.write_config(agents={"job": {"every": 1}})
    ring.roster(f"a {ring.agents_dir}/a.sh", f"job {ring.agents_dir}/a.sh")
    assert ring.start_driver("--once").wait(timeout=20) == 0
    runs = ring.runs()
    assert {r["agent"] for r in runs} == {"a", "job"}
    job_start = next(r["started_at"] for r in runs if r["agent"] == "job")
    wait_until(lambda: time.time() > job_start + 1.5, message="the job due again, in the past")
    # -o -: the page on standard output and nothing else
    res = ring.cli("report", "-o", "-")
    assert res.returncode == 0 and res.stdout.startswith("<!DOCTYPE html>") and res.stdout.endswith("</html>\n")
    assert all(f"data-run-id=\"{r['id']}\"" in res.stdout for r in runs)
    # the scheduled job was due again a second after it started: a due mark, named in the legend
    assert "<path class=\"due\"" in res.stdout and ">job due " in res.stdout
    assert "scheduled agent due" in res.stdout
    # the default file, in the working directory
    res = subprocess_in(ring, ring.base, "report")
    assert res.returncode == 0 and (ring.base / "ring-report.html").exists(), res.stderr
    # a window that ended before the run started holds no run
    res = ring.cli("report", "--since", "2000-01-01", "--until", "2000-01-02 12:00", "-o", "-")
    assert res.returncode == 0 and "data-run-id" not in res.stdout and "no run started in this window" in res.stdout
    for args, says in ((("--since", "soon"), "not a time: 'soon'"),
                       (("--until", "2026-13-01"), "month must be in 1..12"),
                       (("--since", "1h", "--until", "2h"), "is not before --until")):
        res = ring.cli("report", *args, "-o", "-")
        lines = [x for x in res.stderr.splitlines() if x.strip()]
        assert res.returncode == 2 and len(lines) == 1 and says in lines[0], res.stderr
        assert res.stdout == "" and "Traceback" not in res.stderr
    res = ring.cli("report", "-o", str(ring.base / "no-such-dir" / "r.html"))
    assert res.returncode == 1 and len(res.stderr.strip().splitlines()) == 1, res.stderr


def subprocess_in(ring, cwd: Path, *args: str):
    import subprocess
    return subprocess.run(ring_cmd(*args, *ring.common()), cwd=cwd, env=ring.env, capture_output=True,
                          text=True, timeout=60)


# --- top ------------------------------------------------------------------------------------------

@pytest.fixture
def tmux(tmp_path, ring):
    t = Tmux(tmp_path, ring.env)
    yield t
    t.close()


def top_script(ring, *env: str) -> str:
    """A shell line that runs top and then shows what it left: its exit code and the terminal's modes."""
    script = ring.base / "top.sh"
    top = " ".join(shlex.quote(x) for x in ring_cmd("top", *ring.common()))
    # (the shell traps SIGINT, so a Ctrl-C meant for top does not end it too; top gets it as usual)
    script.write_text(f"trap : INT\ncd {shlex.quote(str(REPO))}\nstty -g > {ring.base}/stty.before\n"
                      f"{' '.join(env)} {top}\necho TOP-EXIT=$?\nstty -g > {ring.base}/stty.after\nsleep 600\n")
    return f"sh {shlex.quote(str(script))}"


def on_screen(tmux, *words: str, timeout: float = 60) -> list:
    last = []

    def shown():
        last[:] = tmux.screen()
        return last if all(w in "\n".join(last) for w in words) else None
    try:
        return wait_until(shown, timeout=timeout, message=f"{words} on the screen")
    except AssertionError as e:
        raise AssertionError(f"{e}; the screen was:\n" + "\n".join(last)) from None


def stty_after(ring) -> str:
    """The terminal's modes once top ended: the shell echoes TOP-EXIT before it
    writes them, and its redirection makes the file empty first."""
    after = ring.base / "stty.after"
    return wait_until(lambda: after.exists() and after.read_text().endswith("\n") and after.read_text(),
                      message="the terminal's modes after top")


def top_process(tmux):
    return wait_until(lambda: next((p for p in tmux.pane_processes() if "top" in p.cmdline()), None),
                      message="ringd top running")


@needs_tmux
def test_top_in_a_real_terminal(ring, tmux):
    ring.write_config(ring={"run_budget": 600, "stall_threshold": 700, "heartbeat_interval": 0.5})
    ring.agent("work", f"{notify(EVIL)}\nsleep 600 & wait")
    ring.agent("other", "exit 0")
    ring.roster(f"work {ring.agents_dir}/work.sh", f"other {ring.agents_dir}/other.sh")
    ring.start_driver()
    wait_until(lambda: "PWNED" in phase_now(ring), timeout=20, message="work's phase")
    # ended by hand, work's next run has the operator's reason as its last one; the journal is any
    # process's of the ring's user to write, so a reader takes what it holds as input
    assert ring.cli("force-fail", "work", "--reason", "see below").returncode == 0
    wait_until(lambda: len(ring.runs()) >= 3 and ring.runs()[-1]["status"] == "running", message="work again")
    wait_until(lambda: "PWNED" in phase_now(ring), timeout=20, message="work's phase")
    plant(ring, "UPDATE runs SET reason = ? WHERE id = 1", EVIL)
    # (a shell's COLUMNS and LINES are what the terminal was when it started: the view asks the terminal)
    tmux.start(top_script(ring, "COLUMNS=80", "LINES=24"), 120, 40)
    # the phase and the reason are text: the page was not cleared, the title not set, the cursor not moved
    shown = "<script>alert('x')</script> \"q\" &  [2J [H ]0;owned PWNED"
    # (a frame drawn on a loaded box before the planted reason was read shows the one before it)
    screen = on_screen(tmux, "ring top", "work", "other", f"phase    {shown}", f"last interrupted: {shown}")
    assert screen[0].startswith("ring top") and screen[0].rstrip().endswith("q quits")
    text = "\n".join(screen)
    assert "current  work  run 3" in text and "budget   [" in text and "of 10m00s" in text
    assert "next     other after this run" in text
    assert f"phase    {shown}" in text
    assert f"work: 1 failure(s) in a row, last interrupted: {shown}" in text
    assert tmux.show("#{pane_title}") != "owned"
    assert all(len(line) <= 120 for line in screen) and tmux.show("#{alternate_on}") == "1"

    top = top_process(tmux)
    cpu0, t0 = sum(top.cpu_times()[:2]), time.monotonic()
    time.sleep(10)   # (measuring: ten refreshes of a live ring)
    share = (sum(top.cpu_times()[:2]) - cpu0) / (time.monotonic() - t0)
    assert share < 0.02, f"ringd top used {share:.1%} of a core"

    tmux("resize-window", "-x", "80", "-y", "24")
    small = wait_until(lambda: (lambda s: s if s[0].rstrip().endswith("q quits") and len(s[0].rstrip()) <= 80
                                else None)(tmux.screen()), message="the view fitted to 80 columns")
    assert all(len(line) <= 80 for line in small) and "work" in "\n".join(small)

    tmux("send-keys", "q")
    on_screen(tmux, "TOP-EXIT=0")
    assert not top.is_running() or top.status() == "zombie"
    assert stty_after(ring) == (ring.base / "stty.before").read_text()
    assert tmux.show("#{alternate_on}") == "0" and tmux.show("#{cursor_flag}") == "1"


@needs_tmux
def test_top_without_colour_and_with_the_driver_stopped_ends_on_ctrl_c(ring, tmux):
    ring.agent("a", "exit 0")
    ring.agent("b", "exit 1")
    ring.roster(f"a {ring.agents_dir}/a.sh", f"b {ring.agents_dir}/b.sh")
    assert ring.start_driver("--once").wait(timeout=20) == 0
    tmux.start(top_script(ring, "NO_COLOR=1"), 100, 30)
    screen = on_screen(tmux, "ring top", "STOPPED", "driver stopped: nothing runs",
                       "b: 1 failure(s) in a row, last failed")
    rows = {line.split()[1]: line for line in screen if line[:4].strip().isdigit()}
    assert rows["a"].rstrip().endswith(".") and rows["b"].rstrip().endswith("F")
    for sgr in re.findall(r"\x1b\[([0-9;:]*)m", "\n".join(tmux.screen(escapes=True))):
        colours = [p for p in re.split("[;:]", sgr) if p.isdigit() and (30 <= int(p) <= 38 or 40 <= int(p) <= 48
                                                                       or 90 <= int(p) <= 107)]
        assert not colours, f"a colour (SGR {sgr}) with NO_COLOR set"
    tmux("send-keys", "C-c")
    on_screen(tmux, "TOP-EXIT=0")
    assert stty_after(ring) == (ring.base / "stty.before").read_text()
    assert tmux.show("#{alternate_on}") == "0" and tmux.show("#{cursor_flag}") == "1"


def test_top_on_a_pipe_prints_one_plain_frame(ring):
    ring.agent("a", "exit 0")
    ring.roster(f"a {ring.agents_dir}/a.sh")
    assert ring.start_driver("--once").wait(timeout=20) == 0
    res = ring.cli("top")
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("ring top") and "\x1b" not in res.stdout and "STOPPED" in res.stdout
    missing = ring_cmd("top", "--state", str(ring.base / "nowhere"))
    import subprocess
    res = subprocess.run(missing, env=ring.env, capture_output=True, text=True, timeout=30)
    assert res.returncode != 0 and len(res.stderr.strip().splitlines()) == 1 and "Traceback" not in res.stderr


def test_top_reads_only_new_runs_and_sees_the_one_in_flight_end(tmp_path):
    """top's strips, read again from the run in flight on, are what a full read of a real journal gives."""
    from ringd.cli.top import STRIP_RUNS, Source
    from ringd.inputs.config import load_config
    from ringd.journal.sqlite import Journal
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    config = load_config(None)
    journal = Journal.open(state)
    t = [1_800_000_000.0]

    def run(agent, status, reason=None):
        with journal.transaction() as tx:
            t[0] += 1
            rid = tx.start_run(agent, "ab".index(agent), now=t[0], run_budget=60, stall_threshold=90,
                               driver_pid=1, driver_start=None)
            if status != "running":
                tx.close_run(rid, status, source="driver", now=t[0] + 0.5, reason=reason)
        return rid

    try:
        total = 2 * (STRIP_RUNS + 30)
        for k in range(total):
            run("ab"[k % 2], "ok" if k % 7 else "failed")
        live = Source(state, config)
        live.read_runs(("a", "b"))
        assert len(live.strips["a"]) == STRIP_RUNS and live.low == total + 1
        rid = run("a", "running")
        live.read_runs(("a", "b"))
        assert live.strips["a"][-1] == "running" and live.low == rid
        with journal.transaction() as tx:
            tx.close_run(rid, "timeout", source="driver", now=t[0] + 5, reason="run budget of 60s reached")
        run("b", "skipped", reason="operator skipped it")
        live.read_runs(("a", "b"))
        fresh = Source(state, config)
        fresh.read_runs(("a", "b"))
        assert live.strips == fresh.strips and live.reasons == fresh.reasons
        assert live.strips["a"][-1] == "timeout" and live.reasons == {
            "a": "timeout: run budget of 60s reached", "b": "skipped: operator skipped it"}
        assert live.low == rid + 2 and len(live.strips["a"]) == STRIP_RUNS
    finally:
        journal.close()
