"""Alerts: run the operator's ``alerts.command`` on notable events, detached.

The command gets the event as JSON on stdin and as ``RING_EVENT``,
``RING_AGENT``, ``RING_DETAIL`` in its environment, so ``mail``, ``curl`` or
``logger`` work as one-liners. It runs under a small supervisor process
(``python -m ringd.host.alerts``) in its own session that kills it, and whatever
it forked, after ``ALERT_TIMEOUT`` seconds, so a hanging, failing or missing
command never slows or stops the ring: the driver only forks and forgets (and
reaps).
Output goes to ``<state>/logs/alerts.log`` (the first ``ALERT_OUTPUT_BYTES``
of each alert's).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Sequence

from ringd.core.errors import EX_ALERT_CANNOT_START, EX_ALERT_TIMED_OUT
from ringd.core.events import FAILURES
from ringd.core.levels import ERR, INFO, WARNING

ALERT_TIMEOUT = 30.0
ALERT_OUTPUT_BYTES = 64 * 1024   # of one alert's output kept in alerts.log
# Alert commands running at once. A whole ring failing while the command hangs
# would otherwise start a supervisor (a Python interpreter) per alert until the
# box runs out of memory; past this, an alert is dropped, and the log says so.
MAX_ALERTS_RUNNING = 16
# Alerts started: at most ALERT_BURST at once, then ALERT_RATE a second. Each
# starts a supervisor (a Python interpreter, ~40 ms of CPU): a ring whose every
# run failed with failures_in_a_row: 1 and a quick command (/bin/true) turned
# 17 times slower (466 runs/s -> 27 on two cores), the box busy starting them.
ALERT_BURST = MAX_ALERTS_RUNNING
ALERT_RATE = 1.0
# After the timeout the supervisor SIGKILLs what the alert left and waits this
# long more for it to be reaped: an alert's supervisor ends within its timeout,
# this, and its own interpreter start-up (STARTUP_ALLOWANCE).
REAP_GRACE = 5.0
STARTUP_ALLOWANCE = 5.0
_dropped = 0   # alerts dropped since the last one sent
_bucket: "tuple[float, Optional[float]]" = (float(ALERT_BURST), None)   # (tokens, when counted)


def admit(bucket: "tuple[float, Optional[float]]", now: float, rate: float = ALERT_RATE,
          burst: int = ALERT_BURST) -> "tuple[tuple[float, Optional[float]], bool]":
    """Token bucket (pure): (the bucket after, may one alert start now?)."""
    tokens, at = bucket
    if at is not None:
        tokens = min(float(burst), tokens + max(0.0, now - at) * rate)
    if tokens >= 1.0:
        return (tokens - 1.0, now), True
    return (tokens, now), False

# The one kind a failing ring raises at every run. The others come once per
# agent (a quarantine), per driver or per run reaped: never dropped for the rate.
RATE_LIMITED = frozenset({FAILURES})


def open_alert_log(state_dir: Path) -> int:
    """Append-only ``logs/alerts.log`` (0600), never through a planted symlink,
    rotated like ringd.log (safefile.open_log)."""
    from ringd.host.safefile import open_log
    fd, unrotated = open_log(state_dir, ("logs",), "alerts.log")
    if unrotated is not None:
        os.write(fd, f"cannot rotate alerts.log to alerts.log.1 ({unrotated.strerror}); appending on\n".encode())
    return fd


def event_payload(kind: str, agent: Optional[str], detail: str, state_dir: Path,
                  extra: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    from ringd.core.timefmt import iso
    payload = {"event": kind, "agent": agent, "detail": detail, "at": iso(time.time()),
               "state_dir": str(state_dir)}
    if extra:
        payload.update(extra)
    return payload


def fire(command: Optional[Sequence[str]], kind: str, agent: Optional[str], detail: str,
         state_dir: Path, extra: Optional[Dict[str, Any]] = None, timeout: float = ALERT_TIMEOUT,
         log: Callable[[str, int], None] = lambda _m, _level: None, reaped_by_caller: bool = True) -> Optional[int]:
    """Start the alert command for one event and return at once (pid or None).
    Never raises: an alert must never hurt the ring. ``reaped_by_caller``: the
    caller collects exited children itself (the driver does, as a subreaper), so
    Popen must never waitpid this pid later (it could be recycled by then)."""
    global _dropped, _bucket
    if not command:
        return None
    from ringd.host.proctree import helpers_running
    why = None
    if helpers_running() >= MAX_ALERTS_RUNNING:
        why = (f"{MAX_ALERTS_RUNNING} alert commands are still running (alerts.timeout {timeout:g}s); "
               f"alerts are dropped until one ends")
    elif kind in RATE_LIMITED:
        _bucket, admitted = admit(_bucket, time.monotonic())
        if not admitted:
            why = (f"more than {ALERT_BURST} alerts, then {ALERT_RATE:g} a second; "
                   f"alerts are dropped until the storm passes")
    if why is not None:
        _dropped += 1
        if _dropped == 1:   # said once per storm
            log(f"alert {kind}{f' ({agent})' if agent else ''}: not sent: {why}", WARNING)
        return None
    if _dropped:
        log(f"{_dropped} alert(s) were not sent (too many at once)", WARNING)
        _dropped = 0
    payload = event_payload(kind, agent, detail, state_dir, extra)
    try:
        from ringd.host.proctree import clean_env
        env = clean_env(os.environ, {"RING_EVENT": kind, "RING_AGENT": agent or "",
                                     "RING_DETAIL": detail, "RING_STATE": str(state_dir)})
        env.pop("RING_RUN_ID", None)
        log_fd = open_alert_log(state_dir)
        try:
            proc = subprocess.Popen(
                [sys.executable, "-m", "ringd.host.alerts", str(timeout), *command],
                stdin=subprocess.PIPE, stdout=log_fd, stderr=subprocess.STDOUT, env=env,
                start_new_session=True, close_fds=True)
        finally:
            os.close(log_fd)
        try:
            proc.stdin.write(json.dumps(payload).encode() + b"\n")  # small: fits the pipe buffer
            proc.stdin.close()
        except OSError:
            pass
        if reaped_by_caller:
            proc.returncode = 0
        from ringd.host.proctree import register_helper
        register_helper(proc.pid)   # the driver's own helper: never killed as part of a run
        log(f"alert {kind}{f' ({agent})' if agent else ''}: started {command[0]} (pid {proc.pid})", INFO)
        return proc.pid
    except Exception as e:  # noqa: BLE001 - an alert must never stop the ring
        log(f"alert {kind}: could not start {command[0]!r}: {e}", ERR)
        return None


def longest(timeout: float) -> float:
    """Pure: the longest an alert started with ``timeout`` can run, supervisor
    included (a caller that must not exit before its alert is out waits this)."""
    return timeout + REAP_GRACE + STARTUP_ALLOWANCE


def _supervise(timeout: float, argv: Sequence[str]) -> int:
    """Run ``argv`` with our stdin, in its own session, and end it and all it
    started at ``timeout``. We are its subreaper: a daemon it forks (setsid,
    double fork) re-parents to us, so we outlive - and stay the driver's helper
    for - everything of the alert's, and nothing of it outlives the timeout.
    Its output goes to our stdout (alerts.log), the first ALERT_OUTPUT_BYTES of
    it: a command printing without end cannot fill the state dir."""
    import select
    from ringd.host import proctree
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime())
    event = os.environ.get("RING_EVENT", "?")
    proctree.set_child_subreaper()
    wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)   # (a handled signal is reset at exec)
    out_r, out_w = os.pipe2(os.O_CLOEXEC)
    try:
        child = subprocess.Popen(list(argv), stdin=sys.stdin, stdout=out_w, stderr=out_w,
                                 start_new_session=True)
    except OSError as e:
        print(f"{stamp} alert {event}: cannot start {argv[0]!r}: {e.strerror}", flush=True)
        return EX_ALERT_CANNOT_START
    finally:
        os.close(out_w)
    os.set_blocking(out_r, False)
    child.returncode = 0   # collected below (waitpid -1), never by Popen
    deadline = time.monotonic() + timeout
    code: Optional[int] = None
    killed = False
    kept = dropped = 0
    reading = True   # until every copy of the output pipe is closed
    while True:
        try:
            while True:
                pid, status = os.waitpid(-1, os.WNOHANG)
                if not pid:
                    break
                if pid == child.pid:
                    code = os.waitstatus_to_exitcode(status)
            alive = True
        except ChildProcessError:
            alive = False   # none of the alert's processes is left (they all re-parent to us)
        while reading:
            try:
                chunk = os.read(out_r, 65536)
            except BlockingIOError:
                break
            if not chunk:
                reading = False
                break
            keep = chunk[:max(0, ALERT_OUTPUT_BYTES - kept)]
            try:
                if keep:
                    os.write(1, keep)
            except OSError:   # a full state dir: the alert still runs to its end
                keep = b""
            kept += len(keep)
            dropped += len(chunk) - len(keep)
        if not alive:
            break
        left = deadline - time.monotonic()
        if left <= 0 and not killed:
            killed = True
            # every descendant of ours: as their subreaper, that is all of the alert's
            # (no run key needed); its group only while the command is unreaped (its
            # pid cannot be reused then)
            proctree.kill_run("", 0, child.pid if code is None else None, scope="descendants")
            deadline = time.monotonic() + REAP_GRACE   # SIGKILLed: only their reaping is left
            continue
        if left <= 0:
            break   # (never: a SIGKILLed process ends) - the driver reaps what is left
        try:
            select.select([wake_r, out_r] if reading else [wake_r], [], [], left)
        except InterruptedError:
            pass
        try:
            while os.read(wake_r, 512):
                pass
        except BlockingIOError:
            pass
    if dropped:
        print(f"\n{stamp} alert {event}: output cut at {kept} bytes, {dropped} more not kept", flush=True)
    if killed and code is not None:
        print(f"{stamp} alert {event}: {argv[0]!r} exited {code}; what it left running was killed "
              f"after {timeout:g}s", flush=True)
        return EX_ALERT_TIMED_OUT
    if killed:
        print(f"{stamp} alert {event}: {argv[0]!r} killed after {timeout:g}s", flush=True)
        return EX_ALERT_TIMED_OUT
    if code:
        print(f"{stamp} alert {event}: {argv[0]!r} exited {code}", flush=True)
    return code or 0


if __name__ == "__main__":
    sys.exit(_supervise(float(sys.argv[1]), sys.argv[2:]))
