"""Files inside the state dir that a local user must not be able to redirect:
every directory on the way is opened O_NOFOLLOW (created 0700 if missing) and
the file is opened relative to it, O_NOFOLLOW, mode 0600. A symlink planted at
``logs/``, ``logs/<agent>/`` or at the file itself is never followed: refused
(ELOOP/ENOTDIR/EEXIST), or for a run log set aside (:func:`set_aside`). Used
for run logs, ``alerts.log`` and ``ringd.log``.
Every file a daemon opens by name in the state dir or reads as its input goes
through :func:`open_regular`: a FIFO or a device there is refused, never waited
on.
Also the one definition of a run log's name, ``logs/<agent>/<run_id>.log``, and
the checks on files the daemons read (regular, not writable by others, a path a
system call can take).
"""
from __future__ import annotations

import errno
import os
import re
import stat
import time
from pathlib import Path
from contextlib import contextmanager
from typing import Callable, Iterator, List, Optional, Sequence, Tuple

from ringd.core.errors import ConfigError, excerpt

# Agents can write into their log dir: a name is a run log only if it is exactly
# ASCII digits + ".log" ("²".isdigit() is True, int("²") raises).
RUN_LOG_RE = re.compile(r"([1-9][0-9]{0,18})\.log", re.ASCII)

NAME_MAX = 255                 # bytes in one path component (Linux, macOS)
PATH_MAX = 4095

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class NotRegularFile(OSError):
    """A path names a FIFO, a device, a socket or a directory where a file must be.
    ``strerror`` reads after "is": "a directory", "not a regular file"."""


