"""Pure decisions of the driver: what a run's ending means, what an agent's
state becomes after it, and whether an agent takes its turn. Plain functions
of their inputs and a clock value; no I/O.
"""
from __future__ import annotations

from typing import Any, Dict, Mapping, Optional, Tuple

from .config import RingSettings

FAILURES = ("failed", "error", "timeout", "stalled", "interrupted")
BAD_ENDINGS = ("stalled", "timeout", "interrupted")  # the agent wedged, or its run was lost


def classify(exit_code: Optional[int], signal: Optional[int], *, ended_by: Optional[str],
             termed_at_budget: bool, tempfail_exit_code: int) -> str:
    """The terminal status of a run from how it ended.

    ``ended_by``: None (the agent exited by itself), ``"stall"`` (killed at the
    stall threshold), ``"skip"`` (an operator ended it), ``"stop"`` (the driver
    is shutting down)."""
    if ended_by == "stall":
        return "stalled"
    if ended_by == "skip":
        return "skipped"
    if ended_by == "stop":
        return "interrupted"
    if termed_at_budget:
        return "timeout"
    if exit_code == 0:
        return "ok"
    if exit_code == tempfail_exit_code:
        return "deferred"
    return "failed"


def backoff_delay(consecutive_deferrals: int, initial: float, maximum: float) -> float:
    """initial, 2x, 4x ... per consecutive deferral, capped at maximum."""
    n = max(1, consecutive_deferrals)
    return min(maximum, initial * (2 ** min(n - 1, 62)))


def after_run(state: Mapping[str, Any], status: str, now: float, ring: RingSettings,
              line: Optional[str] = None) -> Dict[str, Any]:
    """The per-agent fields to store after a run ended with ``status``."""
    failures = state.get("consecutive_failures") or 0
    deferrals = state.get("consecutive_deferrals") or 0
    bad = state.get("bad_streak") or 0
    out: Dict[str, Any] = {}
    if status == "ok":
        out.update(consecutive_failures=0, consecutive_deferrals=0, backoff_until=None, bad_streak=0)
    elif status == "deferred":
        deferrals += 1
        out.update(consecutive_deferrals=deferrals, bad_streak=0,
                   backoff_until=now + backoff_delay(deferrals, ring.backoff_initial, ring.backoff_max))
    elif status in FAILURES:
        out["consecutive_failures"] = failures + 1
        out["bad_streak"] = bad + 1 if status in BAD_ENDINGS else 0
    out["skip_requested"] = 0  # a pending skip is used up by the run that just ended
    if status in BAD_ENDINGS and ring.quarantine_after and out.get("bad_streak", 0) >= ring.quarantine_after:
        out["quarantined_until"] = now + ring.quarantine_cooloff
        out["quarantine_line"] = line
    elif status in ("ok", "failed", "error", "deferred") and state.get("quarantined_until") is not None:
        out["quarantined_until"] = None  # a probation run that did not wedge ends the quarantine
        out["quarantine_line"] = None
    return out


def turn_decision(state: Mapping[str, Any], now: float, line: Optional[str] = None
                  ) -> Tuple[str, Optional[str]]:
    """Does an agent take its turn? -> (``run`` | ``skip`` | ``pass``, reason).

    ``skip``: record a skipped row (operator asked). ``pass``: silently go on to
    the next agent (backing off after a deferral, or quarantined)."""
    if state.get("skip_requested"):
        return "skip", "operator requested skip"
    q_until = state.get("quarantined_until")
    if q_until is not None:
        if line is not None and state.get("quarantine_line") not in (None, line):
            return "run", "roster line changed; quarantine lifted"
        if now < q_until:
            return "pass", "quarantined"
        return "run", "probation run after quarantine cool-off"
    backoff = state.get("backoff_until")
    if backoff is not None and now < backoff:
        return "pass", "backing off"
    return "run", None
