"""``ringd logs`` without processes: the last N lines and the prefixed view of
a run log, on logs an agent made hostile (huge, one endless line)."""
from __future__ import annotations

import io
import os
import random
from pathlib import Path

import pytest

from ringd.cli import logs
from ringd.inputs.config import Config
from ringd.core.records import RunRow


def tail_bytes(data: bytes, lines: int) -> bytes:
    """The oracle: the last ``lines`` lines of ``data`` in memory (a last line
    without newline counts), as ``--lines`` once read them."""
    if lines <= 0:
        return b""
    end = len(data) - 1 if data.endswith(b"\n") else len(data)
    cut = end
    for _ in range(lines):
        cut = data.rfind(b"\n", 0, cut)
        if cut < 0:
            return data
    return data[cut + 1:]


def run_row(run_id: int = 7, agent: str = "web", status: str = "ok") -> RunRow:
    return RunRow(id=run_id, agent=agent, position=0, status=status, started_at=0.0, ended_at=1.0,
                  duration=1.0, exit_code=0, signal=None, reason=None, pid=1, pid_start=None,
                  run_budget=None, stall_threshold=None, log_path=None, driver_pid=None, driver_start=None)


def write_log(state: Path, row: RunRow, data: bytes) -> Path:
    folder = state / "logs" / row.agent
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{row.id}.log"
    path.write_bytes(data)
    return path


@pytest.fixture
def counted_reads(monkeypatch):
    """Bytes the code under test read from files (os.read and os.pread)."""
    total = {"bytes": 0}
    real_read, real_pread = os.read, os.pread

    def read(fd, n):
        data = real_read(fd, n)
        total["bytes"] += len(data)
        return data

    def pread(fd, n, off):
        data = real_pread(fd, n, off)
        total["bytes"] += len(data)
        return data

    monkeypatch.setattr(logs.os, "read", read)
    monkeypatch.setattr(logs.os, "pread", pread)
    return total


@pytest.mark.parametrize("seed", range(40))
def test_tail_offset_agrees_with_tail_bytes(tmp_path, seed):
    rnd = random.Random(seed)
    data = bytes(rnd.choice(b"ab\n") for _ in range(rnd.randrange(0, 300)))
    path = tmp_path / "log"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    try:
        for n in range(0, 12):
            assert data[logs.tail_offset(fd, n, chunk=rnd.randrange(1, 20)):] == tail_bytes(data, n), (data, n)
    finally:
        os.close(fd)


BIG = 40 * 1024 * 1024


def test_the_last_lines_of_a_huge_log_read_only_its_end(tmp_path, counted_reads):
    row = run_row()
    write_log(tmp_path, row, b"x" * BIG + b"\nlast one\nlast two\n")
    out = io.BytesIO()
    logs.show_tail(tmp_path, Config(), row, out, 2)
    assert out.getvalue() == b"last one\nlast two\n"
    assert counted_reads["bytes"] < 1024 * 1024, "read the whole log for its last lines"


