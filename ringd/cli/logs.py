"""``ringd logs``: print a run's log (``--lines N``: its last N lines; NAME alone:
its newest run that has a log), follow one run until it ends (``--run ID -f``),
follow an agent's current and later runs (``NAME -f``), or the whole ring (``-f``:
each line prefixed ``NAME[RUN_ID] HH:MM:SS ``, and a line when a run ends).

Logs live at ``<state>/logs/<agent>/<run_id>.log``; they are opened without
following symlinks and copied as bytes (an agent's output need not be UTF-8).
A running run's log is read only once its row has a pid (the driver made the
file before the spawn), and bytes are shown only while the file read is still
the one at the run's path, or has no name at all: no other run's bytes are ever
shown as this run's. Following is the CLI polling the journal and the files
every 0.1 s (the driver never polls for it).
"""
from __future__ import annotations

import errno
import os
import re
import signal
import sys
import time
from pathlib import Path
from typing import BinaryIO, Callable, Dict, List, Optional, Tuple

from ringd.host import safefile
from ringd.inputs.config import Config
from ringd.core.errors import EX_BAD_USAGE, EX_FAILURE
from ringd.journal.sqlite import Journal, JournalError, RunRow, journal_path
from ringd.cli.reap import reap_if_orphaned
from ringd.cli.status import OperatorError, known_names, open_reader, require_state_dir, unknown_agent

CHUNK = 64 * 1024
MAX_LINE = 64 * 1024   # bytes of one line of a prefixed view held before it is shown in pieces
FOLLOW_INTERVAL = 0.1   # s between looks at a followed log (the CLI polls; the driver never does)
JOURNAL_CREATE_GRACE = 5.0   # s a journal may look unusable while its first driver creates it
LOGLESS_SCAN = 1000   # newest runs of an agent looked through for one with a log (``logs NAME``)


def log_file(state_dir: Path, row: RunRow) -> Path:
    return state_dir / "logs" / row.agent / f"{row.id}.log"


def find_run(state_dir: Path, config: Config, agent: str, run_id: Optional[int],
             logless: Optional[List[RunRow]] = None) -> RunRow:
    """The run whose log to show: ``run_id`` (which must be ``agent``'s) or the
    agent's last run. With ``logless`` (a list) and no ``run_id``: the agent's
    newest run that has a log, the newer runs without one appended to
    ``logless`` (skipped, quarantined, could not start). Unknown agent or run
    -> OperatorError(2)."""
    require_state_dir(state_dir)
    try:
        reader = open_reader(state_dir, config)
        if reader is None:
            known = known_names(config, state_dir)
            if agent not in known:
                raise unknown_agent(agent, known)
            raise OperatorError(f"{agent} has no runs yet", EX_FAILURE)
        try:
            known = known_names(config, state_dir, reader, include_journal=True)
            if agent not in known:
                raise unknown_agent(agent, known)
            reap_if_orphaned(state_dir, config, reader)
            if run_id is None and logless is not None:
                row = _newest_with_log(state_dir, reader.history(agent, limit=LOGLESS_SCAN), logless)
                if row is None:
                    raise OperatorError(f"{agent} has no runs yet", EX_FAILURE)
            elif run_id is None:
                row = reader.last_run_of(agent)
                if row is None:
                    raise OperatorError(f"{agent} has no runs yet", EX_FAILURE)
            else:
                row = reader.run(run_id)
                if row is None or row.agent != agent:
                    raise OperatorError(f"no run {run_id} of {agent} (see ringd history {agent})", EX_BAD_USAGE)
            return row
        finally:
            reader.close()
    except JournalError as e:
        raise OperatorError(str(e)) from None


def _newest_with_log(state_dir: Path, rows: List[RunRow], logless: List[RunRow]) -> Optional[RunRow]:
    """The first of ``rows`` (newest first) that has a log; those before it go to
    ``logless``. None of them: the newest (whose missing log is then said)."""
    for row in rows:
        try:
            fd = _open_log(state_dir, row)
        except OperatorError:
            return row   # there is something there: showing it says what
        if fd is not None:
            os.close(fd)
            return row
        logless.append(row)
    if rows:
        del logless[:]
        return rows[0]
    return None


