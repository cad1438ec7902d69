"""What the operator reads: ``ringd status`` and ``ringd history`` as plain dicts
in the SPEC's JSON shapes.

``build_status`` is pure (files already read, liveness already judged, a clock
passed in); ``gather_status`` does the I/O around it. Reading never creates
anything and changes nothing: the state dir must exist and the journal is
opened read-only (the commands reap first: :mod:`ringd.cli.reap`). Reads are one short transaction each, so the CLI never
blocks the driver (WAL: readers and the writer do not wait for each other).

Rich is never imported here (``status --json`` must stay fast).
"""
from __future__ import annotations

import os
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from ringd.inputs.config import Config, RingSettings, excerpt
from ringd.core.errors import EX_BAD_USAGE, EX_FAILURE
from ringd.core.errors import STATUS_DEAD as EXIT_DEAD_OR_STALE
from ringd.core.errors import STATUS_OK as EXIT_HEALTHY
from ringd.core.errors import STATUS_STOPPED as EXIT_STOPPED
from ringd.core.errors import STATUS_UNKNOWN as EXIT_UNKNOWN
from ringd.core.errors import RingError as OperatorError
from ringd.core.timefmt import epoch as _epoch
from ringd.host.heartbeat import (WATCHER_FILE, iso, live_writer, read_heartbeat, read_own, ring_uid, watcher_alive,
                                  watcher_gave_up)
from ringd.cli.found import driver_facts, with_pace
from ringd.core.health import heartbeat_age, heartbeat_health
from ringd.core.records import EventRow
from ringd.journal.sqlite import Journal, JournalError, RunRow, journal_path, no_schema_yet
from ringd.host.lock import LOCK_FILE, holder_pid
from ringd.host.notify import read_notes
from ringd.core.policy import seen_at
from ringd.inputs import schedule
from ringd.inputs.roster import roster_view

MAX_KNOWN_NAMES_CHARS = 600


# --- opening things without creating them -----------------------------------

def require_state_dir(state_dir: Path, code: int = EX_FAILURE) -> None:
    """The state dir must exist already: reading commands never create it."""
    try:
        st = os.stat(state_dir)
    except FileNotFoundError:
        raise OperatorError(f"{state_dir}: no such state directory (give --state DIR or set RING_STATE)",
                            code) from None
    except OSError as e:
        raise OperatorError(f"{state_dir}: cannot read state directory: {e.strerror}", code) from None
    if not stat.S_ISDIR(st.st_mode):
        raise OperatorError(f"{state_dir}: state directory is not a directory", code)


def open_reader(state_dir: Path, config: Optional[Config] = None) -> Optional[Journal]:
    """The journal read-only, or None when there is none yet (the ring never ran).
    A many-host ring's journal is the PostgreSQL database its config names."""
    if config is not None and config.ring.journal:
        from ringd.journal.pg import PgJournal
        return PgJournal.connect(config.ring.journal, readonly=True, ttl=config.ring.lease_ttl)
    path = journal_path(state_dir)
    if not (path.exists() or path.is_symlink()):
        return None
    if path.is_symlink():
        raise JournalError(f"{path}: journal is a symbolic link; refusing to follow it")
    try:
        return Journal.open_readonly(state_dir)
    except JournalError:
        if no_schema_yet(path):
            return None
        raise


# --- the roster as status sees it ---------------------------------------------

def known_names(config: Config, state_dir: Path, reader: Optional[Journal] = None,
                include_journal: bool = False) -> List[str]:
    """Agent names an operator may name: the current roster's (and, for reading
    commands, any agent the journal knows). A broken roster falls back to the journal."""
    _, agents, _ = roster_view(config, state_dir)
    names = [n for n, _ in agents] if agents is not None else []
    if (include_journal or agents is None) and reader is not None:
        for n in reader.agent_names():
            if n not in names:
                names.append(n)
    return names


def unknown_agent(name: str, known: Sequence[str]) -> OperatorError:
    """Exit 2 with the list of known names (cut short, never a 100 kB line)."""
    listed = ""
    shown = 0
    for n in known:
        piece = (", " if listed else "") + n
        if len(listed) + len(piece) > MAX_KNOWN_NAMES_CHARS:
            break
        listed += piece
        shown += 1
    if shown < len(known):
        listed += f", ... ({len(known) - shown} more)"
    return OperatorError(f"unknown agent {excerpt(name)}; known agents: {listed or '(none)'}", EX_BAD_USAGE)


# --- status -------------------------------------------------------------------

def _round(value: Optional[float], digits: int = 3) -> Optional[float]:
    return None if value is None else round(value, digits)


def _count(value: Any) -> Optional[int]:
    """A count read from a file agents can write: a non-negative int, else None."""
    return value if type(value) is int and value >= 0 else None


