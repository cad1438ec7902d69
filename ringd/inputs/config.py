"""Configuration: locate, load and validate ``ring.yaml`` into frozen dataclasses.

Every error is a :class:`ConfigError` whose message names the file and the key
(``ring.run_budget``, ``agents.web.stall_threshold`` ...). Defaults here are
identical to the shipped ``config/ring.yaml`` (a test checks that).
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Tuple

from ringd.core.errors import ConfigError, excerpt
from ringd.core.settings import AgentOverride, AlertSettings, Limits, RingSettings, WatchSettings
from ringd.core.lease import BEATS_PER_TTL
from ringd.core.quota import MAX_UNITS, POOL_RE, Pool
from ringd.inputs.roster import NAME_RE
from ringd.host.safefile import check_path, lenient_modes, read_checked_file  # noqa: F401 - lenient_modes: the CLI's

MAX_CONFIG_BYTES = 256 * 1024  # a config larger than this is a mistake (or an attack)
# Every duration must fit the OS timers and datetime once added to "now"; waits
# longer than a timer allows are clamped by the waiters, so ten years is safe.
MAX_DURATION = 10 * 365 * 86400
# How often a daemon wakes by itself (heartbeat_interval, poll_interval) is
# floored: 1us was accepted, and a driver beating a million times a second
# spent 2/3 of a CPU rewriting its heartbeat file. Tests run at 0.2 s.
MIN_TICK = 0.05
MAX_COUNT = 10 ** 9            # counts (keep_logs, bursts ...) stay far inside SQLite's INTEGER
MAX_NESTING = 32               # a config is 3 levels deep; deeper YAML is refused, never recursed into


@dataclass(frozen=True)
class Config:
    ring: RingSettings = field(default_factory=RingSettings)
    agents: Mapping[str, AgentOverride] = field(default_factory=dict)
    watch: WatchSettings = field(default_factory=WatchSettings)
    alerts: AlertSettings = field(default_factory=AlertSettings)
    quotas: Mapping[str, Pool] = field(default_factory=dict)   # named pools (SPEC "Agents on a shared quota")
    path: Optional[Path] = None            # None: built-in defaults
    warnings: Tuple[str, ...] = ()
    signature: Optional[Tuple[int, ...]] = None   # the file as loaded (file_signature): edited since?
    error: Optional[str] = None            # set on what a command salvaged from a file that does not load

    def limits_for(self, agent: str) -> Limits:
        o = self.agents.get(agent) or AgentOverride()
        return Limits(
            run_budget=o.run_budget if o.run_budget is not None else self.ring.run_budget,
            stall_threshold=o.stall_threshold if o.stall_threshold is not None else self.ring.stall_threshold,
        )

    def watchdog_for(self, agent: str) -> Optional[float]:
        """The agent's watchdog in seconds, or None (off): its own, else ``ring.watchdog``;
        ``agents.<name>.watchdog: null`` turns the ring's off for that agent."""
        o = self.agents.get(agent)
        if o is None or o.watchdog is None:
            return self.ring.watchdog
        return o.watchdog or None

    def schedule_for(self, agent: str):
        """The agent's :class:`ringd.inputs.schedule.Schedule`, or None for an ordinary agent."""
        o = self.agents.get(agent)
        if o is None or (o.schedule is None and o.every is None):
            return None
        from ringd.inputs.schedule import Schedule
        return Schedule(cron=o.schedule, every=o.every)

    def quota_for(self, agent: str) -> Optional[str]:
        """The name of the pool the agent draws on, or None."""
        o = self.agents.get(agent)
        return o.quota if o is not None else None

    def cwd_for(self, agent: str) -> Optional[str]:
        o = self.agents.get(agent)
        return o.cwd if o else None

    def roster_path(self, state_dir: Path) -> Path:
        if self.ring.roster:
            p = Path(os.path.expanduser(self.ring.roster))   # (never raises: load_config checked it)
            if not p.is_absolute():
                base = self.path.parent if self.path else Path.cwd()
                p = base / p
            return p
        return state_dir / "ring.txt"


# --- locations -------------------------------------------------------------

SYSTEM_CONFIG = "/etc/ring/ring.yaml"
BUILT_IN = "built-in defaults"


@dataclass(frozen=True)
class Found:
    """Where a command finds its ring (:func:`find_ring`): absolute paths, not yet
    resolved, and how each was found (for ``status`` and ``check`` to say)."""
    config_path: Optional[str]      # None: the built-in defaults
    config_from: str                # "--config", "$RING_CONFIG", "its driver's heartbeat", "search", BUILT_IN
    state_dir: str
    state_from: str                 # "--state", "$RING_STATE", "ring.state_dir", "./STATE"
    searched: Tuple[str, ...] = ()  # the paths the search looked at, in order


