"""Tables for people. The only module that imports rich, and only when a table is
drawn (``status --json`` never loads it).

Output is plain text - no escape codes at all - when stdout is not a terminal or
``NO_COLOR`` is set; tables fit an 80-column terminal (long cells are cut with
an ellipsis rather than wrapped).
"""
from __future__ import annotations

import os
import sys
import time
from datetime import datetime
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, TextIO

from .heartbeat import parse_iso

HEALTH_STYLE = {"ok": "bold green", "stale": "bold yellow", "dead": "bold red", "stopped": "dim"}
STATUS_STYLE = {
    "ok": "green", "running": "bold cyan", "failed": "red", "error": "red", "stalled": "bold red",
    "timeout": "yellow", "interrupted": "magenta", "deferred": "blue", "skipped": "dim",
}


# --- plain formatting (no rich) -----------------------------------------------

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


def fmt_until(iso_time: Optional[str], now: float) -> str:
    t = parse_iso(iso_time)
    if t is None:
        return "-"
    local = datetime.fromtimestamp(t).strftime("%H:%M" if t - now < 86400 else "%m-%d %H:%M")
    return f"{local} (in {fmt_duration(max(0.0, t - now))})"


def fmt_local(iso_time: Optional[str]) -> str:
    t = parse_iso(iso_time)
    return "-" if t is None else datetime.fromtimestamp(t).strftime("%m-%d %H:%M:%S")


def budget_bar(elapsed: float, budget: Optional[float], width: int = 20, plain: bool = False) -> str:
    if not budget:
        return ""
    frac = max(0.0, min(1.0, elapsed / budget))
    full = int(round(frac * width))
    on, off = ("#", "-") if plain else ("\u2588", "\u2591")
    return f"[{on * full}{off * (width - full)}] {frac * 100:.0f}%"


def _exit_text(code: Any, sig: Any) -> str:
    if sig:
        try:
            import signal
            return signal.Signals(sig).name
        except (ValueError, TypeError):
            return f"sig {sig}"
    return "-" if code is None else str(code)


# --- rich ------------------------------------------------------------------------

def plain_output(stream: Optional[TextIO] = None) -> bool:
    stream = stream or sys.stdout
    if os.environ.get("NO_COLOR"):
        return True
    try:
        return not stream.isatty()
    except (AttributeError, ValueError):
        return True


def make_console(stream: Optional[TextIO] = None, live: bool = False):
    from rich.console import Console
    stream = stream or sys.stdout
    if plain_output(stream) and not (live and _isatty(stream)):
        # No terminal codes whatsoever: no colour, no bold, no cursor movement.
        return Console(file=stream, color_system=None, force_terminal=False, force_interactive=False,
                       highlight=False, emoji=False, markup=True)
    return Console(file=stream, highlight=False, emoji=False, no_color=bool(os.environ.get("NO_COLOR")))


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def status_renderable(doc: Mapping[str, Any], now: Optional[float] = None, plain: bool = False,
                      warnings: Sequence[str] = ()):
    from rich import box
    from rich.console import Group
    from rich.markup import escape
    from rich.table import Table
    from rich.text import Text

    now = time.time() if now is None else now
    head = Table.grid(padding=(0, 1))
    head.add_column(style="bold", no_wrap=True)
    head.add_column(overflow="fold")

    d = doc["driver"]
    health = d["health"]
    line = Text(health.upper() if health != "ok" else "ok", style=HEALTH_STYLE.get(health, ""))
    bits: List[str] = []
    if health == "stale":
        line.append(f"  likely stuck: heartbeat {int(d['heartbeat_age'] or 0)} s old", style="yellow")
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
    if health == "stopped" and d.get("heartbeat_at") is None:
        bits.append("never ran here")
    elif health == "stopped":
        bits.append(f"stopped {fmt_ago(d.get('heartbeat_at'), now)}")
    if bits:
        line.append("  " + ", ".join(bits))
    head.add_row("driver", line)

    w = doc["watcher"]
    if w["alive"]:
        wl = Text("alive", style="green")
        wl.append(f"  pid {w['pid']}, polled {fmt_ago(w.get('last_poll_at'), now)}")
    elif w.get("last_poll_at"):
        wl = Text("not running", style="dim")
        wl.append(f"  (last poll {fmt_ago(w.get('last_poll_at'), now)})")
    else:
        wl = Text("not running", style="dim")
    wl.append(f", {w['restarts']} restart{'s' if w['restarts'] != 1 else ''} in window")
    if w["gave_up"]:
        wl.append("  GAVE UP (ringwatch reset to clear)", style="bold red")
    head.add_row("watcher", wl)

    c = doc.get("current")
    if c:
        cl = Text(c["agent"], style="bold cyan")
        cl.append(f"  run {c['run_id']}" + (f", pid {c['pid']}" if c.get("pid") else ""))
        cl.append(f", {fmt_duration(c['elapsed'])} elapsed")
        if c.get("run_budget"):
            left = max(0.0, c["run_budget"] - c["elapsed"])
            over = c["elapsed"] > c["run_budget"]
            cl.append("\n" + budget_bar(c["elapsed"], c["run_budget"], plain=plain),
                      style="red" if over else "cyan")
            cl.append(f" of {fmt_duration(c['run_budget'])}, "
                      + ("over budget" if over else f"{fmt_duration(left)} left"))
        head.add_row("current", cl)
    else:
        head.add_row("current", Text("-  (between runs)" if health == "ok" else "-", style="dim"))

    r = doc["roster"]
    rl = Text(f"{r['path']}  ({r['agents']} agent{'s' if r['agents'] != 1 else ''})")
    if r.get("error"):
        rl.append(f"\nERROR: {r['error']}", style="bold red")
    head.add_row("roster", rl)
    for warning in warnings:
        head.add_row("warning", Text(warning, style="yellow"))

    table = Table(box=box.SIMPLE_HEAD, padding=(0, 1), expand=False, show_edge=False,
                  pad_edge=False, header_style="bold")
    table.add_column("#", justify="right", no_wrap=True)
    table.add_column("agent", no_wrap=True, overflow="ellipsis", max_width=20)
    table.add_column("last", no_wrap=True)
    table.add_column("took", justify="right", no_wrap=True)
    table.add_column("when", justify="right", no_wrap=True)
    table.add_column("fails", justify="right", no_wrap=True)
    table.add_column("notes", overflow="fold", min_width=10)
    for a in doc["agents"]:
        status = a.get("last_status")
        when = a.get("last_ended_at") or a.get("last_started_at")
        notes = Text()
        if a.get("quarantined_until"):
            notes.append(f"QUARANTINED until {fmt_until(a['quarantined_until'], now)}", style="bold magenta")
        if a.get("skip_requested"):
            notes.append(("; " if notes else "") + "skip requested", style="yellow")
        if a.get("backoff_until"):
            notes.append(("; " if notes else "") + f"back-off until {fmt_until(a['backoff_until'], now)}",
                         style="blue")
        fails = a.get("consecutive_failures") or 0
        table.add_row(
            str(a["position"]), escape(a["name"]),
            Text(status or "never", style=STATUS_STYLE.get(status or "", "dim")),
            fmt_duration(a.get("last_duration")) if status != "running" else "-",
            fmt_ago(when, now) if when else "-",
            Text(str(fails), style="red" if fails else ""),
            notes,
        )
    return Group(head, Text(""), table)


