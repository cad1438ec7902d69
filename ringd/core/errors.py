"""Exit codes and the one error type that carries one.

Daemon and command exit codes come from sysexits (sysexits(3)); ``ringd status``
uses the LSB init-script status codes. Every error meant for the operator is a
:class:`RingError`: a one-line message plus the exit code that goes with it.
"""
from __future__ import annotations

import errno
from typing import Any

# sysexits(3)
EX_OK = 0                       # 0
EX_UNAVAILABLE = 69             # 69: the journal cannot be used now (busy, full, unreachable): restart later
EX_SOFTWARE = 70                # 70: ringwatch gave up (the start limit was hit); nothing else exits 70
EX_IOERR = 74                   # 74: a command's output could not be written (stdout on a full disk)
EX_TEMPFAIL = 75                # 75: another daemon holds the lock
EX_CONFIG = 78                  # 78: configuration (or unusable journal): do not restart blindly
EX_INTERRUPTED = 128 + 2        # 130: a foreground command was interrupted (SIGINT)

# The SPEC's own small codes for the operator commands (and ringwatch's)
EX_FAILURE = 1                  # the command failed: nothing running, the run it saw had already ended,
                                # nothing to force-fail, no runs yet, init/service would overwrite,
                                # check --strict warned, NOTIFY_SOCKET unset; also an internal error
EX_BAD_USAGE = 2                # an unknown agent, run or mode, or a bad or missing argument (the SPEC's
                                # "2 unknown"; click exits 2 for its own usage errors as well)

# The alert supervisor's own codes (``python -m ringd.host.alerts``), timeout(1)'s:
# the driver forks it and forgets, so nothing reads them - they are for a human
# running the helper by hand, who knows them from timeout(1) and the shell.
EX_ALERT_TIMED_OUT = 124        # the command was killed at its timeout (timeout(1)'s 124)
EX_ALERT_CANNOT_START = 127     # the command could not be started (the shell's "command not found")

# LSB init-script status codes (``ringd status``)
STATUS_OK = 0
STATUS_DEAD = 1                 # dead or stale
STATUS_STOPPED = 3              # stopped, or never ran
STATUS_UNKNOWN = 4              # cannot be told


# What a file system says when it is full, read-only (a bind mount, remounted
# read-only after an error) or failing: outages a restart can outlive. A daemon
# that meets one at start-up exits 69, never 78 - ringwatch and systemd
# (RestartPreventExitStatus=78) never restart a configuration error.
OUTAGE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO})


def exit_for(e: OSError) -> int:
    """The start-up exit code for an OSError on the state dir: 69 for an outage, else 78."""
    return EX_UNAVAILABLE if e.errno in OUTAGE_ERRNOS else EX_CONFIG


class RingError(Exception):
    """A one-line message for the operator and the process exit code that goes with it."""

    def __init__(self, message: str, code: int = EX_FAILURE):
        super().__init__(message)
        self.message = message
        self.code = code


class ConfigError(RingError):
    """A configuration or roster problem (exit 78)."""

    def __init__(self, message: str, code: int = EX_CONFIG):
        super().__init__(message, code)


def excerpt(value: Any, limit: int = 40) -> str:
    """A short, single-line rendering of untrusted input for error messages."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
