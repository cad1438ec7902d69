"""``ringd top``'s screen as lines of ``(text, style)`` segments: a pure function of the status, the
agents' last runs, a clock and the terminal's size (rich is not imported here).

Sections, top to bottom: a title line; the driver and the watcher; the current
run with its budget bar, phase and agent beat; the next turns and scheduled
agents' due times; quota pools (when the status has any); problems; one row
per agent with its last runs as a strip of coloured cells (letters when
colour is off); a legend. Every line fits the width; rows that do not fit the
height are counted in a last line instead. Text from the journal or a state
file is made safe for a terminal where the lines are drawn (:func:`safe`).
"""
from __future__ import annotations

from datetime import datetime
from typing import Any, List, Mapping, Optional, Sequence

from ringd.cli.render import (HEALTH_STYLE, STATUS_STYLE, Line, Seg, budget_bar, fmt_duration, fmt_seconds,
                              shown)
from ringd.core.timefmt import parse_iso

CELL = "\u25a0"   # one run in an agent's strip
LETTERS = {"ok": ".", "running": ">", "failed": "F", "error": "E", "stalled": "S", "timeout": "T",
           "interrupted": "I", "deferred": "D", "skipped": "-"}
CELL_STYLE = dict(STATUS_STYLE, skipped="bright_black", ok="green")
NAME_W = 18
NOTE_W = 16
NEXT_TURNS = 5


def safe(lines: Sequence[Line]) -> List[Line]:
    """Every segment's control characters as spaces: an escape sequence in a
    phase or a reason can neither move the cursor nor repaint the screen.
    Neighbours of one style become one segment (a strip of 80 green cells is
    one piece of text to draw, not 80)."""
    out: List[Line] = []
    for line in lines:
        merged: Line = []
        for t, s in line:
            if merged and merged[-1][1] == s:
                merged[-1] = (merged[-1][0] + shown(t), s)
            elif t:
                merged.append((shown(t), s))
        out.append(merged)
    return out


def fit(line: Line, width: int) -> Line:
    """``line`` cut to ``width`` characters (styles kept)."""
    out: Line = []
    room = width
    for t, s in line:
        if room <= 0:
            break
        if len(t) > room:
            t = t[: max(0, room - 1)] + "\u2026"
        out.append((t, s))
        room -= len(t)
    return out


def cell(status: Optional[str], plain: bool) -> Seg:
    if plain:
        return LETTERS.get(status or "", "?"), ""
    return CELL, CELL_STYLE.get(status or "", "")


def top_lines(doc: Optional[Mapping[str, Any]], strips: Mapping[str, Sequence[str]], now: float, *,
              width: int, height: int, plain: bool = False, warnings: Sequence[str] = (),
              error: Optional[str] = None, reasons: Optional[Mapping[str, str]] = None) -> List[Line]:
    """The whole screen. ``doc``: ``status --json``'s document (None when it
    could not be read: ``error`` says why). ``strips``: each agent's last
    statuses, oldest first; ``reasons``: how each agent's last finished run
    ended (``status: reason``)."""
    width, height = max(20, width), max(5, height)
    out: List[Line] = [title_line(doc, now, width)]
    if doc is None:
        out += [[], [("cannot read the ring: ", "bold red"), (error or "unknown error", "")]]
        return [fit(x, width) for x in out[:height]]
    out += driver_lines(doc, now)
    out += current_lines(doc, width, plain)
    out += next_lines(doc, now)
    out += quota_lines(doc, width, plain)
    out += problem_lines(doc, now, warnings, error, reasons or {})
    out.append([])
    foot = legend_line(plain)
    room = height - len(out) - 1
    out += agent_lines(doc, strips, now, width, plain, room)
    out.append(foot)
    return [fit(x, width) for x in out[:height]]