def logless_line(agent: str, shown: RunRow, logless: List[RunRow]) -> str:
    """The one stderr line of ``logs NAME`` when newer runs than the one shown had no log."""
    def why(r: RunRow) -> str:
        if r.status == "skipped":
            return "quarantined" if (r.reason or "").startswith("quarantined") else "skipped"
        return {"error": "could not start", "running": "starting"}.get(r.status, f"{r.status}, no log")
    newer = ", ".join(f"{r.id} ({why(r)})" for r in logless[:10])
    more = f" and {len(logless) - 10} more" if len(logless) > 10 else ""
    return f"showing run {shown.id} of {agent}; newer runs had no log: {newer}{more}"


def _open_log(state_dir: Path, row: RunRow) -> Optional[int]:
    """The run log's descriptor, or None when there is none. No symlink is
    followed, at ``logs/``, ``logs/<agent>`` (an agent may swap its log dir
    for a link to another dir) or the log itself; anything but a regular
    file is refused, never waited on: a blocking open of a FIFO planted at a
    run log hung ``ringd logs`` until a writer came (safefile.open_regular)."""
    if row.status == "running" and row.pid is None:
        return None   # starting: its log may not be made yet (what is at its path may be another's)
    path = log_file(state_dir, row)
    try:
        dfd = safefile.open_dir(state_dir, ("logs", row.agent), create=False)
    except FileNotFoundError:
        return None
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            raise OperatorError(f"{path.parent}: log dir is a symbolic link or not a directory; "
                                f"refusing to follow it") from None
        raise OperatorError(f"{path.parent}: cannot read log dir: {e.strerror}") from None
    try:
        return safefile.open_in(dfd, path.name, os.O_RDONLY)
    except FileNotFoundError:
        return None
    except safefile.NotRegularFile as e:
        raise OperatorError(f"{path}: log is {e.strerror}; refusing to read it") from None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise OperatorError(f"{path}: log is a symbolic link; refusing to follow it") from None
        raise OperatorError(f"{path}: cannot read log: {e.strerror}") from None
    finally:
        os.close(dfd)


def _copy(fd: int, out: BinaryIO) -> int:
    n = 0
    while True:
        chunk = os.read(fd, CHUNK)
        if not chunk:
            return n
        out.write(chunk)
        n += len(chunk)


def _no_log(row: RunRow, config: Config) -> OperatorError:
    if row.status == "skipped" and row.pid is None:
        why = "it was skipped without starting"
    elif row.status == "running":
        why = "it is starting"
    else:
        why = f"it was pruned (keep_logs: {config.ring.keep_logs}) or never written"
    return OperatorError(f"run {row.id} of {row.agent} ({row.status}) has no log: {why}", EX_FAILURE)


def show_log(state_dir: Path, config: Config, row: RunRow, out: BinaryIO) -> None:
    fd = _open_log(state_dir, row)
    if fd is None:
        raise _no_log(row, config)
    try:
        _copy(fd, out)
    finally:
        os.close(fd)
    out.flush()


def follow_log(state_dir: Path, config: Config, row: RunRow, out: BinaryIO,
               interval: float = FOLLOW_INTERVAL, sleep: Callable[[float], None] = time.sleep) -> str:
    """Print the log and keep printing what is appended until the run leaves
    ``running`` (an orphaned run - its driver gone - is reaped, which ends it).
    Returns the run's final status. A log that cannot be read (or is moved
    away while followed) ends it with an OperatorError."""
    if row.status != "running":
        show_log(state_dir, config, row, out)
        return row.status

    def refuse(message: str) -> None:
        raise OperatorError(message)
    reader = Journal.open_readonly(state_dir)
    t = _Tracked(row, b"", refuse)
    last_reap_check = 0.0
    try:
        while True:
            current = reader.run(row.id)
            if current is not None:
                t.row = current
            if t.pump(state_dir, out):
                out.flush()
            if current is None or current.status != "running":
                t.finish(state_dir, out)   # the last words written before the run ended
                out.flush()
                return current.status if current else "unknown"
            now = time.monotonic()
            if now - last_reap_check >= 1.0:
                last_reap_check = now
                reap_if_orphaned(state_dir, config, reader)
            sleep(interval)
    finally:
        t.close()
        reader.close()


def tail_offset(fd: int, lines: int, chunk: int = CHUNK) -> int:
    """Where the last ``lines`` lines of the regular file at ``fd`` start (its
    size for 0 lines; a last line without newline counts).
    Read backwards from the end a block at a time, so the last lines of a 10 GB
    log cost what they hold, not the whole log in memory (``--lines`` read all
    of it, and ``-f --lines`` did so by repeated concatenation: a 300 MB log
    hung it for minutes before a line was shown)."""
    end = pos = os.fstat(fd).st_size
    if lines <= 0:
        return end
    left = lines
    while pos > 0:
        start = max(0, pos - chunk)
        block = os.pread(fd, pos - start, start)
        if not block:
            break   # truncated meanwhile: what there is
        if pos == end and block.endswith(b"\n"):
            block = block[:-1]   # the last line's own newline
        cut = len(block)
        while True:
            cut = block.rfind(b"\n", 0, cut)
            if cut < 0:
                break
            left -= 1
            if not left:
                return start + cut + 1
        pos = start
    return 0


