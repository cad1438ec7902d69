"""``<state>/metrics.prom``: the ring in Prometheus text exposition format, for
node_exporter's textfile collector. ``render`` is pure (a snapshot in, text
out); ``write_metrics`` takes the snapshot from the journal and state files and
writes it atomically.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from ringd.core.settings import RingSettings
from ringd.core.policy import seen_at
from ringd.core.quota import Gate, Pool
from ringd.core.silence import silent_agents

METRICS_FILE = "metrics.prom"


@dataclass
class Snapshot:
    now: float
    run_counts: Dict[str, Dict[str, int]] = field(default_factory=dict)   # agent -> status -> n
    last_runs: Dict[str, Tuple[Optional[float], Optional[float]]] = field(default_factory=dict)  # agent -> (duration, ended_at)
    current: Optional[Tuple[str, float]] = None          # (agent, elapsed seconds)
    heartbeat_at: Optional[float] = None
    driver_started_at: Optional[float] = None
    laps: int = 0
    quarantined: List[str] = field(default_factory=list)
    deferred: List[str] = field(default_factory=list)
    silent: List[str] = field(default_factory=list)     # roster agents with no ok run for alerts.silent_after
    consecutive_failures: Dict[str, int] = field(default_factory=dict)
    roster_agents: int = 0
    roster_error: bool = False
    watcher_restarts: Optional[int] = None
    watcher_gave_up: Optional[bool] = None
    role: str = "leader"                                 # leader | standby (a many-host ring)
    quotas: List[Tuple[str, int, int, int]] = field(default_factory=list)   # (pool, used, limit, left)
    quota_spent: Dict[Tuple[str, str], int] = field(default_factory=dict)   # (pool, agent) -> units


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _num(v: float) -> str:
    return repr(float(v)) if isinstance(v, float) else str(v)


def render(s: Snapshot) -> str:
    out: List[str] = []

    def metric(name: str, kind: str, help_: str, samples) -> None:
        out.append(f"# HELP {name} {help_}")
        out.append(f"# TYPE {name} {kind}")
        for labels, value in samples:
            lab = ",".join(f'{k}="{_label(str(v))}"' for k, v in labels.items())
            out.append(f"{name}{{{lab}}} {_num(value)}" if lab else f"{name} {_num(value)}")

    metric("ring_runs_total", "counter", "Finished runs by agent and terminal status.",
           [({"agent": a, "status": st}, n) for a in sorted(s.run_counts)
            for st, n in sorted(s.run_counts[a].items())])
    metric("ring_last_run_duration_seconds", "gauge", "Duration of the agent's last finished run.",
           [({"agent": a}, d) for a, (d, _) in sorted(s.last_runs.items()) if d is not None])
    metric("ring_last_run_end_timestamp_seconds", "gauge", "When the agent's last run ended (epoch).",
           [({"agent": a}, e) for a, (_, e) in sorted(s.last_runs.items()) if e is not None])
    metric("ring_current_run_elapsed_seconds", "gauge", "Elapsed time of the run in flight (0 when none).",
           [({"agent": s.current[0]}, round(s.current[1], 3))] if s.current else [({}, 0)])
    metric("ring_agent_consecutive_failures", "gauge", "Runs in a row that did not succeed.",
           [({"agent": a}, n) for a, n in sorted(s.consecutive_failures.items())])
    if s.heartbeat_at is not None:
        metric("ring_driver_heartbeat_timestamp_seconds", "gauge", "The driver's last heartbeat (epoch).",
               [({}, s.heartbeat_at)])
    if s.driver_started_at is not None:
        metric("ring_driver_start_timestamp_seconds", "gauge", "When the driver started (epoch).",
               [({}, s.driver_started_at)])
    metric("ring_driver_role", "gauge", "1 for this driver's role: leader runs agents, standby waits.",
           [({"role": r}, int(r == s.role)) for r in ("leader", "standby")])
    metric("ring_laps_total", "counter", "Laps of the ring finished before the current one, counted in the "
           "journal across driver restarts.", [({}, s.laps)])
    metric("ring_roster_agents", "gauge", "Agents on the roster in use.", [({}, s.roster_agents)])
    metric("ring_roster_error", "gauge", "1 while the roster file has an error (last good roster in use).",
           [({}, int(s.roster_error))])
    metric("ring_quarantined_agents", "gauge", "Agents in quarantine.", [({}, len(s.quarantined))])
    metric("ring_agent_quarantined", "gauge", "1 if the agent is quarantined.",
           [({"agent": a}, 1) for a in sorted(s.quarantined)])
    metric("ring_deferred_agents", "gauge", "Agents backing off after a deferral.", [({}, len(s.deferred))])
    metric("ring_agent_deferred", "gauge", "1 if the agent is backing off after a deferral.",
           [({"agent": a}, 1) for a in sorted(s.deferred)])
    metric("ring_agents_silent", "gauge", "Agents with no ok run for alerts.silent_after (0 when it is off).",
           [({}, len(s.silent))])
    metric("ring_agent_silent", "gauge", "1 if the agent has had no ok run for alerts.silent_after.",
           [({"agent": a}, 1) for a in sorted(s.silent)])
    if s.quotas:
        metric("ring_quota_used", "gauge", "Units of the quota pool used in its window.",
               [({"quota": q}, used) for q, used, _, _ in s.quotas])
        metric("ring_quota_limit", "gauge", "Units the quota pool allows per window.",
               [({"quota": q}, limit) for q, _, limit, _ in s.quotas])
        metric("ring_quota_left", "gauge", "Units an agent with no reserve may spend of the pool now.",
               [({"quota": q}, left) for q, _, _, left in s.quotas])
        metric("ring_quota_spent_total", "counter", "Units spent of the quota pool, by agent.",
               [({"quota": q, "agent": a}, n) for (q, a), n in sorted(s.quota_spent.items())])
    if s.watcher_restarts is not None:
        metric("ring_watcher_restarts", "gauge", "Driver restarts by ringwatch within its start-limit window.",
               [({}, s.watcher_restarts)])
        metric("ring_watcher_gave_up", "gauge", "1 if ringwatch gave up restarting the driver.",
               [({}, int(bool(s.watcher_gave_up)))])
    out.append(f"# ring metrics written {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime(s.now))}")
    return "\n".join(out) + "\n"


def snapshot(journal, *, now: Optional[float] = None, current: Optional[Tuple[str, float]] = None,
             heartbeat_at: Optional[float] = None, driver_started_at: Optional[float] = None,
             laps: int = 0, roster: Sequence[Tuple[str, Optional[str]]] = (), roster_error: bool = False,
             state_dir: Optional[Path] = None, role: str = "leader", ring: RingSettings,
             quotas: Optional[Mapping[str, Pool]] = None, due: Optional[Mapping[str, float]] = None,
             silent_after: Optional[float] = None
             ) -> Snapshot:
    """Read what the metrics need from the journal (a few small, indexed queries).
    ``roster``: (name, line) of each agent on the roster in use. The counters
    keep every agent the journal knows (a counter never goes back); the
    per-agent gauges (last run, quarantined, backing off, failures in a row) are
    the roster's agents' only, as in ``ringd status``: an agent renamed or
    removed is no longer held (and ``ringd resume`` could not lift it: unknown
    name), nor late forever; one whose line changed is held no more.
    ``quotas``: the config's pools (``due``: the scheduled agents' next due
    times, whose reserves they hold)."""
    now = time.time() if now is None else now
    s = Snapshot(now=now, run_counts=journal.run_counts(), current=current, heartbeat_at=heartbeat_at,
                 driver_started_at=driver_started_at, laps=laps, roster_agents=len(roster),
                 roster_error=roster_error, role=role)
    on_roster = dict(roster)
    for name, r in journal.last_runs().items():
        if name in on_roster:
            s.last_runs[name] = (r.duration, r.ended_at)
    states = journal.agent_states()
    s.silent = sorted(silent_agents(states, on_roster, now, silent_after))
    for name, st in states.items():
        if name not in on_roster:
            continue
        st = seen_at(st, now, ring, on_roster[name])   # (a hold begun under another line is over)
        s.consecutive_failures[name] = st.consecutive_failures
        if st.quarantined_until is not None and st.quarantined_until > now:
            s.quarantined.append(name)
        elif st.backoff_until is not None and st.backoff_until > now:
            s.deferred.append(name)
    if quotas and journal.knows_quotas():
        add_quotas(s, journal, quotas, due or {}, now)
    if state_dir is not None:
        from ringd.host.heartbeat import WATCHER_FILE, read_own, watcher_gave_up
        w = read_own(state_dir / WATCHER_FILE, state_dir)   # (never another ring's copy)
        gave_up = watcher_gave_up(state_dir, w)   # (the marker file too: a full disk's give-up)
        if w is not None or gave_up:
            restarts = (w or {}).get("restarts")
            s.watcher_restarts = len(restarts) if isinstance(restarts, list) else 0
            s.watcher_gave_up = gave_up
    return s


def add_quotas(s: Snapshot, journal, quotas: Mapping[str, Pool], due: Mapping[str, float], now: float) -> None:
    """The pools' gauges and spent counters (SPEC "Agents on a shared quota")."""
    uses, exhausted = journal.quota_use({name: p.window for name, p in quotas.items()}, now)
    paused = journal.controls().paused if any(p.reserve for p in quotas.values()) else frozenset()
    gate = Gate(quotas, lambda agent: None, uses, now, exhausted=exhausted, due=due, paused=paused)
    for name, pool in quotas.items():
        st = gate.standing(name)
        s.quotas.append((name, st.used, pool.limit, st.left_for(None)))
    s.quota_spent = journal.quota_spent()


