"""The picture of a ring, pure parts: the timeline model, the HTML page, top's screen, due times."""
from __future__ import annotations

import re
from datetime import datetime, timezone
from html.parser import HTMLParser
from zoneinfo import ZoneInfo


from ringd.cli import reporthtml, topview
from ringd.core.records import RunRow
from ringd.core.timeline import PoolUse, build_timeline, laps_of, pool_use
from ringd.inputs.schedule import Schedule, due_between

T0 = 1_800_000_000.0
EVIL = "<script>alert('x')</script> \"q\" & \x1b[2J\x1b]0;owned\x07 done"


def row(id, agent, status="ok", start=0.0, took=1.0, position=None, phase=None, reason=None, exit_code=0):
    running = status == "running"
    return RunRow(id=id, agent=agent, position=position, status=status, started_at=T0 + start,
                  ended_at=None if running else T0 + start + took, duration=None if running else took,
                  exit_code=None if running else exit_code, signal=None, reason=reason, pid=None, pid_start=None,
                  run_budget=60.0, stall_threshold=90.0, log_path=None, driver_pid=None, driver_start=None,
                  phase=phase)


# --- the model -------------------------------------------------------------------------------------

def test_a_run_is_in_the_window_when_it_started_in_it():
    runs = [row(1, "a", start=-10), row(2, "a", start=0), row(3, "b", start=50, took=100), row(4, "a", start=100)]
    tl = build_timeline(runs, since=T0, until=T0 + 100, now=T0 + 200, roster=["a", "b"])
    assert [b.run_id for b in tl.bars] == [2, 3]
    assert tl.end == T0 + 150   # run 3 started in the window and is drawn whole
    assert (tl.start, tl.counts) == (T0, {"ok": 2})


def test_lanes_follow_the_roster_then_agents_that_left_it():
    runs = [row(1, "gone"), row(2, "b", start=5), row(3, "a", start=9)]
    tl = build_timeline(runs, since=T0, until=T0 + 60, now=T0 + 60, roster=["a", "b", "idle"])
    assert [(lane.name, lane.on_roster, lane.runs) for lane in tl.lanes] == [
        ("a", True, 1), ("b", True, 1), ("idle", True, 0), ("gone", False, 1)]
    assert {b.run_id: b.lane for b in tl.bars} == {1: 3, 2: 1, 3: 0}


def test_a_running_bar_reaches_now_and_fit_keeps_to_the_runs():
    runs = [row(1, "a", start=3600), row(2, "b", "running", start=3700)]
    tl = build_timeline(runs, since=T0, until=T0 + 7200, now=T0 + 3760, roster=["a", "b"], fit=True)
    assert tl.bars[1].end == T0 + 3760 and tl.bars[1].running
    assert T0 + 3590 < tl.start < T0 + 3600 and T0 + 3760 < tl.end < T0 + 3800
    empty = build_timeline([], since=T0, until=T0 + 10, now=T0 + 10, fit=True)
    assert (empty.start, empty.end, empty.bars) == (T0, T0 + 10, ())


def test_lap_boundaries_are_where_the_ring_wraps_and_scheduled_runs_are_no_turn():
    positions = [0, 1, 2, 0, 1, 2, 0]
    runs = [row(k + 1, "abc"[p], start=k * 10, position=p) for k, p in enumerate(positions)]
    runs.insert(2, row(100, "job", start=15, position=3))   # a scheduled run between turns
    laps = laps_of(runs, scheduled={"job"}, lap=7)
    assert [(lap.at - T0, lap.number) for lap in laps] == [(30, 6), (60, 7)]
    assert [lap.number for lap in laps_of(runs, {"job"}, lap=1)] == [None, 1]
    assert [lap.number for lap in laps_of(runs, {"job"})] == [None, None]
    # a roster that shrank: position 2 after position 3 is a wrap too
    assert len(laps_of([row(1, "a", position=3), row(2, "b", start=1, position=2)], set())) == 1


