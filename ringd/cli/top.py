"""``ringd top``: the live full-screen view (rich Live on the alternate screen), keys and terminal care.

The ring is read as ``ringd status`` reads it (:func:`ringd.cli.status.gather_status`,
and each agent's last runs from the read-only journal, read again only when a
run has started or ended), at most once per ``interval`` (1 s). Between reads
the process sleeps in one ``select`` on the terminal and a self-pipe that
SIGWINCH writes to, so a resize redraws at once from the data it has and
nothing else wakes it. ``q`` quits; Ctrl-C, SIGTERM and SIGHUP end it too, and
the terminal's modes, cursor and screen are put back whatever ends it.
Output that is not a terminal gets one plain frame (like ``top -b -n 1``).
"""
from __future__ import annotations

import contextlib
import os
import select
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import Dict, Iterator, List, Optional, TextIO, Tuple

from ringd.cli import topview
from ringd.cli.reap import reap_before_reading
from ringd.cli.render import Line, _console, _isatty, plain_output
from ringd.cli.status import gather_status, open_reader
from ringd.core.errors import RingError
from ringd.core.records import text
from ringd.inputs.config import Config
from ringd.journal.sqlite import JournalError

STRIP_RUNS = 120   # runs kept per agent for its strip (a wide terminal shows about that many)


class Source:
    """The ring as top shows it: the status document and each agent's last runs.

    The runs are read once in full (the last STRIP_RUNS of each agent), then
    only from the oldest run that may still change (the one in flight) on:
    a refresh of a 100-agent ring reads a row or two, not 12,000."""

    def __init__(self, state_dir: Path, config: Config):
        self.state_dir, self.config = state_dir, config
        self.runs: Dict[str, Dict[int, Tuple[str, Optional[str]]]] = {}   # agent -> id -> (status, reason)
        self.names: Tuple[str, ...] = ()
        self.low: Optional[int] = None   # runs from this id on are read again
        self.key: Optional[tuple] = None
        self.strips: Dict[str, List[str]] = {}
        self.reasons: Dict[str, str] = {}

    def read(self) -> Tuple[dict, List[str]]:
        warning = reap_before_reading(self.state_dir, self.config)   # (as status --watch does)
        warnings: List[str] = [warning] if warning else []
        doc = gather_status(self.state_dir, self.config, warnings=warnings)
        key = topview.strip_key(doc)
        if key != self.key:
            self.read_runs(tuple(a["name"] for a in doc["agents"]))
            self.key = key
        return doc, warnings

    def read_runs(self, names: Tuple[str, ...]) -> None:
        reader = open_reader(self.state_dir, self.config)
        if reader is None:
            self.runs, self.low = {}, None
            self.shown()
            return
        try:
            newest = reader.con.execute("SELECT max(id) FROM runs").fetchone()[0]
            newest = newest if isinstance(newest, int) else 0
            if self.low is None or names != self.names or newest < self.low - 1:   # (a journal made anew)
                self.runs = {n: {} for n in names}
                for n in names:
                    self.take(n, reader.con.execute("SELECT id, status, reason FROM runs WHERE agent = ? "
                                                    "ORDER BY id DESC LIMIT ?", (n, STRIP_RUNS)).fetchall())
                self.names = names
                running = [k for runs in self.runs.values() for k, (status, _) in runs.items() if status == "running"]
                self.low = min(running, default=newest + 1)
            else:
                self.update(reader.con.execute("SELECT id, agent, status, reason FROM runs WHERE id >= ? "
                                               "ORDER BY id", (self.low,)).fetchall())
        finally:
            reader.close()
        self.shown()

    def update(self, rows) -> None:
        """Runs from ``low`` on, read again: new ones added, the one that was in flight as it is now."""
        running = None
        for r in rows:
            agent = text(r[1])
            if agent in self.runs:
                self.take(agent, [(r[0], r[2], r[3])])
            if text(r[2]) == "running" and running is None:
                running = r[0]
        top = max((r[0] for r in rows if isinstance(r[0], int)), default=self.low - 1)
        self.low = running if isinstance(running, int) else top + 1

    def take(self, agent: str, rows) -> None:
        runs = self.runs[agent]
        for run_id, status, reason in rows:
            if isinstance(run_id, int):
                runs[run_id] = (text(status) or "?", text(reason))
        for old in sorted(runs)[:-STRIP_RUNS]:
            del runs[old]

    def shown(self) -> None:
        """What the screen takes from the runs: each agent's last statuses
        (oldest first) and how its last finished run ended (``status: reason``)."""
        self.strips, self.reasons = {}, {}
        for n, runs in self.runs.items():
            ids = sorted(runs)
            self.strips[n] = [runs[k][0] for k in ids]
            done = next((runs[k] for k in reversed(ids) if runs[k][0] != "running"), None)
            if done is not None:
                self.reasons[n] = done[0] + (f": {done[1]}" if done[1] else "")