def show_tail(state_dir: Path, config: Config, row: RunRow, out: BinaryIO, lines: int) -> None:
    fd = _open_log(state_dir, row)
    if fd is None:
        raise _no_log(row, config)
    try:
        os.lseek(fd, tail_offset(fd, lines), os.SEEK_SET)
        _copy(fd, out)
    finally:
        os.close(fd)
    out.flush()


def split_lines(data: bytes, limit: Optional[int] = None) -> "tuple[List[bytes], bytes]":
    """(whole lines without their newline, what is left): a line longer than
    ``limit`` (MAX_LINE) is cut into pieces of ``limit`` bytes, and so is what
    is left, to less than ``limit``."""
    limit = MAX_LINE if limit is None else limit
    *lines, rest = data.split(b"\n")
    out: List[bytes] = []
    for line in lines:
        out += [line[i:i + limit] for i in range(0, len(line), limit)] or [b""]
    while len(rest) >= limit:
        out.append(rest[:limit])
        rest = rest[limit:]
    return out, rest


# What a terminal acts on inside a line: C0 controls but tab (a carriage return,
# an escape sequence), DEL, and the C1 controls in UTF-8 (U+0080-U+009F: CSI is
# U+009B).
_CONTROLS = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]|\xc2[\x80-\x9f]")


def _caret(m: "re.Match[bytes]") -> bytes:
    b = m.group()
    if len(b) == 2:
        return b"M-^" + bytes([b[1] - 0x40])
    return b"^?" if b == b"\x7f" else b"^" + bytes([b[0] + 0x40])


def visible(line: bytes) -> bytes:
    """One line of the prefixed (whole-ring) view with its control characters
    shown as ``cat -v`` shows them (``^M``, ``^[``, ``M-^[``): an agent's carriage
    return or escape sequence would otherwise move the operator's cursor back
    over the ``NAME[RUN_ID] `` prefix (or up a line) and show its own text as
    another agent's line."""
    return _CONTROLS.sub(_caret, line) if _CONTROLS.search(line) else line


def prefix_of(row: RunRow) -> bytes:
    """``NAME[RUN_ID]`` of the whole-ring view, shown as :func:`visible` shows a
    line: the name is the journal's, which any process of the ring's user can
    write (an escape sequence or carriage return there moved the cursor too)."""
    return visible(f"{row.agent}[{row.id}]".encode("utf-8", "replace"))


def read_time() -> bytes:
    """``HH:MM:SS``, local: when a line of the whole-ring view was read."""
    return time.strftime("%H:%M:%S").encode()


# SGR colours of an end line on a terminal, by status (render.STATUS_STYLE's)
_END_COLOUR = {"ok": b"32", "running": b"1;36", "failed": b"31", "error": b"31", "stalled": b"1;31",
               "timeout": b"33", "interrupted": b"35", "deferred": b"34", "skipped": b"2"}


def how_it_ended(row: RunRow) -> str:
    """``timeout after 5.0s (run budget of 5s reached)``: status, duration, and
    the reason (else the exit code or signal of a run that did not exit 0)."""
    took = row.duration if row.duration is not None else max(0.0, (row.ended_at or row.started_at) - row.started_at)
    why = " ".join((row.reason or "").split())
    if not why and row.signal:
        try:
            why = signal.Signals(row.signal).name
        except ValueError:
            why = f"signal {row.signal}"
    elif not why and row.exit_code not in (None, 0):
        why = f"exit {row.exit_code}"
    return f"{row.status} after {took:.1f}s" + (f" ({why})" if why else "")


def end_line(row: RunRow, colour: bool = False) -> bytes:
    """``NAME[RUN] -- timeout after 5.0s (run budget of 5s reached)``: the whole-ring
    view's line when a run ends, its ending coloured on a terminal."""
    text = b"-- " + visible(how_it_ended(row).encode("utf-8", "replace"))
    if colour:
        text = b"\x1b[" + _END_COLOUR.get(row.status, b"0") + b"m" + text + b"\x1b[0m"
    return prefix_of(row) + b" " + text + b"\n"


