"""The ``ringd`` command line: a thin click layer over functions tests call too.

Every command takes ``--state`` and ``--config``. Errors are one line on stderr,
never a traceback. Rich is imported only by the commands that render tables.
"""
from __future__ import annotations

import functools
import sys
from pathlib import Path
from typing import Optional

import click

from .config import ConfigError, load_config, resolve_config_path, resolve_state_dir

EXIT_CONFIG = 78


def fail(message: str, code: int) -> "click.exceptions.Exit":
    click.echo(f"ringd: {message}", err=True)
    return click.exceptions.Exit(code)


def locations(fn):
    """Add --state/--config and pass resolved ``state_dir`` and ``config_path``."""
    @click.option("--state", "state", metavar="DIR", default=None,
                  help="State directory (default: $RING_STATE, else ./STATE).")
    @click.option("--config", "config", metavar="FILE", default=None,
                  help="Config file (default: $RING_CONFIG, else ./config/ring.yaml, else built-in).")
    @functools.wraps(fn)
    def wrapper(state: Optional[str], config: Optional[str], **kw):
        return fn(state_dir=resolve_state_dir(state), config_path=resolve_config_path(config), **kw)
    return wrapper


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="ring", prog_name="ringd")
def main() -> None:
    """ring's driver and operator commands."""


@main.command()
@locations
@click.option("--once", is_flag=True, help="Run one lap (each agent once) and exit.")
def run(state_dir: Path, config_path: Optional[Path], once: bool) -> None:
    """Run the ring in the foreground, forever (or one lap with --once)."""
    from .driver import run_driver
    sys.exit(run_driver(state_dir, config_path, once=once))


@main.command()
@locations
def check(state_dir: Path, config_path: Optional[Path]) -> None:
    """Validate the config and the roster without starting anything."""
    from .roster import read_roster
    try:
        config = load_config(config_path)
        roster_path = config.roster_path(state_dir)
        agents = read_roster(roster_path)
    except ConfigError as e:
        raise fail(f"invalid: {e}", EXIT_CONFIG)
    for w in config.warnings:
        click.echo(f"ringd: warning: {w}", err=True)
    click.echo(f"ok: config {config_path or '(built-in defaults)'}, roster {roster_path} "
               f"with {len(agents)} agent(s): {', '.join(a.name for a in agents)}")
