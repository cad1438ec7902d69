"""Tables for people. The only module that imports rich, and only to colour a
table on a terminal (``status --json`` never loads it; plain output neither).

A table is built once as lines of ``(text, style)`` segments laid out in fixed
columns that fit the terminal: long cells are cut with an ellipsis, never
wrapped. Output that is not a terminal (a pipe, a file) is never cut: a script
or ``grep`` gets every reason whole. Plain output - no escape codes at all - is
those lines' text, written directly, when stdout is not a terminal or
``NO_COLOR`` is set. On a terminal rich colours the same lines (rich's own
Table lays out a 200-agent roster ~10x slower than this).
"""
from __future__ import annotations

import os
import shutil
import sys
import time
from datetime import datetime
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, TextIO, Tuple

from ringd.core.timefmt import parse_iso
from ringd.host.notify import without_controls

Seg = Tuple[str, str]          # (text, rich style; "" for none)
Line = List[Seg]

HEALTH_STYLE = {"ok": "bold green", "stale": "bold yellow", "dead": "bold red", "stopped": "dim"}
STATUS_STYLE = {
    "ok": "green", "running": "bold cyan", "failed": "red", "error": "red", "stalled": "bold red",
    "timeout": "yellow", "interrupted": "magenta", "deferred": "blue", "skipped": "dim",
}
GAP = "  "
LABEL_WIDTH = 9


# --- plain formatting ----------------------------------------------------------------

def fmt_duration(seconds: Optional[float]) -> str:
    if seconds is None:
        return "-"
    s = max(0.0, float(seconds))
    if s < 10:
        return f"{s:.1f}s"
    if s < 60:
        return f"{s:.0f}s"
    m, sec = divmod(int(s), 60)
    if m < 60:
        return f"{m}m{sec:02d}s"
    h, m = divmod(m, 60)
    if h < 48:
        return f"{h}h{m:02d}m"
    d, h = divmod(h, 24)
    return f"{d}d{h:02d}h"


def fmt_ago(iso_time: Optional[str], now: float) -> str:
    t = parse_iso(iso_time)
    if t is None:
        return "-"
    delta = now - t
    if delta < 0:
        return f"in {fmt_duration(-delta)}"
    return f"{fmt_duration(delta)} ago"


def fmt_left(iso_time: Optional[str], now: float) -> str:
    t = parse_iso(iso_time)
    return "-" if t is None else f"{fmt_duration(max(0.0, t - now))} left"


def fmt_local(iso_time: Optional[str], now: Optional[float] = None) -> str:
    """Local time: ``HH:MM:SS`` today, ``YYYY-MM-DD HH:MM:SS`` on any other day
    (the zone is said once, by :func:`zone_line`)."""
    t = parse_iso(iso_time)
    if t is None:
        return "-"
    when = datetime.fromtimestamp(t)
    today = datetime.fromtimestamp(time.time() if now is None else now).date()
    return when.strftime("%H:%M:%S" if when.date() == today else "%Y-%m-%d %H:%M:%S")


def zone_name(t: float) -> str:
    """``CET (+01:00)``: the local zone's name and offset at ``t``."""
    when = datetime.fromtimestamp(t).astimezone()
    offset = when.strftime("%z") or "+0000"
    return f"{when.tzname() or 'local'} ({offset[:3]}:{offset[3:5]})"


def zone_line(times: Sequence[Optional[str]], now: Optional[float] = None) -> Line:
    """``times in CET (+01:00)`` for a table of local times (both zones when they
    span a change of offset: ``CET (+01:00) / CEST (+02:00)``)."""
    now = time.time() if now is None else now
    zones: List[str] = []
    seen = [t for t in (parse_iso(x) for x in times) if t is not None]
    for t in ([min(seen), max(seen)] if seen else []) + [now]:   # (a table spans one change at most)
        if t is not None and (z := zone_name(t)) not in zones:
            zones.append(z)
    return [(f"times in {' / '.join(zones)}", "dim")]