def config_candidates(env: Mapping[str, str], cwd: str) -> Tuple[str, ...]:
    """Pure: where a config is looked for, first found wins: ``./config/ring.yaml``,
    ``$XDG_CONFIG_HOME/ring/ring.yaml`` (``~/.config`` when unset or relative,
    as the XDG spec says), ``/etc/ring/ring.yaml``."""
    import posixpath
    out = [posixpath.join(cwd, "config", "ring.yaml")]
    xdg = env.get("XDG_CONFIG_HOME") or ""
    if not xdg.startswith("/"):
        home = env.get("HOME") or ""
        xdg = posixpath.join(home, ".config") if home.startswith("/") else ""
    if xdg:
        out.append(posixpath.join(xdg, "ring", "ring.yaml"))
    out.append(SYSTEM_CONFIG)
    return tuple(dict.fromkeys(out))


def find_ring(config_opt: Optional[str], state_opt: Optional[str], *, env: Mapping[str, str], cwd: str,
              exists: Callable[[str], bool],
              state_dir_of: Callable[[str], Optional[str]] = lambda _path: None,
              driver_config_of: Optional[Callable[[str], Tuple[bool, Optional[str]]]] = None) -> Found:
    """Pure: the config and the state dir a command uses - the one search order.

    Config: ``--config`` > ``$RING_CONFIG`` > (given only a state dir) the config
    its driver runs with, as its heartbeat says (``driver_config_of(state)``:
    (known, path or None for the built-in defaults)) > the first of
    :func:`config_candidates` that ``exists`` > the built-in defaults.
    State dir: ``--state`` > ``$RING_STATE`` > ``ring.state_dir`` of that config
    (``state_dir_of(config)``, already ``~``-expanded; relative to the config's
    folder) > ``./STATE``. Options are ``~``-expanded by the caller; a relative
    one is taken from ``cwd``. An empty option is refused, never read as the
    default: a command meant for one ring must not act on another.
    ``driver_config_of`` None: a daemon (``ringd run``, ``ringwatch``) - it is the
    one that sets the heartbeat, so it never follows one."""
    import posixpath

    def absolute(p: str, base: str = cwd) -> str:
        return posixpath.normpath(posixpath.join(base, p))

    for name, value in (("--config", config_opt), ("--state", state_opt)):
        if value == "":
            raise ConfigError(f"{name}: an empty path (is the variable that should hold it set?)")
    state_raw, state_from = (state_opt, "--state") if state_opt else (env.get("RING_STATE") or None, "$RING_STATE")
    state = absolute(state_raw) if state_raw else None
    searched: Tuple[str, ...] = ()
    if config_opt:
        config, config_from = absolute(config_opt), "--config"
    elif env.get("RING_CONFIG"):
        config, config_from = absolute(env["RING_CONFIG"]), "$RING_CONFIG"
    else:
        known, config = (False, None)
        if state is not None and driver_config_of is not None:
            known, config = driver_config_of(state)
        if known:
            config_from = "its driver's heartbeat"
        else:
            places = config_candidates(env, cwd)
            config = next((p for p in places if exists(p)), None)
            searched = places[:places.index(config) + 1] if config is not None else places
            config_from = "search" if config is not None else BUILT_IN
    if state is None:
        wanted = state_dir_of(config) if config is not None else None
        if wanted:
            state, state_from = absolute(wanted, posixpath.dirname(config)), "ring.state_dir"
        else:
            state, state_from = absolute("STATE"), "./STATE"
    return Found(config, config_from, state, state_from, searched)


def entry_exists(path: str) -> bool:
    """Is there anything at ``path``? A dangling symlink, a directory or a FIFO
    there is the operator's config that cannot be read - load_config says why -
    never a reason to run on the built-in defaults; so is a folder this user may
    not search."""
    try:
        os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return False
    except OSError:
        return True
    return True


@dataclass(frozen=True)
class Location:
    """:class:`Found`, with the state dir as its real path (symlinks resolved):
    agents get it as ``RING_STATE`` and it is half of the key that recognises a
    run's processes, so a driver started through a symlink and a reaper started
    through the real path must spell it the same way."""
    state_dir: Path
    config_path: Optional[Path]
    found: Found

    def says(self) -> Tuple[str, str]:
        """(state line, config line) as ``status`` and ``check`` name them."""
        f = self.found
        state_how = {"ring.state_dir": f"ring.state_dir in {f.config_path}"}.get(f.state_from, f.state_from)
        if f.config_path is None:
            looked = f" (none at {', '.join(f.searched)})" if f.searched else ""
            config_line = f"{BUILT_IN}{looked}" if f.config_from == BUILT_IN else f"{BUILT_IN} ({f.config_from})"
        else:
            config_line = f"{f.config_path} ({'found' if f.config_from == 'search' else f.config_from})"
        return f"{self.state_dir} ({state_how})", config_line


