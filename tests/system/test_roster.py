"""Roster parsing and the resume rule (pure)."""
import os
import time

import pytest

from conftest import wait_until

from ringd.inputs.roster import RosterError, RosterSource, next_index, parse_roster, read_roster, resolve_program


def parse(text, tmp_path):
    return parse_roster(text, tmp_path / "ring.txt")


def test_parses_names_commands_comments_and_quotes(tmp_path):
    agents = parse("# comment\n\noutreach   ./agents/outreach.sh --nightly\n"
                   "web sh -c 'cd site && make publish'\n  # indented comment\n", tmp_path)
    assert [a.name for a in agents] == ["outreach", "web"]
    assert agents[0].argv == ("./agents/outreach.sh", "--nightly")
    assert agents[1].argv == ("sh", "-c", "cd site && make publish")
    assert agents[1].line == 4


@pytest.mark.parametrize("text, line, words", [
    ("good true\n-bad true\n", 2, "bad agent name"),
    ("a true\na false\n", 2, "duplicate"),
    # logs/web and logs/Web are one folder on macOS (APFS, HFS+) and Windows shares
    ("web true\nok true\nWeb false\n", 3, "duplicate agent name 'Web' (first on line 1 as 'web': "
                                           "names that differ only in case share one log folder"),
    ("a.B-c true\nA.b-C true\n", 2, "duplicate agent name 'A.b-C'"),
    ("a sh -c 'unbalanced\n", 1, "quotation"),
    ("lonely\n", 1, "no command"),
    ("# only comments\n\n", None, "no agents"),
    ("x;drop true\n", 1, "bad agent name"),
    ("$(rm) true\n", 1, "bad agent name"),
    ("a true\nb '' -v\n", 2, "program name is empty"),
    ('a ""\n', 1, "program name is empty"),
    ("a true\rb false\r", 1, "control character (U+000D)"),
    ("a true\x0cb false\n", 1, "control character (U+000C)"),
    ("a true\u2028b false\n", 1, "control character (U+2028)"),
    ("# note\x1b[31m\na true\n", 1, "control character (U+001B)"),
    ("a\u00a0true\n", 1, "bad agent name"),
    ("a\u3000true\n", 1, "bad agent name"),
    # Trojan Source: a line that shows other than it runs
    ("a /bin/echo safe \u202e; txt.gnir\n", 1, "invisible format character (U+202E RIGHT-TO-LEFT OVERRIDE)"),
    ("a true\nb /bin/echo \u2066x\u2069\n", 2, "invisible format character (U+2066"),
    ("a ./agents/out\u200breach.sh\n", 1, "invisible format character (U+200B ZERO WIDTH SPACE)"),
    ("a /bin/rm -rf /tmp/x\u00ad\n", 1, "(U+00AD"),
    ("# ok\u2067 note\na true\n", 1, "(U+2067"),
    ("a true\nb true \ufeff\n", 2, "(U+FEFF"),
    ("a true \U000e0041\n", 1, "(U+E0041"),
])
def test_errors_name_file_line_and_reason(tmp_path, text, line, words):
    with pytest.raises(RosterError) as e:
        parse(text, tmp_path)
    assert e.value.line == line
    assert words in str(e.value)
    assert str(tmp_path / "ring.txt") in str(e.value)


def test_the_invisible_characters_refused_are_exactly_unicodes_format_characters():
    """Every Cf character this Python knows is refused, and nothing else is but
    what Unicode had not assigned then (a newer Unicode's Cf)."""
    import sys
    import unicodedata
    from ringd.inputs.roster import _FORMAT
    for cp in range(sys.maxunicode + 1):
        ch = chr(cp)
        category = unicodedata.category(ch)
        if category == "Cf":
            assert _FORMAT.fullmatch(ch), f"U+{cp:04X} {unicodedata.name(ch, '')} is not refused"
        elif _FORMAT.fullmatch(ch):
            assert category == "Cn", f"U+{cp:04X} ({category}) is refused"


