"""The driver's short-lived side threads (a new PostgreSQL connection):
started with every signal blocked, so the kernel gives the driver's signals
to its main thread, whose wait hears them, and never interrupts a side
thread's system call with one."""
from __future__ import annotations

import signal
import threading
from typing import Any, Callable


def start(target: Callable[..., Any], *args: Any, name: str) -> threading.Thread:
    """Start ``target(*args)`` on a daemon thread born with every signal
    blocked (a thread inherits its creator's mask). Raises RuntimeError when
    no thread can be made."""
    t = threading.Thread(target=target, args=args, name=name, daemon=True)
    old = signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
    try:
        t.start()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)
    return t
