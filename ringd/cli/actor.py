"""Who asked: the operator behind a control verb, as the journal's events record it.

``who()`` reads the calling process (its uid and user name, ``SUDO_USER``, its
terminal, ``SSH_CLIENT``); :func:`actor_from` is the pure rule it applies and
:func:`describe` the one line a table shows. Every control verb (skip, pause,
resume, next, force-fail, reload) records ``who()`` with its event.
"""
from __future__ import annotations

import os
from typing import Any, Dict, Mapping, Optional

MAX_FIELD_CHARS = 200   # an environment value is the caller's to choose: never a 100 kB field


def _clean(value: Any) -> Optional[str]:
    """One short line of text, or None for nothing: control characters are spaces."""
    if not isinstance(value, str):
        return None
    from ringd.host.notify import without_controls
    text = " ".join(without_controls(value).split())
    return text[:MAX_FIELD_CHARS] or None


def actor_from(uid: int, user: Optional[str], environ: Mapping[str, str],
               tty: Optional[str]) -> Dict[str, Any]:
    """Pure: the actor of a request made by ``uid`` (named ``user``) with the
    environment ``environ`` on terminal ``tty``. ``sudo_user`` is what sudo
    says (it cannot be proven: any caller may set it, so it is recorded beside
    the uid, never instead of it); ``ssh_client`` is the address of
    ``SSH_CLIENT`` (else ``SSH_CONNECTION``), without its ports."""
    ssh = _clean(environ.get("SSH_CLIENT")) or _clean(environ.get("SSH_CONNECTION"))
    return {
        "user": _clean(user),
        "uid": uid,
        "sudo_user": _clean(environ.get("SUDO_USER")),
        "tty": _clean(tty),
        "ssh_client": ssh.split(" ", 1)[0] if ssh else None,
    }


def who() -> Dict[str, Any]:
    """The actor of this process's request (:func:`actor_from`). Never raises:
    a uid with no passwd entry (a container's) has no name."""
    import pwd
    uid = os.getuid()
    try:
        user: Optional[str] = pwd.getpwuid(uid).pw_name
    except (KeyError, OSError):
        user = None
    return actor_from(uid, user, os.environ, _terminal())


def _terminal() -> Optional[str]:
    """The terminal of standard input, output or error (as ``tty`` and ``who`` name it), if any."""
    for fd in (0, 1, 2):
        try:
            if os.isatty(fd):
                return os.ttyname(fd)
        except OSError:
            continue
    return None


def describe(actor: Optional[Mapping[str, Any]]) -> str:
    """One line for a table: ``alice (uid 1000) via sudo from bob on /dev/pts/3 from 10.0.0.5``;
    ``-`` for none (the driver's and the reaper's own events)."""
    if not actor:
        return "-"
    uid = actor.get("uid")
    name = actor.get("user") or (f"uid {uid}" if uid is not None else "?")
    text = f"{name} (uid {uid})" if actor.get("user") and uid is not None else str(name)
    if actor.get("sudo_user"):
        text += f" via sudo from {actor['sudo_user']}"
    if actor.get("tty"):
        text += f" on {actor['tty']}"
    if actor.get("ssh_client"):
        text += f" from {actor['ssh_client']}"
    return text