def print_status(doc: Mapping[str, Any], warnings: Sequence[str] = (), stream: Optional[TextIO] = None) -> None:
    console = make_console(stream)
    console.print(status_renderable(doc, plain=plain_output(stream), warnings=warnings))


def watch_status(gather: Callable[[], "tuple[Dict[str, Any], List[str]]"], interval: float = 1.0,
                 stream: Optional[TextIO] = None) -> None:
    """Redraw the status every ``interval`` s until Ctrl-C (in place on a terminal;
    one frame after another, separated by a blank line, otherwise)."""
    stream = stream or sys.stdout
    console = make_console(stream, live=True)
    plain = plain_output(stream)
    if console.is_terminal:
        from rich.live import Live
        doc, warnings = gather()
        with Live(status_renderable(doc, plain=plain, warnings=warnings), console=console,
                  auto_refresh=False, transient=False) as live:
            while True:
                time.sleep(interval)
                doc, warnings = gather()
                live.update(status_renderable(doc, plain=plain, warnings=warnings), refresh=True)
    else:
        while True:
            doc, warnings = gather()
            console.print(status_renderable(doc, plain=True, warnings=warnings))
            console.print("")
            stream.flush()
            time.sleep(interval)


def print_history(runs: Sequence[Mapping[str, Any]], stream: Optional[TextIO] = None) -> None:
    from rich import box
    from rich.markup import escape
    from rich.table import Table
    from rich.text import Text

    console = make_console(stream)
    if not runs:
        console.print("no runs yet")
        return
    table = Table(box=box.SIMPLE_HEAD, padding=(0, 1), show_edge=False, pad_edge=False, header_style="bold")
    table.add_column("run", justify="right", no_wrap=True)
    table.add_column("agent", no_wrap=True, overflow="ellipsis", max_width=18)
    table.add_column("status", no_wrap=True)
    table.add_column("started", no_wrap=True)
    table.add_column("took", justify="right", no_wrap=True)
    table.add_column("exit", justify="right", no_wrap=True)
    table.add_column("reason", overflow="ellipsis", no_wrap=True, min_width=8)
    for r in runs:
        table.add_row(str(r["id"]), escape(r["agent"]),
                      Text(r["status"], style=STATUS_STYLE.get(r["status"], "")),
                      fmt_local(r["started_at"]), fmt_duration(r["duration"]),
                      _exit_text(r["exit_code"], r["signal"]), Text(r.get("reason") or ""))
    console.print(table)
