"""``ringd logs -f`` across runs and across the whole ring, and ``--lines N``,
against a real driver; following ends with Ctrl-C, exit 0."""
from __future__ import annotations

import re
import signal

from conftest import ring_cmd, wait_until


def follower(ring, *args):
    out = ring.base / f"follow-{len(ring.procs)}.out"
    f = open(out, "wb")
    try:
        p = ring.start(ring_cmd("logs", *ring.common(), *args), stdout=f)
    finally:
        f.close()
    return p, out


def stop(p) -> int:
    p.send_signal(signal.SIGINT)
    return p.wait(timeout=10)


def test_lines_without_follow(ring):
    ring.agent("talk", 'for i in 1 2 3 4 5; do echo "line $i"; done; printf "no newline"')
    ring.roster(f"talk {ring.agents_dir}/talk.sh")
    assert ring.start_driver("--once").wait(timeout=20) == 0
    res = ring.cli("logs", "talk", "--lines", "2")
    assert res.returncode == 0 and res.stdout == "line 5\nno newline", repr(res.stdout)
    assert ring.cli("logs", "talk", "-n", "0").stdout == ""
    assert ring.cli("logs", "talk", "--lines", "100").stdout.startswith("line 1\n")
    res = ring.cli("logs", "--lines", "2")
    assert res.returncode == 2 and "NAME" in res.stderr


def test_follow_an_agent_across_runs(ring):
    ring.write_config(ring={"lap_pause": 1.0})
    ring.agent("hello", 'echo "hello from run $RING_RUN_ID"; sleep 0.3; echo "bye from $RING_RUN_ID"')
    ring.roster(f"hello {ring.agents_dir}/hello.sh")
    assert ring.start_driver("--once").wait(timeout=20) == 0     # an old run, hello not running now
    first = ring.runs()[-1]["id"]
    p, out = follower(ring, "hello", "-f", "--lines", "1")
    wait_until(lambda: f"bye from {first}\n" in out.read_text(), message="the last line of the last run")
    assert p.poll() is None, "follows on, instead of printing an old log and exiting"
    ring.start_driver()
    wait_until(lambda: len(re.findall(r"bye from \d+", out.read_text())) >= 3, timeout=20,
               message="two later runs followed")
    assert stop(p) == 0
    text = out.read_text()
    assert f"hello from run {first}" not in text       # --lines 1 of the old run
    ids = [int(x) for x in re.findall(r"hello from run (\d+)", text)]
    assert ids == sorted(ids) and len(ids) >= 2 and ids[0] > first


def test_follow_the_whole_ring_with_prefixes(ring):
    ring.agent("a", 'echo "from a"; sleep 0.2; printf "a again"')
    ring.agent("b", 'echo "from b" >&2')
    ring.roster(f"a {ring.agents_dir}/a.sh", f"b {ring.agents_dir}/b.sh")
    p, out = follower(ring, "-f")       # no journal yet: it waits for the first driver
    ring.start_driver()
    wait_until(lambda: len(re.findall(r"^b\[\d+\] from b$", out.read_text(), re.M)) >= 2, timeout=20,
               message="two laps followed")
    assert stop(p) == 0
    lines = out.read_text().splitlines()
    assert lines and all(re.match(r"^(a|b)\[\d+\] ", x) for x in lines), lines
    runs = {r["id"]: r["agent"] for r in ring.runs()}
    for x in lines:
        m = re.match(r"^(a|b)\[(\d+)\] (.*)$", x)
        assert runs[int(m.group(2))] == m.group(1)
        assert m.group(3) in ("from a", "a again", "from b")
    assert any(x.endswith("] a again") for x in lines)   # a last line without newline, prefixed too
    assert ring.cli("logs", "ghost", "-f").returncode == 2


def test_follow_goes_on_with_a_journal_put_in_place_of_the_one_followed(ring):
    """The operator moves a journal aside (a damaged one: the driver refuses to
    start on it) and a driver makes a new one: a follower kept reading the old
    file and showed no run again."""
    ring.write_config(ring={"lap_pause": 0.3})
    ring.agent("b", 'echo "run $RING_RUN_ID"')
    ring.roster(f"b {ring.agents_dir}/b.sh")
    driver = ring.start_driver()
    p, out = follower(ring, "-f")
    wait_until(lambda: re.search(r"^b\[\d+\] run \d+$", out.read_text(), re.M), timeout=20,
               message="a run followed")
    driver.send_signal(signal.SIGTERM)
    assert driver.wait(timeout=10) == 0
    last_old = ring.runs()[-1]["id"]
    aside = ring.base / "aside"
    aside.mkdir()
    for f in ring.state.glob("journal.db*"):
        f.rename(aside / f.name)
    ring.start_driver()
    wait_until(lambda: any(int(x) > last_old for x in re.findall(r"^b\[(\d+)\] ", out.read_text(), re.M)),
               timeout=20, message="a run of the new journal followed")
    assert stop(p) == 0
