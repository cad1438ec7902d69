"""The ``ringd`` command line: a thin click layer over functions tests call too.

Every command takes ``--state`` and ``--config``. Errors are one line on stderr,
never a traceback (set ``RINGD_DEBUG=1`` to get one for an internal error).
Rich is imported only by the commands that render tables (``ringd.cli.render``).
"""
from __future__ import annotations

import sys

from ringd.host import earlysig

if earlysig.starting("ringd", "run"):
    earlysig.hold()  # first instruction of the driver: a signal now waits for its handler

import contextlib
import errno
import functools
import io
import json
import os
from pathlib import Path
from typing import List, Optional

import click

from ringd import __version__
from ringd.inputs.config import ConfigError, Location, NoStateDir, lenient_modes, load_config, locate
from ringd.core.errors import EX_CONFIG as EXIT_CONFIG
from ringd.core.errors import EX_INTERRUPTED as EXIT_INTERRUPTED
from ringd.core.errors import EX_BAD_USAGE, EX_FAILURE, EX_IOERR, STATUS_UNKNOWN
from ringd.core.errors import RingError


def open_standard_fds() -> None:
    """A standard descriptor the caller closed (``ringd status >&-``, a cron
    line's ``2>&-``) becomes /dev/null, as if redirected there. Python leaves
    ``sys.stdout``/``sys.stderr`` None for one: every line written was an
    AttributeError (``status`` exit 1 "internal error" while the driver was
    healthy; ``ringd run`` and ``ringwatch`` exited 1 at their first log line,
    having done nothing), and the next file opened would take the number and
    get what a child writes to its stdout. Run at import by both CLIs
    (``ringwatch.cli`` imports this module)."""
    for fd, name, mode in ((0, "stdin", "r"), (1, "stdout", "w"), (2, "stderr", "w")):
        try:
            os.fstat(fd)
            continue
        except OSError:
            pass
        null = os.open(os.devnull, os.O_RDWR)
        if null != fd:
            os.dup2(null, fd)
            os.close(null)
        os.set_inheritable(fd, True)
        if getattr(sys, name) is None:
            setattr(sys, name, open(fd, mode, closefd=False, errors="backslashreplace"))


open_standard_fds()

MAX_ERROR_CHARS = 1000   # an error line never echoes a 100 kB input
RUN_ID = click.IntRange(1, 2 ** 63 - 1)   # SQLite's INTEGER range


class When(click.ParamType):
    """A point in time on the command line (``--since``/``--until``): a duration
    back from now, today, yesterday, an ISO date or date-time, local unless a
    zone is given (ringd.inputs.when). Converted to epoch seconds."""
    name = "when"

    def convert(self, value, param, ctx):
        if isinstance(value, (int, float)):
            return float(value)
        import time
        from ringd.inputs.schedule import local_zone
        from ringd.inputs.when import WhenError, parse_when
        try:
            return parse_when(value, time.time(), local_zone())
        except WhenError as e:
            self.fail(str(e), param, ctx)


WHEN_HELP = ("a duration back from now (2h, 1d 6h), today, yesterday, 18:00, 2026-12-06 or "
             "2026-12-06 18:00 (local unless a zone follows: Z, +01:00)")


def reason_option(fn):
    """--reason TEXT: why, recorded with the request's event (ringd events)."""
    return click.option("--reason", metavar="TEXT", type=ArgText(), default=None,
                        help="Why (recorded with the event, with who asked: see `ringd events`).")(fn)


def _who() -> dict:
    from ringd.cli.actor import who
    return who()


class ArgText(click.ParamType):
    """Free text from the command line (a reason, a phase) as the UTF-8 its
    bytes spell. Python decodes argv with surrogateescape: a byte that is not
    UTF-8 became a lone surrogate, which neither SQLite nor a socket takes (the
    command died as an internal error, or with a traceback). Such a byte is
    U+FFFD here; the rest is kept as given."""
    name = "text"

    def convert(self, value, param, ctx):
        return os.fsencode(value).decode("utf-8", "replace") if isinstance(value, str) else value


