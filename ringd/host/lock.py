"""Exclusive kernel locks on a state dir's lock files (``ringd.lock``,
``ringwatch.lock``): ``flock(LOCK_EX | LOCK_NB)`` on a descriptor that is
close-on-exec, so the kernel releases it when the holder dies and no agent
inherits it. Never a "soft" lock (a file's existence), which would outlive a
crash.

This is the lock filelock's UnixFileLock takes, without the library: importing
filelock costs the daemons ~6 MB of RSS, and it truncates the file on every
attempt. Nothing is stored in the lock file; the holder is found in
``/proc/locks`` (or named by the caller from its state file).
"""
from __future__ import annotations

import fcntl
import os
from pathlib import Path
from typing import Optional


LOCK_FILE = "ringd.lock"   # the driver's (ringd.host.watchstate has the watcher's)


class LockHeld(Exception):
    """Another process holds the lock; ``holder`` is its pid when known."""

    def __init__(self, path: Path, holder: Optional[int]):
        super().__init__(f"{path}: held by {f'pid {holder}' if holder else 'another process'}")
        self.path, self.holder = path, holder


class KernelLock:
    def __init__(self, path: Path):
        self.path = path
        self.fd: Optional[int] = None

    def acquire(self) -> "KernelLock":
        """Take the lock or raise LockHeld (never waits) / OSError."""
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise LockHeld(self.path, holder_pid(self.path)) from None
        except OSError:
            os.close(fd)
            raise
        self.fd = fd
        return self

    def verify(self) -> str:
        """Is the lock still on the file at our path? A lock file deleted or
        replaced under us (tmpfiles cleaners, ``git clean -X``) would let a second
        driver lock a fresh file. ``"ok"``; ``"retaken"`` (the path named another
        file or none, and we locked it again); ``"lost"`` (another process holds
        the new file's lock)."""
        assert self.fd is not None
        try:
            ours = os.fstat(self.fd)
            theirs = os.stat(self.path, follow_symlinks=False)
            if (ours.st_ino, ours.st_dev) == (theirs.st_ino, theirs.st_dev):
                return "ok"
        except OSError:
            pass
        old = self.fd
        try:
            self.acquire()
        except LockHeld:
            self.fd = old
            return "lost"
        except OSError:
            self.fd = old
            return "ok"   # cannot recreate it now (read-only dir ...): keep ours, look again next beat
        os.close(old)
        return "retaken"

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing the only descriptor drops the flock
            self.fd = None


def holder_pid(path: Path) -> Optional[int]:
    """The pid holding a flock on ``path`` per /proc/locks (Linux), else None.
    A lock is named there by device and inode ("MAJOR:MINOR:INODE", the device
    in hex): both must match - inode numbers repeat across file systems (every
    tmpfs counts from 1), and a flock on another one's file of the same number
    named its holder as the driver (``ringd status``: "stale", never "stopped")."""
    try:
        st = os.stat(path)
        want = (os.major(st.st_dev), os.minor(st.st_dev), st.st_ino)
        with open("/proc/locks") as f:
            for line in f:
                # "1: FLOCK  ADVISORY  WRITE 1234 fd:01:5678 0 EOF"
                parts = line.split()
                if len(parts) < 6 or parts[1] != "FLOCK":
                    continue
                dev = parts[5].split(":")
                if len(dev) == 3 and (int(dev[0], 16), int(dev[1], 16), int(dev[2])) == want:
                    return int(parts[4])
    except (OSError, ValueError):
        pass
    return None