def test_visible_non_ascii_text_in_a_command_is_kept(tmp_path):
    agents = parse("a /bin/echo \u00e9t\u00e9 \u05e9\u05dc\u05d5\u05dd \u2764 \u00a0\n", tmp_path)
    assert agents[0].argv == ("/bin/echo", "\u00e9t\u00e9", "\u05e9\u05dc\u05d5\u05dd", "\u2764", "\u00a0")


def test_tabs_crlf_and_a_byte_order_mark_are_plain_text(tmp_path):
    agents = parse("\ufeffa\ttrue -x\r\n\tb  false\t\r\n", tmp_path)
    assert [(a.name, a.argv) for a in agents] == [("a", ("true", "-x")), ("b", ("false",))]


def test_unsafe_and_absurd_files(tmp_path):
    p = tmp_path / "ring.txt"
    p.write_bytes(b"a true\n\xff\xfe b true\n")
    os.chmod(p, 0o600)
    with pytest.raises(RosterError, match="UTF-8"):
        read_roster(p)
    p.write_text("a true\n")
    os.chmod(p, 0o666)
    with pytest.raises(RosterError, match="writable by group or others"):
        read_roster(p)


def test_relative_programs_resolve_against_roster_folder(tmp_path):
    assert resolve_program(("./x.sh", "-v"), tmp_path) == [str(tmp_path / "x.sh"), "-v"]
    assert resolve_program(("python3", "-m", "x"), tmp_path) == ["python3", "-m", "x"]
    assert resolve_program(("/bin/true",), tmp_path) == ["/bin/true"]


def test_next_index_resumes_after_last_by_name_and_wraps():
    names = ["a", "b", "c"]
    assert next_index(names, None, None) == 0
    assert next_index(names, "a", 0) == 1
    assert next_index(names, "c", 2) == 0          # wrap-around
    assert next_index(["a", "x", "b", "c"], "b", 1) == 3  # by name, not position


def test_next_index_removed_agent_continues_from_its_position():
    # b (position 1) was removed: c moved up into position 1 and runs next
    assert next_index(["a", "c"], "b", 1) == 1
    assert next_index(["a", "c"], "z", 7) == 0   # past the end: the lap is over, the ring starts again


def test_next_index_last_agents_removed_gives_the_first_agent_its_turn():
    # a, b, c, d; d (position 3) ran last; c and d removed: after d came a, and a is
    # still first - b must not take a's turn (3 % 2 == 1 would pick b)
    assert next_index(["a", "b"], "d", 3) == 0
    assert next_index(["a", "b", "c"], "e", 4) == 0


def test_source_keeps_last_good_roster_on_broken_edit(tmp_path):
    p = tmp_path / "ring.txt"
    p.write_text("a true\n")
    os.chmod(p, 0o600)
    src = RosterSource(p)
    assert src.refresh() and src.names == ["a"]
    assert not src.refresh()                       # unchanged: one stat, no re-read
    p.write_text("a true\nb 'broken\n")
    assert src.refresh()
    assert src.names == ["a"] and "ring.txt:2" in src.error
    p.write_text("a true\nb true\n")
    assert src.refresh()
    assert src.names == ["a", "b"] and src.error is None
    p.unlink()
    assert src.refresh() and src.names == ["a", "b"] and "not found" in src.error


def test_source_sees_an_in_place_edit_that_kept_size_inode_and_mtime(tmp_path):
    """``cp -p``/``touch -r``/``tar x`` over the roster: same inode, same size, the
    old mtime. Only ctime (which nobody can set) tells the edit apart."""
    p = tmp_path / "ring.txt"
    p.write_text("a true\nb true\n")
    os.chmod(p, 0o600)
    old = p.stat()
    an_hour_ago = old.st_mtime_ns - 3600 * 10 ** 9
    os.utime(p, ns=(an_hour_ago, an_hour_ago))
    src = RosterSource(p)
    assert src.refresh() and src.names == ["a", "b"]
    ino = p.stat().st_ino
    wait_until(lambda: time.time_ns() > p.stat().st_ctime_ns + 50 * 10 ** 6, 5, message="a later ctime tick")
    with open(p, "r+") as f:       # in place: same inode, same size
        f.write("b true\na true\n")
    os.utime(p, ns=(an_hour_ago, an_hour_ago))
    assert (p.stat().st_ino, p.stat().st_size, p.stat().st_mtime_ns) == (ino, old.st_size, an_hour_ago)
    assert src.refresh(), "the edit was missed"
    assert src.names == ["b", "a"]


