"""Files inside the state dir that a local user must not be able to redirect:
every directory on the way is opened O_NOFOLLOW (created 0700 if missing) and
the file is opened relative to it, O_NOFOLLOW, mode 0600. A symlink planted at
``logs/``, ``logs/<agent>/`` or at the file itself is refused (ELOOP/ENOTDIR/
EEXIST), never followed. Used for run logs, ``alerts.log`` and ``ringd.log``.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def open_dir(state_dir: Path, parts: Sequence[str]) -> int:
    """A descriptor of ``state_dir/parts...``, creating missing parts 0700."""
    base = os.open(state_dir, _DIR_FLAGS)
    try:
        for part in parts:
            try:
                os.mkdir(part, 0o700, dir_fd=base)
            except FileExistsError:
                pass
            nxt = os.open(part, _DIR_FLAGS, dir_fd=base)
            os.close(base)
            base = nxt
    except BaseException:
        os.close(base)
        raise
    return base


def open_file(state_dir: Path, parts: Sequence[str], name: str, flags: int) -> int:
    """Open ``state_dir/parts.../name`` with ``flags`` (plus O_NOFOLLOW, O_CLOEXEC), 0600."""
    dfd = open_dir(state_dir, parts)
    try:
        return os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dfd)
    finally:
        os.close(dfd)