def _future(ts: Optional[float], now: float) -> Optional[str]:
    """ISO time of ``ts`` if it is still ahead, else None (a passed back-off is over)."""
    return iso(ts) if ts is not None and ts > now else None


@dataclass(frozen=True)
class StatusInputs:
    """Everything ``build_status`` looks at, read beforehand (:func:`gather_status`).

    ``lock_holder``: the pid holding the driver's lock, looked up when no
    heartbeat could be read (a driver alive but unable to beat is ``stale``).
    ``notes``: what the current run's agent said (``phase``, ``agent_beat_at``,
    ringd.host.notify.read_notes). ``next_due``: scheduled agents' next due times.
    ``gave_up``: did the watcher give up (in ringwatch.json, or in the marker
    file a full disk left instead). ``agent_rows``: per agent name, the
    ``agents`` table row plus ``last_*`` keys of its last finished run.
    ``roster``: the current roster's names, or None if it does not parse (then
    the agents the journal knows, by last position). ``roster_lines`` (name,
    line) and ``last_run`` (the journal's newest row) give the next turn;
    ``journal_lap`` is the lap the driver recorded in the journal. ``turn_from``:
    the run the ring resumes after when that is not the newest (a scheduled
    agent's run is not a turn). ``ran_scheduled``: the driver's round, kept in
    the journal. ``quota_use``: each pool's use in its window and its exhausted
    reports, as the journal holds them."""
    state_dir: Path
    config: Config
    now: float
    heartbeat: Optional[Mapping[str, Any]]
    driver_alive: bool
    watcher: Optional[Mapping[str, Any]]
    watcher_is_alive: bool
    running: Optional[RunRow]
    agent_rows: Mapping[str, Mapping[str, Any]]
    roster_path: Path
    roster: Optional[Sequence[str]]
    roster_error: Optional[str]
    lock_holder: Optional[int] = None
    gave_up: bool = False
    roster_lines: Optional[Sequence[Tuple[str, str]]] = None
    last_run: Optional[RunRow] = None
    journal_lap: Optional[int] = None
    states: Optional[Mapping[str, Any]] = None
    ring_paused: bool = False
    paused_agents: Sequence[str] = ()
    next_requested: Optional[str] = None
    notes: Optional[Mapping[str, Any]] = None
    next_due: Optional[Mapping[str, float]] = None
    turn_from: Optional[RunRow] = None
    ran_scheduled: Sequence[str] = ()
    quota_use: Optional[Tuple[Mapping[str, Any], Mapping[str, Any]]] = None


def build_status(inp: StatusInputs) -> Dict[str, Any]:
    """Pure: the ``ringd status --json`` document."""
    gate = quota_gate(inp.config, inp.now, inp.quota_use, inp.next_due, inp.paused_agents)
    names = _agent_names(inp)
    return {
        "state_dir": str(inp.state_dir),
        "driver": _driver_doc(inp),
        "watcher": _watcher_doc(inp),
        "current": _current_doc(inp),
        "roster": {"path": str(inp.roster_path), "agents": len(names), "error": inp.roster_error},
        "agents": [_agent_doc(inp, gate, position, name) for position, name in enumerate(names)],
        "quotas": quota_docs(inp.config, gate),
        # addition: who takes the next turn, and when (estimated from the journal)
        "next": _next_doc(inp, gate),
    }


def _driver_doc(inp: StatusInputs) -> Dict[str, Any]:
    hb = dict(inp.heartbeat) if inp.heartbeat else None
    health = heartbeat_health(hb, inp.driver_alive, inp.now, inp.config.ring.heartbeat_interval,
                              locked=inp.lock_holder is not None)
    age = heartbeat_age(hb, inp.now)
    return {
        "pid": hb.get("pid") if hb and inp.driver_alive else (None if hb else inp.lock_holder),
        "health": health,
        "heartbeat_age": _round(age) if hb else None,
        "started_at": iso(_epoch(hb.get("started_at"))) if hb else None,
        "lap": inp.journal_lap if inp.journal_lap is not None else (hb.get("lap") if hb else None),
        "paused": bool(inp.ring_paused),
        "containment": hb.get("containment") if hb else None,   # "cgroup" | "subreaper"
        # additions to the SPEC shape
        "heartbeat_at": iso(_epoch(hb.get("at_epoch")) or _epoch(hb.get("at"))) if hb else None,
        "last_pid": hb.get("pid") if hb else None,
        "notify_dropped": _count(hb.get("notify_dropped")) if hb else None,   # in the driver's life
    }


def _watcher_doc(inp: StatusInputs) -> Dict[str, Any]:
    w = dict(inp.watcher) if inp.watcher else None
    window = inp.config.watch.start_limit_interval
    restarts = 0
    if w and isinstance(w.get("restarts"), list):
        for item in w["restarts"]:
            t = _epoch(item)
            if t is None or t >= inp.now - window:
                restarts += 1
    return {
        "pid": w.get("pid") if w and inp.watcher_is_alive else None,
        "alive": bool(inp.watcher_is_alive),
        "last_poll_at": iso(_epoch(w.get("last_poll_at"))) if w else None,
        "restarts": restarts,
        "gave_up": bool(inp.gave_up),
    }