def title_line(doc: Optional[Mapping[str, Any]], now: float, width: int) -> Line:
    right = f"{datetime.fromtimestamp(now).strftime('%H:%M:%S')}  q quits"
    left = "ring top" + (f"  {doc['state_dir']}" if doc else "")
    gap = max(1, width - len(left) - len(right))
    if len(left) + len(right) + 1 > width:
        left = left[: max(8, width - len(right) - 2)]
        gap = max(1, width - len(left) - len(right))
    return [(left[:8], "bold"), (left[8:], "dim"), (" " * gap, ""), (right, "dim")]


def driver_lines(doc: Mapping[str, Any], now: float) -> List[Line]:
    d, w = doc["driver"], doc["watcher"]
    health = d["health"]
    bits = []
    if d.get("pid"):
        bits.append(f"pid {d['pid']}")
    if d.get("lap") is not None:
        bits.append(f"lap {d['lap']}")
    if health in ("ok", "stale") and d.get("started_at"):
        bits.append(f"up {fmt_duration(now - (parse_iso(d['started_at']) or now))}")
    if d.get("heartbeat_age") is not None and health != "stopped":
        bits.append(f"beat {fmt_duration(d['heartbeat_age'])} ago")
    line: Line = [("driver   ", "bold"), (health if health == "ok" else health.upper(), HEALTH_STYLE.get(health, ""))]
    if bits:
        line.append(("  " + ", ".join(bits), ""))
    if d.get("paused"):
        line.append(("  PAUSED", "bold yellow"))
    line.append(("   watcher ", "bold"))
    if w.get("gave_up"):
        line.append(("GAVE UP", "bold red"))
    else:
        line.append(("alive" if w.get("alive") else "not running", "green" if w.get("alive") else "dim"))
    if w.get("restarts"):
        line.append((f", {w['restarts']} restart(s) in window", "yellow"))
    return [line]


def current_lines(doc: Mapping[str, Any], width: int, plain: bool) -> List[Line]:
    c = doc.get("current")
    if not c:
        d = doc["driver"]
        why = ("paused" if d.get("paused") else "between runs" if d["health"] == "ok"
               else f"driver {d['health']}: nothing runs")
        return [[("current  ", "bold"), ("-  " + why, "dim")]]
    line: Line = [("current  ", "bold"), (c["agent"], "bold cyan"),
                  (f"  run {c['run_id']}, {fmt_duration(c.get('elapsed'))} elapsed", "")]
    beat = c.get("agent_beat_age")
    line.append((f"  beat {fmt_duration(beat)} ago" if beat is not None else "  no beat", "dim"))
    out = [line]
    if c.get("phase"):
        out.append([("phase    ", "bold"), (c["phase"], "bold")])
    if c.get("run_budget") and c.get("elapsed") is not None:
        over = c["elapsed"] > c["run_budget"]
        bar = budget_bar(c["elapsed"], c["run_budget"], width=max(10, min(50, width - 40)), plain=plain)
        left = "over budget" if over else f"{fmt_duration(c['run_budget'] - c['elapsed'])} left"
        out.append([("budget   ", "bold"), (bar, "red" if over else "cyan"),
                    (f" of {fmt_duration(c['run_budget'])}, {left}", "")])
    return out


def upcoming(doc: Mapping[str, Any], now: float, n: int = NEXT_TURNS) -> List[str]:
    """The next ``n`` turns: the one status names, then the roster onwards,
    passing over agents that are paused, quarantined, backing off or scheduled."""
    nxt = doc.get("next")
    agents = doc["agents"]
    if not nxt or not agents:
        return []
    names = [a["name"] for a in agents]
    if nxt["agent"] not in names:
        return [nxt["agent"]]

    def waits(a: Mapping[str, Any]) -> bool:
        return bool(a.get("paused") or a.get("next_due") or a.get("quarantined_until")
                    or (parse_iso(a.get("backoff_until")) or 0) > now)
    out = [nxt["agent"]]
    k = names.index(nxt["agent"])
    for step in range(1, len(names)):
        a = agents[(k + step) % len(names)]
        if len(out) >= n:
            break
        if not waits(a):
            out.append(a["name"])
    return out