def test_an_edit_in_the_clock_tick_of_the_last_read_is_not_missed(tmp_path, monkeypatch):
    """Time stamps have a granularity (a kernel tick on ext4 before Linux 6.13):
    an in-place edit of the same size right after the driver read the file can
    leave every stamp as it was. A read that soon after the file's change is
    not trusted: the file is read again until a read comes later (stamps here
    are scripted, as no file system of this box's kernel repeats them)."""
    from ringd.inputs.roster import RACY_NS
    p = tmp_path / "ring.txt"
    p.write_text("a true\n")
    os.chmod(p, 0o600)
    stamp = 1_700_000_000 * 10 ** 9
    now = [stamp + 10 ** 6]                 # read 1 ms after the change
    src = RosterSource(p, clock=lambda: now[0])
    monkeypatch.setattr(src, "_stat_signature", lambda: (stamp, stamp, 7, 1, 1, 0o100600))
    assert src.refresh() and src.names == ["a"]
    p.write_text("b true\n")               # same size, same stamps
    assert src.refresh() and src.names == ["b"], "the edit was missed"
    assert not src.refresh()                # read again, as it was: no change
    now[0] = stamp + RACY_NS                # a read this late is the file's last word ...
    p.write_text("c true\n")
    assert src.refresh() and src.names == ["c"]
    p.write_text("d true\n")               # (... as a later edit would get later stamps)
    assert not src.refresh() and src.names == ["c"], "a settled file is one stat, no read"


@pytest.mark.parametrize("command", [
    "x.sh --nightly  # runs at night", "x.sh a#b", "x.sh '#q' \"#d\"", "x.sh \\#e", "x.sh #", "x.sh\t#tab",
    "x.sh url#frag", "x.sh \"a\"#b", "x.sh \"a # b\" c", "x.sh 'a # b' #c 'd'", "x.sh \"q\\\"#\" #z",
    "x.sh a\\ #b", "x.sh ''#x",
])
def test_a_command_splits_as_a_posix_shell_splits_it_trailing_comment_included(tmp_path, command):
    """SPEC: the command is split like a POSIX shell would. A shell drops an
    unquoted word-initial ``#`` and the rest of the line; shlex (comments off)
    passed '#', 'runs', 'at', 'night' to the agent as arguments."""
    import subprocess
    (agent,) = parse(f"a {command}\n", tmp_path)
    out = subprocess.run(["/bin/sh", "-c", f"set -- {command}\nprintf '%s\\0' \"$@\""],
                         capture_output=True, timeout=10, check=True).stdout
    assert list(agent.argv) == out.decode().split("\0")[:-1]


def test_a_warning_about_a_long_program_path_is_one_short_line(tmp_path):
    from ringd.inputs.roster import program_problem
    long_dir = "/".join(["d" * 200] * 30)      # 6 kB: a legal roster line
    for argv in ((f"./{long_dir}/x.sh",), (f"/{long_dir}/x.sh",)):
        problem = program_problem(argv, tmp_path)
        assert problem and "not found" in problem and len(problem) < 250, problem[:300]


