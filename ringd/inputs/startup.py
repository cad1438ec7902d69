"""What ``ringd run`` requires of its config, state dir and roster: one rule for ``run`` and ``check``."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional

from ringd.host.safefile import check_state_dir, strict_modes
from ringd.inputs.config import Config, load_config
from ringd.inputs.roster import Agent, read_roster


@dataclass(frozen=True)
class RunInputs:
    config: Config
    roster_path: Path
    agents: List[Agent]


def inputs_for_run(state_dir: Path, config_path: Optional[Path]) -> RunInputs:
    """Load the config, judge the state dir and read the roster in ``ringd run``'s
    order, strictly: a file group or others may write (or another user owns) is
    refused here whoever asks, so that whatever ``ringd check`` accepts, ``ringd
    run`` runs. Raises ConfigError (exit 78) with the line run gives."""
    with strict_modes():
        config = load_config(config_path)
        check_state_dir(state_dir)   # (a missing one is fine: run creates it 0700)
        roster_path = config.roster_path(state_dir)
        agents = read_roster(roster_path)
    return RunInputs(config, roster_path, agents)