def one_line(message: str, limit: int = MAX_ERROR_CHARS) -> str:
    """One line of at most ``limit`` characters, its control characters spaces:
    an error may quote what the journal holds (the agents it knows), and an
    escape sequence there must not reach the operator's terminal."""
    from ringd.host.notify import without_controls
    text = " ".join(without_controls(str(message)).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def fail(message: str, code: int) -> "click.exceptions.Exit":
    click.echo(f"ringd: {one_line(message)}", err=True)
    return click.exceptions.Exit(code)


def drop_output() -> None:
    """Standard output is gone (its reader went away: ``ringd history | head``)
    or fails (OutputError): what is still buffered goes to /dev/null, so the
    interpreter's last flush ends quietly."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass


class RingGroup(click.Group):
    """click, but a usage error is one line on stderr (no usage block), Ctrl-C
    exits 130 without a traceback, and a closed pipe ends quietly. ``ringwatch``
    uses it too (``prog`` names the command in its error lines)."""

    prog = "ringd"

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        no_args_help = getattr(click.exceptions, "NoArgsIsHelpError", None)
        try:
            rv = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except click.ClickException as e:
            if no_args_help is not None and isinstance(e, no_args_help):
                e.show()
                sys.exit(e.exit_code)
            where = ""
            if isinstance(e, click.UsageError) and e.ctx is not None:
                where = f" (see '{e.ctx.command_path} --help')"
            click.echo(f"{self.prog}: {one_line(e.format_message(), 300)}{where}", err=True)
            sys.exit(e.exit_code)
        except click.exceptions.Abort:
            sys.exit(EXIT_INTERRUPTED)
        except KeyboardInterrupt:
            sys.exit(EXIT_INTERRUPTED)
        except BrokenPipeError:
            drop_output()
            sys.exit(EX_FAILURE)
        except OSError as e:
            if e.errno == errno.EPIPE:
                drop_output()
                sys.exit(EX_FAILURE)
            raise
        sys.exit(rv if isinstance(rv, int) else 0)


STATE_HELP = "State directory (default: $RING_STATE, else ring.state_dir of the config, else ./STATE)."
CONFIG_HELP = ("Config file (default: $RING_CONFIG, else the one the state dir's driver runs with, else the "
               "first of ./config/ring.yaml, ~/.config/ring/ring.yaml, /etc/ring/ring.yaml, else built-in).")


def given_locations(ctx: Optional[click.Context]) -> "tuple[Optional[str], Optional[str]]":
    """--state/--config as given after the subcommand, else before it (``ringd --state D status``)."""
    state = config = None
    while ctx is not None:   # (an empty value is kept: resolve_state_dir refuses it)
        state = ctx.params.get("state") if state is None else state
        config = ctx.params.get("config") if config is None else config
        ctx = ctx.parent
    return state, config


def locations(fn=None, *, daemon: bool = False):
    """Add --state/--config and pass resolved ``state_dir`` and ``config_path``
    (config.locate: the one search order). The Location is kept for the command
    (:func:`location`). ``daemon`` (``ringd run``): it never follows a heartbeat's
    config, and refuses a config others may write while finding its state dir."""
    if fn is None:
        return functools.partial(locations, daemon=daemon)

    @click.option("--state", "state", metavar="DIR", default=None, help=STATE_HELP)
    @click.option("--config", "config", metavar="FILE", default=None, help=CONFIG_HELP)
    @functools.wraps(fn)
    def wrapper(state: Optional[str], config: Optional[str], **kw):
        ctx = click.get_current_context()
        state, config = given_locations(ctx)
        try:
            # (a command reads the config again below, and warns about its mode then)
            with contextlib.nullcontext() if daemon else lenient_modes(lambda _message: None):
                where = locate(config, state, follow_driver=not daemon)
        except NoStateDir as e:   # the config that should say where the state dir is cannot be read
            raise fail(f"configuration error: {e}", EXIT_CONFIG)
        except ConfigError as e:   # a path no system call could take
            raise fail(f"invalid: {e}", EXIT_CONFIG)
        ctx.meta["ring.location"] = where
        return fn(state_dir=where.state_dir, config_path=where.config_path, **kw)
    return wrapper


def location() -> Optional[Location]:
    """Where the running command found its ring (:func:`locations`)."""
    ctx = click.get_current_context(silent=True)
    return ctx.meta.get("ring.location") if ctx is not None else None


def command_config(state_dir: Path, config_path: Optional[Path]):
    """The config an operator command acts with: as it loads, or what can be
    salvaged from a broken one after one warning (ringd.cli.found)."""
    from ringd.cli.found import reading_config
    ctx = click.get_current_context(silent=True)
    warn = (ctx.meta.get("ring.warn") if ctx is not None else None) or (lambda m: _warn([m]))
    return reading_config(state_dir, config_path, warn)


def complete_agent(ctx: click.Context, param: click.Parameter, incomplete: str) -> List[str]:
    """Shell completion of a NAME argument: the roster's agent names. Never fails
    (completion must not print errors into the operator's prompt)."""
    try:
        from ringd.inputs.roster import read_roster
        state, config = given_locations(ctx)
        with lenient_modes(lambda _message: None):
            where = locate(config, state)
            cfg = load_config(where.config_path)
            agents = read_roster(cfg.roster_path(where.state_dir))
        return [a.name for a in agents if a.name.startswith(incomplete)]
    except Exception:  # noqa: BLE001 - no completion rather than a broken prompt
        return []


def reading(fn):
    """An operator command: a config or roster others may write is a one-line
    warning, not a refusal (only ``ringd run`` and ``ringwatch`` refuse), judged
    for the user the ring runs as (heartbeat.ring_uid); so is a config that does
    not load (:func:`command_config`). Such a config's alert command is never
    run by the command (see config.load_config)."""
    @functools.wraps(fn)
    def wrapper(**kw):
        from ringd.host.heartbeat import ring_uid
        seen: List[str] = []

        def warn(message: str) -> None:
            if message not in seen:
                seen.append(message)
                _warn([message])
        ctx = click.get_current_context(silent=True)
        if ctx is not None:
            ctx.meta["ring.warn"] = warn
        uid = ring_uid(kw["state_dir"]) if "state_dir" in kw else None
        with lenient_modes(warn, ring_uid=uid):
            return fn(**kw)
    return wrapper


def operator_command(fn=None, *, output_error: int = EX_IOERR, failure: int = EX_FAILURE):
    """Turn every expected failure of an operator command into one line + exit code.
    Its output is flushed here, not at the interpreter's exit: standard output
    that cannot be written (a file on a full disk) is an error of its own,
    ``output_error`` (74; for ``status`` 4, "unknown"), never the exit code of
    a state it could not report. ``failure``: the code of a failure that has
    none of its own - a journal or file error, an internal error, an error
    raised with the general 1 (for ``status`` 4, "unknown": its 1 says "dead")."""
    if fn is None:
        return functools.partial(operator_command, output_error=output_error, failure=failure)

    @functools.wraps(fn)
    def wrapper(**kw):
        from ringd.journal.sqlite import JournalError
        try:
            _tell_output_errors()
            try:
                return fn(**kw)
            finally:
                sys.stdout.flush()
        except (click.exceptions.Exit, click.ClickException, click.exceptions.Abort):
            raise
        except OutputError as e:
            drop_output()
            raise fail(f"cannot write to standard output: {e.strerror or e}", output_error)
        except ConfigError as e:
            raise fail(f"configuration error: {e}", e.code)
        except RingError as e:
            raise fail(e.message, failure if e.code == EX_FAILURE else e.code)
        except JournalError as e:
            raise fail(str(e), failure)
        except KeyboardInterrupt:
            raise click.exceptions.Exit(EXIT_INTERRUPTED)
        except BrokenPipeError:
            # its reader went away (``ringd history | head``): quietly, with the
            # code of a failure of its own (for ``status`` 4, "unknown", never 1, "dead")
            drop_output()
            raise click.exceptions.Exit(failure)
        except OSError as e:
            if isinstance(e, PermissionError):
                raise fail(f"{e.filename or 'state'}: permission denied "
                           f"(operator commands run as the ring's user)", failure)
            if e.filename is None:
                raise fail(f"{e.strerror or e}", failure)
            raise fail(f"{e.filename}: {e.strerror or e}", failure)
        except Exception as e:  # noqa: BLE001 - the operator gets one line, not a traceback
            if os.environ.get("RINGD_DEBUG"):
                raise
            raise fail(f"internal error: {type(e).__name__}: {one_line(e, 200)} "
                       f"(set RINGD_DEBUG=1 for a traceback)", failure)
    return wrapper


class OutputError(OSError):
    """Standard output could not be written (a file on a full disk, a device
    that fails): told apart from a failure of the ring's own files."""


class _StandardOutput(io.FileIO):
    """Descriptor 1 whose write errors are OutputErrors. (EPIPE stays itself:
    a reader that went away ends the command quietly: operator_command, RingGroup.main.)"""

    def write(self, data):
        try:
            return super().write(data)
        except OSError as e:
            if e.errno == errno.EPIPE:
                raise
            raise OutputError(e.errno, e.strerror) from None


def _tell_output_errors() -> None:
    """Put :class:`_StandardOutput` under ``sys.stdout`` (once), keeping its
    encoding and buffering."""
    out = sys.stdout
    if isinstance(getattr(getattr(out, "buffer", None), "raw", None), _StandardOutput):
        return
    try:
        if out.fileno() != 1:
            return   # (a caller's own stream, as under a test runner)
        out.flush()
    except (AttributeError, OSError, ValueError):
        return
    sys.stdout = io.TextIOWrapper(io.BufferedWriter(_StandardOutput(1, "w", closefd=False)),
                                  encoding=out.encoding, errors=out.errors,
                                  line_buffering=out.line_buffering)


def _warn(warnings: List[str]) -> None:
    for w in warnings:
        click.echo(f"ringd: warning: {one_line(w)}", err=True)


@click.group(cls=RingGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(version=__version__, prog_name="ringd")
@click.option("--state", "state", metavar="DIR", default=None, help=STATE_HELP)
@click.option("--config", "config", metavar="FILE", default=None, help=CONFIG_HELP)
def main(state: Optional[str], config: Optional[str]) -> None:
    """ring's driver and operator commands.

    --state and --config may come before the command or after it."""


@main.command()
@locations(daemon=True)
@click.option("--once", is_flag=True, help="Run one lap (each agent once) and exit.")
def run(state_dir: Path, config_path: Optional[Path], once: bool) -> None:
    """Run the ring in the foreground, forever (or one lap with --once)."""
    from ringd.loops.driver import run_driver
    sys.exit(run_driver(state_dir, config_path, once=once, found=location()))


@main.command()
@locations
@click.option("--strict", is_flag=True, help="Exit 1 when there is any warning (e.g. a program not found).")
@operator_command
def check(state_dir: Path, config_path: Optional[Path], strict: bool) -> None:
    """Validate the config and the roster without starting anything.

    Exit 0 valid (warnings on stderr), 78 invalid, 1 with --strict and a warning."""
    from ringd.inputs.roster import program_problem
    from ringd.inputs.startup import inputs_for_run
    try:
        # ringd run's own rule, a file others may write included: check validates for run
        inputs = inputs_for_run(state_dir, config_path)
    except ConfigError as e:
        raise fail(f"invalid: {e}", EXIT_CONFIG)
    config, roster_path, agents = inputs.config, inputs.roster_path, inputs.agents
    warned: List[str] = list(config.warnings)
    # a section for a name the roster lacks is most often a typo (webb: for web):
    # its limits would silently apply to nothing. Not an error: the roster may
    # gain the agent later, and the running driver re-reads it at every hop.
    on_roster = {a.name for a in agents}
    warned += [f"agents.{name}: no agent {name} in the roster; its settings apply to nothing (a typo?)"
               for name in config.agents if name not in on_roster]
    for a in agents:
        problem = program_problem(a.argv, roster_path.parent, config.cwd_for(a.name))
        if problem:
            warned.append(f"agent {a.name}: {problem}")
    _warn(warned)
    where = location()
    searched = where.found.searched if where is not None and config_path is None else ()
    click.echo(check_ok_line(config_path, roster_path, [a.name for a in agents], len(warned), searched))
    if strict and warned:
        raise click.exceptions.Exit(EX_FAILURE)


def check_ok_line(config_path: Optional[Path], roster_path: Path, names: List[str], warnings: int,
                  searched: "tuple[str, ...]" = ()) -> str:
    """``ringd check``'s one line for a valid ring. The paths are shown as
    ``status`` shows them (control characters and bidirectional controls as
    spaces): a ``ring.roster`` or ``--config`` holding a newline printed a
    second, forged line, and a right-to-left override showed the line's end
    reversed. ``searched``: where the search found no config (the line says
    the ring falls back to the built-in defaults, and why)."""
    from ringd.host.notify import without_controls
    defaults = f"(built-in defaults: no file at {', '.join(searched)})" if searched else "(built-in defaults)"
    return (f"ok: config {without_controls(str(config_path or defaults))}, "
            f"roster {without_controls(str(roster_path))} with {len(names)} agent(s): {', '.join(names)}"
            + (f"; {warnings} warning(s)" if warnings else ""))


# --- operator commands -------------------------------------------------------------

@main.command()
@locations
@click.argument("name", required=False, shell_complete=complete_agent)
@click.option("--json", "as_json", is_flag=True, help="Print the status as JSON (SPEC shape) and nothing else.")
@click.option("--watch", is_flag=True, help="Refresh every second until Ctrl-C (with --json: one JSON line a second).")
@click.option("--strict", is_flag=True, help="Exit 1 when the driver is healthy but there are problems "
                                             "(a config or roster edit that is not taking effect).")
@reading
@operator_command(output_error=STATUS_UNKNOWN, failure=STATUS_UNKNOWN)
def status(state_dir: Path, config_path: Optional[Path], name: Optional[str], as_json: bool, watch: bool,
           strict: bool) -> None:
    """Driver health, watcher, current run, roster and one row per agent.
    With NAME: that agent alone - its roster line, state, current run and last runs.

    Exit 0 driver healthy (with --strict: and no problems, else 1), 1 dead or
    stale, 3 stopped or never ran, 4 status unknown (no such state dir,
    unreadable journal), 78 the journal's location cannot be known. With NAME:
    0, or 2 for an unknown agent."""
    from ringd.cli.reap import reap_before_reading
    from ringd.cli.status import gather_status, status_exit_code
    config = command_config(state_dir, config_path)
    where = location()
    if name is not None:
        if watch:
            raise fail("--watch follows the whole ring: drop NAME (or use `ringd top`)", EX_BAD_USAGE)
        _agent_status(state_dir, config, name, as_json, where)
        return

    def gather():
        warning = reap_before_reading(state_dir, config)
        warnings: List[str] = [warning] if warning else []
        return gather_status(state_dir, config, warnings=warnings, location=where), warnings

    if watch:
        _watch(gather, as_json)
        return
    doc, warnings = gather()
    _warn(warnings)
    if as_json:
        click.echo(json.dumps(doc, indent=2))
    else:
        from ringd.cli.render import print_status
        print_status(doc, warnings=())
    raise click.exceptions.Exit(status_exit_code(doc, strict=strict))


def _agent_status(state_dir: Path, config, name: str, as_json: bool, where=None) -> None:
    """``ringd status NAME``: exit 0 whatever the driver's health (2: unknown agent)."""
    from ringd.cli.reap import reap_before_reading
    from ringd.cli.status import gather_agent
    warning = reap_before_reading(state_dir, config)
    warnings: List[str] = [warning] if warning else []
    doc = gather_agent(state_dir, config, name, warnings=warnings, location=where)
    _warn(warnings)
    if as_json:
        click.echo(json.dumps(doc, indent=2))
    else:
        from ringd.cli.render import print_agent
        print_agent(doc)


def _watch(gather, as_json: bool) -> None:
    import time
    try:
        if as_json:
            while True:
                doc, warnings = gather()
                _warn(warnings)
                click.echo(json.dumps(doc))
                sys.stdout.flush()
                time.sleep(1.0)
        from ringd.cli.render import watch_status
        watch_status(gather)
    except KeyboardInterrupt:
        raise click.exceptions.Exit(0)


@main.command()
@locations
@click.argument("name", required=False, shell_complete=complete_agent)
@click.option("--no-wait", is_flag=True, help="Do not wait to see the current run end.")
@reason_option
@reading
@operator_command
def skip(state_dir: Path, config_path: Optional[Path], name: Optional[str], no_wait: bool,
         reason: Optional[str]) -> None:
    """Skip NAME: end its current run now, or skip its next turn.

    Without NAME: the agent running now (exit 1 if nothing runs). Exit 2 for an
    unknown agent. With no driver running, the request waits for the next one."""
    from ringd.cli.control import skip as do_skip
    from ringd.cli.render import fmt_duration
    config = command_config(state_dir, config_path)
    r = do_skip(state_dir, config, name, wait=0 if no_wait else 5.0, actor=_who(), reason=reason)
    going = f" after {fmt_duration(r.elapsed)} of running" if r.elapsed is not None else ""
    if r.current and r.final_status is not None:
        ran = f" after {fmt_duration(r.ran_for)} of running" if r.ran_for is not None else going
        click.echo(f"{r.agent}: run {r.run_id} {r.final_status}{ran}; the ring moves on")
    elif r.current and r.driver_pid is not None and no_wait:
        click.echo(f"{r.agent}: skip of run {r.run_id}{going} requested (driver pid {r.driver_pid} woken)")
    elif r.current and r.driver_pid is not None:
        click.echo(f"{r.agent}: skip of run {r.run_id}{going} requested; it had not ended {r.waited:.1f}s later "
                   f"(see ringd status)")
    elif r.driver_pid is not None:
        click.echo(f"{r.agent}: its next turn will be skipped")
    else:
        click.echo(f"{r.agent}: no driver is running; its next turn will be skipped when one starts")


@main.command()
@locations
@click.argument("name", required=False, shell_complete=complete_agent)
@click.option("--limit", "-n", type=click.IntRange(1, 1_000_000), default=None,
              help="How many runs to show (default 20; with --since: all of them).")
@click.option("--since", type=When(), default=None, metavar="WHEN",
              help=f"Only runs that started at or after WHEN: {WHEN_HELP}.")
@click.option("--until", type=When(), default=None, metavar="WHEN",
              help="Only runs that started at or before WHEN (as --since; --until 1h: one hour ago).")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list (SPEC shape).")
@reading
@operator_command
def history(state_dir: Path, config_path: Optional[Path], name: Optional[str], limit: Optional[int],
            since: Optional[float], until: Optional[float], as_json: bool) -> None:
    """Recent runs, newest first (of NAME only, if given). Times are local
    (the zone on the first line); JSON's are ISO 8601 UTC."""
    from ringd.cli.reap import reap_before_reading
    from ringd.cli.status import gather_history
    config = command_config(state_dir, config_path)
    warning = reap_before_reading(state_dir, config)
    warnings: List[str] = [warning] if warning else []
    runs = gather_history(state_dir, config, name, limit, warnings=warnings, since=since, until=until)
    _warn(warnings)
    if as_json:
        click.echo(json.dumps(runs, indent=2))
    else:
        from ringd.cli.render import print_history
        print_history(runs)


@main.command()
@locations
@click.argument("name", required=False, shell_complete=complete_agent)
@click.option("--run", "run_id", type=RUN_ID, default=None, metavar="ID",
              help="This run's log (default: NAME's newest run that has a log).")
@click.option("-f", "--follow", is_flag=True,
              help="Follow: NAME's current run and its later runs (no NAME: the whole ring, lines prefixed "
                   "NAME[RUN_ID] HH:MM:SS, and a line as each run ends; with --run: that run until it ends), "
                   "until Ctrl-C.")
@click.option("--lines", "-n", "lines", type=click.IntRange(0, 10_000_000), default=None, metavar="N",
              help="Only the last N lines (with -f: first the last N lines, then what follows).")
@reading
@operator_command
def logs(state_dir: Path, config_path: Optional[Path], name: Optional[str], run_id: Optional[int],
         follow: bool, lines: Optional[int]) -> None:
    """Print a run's log, or follow an agent or the whole ring.

    Exit 2 for an unknown agent or run."""
    from ringd.cli.logs import find_run, follow as follow_runs, follow_log, logless_line, show_log, show_tail
    if name is None and (run_id is not None or not follow):
        raise fail("give an agent NAME, or -f to follow the whole ring (see 'ringd logs --help')", EX_BAD_USAGE)
    config = command_config(state_dir, config_path)
    out = sys.stdout.buffer
    try:
        if follow and run_id is None:
            colour = sys.stdout.isatty() and not os.environ.get("NO_COLOR")
            follow_runs(state_dir, config, name, out, lines=lines, colour=colour)
            return
        logless: Optional[List] = [] if run_id is None and not follow else None
        row = find_run(state_dir, config, name, run_id, logless)
        if logless:
            click.echo(f"ringd: {one_line(logless_line(name, row, logless))}", err=True)
        if follow:
            follow_log(state_dir, config, row, out)
        elif lines is not None:
            show_tail(state_dir, config, row, out, lines)
        else:
            show_log(state_dir, config, row, out)
    except KeyboardInterrupt:   # following ends when interrupted: that is success
        out.flush()
        raise click.exceptions.Exit(0)


@main.command("force-fail")
@locations
@click.argument("name", required=False, shell_complete=complete_agent)
@click.option("--reason", metavar="TEXT", type=ArgText(), default=None,
              help="Why (recorded in the run's reason and with the event).")
@click.option("--run", "run_id", type=RUN_ID, default=None, metavar="ID",
              help="The run to close: only if it is still running.")
@reading
@operator_command
def force_fail(state_dir: Path, config_path: Optional[Path], name: Optional[str], reason: Optional[str],
               run_id: Optional[int]) -> None:
    """Close NAME's stuck running run (or run ID's) as interrupted and kill its process tree.

    Another agent's run is never touched. Exit 1 when that run is not running
    (or it finished meanwhile); 2 for an unknown agent, or when neither NAME nor
    --run is given while a run goes on (the error names it)."""
    from ringd.cli.control import force_fail as do_force_fail
    config = command_config(state_dir, config_path)
    r = do_force_fail(state_dir, config, name, run_id, reason=reason, actor=_who())
    killed = f"; killed {r.killed} process(es)" if r.killed else "; no process of it was left"
    click.echo(f"run {r.run_id} of {r.agent} closed as interrupted{killed}")


def _woke(pid: Optional[int]) -> str:
    return f" (driver pid {pid} woken)" if pid else ""


@main.command()
@locations
@click.argument("name", required=False, shell_complete=complete_agent)
@reason_option
@reading
@operator_command
def pause(state_dir: Path, config_path: Optional[Path], name: Optional[str], reason: Optional[str]) -> None:
    """Pause the ring: after the current run, start nothing until `ringd resume`.

    With NAME: pass NAME over (no row) until `ringd resume NAME`. The current
    run is untouched. Pauses live in the journal (they survive restarts).
    Exit 2 for an unknown agent."""
    from ringd.cli.control import pause as do_pause
    r = do_pause(state_dir, command_config(state_dir, config_path), name, actor=_who(), reason=reason)
    what = "the ring" if name is None else name
    if not r.changed:
        click.echo(f"{what}: already paused")
    elif name is None:
        click.echo(f"ring paused: nothing new starts until `ringd resume`; a run in flight goes on{_woke(r.driver_pid)}")
    else:
        click.echo(f"{name}: paused; passed over until `ringd resume {name}`{_woke(r.driver_pid)}")


@main.command()
@locations
@click.argument("name", required=False, shell_complete=complete_agent)
@reason_option
@reading
@operator_command
def resume(state_dir: Path, config_path: Optional[Path], name: Optional[str], reason: Optional[str]) -> None:
    """Lift the ring's pause; with NAME, lift NAME's pause, quarantine and back-off.

    Exit 2 for an agent not on the roster."""
    from ringd.cli.control import resume as do_resume
    r = do_resume(state_dir, command_config(state_dir, config_path), name, actor=_who(), reason=reason)
    if name is None:
        click.echo(f"ring resumed{_woke(r.driver_pid)}" if r.changed else "the ring was not paused; nothing to do")
    elif r.changed:
        click.echo(f"{name}: {'; '.join(r.lifted)}; it runs at its next turn{_woke(r.driver_pid)}")
    else:
        click.echo(f"{name}: not paused, quarantined or backing off; nothing to do")


@main.command("next")
@locations
@click.argument("name", shell_complete=complete_agent)
@reason_option
@reading
@operator_command
def next_(state_dir: Path, config_path: Optional[Path], name: str, reason: Optional[str]) -> None:
    """NAME takes the very next turn (after the current run), once, whatever its
    back-off, quarantine or pause; then the ring goes on from where it was.

    Exit 2 for an unknown agent."""
    from ringd.cli.control import next_turn
    r = next_turn(state_dir, command_config(state_dir, config_path), name, actor=_who(), reason=reason)
    instead = f" (instead of {r.replaced})" if r.replaced else ""
    click.echo(f"{name}: takes the next turn{instead}{_woke(r.driver_pid)}")


@main.command()
@locations
@reason_option
@reading
@operator_command
def reload(state_dir: Path, config_path: Optional[Path], reason: Optional[str]) -> None:
    """Make the driver and the watcher re-read the config and the roster now
    (what SIGHUP does), and wait (5 s at most) for the driver to confirm.

    Prints what changed, or the error that kept the old config. The request
    and the answer are events, with who asked and why (ringd events). Exit 0
    reloaded, 1 no driver (or no answer), 78 the new config or roster was
    refused (the old one stays)."""
    from ringd.cli.reload import reload as do_reload
    r = do_reload(state_dir, command_config(state_dir, config_path), actor=_who(), reason=reason)
    if r.unrecorded:
        _warn([f"the driver's answer is not in the events: {r.unrecorded}"])
    if r.record is None:
        raise fail(f"driver pid {r.driver_pid} was sent SIGHUP but did not confirm a reload within "
                   f"{r.waited:.1f}s (see ringd status)", EX_FAILURE)
    for e in r.errors:
        click.echo(f"ringd: {e.get('kind')} not reloaded, the driver keeps the old one: "
                   f"{one_line(str(e.get('detail')))}", err=True)
    kept = {e.get("kind") for e in r.errors}
    if "config" not in kept:
        click.echo(f"driver pid {r.driver_pid} reloaded ({r.waited:.2f}s)"
                   + (":" if r.changed else "; nothing changed"))
        for line in r.changed:
            click.echo(f"  {one_line(line)}")
        if r.changed:
            click.echo("  (the run in flight keeps its limits; the next run has the new ones)")
    elif r.changed:   # the roster may have been taken though the config was not
        for line in r.changed:
            click.echo(f"  {one_line(line)}")
    if r.watcher_record is not None:
        err = r.watcher_record.get("error")
        click.echo(f"watcher pid {r.watcher_pid} reloaded" if not err
                   else f"watcher pid {r.watcher_pid} kept its old config: {one_line(str(err))}")
    if r.exit_code:
        raise click.exceptions.Exit(r.exit_code)


@main.command()
@locations
@click.argument("name", required=False, shell_complete=complete_agent)
@click.option("--since", type=When(), default=None, metavar="WHEN", help=f"Only events at or after WHEN: {WHEN_HELP}.")
@click.option("--until", type=When(), default=None, metavar="WHEN", help="Only events at or before WHEN (as --since).")
@click.option("--limit", "-n", type=click.IntRange(1, 1_000_000), default=None,
              help="How many events to show (default 50; with --since/--until: all of them).")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list, newest first (times ISO 8601 UTC).")
@reading
@operator_command
def events(state_dir: Path, config_path: Optional[Path], name: Optional[str], since: Optional[float],
           until: Optional[float], limit: Optional[int], as_json: bool) -> None:
    """The event trail, newest first: time, run, kind, source, actor, reason.

    Every start and end of a run and every operator request (skip, pause,
    resume, next, force-fail, reload) with who asked and why. With NAME: the
    events of that agent only. Exit 2 for an unknown agent."""
    from ringd.cli.status import gather_events
    rows = gather_events(state_dir, command_config(state_dir, config_path), name, limit, since=since, until=until)
    if as_json:
        click.echo(json.dumps(rows, indent=2))
    else:
        from ringd.cli.render import print_events
        print_events(rows)


@main.command()
@locations
@click.argument("shell", type=click.Choice(["bash", "zsh", "fish"]))
def completion(state_dir: Path, config_path: Optional[Path], shell: str) -> None:
    """Print the shell completion script for SHELL (bash, zsh or fish).

    bash: eval "$(ringd completion bash)" in ~/.bashrc; zsh: the same in ~/.zshrc;
    fish: ringd completion fish > ~/.config/fish/completions/ringd.fish"""
    from click.shell_completion import get_completion_class
    cls = get_completion_class(shell)
    click.echo(cls(main, {}, "ringd", "_RINGD_COMPLETE").source())


@main.command()
@click.option("--status", "text", metavar="TEXT", type=ArgText(), default=None,
              help="Tell the ring the run's phase (STATUS=; cut to 200 characters).")
@click.option("--ping", is_flag=True, help="Tell the ring the agent is alive (WATCHDOG=1).")
@click.option("--used", metavar="POOL:N", type=ArgText(), default=None,
              help="Tell the ring the run has spent N units of quota POOL so far (X_RING_USED=).")
@click.option("--exhausted", metavar="POOL", type=ArgText(), default=None,
              help="Tell the ring the provider refuses quota POOL (X_RING_EXHAUSTED=), until --until.")
@click.option("--until", metavar="SECONDS|ISO", type=ArgText(), default=None,
              help="With --exhausted: seconds from now (like Retry-After) or an ISO time (UTC if no zone).")
def notify(text: Optional[str], ping: bool, used: Optional[str], exhausted: Optional[str],
           until: Optional[str]) -> None:
    """For agents: speak to the ring's $NOTIFY_SOCKET like systemd-notify.

    Exit 1 when NOTIFY_SOCKET is not set or the message cannot be sent, 2 for
    a report that does not parse."""
    from ringd.host.notify import PHASE_CHARS, NotifyError, send   # stdlib only: no journal, no rich, no psutil
    # cut as the ring cuts it (SPEC): a long text is a phase, never a datagram too big to be heard
    phase = " ".join(text.splitlines())[:PHASE_CHARS] if text is not None else None
    lines = ([f"STATUS={phase}"] if phase is not None else []) + (["WATCHDOG=1"] if ping else [])
    if not lines and used is None and exhausted is None and until is None:
        raise fail("nothing to send: give --status TEXT, --ping, --used POOL:N or --exhausted POOL --until WHEN",
                   EX_BAD_USAGE)
    if not os.environ.get("NOTIFY_SOCKET"):   # whatever it was asked to send (SPEC)
        raise fail("NOTIFY_SOCKET is not set (not running under ring or systemd)", EX_FAILURE)
    lines += quota_lines(used, exhausted, until)
    try:
        send("\n".join(lines))
    except NotifyError as e:
        raise fail(str(e), EX_FAILURE)


def quota_lines(used: Optional[str], exhausted: Optional[str], until: Optional[str]) -> List[str]:
    """``X_RING_USED=`` / ``X_RING_EXHAUSTED=`` lines of ``ringd notify``, checked
    as the driver checks them (any pool name: only the driver knows the config)."""
    import time
    from ringd.core import quota
    out = []
    if (exhausted is None) != (until is None):
        raise fail("--exhausted POOL and --until SECONDS|ISO go together", EX_BAD_USAGE)
    for key, value in ((quota.USED_KEY, used),
                       (quota.EXHAUSTED_KEY, None if exhausted is None else f"{exhausted}:{until}")):
        if value is None:
            continue
        try:
            report = quota.parse_report(key, value.strip(), time.time(), quota.ANY_POOL)
        except quota.BadReport as e:
            raise fail(f"--{'used' if key == quota.USED_KEY else 'exhausted/--until'}: {e}", EX_BAD_USAGE)
        out.append(f"{key}={report.pool}:{report.units}" if isinstance(report, quota.Used)
                   else f"{key}={report.pool}:{until.strip()}")
    return out


# --- setting up ------------------------------------------------------------------------

@main.command()
@click.argument("directory", required=False, default=".", metavar="[DIR]")
@operator_command
def init(directory: str) -> None:
    """Lay out a new ring in DIR (default .): config/ring.yaml and STATE/ring.txt.

    Never overwrites: exit 1 naming what exists."""
    from ringd.cli.init import init as do_init
    layout = do_init(Path(directory))
    for p in layout.created:
        click.echo(f"created {p}")
    here = Path(directory).resolve()
    click.echo(f"next: cd {shell_quote(str(here))} && ringd check && ringwatch   "
               f"(or: ringd service install, see docs/service.md)")


def shell_quote(text: str) -> str:
    import shlex
    return shlex.quote(text)


@main.group(cls=RingGroup)
def service() -> None:
    """Unit files (systemd) or a property list (launchd) for this installation."""


def service_options(fn):
    """--mode, --user, --state, --config, --bin-dir (resolved by ``service_target``)."""
    for option in reversed((
        click.option("--mode", type=click.Choice(["watcher", "systemd", "launchd"]), default="watcher",
                     show_default=True, help="watcher: systemd keeps ringwatch alive (mode 1); systemd: "
                     "systemd owns ringd (mode 2); launchd: macOS."),
        click.option("--user", metavar="USER", default=None,
                     help="Run as this existing account (default: a systemd dynamic user 'ring'; "
                          "launchd: the installing user)."),
        click.option("--state", "state", metavar="DIR", default=None,
                     help="State dir of the service (default /var/lib/ring; launchd /usr/local/var/ring)."),
        click.option("--config", "config", metavar="FILE", default=None,
                     help="Config of the service (default /etc/ring/ring.yaml, where every command finds it; "
                          "a launchd agent of this user: ~/.config/ring/ring.yaml)."),
        click.option("--bin-dir", metavar="DIR", default=None,
                     help="Where ringd and ringwatch are (default: this installation's)."),
    )):
        fn = option(fn)
    return fn


def service_target(mode: str, user: Optional[str], state: Optional[str], config: Optional[str],
                   bin_dir: Optional[str]):
    from ringd.cli.service import target

    def absolute(p: Optional[str]) -> Optional[Path]:
        return Path(os.path.abspath(os.path.expanduser(p))) if p else None
    return target(mode, bin_dir=absolute(bin_dir), state=absolute(state), config=absolute(config), user=user)


@service.command("print")
@service_options
@operator_command
def service_print(mode: str, user: Optional[str], state: Optional[str], config: Optional[str],
                  bin_dir: Optional[str]) -> None:
    """Print the files for this installation (several: each after a '# ==> PATH <==' line)."""
    from ringd.cli.service import destinations
    t = service_target(mode, user, state, config, bin_dir)
    _warn(t.warnings)
    dest = destinations(t)
    many = len(t.files) > 1
    for k, (name, text) in enumerate(t.files.items()):
        if many:
            click.echo(("\n" if k else "") + f"# ==> {dest[name]} <==")
        click.echo(text, nl=False)


@service.command("install")
@click.option("--root", metavar="DIR", default=None,
              help="Write under DIR instead of / (like systemctl --root).")
@click.option("--enable", is_flag=True, help="Also run the command that enables and starts it.")
@service_options
@operator_command
def service_install(mode: str, user: Optional[str], state: Optional[str], config: Optional[str],
                    bin_dir: Optional[str], root: Optional[str], enable: bool) -> None:
    """Write the files where the init system reads them; create the state dir,
    config and roster when missing. Never overwrites (exit 1 naming the file)."""
    import shlex
    from ringd.cli.service import install, run_enable
    t = service_target(mode, user, state, config, bin_dir)
    _warn(t.warnings)
    r = install(t, Path(os.path.abspath(root)) if root else None)
    for p in r.layout.created:
        click.echo(f"created {p}")
    for p in r.written:
        click.echo(f"wrote {p}")
    for p in r.unchanged:
        click.echo(f"unchanged {p}")
    _warn(r.warnings)
    command = " && ".join(" ".join(shlex.quote(w) for w in step) for step in r.enable)
    if not enable:
        click.echo(f"enable it with: {command}")
        return
    click.echo(f"running: {command}")
    rc = run_enable(r.enable)
    if rc:
        raise fail(f"'{command}' failed (exit {rc})", EX_FAILURE)


# --- pictures of the ring ----------------------------------------------------------------

# (--since/--until: When, WHEN_HELP above)


@main.command()
@locations
@click.option("--since", type=When(), default=None, metavar="WHEN",
              help=f"Runs that started from WHEN: {WHEN_HELP} (default: the last 24 hours).")
@click.option("--until", type=When(), default=None, metavar="WHEN", help="... until WHEN (default: now).")
@click.option("-o", "--output", metavar="FILE", default="ring-report.html", show_default=True,
              help="Where to write the page ('-': standard output).")
@reading
@operator_command
def report(state_dir: Path, config_path: Optional[Path], since: Optional[float], until: Optional[float],
           output: str) -> None:
    """Write a self-contained HTML timeline of the ring: one lane per agent, one bar per run."""
    import time
    from ringd.cli.report import build, page, write
    config = command_config(state_dir, config_path)
    warnings: List[str] = []
    now = time.time()
    timeline = build(state_dir, config, since=since, until=until, now=now, warnings=warnings)
    _warn(warnings)
    size = write(output, page(state_dir, config, config_path, timeline, now))
    if output != "-":
        click.echo(f"wrote {output}: {len(timeline.bars)} run(s), {size / 1024:.0f} kB")


@main.command()
@locations
@click.option("--interval", type=click.FloatRange(1.0, 3600.0), default=1.0, show_default=True,
              help="Seconds between reads of the ring (at least 1).")
@reading
@operator_command
def top(state_dir: Path, config_path: Optional[Path], interval: float) -> None:
    """A live full-screen view: current run, next turns, each agent's last runs, problems. q quits."""
    from ringd.cli.top import run_top
    run_top(state_dir, command_config(state_dir, config_path), interval)
