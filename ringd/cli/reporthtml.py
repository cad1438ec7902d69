"""``ringd report``'s page: a Timeline as one self-contained HTML file with inline SVG (pure, stdlib only).

No script, no external style sheet, image or font: the file opens offline,
from an email attachment or a CI artifact. Every text that comes from the
journal or a state file (an agent's name, a phase, a reason) is shown as text:
its control characters are spaces and it goes through ``html.escape``.

Layout: a scrolling box holds a grid of four SVGs - a corner, the time axis
(sticky at the top), the lane names (sticky at the left) and the lanes - so a
100-agent ring scrolls both ways with its axis and names in view. The chart is
as wide as its busiest lane needs for every bar to keep a minimum width.
"""
from __future__ import annotations

import html
from datetime import datetime, tzinfo
from typing import List, Optional, Sequence, Tuple

from ringd.cli.render import fmt_duration
from ringd.core.records import STATUSES
from ringd.core.timeline import Bar, Lap, PoolUse, Timeline
from ringd.host.notify import without_controls

# One colour per status (legend, bars, table), told apart by people with the
# common colour-vision deficiencies as far as nine colours allow (a tab10-like set).
COLOURS = {
    "ok": "#2ca02c", "running": "#17becf", "failed": "#d62728", "error": "#8c564b", "stalled": "#7f0000",
    "timeout": "#ff7f0e", "interrupted": "#e377c2", "deferred": "#1f77b4", "skipped": "#a0a0a0",
}
assert set(COLOURS) == set(STATUSES)

LABEL_W = 170       # px: the lane names' column
LANE_H = 18         # px: one lane
BAR_H = 12          # px: one bar
AXIS_H = 30         # px: the time axis
MIN_BAR = 2         # px: the narrowest bar (a run of a second in a day's window)
BASE_W = 1000       # px: the chart's width when nothing needs more
PER_RUN_W = 4       # px of chart per run of the busiest lane, so its bars stay apart
MAX_W = 60000       # px: the widest chart
NAME_CHARS = 24     # a lane name longer than this is cut (the full name is its tooltip)
TITLE_CHARS = 300   # a reason or phase in a tooltip (the table has it whole)
LAP_GAP = 56        # px: the closest two lap lines come
TICK_PX = 110       # px between time labels, about
_STEPS = (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 10800, 21600, 43200,
          86400, 172800, 604800, 1209600, 2592000)


def text(value: Optional[str], limit: Optional[int] = None) -> str:
    """Journal text as HTML text: control characters as spaces, cut, escaped."""
    if not value:
        return ""
    s = " ".join(without_controls(str(value)).split())
    if limit is not None and len(s) > limit:
        s = s[: limit - 1] + "\u2026"
    return html.escape(s, quote=True)


class Clock:
    """Local times in one zone, formatted for the page."""

    def __init__(self, tz: tzinfo, now: float):
        self.tz = tz
        self.today = datetime.fromtimestamp(now, tz).date()
        self.zone = datetime.fromtimestamp(now, tz).strftime("%Z (%z)")
        self.zone = self.zone[:-3] + ":" + self.zone[-3:] if self.zone.endswith(")") else self.zone

    def at(self, t: float, seconds: bool = True) -> str:
        d = datetime.fromtimestamp(t, self.tz)
        clock = d.strftime("%H:%M:%S" if seconds else "%H:%M")
        return clock if d.date() == self.today else d.strftime("%Y-%m-%d ") + clock

    def full(self, t: float) -> str:
        return datetime.fromtimestamp(t, self.tz).strftime("%Y-%m-%d %H:%M:%S")


# --- geometry ------------------------------------------------------------------------------

def chart_width(tl: Timeline) -> int:
    busiest = max((lane.runs for lane in tl.lanes), default=0)
    return max(BASE_W, min(MAX_W, busiest * PER_RUN_W))


class Scale:
    """Time to x (px) across the chart."""

    def __init__(self, tl: Timeline, width: int):
        self.t0, self.width = tl.start, width
        self.k = width / (tl.end - tl.start)

    def x(self, t: float) -> float:
        return (t - self.t0) * self.k

    def bar(self, b: Bar) -> Tuple[float, float]:
        """(x, width) of a bar: at least MIN_BAR wide, never past the chart's end."""
        x = max(0.0, min(self.x(b.start), self.width - MIN_BAR))
        return x, max(MIN_BAR, self.x(b.end) - x)


def ticks(start: float, end: float, width: int, tz: tzinfo) -> List[float]:
    """Times for the axis's labels, on round local times about TICK_PX apart."""
    want = (end - start) * TICK_PX / width
    step = next((s for s in _STEPS if s >= want), _STEPS[-1])
    offset = datetime.fromtimestamp(start, tz).utcoffset()
    off = offset.total_seconds() if offset is not None else 0.0
    t = start - ((start + off) % step)
    out = []
    while t <= end and len(out) < 2000:
        if t >= start:
            out.append(t)
        t += step
    return out