def next_lines(doc: Mapping[str, Any], now: float) -> List[Line]:
    d, nxt = doc["driver"], doc.get("next")
    out: List[Line] = []
    turns = upcoming(doc, now)
    if turns and not d.get("paused"):
        if d["health"] not in ("ok", "stale"):
            when = " when a driver starts"
        elif nxt.get("after_current_run"):
            when = " after this run"
        elif nxt.get("in") is not None and nxt["in"] >= 0.05:
            when = f" in {fmt_seconds(nxt['in'])}"
        else:
            when = " now"
        line: Line = [("next     ", "bold"), (turns[0], "bold"), (when, "")]
        for name in turns[1:]:
            line += [(" \u2192 ", "dim"), (name, "")]
        out.append(line)
    dues = sorted(((parse_iso(a["next_due"]) or now, a["name"]) for a in doc["agents"] if a.get("next_due")))
    if dues:
        line = [("due      ", "bold")]
        for k, (t, name) in enumerate(dues[:6]):
            at = "now" if t <= now else f"in {fmt_duration(t - now)} ({datetime.fromtimestamp(t).strftime('%H:%M')})"
            line += [(", " if k else "", ""), (name, ""), (f" {at}", "dim")]
        out.append(line)
    return out


def quota_lines(doc: Mapping[str, Any], width: int, plain: bool) -> List[Line]:
    pools = doc.get("quotas")
    if not isinstance(pools, list) or not pools:
        return []
    out: List[Line] = []
    for p in pools:
        if not isinstance(p, dict):
            continue
        limit, used = p.get("limit") or 0, p.get("used") or 0
        bar = budget_bar(used, limit, width=max(10, min(30, width - 50)), plain=plain) if limit else ""
        bits = [f"{used:g}/{limit:g} used" if isinstance(used, (int, float)) and isinstance(limit, (int, float))
                else "", f"{p['reserved']:g} reserved" if isinstance(p.get("reserved"), (int, float)) else "",
                f"{p['left']:g} left" if isinstance(p.get("left"), (int, float)) else ""]
        held = p.get("exhausted_until")
        line: Line = [("quota    " if not out else "         ", "bold"), (str(p.get("name")), "bold"), ("  ", ""),
                      (bar, "red" if held else "cyan"), ("  " + ", ".join(b for b in bits if b), "")]
        if held:
            line.append((f"  exhausted until {held}", "bold red"))
        out.append(line)
    return out


def problems(doc: Mapping[str, Any], now: float, warnings: Sequence[str] = (),
             reasons: Optional[Mapping[str, str]] = None) -> List[str]:
    """What an operator should look at, one short text each: the driver, the
    watcher, the roster and config, quarantines, and each agent failing in a
    row with how its last run ended."""
    d, w = doc["driver"], doc["watcher"]
    out: List[str] = []
    if d["health"] == "dead":
        out.append(f"driver dead: pid {d.get('last_pid') or '?'} gone without a clean stop")
    elif d["health"] == "stale":
        out.append(f"driver stale: heartbeat {fmt_duration(d.get('heartbeat_age'))} old")
    elif d["health"] == "stopped":
        out.append("driver stopped: nothing runs (start ringwatch or ringd run)")
    if w.get("gave_up"):
        out.append("watcher gave up (ringwatch reset clears it)")
    if doc["roster"].get("error"):
        out.append(f"roster: {doc['roster']['error']}")
    for p in doc.get("problems") or ():
        if isinstance(p, dict):
            out.append(f"{p.get('kind')}: {p.get('detail')}")
    out += list(warnings)
    for a in doc["agents"]:
        if a.get("quarantined_until"):
            out.append(f"{a['name']} quarantined, {fmt_duration((parse_iso(a['quarantined_until']) or now) - now)} "
                       f"left (ringd resume {a['name']})")
    for a in doc["agents"]:
        fails = a.get("consecutive_failures") or 0
        if fails and not a.get("quarantined_until"):
            last = (reasons or {}).get(a["name"]) or a.get("last_status") or "?"
            out.append(f"{a['name']}: {fails} failure(s) in a row, last {' '.join(last.split())}")
    return out


