"""The ``ringwatch`` command line (click): run the watcher, or ``reset`` its
restart history. Thin: resolve locations, load the config, call
:mod:`ringd.loops.watcher` / :mod:`ringd.host.watchstate`, turn every error into one
``ringwatch: ...`` line and an exit code - never a traceback.
"""
from __future__ import annotations

import errno
import sys

from ringd.host import earlysig

if earlysig.starting("ringwatch", None):
    earlysig.hold()  # first instruction of the watcher: a signal now waits for its handler

from typing import Optional

import click

from ringd import __version__
from ringd.host import logline
from ringd.cli.commands import RingGroup, drop_output
from ringd.inputs.config import ConfigError, lenient_modes, load_config, locate
from ringd.core.errors import EX_BAD_USAGE, EX_CONFIG, EX_FAILURE, EX_INTERRUPTED, EX_IOERR, STATUS_UNKNOWN, RingError

from ringd.host import watchstate


# An unexpected error (a bug) exits 1, never 70: 70 says the watcher gave up, and
# the shipped units tell systemd never to restart that (RestartPreventExitStatus=70
# 78), so a bug stopped the ring for good instead of costing one restart.
EXIT_INTERNAL = EX_FAILURE
FULL = (errno.ENOSPC, errno.EDQUOT)   # a disk (or quota) that space freed mends


def _fail(message: str, code: int) -> None:
    # the daemon's own line format: under systemd this is the journal's <3> line
    logline.emit("ringwatch", message, logline.ERR)
    sys.exit(code)


_state_opt = click.option("--state", "state_opt", metavar="DIR",
                          help="State directory (default: $RING_STATE, else ring.state_dir of the config, "
                               "else ./STATE).")
_config_opt = click.option("--config", "config_opt", metavar="FILE",
                           help="Config file (default: $RING_CONFIG, else the first of ./config/ring.yaml, "
                                "~/.config/ring/ring.yaml, /etc/ring/ring.yaml, else built-in).")


class WatchGroup(RingGroup):
    """ringd's one-line usage errors, named ``ringwatch``."""
    prog = "ringwatch"