def run_top(state_dir: Path, config: Config, interval: float = 1.0, stream: Optional[TextIO] = None) -> None:
    stream = stream or sys.stdout
    source = Source(state_dir, config)
    doc, warnings = source.read()   # a ring that cannot be read at all: one line, before the screen
    if not _isatty(stream):
        size = shutil.get_terminal_size((120, 40))
        lines = topview.top_lines(doc, source.strips, time.time(), width=max(size.columns, 120),
                                  height=1 << 20, plain=True, warnings=warnings, reasons=source.reasons)
        stream.write("".join("".join(t for t, _ in line).rstrip() + "\n" for line in topview.safe(lines)))
        stream.flush()
        return
    try:
        live_view(source, (doc, warnings), interval, stream)
    except KeyboardInterrupt:   # Ctrl-C is how a person leaves, as q is: success
        pass


def live_view(source: Source, first: Tuple[dict, List[str]], interval: float, stream: TextIO) -> None:
    from rich.live import Live
    console = _console(stream)
    plain = plain_output(stream)
    data: Tuple[Optional[dict], List[str], Optional[str]] = (first[0], first[1], None)
    with ended_by_signals(), keys(sys.stdin) as key_fd, resize_pipe() as wake_fd:
        with Live(console=console, screen=True, auto_refresh=False, redirect_stdout=False,
                  redirect_stderr=False) as live:
            due = time.monotonic() + interval
            while True:
                console.size = size = terminal_size(stream)
                lines = topview.top_lines(data[0], source.strips, time.time(), width=size.columns,
                                          height=size.lines, plain=plain, warnings=data[1], error=data[2],
                                          reasons=source.reasons)
                live.update(Frame(topview.safe(lines)), refresh=True)
                woke = wait(key_fd, wake_fd, due - time.monotonic())
                if woke == "quit":
                    return
                if woke == "timeout":
                    data = refresh(source, data)
                    due = time.monotonic() + interval


def terminal_size(stream: TextIO) -> os.terminal_size:
    """The terminal's own size, asked of it at each frame: ``COLUMNS`` and
    ``LINES`` in the environment (which rich and shutil prefer) are what a
    shell said once, and stay put when the window is resized."""
    try:
        return os.get_terminal_size(stream.fileno())
    except (AttributeError, ValueError, OSError):
        return shutil.get_terminal_size((120, 40))


class Frame:
    """The screen's lines as rich segments, drawn as they are: rich's Text would
    lay out, wrap and crop spans the lines already fit (twice the CPU a frame)."""

    def __init__(self, lines: List[Line]):
        self.lines = lines

    def __rich_console__(self, console, options):
        from rich.segment import Segment
        style = console.get_style
        newline = Segment.line()
        for k, line in enumerate(self.lines):
            if k:
                yield newline
            for text_, name in line:
                yield Segment(text_, style(name) if name else None)


def refresh(source: Source, data):
    """Read again; a failed read keeps the last picture and says why."""
    try:
        doc, warnings = source.read()
        return doc, warnings, None
    except (RingError, JournalError, OSError) as e:
        return data[0], data[1], getattr(e, "message", None) or str(e)


def wait(key_fd: Optional[int], wake_fd: int, timeout: float) -> str:
    """Sleep until a key, a resize or ``timeout``: "quit", "resize" or "timeout"."""
    fds = [wake_fd] + ([key_fd] if key_fd is not None else [])
    ready, _, _ = select.select(fds, [], [], max(0.0, timeout))
    if wake_fd in ready:
        with contextlib.suppress(OSError):
            os.read(wake_fd, 512)
        return "resize"
    if key_fd is not None and key_fd in ready:
        try:
            got = os.read(key_fd, 64)
        except OSError:
            got = b""
        if got == b"" or b"q" in got or b"Q" in got:   # (end of input: the terminal is gone)
            return "quit"
        return "key"
    return "timeout"


@contextlib.contextmanager
def keys(stdin: TextIO) -> Iterator[Optional[int]]:
    """Standard input in cbreak mode (keys one by one, no echo; Ctrl-C still
    interrupts), its modes put back on the way out. None when it is no terminal."""
    try:
        fd = stdin.fileno()
    except (AttributeError, ValueError, OSError):
        yield None
        return
    if not os.isatty(fd):
        yield None
        return
    import termios
    import tty
    saved = termios.tcgetattr(fd)
    try:
        tty.setcbreak(fd, termios.TCSANOW)
        yield fd
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


@contextlib.contextmanager
def resize_pipe() -> Iterator[int]:
    """A pipe SIGWINCH writes a byte to (a select on it wakes at a resize)."""
    r, w = os.pipe()
    os.set_blocking(r, False)
    os.set_blocking(w, False)

    def on_resize(_signum, _frame):
        with contextlib.suppress(OSError):
            os.write(w, b"w")
    old = signal.signal(signal.SIGWINCH, on_resize)
    try:
        yield r
    finally:
        signal.signal(signal.SIGWINCH, old)
        os.close(r)
        os.close(w)


@contextlib.contextmanager
def ended_by_signals() -> Iterator[None]:
    """SIGTERM and SIGHUP end top like ``q`` does (the terminal is put back
    by the ``finally`` blocks on the way out), instead of killing it mid-screen."""
    def stop(_signum, _frame):
        raise SystemExit(0)
    old = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
