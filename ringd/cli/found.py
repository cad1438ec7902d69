"""How an operator command finds its ring and reads a config that may be broken.

``ringd run`` and ``ringwatch`` refuse a config that does not load (78). Every
other command still acts: it takes from such a file only what it cannot do
without - where the state dir and the journal are (config.essentials) - says
why once on stderr, and uses the built-in defaults for the rest, with what the
driver's heartbeat records of the ring it runs (its roster's path, its pace).
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable, Dict, Mapping, Optional

from ringd.core.errors import ConfigError
from ringd.core.settings import RingSettings
from ringd.host.heartbeat import read_heartbeat
from ringd.inputs.config import Config, essentials, load_config


def reading_config(state_dir: Path, config_path: Optional[Path], warn: Callable[[str], None]) -> Config:
    """The config an operator command acts with: ``config_path`` as it loads; if
    it does not, a salvage (``Config.error`` set) - its state dir and journal
    location, the rest built-in - after one warning. ConfigError (78) only when
    the journal's location cannot be known: the file is not YAML (or cannot be
    read) and the state dir's driver runs on PostgreSQL."""
    try:
        return load_config(config_path)
    except ConfigError as e:
        broken = e.message
    hb = read_heartbeat(state_dir) or {}
    try:
        known = essentials(config_path)
        journal, ttl = known.journal, known.lease_ttl
    except ConfigError:
        if hb.get("journal") not in (None, "sqlite"):
            raise ConfigError(f"{broken} (and the ring's journal is in PostgreSQL: without a config that "
                              f"reads, where it is cannot be known)") from None
        journal, ttl = None, RingSettings.lease_ttl
    warn(f"configuration error: {broken}; using only where its state dir and journal are "
         f"(a running driver keeps the config it loaded)")
    roster = hb.get("roster_path")
    ring = RingSettings(journal=journal, lease_ttl=ttl,
                        roster=roster if isinstance(roster, str) and roster.startswith("/") else None)
    return Config(ring=ring, path=config_path, error=broken)


def driver_facts(hb: Optional[Mapping[str, Any]]) -> Dict[str, Any]:
    """Pure: what a heartbeat records of the ring its driver runs, each checked
    for its type (a file anyone with the ring's uid could have edited)."""
    hb = hb or {}

    def text(key: str) -> Optional[str]:
        v = hb.get(key)
        return v if isinstance(v, str) else None
    agents = hb.get("roster_agents")
    interval = hb.get("heartbeat_interval")
    sig = hb.get("config_signature")
    return {
        "config": text("config"), "config_loaded_at": text("config_loaded_at"),
        "config_error": text("config_error"), "config_signature": tuple(sig) if isinstance(sig, list) else None,
        "roster_path": text("roster_path"), "roster_error": text("roster_error"),
        "roster_agents": [a for a in agents if isinstance(a, str)] if isinstance(agents, list) else None,
        "heartbeat_interval": interval if isinstance(interval, (int, float)) and not isinstance(interval, bool)
        and 0 < interval < 10 ** 9 else None,
    }


def with_pace(config: Config, facts: Mapping[str, Any]) -> Config:
    """``config`` judging a heartbeat's age by the interval the driver beats at
    (it may run on another config than the file now says, or on a salvage)."""
    every = facts.get("heartbeat_interval")
    if every is None or every == config.ring.heartbeat_interval:
        return config
    return dataclasses.replace(config, ring=dataclasses.replace(config.ring, heartbeat_interval=every))