@click.group(cls=WatchGroup, invoke_without_command=True, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(version=__version__, prog_name="ringwatch")
@_state_opt
@_config_opt
@click.pass_context
def cli(ctx: click.Context, state_opt: Optional[str], config_opt: Optional[str]) -> None:
    """Keep the ring's driver alive: start `ringd run`, replace it when it dies or
    hangs, give up (exit 70) after too many restarts. Runs in the foreground."""
    ctx.ensure_object(dict)
    ctx.obj.update(state=state_opt, config=config_opt)
    if ctx.invoked_subcommand is not None:
        return
    from ringd.loops.watcher import Watcher  # the daemon's imports only when it runs

    try:
        where = locate(config_opt, state_opt, follow_driver=False)   # (it is the one that starts the driver)
        state_dir, config_path = where.state_dir, where.config_path
        config = load_config(config_path)
    except ConfigError as e:
        _fail(str(e), EX_CONFIG)
    if where.found.config_from not in ("--config", "$RING_CONFIG") or \
            where.found.state_from not in ("--state", "$RING_STATE"):
        state_line, config_line = where.says()
        logline.emit("ringwatch", f"config {config_line}; state dir {state_line}", logline.INFO)
    try:
        code = Watcher(state_dir, config_path, config).run()
    except RingError as e:
        _fail(str(e), e.code)
    except OSError as e:
        _fail(f"{getattr(e, 'filename', None) or state_dir}: {e.strerror or e}", EXIT_INTERNAL)
    sys.exit(code)


@cli.command()
@_state_opt
@_config_opt
@click.pass_context
def reset(ctx: click.Context, state_opt: Optional[str], config_opt: Optional[str]) -> None:
    """Clear the restart history and the give-up (like `systemctl reset-failed`)."""
    try:
        with lenient_modes(lambda _message: None):   # (only its ring.state_dir is read)
            state_dir = locate(ctx.obj.get("config") if config_opt is None else config_opt,
                               ctx.obj.get("state") if state_opt is None else state_opt).state_dir
    except ConfigError as e:
        _fail(str(e), EX_CONFIG)
    if not state_dir.is_dir():
        _fail(f"{state_dir}: no such state directory", EX_BAD_USAGE)
    try:
        done = watchstate.reset(state_dir)
    except RingError as e:   # the write lock held too long (75), a marker no unlink can take (1)
        _fail(e.message, e.code)
    except OSError as e:
        # 1, as ringd's operator commands fail on a state file they cannot
        # write (74 is output that cannot be written). state.reset changes
        # nothing unless it saved, so a full disk's reset can just be run again.
        hint = " (nothing was reset: free some space and run it again)" if e.errno in FULL else ""
        _fail(f"{watchstate.state_path(state_dir)}: cannot reset: {e.strerror or e}{hint}", EX_FAILURE)
    try:   # apart: output that cannot be written (a full disk) is no failed reset
        click.echo(done)
        sys.stdout.flush()
    except BrokenPipeError:
        raise   # its reader went away: RingGroup ends quietly
    except OSError as e:
        drop_output()
        _fail(f"reset done, but cannot write to standard output: {e.strerror or e}", EX_IOERR)


@cli.command()
@_state_opt
@_config_opt
@click.option("--json", "as_json", is_flag=True, help="Print the watcher's state as JSON.")
@click.pass_context
def status(ctx: click.Context, state_opt: Optional[str], config_opt: Optional[str], as_json: bool) -> None:
    """The watcher's own state: pid, restarts in the window, gave up, last poll, the driver it watches.

    Exit 0 running, 3 not running, 1 gave up (`ringwatch reset` clears it)."""
    import json
    from ringd.cli.found import reading_config
    from ringd.host.heartbeat import live_writer
    from ringd.host.procid import same_process
    state = ctx.obj.get("state") if state_opt is None else state_opt
    config = ctx.obj.get("config") if config_opt is None else config_opt
    warned: list = []

    def warn(message: str) -> None:
        if message not in warned:
            warned.append(message)
            click.echo(f"ringwatch: warning: {message}", err=True)
    try:
        with lenient_modes(warn):
            where = locate(config, state)
            cfg = reading_config(where.state_dir, where.config_path, warn)
    except ConfigError as e:
        _fail(str(e), EX_CONFIG)
    state_dir = where.state_dir
    if not state_dir.is_dir():
        _fail(f"{state_dir}: no such state directory (give --state DIR or set RING_STATE)", STATUS_UNKNOWN)
    data = watchstate.load(state_dir)
    driver = data.get("driver") if isinstance(data.get("driver"), dict) else {}
    doc = watchstate.status_doc(
        state_dir, data, alive=live_writer(data) is not None, given_up=watchstate.gave_up(state_dir, data),
        driver_alive=bool(driver.get("pid")) and same_process(driver.get("pid"), driver.get("pid_start")),
        clock=watchstate.clock_now(), start_limit_burst=cfg.watch.start_limit_burst,
        start_limit_interval=cfg.watch.start_limit_interval)
    try:
        click.echo(json.dumps(doc, indent=2) if as_json else status_text(doc))
        sys.stdout.flush()
    except BrokenPipeError:
        raise
    except OSError as e:
        drop_output()
        _fail(f"cannot write to standard output: {e.strerror or e}", EX_IOERR)
    sys.exit(watchstate.status_exit_code(doc))


def status_text(doc: dict) -> str:
    """``ringwatch status`` for people: one labelled line each."""
    from ringd.cli.render import fmt_ago
    import time
    now = time.time()
    if doc["alive"]:
        head = f"running  pid {doc['pid']}, started {fmt_ago(doc['started_at'], now)}, mode {doc['mode']}"
    elif doc["gave_up"]:
        head = "GAVE UP  (ringwatch reset clears it)"
    else:
        head = "not running"
    d = doc["driver"]
    driver = "-" if not d.get("pid") else (f"pid {d['pid']} ({'alive' if d['alive'] else 'gone'}; "
                                           f"{d.get('health') or 'not judged'} at the last poll)")
    lines = [("watcher", head), ("state", doc["state_dir"]),
             ("polled", fmt_ago(doc["last_poll_at"], now) if doc["last_poll_at"] else "never"),
             ("driver", driver),
             ("restarts", f"{doc['restarts']} in the last {doc['start_limit_interval']:g}s "
                          f"(gives up past {doc['start_limit_burst']})")]
    if doc["gave_up"]:
        lines.append(("gave up", f"{doc['gave_up_at'] or 'earlier'}: {doc['gave_up_reason'] or 'start limit hit'}"))
    from ringd.host.notify import without_controls
    return "\n".join(f"{label:<9}{without_controls(str(text))}" for label, text in lines)


def main() -> None:
    try:
        cli(prog_name="ringwatch")
    except SystemExit:
        raise
    except KeyboardInterrupt:
        _fail("interrupted", EX_INTERRUPTED)
    except Exception as e:  # noqa: BLE001 - a one-line error, never a traceback
        _fail(f"internal error: {type(e).__name__}: {e}", EXIT_INTERNAL)