def _current_doc(inp: StatusInputs) -> Optional[Dict[str, Any]]:
    running, now, notes = inp.running, inp.now, inp.notes or {}
    if running is None:
        return None
    # (a start no clock can show, written by hand, is None: elapsed unknown)
    elapsed = max(0.0, now - running.started_at) if running.started_at is not None else None
    budget = running.run_budget
    beat_at = notes.get("agent_beat_at")
    return {
        "agent": running.agent, "run_id": running.id, "pid": running.pid,
        "elapsed": _round(elapsed), "run_budget": budget,
        "stall_threshold": running.stall_threshold,
        "phase": notes.get("phase"),
        "agent_beat_age": _round(max(0.0, now - beat_at)) if beat_at is not None else None,
        # additions
        "started_at": iso(running.started_at),
        "budget_left": round(max(0.0, budget - elapsed), 3) if None not in (budget, elapsed) else None,
        "notify_dropped": notes.get("dropped"),   # datagrams of this run's socket not heard
        # held (quarantined, backing off, paused) yet running: `ringd next` started it
        "out_of_turn": _held_now(inp.agent_rows.get(running.agent) or {}, now, running.agent in inp.paused_agents),
    }


def _held_now(row: Mapping[str, Any], now: float, paused: bool) -> bool:
    """Is an agent held back at ``now`` (paused, quarantined, backing off)? A run
    of one that is can only have been started by ``ringd next``: a changed line
    lifts a hold as its run starts, a probation run comes once the hold is over."""
    return paused or any(_future(row.get(k), now) is not None for k in ("quarantined_until", "backoff_until"))


def _agent_names(inp: StatusInputs) -> List[str]:
    if inp.roster is not None:
        return list(inp.roster)
    # the last good roster is the driver's; the journal knows where agents ran
    known = sorted(inp.agent_rows.items(), key=lambda kv: (
        kv[1].get("last_position") if kv[1].get("last_position") is not None else 1 << 30, kv[0]))
    return [n for n, _ in known]


def _agent_doc(inp: StatusInputs, gate, position: int, name: str) -> Dict[str, Any]:
    now, running = inp.now, inp.running
    a = inp.agent_rows.get(name) or {}
    last = a
    if running is not None and running.agent == name:
        last = {"last_status": "running", "last_started_at": running.started_at,
                "last_ended_at": None, "last_duration": None, "last_exit_code": None,
                "last_signal": None}
    quiet = _silent_for(inp, name)
    return {
        "name": name,
        "position": position,
        "last_status": last.get("last_status"),
        "last_started_at": iso(last.get("last_started_at")),
        "last_duration": _round(last.get("last_duration")),
        "last_exit_code": last.get("last_exit_code"),
        "runs": int(a.get("runs") or 0),
        "consecutive_failures": int(a.get("consecutive_failures") or 0),
        "backoff_until": _future(a.get("backoff_until"), now),
        "skip_requested": bool(a.get("skip_requested")),
        "quarantined_until": _future(a.get("quarantined_until"), now),
        "paused": name in inp.paused_agents,
        "next_due": iso((inp.next_due or {}).get(name)),
        **agent_quota(inp.config, gate, name),
        # additions
        "last_ended_at": iso(last.get("last_ended_at")),
        "last_signal": last.get("last_signal"),
        "last_ok_at": iso(a.get("last_ok_at")),
        "silent": quiet is not None,   # no ok run for alerts.silent_after (ringd.core.silence)
        "silent_for": _round(quiet),
    }


def _silent_for(inp: StatusInputs, name: str) -> Optional[float]:
    """How long ``name`` has been silent (alerts.silent_after; None: not silent, or off)."""
    if inp.config.alerts.silent_after is None:
        return None
    from ringd.core.silence import silent_for
    return silent_for((inp.states or {}).get(name), inp.now, inp.config.alerts.silent_after)


def _next_doc(inp: StatusInputs, gate) -> Optional[Dict[str, Any]]:
    if not inp.roster_lines or inp.ring_paused:
        return None
    turn = next_turn(inp.roster_lines, inp.states or {}, inp.turn_from or inp.running or inp.last_run,
                     inp.now, inp.config, paused=inp.paused_agents, requested=inp.next_requested,
                     next_due=inp.next_due, ran_scheduled=inp.ran_scheduled if inp.driver_alive else (),
                     gate=gate)
    if turn is None:
        return None
    name, at = turn
    current = inp.running is not None
    return {"agent": name,
            "at": None if current else iso(at),
            "in": None if current else round(max(0.0, at - inp.now), 3),
            "after_current_run": current}