def test_follow_from_the_last_lines_of_a_huge_log_reads_only_its_end(tmp_path, counted_reads):
    row = run_row()
    write_log(tmp_path, row, b"x\n" * (BIG // 2) + b"last one\nlast two")
    out = io.BytesIO()
    t = logs._Tracked(row, b"web[7]", stamp=lambda: b"18:04:05")
    t.pump(tmp_path, out, skip_to_lines=1)
    t.finish(tmp_path, out)
    assert out.getvalue() == b"web[7] 18:04:05 last two\n"
    assert counted_reads["bytes"] < 1024 * 1024


def test_an_endless_line_is_shown_in_prefixed_pieces_not_held(tmp_path):
    row = run_row()
    path = write_log(tmp_path, row, b"")
    out = io.BytesIO()
    t = logs._Tracked(row, b"web[7]", stamp=lambda: b"18:04:05")
    with open(path, "ab") as f:
        for _ in range(64):
            f.write(b"y" * 65536)
            f.flush()
            t.pump(tmp_path, out)
            assert len(t.partial) < logs.MAX_LINE
        f.write(b"tail\nnext")
    t.pump(tmp_path, out)
    t.finish(tmp_path, out)
    text = out.getvalue()
    head = b"web[7] 18:04:05 "
    assert all(line.startswith(head) and len(line) <= len(head) + logs.MAX_LINE
               for line in text.split(b"\n")[:-1])
    assert text.replace(b"\n" + head, b"") == head + b"y" * (64 * 65536) + b"tail" + b"next\n"


def test_split_lines():
    assert logs.split_lines(b"a\n\nbc", 4) == ([b"a", b""], b"bc")
    assert logs.split_lines(b"abcdefghij\nxyzwv", 4) == ([b"abcd", b"efgh", b"ij", b"xyzw"], b"v")
    assert logs.split_lines(b"", 4) == ([], b"")


def test_an_agent_cannot_forge_another_agents_line_in_the_whole_ring_view(tmp_path):
    row = run_row(5, "a")
    write_log(tmp_path, row, b"ok\rb[6] forged\n\x1b[1A\x1b[2Kb[6] also\n\xc2\x9b2Kc1 \x7f\ttab \xc3\xa9\nend\r")
    out = io.BytesIO()
    t = logs._Tracked(row, b"a[5]", stamp=lambda: b"18:04:05")
    t.pump(tmp_path, out)
    t.finish(tmp_path, out)
    assert out.getvalue() == (b"a[5] 18:04:05 ok^Mb[6] forged\n"
                              b"a[5] 18:04:05 ^[[1A^[[2Kb[6] also\n"
                              b"a[5] 18:04:05 M-^[2Kc1 ^?\ttab \xc3\xa9\n"
                              b"a[5] 18:04:05 end^M\n")


def test_visible():
    assert logs.visible(b"plain \xff\xfe bytes\t") == b"plain \xff\xfe bytes\t"
    assert logs.visible(b"\x00\x1b\x1f") == b"^@^[^_"


@pytest.mark.parametrize("plant", ["fifo", "symlink", "directory", "dir-symlink"])
def test_a_log_an_agent_made_unreadable_is_named_once_and_following_goes_on(tmp_path, plant):
    row = run_row()
    folder = tmp_path / "logs" / row.agent
    folder.mkdir(parents=True)
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "7.log").write_bytes(b"not this run's\n")
    path = folder / "7.log"
    if plant == "fifo":
        os.mkfifo(path)
    elif plant == "symlink":
        path.symlink_to(tmp_path / "elsewhere" / "7.log")
    elif plant == "directory":
        path.mkdir()
    else:
        folder.rmdir()
        folder.symlink_to(tmp_path / "elsewhere")
    said = []
    out = io.BytesIO()
    t = logs._Tracked(row, b"web[7]", said.append)
    assert t.pump(tmp_path, out) is False
    t.pump(tmp_path, out)
    t.finish(tmp_path, out)
    assert out.getvalue() == b"" and len(said) == 1 and "refusing" in said[0], said


def test_the_whole_ring_views_prefix_shows_a_journal_names_control_characters():
    assert logs.prefix_of(run_row(5, "a")) == b"a[5]"
    assert logs.prefix_of(run_row(6, "b\x1b[2K\ra")) == b"b^[[2K^Ma[6]"


def ended_row(**kw) -> RunRow:
    base = dict(id=17, agent="web", position=0, status="timeout", started_at=100.0, ended_at=105.02,
                duration=5.02, exit_code=None, signal=15, reason="run budget of 5s reached", pid=9,
                pid_start=None, run_budget=5.0, stall_threshold=8.0, log_path=None, driver_pid=None,
                driver_start=None)
    base.update(kw)
    return RunRow(**base)


def test_the_end_line_says_status_duration_and_reason():
    assert logs.end_line(ended_row()) == b"web[17] -- timeout after 5.0s (run budget of 5s reached)\n"
    assert logs.end_line(ended_row(status="ok", signal=None, exit_code=0, reason=None)) == \
        b"web[17] -- ok after 5.0s\n"
    assert logs.end_line(ended_row(status="failed", signal=None, exit_code=3, reason=None)) == \
        b"web[17] -- failed after 5.0s (exit 3)\n"
    assert logs.end_line(ended_row(status="failed", signal=9, reason=None)) == \
        b"web[17] -- failed after 5.0s (SIGKILL)\n"
    assert logs.end_line(ended_row(reason="a\x1b[2K\rb\nc")) == b"web[17] -- timeout after 5.0s (a^[[2K b c)\n"
    coloured = logs.end_line(ended_row(), colour=True)
    assert coloured == b"web[17] \x1b[33m-- timeout after 5.0s (run budget of 5s reached)\x1b[0m\n"


def test_the_whole_ring_view_ends_a_run_with_its_end_line(tmp_path):
    row = ended_row(status="running", ended_at=None, duration=None, reason=None, signal=None)
    write_log(tmp_path, row, b"working\nhalf")
    out = io.BytesIO()
    t = logs._Tracked(row, logs.prefix_of(row), stamp=lambda: b"18:04:05")
    t.pump(tmp_path, out)
    t.finish(tmp_path, out, ended_row())
    assert out.getvalue() == (b"web[17] 18:04:05 working\nweb[17] 18:04:05 half\n"
                              b"web[17] -- timeout after 5.0s (run budget of 5s reached)\n")


def test_a_starting_runs_log_is_read_only_once_its_row_has_a_pid(tmp_path):
    """Until the driver has made the run's log (its pid is recorded after the
    spawn, which follows the log), what is at the path may be an old log or a
    planted file the driver is about to set aside: never shown as the run's."""
    row = ended_row(status="running", ended_at=None, duration=None, reason=None, signal=None, pid=None)
    path = write_log(tmp_path, row, b"an old journal's run 17\n")
    out = io.BytesIO()
    t = logs._Tracked(row, b"web[17]", stamp=lambda: b"18:04:05")
    assert t.pump(tmp_path, out) is False and t.fd is None
    os.rename(path, path.with_name("17.log.aside-1"))   # the driver sets it aside, makes the run's own
    path.write_bytes(b"run 17 itself\n")
    t.row = ended_row(status="running", ended_at=None, duration=None, reason=None, signal=None, pid=42)
    t.pump(tmp_path, out)
    assert out.getvalue() == b"web[17] 18:04:05 run 17 itself\n"


@pytest.mark.parametrize("how", ["hard link", "rename"])
def test_a_followed_log_given_to_another_run_shows_none_of_that_runs_bytes(tmp_path, how):
    """A log file whose inode becomes a later run's (linked or renamed to the
    later run's name): what is written to it afterwards is never shown under
    the earlier run's NAME[RUN_ID]; said once."""
    row = ended_row(status="running", ended_at=None, duration=None, reason=None, signal=None)
    path = write_log(tmp_path, row, b"run 17 line\n")
    said, out = [], io.BytesIO()
    t = logs._Tracked(row, b"web[17]", said.append, stamp=lambda: b"18:04:05")
    t.pump(tmp_path, out)
    later = path.with_name("18.log")
    if how == "hard link":
        os.link(path, later)
        os.unlink(path)
    else:
        os.rename(path, later)
    with open(later, "ab") as f:
        f.write(b"run 18 line\n")
    t.pump(tmp_path, out)
    t.finish(tmp_path, out, ended_row())
    text = out.getvalue()
    assert b"run 18" not in text and text.startswith(b"web[17] 18:04:05 run 17 line\n"), text
    assert len(said) == 1 and "moved or replaced" in said[0], said


def test_a_followed_log_pruned_while_it_is_read_is_read_to_its_end(tmp_path):
    """Unlinked (keep_logs pruned it as the next run started): a file with no
    name can be no other run's, so its last lines are still shown."""
    row = ended_row(status="running", ended_at=None, duration=None, reason=None, signal=None)
    path = write_log(tmp_path, row, b"first\n")
    said, out = [], io.BytesIO()
    t = logs._Tracked(row, b"web[17]", said.append, stamp=lambda: b"18:04:05")
    t.pump(tmp_path, out)
    with open(path, "ab") as f:
        f.write(b"last words\n")
    os.unlink(path)
    t.finish(tmp_path, out, ended_row())
    assert out.getvalue().splitlines()[:2] == [b"web[17] 18:04:05 first", b"web[17] 18:04:05 last words"]
    assert said == []


def test_logs_name_shows_the_newest_run_with_a_log_and_names_the_newer_ones_without():
    rows = [ended_row(id=9, status="skipped", reason="skipped by operator", pid=None),
            ended_row(id=8, status="skipped", reason="quarantined until ...", pid=None),
            ended_row(id=7, status="error", reason="cannot open run log")]
    line = logs.logless_line("web", ended_row(id=6), rows)
    assert line == "showing run 6 of web; newer runs had no log: 9 (skipped), 8 (quarantined), 7 (could not start)"
