"""The roster, ``ring.txt``: parse it, reload it cheaply, and decide what runs next.

``parse_roster`` and ``next_index`` are pure. ``RosterSource`` holds the last good
roster and the current error so a broken edit never loses the ring.
"""
from __future__ import annotations

import os
import re
import shlex
import shutil
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, List, Optional, Sequence, Tuple

from ringd.core.errors import ConfigError, excerpt
from ringd.host.safefile import open_regular, read_regular_file

NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
MAX_ROSTER_BYTES = 1024 * 1024
MAX_LINE_CHARS = 8192
MAX_NAME_CHARS = 64


class RosterError(ConfigError):
    """A roster that does not parse: names the file, the line and the reason."""

    def __init__(self, path: Path, line: Optional[int], reason: str):
        self.path, self.line, self.reason = path, line, reason
        where = f"{path}:{line}" if line else f"{path}"
        super().__init__(f"{where}: {reason}")


@dataclass(frozen=True)
class Agent:
    name: str
    argv: Tuple[str, ...]
    line: int
    text: str  # the roster line as written (a change of it ends a quarantine)


# A roster is a text file of lines. Any other control character in it (tab
# aside) is refused: a lone CR (old Mac line endings) or a form feed would
# otherwise make split() or shlex join two agents into one argv or cut a name,
# and a NUL or U+2028 reaches no exec intact.
_CONTROL = re.compile("[\x00-\x08\x0a-\x1f\x7f-\x9f\u2028\u2029]")
# Nor may it hold an invisible format character (Unicode category Cf): the
# bidirectional overrides and isolates (U+202A-202E, U+2066-2069) make an editor,
# ``cat`` or a code review show a line's words in another order than they run
# ("Trojan Source"), and zero-width characters (U+200B, U+2060, a soft hyphen,
# the tag characters) make an argument or a program path look like another one
# (``./out\u200breach.sh`` shows as ``./outreach.sh``). What the file shows is
# what runs; a program that needs such a character in an argument gets it from
# a script. The ranges are Unicode 15's Cf (tests/system/test_roster.py checks them
# against this Python's unicodedata).
_FORMAT = re.compile("[\u00ad\u0600-\u0605\u061c\u06dd\u070f\u0890\u0891\u08e2\u180e\u200b-\u200f"
                     "\u202a-\u202e\u2060-\u2064\u2066-\u206f\ufeff\ufff9-\ufffb\U000110bd\U000110cd"
                     "\U00013430-\U0001343f\U0001bca0-\U0001bca3\U0001d173-\U0001d17a\U000e0001"
                     "\U000e0020-\U000e007f]")
# Name and command are separated as a POSIX shell separates words: by spaces
# and tabs only (str.split() would also split at a no-break space).
_NAME_AND_COMMAND = re.compile(r"([^ \t]+)(?:[ \t]+(.*))?\Z", re.DOTALL)


def _without_comment(command: str) -> str:
    """``command`` up to a trailing comment, as a POSIX shell reads one: an
    unquoted, unescaped ``#`` that starts a word (``run.sh --x  # nightly``);
    a ``#`` inside a word (``url#frag``), quoted or escaped stays. shlex's own
    ``comments=True`` would also cut at ``url#frag``, so the cut is found here."""
    quote, escaped, word_start = None, False, True
    for i, ch in enumerate(command):
        if escaped:
            escaped, word_start = False, False
            continue
        if quote == "'":
            quote = None if ch == "'" else quote
        elif quote == '"':
            if ch == "\\":
                escaped = True
            elif ch == '"':
                quote = None
        elif ch == "\\":
            escaped = True
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and word_start:
            return command[:i]
        word_start = quote is None and not escaped and ch in " \t"
    return command


def _control_reason(ch: str) -> str:
    return "line contains a NUL byte" if ch == "\x00" else \
        f"line contains a control character (U+{ord(ch):04X}); a roster is plain text lines"


def _format_reason(ch: str) -> str:
    import unicodedata
    name = unicodedata.name(ch, "")
    return (f"line contains an invisible format character (U+{ord(ch):04X}{' ' + name if name else ''}): "
            f"it would make the line show other than it runs; put such an argument in a script")