def refresh_without_driver(state_dir: Path, config, journal) -> bool:
    """Rewrite metrics.prom after a run was closed by someone other than a live
    driver (``ringd status`` reaping a dead driver's run, ``ringd force-fail``):
    a live driver rewrites it at its next beat, but with none the file kept the
    dead driver's last word - a run in flight, counters one short of status's
    ``runs`` - until a driver started again. The driver's own values (its last
    beat, start, lap, role) are taken from its heartbeat, never made up. Only
    for a state dir's own SQLite journal (a many-host ring's drivers each write
    their own). Never raises; True if written."""
    from ringd.host.heartbeat import live_writer, read_heartbeat
    from ringd.core.timefmt import parse_iso
    from ringd.inputs.roster import roster_view
    if config.ring.journal:
        return False
    try:
        hb = read_heartbeat(state_dir) or {}
        if live_writer(hb, even_stopped=True):
            return False   # its driver lives: it rewrites the file at its next beat
        _, roster, roster_error = roster_view(config, state_dir)
        if roster is None:   # a broken roster: the agents the journal knows stand in for it
            roster = [(name, None) for name in journal.agent_states()]
        lap = hb.get("lap")
        at = hb.get("at_epoch")
        snap = snapshot(journal, heartbeat_at=at if isinstance(at, (int, float)) else None,
                        driver_started_at=parse_iso(hb.get("started_at")),
                        laps=max(0, lap - 1) if isinstance(lap, int) else 0, roster=roster,
                        roster_error=roster_error is not None, state_dir=state_dir,
                        role=hb.get("role") if hb.get("role") in ("leader", "standby") else "leader",
                        ring=config.ring, quotas=config.quotas, due=_next_due(config, journal, time.time()),
                        silent_after=config.alerts.silent_after)
        write_metrics(state_dir, render(snap))
        return True
    except Exception:   # noqa: BLE001 - the command's own work is done; metrics are best effort
        return False


def _next_due(config, journal, now: float) -> Dict[str, float]:
    """Next due times of the scheduled agents a reserve is kept for (read-only)."""
    names = {agent for pool in config.quotas.values() for agent in pool.reserve}
    if not names:
        return {}
    from ringd.inputs import schedule
    zone, out = schedule.local_zone(), {}
    with journal.snapshot() as tx:
        for name in sorted(names):
            sched = config.schedule_for(name)
            if sched is not None:
                out[name] = schedule.entry(tx, name, sched, now, write=False).next_due(zone)
    return out


def write_metrics(state_dir: Path, text: str) -> None:
    """Atomic write (temp, rename) so the collector never reads half a file; no
    fsync, as it is rewritten at every beat (see ringd.heartbeat)."""
    from ringd.host.atomicfile import write_text_atomic
    write_text_atomic(state_dir / METRICS_FILE, text, durable=False)
