"""Signals that arrive before a daemon can act on them.

SIGHUP's and SIGTERM's default action kills a process, and a daemon has no
handler until its imports are done and its wake-up pipe exists (tenths of a
second): a SIGHUP in that window killed the driver (ringwatch counted a
restart) or the watcher itself. So both daemons block these signals as their
first instruction (before click and the other imports), and unblock them once
their handlers are installed (``ringd.host.wakeup.Wakeups``): a signal sent in
between stays pending and is honoured then. ringwatch starts the driver with
them blocked too, so even the interpreter's own start-up cannot lose one; a
blocked mask is inherited across exec, so nothing else is ever started with it.
"""
from __future__ import annotations

import os
import signal
import sys
from contextlib import contextmanager
from typing import Iterator, Optional, Sequence

DEFERRED = {signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1}
_VALUED = {"--state", "--config"}   # the options that take a value, shared by both CLIs


def subcommand(args: Sequence[str]) -> Optional[str]:
    """The first argument that is not an option (or an option's value): ``run``
    in ``ringd --state D run``; None for a bare ``ringwatch``."""
    skip = False
    for arg in args:
        if skip:
            skip = False
        elif arg in _VALUED:
            skip = True
        elif not arg.startswith("-"):
            return arg
    return None


def starting(program: str, command: Optional[str]) -> bool:
    """Is this process ``program`` - its console script, or ``python -m
    program`` - starting ``command`` (None: no subcommand, a bare ``ringwatch``)?
    Only then are signals held: a process that merely imports the command line
    (a tool, a test runner whose argv is ``-c``) keeps its signal mask, which
    every program it starts would inherit."""
    prog = sys.argv[0] if sys.argv else ""
    if os.path.basename(prog) != program and not prog.endswith(os.path.join(program, "__main__.py")):
        return False
    return subcommand(sys.argv[1:]) == command


def hold() -> None:
    signal.pthread_sigmask(signal.SIG_BLOCK, DEFERRED)


def release() -> None:
    signal.pthread_sigmask(signal.SIG_UNBLOCK, DEFERRED)


@contextmanager
def held() -> Iterator[None]:
    """Block the signals around a fork + exec, so the child starts with them held."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, DEFERRED)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)
