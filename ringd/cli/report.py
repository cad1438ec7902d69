"""``ringd report``: read the journal as ``status`` and ``history`` do, build the timeline, write the page.

The journal is read as ``status`` and ``history`` read it: reaping first
(:mod:`ringd.cli.reap`), then through :mod:`ringd.cli.status`, one read-only
pass over the runs that started in the window, newest first, in batches
(never a scan of older history). The picture is built by
:func:`ringd.core.timeline.build_timeline` and drawn by :mod:`ringd.cli.reporthtml`.
The file is written whole or not at all (a temporary file renamed over it).
"""
from __future__ import annotations

import os
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence

from ringd.cli import reporthtml
from ringd.cli.reap import reap_before_reading
from ringd.cli.status import gather_status, history_since, open_reader, require_state_dir
from ringd.core.errors import EX_BAD_USAGE, RingError
from ringd.core.records import RunRow
from ringd.core.timeline import PoolUse, Timeline, build_timeline, pool_use
from ringd.core.timefmt import parse_iso
from ringd.inputs import schedule
from ringd.inputs.config import Config
from ringd.journal.sqlite import JournalError

DEFAULT_WINDOW = 86400.0
DEFAULT_FILE = "ring-report.html"


def gather_runs(state_dir: Path, config: Config, since: float, until: float) -> List[RunRow]:
    """Runs that started in ``[since, until)``, oldest first (read-only: reaped before)."""
    try:
        reader = open_reader(state_dir, config)
        if reader is None:
            return []
        try:
            rows = history_since(reader, None, since, None)
            if rows and config.quotas and reader.knows_quotas():   # each pool's use over the window
                used = reader.used_by_runs([r.id for r in rows])
                rows = [replace(r, used=used.get(r.id, {})) for r in rows]
        finally:
            reader.close()
    except JournalError as e:
        raise RingError(str(e)) from None
    return [r for r in reversed(rows) if r.started_at is not None and r.started_at < until]


def build(state_dir: Path, config: Config, *, since: Optional[float], until: Optional[float],
          now: Optional[float] = None, warnings: Optional[List[str]] = None) -> Timeline:
    """The timeline of a ring's window (default: the last 24 hours, fitted to its runs)."""
    now = time.time() if now is None else now
    fit = since is None
    until = now if until is None else until
    since = now - DEFAULT_WINDOW if since is None else since
    if since >= until:
        raise RingError(f"--since ({reporthtml.Clock(schedule.local_zone(), now).full(since)}) is not "
                        f"before --until ({reporthtml.Clock(schedule.local_zone(), now).full(until)})",
                        EX_BAD_USAGE)
    require_state_dir(state_dir)
    warning = reap_before_reading(state_dir, config)   # (as status and history do)
    if warning and warnings is not None:
        warnings.append(warning)
    doc = gather_status(state_dir, config, now=now, warnings=warnings)
    runs = with_live_phase(gather_runs(state_dir, config, since, until), doc)
    roster = [a["name"] for a in doc["agents"]]
    scheduled = {n for n in set(roster) | {r.agent for r in runs} if config.schedule_for(n) is not None}
    newest_included = bool(runs) and doc.get("driver", {}).get("lap") is not None and (
        doc.get("current") is None or any(r.id == doc["current"]["run_id"] for r in runs))
    return build_timeline(
        runs, since=since, until=until, now=now, roster=roster, scheduled=scheduled,
        dues=due_times(config, doc, runs, scheduled, since, max(until, now)),
        lap=doc["driver"]["lap"] if newest_included and until >= now else None,
        pools=quota_pools(doc, runs, since, max(until, now)), fit=fit)


def with_live_phase(runs: List[RunRow], doc: Mapping[str, Any]) -> List[RunRow]:
    """The run in flight with the phase its agent says now (kept on the row only when it ends)."""
    current = doc.get("current")
    if not current or not current.get("phase"):
        return runs
    return [replace(r, phase=current["phase"]) if r.id == current["run_id"] and r.status == "running" else r
            for r in runs]


def due_times(config: Config, doc: Mapping[str, Any], runs: Sequence[RunRow], scheduled: set,
              since: float, until: float) -> Dict[str, List[float]]:
    """When each scheduled agent was due in the window, and its next due time."""
    zone = schedule.local_zone()
    out: Dict[str, List[float]] = {}
    next_due = {a["name"]: parse_iso(a.get("next_due")) for a in doc["agents"]}
    for name in scheduled:
        sched = config.schedule_for(name)
        starts = [r.started_at for r in runs if r.agent == name]
        times = schedule.due_between(sched, starts, since, until, zone)
        nxt = next_due.get(name)
        if nxt is not None and all(abs(nxt - t) > 0.5 for t in times):   # (ISO times keep microseconds)
            times.append(nxt)
        out[name] = times
    return out


def quota_pools(doc: Mapping[str, Any], runs: Sequence[RunRow], since: float,
                until: float) -> Optional[List[PoolUse]]:
    """Each pool's use over the window from ``status --json``'s ``quotas`` and
    the runs' ``used``; None when the status has no ``quotas`` at all."""
    pools = doc.get("quotas")
    if not isinstance(pools, list):
        return None
    out = []
    for p in pools:
        if not isinstance(p, dict) or not isinstance(p.get("name"), str):
            continue
        window = float(p.get("window") or 0) or until - since
        uses = [((r.ended_at or r.started_at), float(used[p["name"]])) for r in runs
                if isinstance(used := getattr(r, "used", None), dict) and isinstance(used.get(p["name"]), (int, float))]
        out.append(PoolUse(p["name"], float(p.get("limit") or 0), window, pool_use(uses, window, since, until)))
    return out


def page(state_dir: Path, config: Config, config_path: Optional[Path], tl: Timeline, now: float) -> str:
    source = f"state {state_dir}, config {config_path or '(built-in defaults)'}"
    return reporthtml.render(tl, tz=schedule.local_zone(), title="ring report", source=source, generated=now)


def write(output: str, html: str) -> int:
    """Write the page to ``output`` (``-``: standard output); returns its size in bytes."""
    blob = html.encode("utf-8", "replace")
    if output == "-":
        sys.stdout.flush()
        sys.stdout.buffer.write(blob)
        sys.stdout.buffer.flush()
        return len(blob)
    path = Path(output)
    folder = path.parent if str(path.parent) else Path(".")
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(blob)
        mask = os.umask(0)
        os.umask(mask)
        os.chmod(tmp, 0o666 & ~mask)   # a page to pass on: the mode a new file would get
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return len(blob)