# --- the page ----------------------------------------------------------------------------------

def render(tl: Timeline, *, tz: tzinfo, title: str = "ring report", source: str = "",
           generated: Optional[float] = None) -> str:
    """The whole page."""
    clock = Clock(tz, tl.now)
    width = chart_width(tl)
    scale = Scale(tl, width)
    parts = [
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">",
        f"<meta name=\"viewport\" content=\"width=device-width\"><title>{text(title)}</title>",
        f"<style>{css()}</style></head><body>",
        header(tl, clock, title, source, generated),
        legend(tl),
        chart(tl, clock, scale),
        pools(tl, clock, scale),
        table(tl, clock),
        "</body></html>\n",
    ]
    return "".join(parts)


def css() -> str:
    status_rules = "".join(f"rect[data-status={s}]{{fill:{c}}}.k-{s}{{background:{c}}}"
                           f"tr[data-status={s}] .st{{color:{c}}}" for s, c in COLOURS.items())
    return (
        "body{font:13px/1.4 system-ui,-apple-system,'Segoe UI',Roboto,sans-serif;margin:16px;color:#222}"
        "h1{font-size:18px;margin:0 0 4px}h2{font-size:15px;margin:18px 0 6px}"
        ".meta{color:#555;margin:0 0 8px}"
        ".legend{list-style:none;padding:0;margin:6px 0 10px;display:flex;flex-wrap:wrap;gap:4px 14px}"
        ".legend li{display:flex;align-items:center;gap:5px}.legend .zero{opacity:.45}"
        ".sw{display:inline-block;width:14px;height:10px;border-radius:2px}"
        ".sw.lap{width:0;height:14px;border-left:2px dashed #555;border-radius:0}"
        ".sw.due{width:0;height:0;border:6px solid transparent;border-top:8px solid #333;border-bottom:0}"
        ".sw.now{width:0;height:14px;border-left:2px solid #c00;border-radius:0}"
        ".scroll{overflow:auto;max-height:75vh;border:1px solid #ccc;background:#fff}"
        f".grid{{display:grid;grid-template-columns:{LABEL_W}px max-content}}"
        ".grid>svg{display:block}"
        ".corner{position:sticky;top:0;left:0;z-index:3;background:#fff;border-bottom:1px solid #ccc}"
        ".axis{position:sticky;top:0;z-index:2;background:#fff;border-bottom:1px solid #ccc}"
        ".names{position:sticky;left:0;z-index:2;background:#fff;border-right:1px solid #ccc}"
        "svg text{font:11px system-ui,sans-serif;fill:#333}.names text.off{fill:#999;font-style:italic}"
        ".lanes{shape-rendering:crispEdges}.alt{fill:#f4f6f8}.tick{stroke:#e3e3e3}"
        ".lap{stroke:#666;stroke-dasharray:3 3}.lapt{fill:#555;font-weight:600}"
        ".due{fill:#333}.nowl{stroke:#c00}rect[data-status=running]{stroke:#0b6f7a}"
        + status_rules +
        ".pool{fill:#9ecae1;stroke:#3182bd}.limit{stroke:#c00;stroke-dasharray:5 3}"
        ".empty{color:#777;font-style:italic;border:1px dashed #bbb;padding:10px;margin:0}"
        "table.runs{border-collapse:collapse;font-size:12px;margin-top:4px}"
        ".runs th,.runs td{border-bottom:1px solid #eee;padding:2px 8px;text-align:left;vertical-align:top}"
        ".runs th{position:sticky;top:0;background:#fafafa}.runs td.n{text-align:right;"
        "font-variant-numeric:tabular-nums}.st{font-weight:600}.runs td.w{max-width:40em;"
        "overflow-wrap:anywhere}"
    )


def header(tl: Timeline, clock: Clock, title: str, source: str, generated: Optional[float]) -> str:
    n = len(tl.bars)
    what = (f"{n} run{'s' if n != 1 else ''} of {sum(1 for lane in tl.lanes if lane.runs)} agent(s) "
            f"started from {clock.full(tl.since)} to {clock.full(tl.until)}; times in {clock.zone}")
    made = f"; made {clock.full(generated)}" if generated is not None else ""
    src = f"<p class=\"meta\">{text(source)}</p>" if source else ""
    return f"<h1>{text(title)}</h1>{src}<p class=\"meta\">{text(what)}{text(made)}</p>"


