"""Speaking to systemd as its service: sd_notify when NOTIFY_SOCKET is set, and the watchdog's interval."""
from __future__ import annotations

import os
from typing import Optional


def watchdog_interval() -> Optional[float]:
    """Half of systemd's WatchdogSec when it watches *this* process, else None."""
    usec = os.environ.get("WATCHDOG_USEC")
    owner = os.environ.get("WATCHDOG_PID")
    if not usec or (owner and owner != str(os.getpid())):
        return None
    try:
        return max(0.05, int(usec) / 2e6)
    except ValueError:
        return None


class Notifier:
    """sd_notify when NOTIFY_SOCKET is set; silent otherwise."""

    def __init__(self) -> None:
        self._n = None
        if os.environ.get("NOTIFY_SOCKET"):
            import sdnotify
            self._n = sdnotify.SystemdNotifier()

    @property
    def active(self) -> bool:
        """Is a service manager listening (NOTIFY_SOCKET set)?"""
        return self._n is not None

    def notify(self, message: str) -> None:
        if self._n is not None:
            self._n.notify(message)