def test_due_times_outside_the_span_are_left_out():
    runs = [row(1, "job", start=100)]
    tl = build_timeline(runs, since=T0, until=T0 + 200, now=T0 + 200, roster=["job"],
                        dues={"job": [T0 + 50, T0 + 150, T0 + 500], "nobody": [T0 + 60]})
    assert [(d.agent, d.at - T0) for d in tl.dues] == [("job", 50), ("job", 150)]


def test_pool_use_counts_each_use_for_its_window():
    uses = [(T0 - 50, 10.0), (T0 + 10, 5.0), (T0 + 20, 1.0), (T0 - 500, 99.0), (T0 + 1000, 7.0)]
    steps = pool_use(uses, 100.0, T0, T0 + 200)
    assert [(t - T0, u) for t, u in steps] == [(0, 10), (10, 15), (20, 16), (50, 6), (110, 1), (120, 0), (200, 0)]
    assert pool_use([], 60.0, T0, T0 + 5) == ((T0, 0.0), (T0 + 5, 0.0))


# --- the page --------------------------------------------------------------------------------------

class Bars(HTMLParser):
    """The bars (data-run-id, data-status), the legend and every tag and attribute of a page."""

    def __init__(self):
        super().__init__()
        self.bars, self.legend, self.tags, self.attrs = [], 0, set(), []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        self.tags.add(tag)
        self.attrs += list(a)
        if "data-run-id" in a:
            self.bars.append((int(a["data-run-id"]), a["data-status"]))
        if a.get("id") == "legend" or "legend" in (a.get("class") or "").split():
            self.legend += 1


def page_of(runs, **kw):
    tl = build_timeline(runs, since=T0 - 10, until=T0 + 3600, now=T0 + 3600, roster=["a", "b"], **kw)
    return tl, reporthtml.render(tl, tz=timezone.utc, source="state /x", generated=T0 + 3600)


def test_the_page_has_a_bar_per_run_a_legend_and_a_table_row_per_run():
    statuses = ["ok", "failed", "deferred", "timeout", "stalled", "skipped", "interrupted", "error", "running"]
    runs = [row(k + 1, "ab"[k % 2], s, start=k * 60, position=k % 2) for k, s in enumerate(statuses)]
    tl, page = page_of(runs, lap=3)
    p = Bars()
    p.feed(page)
    assert p.bars == [(k + 1, s) for k, s in enumerate(statuses)]
    assert p.legend == 1
    assert page.count("<tr id=\"run-") == len(runs)
    for s, colour in reporthtml.COLOURS.items():
        assert f"rect[data-status={s}]{{fill:{colour}}}" in page
    assert "class=\"lapt\"" in page and "id=\"quotas\"" in page and "No quota pools" in page


def test_the_page_needs_nothing_from_outside():
    tl, page = page_of([row(1, "a")])
    p = Bars()
    p.feed(page)
    assert not p.tags & {"script", "link", "img", "iframe", "object", "embed"}
    assert not {"src", "href", "onload", "onclick"} & set(p.attrs)
    assert not re.search(r"url\(|@import|https?:", page)


def test_journal_text_shows_as_text_never_as_markup_or_escapes():
    runs = [row(1, "a", "failed", phase=EVIL, reason=EVIL, exit_code=1)]
    tl, page = page_of(runs)
    assert "<script" not in page and "\x1b" not in page and "\x07" not in page
    assert "&lt;script&gt;alert(&#x27;x&#x27;)&lt;/script&gt; &quot;q&quot; &amp;" in page
    p = Bars()
    p.feed(page)
    assert "script" not in p.tags