def parse_roster(text: str, path: Path) -> List[Agent]:
    """Parse roster text. Raises RosterError(path, line, reason)."""
    agents: List[Agent] = []
    seen: dict = {}   # name in lower case -> (line, name as written): unique whatever the case
    if text.startswith("\ufeff"):   # a byte order mark some editors write: not part of the first name
        text = text[1:]
    for number, raw in enumerate(text.split("\n"), start=1):
        line = raw[:-1] if raw.endswith("\r") else raw   # CRLF line endings
        bad = _CONTROL.search(line)
        if bad:
            raise RosterError(path, number, _control_reason(bad.group()))
        invisible = _FORMAT.search(line)
        if invisible:
            raise RosterError(path, number, _format_reason(invisible.group()))
        stripped = line.strip(" \t")
        if not stripped or stripped.startswith("#"):
            continue
        if len(line) > MAX_LINE_CHARS:
            raise RosterError(path, number, f"line is longer than {MAX_LINE_CHARS} characters")
        name, command = _NAME_AND_COMMAND.match(stripped).groups()
        if not NAME_RE.fullmatch(name) or len(name) > MAX_NAME_CHARS:
            raise RosterError(path, number, f"bad agent name {excerpt(name)}: use letters, digits, "
                                            f"'_', '.', '-' (starting with a letter or digit), at most {MAX_NAME_CHARS}")
        first = seen.get(name.lower())
        if first is not None:
            raise RosterError(path, number, f"duplicate agent name {name!r} (first on line {first[0]}"
                                            + (")" if first[1] == name else
                                               f" as {first[1]!r}: names that differ only in case share "
                                               f"one log folder on a case-insensitive file system)"))
        if not command:
            raise RosterError(path, number, f"agent {name!r} has no command")
        try:
            argv = shlex.split(_without_comment(command), comments=False, posix=True)
        except ValueError as e:
            raise RosterError(path, number, f"cannot split the command of {name!r}: {str(e).lower()}") from None
        if not argv:
            raise RosterError(path, number, f"agent {name!r} has no command")
        if not argv[0]:   # exec takes no empty program name ('' or "")
            raise RosterError(path, number, f"agent {name!r}: the program name is empty")
        seen[name.lower()] = (number, name)   # (names are ASCII: lower() is their case folding)
        agents.append(Agent(name=name, argv=tuple(argv), line=number, text=stripped))
    if not agents:
        raise RosterError(path, None, "roster has no agents")
    return agents


def read_roster(path: Path) -> List[Agent]:
    """Read and parse the roster file, refusing unsafe or absurd files."""
    return _parse_blob(_read_blob(path), path)


def _read_blob(path: Path) -> bytes:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise RosterError(path, None, "roster file not found") from None
    except OSError as e:
        raise RosterError(path, None, f"cannot read roster: {e.strerror}") from None
    if not stat.S_ISREG(st.st_mode):
        raise RosterError(path, None, "roster is not a regular file")
    if st.st_size > MAX_ROSTER_BYTES:
        raise RosterError(path, None, f"roster is larger than {MAX_ROSTER_BYTES // 1024} KiB")
    try:  # non-blocking, its mode and owner judged on the descriptor read: swapped for a FIFO, it is refused
        blob = read_regular_file(path, "roster", MAX_ROSTER_BYTES)
    except ConfigError as e:   # "<path>: <reason>": the reason (a path may hold ": " itself)
        message, prefix = str(e), f"{path}: "
        raise RosterError(path, None, message[len(prefix):] if message.startswith(prefix) else message) from None
    if len(blob) > MAX_ROSTER_BYTES:
        raise RosterError(path, None, f"roster is larger than {MAX_ROSTER_BYTES // 1024} KiB")
    return blob


def _parse_blob(blob: bytes, path: Path) -> List[Agent]:
    try:
        text = blob.decode("utf-8")
    except UnicodeDecodeError as e:
        line = blob.count(b"\n", 0, e.start) + 1
        raise RosterError(path, line, "not UTF-8 text") from None
    return parse_roster(text, path)


def resolve_program(argv: Sequence[str], roster_dir: Path) -> List[str]:
    """Relative program paths (``./x``, ``bin/x``) resolve against the roster's folder;
    bare names (``python3``) are looked up on PATH as usual."""
    prog = argv[0]
    if "/" in prog and not os.path.isabs(prog):
        prog = os.path.normpath(os.path.join(str(roster_dir), prog))
    return [prog, *argv[1:]]


def resolve_cwd(cwd: Optional[str], roster_dir: Path) -> str:
    """The folder an agent runs in: ``agents.<name>.cwd`` (``~`` expanded; a
    relative one against the roster's folder, like a relative program, never
    against wherever the driver happened to be started), else the roster's folder."""
    if not cwd:
        return str(roster_dir)
    return os.path.normpath(os.path.join(str(roster_dir), os.path.expanduser(cwd)))