def quota_gate(config: Config, now: float, quota_use, next_due: Optional[Mapping[str, float]],
               paused: Sequence[str]):
    """Pure: the pools as the driver's turn would see them now (None: no pools)."""
    if not config.quotas:
        return None
    from ringd.core.quota import Gate
    uses, exhausted = quota_use or ({}, {})
    return Gate(config.quotas, config.quota_for, uses, now, exhausted=exhausted, due=next_due or {},
                paused=frozenset(paused))


def agent_quota(config: Config, gate, name: str) -> Dict[str, Any]:
    """``quota`` of an agent in ``status --json`` (its pool, or None), and as
    additions its ``RING_QUOTA_LEFT`` now and what holds it (None: nothing)."""
    pool = config.quota_for(name)
    if gate is None or pool not in config.quotas:
        return {"quota": None}
    hold = gate.hold(name)
    return {"quota": pool, "quota_left": gate.standing(pool).left_for(name),
            "quota_held": hold.reason if hold is not None else None}


def agent_pool(doc: Mapping[str, Any], row: Mapping[str, Any]) -> Optional[Dict[str, Any]]:
    """``quota`` of ``status NAME --json``: the agent's pool as ``quotas`` of the
    status shows it, with what the agent itself may spend (``left_for_agent``:
    its RING_QUOTA_LEFT, its own reserve included) and why it waits (``held``)."""
    pool = next((p for p in doc.get("quotas") or () if p["name"] == row.get("quota")), None)
    if pool is None:
        return None
    return dict(pool, left_for_agent=row.get("quota_left"), held=row.get("quota_held"))


def quota_docs(config: Config, gate) -> List[Dict[str, Any]]:
    """``quotas`` of ``status --json``: one entry per pool of the config."""
    out = []
    for name, pool in (config.quotas.items() if gate is not None else ()):
        st = gate.standing(name)
        out.append({"name": name, "limit": pool.limit, "window": pool.window, "used": st.used,
                    "reserved": st.reserved_total, "left": st.left_for(None),
                    "exhausted_until": iso(st.exhausted_until), "reset_at": iso(st.reset_at),
                    # addition: the reserves held now, by agent
                    "reserves": dict(st.reserved)})
    return out


def next_turn(roster: Sequence[Tuple[str, str]], states: Mapping[str, Any],
              last: Optional[RunRow], now: float, config: Config, paused: Sequence[str] = (),
              requested: Optional[str] = None,
              next_due: Optional[Mapping[str, float]] = None,
              ran_scheduled: Sequence[str] = (), gate=None) -> Optional[Tuple[str, float]]:
    """Pure: (the agent that takes the next turn, when it starts), as the driver
    chooses it - ``policy.plan_turn``, the driver's own rule (``states``: name ->
    AgentState; ``next_due``: scheduled agents' next due times): an operator's
    ``ringd next`` first, then a due scheduled agent not run in the driver's
    round (``ran_scheduled``), else after ``last`` by name, passing over paused
    agents, scheduled ones and those that back off or are quarantined. When
    nothing is due, whoever the driver picks once the first wait ends. A turn
    after a full lap waits ``lap_pause`` after the last run ended."""
    import math
    from dataclasses import replace
    from ringd.core.policy import TurnInputs, plan_turn, round_after
    from ringd.inputs.roster import next_index
    names = [n for n, _ in roster]
    if not names:
        return None
    start = next_index(names, last.agent if last else None, last.position if last else None)
    inputs = TurnInputs(roster, start, states, now, paused=frozenset(paused), requested=requested,
                        scheduled=dict(next_due or {}), ran_scheduled=frozenset(ran_scheduled), quota=gate)
    plan, at = plan_turn(inputs), now
    if plan.again:   # the driver ends its round first, then chooses again
        plan = plan_turn(replace(inputs, ran_scheduled=round_after(inputs.ran_scheduled, plan, names)))
    if plan.index is None:
        if plan.until is None or not math.isfinite(plan.until):
            return None   # every agent paused, or waiting for nothing that comes by itself
        at = max(now, plan.until)
        plan = plan_turn(replace(inputs, now=at, ran_scheduled=round_after(inputs.ran_scheduled, plan, names),
                                 quota=gate.at(at) if gate is not None else None))
        if plan.index is None:
            return None
    last_index = names.index(last.agent) if last is not None and last.agent in names else None
    wraps = not plan.forced and not plan.scheduled and last_index is not None and plan.index <= last_index
    if wraps and config.ring.lap_pause > 0 and last is not None and last.ended_at is not None:
        at = max(at, last.ended_at + config.ring.lap_pause)
    return names[plan.index], at


