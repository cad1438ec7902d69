"""The one way a daemon publishes a file: temp file (O_NOFOLLOW, 0600), fsync, rename.

Files rewritten at every beat (the heartbeat, metrics) skip the fsync
(``durable=False``): they stay atomic for readers, and a power cut costs at most
the last beat, which readers already take as a dead driver.
"""
from __future__ import annotations

import errno
import json
import os
from pathlib import Path
from typing import Any, Dict, Optional, Set

from ringd.host import safefile


def write_json_atomic(path: Path, data: Dict[str, Any], durable: bool = True) -> None:
    """Write JSON so a reader sees the old file or the new one, never half of one."""
    write_text_atomic(path, json.dumps(data, sort_keys=True) + "\n", durable)


def write_text_atomic(path: Path, text: str, durable: bool = True) -> None:
    """Temp file (created afresh, 0600), fsync (``durable``), rename over ``path``."""
    if str(path) not in _swept:
        _sweep_temps(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    blob = text.encode()
    fd = safefile.create_new(tmp, 0o600)
    try:
        try:
            # a short write (a full disk, a file size limit) is not an error by
            # itself: write the rest, so the one that fails raises, and the old
            # file stays
            view = memoryview(blob)
            while view:
                n = os.write(fd, view)
                if n <= 0:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp))
                view = view[n:]
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError:
        try:   # a full or read-only state dir: leave no half-written temp file behind
            os.unlink(tmp)
        except OSError:
            pass
        raise


_swept: Set[str] = set()   # the files whose dead writers' temp files this process has removed


def _sweep_temps(path: Path) -> None:
    """Remove the temp files of ``path`` that writers killed mid-write (SIGKILL
    in a stalled fsync, the OOM killer, a power cut) left: ``.NAME.<pid>.tmp``
    of a pid no process has now. Each such death left one for good, none ever
    renamed nor removed. Once per file per process (its first write); a live
    writer's (another process, whatever its user) is left alone."""
    _swept.add(str(path))
    prefix = f".{path.name}."
    try:
        with os.scandir(path.parent) as entries:
            names = [e.name for e in entries if e.name.startswith(prefix) and e.name.endswith(".tmp")]
    except OSError:
        return
    for name in names:
        pid = name[len(prefix):-len(".tmp")]
        if not (pid.isascii() and pid.isdigit() and 0 < int(pid) < 1 << 31) or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
            continue   # alive (or another user's: PermissionError)
        except ProcessLookupError:
            pass
        except OSError:
            continue
        try:
            os.unlink(path.with_name(name))
        except OSError:
            pass


def read_json(path: Path) -> Optional[Dict[str, Any]]:
    """The JSON object in ``path``, or None if missing, unreadable, corrupt or not
    a regular file (a FIFO there is never waited on: safefile.open_regular)."""
    try:
        with os.fdopen(safefile.open_regular(path), "rb") as f:
            blob = f.read(64 * 1024)
        data = json.loads(blob)
    except (OSError, ValueError, RecursionError):   # RecursionError: '[' nested thousands deep
        return None
    return data if isinstance(data, dict) else None


# --- the heartbeat -----------------------------------------------------------