class _Tracked:
    """One run being followed: its log's descriptor and a partial last line.
    ``tag``: ``NAME[RUN_ID]`` of the whole-ring view, each line then prefixed
    with it and the time it was read (``stamp``); b"": lines as they are."""

    def __init__(self, row: RunRow, tag: bytes, warn: Callable[[str], None] = lambda _m: None,
                 stamp: Callable[[], bytes] = read_time):
        self.row = row   # kept current by the caller: its log is opened once the row has a pid
        self.tag = tag
        self.warn = warn
        self.stamp = stamp
        self.fd: Optional[int] = None
        self.ident: Optional[Tuple[int, int]] = None   # (st_dev, st_ino) of the file ``fd`` reads
        self.skip_to_lines: Optional[int] = None
        self.partial = b""
        self.refused = False   # its log is not one to read (a FIFO, a symlink ...): said once
        self.moved = False     # its file was moved away while followed: the rest is not shown (said once)

    def _prefix(self) -> bytes:
        return self.tag + b" " + self.stamp() + b" "

    def _open(self, state_dir: Path) -> bool:
        if self.refused or self.moved:
            return False
        try:
            self.fd = _open_log(state_dir, self.row)
        except OperatorError as e:
            # one agent's log made a FIFO or a symlink must not end the
            # following of its later runs, or of the whole ring
            self.refused = True
            self.warn(e.message)
            return False
        if self.fd is None:
            return False
        st = os.fstat(self.fd)
        self.ident = (st.st_dev, st.st_ino)
        if self.skip_to_lines is not None:
            os.lseek(self.fd, tail_offset(self.fd, self.skip_to_lines), os.SEEK_SET)
            self.skip_to_lines = None
        return True

    def _still_the_runs(self, state_dir: Path) -> bool:
        """Is the file just read still this run's? Looked at after the read: yes
        while the run's path names it (a file is made for one run and never
        given to another), or while it has no name at all (pruned: nothing can
        give it to another run). A file of ours under another name only was
        moved or linked away - to be another run's, perhaps - and a file
        replaced at the path is not the one the run writes: neither is shown."""
        try:
            st = os.stat(log_file(state_dir, self.row), follow_symlinks=False)
            if (st.st_dev, st.st_ino) == self.ident:
                return True
        except OSError:
            pass
        return os.fstat(self.fd).st_nlink == 0

    def pump(self, state_dir: Path, out: BinaryIO, skip_to_lines: Optional[int] = None) -> bool:
        """Copy what was appended (whole lines, prefixed), a chunk at a time. True
        if anything was written. A line longer than MAX_LINE is shown in pieces
        of that size, each prefixed: an agent printing without a newline is held
        in memory that far, never without end. ``skip_to_lines``: start at the
        log's last N lines (once it is opened)."""
        if skip_to_lines is not None:
            self.skip_to_lines = skip_to_lines
        if self.fd is None and not self._open(state_dir):
            return False
        wrote = False
        prefix = self._prefix() if self.tag else b""
        while True:
            chunk = os.read(self.fd, CHUNK)
            if not chunk:
                return wrote
            if not self._still_the_runs(state_dir):
                self.moved = True
                self.close()
                self.partial = b""
                self.warn(f"{log_file(state_dir, self.row)}: the log of run {self.row.id} was moved or "
                          f"replaced while it was followed; the rest of it is not shown")
                return wrote
            if not self.tag:
                out.write(chunk)
                wrote = True
                continue
            lines, self.partial = split_lines(self.partial + chunk)
            if lines:
                out.write(b"".join(prefix + visible(line) + b"\n" for line in lines))
                wrote = True

    def finish(self, state_dir: Path, out: BinaryIO, ended: Optional[RunRow] = None,
               colour: bool = False) -> None:
        """The run ended: its last words, a last line without newline included;
        in the whole-ring view then how it ended (``ended``: its closed row)."""
        if ended is not None:
            self.row = ended
        self.pump(state_dir, out)
        if self.partial:
            out.write(self._prefix() + visible(self.partial) + b"\n")
            self.partial = b""
        self.close()
        if self.tag and ended is not None and ended.status != "running":
            out.write(end_line(ended, colour))

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def _file_identity(path: Path) -> Optional[tuple]:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _to_stderr(out: BinaryIO) -> Callable[[str], None]:
    """A warning line to stderr, after what ``out`` holds so far."""
    def warn(message: str) -> None:
        out.flush()
        sys.stderr.write(f"ringd: {message}\n")
        sys.stderr.flush()
    return warn