def budget_bar(elapsed: float, budget: Optional[float], width: int = 20, plain: bool = False) -> str:
    if not budget:
        return ""
    frac = max(0.0, min(1.0, elapsed / budget))
    full = int(round(frac * width))
    on, off = ("#", "-") if plain else ("\u2588", "\u2591")
    return f"[{on * full}{off * (width - full)}] {frac * 100:.0f}%"


def exit_text(code: Any, sig: Any) -> str:
    if sig:
        try:
            import signal
            return signal.Signals(sig).name
        except (ValueError, TypeError):
            return f"sig {sig}"
    return "-" if code is None else str(code)


def shown(text: str) -> str:
    """Text from the journal or a state file (an agent's name, a reason, a phase,
    a roster error) as a terminal may show it: its control characters are
    spaces (:func:`ringd.host.notify.without_controls`), so no escape sequence, carriage
    return or newline written there can move the operator's cursor, retitle the
    terminal or forge a line of the table. Rich drops some (BEL, CR) but passes
    ESC; plain output (``NO_COLOR``, a pipe into ``less -R``) passed them all."""
    return without_controls(text)


# --- layout ----------------------------------------------------------------------------

UNLIMITED = 1 << 30


def output_width(stream: Optional[TextIO] = None) -> int:
    """The terminal's width; unlimited when ``stream`` is not a terminal."""
    if not _isatty(stream or sys.stdout):
        return UNLIMITED
    return max(40, shutil.get_terminal_size((80, 24)).columns)


def plain_output(stream: Optional[TextIO] = None) -> bool:
    stream = stream or sys.stdout
    if os.environ.get("NO_COLOR"):
        return True
    return not _isatty(stream)


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def cut(text: str, width: int, plain: bool) -> str:
    if len(text) <= width:
        return text
    if width <= 0:
        return ""
    mark = "..." if plain else "\u2026"
    return text[: max(0, width - len(mark))] + mark[: width]


def table(headers: Sequence[str], rows: Sequence[Sequence[Seg]], *, right: Sequence[bool],
          max_widths: Sequence[Optional[int]], width: int, plain: bool) -> List[Line]:
    """Fixed-width columns; the last column takes what is left of ``width``.
    ``max_widths`` and the cut apply only when fitting a terminal: at
    ``width`` :data:`UNLIMITED` (a pipe, a file) every cell is whole.
    A cell's control characters are spaces (:func:`shown`)."""
    n = len(headers)
    rows = [[(shown(text), style) for text, style in row] for row in rows]
    widths = [len(h) for h in headers]
    for row in rows:
        for i, (text, _) in enumerate(row):
            widths[i] = max(widths[i], len(text))
    if width < UNLIMITED:
        for i, cap in enumerate(max_widths):
            if cap is not None:
                widths[i] = min(widths[i], cap)
        used = sum(widths[:-1]) + len(GAP) * (n - 1)
        widths[-1] = max(len(headers[-1]), min(widths[-1], width - used))

    def line(cells: Sequence[Seg]) -> Line:
        out: Line = []
        for i, (text, style) in enumerate(cells):
            text = cut(text, widths[i], plain)
            pad = " " * (widths[i] - len(text))
            if i:
                out.append((GAP, ""))
            if right[i]:
                out += [(pad, ""), (text, style)]
            elif i < n - 1:
                out += [(text, style), (pad, "")]
            else:
                out.append((text, style))
        return out

    lines = [line([(h, "bold") for h in headers])]
    lines.append([("-" * min(width, sum(widths) + len(GAP) * (n - 1)), "dim")])
    lines += [line(r) for r in rows]
    return lines


def labelled(label: str, segs: Sequence[Seg], width: int) -> List[Line]:
    """``label   text...`` wrapped under itself to ``width`` (styles kept per piece).
    A segment that starts with a newline starts a line; any other control
    character is a space (:func:`shown`)."""
    lines: List[Line] = []
    cur: Line = [(label.ljust(LABEL_WIDTH), "bold")]
    room = width - LABEL_WIDTH
    used = 0
    for text, style in segs:
        if text.startswith("\n"):
            lines.append(cur)
            cur, used = [(" " * LABEL_WIDTH, "")], 0
        part = shown(text.removeprefix("\n"))
        while used + len(part) > room and room - used > 0:
            # break at a space if one is near, else hard
            take = room - used
            space = part.rfind(" ", 0, take + 1)
            if space > take // 2:
                take = space
            cur.append((part[:take], style))
            lines.append(cur)
            cur, used = [(" " * LABEL_WIDTH, "")], 0
            part = part[take:].lstrip(" ")
        if part:
            cur.append((part, style))
            used += len(part)
    lines.append(cur)
    return lines


