"""The ``ringwatch`` command line (click): run the watcher, or ``reset`` its
restart history. Thin: resolve locations, load the config, call
:mod:`ringd.loops.watcher` / :mod:`ringd.loops.watchstate`, turn every error into one
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
from ringd.inputs.config import ConfigError, load_config, resolve_config_path, resolve_state_dir
from ringd.core.errors import EX_BAD_USAGE, EX_CONFIG, EX_FAILURE, EX_INTERRUPTED, EX_IOERR, RingError

from ringd.loops import watchstate


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
                          help="State directory (default: $RING_STATE, else ./STATE).")
_config_opt = click.option("--config", "config_opt", metavar="FILE",
                           help="Config file (default: $RING_CONFIG, else ./config/ring.yaml, else built-in).")


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
        state_dir = resolve_state_dir(state_opt)
        config_path = resolve_config_path(config_opt)
        config = load_config(config_path)
    except ConfigError as e:
        _fail(str(e), EX_CONFIG)
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
        state_dir = resolve_state_dir(ctx.obj.get("state") if state_opt is None else state_opt)
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


def main() -> None:
    try:
        cli(prog_name="ringwatch")
    except SystemExit:
        raise
    except KeyboardInterrupt:
        _fail("interrupted", EX_INTERRUPTED)
    except Exception as e:  # noqa: BLE001 - a one-line error, never a traceback
        _fail(f"internal error: {type(e).__name__}: {e}", EXIT_INTERNAL)