def _require_known(state_dir: Path, config: Config, agent: str) -> None:
    """Exit 2 naming the known agents unless ``agent`` is on the roster or in the journal."""
    reader = open_reader(state_dir, config)
    try:
        known = known_names(config, state_dir, reader, include_journal=True)
    finally:
        if reader is not None:
            reader.close()
    if agent not in known:
        raise unknown_agent(agent, known)


def follow(state_dir: Path, config: Config, agent: Optional[str], out: BinaryIO, *,
           lines: Optional[int] = None, interval: float = FOLLOW_INTERVAL,
           sleep: Callable[[float], None] = time.sleep, until: Optional[Callable[[], bool]] = None,
           warn: Optional[Callable[[str], None]] = None, colour: bool = False) -> None:
    """Follow ``agent``'s runs (None: every run of the ring, lines prefixed
    ``NAME[RUN_ID] HH:MM:SS ``, and one line as each run ends, its ending in
    colour if ``colour``) until interrupted (or ``until()`` says so): first the
    running (else the last) run - all of it, or its last ``lines`` lines - then
    every later run as it is written. A run whose driver died is reaped (which
    ends it), as ``status`` would. A run log that cannot be read is named in
    one line to ``warn`` (stderr), and following goes on."""
    warn = warn or _to_stderr(out)
    require_state_dir(state_dir)
    prefixed = agent is None
    if agent is not None:
        _require_known(state_dir, config, agent)
    reader = None
    reader_file: Optional[tuple] = None   # (device, inode) of the journal ``reader`` reads
    tracked: Dict[int, _Tracked] = {}
    seen = 0            # runs up to this id are tracked or done
    started = False
    last_reap_check = 0.0
    unusable_since: Optional[float] = None
    where = "" if agent is None else " AND agent = ?"
    args: List = [] if agent is None else [agent]
    try:
        while until is None or not until():
            if reader is None:
                # no run yet: wait for the first driver (and for it to finish creating the journal)
                try:
                    reader_file = _file_identity(journal_path(state_dir))   # (before it is opened)
                    reader = Journal.open_readonly(state_dir) if reader_file is not None else None
                except JournalError:
                    if unusable_since is None:
                        unusable_since = time.monotonic()
                    if time.monotonic() - unusable_since > JOURNAL_CREATE_GRACE:
                        raise   # not a journal being created: a broken one, say so
                    reader = None
                if reader is None:
                    sleep(interval)
                    continue
                unusable_since = None
                if started:   # a journal put in place of the one followed: its runs from here on
                    top = reader.con.execute("SELECT max(id) FROM runs").fetchone()[0]
                    seen = min(seen, top or 0)
            if not started:
                started = True
                row = reader.con.execute(f"SELECT * FROM runs WHERE status = 'running'{where}", args).fetchone() \
                    or reader.con.execute(f"SELECT * FROM runs WHERE 1 = 1{where} ORDER BY id DESC LIMIT 1",
                                          args).fetchone()
                if row is not None:
                    first = RunRow.from_mapping(row)
                    seen = first.id
                    t = _Tracked(first, prefix_of(first) if prefixed else b"", warn)
                    t.pump(state_dir, out, skip_to_lines=lines)
                    if first.status == "running":
                        tracked[first.id] = t
                    else:
                        t.finish(state_dir, out, first, colour)
            for r in reader.con.execute(f"SELECT * FROM runs WHERE id > ?{where} ORDER BY id",
                                        [seen, *args]).fetchall():
                row = RunRow.from_mapping(r)
                seen = row.id
                tracked[row.id] = _Tracked(row, prefix_of(row) if prefixed else b"", warn)
            for run_id in sorted(tracked):
                t = tracked[run_id]
                current = reader.run(run_id)   # first: its log is read once the row has a pid
                if current is not None:
                    t.row = current
                t.pump(state_dir, out)
                if current is None or current.status != "running":
                    t.finish(state_dir, out, current, colour)
                    del tracked[run_id]
            out.flush()
            now = time.monotonic()
            if now - last_reap_check >= 1.0:
                last_reap_check = now
                reap_if_orphaned(state_dir, config, reader)
                if _file_identity(journal_path(state_dir)) != reader_file:
                    # moved aside or removed, and a driver made a new one: a reader
                    # kept on the old file would show no run of the ring again
                    reader.close()
                    reader = None
                    continue
            sleep(interval)
    finally:
        for t in tracked.values():
            t.close()
        if reader is not None:
            reader.close()