def status_exit_code(doc: Mapping[str, Any], strict: bool = False) -> int:
    """LSB: 0 healthy, 1 dead or stale, 3 stopped; ``strict``: 1 when healthy with problems."""
    health = doc["driver"]["health"]
    if health == "ok":
        return EX_FAILURE if strict and doc.get("problems") else EXIT_HEALTHY
    if health in ("dead", "stale"):
        return EXIT_DEAD_OR_STALE
    return EXIT_STOPPED


def read_journal_view(reader: Journal, now: float, ring: RingSettings,
                      lines: Optional[Mapping[str, str]] = None, quotas: Optional[Mapping[str, Any]] = None
                      ) -> Dict[str, Any]:
    """In one snapshot: the running row, per-agent rows (each agent's state as it
    stands at ``now``, as the driver sees it, plus ``last_*`` keys of its last
    finished run), the agents' states, the newest row and the driver's notes
    (roster error, lap). Cost is independent of the journal's size (primary-key
    and index lookups only). ``lines``: the roster's line of each agent (a hold
    begun under another line is over: :func:`ringd.core.policy.seen_at`).
    ``quotas``: the config's pools, whose use in their windows is read too."""
    lines = lines or {}
    with reader.snapshot() as tx:
        running, states, last = tx.running_row(), tx.agents(), reader.last_runs()
        newest, roster_error, lap = tx.last_run(), tx.meta("roster_error"), tx.meta("lap")
        controls = tx.controls()   # read as the driver reads them, in the same snapshot
        ran_scheduled = schedule.read_round(tx)
        quota_use = (tx.quota_use({n: p.window for n, p in quotas.items()}, now)
                     if quotas and reader.knows_quotas() else None)
    ring_paused, paused_agents, next_requested = controls.ring_paused, sorted(controls.paused), controls.next
    states = {name: seen_at(st, now, ring, lines.get(name)) for name, st in states.items()}
    agents: Dict[str, Dict[str, Any]] = {}
    for name, st in states.items():
        row = dict(vars(st))   # (its fields are plain values: asdict's deep copy was a tenth of a status)
        r = last.get(name)
        if r is not None:
            row.update(last_status=r.status, last_started_at=r.started_at, last_ended_at=r.ended_at,
                       last_duration=r.duration, last_exit_code=r.exit_code, last_signal=r.signal,
                       last_position=r.position)
        agents[name] = row
    return {"running": running, "last_run": newest, "agent_rows": agents, "states": states,
            "roster_error": roster_error, "ring_paused": ring_paused, "paused_agents": paused_agents,
            "next_requested": next_requested, "ran_scheduled": sorted(ran_scheduled), "quota_use": quota_use,
            "lap": int(lap) if lap is not None and lap.isascii() and lap.isdigit() else None}


def gather_status(state_dir: Path, config: Config, now: Optional[float] = None,
                  warnings: Optional[List[str]] = None, location: Any = None) -> Dict[str, Any]:
    """Read everything and build the status document (the command reaps first)."""
    require_state_dir(state_dir, EXIT_UNKNOWN)
    warnings = warnings if warnings is not None else []
    view: Dict[str, Any] = {"running": None, "last_run": None, "agent_rows": {}, "states": {}, "lap": None,
                            "ring_paused": False, "paused_agents": [], "next_requested": None,
                            "ran_scheduled": [], "quota_use": None}
    lease = None
    next_due: Dict[str, float] = {}
    turn_from: Optional[RunRow] = None   # the run the ring resumes after (schedule.last_turn)
    roster_path, roster, roster_error = roster_view(config, state_dir)
    try:
        reader = open_reader(state_dir, config)
        if reader is None:
            next_due = scheduled_next_due(None, config, state_dir, now)
        else:
            try:
                view = read_journal_view(reader, time.time() if now is None else now, config.ring,
                                         dict(roster) if roster is not None else None, config.quotas)
                turn_from = schedule.last_turn(reader, config, view["running"] or view["last_run"])
                if config.ring.journal:
                    lease_view = reader.read_lease()
                    lease = {"holder": lease_view.holder, "expires_at": iso(lease_view.expires_at),
                             "epoch": lease_view.epoch}
                next_due = scheduled_next_due(reader, config, state_dir, now)
            finally:
                reader.close()
    except JournalError as e:
        if not config.ring.journal:
            raise OperatorError(str(e), EXIT_UNKNOWN) from None
        # a many-host ring whose database is away: the drivers' health is still
        # known from this box's heartbeat; say why the rest is missing
        warnings.append(f"journal unreachable: {e}")
    hb = read_heartbeat(state_dir)
    watcher = read_own(state_dir / WATCHER_FILE, state_dir)
    facts = driver_facts(hb)
    alive = live_writer(hb, even_stopped=True) is not None
    running_driver = alive and not (hb or {}).get("stopped")
    problems = ring_problems(config, roster_path, roster_error, facts if running_driver else {},
                             ring_uid(state_dir))
    if roster is None or (running_driver and facts["roster_error"]):
        roster = drivers_roster(facts if running_driver else {}, roster)
    roster_error = next((p["detail"] for p in problems if p["kind"] == "roster"), None)
    # the clock read after everything else: a heartbeat read just now is never "from the future"
    now = time.time() if now is None else now
    doc = build_status(StatusInputs(
        state_dir=state_dir, config=with_pace(config, facts), now=now,
        heartbeat=hb, driver_alive=alive,
        lock_holder=None if hb else holder_pid(state_dir / LOCK_FILE),
        watcher=watcher, watcher_is_alive=watcher_alive(watcher),
        gave_up=watcher_gave_up(state_dir, watcher),
        running=view["running"], agent_rows=view["agent_rows"],
        roster_path=roster_path, roster=[n for n, _ in roster] if roster is not None else None,
        roster_error=roster_error, roster_lines=roster, last_run=view["last_run"],
        journal_lap=view["lap"], states=view["states"], ring_paused=view["ring_paused"],
        paused_agents=view["paused_agents"], next_requested=view["next_requested"],
        next_due=next_due, turn_from=turn_from, ran_scheduled=view["ran_scheduled"],
        quota_use=view["quota_use"],
        notes=read_notes(state_dir, view["running"].id) if view["running"] is not None else None,
    ))
    add_leadership(doc, hb, lease)
    doc["problems"] = problems
    doc["config"] = {"path": str(config.path) if config.path is not None else None,
                     "driver_path": facts["config"] if hb else None,
                     "driver_loaded_at": facts["config_loaded_at"] if hb else None}
    if location is not None:
        doc["state_from"], doc["config"]["from"] = location.found.state_from, location.found.config_from
        doc["config"]["searched"] = list(location.found.searched)
    return doc