class NoStateDir(ConfigError):
    """The state dir was to come from a config that cannot be read (exit 78)."""


def locate(config_opt: Optional[str], state_opt: Optional[str], *, follow_driver: bool = True,
           state_dir_of: Optional[Callable[[str], Optional[str]]] = None) -> Location:
    """:func:`find_ring` on this process's environment and file system. Raises
    ConfigError for a path no system call could take, or when the state dir
    must come from a config that cannot be read. ``follow_driver``: given only
    a state dir, use the config its driver records (every command but the
    daemons)."""
    for what, raw in (("config file", config_opt), ("state directory", state_opt)):
        if raw:
            check_path(what, raw)
    env = dict(os.environ)
    for name, what in (("RING_CONFIG", "config file"), ("RING_STATE", "state directory")):
        if env.get(name):
            check_path(what, env[name])
            env[name] = os.path.expanduser(env[name])
    expand = (lambda p: os.path.expanduser(p) if p else p)
    wanted = state_dir_of or config_state_dir

    def state_dir_in(path: str) -> Optional[str]:
        try:
            return wanted(path)
        except NoStateDir:
            raise
        except ConfigError as e:
            raise NoStateDir(f"{e.message}; so where its ring.state_dir points cannot be known "
                             f"(give --state DIR or set RING_STATE)") from None
    found = find_ring(expand(config_opt), expand(state_opt), env=env, cwd=os.getcwd(), exists=entry_exists,
                      state_dir_of=state_dir_in,
                      driver_config_of=driver_config if follow_driver else None)
    check_path("state directory", found.state_dir)
    return Location(state_dir=Path(os.path.realpath(found.state_dir)),
                    config_path=Path(found.config_path) if found.config_path else None, found=found)


def driver_config(state_dir: str) -> Tuple[bool, Optional[str]]:
    """(known, path) of the config the state dir's driver runs with, as its
    heartbeat records it (``config``: an absolute path, or null for the built-in
    defaults); (False, None) when no heartbeat says."""
    from ringd.host.heartbeat import read_heartbeat
    hb = read_heartbeat(Path(os.path.realpath(state_dir)))
    if not isinstance(hb, dict) or "config" not in hb:
        return False, None
    path = hb["config"]
    if path is None:
        return True, None
    if isinstance(path, str) and path.startswith("/") and "\x00" not in path:
        return True, path
    return False, None


def config_state_dir(path: str) -> Optional[str]:
    """``ring.state_dir`` of the config at ``path`` (``~``-expanded), or None when it
    sets none. A config that cannot be read, or is not YAML, cannot say where its
    state dir is: ConfigError (the command cannot know its journal: 78). A bad
    value elsewhere in it does not matter here (:func:`essentials`)."""
    return essentials(Path(path)).state_dir


def resolve_state_dir(option: Optional[str]) -> Path:
    """The state dir for ``option`` (see :func:`locate`)."""
    return locate(None, option).state_dir


def resolve_config_path(option: Optional[str]) -> Optional[Path]:
    """The config for ``option`` (see :func:`locate`): an empty ``--config`` is
    refused; without one, the search order (an entry that exists is the
    operator's config even if it cannot be read)."""
    return locate(option, None, follow_driver=False, state_dir_of=lambda _p: None).config_path


# --- YAML without aliases ----------------------------------------------------