def program_problem(argv: Sequence[str], roster_dir: Path, cwd: Optional[str] = None) -> Optional[str]:
    """Why the agent's program could not be started, or None (``ringd check``).
    Looks it up as the driver would: its working directory (``cwd``, as
    :func:`resolve_cwd`), relative paths against the roster's folder, bare
    names on this process's PATH (a service's PATH may differ)."""
    folder = resolve_cwd(cwd, roster_dir)
    if not os.path.isdir(folder):
        return f"working directory {excerpt(folder, 80)} {'is not a directory' if os.path.exists(folder) else 'not found'}"
    prog = resolve_program(argv, roster_dir)[0]
    if "/" not in prog:
        found = shutil.which(prog)
        if not found:
            return f"program {excerpt(prog)} not found on PATH"
        prog = found
    if not os.path.exists(prog):
        return f"program {_shown(prog)} not found"
    if not os.path.isfile(prog) or not os.access(prog, os.X_OK):   # exec takes a regular file only
        return f"program {_shown(prog)} is not executable"
    if _exec_header(prog) not in (None, b"#!", b"\x7fE"):
        return (f"program {_shown(prog)} has no #! line and is not a binary: exec refuses it "
                f"(ring runs no shell; start the script with #!/bin/sh)")
    return None


def _shown(path: str, limit: int = 160) -> str:
    """A path as a warning names it: whole when short, else cut (a roster line
    may hold 8 kB; a warning is one short line)."""
    return path if len(path) <= limit else path[: limit - 3] + "..."


def _exec_header(prog: str) -> Optional[bytes]:
    """The first two bytes of ``prog`` (``#!`` or ELF's), None if they cannot be
    read (an execute-only binary, a FIFO: never waited on)."""
    try:
        fd = open_regular(prog)
    except OSError:
        return None
    try:
        return os.read(fd, 2)
    except OSError:
        return None
    finally:
        os.close(fd)


def _resume_at(names: Sequence[str], last_name: Optional[str], last_position: Optional[int],
               last_roster: Optional[Sequence[str]]) -> int:
    """Where the ring goes on, unwrapped: ``len(names)`` when the lap is over."""
    if last_position is not None and 0 <= last_position < len(names) and names[last_position] == last_name:
        return last_position + 1   # still where it was (every turn of an unedited roster): no search
    if last_name is not None and last_name in names:
        return list(names).index(last_name) + 1
    if (last_roster is not None and last_position is not None and 0 <= last_position < len(last_roster)
            and last_roster[last_position] == last_name):
        # gone, and the roster of its turn is known: after the last of the agents that
        # preceded it there, as the roster is now; at the start if none of them is left
        # (agents before it removed with it: its old position says nothing any more)
        now = {name: i for i, name in enumerate(names)}
        kept = [now[name] for name in last_roster[:last_position] if name in now]
        return max(kept) + 1 if kept else 0
    if last_position is not None and 0 <= last_position < len(names):
        return last_position
    return len(names)


def next_index(names: Sequence[str], last_name: Optional[str], last_position: Optional[int],
               last_roster: Optional[Sequence[str]] = None) -> int:
    """Where the ring resumes: after ``last_name`` if it is still on the roster,
    else at the position it held (the agent that followed it moved up into it).
    ``last_roster``: the roster's names at its turn (the driver knows them; a
    restart does not): the position it held is then the place after the last
    of the agents that preceded it, as the roster is now - agents removed before
    it with it, or moved, never pass over the agent that followed it.
    A position past the end of the roster means the agents after it were removed
    too: the lap is over and the ring goes on at its first agent (never modulo
    the new length, which would pass over agents whose turn it is)."""
    if not names:
        raise ValueError("empty roster")
    at = _resume_at(names, last_name, last_position, last_roster)
    return at if at < len(names) else 0


def wraps(names: Sequence[str], last_name: Optional[str], last_position: Optional[int], index: int,
          last_roster: Optional[Sequence[str]] = None) -> bool:
    """Does the turn of ``index`` begin a new lap, the last turn having been
    ``last_name``'s at ``last_position``? Yes when it is not after the last
    agent in the roster as it is now - judged by :func:`next_index`'s rule, so
    agents removed or added ahead of it meanwhile never make a lap of their own
    (its old position says nothing of the roster read since)."""
    return index < _resume_at(names, last_name, last_position, last_roster)


# A file's time stamps are the clock's at the change, to a granularity (a coarse
# kernel tick on ext4 before Linux 6.13; 2 s on FAT): a file read within this
# long of its last change may be changed again with the very same stamps.
RACY_NS = 2 * 10 ** 9