# --- status ------------------------------------------------------------------------------

def status_lines(doc: Mapping[str, Any], now: Optional[float] = None, plain: bool = True,
                 width: int = 80, warnings: Sequence[str] = ()) -> List[Line]:
    now = time.time() if now is None else now
    out: List[Line] = where_lines(doc, now, width)
    out += labelled("driver", _driver_segs(doc, now), width)
    out += labelled("watcher", _watcher_segs(doc["watcher"], now), width)
    out += _current_lines(doc, now, plain, width)
    r = doc["roster"]
    segs = [(f"{r['path']}  ({r['agents']} agent{'s' if r['agents'] != 1 else ''})", "")]
    out += labelled("roster", segs, width)
    out += quota_status_lines(doc.get("quotas") or (), now, width)
    for p in doc.get("problems") or ():   # (the roster's error among them)
        out += labelled("problem", [(f"ERROR: {p['kind']}: {p['detail']}", "bold red")], width)
    for warning in warnings:
        out += labelled("warning", [(warning, "yellow")], width)
    out.append([])
    return out + _agent_table(doc, now, plain, width)


def _driver_segs(doc: Mapping[str, Any], now: float) -> List[Seg]:
    d = doc["driver"]
    health = d["health"]
    segs: List[Seg] = [(health if health == "ok" else health.upper(), HEALTH_STYLE.get(health, ""))]
    if health == "stale" and d.get("heartbeat_age") is None:
        segs.append(("  heartbeat unreadable: not a file, or not readable", "bold yellow"))
    elif health == "stale":
        segs.append((f"  likely stuck: heartbeat {int(d['heartbeat_age'] or 0)} s old", "bold yellow"))
    bits: List[str] = []
    if d.get("pid"):
        bits.append(f"pid {d['pid']}")
    elif health == "dead" and d.get("last_pid"):
        bits.append(f"pid {d['last_pid']} gone without a clean stop")
    if d.get("lap") is not None:
        bits.append(f"lap {d['lap']}")
    if health in ("ok", "stale") and d.get("started_at"):
        bits.append(f"up {fmt_duration(now - (parse_iso(d['started_at']) or now))}")
    if health == "ok" and d.get("heartbeat_age") is not None:
        bits.append(f"beat {fmt_duration(d['heartbeat_age'])} ago")
    if health == "stopped":
        bits.append("never ran here" if d.get("heartbeat_at") is None
                    else f"stopped {fmt_ago(d.get('heartbeat_at'), now)}")
    lease = doc.get("lease")
    if lease is not None and d.get("role"):  # a many-host ring: who leads
        bits.append(f"{d['role']} on {d.get('host')}")
        if d["role"] == "standby" and lease.get("holder"):
            bits.append(f"leader {lease['holder']}")
    if bits:
        segs.append(("  " + ", ".join(bits), ""))
    if d.get("paused"):
        segs.append(("  PAUSED (ringd resume)", "bold yellow"))
    return segs



def _watcher_segs(w: Mapping[str, Any], now: float) -> List[Seg]:
    if w["alive"]:
        segs = [("alive", "green"), (f"  pid {w['pid']}, polled {fmt_ago(w.get('last_poll_at'), now)}", "")]
    else:
        segs = [("not running", "dim")]
        if w.get("last_poll_at"):
            segs.append((f"  (last poll {fmt_ago(w.get('last_poll_at'), now)})", "dim"))
    segs.append((f", {w['restarts']} restart{'s' if w['restarts'] != 1 else ''} in window", ""))
    if w["gave_up"]:
        segs.append(("  GAVE UP (ringwatch reset clears it)", "bold red"))
    return segs



