"""Silence passes for health no longer: pure rules for ``alerts.silent_after`` and
``alerts.paused_longer_than``.

An agent on the roster is *silent* once it has had no ``ok`` run for
``silent_after`` seconds, counted from the end of its last ``ok`` run, or from
when it joined the roster if that is later (or it never had one). A pause (the
ring's, or one agent's) is *too long* once it is older than
``paused_longer_than``. Each raises one alert: the driver keeps a mark per
silence (its start) and per pause (its start), and :func:`alerts_due` says
which marks are new - an ``ok`` run or a lifted pause starts a new one.
Plain functions of their inputs and a clock value; no I/O.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Iterable, List, Mapping, Optional, Tuple

from ringd.core.events import PAUSED_TOO_LONG, SILENT
from ringd.core.records import AgentState

RING = ""                            # the ring's own pause among agents' ones (no agent has an empty name)


def silent_since(state: Optional[AgentState]) -> Optional[float]:
    """Since when ``state``'s agent has had no ok run: its last ok run's end, or
    its join if later. None when neither is known (the driver never ran a
    roster holding it: not on the roster, or no driver since it joined)."""
    if state is None:
        return None
    ok, joined = state.last_ok_at, state.joined_at
    if joined is None:
        return None
    return joined if ok is None else max(ok, joined)


def silent_for(state: Optional[AgentState], now: float, silent_after: Optional[float]) -> Optional[float]:
    """How long ``state``'s agent has been silent at ``now`` when that is at least
    ``silent_after`` (None: off), else None."""
    since = silent_since(state)
    if silent_after is None or since is None:
        return None
    quiet = now - since
    return quiet if quiet >= silent_after else None


def silent_agents(states: Mapping[str, AgentState], names: Iterable[str], now: float,
                  silent_after: Optional[float]) -> Dict[str, float]:
    """The roster's (``names``) silent agents: name -> since when (:func:`silent_since`)."""
    if silent_after is None:
        return {}
    out: Dict[str, float] = {}
    for name in names:
        st = states.get(name)
        if silent_for(st, now, silent_after) is not None:
            out[name] = silent_since(st)   # type: ignore[assignment]
    return out


def pauses_too_long(pauses: Mapping[str, float], now: float, longer_than: Optional[float]) -> Dict[str, float]:
    """Of ``pauses`` (:data:`RING` or an agent's name -> when it was paused),
    those older than ``longer_than`` (None: off), with their start."""
    if longer_than is None:
        return {}
    return {who: since for who, since in pauses.items() if now - since > longer_than}


@dataclass(frozen=True)
class Due:
    """What the driver does at a look: raise ``fire`` (kind, agent or
    :data:`RING`, since when), and keep ``marks`` (the new set of marks)."""
    fire: List[Tuple[str, str, float]]
    marks: Dict[str, float]
    changed: bool


def mark_key(kind: str, who: str) -> str:
    """The mark of one silence or pause: ``silent:NAME``, ``paused_too_long:`` (the ring), ..."""
    return f"{kind}:{who}"


def alerts_due(now_silent: Mapping[str, float], now_paused: Mapping[str, float],
               marks: Mapping[str, float]) -> Due:
    """One alert per silence and per pause: a silence (or pause) whose start is
    not the one marked raises its alert and is marked; a mark whose silence (or
    pause) is over is dropped, so the next one raises again."""
    fire: List[Tuple[str, str, float]] = []
    new: Dict[str, float] = {}
    for kind, current in ((SILENT, now_silent), (PAUSED_TOO_LONG, now_paused)):
        for who, since in sorted(current.items()):
            key = mark_key(kind, who)
            if marks.get(key) != since:
                fire.append((kind, who, since))
            new[key] = since
    return Due(fire, new, new != dict(marks))