def ring_problems(config: Config, roster_path: Path, roster_error: Optional[str],
                  facts: Mapping[str, Any], uid: int) -> List[Dict[str, Any]]:
    """Every problem that keeps an edit from taking effect, one per file (SPEC
    ``problems``): a config or roster that does not load for this command, or
    that the driver refuses for its mode or owner (judged for the ring's user,
    ``uid``), what the running driver (``facts``: driver_facts of a live one)
    reports it refused, and a config edited since the driver loaded it."""
    found: Dict[Tuple[str, str], str] = {}

    def add(kind: str, path: Any, detail: Optional[str]) -> None:
        if path is not None and detail:
            found.setdefault((kind, str(path)), detail)
    if config.path is not None:
        add("config", config.path, config.error or mode_problem(config.path, "config file", uid))
    add("roster", roster_path, roster_error or mode_problem(roster_path, "roster", uid))
    if facts.get("config") and facts.get("config_error"):
        add("config", facts["config"], f"the driver's last reload kept its old config: {facts['config_error']} "
                                       f"(`ringd reload` tries again)")
    if facts.get("config") and facts.get("config_signature") is not None:
        from ringd.inputs.config import file_signature
        if file_signature(Path(facts["config"])) != tuple(facts["config_signature"]):
            add("config", facts["config"], f"changed since the driver loaded it at {facts.get('config_loaded_at')}; "
                                           f"`ringd reload` applies it")
    if facts.get("roster_error"):
        add("roster", facts.get("roster_path") or roster_path, f"the driver keeps its last good roster: "
                                                                 f"{facts['roster_error']}")
    return [{"kind": kind, "path": path, "detail": detail} for (kind, path), detail in found.items()]


def mode_problem(path: Path, what: str, uid: int) -> Optional[str]:
    """Why ``ringd run`` and ``ringwatch`` would refuse the file at ``path`` for
    its mode or owner, judged for the ring's user ``uid`` (None: they would not,
    or it cannot be read: the reading itself says why)."""
    from ringd.host.safefile import others_can_change
    try:
        st = os.stat(path)
    except OSError:
        return None
    found = others_can_change(path, st, uid, "the ring's user")
    if found is None:
        return None
    return f"{path}: {what} {found[0]}; ringd run and ringwatch refuse it. Fix: {found[1]}"


def drivers_roster(facts: Mapping[str, Any], roster: Optional[List[Tuple[str, str]]]) \
        -> Optional[List[Tuple[str, Optional[str]]]]:
    """The roster the running driver runs, when the file does not load or the
    driver refuses it: its agents' names (their lines as the file has them, if
    it parses). None when no live driver says (then the journal's agents)."""
    names = facts.get("roster_agents")
    if names is None:
        return roster
    lines = dict(roster or [])
    return [(n, lines.get(n)) for n in names]


def add_leadership(doc: Dict[str, Any], hb: Optional[Mapping[str, Any]], lease: Optional[Dict[str, Any]]) -> None:
    """``driver.host``, ``driver.role`` (leader | standby) and ``lease``. A SQLite
    ring has one driver per state dir, always the leader, and no lease (null)."""
    hb = hb or {}
    doc["driver"]["host"] = hb.get("host")
    live = doc["driver"].get("health") in ("ok", "stale")
    doc["driver"]["role"] = hb.get("role", "leader") if live else None
    doc["lease"] = lease