def _current_lines(doc: Mapping[str, Any], now: float, plain: bool, width: int) -> List[Line]:
    health, paused = doc["driver"]["health"], doc["driver"].get("paused")
    c = doc.get("current")
    if c:
        segs = [(c["agent"], "bold cyan"),
                (f"  run {c['run_id']}" + (f", pid {c['pid']}" if c.get("pid") else "")
                 + f", {fmt_duration(c['elapsed'])} elapsed", "")]
        if c.get("phase"):
            segs.append((f"  phase: {c['phase']}", "bold"))
        if c.get("agent_beat_age") is not None:
            segs.append((f"  (last ping {fmt_duration(c['agent_beat_age'])} ago)", "dim"))
        if c.get("run_budget") and c.get("elapsed") is not None:
            over = c["elapsed"] > c["run_budget"]
            segs.append(("\n" + budget_bar(c["elapsed"], c["run_budget"], plain=plain), "red" if over else "cyan"))
            left = "over budget" if over else f"{fmt_duration(c['run_budget'] - c['elapsed'])} left"
            segs.append((f" of {fmt_duration(c['run_budget'])}, {left}", ""))
        return labelled("current", segs, width)
    idle = "-  (paused)" if paused else "-  (between runs)" if health == "ok" else "-"
    return labelled("current", [(idle, "dim")] + next_segs(doc.get("next"), health), width)


def _agent_table(doc: Mapping[str, Any], now: float, plain: bool, width: int) -> List[Line]:
    rows = []
    c = doc.get("current")
    forced = c.get("agent") if c and c.get("out_of_turn") else None
    for a in doc["agents"]:
        status = a.get("last_status")
        when = a.get("last_ended_at") or a.get("last_started_at")
        notes, style = agent_notes(a, now, forced=a["name"] == forced)
        fails = a.get("consecutive_failures") or 0
        rows.append([
            (str(a["position"]), ""), (a["name"], ""),
            (status or "never", STATUS_STYLE.get(status or "", "dim")),
            (fmt_duration(a.get("last_duration")) if status != "running" else "-", ""),
            (fmt_ago(when, now) if when else "-", ""),
            (str(fails), "red" if fails else ""),
            ("; ".join(notes), style),
        ])
    heads = ("#", "agent", "last", "took", "when", "fails", "notes")
    right = (True, False, False, True, True, True, False)
    if any(a.get("next_due") for a in doc["agents"]):   # scheduled agents: when each is next due
        heads, right = heads[:-1] + ("next due",) + heads[-1:], right[:-1] + (True, False)
        for a, row in zip(doc["agents"], rows):
            due = a.get("next_due")
            text = "-" if not due else ("now" if (parse_iso(due) or 0) <= now else fmt_ago(due, now))
            row.insert(len(row) - 1, (text, ""))
    return table(heads, rows, right=right, max_widths=(None, 20) + (None,) * (len(heads) - 2),
                 width=width, plain=plain)


def quota_status_lines(pools: Sequence[Mapping[str, Any]], now: float, width: int) -> List[Line]:
    """A line per quota pool: used / limit in the window, reserved, left, and
    until when it is held (exhausted, or nothing left)."""
    out: List[Line] = []
    for k, p in enumerate(pools):
        out += labelled("quota" if k == 0 else "", pool_segs(p, now, p["left"]), width)
    return out


def pool_segs(p: Mapping[str, Any], now: float, left: int, agent: Optional[str] = None) -> List[Seg]:
    """One pool: used / limit in the window, reserved, what ``left`` is (for
    ``agent``, if named), and when it refills: an exhausted pool when it
    reopens, else when the oldest counted use leaves the window."""
    segs: List[Seg] = [(f"{p['name']}  {p['used']:,} / {p['limit']:,} in {fmt_duration(p['window'])}", "")]
    if p.get("reserved"):
        held = ", ".join(sorted(p.get("reserves") or {}))
        segs.append((f", {p['reserved']:,} reserved" + (f" for {held}" if held else ""), ""))
    segs.append((f", {left:,} left" + (f" for {agent}" if agent else ""), "bold red" if not left else ""))
    if p.get("exhausted_until"):
        segs.append((f"  EXHAUSTED until {fmt_local(p['exhausted_until'], now)} "
                     f"({fmt_left(p['exhausted_until'], now)})", "bold red"))
    elif p.get("reset_at"):
        segs.append((f"; oldest use leaves {fmt_ago(p['reset_at'], now)} ({fmt_local(p['reset_at'], now)})"
                     if agent else f"; oldest use leaves {fmt_ago(p['reset_at'], now)}",
                     "dim" if left else "yellow"))
    return segs