def test_bars_keep_a_minimum_width_and_the_chart_widens_for_a_busy_lane():
    runs = [row(k + 1, "a", start=k * 8.0, took=0.01) for k in range(2000)]
    tl = build_timeline(runs, since=T0, until=T0 + 86400, now=T0 + 86400, roster=["a"])
    width = reporthtml.chart_width(tl)
    assert width == 2000 * reporthtml.PER_RUN_W
    scale = reporthtml.Scale(tl, width)
    assert all(scale.bar(b)[1] >= reporthtml.MIN_BAR for b in tl.bars)
    last = scale.bar(tl.bars[-1])
    assert last[0] + last[1] <= width + 0.01
    few = build_timeline(runs[:3], since=T0, until=T0 + 60, now=T0 + 60, roster=["a"])
    assert reporthtml.chart_width(few) == reporthtml.BASE_W


def test_dense_laps_are_thinned_to_readable_lines():
    runs = [row(k + 1, "ab"[k % 2], start=k * 5.0, position=k % 2) for k in range(2000)]
    tl = build_timeline(runs, since=T0, until=T0 + 86400, now=T0 + 86400, roster=["a", "b"], fit=True)
    scale = reporthtml.Scale(tl, reporthtml.chart_width(tl))
    drawn = reporthtml.shown_laps(tl, scale)
    assert len(tl.laps) == 999 and len(drawn) < 100
    assert sum(1 + more for _, more in drawn) == len(tl.laps)
    xs = [scale.x(lap.at) for lap, _ in drawn]
    assert all(b - a >= reporthtml.LAP_GAP for a, b in zip(xs, xs[1:]))


def test_quota_pools_are_drawn_when_the_status_has_them():
    tl = build_timeline([row(1, "a")], since=T0, until=T0 + 60, now=T0 + 60, roster=["a"],
                        pools=[PoolUse("model", 100.0, 3600.0, ((T0, 0.0), (T0 + 30, 40.0), (T0 + 60, 40.0)))])
    page = reporthtml.render(tl, tz=timezone.utc)
    assert "<polygon class=\"pool\"" in page and "model: limit 100 per 1h00m" in page
    none = reporthtml.render(build_timeline([], since=T0, until=T0 + 1, now=T0, pools=[]), tz=timezone.utc)
    assert "No quota pools are configured" in none


def test_times_are_local_and_the_zone_is_named():
    berlin = ZoneInfo("Europe/Berlin")
    noon = datetime(2026, 12, 6, 12, 0, tzinfo=berlin).timestamp()
    clock = reporthtml.Clock(berlin, noon)
    assert clock.zone == "CET (+01:00)"
    assert clock.at(noon) == "12:00:00" and clock.at(noon - 86400) == "2026-12-05 12:00:00"
    ticks = reporthtml.ticks(noon, noon + 3600, 1000, berlin)
    assert all(datetime.fromtimestamp(t, berlin).minute % 5 == 0 for t in ticks) and len(ticks) >= 6


# --- due times -------------------------------------------------------------------------------------

def test_due_between_cron_and_every():
    utc = timezone.utc
    start = datetime(2026, 12, 6, 0, 0, tzinfo=utc).timestamp()
    assert due_between(Schedule(cron="0 */6 * * *"), [], start, start + 86400, utc) == [
        start + h * 3600 for h in (0, 6, 12, 18, 24)]
    assert len(due_between(Schedule(cron="* * * * *"), [], start, start + 86400, utc)) == 500
    assert due_between(Schedule(every=60), [start, start + 100, start + 1000], start, start + 200) == [
        start + 60, start + 160]


# --- top's screen ----------------------------------------------------------------------------------