class RosterSource:
    """The roster file as the driver sees it: last good roster + current error.

    ``refresh()`` re-reads only when (mtime, ctime, size, inode, device, mode)
    changed, so calling it before every hop costs one ``stat`` - except after
    a read that came within RACY_NS of the file's last change (git's "racily
    clean" files): an in-place edit of the same size in the same clock tick
    leaves every stamp as it was, so such a file is read again at each
    refresh until a read comes later than that; such a read that finds the
    file empty or its last line unterminated keeps the last good roster (the
    file is being written). ``clock``: wall time in ns.
    """

    def __init__(self, path: Path, clock: Callable[[], int] = time.time_ns):
        self.path = path
        self.agents: List[Agent] = []
        self.origin: Optional[Path] = None   # the file ``agents`` were read from
        self.error: Optional[str] = None
        self._signature: Optional[tuple] = None
        self._racy = False     # the last read was too soon after the change to trust the stamps
        self._blob: Optional[bytes] = None   # what it read (None: it could not read the file)
        self._clock = clock

    def moved_to(self, path: Path) -> "RosterSource":
        """The source for a new roster path (``ring.roster`` changed at SIGHUP):
        it reads ``path`` at its first refresh and, until that file parses,
        keeps this one's last good roster."""
        moved = RosterSource(path, self._clock)
        moved.agents, moved.origin = self.agents, self.origin
        return moved

    def _stat_signature(self) -> Optional[tuple]:
        try:
            st = os.stat(self.path)
        except OSError as e:
            return ("missing", e.errno)
        # ctime too: cp -p, touch -r, rsync -t and tar keep or set the mtime, and an
        # in-place edit of equal size then looked unchanged; nobody can set ctime
        return (st.st_mtime_ns, st.st_ctime_ns, st.st_size, st.st_ino, st.st_dev, st.st_mode)

    def refresh(self, force: bool = False) -> bool:
        """Re-read if changed. Returns True when the roster or its error changed."""
        sig = self._stat_signature()
        if not force and sig == self._signature and not self._racy:
            return False
        self._signature = sig
        # stat before read: a change after this read gets stamps at least this late
        self._racy = sig[0] != "missing" and 0 <= self._clock() - max(sig[0], sig[1]) < RACY_NS
        try:
            blob = _read_blob(self.path)
        except RosterError as e:
            self._blob = None
            return self._failed(e)
        if blob == self._blob:   # (a racy file read again, as it was): what it said before
            return False
        if self._racy and self.agents and not blob.endswith(b"\n"):
            # Empty or cut mid-line just after a change: being written in place
            # (truncated, then written in chunks), and a cut line may parse
            # ("--dry-run" cut to "--dry"). The last good roster stays, with no
            # error, until the file ends its last line or settles (read again at
            # each refresh while racy). Without a last good one it is taken as is.
            return False
        self._blob = blob
        try:
            agents = _parse_blob(blob, self.path)
        except RosterError as e:
            return self._failed(e)
        changed = agents != self.agents or self.error is not None
        self.agents, self.error, self.origin = agents, None, self.path
        return changed

    def _failed(self, e: RosterError) -> bool:
        changed = self.error != str(e)
        self.error = str(e)
        return changed

    @property
    def names(self) -> List[str]:
        return [a.name for a in self.agents]


def roster_changes(old: Sequence[Agent], new: Sequence[Agent]) -> List[str]:
    """Pure: what a reload changed in the roster, as one line each: agents added,
    removed, with a changed command line, or moved in ring order."""
    before, after = {a.name: a.text for a in old}, {a.name: a.text for a in new}
    out = [f"roster: {a.name} added" for a in new if a.name not in before]
    out += [f"roster: {a.name} removed" for a in old if a.name not in after]
    out += [f"roster: {a.name} has a new command line" for a in new
            if a.name in before and before[a.name] != after[a.name]]
    kept_old = [a.name for a in old if a.name in after]
    kept_new = [a.name for a in new if a.name in before]
    if kept_old != kept_new:
        out.append(f"roster: order is now {', '.join(kept_new)}")
    return out


def roster_view(config, state_dir: Path) -> Tuple[Path, Optional[List[Tuple[str, str]]], Optional[str]]:
    """The roster ``config`` names, as commands show it: (path, [(name, line)] or
    None when unreadable, error or None)."""
    path = config.roster_path(state_dir)
    try:
        agents = read_roster(path)
    except ConfigError as e:
        return path, None, str(e)
    return path, [(a.name, a.text) for a in agents], None