STATE_FROM = {"--state": "--state", "$RING_STATE": "$RING_STATE", "./STATE": "./STATE here"}
CONFIG_FROM = {"--config": "--config", "$RING_CONFIG": "$RING_CONFIG", "search": "found",
               "its driver's heartbeat": "the one its driver runs with"}


def where_lines(doc: Mapping[str, Any], now: float, width: int) -> List[Line]:
    """The first lines: the state dir and the config this command read, how it
    found them, and the config the driver runs with when that is another."""
    c = doc.get("config") or {}
    how = doc.get("state_from")
    how = f"ring.state_dir of {c.get('path')}" if how == "ring.state_dir" else STATE_FROM.get(how or "", how)
    out = labelled("state", [(doc["state_dir"] + (f"  ({how})" if how else ""), "")], width)
    if c.get("path"):
        found = CONFIG_FROM.get(c.get("from") or "", c.get("from"))
        segs: List[Seg] = [(c["path"] + (f"  ({found})" if found else ""), "")]
    else:
        searched = c.get("searched") or []
        segs = [("built-in defaults" + (f"  (no file at {', '.join(searched)})" if searched else ""), "")]
    if doc["driver"].get("health") in ("ok", "stale") and c.get("driver_loaded_at"):
        runs, ago = c.get("driver_path"), fmt_ago(c["driver_loaded_at"], now)
        segs.append((f"; the driver loaded it {ago}" if runs == c.get("path")
                     else f"; the driver runs {runs or 'the built-in defaults'}, loaded {ago}", "dim"))
    return out + labelled("config", segs, width)


def agent_notes(a: Mapping[str, Any], now: float, forced: bool = False) -> "tuple[List[str], str]":
    """The notes column of one agent (and its style): paused, quarantined,
    backing off, skip requested, silent. ``forced``: it runs now because
    ``ringd next`` started it, so its holds are not shown as holding it."""
    notes: List[str] = []
    style = ""
    if forced:
        notes.append("started by ringd next")
        style = "bold cyan"
    elif a.get("paused"):
        notes.append("paused")
        style = "yellow"
    if a.get("quarantined_until") and not forced:
        notes.append(f"QUARANTINED {fmt_left(a['quarantined_until'], now)}")
        style = style or "bold magenta"
    if a.get("skip_requested"):
        notes.append("skip requested")
        style = style or "yellow"
    if a.get("backoff_until") and not forced:
        notes.append(f"back-off {fmt_left(a['backoff_until'], now)}")
        style = style or "blue"
    if a.get("quota_held"):
        notes.append(f"waits: {a['quota_held']}")
        style = style or "yellow"
    if a.get("silent"):
        notes.append(f"SILENT: no ok run for {fmt_duration(a.get('silent_for'))}")
        style = style or "bold red"
    return notes, style


def next_segs(upcoming: Optional[Mapping[str, Any]], health: str) -> List[Seg]:
    """``; next: NAME in N s`` (or ``now``, or ``when the driver starts``)."""
    if not upcoming:
        return []
    if health not in ("ok", "stale"):
        when = "when a driver starts"
    elif upcoming.get("in") is not None and upcoming["in"] >= 0.05:
        when = f"in {fmt_seconds(upcoming['in'])}"
    else:
        when = "now"
    return [(f"; next: {upcoming['agent']} {when}", "")]


def fmt_seconds(seconds: float) -> str:
    """``12 s`` under two minutes (the operator counts along), else like fmt_duration."""
    if seconds < 10:
        return f"{seconds:.1f} s"
    if seconds < 120:
        return f"{seconds:.0f} s"
    return fmt_duration(seconds)