def test_a_roster_caught_half_written_in_place_never_replaces_the_last_good_one(tmp_path):
    """An editor that rewrites the file in place (nano, ``cat >``) truncates it,
    then writes it in chunks: a read in between sees an empty file, or one cut
    mid-line - and a line cut mid-word may parse (``--dry-run`` cut to ``--dry``,
    or dropped). The driver ran that cut command at the next hop. A file read
    within RACY_NS of its change that is empty or ends without a newline is
    being written: the last good roster stays, no error, and it is read again
    at the next refresh until it is whole or settles."""
    from ringd.inputs.roster import RACY_NS
    p = tmp_path / "ring.txt"
    p.write_text("a true\nb deploy --dry-run\n")
    os.chmod(p, 0o600)
    now = [time.time_ns()]
    src = RosterSource(p, clock=lambda: now[0])
    assert src.refresh() and src.names == ["a", "b"]
    good = list(src.agents)
    for partial in ("", "a true\nb deploy --dry", "a true\nb deploy", "a tr"):
        with open(p, "r+") as f:              # in place: truncated, then written in part
            f.truncate(0)
            f.write(partial)
        now[0] = time.time_ns()
        assert not src.refresh(), f"a half-written roster was taken: {partial!r}"
        assert src.agents == good and src.error is None, partial
    with open(p, "r+") as f:
        f.truncate(0)
        f.write("a true\nb deploy --dry-run\nc true\n")
    now[0] = time.time_ns()
    assert src.refresh() and src.names == ["a", "b", "c"] and src.agents[1].argv == ("deploy", "--dry-run")
    # a file that is left without a final newline is taken once it has settled
    p.write_text("a true\nb true")
    now[0] = time.time_ns()
    assert not src.refresh() and src.names == ["a", "b", "c"]
    now[0] = time.time_ns() + RACY_NS
    assert src.refresh() and src.names == ["a", "b"] and src.error is None
    # ... and so is an empty one: then it is an error, the last good roster kept
    p.write_text("")
    now[0] = time.time_ns()
    assert not src.refresh() and src.error is None
    now[0] = time.time_ns() + RACY_NS
    assert src.refresh() and src.names == ["a", "b"] and "no agents" in src.error


def test_a_first_read_takes_the_roster_as_it_is(tmp_path):
    """With no last good roster to keep (the driver's start), there is nothing to
    wait for: ``ringd run`` reads what ``ringd check`` reads."""
    p = tmp_path / "ring.txt"
    p.write_text("a true")
    os.chmod(p, 0o600)
    src = RosterSource(p)
    assert src.refresh(force=True) and src.names == ["a"] and src.error is None
    q = tmp_path / "empty.txt"
    q.write_text("")
    os.chmod(q, 0o600)
    src = RosterSource(q)
    assert src.refresh(force=True) and "no agents" in src.error


def test_an_error_about_a_roster_in_a_folder_with_a_colon_names_its_path_once(tmp_path):
    """The reason was cut from the file check's message at its first ': ' - inside
    a path like '/srv/ring: prod/ring.txt' - so the error named half the path twice."""
    folder = tmp_path / "ring: prod"
    folder.mkdir()
    p = folder / "ring.txt"
    p.write_text("a true\n")
    os.chmod(p, 0o620)
    with pytest.raises(RosterError) as e:
        read_roster(p)
    assert str(e.value).startswith(f"{p}: roster is writable by group or others"), str(e.value)
    assert e.value.reason.startswith("roster is writable")


def test_check_warns_of_a_program_that_is_a_fifo(tmp_path):
    """exec takes only a regular file: a FIFO with execute bits passed ringd
    check (--strict too) as a fine program, and every run of it ended 'error'."""
    from ringd.inputs.roster import program_problem
    os.mkfifo(tmp_path / "agent", 0o755)
    problem = program_problem(("./agent",), tmp_path)
    assert problem and "is not executable" in problem, problem


def test_check_and_the_driver_read_every_generated_roster_alike(tmp_path):
    """Whatever ``ringd check`` accepts (read_roster), ``ringd run`` runs (the
    driver's RosterSource at start-up): the same agents, or the same one-line
    error naming the file, on many generated rosters of hostile pieces."""
    import random
    pieces = ["a true", "b /bin/true --x", "c sh -c 'exit 0'", "# c", "", "\ufeffd true", "e true\r", "f 'unbal",
              "g", "A true", "a true", "h ./x.sh # c", "i\ttrue", "k \x00", "l\u00a0true", "m true \\", "-o true",
              "p ''", "q \"a b\"#c", "r " + "z" * 9000, "s caf\u00e9", "t \x1b[2J", " \t", "u\u2028v true", "w\x85 x"]
    rng = random.Random(12)
    p = tmp_path / "ring.txt"
    for _ in range(400):
        text = "\n".join(rng.choice(pieces) for _ in range(rng.randint(0, 5))) + rng.choice(["", "\n", "\r\n"])
        blob = text.encode("utf-8", "surrogatepass") if rng.random() < 0.9 else text.encode() + b"\xff"
        p.write_bytes(blob)
        os.chmod(p, 0o600)
        try:
            checked, check_error = [(a.name, a.argv) for a in read_roster(p)], None
        except RosterError as e:
            checked, check_error = [], str(e)
        src = RosterSource(p)
        src.refresh(force=True)
        assert ([(a.name, a.argv) for a in src.agents], src.error) == (checked, check_error), repr(blob[:200])
        if check_error:
            assert str(p) in check_error and "\n" not in check_error and len(check_error) < 400, check_error


