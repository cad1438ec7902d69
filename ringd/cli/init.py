"""``ringd init``: lay out a new ring (config, state dir, example roster), and the
same "create what is missing, never overwrite" step ``ringd service install`` uses.

The default config and example roster are package data (``ringd/data``), so an
installed ring (a venv, pipx) has them without a checkout; ``config/ring.yaml``
in the repository is the same file (a test checks it).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import List, Optional

from ringd.core.errors import EX_FAILURE, ConfigError
from ringd.host.safefile import check_state_dir
from ringd.cli.status import OperatorError

STATE_MODE = 0o700
CONFIG_MODE = 0o644      # readable (no secrets in it), never writable by others
ROSTER_MODE = 0o600
FOLDER_MODE = 0o755      # a folder made on the way (/etc/ring): the service's user must get through


def default_config_text(restart_command: Optional[List[str]] = None, state_dir: Optional[Path] = None) -> str:
    """The shipped config/ring.yaml; ``restart_command`` set for deployment mode 2,
    ``ring.state_dir`` for a service (so every command finds its state dir)."""
    import json
    text = resources.files("ringd").joinpath("data/ring.yaml").read_text()
    if restart_command:
        old = "  restart_command: null "
        assert old in text
        text = text.replace(old, f"  restart_command: [{', '.join(restart_command)}] ", 1)
    if state_dir is not None:
        old = "  state_dir: null "
        assert old in text
        text = text.replace(old, f"  state_dir: {json.dumps(str(state_dir))} ", 1)   # (JSON is YAML)
    return text


def example_roster_text() -> str:
    return resources.files("ringd").joinpath("data/ring.txt").read_text()


@dataclass
class Layout:
    """What to create; ``created`` / ``kept`` say what happened."""
    state_dir: Path
    config_path: Path
    roster_path: Path
    config_text: str = field(default_factory=default_config_text)
    owner: Optional[int] = None      # uid to own the state dir and roster (service --user)
    created: List[Path] = field(default_factory=list)
    kept: List[Path] = field(default_factory=list)


def make_folders(path: Path) -> None:
    """Create ``path`` and its missing parents, each FOLDER_MODE whatever the
    umask: made with root's umask 027 or 077 (sudo keeps the caller's), a new
    /etc/ring was 0750 root and the service's own user could not read its
    config, nor reach a state dir under a new /srv/ring. Folders that exist are
    left as they are."""
    missing = []
    while not (path.exists() or path.is_symlink()):
        missing.append(path)
        path = path.parent
    for folder in reversed(missing):
        try:
            os.mkdir(folder, FOLDER_MODE)
        except FileExistsError:
            continue   # made meanwhile by someone else: theirs
        os.chmod(folder, FOLDER_MODE)


def _write_new(path: Path, text: str, mode: int) -> None:
    """Create ``path`` with ``mode`` whatever the umask; never replace a file
    (O_EXCL: a file that appeared meanwhile is kept, not clobbered)."""
    make_folders(path.parent)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    try:
        os.fchmod(fd, mode)
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def create_missing(layout: Layout) -> Layout:
    """Create the state dir (0700), the config (0644) and the roster (0600) that
    do not exist yet; existing ones are kept as they are."""
    if layout.state_dir.exists():
        layout.kept.append(layout.state_dir)
    else:
        make_folders(layout.state_dir.parent)
        layout.state_dir.mkdir(mode=STATE_MODE)
        os.chmod(layout.state_dir, STATE_MODE)
        layout.created.append(layout.state_dir)
    for path, text, mode in ((layout.config_path, layout.config_text, CONFIG_MODE),
                             (layout.roster_path, example_roster_text(), ROSTER_MODE)):
        if path.exists() or path.is_symlink():
            layout.kept.append(path)
            continue
        _write_new(path, text, mode)
        layout.created.append(path)
    if layout.owner is not None:
        for path in (layout.state_dir, layout.roster_path):
            if path in layout.created:
                os.chown(path, layout.owner, -1)
    return layout


def init(directory: Path) -> Layout:
    """``ringd init DIR``: DIR/config/ring.yaml and DIR/STATE/ring.txt. Refuses
    (exit 1, naming each) when either exists: nothing is created then."""
    directory = Path(os.path.abspath(directory))
    layout = Layout(state_dir=directory / "STATE", config_path=directory / "config" / "ring.yaml",
                    roster_path=directory / "STATE" / "ring.txt")
    existing = [p for p in (layout.config_path, layout.roster_path) if p.exists() or p.is_symlink()]
    if existing:
        raise OperatorError(f"{', '.join(map(str, existing))} already exist{'s' if len(existing) == 1 else ''}; "
                            f"ringd init never overwrites", EX_FAILURE)
    # Before anything is made: a STATE ringd run would refuse (a file; a folder
    # others may write) or a config folder that is a file failed half way, or
    # laid out a ring that does not start.
    try:
        check_state_dir(layout.state_dir)
    except ConfigError as e:
        raise OperatorError(f"{e}; ringd init lays out nothing", EX_FAILURE) from None
    folder = layout.config_path.parent
    if (folder.exists() or folder.is_symlink()) and not folder.is_dir():
        raise OperatorError(f"{folder}: not a directory (ringd init writes {layout.config_path.name} in it); "
                            f"ringd init lays out nothing", EX_FAILURE)
    return create_missing(layout)