def scheduled_next_due(reader: Optional[Journal], config: Config, state_dir: Path,
                       now: Optional[float] = None) -> Dict[str, float]:
    """Next due time of every scheduled agent on the roster (read-only), in the
    driver's time zone (its heartbeat's ``tz``; ours without one). No journal
    yet (``reader`` None): none has run, so each is due as a schedule first seen
    now (``every`` at once, a cron at its next matching minute)."""
    if not any(o.schedule is not None or o.every is not None for o in config.agents.values()):
        return {}
    _, roster, _ = roster_view(config, state_dir)
    names = [n for n, _ in roster] if roster is not None else list(config.agents)
    hb = read_heartbeat(state_dir) or {}
    zone = schedule.local_zone(hb["tz"]) if "tz" in hb else schedule.local_zone()
    now, out = time.time() if now is None else now, {}
    if reader is None:
        scheds = ((name, config.schedule_for(name)) for name in names)
        return {name: schedule.next_due(sched, None, now, zone) for name, sched in scheds if sched is not None}
    with reader.snapshot() as tx:
        for name in names:
            sched = config.schedule_for(name)
            if sched is not None:
                out[name] = schedule.entry(tx, name, sched, now, write=False).next_due(zone)
    return out


# --- history --------------------------------------------------------------------

def run_dict(row: RunRow, used: Optional[Mapping[str, int]] = None,
             actor: Optional[Mapping[str, Any]] = None) -> Dict[str, Any]:
    """One run in the SPEC's ``history --json`` shape (``used``: what it spent, by
    pool; ``actor``: who closed it - an operator's force-fail or skip, its
    closing event's - else None)."""
    return {
        "id": row.id, "agent": row.agent, "status": row.status,
        "started_at": iso(row.started_at), "ended_at": iso(row.ended_at),
        "duration": _round(row.duration), "exit_code": row.exit_code, "signal": row.signal,
        "reason": row.reason, "phase": row.phase, "cpu_seconds": row.cpu_seconds, "used": dict(used or {}),
        "actor": dict(actor) if actor else None,
    }


HISTORY_BATCH = 500


def runs_between(reader: Journal, agent: Optional[str], since: Optional[float], until: Optional[float],
                 limit: Optional[int]) -> List[RunRow]:
    """Runs that started at or after ``since`` and at or before ``until`` (epoch
    seconds; None: no bound), newest first, at most ``limit``. A row's start
    time is when it was written, so ids grow with it: read back in batches from
    the newest and stop at the first run older than ``since`` (never a scan of
    a big journal for a recent window)."""
    out: List[RunRow] = []
    below = None
    where = "" if agent is None else " AND agent = ?"
    while limit is None or len(out) < limit:
        args: List[Any] = [below if below is not None else 1 << 62] + ([] if agent is None else [agent])
        rows = reader.con.execute(f"SELECT * FROM runs WHERE id < ?{where} ORDER BY id DESC LIMIT {HISTORY_BATCH}",
                                  args).fetchall()
        for r in rows:
            row = RunRow.from_mapping(r)
            if since is not None and row.started_at is not None and row.started_at < since:
                return out
            if until is not None and row.started_at is not None and row.started_at > until:
                continue
            out.append(row)
            if limit is not None and len(out) >= limit:
                return out
        if len(rows) < HISTORY_BATCH:
            return out
        below = rows[-1]["id"]
    return out


def history_since(reader: Journal, agent: Optional[str], cutoff: float, limit: Optional[int]) -> List[RunRow]:
    """Runs that started at or after ``cutoff``, newest first (:func:`runs_between`)."""
    return runs_between(reader, agent, cutoff, None, limit)


def _check_agent(state_dir: Path, config: Config, reader: Optional[Journal], agent: Optional[str]) -> None:
    """``agent`` (if given) must be one the roster or the journal knows: else exit 2."""
    if agent is None:
        return
    known = known_names(config, state_dir, reader, include_journal=True)
    if agent not in known:
        raise unknown_agent(agent, known)