def test_wraps_judges_the_lap_by_the_roster_as_it_is_now():
    from ringd.inputs.roster import wraps
    names = ["b", "c", "d"]                      # a removed from a b c d
    assert not wraps(names, "c", 2, 2)           # d follows c: same lap (c's old position said 2)
    assert wraps(names, "c", 2, 0) and wraps(names, "c", 2, 1)
    assert wraps(names, "d", 3, 0)               # after the last agent: a new lap
    assert not wraps(names, "x", 1, 1)           # x (gone) held 1: c, now there, follows it
    assert wraps(names, "x", 1, 0) and wraps(names, "x", 3, 0)   # past the end: the lap is over


def test_an_agent_gone_with_agents_before_it_is_followed_by_its_follower():
    """The running agent removed together with agents before it: the position it
    held, in the roster of its turn, is the place after its last surviving
    predecessor. By its old index alone ``a b c d`` (c running) edited to
    ``b d`` went on at b (index 2 is past the end: a new lap), passing over d;
    ``c d`` (b running) at d, passing over c."""
    from ringd.inputs.roster import wraps
    old = ["a", "b", "c", "d"]
    assert next_index(["b", "d"], "c", 2, old) == 1 and not wraps(["b", "d"], "c", 2, 1, old)
    assert wraps(["b", "d"], "c", 2, 0, old)
    assert next_index(["c", "d"], "b", 1, old) == 0 and not wraps(["c", "d"], "b", 1, 0, old)
    assert next_index(["z", "a", "b", "d"], "c", 2, old) == 3          # one added before it too
    assert next_index(["a", "b", "x", "d"], "c", 2, old) == 2          # renamed: x takes its place
    assert next_index(["a", "b", "c"], "d", 3, old) == 0 and wraps(["a", "b", "c"], "d", 3, 0, old)
    assert next_index(["b", "d"], "c", 2) == 0                         # (the roster unknown: its old position)


def test_where_the_ring_goes_on_is_the_rule_whether_or_not_the_agent_is_where_it_was():
    """``next_index`` and ``wraps`` skip the search by name when the last agent
    is still at its position (every turn of an unedited roster): over random
    edits, their answers are the rule's - after the agent by name when it is on
    the roster, else by the roster of its turn, else by its old position."""
    import random
    from ringd.inputs.roster import wraps

    def rule(names, last_name, last_position, last_roster):
        if last_name is not None and last_name in names:
            return names.index(last_name) + 1
        if (last_roster is not None and last_position is not None and 0 <= last_position < len(last_roster)
                and last_roster[last_position] == last_name):
            kept = [names.index(n) for n in last_roster[:last_position] if n in names]
            return max(kept) + 1 if kept else 0
        if last_position is not None and 0 <= last_position < len(names):
            return last_position
        return len(names)

    rng = random.Random(20261203)
    pool = [f"a{i}" for i in range(12)]
    for _ in range(5000):
        old = rng.sample(pool, rng.randint(1, 8))
        names = rng.sample(pool, rng.randint(1, 8))
        last_position = rng.choice([None, -1, len(old), *range(len(old))])
        last_name = rng.choice([None, "gone", *old, *names]) if rng.random() < 0.5 else \
            (old[last_position] if last_position is not None and 0 <= last_position < len(old) else None)
        last_roster = old if rng.random() < 0.7 else None
        at = rule(names, last_name, last_position, last_roster)
        assert next_index(names, last_name, last_position, last_roster) == (at if at < len(names) else 0)
        index = rng.randrange(len(names))
        assert wraps(names, last_name, last_position, index, last_roster) == (index < at)
