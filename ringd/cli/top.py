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
from ringd.cli.render import _console, _isatty, _rich_text, plain_output
from ringd.cli.status import gather_status, open_reader
from ringd.core.errors import RingError
from ringd.inputs.config import Config
from ringd.journal.sqlite import JournalError

STRIP_RUNS = 120   # runs kept per agent for its strip (a wide terminal shows about that many)


class Source:
    """The ring as top shows it: the status document and each agent's last statuses."""

    def __init__(self, state_dir: Path, config: Config):
        self.state_dir, self.config = state_dir, config
        self.strips: Dict[str, List[str]] = {}
        self.reasons: Dict[str, str] = {}
        self.key: Optional[tuple] = None

    def read(self) -> Tuple[dict, List[str]]:
        warning = reap_before_reading(self.state_dir, self.config)   # (as status --watch does)
        warnings: List[str] = [warning] if warning else []
        doc = gather_status(self.state_dir, self.config, warnings=warnings)
        key = topview.strip_key(doc)
        if key != self.key:
            self.read_runs([a["name"] for a in doc["agents"]])
            self.key = key
        return doc, warnings

    def read_runs(self, names: List[str]) -> None:
        """Each agent's last statuses (oldest first) and how its last finished run ended (status: reason)."""
        reader = open_reader(self.state_dir, self.config)
        strips: Dict[str, List[str]] = {}
        reasons: Dict[str, str] = {}
        if reader is not None:
            try:
                for n in names:
                    rows = reader.history(n, STRIP_RUNS)
                    strips[n] = [r.status for r in reversed(rows)]
                    done = next((r for r in rows if r.status != "running"), None)
                    if done is not None:
                        reasons[n] = done.status + (f": {done.reason}" if done.reason else "")
            finally:
                reader.close()
        self.strips, self.reasons = strips, reasons


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
                size = console.size
                lines = topview.top_lines(data[0], source.strips, time.time(), width=size.width,
                                          height=size.height, plain=plain, warnings=data[1], error=data[2],
                                          reasons=source.reasons)
                live.update(_rich_text(topview.safe(lines)), refresh=True)
                woke = wait(key_fd, wake_fd, due - time.monotonic())
                if woke == "quit":
                    return
                if woke == "timeout":
                    data = refresh(source, data)
                    due = time.monotonic() + interval


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