def gather_history(state_dir: Path, config: Config, agent: Optional[str], limit: Optional[int],
                   warnings: Optional[List[str]] = None, since: Optional[float] = None,
                   until: Optional[float] = None) -> List[Dict[str, Any]]:
    """Recent runs, newest first (the command reaps first): the last ``limit``
    (20 unless a window is given), or those that started between ``since`` and
    ``until`` (epoch seconds), at most ``limit`` when given. Unknown agent ->
    OperatorError(2)."""
    require_state_dir(state_dir)
    warnings = warnings if warnings is not None else []
    try:
        reader = open_reader(state_dir, config)
        _check_agent(state_dir, config, reader, agent)
        if reader is None:
            return []
        try:
            if since is None and until is None:
                rows = reader.history(agent, limit if limit is not None else 20)
            else:
                rows = runs_between(reader, agent, since, until, limit)
            actors = reader.closing_actors([r.id for r in rows if r.status in ("skipped", "interrupted")])
            used = reader.used_by_runs([r.id for r in rows]) if rows and reader.knows_quotas() else {}
        finally:
            reader.close()
    except JournalError as e:
        raise OperatorError(str(e)) from None
    return [run_dict(r, used.get(r.id), actors.get(r.id)) for r in rows]


# --- the event trail --------------------------------------------------------------

def event_dict(e: EventRow) -> Dict[str, Any]:
    """One event in ``ringd events --json``: times ISO 8601 UTC."""
    return {"id": e.id, "at": iso(e.at), "run_id": e.run_id, "agent": e.agent, "kind": e.kind,
            "source": e.source, "actor": e.actor, "reason": e.reason, "detail": e.detail}


def gather_events(state_dir: Path, config: Config, agent: Optional[str], limit: Optional[int],
                  since: Optional[float] = None, until: Optional[float] = None) -> List[Dict[str, Any]]:
    """The event trail, newest first: the last ``limit`` (50 unless a window is
    given), or those between ``since`` and ``until`` (epoch seconds). Read back
    from the newest in batches, stopping at the first older than ``since``."""
    require_state_dir(state_dir)
    if limit is None and since is None and until is None:
        limit = 50
    out: List[Dict[str, Any]] = []
    try:
        reader = open_reader(state_dir, config)
        _check_agent(state_dir, config, reader, agent)
        if reader is None:
            return []
        try:
            below = None
            while limit is None or len(out) < limit:
                batch = reader.events_before(below, agent, HISTORY_BATCH)
                for e in batch:
                    if since is not None and e.at is not None and e.at < since:
                        return out
                    if until is None or e.at is None or e.at <= until:
                        out.append(event_dict(e))
                        if limit is not None and len(out) >= limit:
                            return out
                if len(batch) < HISTORY_BATCH:
                    return out
                below = batch[-1].id
        finally:
            reader.close()
    except JournalError as e:
        raise OperatorError(str(e)) from None
    return out


# --- one agent: ``ringd status NAME`` ------------------------------------------------

AGENT_RUNS = 10   # the last runs ``status NAME`` shows


def gather_agent(state_dir: Path, config: Config, name: str, now: Optional[float] = None,
                 warnings: Optional[List[str]] = None, location: Any = None) -> Dict[str, Any]:
    """``ringd status NAME --json``: the agent's roster line and its row of the
    status (state: back-off, quarantine, pause, next due, silence), its last
    AGENT_RUNS runs, and the current run when it is NAME's (phase, agent beat).
    An agent no longer on the roster that the journal knows is shown from the
    journal (``on_roster`` false). Unknown NAME -> OperatorError(2)."""
    doc = gather_status(state_dir, config, now, warnings, location=location)
    row = next((a for a in doc["agents"] if a["name"] == name), None)
    _, roster, _ = roster_view(config, state_dir)
    try:
        reader = open_reader(state_dir, config)
    except JournalError as e:
        raise OperatorError(str(e), EXIT_UNKNOWN) from None
    try:
        if row is None:
            _check_agent(state_dir, config, reader, name)
        runs = reader.history(name, AGENT_RUNS) if reader is not None else []
        actors = reader.closing_actors([r.id for r in runs]) if reader is not None else {}
        used = reader.used_by_runs([r.id for r in runs]) if runs and reader.knows_quotas() else {}
        if row is None:   # known to the journal only
            st = reader.agent_state(name) if reader is not None else None
            row = {"name": name, "position": None, "last_status": runs[0].status if runs else None,
                   "runs": st.runs if st else 0, "consecutive_failures": st.consecutive_failures if st else 0,
                   "last_ok_at": iso(st.last_ok_at) if st else None}
    except JournalError as e:
        raise OperatorError(str(e), EXIT_UNKNOWN) from None
    finally:
        if reader is not None:
            reader.close()
    current = doc["current"] if doc["current"] and doc["current"]["agent"] == name else None
    upcoming = doc.get("next") if (doc.get("next") or {}).get("agent") == name else None
    return {
        "state_dir": doc["state_dir"],
        "driver": {"health": doc["driver"]["health"], "paused": doc["driver"]["paused"]},
        "agent": dict(row, on_roster=roster is not None and name in dict(roster),
                      line=dict(roster).get(name) if roster is not None else None),
        "quota": agent_pool(doc, row),
        "current": current,
        "next": upcoming,
        "runs": [run_dict(r, used.get(r.id), actors.get(r.id)) for r in runs],
    }