def history_lines(runs: Sequence[Mapping[str, Any]], plain: bool = True, width: int = 80,
                  now: Optional[float] = None) -> List[Line]:
    if not runs:
        return [[("no runs yet", "dim")]]
    return [zone_line([r["started_at"] for r in runs], now)] + run_table(runs, plain, width, now)


def run_table(runs: Sequence[Mapping[str, Any]], plain: bool = True, width: int = 80,
              now: Optional[float] = None) -> List[Line]:
    """Runs as a table (history, ``status NAME``): local start times."""
    rows = [[(str(r["id"]), ""), (r["agent"], ""), (r["status"], STATUS_STYLE.get(r["status"], "")),
             (fmt_local(r["started_at"], now), ""), (fmt_duration(r["duration"]), ""),
             (exit_text(r["exit_code"], r["signal"]), ""),
             (" ".join((r.get("reason") or "").split()), "")] for r in runs]
    heads = ("run", "agent", "status", "started", "took", "exit", "reason")
    if any(r.get("phase") for r in runs):   # the agents' last STATUS= (ringd.host.notify)
        heads += ("phase",)
        for r, row in zip(runs, rows):
            row.append((r.get("phase") or "", ""))
    return table(heads, rows, right=(True, False, False, False, True, True) + (False,) * (len(heads) - 6),
                 max_widths=(None, 18) + (None,) * (len(heads) - 2), width=width, plain=plain)


def agent_lines(doc: Mapping[str, Any], now: Optional[float] = None, plain: bool = True,
                width: int = 80) -> List[Line]:
    """``ringd status NAME``: its roster line, its state, the run it has going, its last runs."""
    now = time.time() if now is None else now
    a = doc["agent"]
    out: List[Line] = []
    where = (f"position {a['position']}" if a.get("on_roster") and a.get("position") is not None
             else "not on the roster (known to the journal)")
    out += labelled("agent", [(a["name"], "bold"), (f"  {where}; {a.get('runs') or 0} run(s)", "")], width)
    if a.get("line"):
        out += labelled("line", [(a["line"], "")], width)
    c = doc.get("current")
    notes, style = agent_notes(a, now, forced=bool(c and c.get("out_of_turn")))
    state: List[str] = notes[:]
    if a.get("next_due"):
        state.append(f"next due {fmt_ago(a['next_due'], now)} ({fmt_local(a['next_due'], now)})")
    if a.get("consecutive_failures"):
        state.append(f"{a['consecutive_failures']} failure(s) in a row")
    if a.get("last_ok_at"):
        state.append(f"last ok {fmt_ago(a['last_ok_at'], now)}")
    if doc.get("driver", {}).get("paused"):
        state.append("the ring is paused")
    out += labelled("state", [("; ".join(state) or "ready", style)], width)
    pool = doc.get("quota")
    if pool:
        out += labelled("quota", pool_segs(pool, now, pool["left_for_agent"], a["name"]), width)
    if c:
        segs: List[Seg] = [(f"run {c['run_id']}", "bold cyan"),
                           (f", {fmt_duration(c.get('elapsed'))} elapsed"
                            + (f" of {fmt_duration(c['run_budget'])}" if c.get("run_budget") else ""), "")]
        if c.get("phase"):
            segs.append((f"  phase: {c['phase']}", "bold"))
        beat = c.get("agent_beat_age")
        segs.append((f"  (last ping {fmt_duration(beat)} ago)" if beat is not None else "  (no ping yet)", "dim"))
        out += labelled("current", segs, width)
    elif doc.get("next"):
        out += labelled("current", [("-", "dim")] + next_segs(doc["next"], doc.get("driver", {}).get("health", "")),
                        width)
    runs = doc.get("runs") or []
    out.append([])
    if not runs:
        return out + [[("no runs yet", "dim")]]
    return out + [zone_line([r["started_at"] for r in runs], now)] + run_table(runs, plain, width, now)