def _safe_yaml(text: str, path: Path) -> Any:
    import yaml

    class NoAliasLoader(yaml.SafeLoader):
        # yaml.safe_load still expands aliases; a "billion laughs" document is
        # a few hundred bytes. A config never needs them, so refuse outright.
        depth = 0

        def compose_node(self, parent, index):  # type: ignore[override]
            if self.check_event(yaml.AliasEvent):
                ev = self.peek_event()
                raise ConfigError(f"{path}: line {ev.start_mark.line + 1}: "
                                  f"YAML aliases (*{excerpt(ev.anchor, 20)[1:-1]}) are not allowed")
            # The composer recurses once per level: bound it far below Python's
            # recursion limit (also when called deep in a SIGHUP reload).
            self.depth += 1
            try:
                if self.depth > MAX_NESTING:
                    line = self.peek_event().start_mark.line + 1
                    raise ConfigError(f"{path}: line {line}: YAML nested more than {MAX_NESTING} levels deep")
                return super().compose_node(parent, index)
            finally:
                self.depth -= 1

        def construct_object(self, node, deep=False):  # type: ignore[override]
            # A tagged scalar no constructor can read (!!int "0b12", !!bool maybe,
            # !!timestamp 2001-13-45, 2001-02-30, an int of 5000 digits) raises a
            # plain ValueError, KeyError or AttributeError, not a YAMLError: say
            # which value, where.
            try:
                return super().construct_object(node, deep=deep)
            except (ConfigError, yaml.YAMLError, RecursionError, MemoryError):
                raise
            except Exception:   # noqa: BLE001 - PyYAML's constructors raise what int(), date() ... raise
                if not isinstance(node, yaml.ScalarNode):
                    raise
                kind = node.tag.rsplit(":", 1)[-1]
                raise ConfigError(f"{path}: line {node.start_mark.line + 1}: invalid YAML: "
                                  f"cannot read {excerpt(node.value)} as {kind}") from None

        def construct_mapping(self, node, deep=False):  # type: ignore[override]
            # PyYAML keeps the last of two equal keys: a second "ring:" section
            # silently dropped every key of the first. Refuse, naming both lines.
            first = {}
            for key_node, _ in node.value if isinstance(node, yaml.MappingNode) else ():
                if isinstance(key_node, yaml.ScalarNode) and key_node.tag != "tag:yaml.org,2002:merge":
                    key = (key_node.tag, key_node.value)
                    line = key_node.start_mark.line + 1
                    if key in first:
                        raise ConfigError(f"{path}: line {line}: duplicate key "
                                          f"{excerpt(key_node.value)} (first on line {first[key]})")
                    first[key] = line
            return super().construct_mapping(node, deep=deep)

    try:
        return yaml.load(text, Loader=NoAliasLoader)  # noqa: S506 - SafeLoader subclass
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}: " if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"{path}: {where}invalid YAML: {excerpt(problem, 80)[1:-1]}") from None
    except (ConfigError, RecursionError, MemoryError):
        raise
    except Exception as e:   # noqa: BLE001 - a constructor's own error (a tag on the wrong kind of node)
        raise ConfigError(f"{path}: invalid YAML: {type(e).__name__}: {excerpt(str(e), 80)[1:-1]}") from None


# --- validation ------------------------------------------------------------

def _number(key: str, value: Any, *, allow_zero: bool = False, minimum: float = 0.0) -> float:
    if isinstance(value, str):
        from ringd.inputs.timespan import parse_timespan
        try:
            value = parse_timespan(value)
        except ValueError as e:
            raise ConfigError(f"{key}: {e}, got {excerpt(value)}") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{key}: must be a number of seconds or a time span like \"15min\", "
                          f"got {excerpt(value)}")
    if value != value or value in (float("inf"), float("-inf")):
        raise ConfigError(f"{key}: must be a finite number, got {excerpt(value)}")
    if value < 0 or (value == 0 and not allow_zero):
        need = "zero or more" if allow_zero else "greater than zero"
        raise ConfigError(f"{key}: must be {need}, got {excerpt(value)}")
    if value > MAX_DURATION:
        raise ConfigError(f"{key}: must be at most {MAX_DURATION} s (10 years), got {excerpt(value)}")
    if value < minimum:
        raise ConfigError(f"{key}: must be at least {minimum:g} s (a shorter one makes the daemon spin), "
                          f"got {excerpt(value)}")
    return float(value) if isinstance(value, float) else value