def open_regular(path, flags: int = os.O_RDONLY, *, dir_fd: Optional[int] = None) -> int:
    """Open ``path`` (``flags`` plus O_CLOEXEC; created 0600) and make sure it is a
    regular file. Opened non-blocking and checked on the descriptor, which is
    then made blocking again: a blocking open of a FIFO waits for its other end
    forever, deaf to SIGTERM (the kernel restarts it under Python's signal
    handlers) - a FIFO planted at the heartbeat or ``ringwatch.json`` hung both
    daemons, the driver with its agent running past its stall threshold. The
    file checked is the file used. Raises NotRegularFile, or OSError."""
    try:
        fd = os.open(path, flags | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
    except OSError as e:
        if e.errno == errno.ENXIO:   # a FIFO with no reader opened to write, a socket
            raise NotRegularFile(errno.EINVAL, "not a regular file", str(path)) from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            what = "a directory" if stat.S_ISDIR(st.st_mode) else "not a regular file"
            raise NotRegularFile(errno.EINVAL, what, str(path))
        if not flags & os.O_NONBLOCK:
            os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def chmod_regular(path, mode: int) -> bool:
    """chmod ``path`` to ``mode`` if it is a regular file; a symlink (or anything
    else) put there is left alone, and so is its target, even one swapped in
    while we look (chmod by path would follow it: run as root on a user's
    ring, a link to a file of root's). The file is reached through an
    ``O_PATH`` descriptor, which is never opened for reading or writing: closing
    a real one would drop every POSIX lock this process holds on the file
    (SQLite's, on its journal). True if the mode was changed."""
    try:
        fd = os.open(path, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or stat.S_IMODE(st.st_mode) == mode:
            return False
        os.chmod(f"/proc/self/fd/{fd}", mode)   # (fchmod refuses an O_PATH descriptor)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def create_new(path, mode: int) -> int:
    """Create ``path`` as a new file for writing (a temp file that is then renamed
    or linked into place): O_EXCL, so nothing already there is ever opened
    through. Temp names are predictable, and a blocking open of a FIFO planted
    at one waited for a reader forever (a driver stopped beating, deaf to
    SIGTERM): a squatter - a FIFO, a symlink, a temp file a crash left - is
    removed first. A directory there raises, and the write fails."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, mode)
    except FileExistsError:
        os.unlink(path)
        fd = os.open(path, flags, mode)
    try:
        os.fchmod(fd, mode)   # whatever the umask
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_dir_in(dir_fd: int, name: str) -> int:
    """A descriptor of the directory ``name`` in ``dir_fd``, never through a symlink."""
    return os.open(name, _DIR_FLAGS, dir_fd=dir_fd)


# Moved out of the way: (its path in the state dir, what it was, its path now).
Aside = Tuple[str, str, str]


def open_dir(state_dir: Path, parts: Sequence[str], create: bool = True,
             moved: Optional[List[Aside]] = None) -> int:
    """A descriptor of ``state_dir/parts...`` (no part a symlink), creating
    missing parts 0700 if ``create``. With ``moved`` (a list), a part that is
    not a directory (a symlink, a file, a FIFO) is set aside (:func:`set_aside`,
    appended to ``moved``) and made afresh, never followed; without, it raises
    (ELOOP, ENOTDIR)."""
    base = os.open(state_dir, _DIR_FLAGS)
    try:
        for i, part in enumerate(parts):
            try:
                nxt = open_dir_in(base, part)
            except FileNotFoundError:   # made on first use only: a hop usually finds it
                if not create:
                    raise
                nxt = _make_dir_in(base, part)
            except OSError as e:
                if moved is None or e.errno not in (errno.ELOOP, errno.ENOTDIR):
                    raise
                what, new = set_aside(base, part)
                moved.append(("/".join(parts[:i + 1]), what, "/".join([*parts[:i], new])))
                nxt = _make_dir_in(base, part)
            os.close(base)
            base = nxt
    except BaseException:
        os.close(base)
        raise
    return base


def _make_dir_in(base: int, part: str) -> int:
    try:
        os.mkdir(part, 0o700, dir_fd=base)
    except FileExistsError:
        pass
    return open_dir_in(base, part)


def kind_of(st: os.stat_result) -> str:
    """What a file is, for a log line: "a symbolic link", "a directory", ..."""
    mode = st.st_mode
    for test, what in ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISDIR, "a directory"),
                       (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"), (stat.S_ISREG, "a file")):
        if test(mode):
            return what
    return "a device"


def set_aside(dir_fd: int, name: str) -> Tuple[str, str]:
    """Rename whatever is at ``name`` in ``dir_fd`` (never followed: a symlink is
    moved as a link) to a fresh name beside it, ``NAME.aside-HEX``. Nothing is
    deleted: it may be an old run's log (a journal's ids that met older logs)
    or evidence of tampering for the operator. Returns (what it was, its new
    name). Raises OSError (FileNotFoundError if it is gone already)."""
    what = kind_of(os.stat(name, dir_fd=dir_fd, follow_symlinks=False))
    for _ in range(4):
        new = f"{name}.aside-{time.time_ns():x}"
        try:
            os.rename(name, new, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
            return what, new
        except OSError as e:   # a directory already at the new name: another name
            if e.errno not in (errno.EEXIST, errno.ENOTEMPTY, errno.EISDIR, errno.ENOTDIR):
                raise
    raise OSError(errno.EEXIST, f"cannot set aside {name}: every name tried is taken", name)


def create_in(dir_fd: int, name: str, moved: List[Aside], where: str = "") -> int:
    """Create ``name`` in ``dir_fd`` as a new regular file for writing (O_EXCL,
    0600). Whatever is in the way - a symlink, a file, a FIFO, a directory - is
    set aside first (:func:`set_aside`, appended to ``moved`` with the folder
    ``where`` before its names): never written through, never opened. Tried
    three times (something made anew in the way each time: FileExistsError)."""
    for attempt in range(3):
        try:
            return open_in(dir_fd, name, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        except FileExistsError:
            if attempt == 2:
                raise
            try:
                what, new = set_aside(dir_fd, name)
            except FileNotFoundError:
                continue   # gone meanwhile: try again
            moved.append((where + name, what, where + new))
    raise AssertionError("unreachable")


LOG_ROTATE_BYTES = 16 * 1024 * 1024   # a daemon's own log is rotated (one old copy) past this size
ROTATE_ENV = "RING_LOG_ROTATE_BYTES"   # another bound (bytes), for tests: a real run rotates at a small size


def log_rotate_bytes() -> int:
    """The size past which ``ringd.log`` and ``alerts.log`` are rotated:
    ``$RING_LOG_ROTATE_BYTES`` if it is a positive integer, else LOG_ROTATE_BYTES."""
    raw = os.environ.get(ROTATE_ENV, "")
    return int(raw) if raw.isascii() and raw.isdigit() and int(raw) > 0 else LOG_ROTATE_BYTES


def open_log(state_dir: Path, parts: Sequence[str], name: str) -> "Tuple[int, Optional[OSError]]":
    """Open a daemon's own log (``logs/ringd.log``, ``logs/alerts.log``) for
    appending, 0600, never through a symlink; past :func:`log_rotate_bytes` it is
    first moved to ``NAME.1`` (one old copy), so it never grows without end
    (a writer that lives on rotates it as it writes: logline.rotate_stderr).
    Returns the descriptor and why it could not be rotated (None: it was, or
    needed not be); a log that cannot be rotated (a directory at ``NAME.1``, a
    read-only folder) is appended to all the same - the caller says so."""
    dfd = open_dir(state_dir, parts)
    unrotated = None
    try:
        try:
            st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
            if st.st_size > log_rotate_bytes() and not stat.S_ISLNK(st.st_mode):
                os.replace(name, name + ".1", src_dir_fd=dfd, dst_dir_fd=dfd)
        except FileNotFoundError:
            pass
        except OSError as e:
            unrotated = e
        fd = open_in(dfd, name, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    finally:
        os.close(dfd)
    return fd, unrotated


def open_in(dir_fd: int, name: str, flags: int) -> int:
    """Open the regular file ``name`` in the directory ``dir_fd`` with ``flags``
    (plus O_NOFOLLOW, O_CLOEXEC), 0600 (:func:`open_regular`)."""
    return open_regular(name, flags | os.O_NOFOLLOW, dir_fd=dir_fd)


def run_log_ids(folder: "Path | int") -> List[int]:
    """Run ids of the run logs in ``folder`` (an agent's log dir, or a descriptor of it), ascending:
    regular files named exactly so; everything else there is ignored (a
    symlink planted there is not a log ring wrote, and is never written through)."""
    try:
        entries = [e for e in os.scandir(folder) if e.is_file(follow_symlinks=False)]
    except OSError:
        return []
    return sorted(int(m.group(1)) for m in (RUN_LOG_RE.fullmatch(e.name) for e in entries) if m)


def highest_run_log_id(state_dir: Path) -> int:
    """The highest run id of any run log in the state dir (0 if none): a new
    journal's run ids start past it, so they never collide with old logs."""
    logs = state_dir / "logs"
    try:
        agents = [e.path for e in os.scandir(logs) if e.is_dir(follow_symlinks=False)]
    except OSError:
        return 0
    return max((ids[-1] for ids in map(run_log_ids, agents) if ids), default=0)


def check_path(what: str, raw: str) -> str:
    """Refuse a path no system call could take (a NUL byte, a component over
    NAME_MAX, over PATH_MAX, not encodable), naming it by an excerpt only."""
    if "\x00" in raw:
        raise ConfigError(f"{what}: path contains a NUL byte: {excerpt(raw)}")
    try:
        blob = os.fsencode(raw)
    except UnicodeError:
        raise ConfigError(f"{what}: path is not a valid file name: {excerpt(raw)}") from None
    if len(blob) > PATH_MAX:
        raise ConfigError(f"{what}: path is longer than {PATH_MAX} bytes: {excerpt(raw)}")
    for part in blob.split(b"/"):
        if len(part) > NAME_MAX:
            raise ConfigError(f"{what}: a path component is longer than {NAME_MAX} bytes: "
                              f"{excerpt(os.fsdecode(part))}")
    return raw


def read_regular_file(path: Path, what: str, limit: int) -> bytes:
    """Read at most ``limit`` + 1 bytes of a file that must be a regular file not
    writable by group or others (:func:`read_checked_file`)."""
    return read_checked_file(path, what, limit)[0]


def read_checked_file(path: Path, what: str, limit: int) -> Tuple[bytes, bool]:
    """Read at most ``limit`` + 1 bytes of a file that must be a regular file not
    writable by group or others, and say whether it is safe from other writers
    (False only within :func:`lenient_modes`). Opened non-blocking and checked
    on the open descriptor: a FIFO (or a device) is refused, never waited on,
    as what it is (not as its device's 0666 mode), and the file checked is the
    file read, a rename in between notwithstanding."""
    try:
        fd = open_regular(path)
    except NotRegularFile as e:
        raise ConfigError(f"{path}: {what} is {e.strerror}") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot read {what}: {e.strerror}") from None
    try:
        trusted = _refuse_if_others_can_change(path, what, os.fstat(fd))
        chunks, left = [], limit + 1
        while left > 0:
            chunk = os.read(fd, min(left, 65536))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks), trusted
    except OSError as e:
        raise ConfigError(f"{path}: cannot read {what}: {e.strerror}") from None
    finally:
        os.close(fd)


# Set by reading commands (``lenient_modes``): a group/other-writable file is
# then reported to this callback instead of refused. Only ``ringd run`` and
# ``ringwatch`` (which run its commands) refuse.
_mode_warning: Optional[Callable[[str], None]] = None
# Whose rule a lenient reader applies: the uid the ring runs as (the driver's),
# which may not be the reader's own (root reading a service user's ring).
_ring_uid: Optional[int] = None


@contextmanager
def lenient_modes(warn: Callable[[str], None], ring_uid: Optional[int] = None) -> Iterator[None]:
    """Within this block, an unsafe file mode is ``warn(message)``, not an error;
    ``ring_uid``: judge ownership for that user (the ring's), not for this process."""
    global _mode_warning, _ring_uid
    previous = _mode_warning, _ring_uid
    _mode_warning, _ring_uid = warn, ring_uid
    try:
        yield
    finally:
        _mode_warning, _ring_uid = previous


def others_can_change(path: Path, st: os.stat_result, uid: int, whose: str = "this user") \
        -> Optional[Tuple[str, str]]:
    """Pure: (what is wrong, the fix) when someone other than ``uid`` (``whose``)
    and root can change the file: group or others may write it, or another
    user owns it (its owner can chmod it and write it: sshd's StrictModes
    checks both). None when only ``uid`` and root can."""
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"is writable by group or others (mode {stat.S_IMODE(st.st_mode):04o})", f"chmod go-w {path}"
    if st.st_uid not in (0, uid):
        return (f"is owned by uid {st.st_uid}, neither {whose} (uid {uid}) nor root", f"chown {uid} {path}")
    return None


@contextmanager
def strict_modes() -> Iterator[None]:
    """Within this block an unsafe file mode is an error, whatever encloses it
    (:func:`lenient_modes`): what ``ringd run`` is given is judged as run judges it."""
    global _mode_warning
    previous, _mode_warning = _mode_warning, None
    try:
        yield
    finally:
        _mode_warning = previous


def check_state_dir(state_dir: Path) -> bool:
    """The one rule on a state dir, for the driver, the watcher and ``ringd
    check`` alike: if it exists, a directory that group and others cannot write
    (anyone who can controls the driver); a missing one is fine (the daemons
    create it 0700). Within :func:`lenient_modes` an unsafe mode is a warning
    and the result False."""
    try:
        st = os.stat(state_dir)
    except FileNotFoundError:
        return True
    except OSError as e:
        raise ConfigError(f"{state_dir}: cannot use state dir: {e.strerror}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"{state_dir}: state dir is not a directory")
    return _refuse_if_others_can_change(state_dir, "state dir", st)


def _refuse_if_others_can_change(path: Path, what: str, st: os.stat_result) -> bool:
    """Refuse a file (or the state dir) another user can change (:func:`others_can_change`,
    for this process's user). Within ``lenient_modes`` judge it for the ring's
    user, warn instead, and return False: the fix named is then the one right
    for the user the ring runs as."""
    lenient = _mode_warning is not None
    uid = _ring_uid if lenient and _ring_uid is not None else os.geteuid()
    whose = "the ring's user" if lenient and _ring_uid is not None and _ring_uid != os.geteuid() else "this user"
    found = others_can_change(path, st, uid, whose)
    if found is None:
        return True
    problem, fix = found
    if lenient:
        _mode_warning(f"{path}: {what} {problem}; ringd run and ringwatch refuse it. Fix: {fix}")
        return False
    raise ConfigError(f"{path}: {what} {problem}; anyone who can write it can run commands as this user. "
                      f"Fix: {fix}")