def legend(tl: Timeline) -> str:
    items = []
    for s, colour in COLOURS.items():
        k = tl.counts.get(s, 0)
        zero = "" if k else " class=\"zero\""
        items.append(f"<li{zero}><span class=\"sw k-{s}\"></span>{s} ({k})</li>")
    items.append("<li><span class=\"sw lap\"></span>lap boundary</li>")
    if any(lane.scheduled for lane in tl.lanes):
        items.append("<li><span class=\"sw due\"></span>scheduled agent due</li>")
    if tl.start <= tl.now <= tl.end:
        items.append("<li><span class=\"sw now\"></span>now</li>")
    return f"<ul class=\"legend\" id=\"legend\">{''.join(items)}</ul>"


def chart(tl: Timeline, clock: Clock, scale: Scale) -> str:
    width = scale.width
    height = max(1, len(tl.lanes)) * LANE_H
    marks = ticks(tl.start, tl.end, width, clock.tz)
    with_seconds = len(marks) > 1 and marks[1] - marks[0] < 60
    axis = [f"<svg class=\"axis\" width=\"{width}\" height=\"{AXIS_H}\">"]
    for t in marks:
        if scale.x(t) < width - 60:   # (a label the edge would cut is left out; its grid line stays)
            axis.append(f"<text x=\"{scale.x(t) + 2:.1f}\" y=\"12\">{clock.at(t, with_seconds)}</text>")
    for lap, _ in shown_laps(tl, scale):
        label = f"lap {lap.number}" if lap.number is not None else "lap"
        x = scale.x(lap.at)
        if x < width - 44:   # (a label the edge would cut is left to its line's tooltip)
            axis.append(f"<text class=\"lapt\" x=\"{x + 2:.1f}\" y=\"26\">{label}</text>")
    axis.append("</svg>")
    names = [f"<svg class=\"names\" width=\"{LABEL_W}\" height=\"{height}\">"]
    for lane in tl.lanes:
        cut = text(lane.name, NAME_CHARS)
        cls = "" if lane.on_roster else " class=\"off\""
        note = "" if lane.on_roster else " (not on the roster)"
        names.append(f"<text{cls} x=\"6\" y=\"{lane.index * LANE_H + 13}\"><title>{text(lane.name)}{note}, "
                     f"{lane.runs} run(s)</title>{cut}</text>")
    names.append("</svg>")
    return ("<h2>Timeline</h2><div class=\"scroll\"><div class=\"grid\">"
            f"<div class=\"corner\"></div>{''.join(axis)}{''.join(names)}"
            f"{lanes(tl, clock, scale, marks, height)}</div></div>")


def lanes(tl: Timeline, clock: Clock, scale: Scale, marks: Sequence[float], height: int) -> str:
    out = [f"<svg class=\"lanes\" width=\"{scale.width}\" height=\"{height}\">"]
    out += [f"<rect class=\"alt\" x=\"0\" y=\"{lane.index * LANE_H}\" width=\"{scale.width}\" height=\"{LANE_H}\"/>"
            for lane in tl.lanes if lane.index % 2]
    out += [f"<line class=\"tick\" x1=\"{scale.x(t):.1f}\" x2=\"{scale.x(t):.1f}\" y1=\"0\" y2=\"{height}\"/>"
            for t in marks]
    for lap, more in shown_laps(tl, scale):
        x = f"{scale.x(lap.at):.1f}"
        also = f" (and {more} more lap(s) before the next line)" if more else ""
        out.append(f"<line class=\"lap\" x1=\"{x}\" x2=\"{x}\" y1=\"0\" y2=\"{height}\"><title>lap"
                   f"{'' if lap.number is None else ' ' + str(lap.number)} began {clock.at(lap.at)}{also}</title></line>")
    top = (LANE_H - BAR_H) // 2
    for b in tl.bars:
        x, w = scale.bar(b)
        out.append(f"<rect data-run-id=\"{b.run_id}\" data-status=\"{b.status}\" x=\"{x:.1f}\" "
                   f"y=\"{b.lane * LANE_H + top}\" width=\"{w:.1f}\" height=\"{BAR_H}\">"
                   f"<title>{tooltip(b, clock)}</title></rect>")
    for d in tl.dues:
        x, y = scale.x(d.at), d.lane * LANE_H
        out.append(f"<path class=\"due\" d=\"M{x - 5:.1f},{y}h10l-5,7z\"><title>{text(d.agent)} due "
                   f"{clock.at(d.at)}</title></path>")
    if tl.start <= tl.now <= tl.end:
        x = f"{scale.x(tl.now):.1f}"
        out.append(f"<line class=\"nowl\" x1=\"{x}\" x2=\"{x}\" y1=\"0\" y2=\"{height}\"><title>now, "
                   f"{clock.at(tl.now)}</title></line>")
    out.append("</svg>")
    return "".join(out)