def problem_lines(doc: Mapping[str, Any], now: float, warnings: Sequence[str], error: Optional[str],
                  reasons: Mapping[str, str]) -> List[Line]:
    found = problems(doc, now, warnings, reasons) + ([f"last refresh failed: {error}"] if error else [])
    if not found:
        return [[("problems ", "bold"), ("none", "green")]]
    return [[("problems " if k == 0 else "         ", "bold"), (p, "yellow")] for k, p in enumerate(found[:6])] + (
        [[("         ", ""), (f"... {len(found) - 6} more", "dim")]] if len(found) > 6 else [])


def agent_notes(a: Mapping[str, Any], now: float) -> Seg:
    if a.get("quarantined_until"):
        return "quarantined", "bold magenta"
    if a.get("paused"):
        return "paused", "yellow"
    until = parse_iso(a.get("backoff_until"))
    if until is not None and until > now:
        return f"back-off {fmt_duration(until - now)}", "blue"
    if a.get("skip_requested"):
        return "skip requested", "yellow"
    due = parse_iso(a.get("next_due"))
    if due is not None:
        return ("due now" if due <= now else f"due in {fmt_duration(due - now)}"), ""
    return "", ""


def agent_lines(doc: Mapping[str, Any], strips: Mapping[str, Sequence[str]], now: float, width: int,
                plain: bool, room: int) -> List[Line]:
    agents = doc["agents"]
    fixed = 4 + NAME_W + 1 + 12 + 6 + NOTE_W + 1
    cells = max(0, width - fixed)
    out: List[Line] = [[(f"{'#':>3} {'agent':<{NAME_W}} {'last':<11} {'fails':>5} {'':<{NOTE_W}} "
                         f"last runs, newest right", "bold")]]
    rows = agents if room - 1 >= len(agents) else agents[:max(0, room - 2)]
    for a in rows:
        status = a.get("last_status")
        name = a["name"] if len(a["name"]) <= NAME_W else a["name"][: NAME_W - 1] + "\u2026"
        fails = a.get("consecutive_failures") or 0
        note, note_style = agent_notes(a, now)
        note = note if len(note) <= NOTE_W else note[: NOTE_W - 1] + "\u2026"
        line: Line = [(f"{a['position']:>3} ", ""), (f"{name:<{NAME_W}} ", "bold" if status == "running" else ""),
                      (f"{status or 'never':<11}", STATUS_STYLE.get(status or "", "dim")), (f" {fails:>5} ",
                      "red" if fails else ""), (f"{note:<{NOTE_W}} ", note_style)]
        strip = list(strips.get(a["name"], ()))[-cells:] if cells else []
        line += [cell(s, plain) for s in strip]
        out.append(line)
    if len(rows) < len(agents):
        out.append([(f"... {len(agents) - len(rows)} more agent(s): a taller terminal shows them", "dim")])
    return out if room > 1 else []


def legend_line(plain: bool) -> Line:
    line: Line = [("cells: ", "dim")]
    for status in LETTERS:
        line += [cell(status, plain), (f" {status}  ", "dim")]
    return line


def strip_key(doc: Optional[Mapping[str, Any]]) -> Optional[tuple]:
    """What changes when an agent's strip does: its finished runs and the run in flight."""
    if doc is None:
        return None
    current = doc.get("current") or {}
    return (current.get("run_id"),) + tuple((a["name"], a.get("runs"), a.get("last_status")) for a in doc["agents"])