def _integer(key: str, value: Any, *, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{key}: must be an integer, got {excerpt(value)}")
    if value < minimum:
        raise ConfigError(f"{key}: must be at least {minimum}, got {excerpt(value)}")
    if value > MAX_COUNT:
        raise ConfigError(f"{key}: must be at most {MAX_COUNT}, got {excerpt(value)}")
    return value


def _argv(key: str, value: Any) -> Optional[Tuple[str, ...]]:
    if value is None:
        return None
    if not isinstance(value, list) or not value or not all(isinstance(x, str) and x for x in value):
        raise ConfigError(f"{key}: must be null or a non-empty list of strings (an argv), got {excerpt(value)}")
    return tuple(value)


def _home_path(key: str, value: str) -> str:
    """A path from the config (``check_path``) whose leading ``~`` or ``~user``
    expands. One that cannot (no such user; no HOME and no passwd entry) was
    taken as is: ``ring.roster: ~nosuchuser/ring.txt`` made every command die in
    ``Path.expanduser`` (``ringd run`` with a traceback, ``check`` an "internal
    error"), and a cwd named a folder ``~nosuchuser`` beside the roster."""
    check_path(key, value)
    if value.startswith("~") and os.path.expanduser(value).startswith("~"):
        user = value[1:].split("/", 1)[0]
        who = f"no user {excerpt(user, 20)}" if user else "no home directory (HOME unset, no passwd entry)"
        raise ConfigError(f"{key}: cannot expand {excerpt(value)}: {who}")
    return value


def _mapping(key: str, value: Any) -> Mapping[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigError(f"{key}: must be a mapping, got {excerpt(value)}")
    for k in value:
        if not isinstance(k, str):
            # an agent may be named "on", "no", "123" or "2024-01-01": YAML 1.1 reads
            # those unquoted as a bool, a number or a date, and the key is lost
            raise ConfigError(f"{key}: keys must be strings, got {excerpt(k)} "
                              f"(YAML reads on/off/yes/no, numbers and dates as such: put the key in quotes)")
    return value


# A key is input too: one that is not a plain short name is quoted as an
# excerpt, so a newline, an escape sequence or 100 kB in it never reaches the
# operator's one-line error (nor the terminal's control codes).
_PLAIN_KEY = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}")


def _key(prefix: str, k: Any) -> str:
    """``prefix.k`` as an error message names it."""
    name = k if isinstance(k, str) and _PLAIN_KEY.fullmatch(k) else excerpt(k)
    return f"{prefix}.{name}" if prefix else name


def _unknown(section: str, given: Mapping[str, Any], known: set) -> None:
    for k in given:
        if k not in known:
            raise ConfigError(f"{_key(section, k)}: unknown key (known: {', '.join(sorted(known))})")


_RING_DURATIONS = {"run_budget", "stall_threshold", "heartbeat_interval", "backoff_initial", "fast_fail",
                   "backoff_max", "quarantine_cooloff", "lease_ttl"}


def _ring(raw: Mapping[str, Any]) -> RingSettings:
    known = {"run_budget", "stall_threshold", "heartbeat_interval", "lap_pause",
             "tempfail_exit_code", "backoff_initial", "backoff_max", "keep_logs", "keep_runs",
             "quarantine_after", "quarantine_cooloff", "fast_fail", "roster", "watchdog", "journal", "lease_ttl",
             "state_dir"}
    _unknown("ring", raw, known)
    values: dict = {}
    for k, v in raw.items():
        key = f"ring.{k}"
        if k == "heartbeat_interval":
            values[k] = _number(key, v, minimum=MIN_TICK)
        elif k == "lease_ttl":   # a many-host driver beats every TTL/5 (ringd.core.lease.beat_every)
            values[k] = _number(key, v, minimum=BEATS_PER_TTL * MIN_TICK)
        elif k in _RING_DURATIONS:
            values[k] = _number(key, v)
        elif k == "lap_pause":
            values[k] = _number(key, v, allow_zero=True)
        elif k == "tempfail_exit_code":
            values[k] = _integer(key, v, minimum=1)
            if values[k] > 255:
                raise ConfigError(f"{key}: must be an exit code between 1 and 255, got {excerpt(v)}")
        elif k == "keep_logs":
            values[k] = _integer(key, v, minimum=1)
        elif k == "keep_runs":
            values[k] = _integer(key, v, minimum=0)
        elif k == "quarantine_after":
            values[k] = _integer(key, v, minimum=0)
        elif k == "watchdog":
            values[k] = None if v is None else _number(key, v)
        elif k in ("roster", "state_dir"):
            if v is not None and (not isinstance(v, str) or not v):
                raise ConfigError(f"{key}: must be null or a path, got {excerpt(v)}")
            values[k] = v if v is None else _home_path(key, v)
        elif k == "journal":
            if v is not None and (not isinstance(v, str) or not v.startswith(("postgresql://", "postgres://"))):
                raise ConfigError(f"{key}: must be null (SQLite in the state dir) or a "
                                  f"postgresql:// URI, got {excerpt(v)[:12]}...")
            if v is not None:
                import importlib.util  # find, never import: only the PostgreSQL path loads psycopg
                if importlib.util.find_spec("psycopg") is None:
                    raise ConfigError(f"{key}: a PostgreSQL journal needs psycopg: "
                                      f"pip install 'ring[pg]' (or psycopg[binary])")
                problem = dsn_problem(v)
                if problem:
                    raise ConfigError(f"{key}: {problem}")
            values[k] = v
    ring = RingSettings(**values)
    if ring.stall_threshold <= ring.run_budget:
        raise ConfigError(f"ring.stall_threshold: must be greater than ring.run_budget "
                          f"({ring.stall_threshold} <= {ring.run_budget})")
    if ring.backoff_max < ring.backoff_initial:
        raise ConfigError(f"ring.backoff_max: must be at least ring.backoff_initial "
                          f"({ring.backoff_max} < {ring.backoff_initial})")
    return ring


def dsn_problem(dsn: str) -> Optional[str]:
    """Why libpq cannot use the PostgreSQL URI ``dsn`` as written (one line, never
    its password), or None. libpq's own parser, no connection: what it refuses
    (an unknown or unencoded query parameter, ``options=-c a=b`` with its '='
    and space as written) failed every start of the driver as an outage, exit 69
    and a restart loop, where ``ringd check`` said ok."""
    from psycopg.conninfo import conninfo_to_dict   # (the PostgreSQL path only)
    from ringd.core.dsn import scrub
    try:
        parts = conninfo_to_dict(dsn)
    except Exception as e:   # psycopg.ProgrammingError: libpq's words, which may quote a token
        return f"libpq cannot read it: {scrub(' '.join(str(e).split()), dsn)[:200]}"
    if "@" in str(parts.get("host") or ""):
        # libpq ends the user and password at the first '@': the rest became the host
        # (and a redacted line showed the password's tail)
        return "an '@' in its user name or password must be written %40 (libpq read the rest as the host)"
    return None


def _agents(raw: Mapping[str, Any], ring: RingSettings) -> Mapping[str, AgentOverride]:
    out = {}
    for name, spec in raw.items():
        section = f"agents.{name}"
        if not NAME_RE.fullmatch(name):
            raise ConfigError(f"agents: {excerpt(name)} is not a valid agent name")
        spec = _mapping(section, spec)
        _unknown(section, spec, {"run_budget", "stall_threshold", "cwd", "watchdog", "schedule", "every", "quota"})
        values: dict = {}
        for k in ("run_budget", "stall_threshold"):
            if k in spec:
                values[k] = _number(f"{section}.{k}", spec[k])
        values.update(_talk_keys(section, spec))
        if spec.get("quota") is not None:
            if not isinstance(spec["quota"], str):
                raise ConfigError(f"{section}.quota: must be the name of a pool (quotas:), "
                                  f"got {excerpt(spec['quota'])}")
            values["quota"] = spec["quota"]
        if "cwd" in spec:
            if not isinstance(spec["cwd"], str) or not spec["cwd"]:
                raise ConfigError(f"{section}.cwd: must be a directory path, got {excerpt(spec['cwd'])}")
            values["cwd"] = _home_path(f"{section}.cwd", spec["cwd"])
        o = AgentOverride(**values)
        budget = o.run_budget if o.run_budget is not None else ring.run_budget
        stall = o.stall_threshold if o.stall_threshold is not None else ring.stall_threshold
        if stall <= budget:
            key = f"{section}.stall_threshold" if o.stall_threshold is not None else f"{section}.run_budget"
            raise ConfigError(f"{key}: stall_threshold must be greater than run_budget "
                              f"for agent {name} ({stall} <= {budget})")
        out[name] = o
    return out


def _talk_keys(section: str, spec: Mapping[str, Any]) -> dict:
    """``watchdog``, ``schedule`` and ``every`` of one agent (null = off)."""
    from ringd.inputs.schedule import ScheduleError, check_cron
    values: dict = {}
    if "watchdog" in spec:   # null: off for this agent, whatever ring.watchdog says
        values["watchdog"] = 0.0 if spec["watchdog"] is None else _number(f"{section}.watchdog", spec["watchdog"])
    if spec.get("schedule") is not None and spec.get("every") is not None:
        raise ConfigError(f"{section}.every: give either schedule or every, not both")
    if spec.get("schedule") is not None:
        try:
            values["schedule"] = check_cron(spec["schedule"])
        except ScheduleError as e:
            raise ConfigError(f"{section}.schedule: {e}, got {excerpt(spec['schedule'])}") from None
    if spec.get("every") is not None:
        values["every"] = _number(f"{section}.every", spec["every"])
    return values


def _units(key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{key}: must be a whole number of units, got {excerpt(value)}")
    if value < 0:
        raise ConfigError(f"{key}: must be zero or more, got {excerpt(value)}")
    if value > MAX_UNITS:
        raise ConfigError(f"{key}: must be at most {MAX_UNITS}, got {excerpt(value)}")
    return value


def _quotas(raw: Mapping[str, Any], agents: Mapping[str, AgentOverride]) -> Mapping[str, Pool]:
    """``quotas:`` (named pools), checked against ``agents``: every agent's
    ``quota`` names a pool; a reserve is for a scheduled agent of that pool,
    and no larger than its limit."""
    pools = {}
    for name, spec in raw.items():
        section = _key("quotas", name)
        if not POOL_RE.fullmatch(name):
            raise ConfigError(f"quotas: {excerpt(name)} is not a valid pool name")
        spec = _mapping(section, spec)
        _unknown(section, spec, {"limit", "window", "reserve"})
        for k in ("limit", "window"):
            if k not in spec:
                raise ConfigError(f"{section}.{k}: missing (a pool needs a limit and a window)")
        limit = _units(f"{section}.limit", spec["limit"])
        window = _number(f"{section}.window", spec["window"])
        reserve = {}
        for agent, units in _mapping(f"{section}.reserve", spec.get("reserve")).items():
            key = _key(f"{section}.reserve", agent)
            reserve[agent] = _units(key, units)
            o = agents.get(agent)
            if o is None or (o.schedule is None and o.every is None):
                raise ConfigError(f"{key}: {agent} is not a scheduled agent (a reserve is kept for an agent "
                                  f"with agents.{agent}.schedule or every)")
            if o.quota != name:
                raise ConfigError(f"{key}: {agent} does not draw on this pool (set agents.{agent}.quota: {name})")
            if reserve[agent] > limit:
                raise ConfigError(f"{key}: {reserve[agent]} is larger than {section}.limit ({limit})")
        pools[name] = Pool(name, limit, float(window), reserve)
    for agent, o in agents.items():
        if o.quota is not None and o.quota not in pools:
            known = ", ".join(sorted(pools)) or "none"
            raise ConfigError(f"agents.{agent}.quota: no pool named {excerpt(o.quota)} (quotas: {known})")
    return pools


def _watch(raw: Mapping[str, Any]) -> WatchSettings:
    known = {"poll_interval", "stale_after", "restart_sec", "start_limit_burst",
             "start_limit_interval", "restart_command"}
    _unknown("watch", raw, known)
    values: dict = {}
    for k, v in raw.items():
        key = f"watch.{k}"
        if k == "poll_interval":
            values[k] = _number(key, v, minimum=MIN_TICK)
        elif k in ("stale_after", "start_limit_interval"):
            values[k] = _number(key, v)
        elif k == "restart_sec":
            values[k] = _number(key, v, allow_zero=True)
        elif k == "start_limit_burst":
            values[k] = _integer(key, v, minimum=1)
        elif k == "restart_command":
            values[k] = _argv(key, v)
    return WatchSettings(**values)


def _alerts(raw: Mapping[str, Any]) -> AlertSettings:
    _unknown("alerts", raw, {"command", "failures_in_a_row", "timeout", "silent_after", "paused_longer_than"})
    values: dict = {}
    for k in ("silent_after", "paused_longer_than"):   # null: off
        if raw.get(k) is not None:
            values[k] = _number(f"alerts.{k}", raw[k])
    if "timeout" in raw:
        values["timeout"] = _number("alerts.timeout", raw["timeout"])
    if "command" in raw:
        values["command"] = _argv("alerts.command", raw["command"])
    if "failures_in_a_row" in raw:
        values["failures_in_a_row"] = _integer("alerts.failures_in_a_row", raw["failures_in_a_row"], minimum=1)
    return AlertSettings(**values)


def _check_strings(value: Any, key: str) -> None:
    """No string anywhere in the document (key or value) may hold a NUL byte or a
    lone surrogate: no system call takes one, so each would crash the first
    command that used it (a cwd, a roster path, an argv) instead of failing here."""
    if isinstance(value, dict):
        for k, v in value.items():
            _check_strings(k, key)
            _check_strings(v, _key(key, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _check_strings(v, f"{key}[{i}]")
    elif isinstance(value, str):
        if "\x00" in value:
            raise ConfigError(f"{key or '(top level)'}: contains a NUL byte: {excerpt(value)}")
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise ConfigError(f"{key or '(top level)'}: contains an invalid character: {excerpt(value)}") from None


def parse_config(data: Any, path: Optional[Path] = None) -> Config:
    """Validate an already-parsed YAML document (None = empty = all defaults)."""
    _check_strings(data, "")
    top = _mapping("(top level)", data)
    for k in top:
        if k not in ("ring", "agents", "watch", "alerts", "quotas"):
            raise ConfigError(f"{_key('', k)}: unknown top-level key (known: agents, alerts, quotas, ring, watch)")
    ring = _ring(_mapping("ring", top.get("ring")))
    agents = _agents(_mapping("agents", top.get("agents")), ring)
    watch = _watch(_mapping("watch", top.get("watch")))
    alerts = _alerts(_mapping("alerts", top.get("alerts")))
    quotas = _quotas(_mapping("quotas", top.get("quotas")), agents)
    warnings = []
    if watch.start_limit_interval < watch.start_limit_burst * watch.restart_sec:
        warnings.append(
            f"watch.start_limit_interval ({watch.start_limit_interval}) is shorter than "
            f"start_limit_burst x restart_sec ({watch.start_limit_burst} x {watch.restart_sec}): "
            f"the start limit can never trigger")
    if watch.stale_after <= ring.heartbeat_interval:
        warnings.append(
            f"watch.stale_after ({watch.stale_after}) is not longer than ring.heartbeat_interval "
            f"({ring.heartbeat_interval}): a healthy driver will look stale between two beats")
    return Config(ring=ring, agents=agents, watch=watch, alerts=alerts, quotas=quotas, path=path,
                  warnings=tuple(warnings))


_parsed: "list[tuple[bytes, Any]]" = []   # the last document parsed (locate and load_config read it once)


def read_document(path: Path) -> "tuple[Any, bool]":
    """The YAML document at ``path`` and whether it is safe from other writers
    (safefile.read_checked_file). Raises ConfigError naming the file: unreadable,
    too big, not UTF-8, not YAML. The bytes are read each time (the mode checked
    each time); the same bytes are parsed once per process."""
    blob, trusted = read_checked_file(path, "config file", MAX_CONFIG_BYTES)
    if len(blob) > MAX_CONFIG_BYTES:
        raise ConfigError(f"{path}: config file is larger than {MAX_CONFIG_BYTES // 1024} KiB")
    if _parsed and _parsed[0][0] == blob:
        return _parsed[0][1], trusted
    try:
        text = blob.decode("utf-8")
    except UnicodeDecodeError as e:
        line = blob.count(b"\n", 0, e.start) + 1
        raise ConfigError(f"{path}: line {line}: config file is not UTF-8 text (byte {e.start})") from None
    if "\x00" in text:
        raise ConfigError(f"{path}: config file contains NUL bytes")
    data = _safe_yaml(text, path)
    _parsed[:] = [(blob, data)]
    return data, trusted


def load_config(path: Optional[Path]) -> Config:
    """Load ``path`` (None: built-in defaults). Raises ConfigError naming file and key."""
    if path is None:
        return Config()
    data, trusted = read_document(path)
    try:
        config = parse_config(data, path)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None
    if not trusted:  # a reading command never runs a command others may have written
        config = replace(config, alerts=replace(config.alerts, command=None))
    return replace(config, signature=file_signature(path))


def file_signature(path: Optional[Path]) -> Optional[Tuple[int, ...]]:
    """(device, inode, size, mtime ns) of the file at ``path``, None if it cannot
    be read: a config edited (or replaced) since it was loaded has another."""
    try:
        st = os.stat(path) if path is not None else None
    except OSError:
        return None
    return None if st is None else (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def config_changes(old: Config, new: Config) -> "list[str]":
    """Pure: what differs between two configs, one ``key: old -> new`` each
    (``agents.NAME`` added or removed as a whole)."""
    from dataclasses import fields
    out = []
    for section in ("ring", "watch", "alerts"):
        a, b = getattr(old, section), getattr(new, section)
        for f in fields(a):
            x, y = getattr(a, f.name), getattr(b, f.name)
            if x != y:
                out.append(f"{section}.{f.name}: {_shown_value(f.name, x)} -> {_shown_value(f.name, y)}")
    for section in ("agents", "quotas"):
        a, b = getattr(old, section), getattr(new, section)
        for name in sorted(set(a) | set(b)):
            x, y = a.get(name), b.get(name)
            if x == y:
                continue
            if x is None or y is None:
                out.append(f"{section}.{name}: {'added' if x is None else 'removed'}")
                continue
            for f in fields(x):
                if getattr(x, f.name) != getattr(y, f.name):
                    out.append(f"{section}.{name}.{f.name}: {_shown_value(f.name, getattr(x, f.name))} -> "
                               f"{_shown_value(f.name, getattr(y, f.name))}")
    return out


def _shown_value(key: str, value: Any) -> str:
    """A config value as a change line shows it (a journal URI never with its password)."""
    if value is None:
        return "null"
    if key == "journal":
        from ringd.core.dsn import redact
        return redact(str(value))
    if isinstance(value, tuple):
        return "[" + ", ".join(map(str, value)) + "]"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


@dataclass(frozen=True)
class Essentials:
    """What a command cannot do without, even from a config that is broken
    elsewhere: where the state dir and the journal are."""
    state_dir: Optional[str]   # ring.state_dir, ``~``-expanded (None: not set)
    journal: Optional[str]     # ring.journal (None: SQLite in the state dir)
    lease_ttl: float


def essentials(path: Path) -> Essentials:
    """``ring.state_dir``, ``ring.journal`` and ``ring.lease_ttl`` of the config at
    ``path``, each checked alone: a bad key or value elsewhere does not matter.
    ConfigError when the file cannot be read, is not YAML, or one of these is bad."""
    data, _ = read_document(path)
    ring = data.get("ring") if isinstance(data, dict) else None
    picked = {k: ring[k] for k in ("state_dir", "journal", "lease_ttl") if k in ring} \
        if isinstance(ring, dict) else {}
    try:
        _check_strings(picked, "ring")
        settings = _ring(picked)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None
    sd = settings.state_dir
    return Essentials(os.path.expanduser(sd) if sd else None, settings.journal, settings.lease_ttl)