def shown_laps(tl: Timeline, scale: Scale) -> List[Tuple[Lap, int]]:
    """The lap boundaries drawn, each with how many more began before the next
    one drawn: a line at most every LAP_GAP px, so a hundred short laps in a
    day's window stay a few lines, never a hatching that hides the bars."""
    out: List[Tuple[Lap, int]] = []
    last = None
    for lap in tl.laps:
        x = scale.x(lap.at)
        if last is not None and x - last < LAP_GAP:
            out[-1] = (out[-1][0], out[-1][1] + 1)
            continue
        out.append((lap, 0))
        last = x
    return out


def tooltip(b: Bar, clock: Clock) -> str:
    took = "running for " + fmt_duration(b.end - b.start) if b.running else fmt_duration(b.duration)
    lines = [f"run {b.run_id} \u00b7 {text(b.agent)} \u00b7 {b.status} \u00b7 {took}", f"started {clock.at(b.start)}"]
    if b.signal or b.exit_code is not None:
        lines.append(f"exit {exit_text(b.exit_code, b.signal)}")
    if b.phase:
        lines.append(f"phase: {text(b.phase, TITLE_CHARS)}")
    if b.reason:
        lines.append(f"reason: {text(b.reason, TITLE_CHARS)}")
    return "\n".join(lines)


def exit_text(code: Optional[int], sig: Optional[int]) -> str:
    if sig:
        import signal
        try:
            return signal.Signals(sig).name
        except ValueError:
            return f"signal {sig}"
    return "-" if code is None else str(code)


def pools(tl: Timeline, clock: Clock, scale: Scale) -> str:
    """Quota pools' use over the window, or a clearly empty slot."""
    head = "<h2>Quota pools</h2>"
    if tl.pools is None:
        return (f"{head}<section id=\"quotas\" class=\"quotas\"><p class=\"empty\">No quota pools: this "
                f"ring's status reports none, so there is no use to draw.</p></section>")
    if not tl.pools:
        return (f"{head}<section id=\"quotas\" class=\"quotas\"><p class=\"empty\">No quota pools are "
                f"configured.</p></section>")
    return f"{head}<section id=\"quotas\" class=\"quotas\">{''.join(pool_svg(p, scale) for p in tl.pools)}</section>"


def pool_svg(p: PoolUse, scale: Scale, height: int = 60) -> str:
    top = max([p.limit] + [u for _, u in p.steps]) or 1.0

    def y(u: float) -> float:
        return height - 2 - (height - 6) * u / top
    points: List[str] = [f"{scale.x(p.steps[0][0]):.1f},{height}"]
    for (t, u), nxt in zip(p.steps, list(p.steps[1:]) + [None]):
        x1 = scale.x(t)
        x2 = scale.x(nxt[0]) if nxt is not None else x1
        points += [f"{x1:.1f},{y(u):.1f}", f"{x2:.1f},{y(u):.1f}"]
    points.append(f"{scale.x(p.steps[-1][0]):.1f},{height}")
    label = f"{text(p.name)}: limit {p.limit:g} per {fmt_duration(p.window)}"
    return (f"<div class=\"scroll\"><div class=\"grid\"><svg class=\"names\" width=\"{LABEL_W}\" "
            f"height=\"{height}\"><text x=\"6\" y=\"14\">{label}</text></svg>"
            f"<svg width=\"{scale.width}\" height=\"{height}\"><polygon class=\"pool\" points=\"{' '.join(points)}\"/>"
            f"<line class=\"limit\" x1=\"0\" x2=\"{scale.width}\" y1=\"{y(p.limit):.1f}\" y2=\"{y(p.limit):.1f}\"/>"
            f"</svg></div></div>")


def table(tl: Timeline, clock: Clock) -> str:
    """Every run in the window, newest first (omitted end tags keep 10,000 rows small)."""
    rows = ["<h2>Runs</h2><table class=\"runs\"><thead><tr><th>run<th>agent<th>status<th>started<th>took"
            "<th>exit<th>phase<th>reason<tbody>"]
    for b in reversed(tl.bars):
        took = fmt_duration(b.end - b.start) + "+" if b.running else fmt_duration(b.duration)
        rows.append(f"<tr id=\"run-{b.run_id}\" data-status=\"{b.status}\"><td class=\"n\">{b.run_id}"
                    f"<td>{text(b.agent)}<td class=\"st\">{b.status}<td>{clock.at(b.start)}<td class=\"n\">{took}"
                    f"<td class=\"n\">{exit_text(b.exit_code, b.signal)}<td class=\"w\">{text(b.phase)}"
                    f"<td class=\"w\">{text(b.reason)}")
    if not tl.bars:
        rows.append("<tr><td colspan=\"8\" class=\"empty\">no run started in this window")
    rows.append("</table>")
    return "\n".join(rows)