def status_doc(health="ok", current=True, agents=4, phase="working"):
    now = T0
    doc = {
        "state_dir": "/srv/ring/STATE",
        "driver": {"pid": 10, "health": health, "heartbeat_age": 0.5, "started_at": "2027-01-15T08:00:00+00:00",
                   "lap": 3, "paused": False, "last_pid": 10},
        "watcher": {"pid": None, "alive": False, "last_poll_at": None, "restarts": 0, "gave_up": False},
        "current": {"agent": "a0", "run_id": 7, "pid": 11, "elapsed": 12.0, "run_budget": 60.0,
                    "stall_threshold": 90.0, "phase": phase, "agent_beat_age": 1.5} if current else None,
        "roster": {"path": "/srv/ring/STATE/ring.txt", "agents": agents, "error": None},
        "agents": [{"name": f"a{k}", "position": k, "last_status": "running" if current and k == 0 else "ok",
                    "runs": 3, "consecutive_failures": 0, "backoff_until": None, "skip_requested": False,
                    "quarantined_until": None, "paused": False, "next_due": None} for k in range(agents)],
        "next": {"agent": "a1", "at": None, "in": None, "after_current_run": current},
    }
    return doc, now


def text_of(lines):
    return ["".join(t for t, _ in line) for line in lines]


def test_top_shows_the_current_run_next_turns_problems_and_strips():
    doc, now = status_doc()
    doc["agents"][2]["paused"] = True
    doc["agents"][3]["consecutive_failures"] = 2
    strips = {"a0": ["ok", "failed", "running"], "a1": ["ok"] * 200}
    lines = text_of(topview.top_lines(doc, strips, now, width=100, height=40))
    screen = "\n".join(lines)
    reasons = {"a3": "failed: exit 1 upstream said 500"}
    again = "\n".join(text_of(topview.top_lines(doc, strips, now, width=100, height=40, reasons=reasons)))
    assert "a3: 2 failure(s) in a row, last failed: exit 1 upstream said 500" in again
    assert lines[0].startswith("ring top  /srv/ring/STATE") and lines[0].endswith("q quits")
    assert "a0  run 7, 12s elapsed  beat 1.5s ago" in screen and "phase    working" in screen
    assert "20% of 1m00s, 48s left" in screen
    assert "next     a1 after this run \u2192 a3 \u2192 a0" in screen   # a2 is paused
    assert "a3: 2 failure(s) in a row, last ok" in screen
    a1 = next(x for x in lines if x.lstrip().startswith("1 a1"))
    assert len(a1) == 100 and a1.endswith(topview.CELL * 10)
    assert all(len(x) <= 100 for x in lines)


def test_top_without_colour_uses_letters():
    doc, now = status_doc()
    lines = text_of(topview.top_lines(doc, {"a0": ["ok", "failed", "timeout", "running"]}, now,
                                      width=100, height=40, plain=True))
    assert any(x.endswith(".FT>") for x in lines)
    assert topview.CELL not in "".join(lines)


def test_top_fits_a_small_terminal_and_counts_the_agents_left_out():
    doc, now = status_doc(agents=50)
    lines = text_of(topview.top_lines(doc, {}, now, width=40, height=20))
    assert len(lines) == 20 and all(len(x) <= 40 for x in lines)
    assert any("more agent(s)" in x for x in lines)


def test_top_with_a_stopped_driver_and_an_unreadable_ring():
    doc, now = status_doc(health="stopped", current=False)
    doc["driver"]["pid"] = None
    screen = "\n".join(text_of(topview.top_lines(doc, {}, now, width=100, height=30)))
    assert "STOPPED" in screen and "driver stopped: nothing runs" in screen
    assert "when a driver starts" in screen
    broken = text_of(topview.top_lines(None, {}, now, width=80, height=10, error="journal.db: disk I/O error"))
    assert "cannot read the ring: journal.db: disk I/O error" in broken


def test_top_shows_journal_text_without_its_escapes():
    doc, now = status_doc(phase=EVIL)
    doc["roster"]["error"] = "ring.txt line 3: bad name '\x1b[31mx'"
    doc["agents"][1]["consecutive_failures"] = 1
    lines = topview.safe(topview.top_lines(doc, {}, now, width=200, height=40, reasons={"a1": EVIL}))
    screen = "\n".join(text_of(lines))
    assert "\x1b" not in screen and "\x07" not in screen
    assert "<script>alert('x')</script> \"q\" &" in screen and "[2J" in screen