def events_lines(events: Sequence[Mapping[str, Any]], plain: bool = True, width: int = 80,
                 now: Optional[float] = None) -> List[Line]:
    """``ringd events``: time, run, agent, kind, source, actor, reason (and detail)."""
    if not events:
        return [[("no events", "dim")]]
    from ringd.cli.actor import describe
    rows = [[(fmt_local(e["at"], now), ""), (str(e["run_id"]) if e.get("run_id") is not None else "-", ""),
             (e.get("agent") or "-", ""), (e["kind"], EVENT_STYLE.get(e["kind"], "")), (e["source"], ""),
             (describe(e.get("actor")), ""), (e.get("reason") or "", ""), (e.get("detail") or "", "dim")]
            for e in events]
    heads = ("time", "run", "agent", "kind", "source", "actor", "reason", "detail")
    caps = (None,) * 8 if width >= UNLIMITED else (None, None, 18, None, None, 40, 40, None)   # (a pipe: whole)
    return [zone_line([e["at"] for e in events], now)] + table(
        heads, rows, right=(True, True) + (False,) * 6, max_widths=caps, width=width, plain=plain)


EVENT_STYLE = dict(STATUS_STYLE, silent="bold red", paused_too_long="bold yellow", paused="yellow",
                   quarantined="bold magenta")


# --- output ------------------------------------------------------------------------------

def emit(lines: Sequence[Line], stream: Optional[TextIO] = None) -> None:
    stream = stream or sys.stdout
    if plain_output(stream):
        stream.write("".join("".join(t for t, _ in line).rstrip() + "\n" for line in lines))
        stream.flush()
        return
    console = _console(stream)
    console.print(_rich_text(lines), no_wrap=True, overflow="crop", crop=True, soft_wrap=False)


def _console(stream: TextIO):
    from rich.console import Console
    return Console(file=stream, highlight=False, emoji=False, markup=False,
                   no_color=bool(os.environ.get("NO_COLOR")))


def _rich_text(lines: Sequence[Line]):
    from rich.text import Text
    text = Text(end="")
    for k, line in enumerate(lines):
        if k:
            text.append("\n")
        for t, style in line:
            text.append(t, style=style or None)
    return text


def print_status(doc: Mapping[str, Any], warnings: Sequence[str] = (), stream: Optional[TextIO] = None) -> None:
    stream = stream or sys.stdout
    emit(status_lines(doc, plain=plain_output(stream), width=output_width(stream), warnings=warnings), stream)


def print_history(runs: Sequence[Mapping[str, Any]], stream: Optional[TextIO] = None) -> None:
    stream = stream or sys.stdout
    emit(history_lines(runs, plain=plain_output(stream), width=output_width(stream)), stream)


def print_agent(doc: Mapping[str, Any], stream: Optional[TextIO] = None) -> None:
    stream = stream or sys.stdout
    emit(agent_lines(doc, plain=plain_output(stream), width=output_width(stream)), stream)


def print_events(events: Sequence[Mapping[str, Any]], stream: Optional[TextIO] = None) -> None:
    stream = stream or sys.stdout
    emit(events_lines(events, plain=plain_output(stream), width=output_width(stream)), stream)


def watch_status(gather: Callable[[], "tuple[Dict[str, Any], List[str]]"], interval: float = 1.0,
                 stream: Optional[TextIO] = None) -> None:
    """Redraw the status every ``interval`` s until Ctrl-C: in place on a terminal
    (rich Live), else one frame after another separated by a blank line."""
    stream = stream or sys.stdout
    if not _isatty(stream):
        while True:
            doc, warnings = gather()
            emit(status_lines(doc, plain=True, width=output_width(stream), warnings=warnings) + [[]], stream)
            time.sleep(interval)
    from rich.live import Live
    plain = plain_output(stream)

    def frame():
        doc, warnings = gather()
        return _rich_text(status_lines(doc, plain=plain, width=output_width(stream), warnings=warnings))

    with Live(frame(), console=_console(stream), auto_refresh=False, transient=False) as live:
        # a terminal that hung up is no terminal: rich draws nothing on it, and
        # the watch would poll the journal for nobody, forever
        while _isatty(stream):
            time.sleep(interval)
            live.update(frame(), refresh=True)
