"""``ringd service print|install``: systemd units and the launchd property list,
rendered for *this* installation (the absolute paths of the ``ringd`` and
``ringwatch`` next to the running Python), a state dir and a config.

Modes: ``watcher`` (systemd keeps ringwatch alive, ringwatch owns the driver),
``systemd`` (systemd owns ringd; ringwatch-systemd restarts it through
systemctl), ``launchd`` (macOS; launchd keeps ringwatch alive).

Who runs the ring: ``--user NAME`` (an account that must exist) or, by default,
a systemd dynamic user named ``ring`` (``DynamicUser=yes``: allocated by systemd
when the unit starts, never a name in /etc/passwd that nothing creates). On
launchd: a LaunchAgent of the installing user, or a LaunchDaemon with
``UserName`` when ``--user`` is given.

``render`` is pure (paths in, file texts out); ``install`` writes them where
the init system reads them, under ``--root`` when given, never overwriting a
file that differs.
"""
from __future__ import annotations

import json
import os
import plistlib
import pwd
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from ringd.inputs.config import Config
from ringd.core.errors import EX_BAD_USAGE, EX_FAILURE, ConfigError, excerpt
from ringd.host.safefile import check_path, create_new
from ringd.cli.status import OperatorError

MODES = ("watcher", "systemd", "launchd")
SYSTEM_STATE = Path("/var/lib/ring")
SYSTEM_CONFIG = Path("/etc/ring/ring.yaml")   # (config.SYSTEM_CONFIG: the last place commands look)
LAUNCHD_STATE = Path("/usr/local/var/ring")
DYNAMIC_USER = "ring"
LABEL = "org.ring.ringwatch"
RESTART_COMMAND = ["systemctl", "restart", "ringd"]
POLKIT_RULE = "50-ring.rules"
UNITS = {"watcher": ("ringwatch.service",), "systemd": ("ringd.service", "ringwatch-systemd.service")}
STOP_GRACE_WATCHER = 30   # s; ringwatch gives the driver 10 s, the driver its agent 3 s
STOP_GRACE_DRIVER = 15


def installation_bin_dir() -> Path:
    """Where this installation's console scripts live: the bin dir of the running
    Python (a venv's bin, pipx's venv), else wherever ``ringd`` is on PATH."""
    here = Path(sys.executable).parent
    for prog in ("ringd", "ringwatch"):
        if not (here / prog).exists():
            found = shutil.which(prog)
            return Path(found).resolve().parent if found else here
    return here


@dataclass
class Target:
    mode: str
    bin_dir: Path
    state_dir: Path
    config_path: Path
    user: Optional[str] = None           # None: DynamicUser (systemd) / the installing user (launchd)
    # False: the service finds its config by the search, as every command does (a
    # launchd agent's, in its user's ~/.config: no home directory in a shipped file)
    config_in_args: bool = True
    files: Dict[str, str] = field(default_factory=dict)
    warnings: List[str] = field(default_factory=list)


def _defaults(mode: str, state: Optional[Path], config: Optional[Path], user: Optional[str]) -> Tuple[Path, Path]:
    """The state dir and the config of a service: the config where every
    command's search finds it (config.config_candidates) - /etc/ring/ring.yaml
    for a system service, the installing user's XDG config for a per-user one
    (a launchd LaunchAgent)."""
    if mode == "launchd":
        return state or LAUNCHD_STATE, config or (SYSTEM_CONFIG if user else user_config())
    return state or SYSTEM_STATE, config or SYSTEM_CONFIG


def user_config() -> Path:
    """This user's config in the search order: ``$XDG_CONFIG_HOME/ring/ring.yaml``
    (``~/.config/ring/ring.yaml``)."""
    from ringd.inputs.config import config_candidates
    env = dict(os.environ)
    env.setdefault("HOME", os.path.expanduser("~"))
    found = [p for p in config_candidates(env, "/") if p not in ("/config/ring.yaml", str(SYSTEM_CONFIG))]
    return Path(found[0]) if found else Path(os.path.expanduser("~/.config/ring/ring.yaml"))


def search_warnings(t: "Target") -> List[str]:
    """A config the commands' search does not find: they would all need --config."""
    from ringd.inputs.config import config_candidates
    env = dict(os.environ)
    env.setdefault("HOME", os.path.expanduser("~"))
    if str(t.config_path) in config_candidates(env, "/nowhere"):
        return []
    return [f"--config {t.config_path}: ring's commands look for a config at {SYSTEM_CONFIG} and "
            f"~/.config/ring/ring.yaml; elsewhere, each needs --config {t.config_path} (or RING_CONFIG)"]


def target(mode: str, *, bin_dir: Optional[Path] = None, state: Optional[Path] = None,
           config: Optional[Path] = None, user: Optional[str] = None) -> Target:
    """Validate the choices (one-line OperatorError, exit 2) and render the files."""
    if mode not in MODES:
        raise OperatorError(f"unknown mode {mode!r} (use {', '.join(MODES)})", EX_BAD_USAGE)
    state_dir, config_path = _defaults(mode, state, config, user)
    bin_what = "--bin-dir" if bin_dir is not None else "this installation's bin dir (give --bin-dir)"
    bin_dir = bin_dir or installation_bin_dir()
    # Every path goes into ExecStart= (split at spaces, '%' a specifier, '$' a
    # variable) or a UTF-8 plist, the programs' too: the same rule for each.
    for what, p in (("--state", state_dir), ("--config", config_path), (bin_what, bin_dir)):
        if not p.is_absolute():
            raise OperatorError(f"{what} {p}: a service needs an absolute path", EX_BAD_USAGE)
        if not str(p).isprintable() or any(c.isspace() or c in "\"'\\%$;" for c in str(p)):
            raise OperatorError(f"{what} {excerpt(str(p), 200)}: use a path of printable UTF-8 without spaces, "
                                f"quotes, '%', '$' or ';'", EX_BAD_USAGE)
        try:
            check_path(what, str(p))   # (a component over NAME_MAX, a path over PATH_MAX: systemd refuses the unit)
        except ConfigError as e:
            raise OperatorError(str(e), EX_BAD_USAGE) from None
    if user is not None:
        try:
            account = pwd.getpwnam(user)
        except KeyError:
            raise OperatorError(f"--user {user}: no such user on this box (create it first, or leave "
                                f"--user out for a systemd dynamic user)", EX_BAD_USAGE) from None
        if _is_overflow_user(account):
            raise OperatorError(f"--user {user}: {user} is not a service user (uid {account.pw_uid} is the "
                                f"kernel's overflow user, which unmapped ids of other namespaces and NFS clients "
                                f"also appear as); create a user for the ring, or leave --user out for a systemd "
                                f"dynamic user", EX_BAD_USAGE)
    if mode != "launchd" and user is None and not _under_var_lib(state_dir):
        raise OperatorError(f"--state {state_dir}: a dynamic user can only own a state dir under /var/lib; "
                            f"give --user NAME for a state dir elsewhere", EX_BAD_USAGE)
    t = Target(mode=mode, bin_dir=bin_dir, state_dir=state_dir,
               config_path=config_path, user=user, config_in_args=not (mode == "launchd" and not user and not config))
    t.files = render(t)
    t.warnings = missing_programs(t) + hidden_by_private_tmp(t) + search_warnings(t)
    return t


OVERFLOW_UID = 65534   # nobody's uid; the kernel's overflowuid unless set otherwise


def _is_overflow_user(account: pwd.struct_passwd) -> bool:
    """``nobody``: the name, uid 65534, or the kernel's overflow uid - the owner
    the kernel shows for ids it cannot map (NFS root squash, user namespaces),
    so a ring run as it shares its files with all of those."""
    try:
        with open("/proc/sys/kernel/overflowuid") as f:
            overflow = int(f.read().strip())
    except (OSError, ValueError):
        overflow = OVERFLOW_UID
    return account.pw_name == "nobody" or account.pw_uid in (OVERFLOW_UID, overflow)


PRIVATE_TMP = (Path("/tmp"), Path("/var/tmp"))


def hidden_by_private_tmp(t: Target) -> List[str]:
    """The programs (and state dir and config) of a systemd unit under /tmp or
    /var/tmp: PrivateTmp=yes gives the unit its own empty ones, so the unit
    fails to start (203/EXEC) or finds no state. One warning naming them."""
    if t.mode == "launchd":
        return []
    progs = ("ringd", "ringwatch") if t.mode == "systemd" else ("ringwatch",)
    paths = [t.bin_dir / p for p in progs] + [t.state_dir, t.config_path]
    hidden = []
    for p in paths:
        for shown in dict.fromkeys((p, Path(os.path.realpath(p)))):
            if any(shown == tmp or tmp in shown.parents for tmp in PRIVATE_TMP) and str(p) not in hidden:
                hidden.append(str(p))
    if not hidden:
        return []
    return [f"{', '.join(hidden)}: under /tmp or /var/tmp, which PrivateTmp=yes hides from the unit: it would "
            f"not start (203/EXEC) or find no state; install ring (or keep the state and config) elsewhere"]


def missing_programs(t: Target) -> List[str]:
    """The programs the files start that are not executable in ``bin_dir`` here:
    such a unit fails ``systemd-analyze verify`` and never starts. Only a warning:
    ``--bin-dir`` may name the layout of another box."""
    progs = ("ringd", "ringwatch") if t.mode == "systemd" else ("ringwatch",)
    missing = [str(t.bin_dir / p) for p in progs if not os.access(t.bin_dir / p, os.X_OK)]
    if not missing:
        return []
    return [f"{' and '.join(missing)}: no such executable here; the service will not start on this box "
            f"until it exists (install ring there, or give --bin-dir)"]


def _under_var_lib(p: Path) -> bool:
    """systemd's StateDirectory= can create (and a dynamic user own) only these."""
    return str(p).startswith("/var/lib/") and p != Path("/var/lib")


# --- systemd ---------------------------------------------------------------------------

def _identity(t: Target) -> List[str]:
    if t.user is None:
        return ["# A user allocated by systemd when the unit starts (no account to create);",
                "# units with the same User= share it. For a real account: ringd service",
                "# install --user NAME.",
                "DynamicUser=yes", f"User={DYNAMIC_USER}"]
    return [f"User={_unit_value(t.user)}"]


def _unit_value(text: str) -> str:
    """``text`` as a unit file setting reads it: '%' starts a specifier (a
    user 'a%b' ran as 'a' + the boot id), so it is doubled."""
    return text.replace("%", "%%")


def _state_lines(t: Target) -> List[str]:
    rel = os.path.relpath(t.state_dir, "/var/lib")
    if _under_var_lib(t.state_dir):
        return [f"# {t.state_dir}, created 0700 and owned by the unit's user",
                f"StateDirectory={rel}", "StateDirectoryMode=0700"]
    return [f"ReadWritePaths={t.state_dir}"]


def _sandbox(t: Target) -> List[str]:
    return [
        "# Sandbox: the whole file system is read-only but the state dir; agents",
        "# run here too. Agents that must write elsewhere: add one line,",
        "#   ReadWritePaths=/the/dir/they/write",
        "# (systemctl edit <unit>). /tmp is private to the unit.",
        "ProtectSystem=strict",
        "ProtectHome=read-only",
        "PrivateTmp=yes",
        "PrivateDevices=yes",
        "NoNewPrivileges=yes",
        "CapabilityBoundingSet=",
        "AmbientCapabilities=",
        "ProtectKernelTunables=yes",
        "ProtectKernelModules=yes",
        "ProtectKernelLogs=yes",
        "ProtectClock=yes",
        "ProtectHostname=yes",
        "ProtectProc=invisible",
        "RestrictSUIDSGID=yes",
        "RestrictRealtime=yes",
        "RestrictNamespaces=yes",
        "LockPersonality=yes",
        "RemoveIPC=yes",
        "SystemCallArchitectures=native",
        "SystemCallFilter=@system-service",
        "RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6 AF_NETLINK",
        "# Each run gets its own cgroup (ended with cgroup.kill): the unit's cgroup",
        "# subtree is delegated to the driver. (ProtectControlGroups would make",
        "# it read-only, so it is not set.)",
        "Delegate=yes",
    ]


def _unit(t: Target, *, head: List[str], unit: List[str], service: List[str]) -> str:
    lines = head + ["[Unit]"] + unit + ["", "[Service]"] + service + _identity(t) + _state_lines(t) \
        + ["UMask=0077"] + _sandbox(t) + ["", "[Install]", "WantedBy=multi-user.target", ""]
    return "\n".join(lines)


def _throttle(c: Config) -> List[str]:
    w = c.watch
    return ["# Match the watch.* defaults of config/ring.yaml (systemd's own, 5 starts",
            "# in 10 s with RestartSec=100ms, would give up within half a second).",
            f"StartLimitIntervalSec={_num(w.start_limit_interval)}", f"StartLimitBurst={w.start_limit_burst}"]


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def _where(t: Target) -> str:
    return f"--state {t.state_dir} --config {t.config_path}"


def _install_hint(t: Target) -> List[str]:
    user = f" --user {t.user}" if t.user else ""
    state = "" if t.state_dir == SYSTEM_STATE else f" --state {t.state_dir}"
    config = "" if t.config_path == SYSTEM_CONFIG else f" --config {t.config_path}"
    return [f"# Rendered by `ringd service print --mode {t.mode}{user}{state}{config}`;",
            f"# `ringd service install --mode {t.mode}{user}{state}{config}` writes it and",
            "# creates the state dir, config and roster when missing."]


def render_watcher(t: Target, c: Config) -> Dict[str, str]:
    head = ["# ring, deployment mode 1: the watcher owns the driver.", "#",
            "# ringwatch starts `ringd run` as its own child, replaces it when it dies or",
            "# hangs, and gives up (exit 70) after watch.start_limit_burst restarts within",
            "# watch.start_limit_interval. systemd in turn keeps ringwatch itself alive.",
            f"# Leave watch.restart_command null in {t.config_path} for this mode.",
            *_install_hint(t),
            "# Do not enable ringd.service or ringwatch-systemd.service as well (mode 2)."]
    unit = ["Description=ring watcher (mode 1: ringwatch owns the ringd driver)",
            "Documentation=man:systemd.exec(5)",
            "After=network-online.target", "Wants=network-online.target",
            "Conflicts=ringd.service ringwatch-systemd.service", *_throttle(c)]
    service = ["Type=notify", "NotifyAccess=main",
               f"ExecStart={t.bin_dir / 'ringwatch'} {_where(t)}",
               "ExecReload=/bin/kill -HUP $MAINPID",
               "# ringwatch pings the watchdog at half this period, whatever it is doing.",
               "WatchdogSec=60", "Restart=always", f"RestartSec={_num(c.watch.restart_sec)}",
               "# 78: configuration error (its own, or the driver's); 70: it gave up (start",
               "# limit hit) and stays down until `ringwatch reset`. Restarting either would",
               "# only repeat the same failure.",
               "RestartPreventExitStatus=70 78", "TimeoutStartSec=60",
               "# ringwatch gives the driver 10 s after SIGTERM (the driver itself gives its",
               "# agent 3 s), then SIGKILLs it; its whole stop, the reap of a killed driver's",
               "# run included, shares one 20 s deadline (a second SIGTERM kills at once).",
               f"TimeoutStopSec={STOP_GRACE_WATCHER}",
               "# On stop, every process of the unit (watcher, driver, agent) gets SIGTERM;",
               "# anything still alive after TimeoutStopSec gets SIGKILL.",
               "KillMode=control-group"]
    return {"ringwatch.service": _unit(t, head=head, unit=unit, service=service)}


def render_systemd(t: Target, c: Config) -> Dict[str, str]:
    head = ["# ring, deployment mode 2: systemd owns the driver.", "#",
            "# systemd starts `ringd run`, restarts it when it exits (Restart=always) or",
            "# stops sending WATCHDOG=1 (it sends one with every heartbeat), and throttles",
            "# restarts. ringwatch-systemd.service watches the heartbeat on top of this and",
            "# runs `systemctl restart ringd` when it goes stale.",
            *_install_hint(t),
            "# Do not enable ringwatch.service (mode 1) as well."]
    unit = ["Description=ring driver (mode 2: systemd owns ringd)",
            "Documentation=man:systemd.exec(5)",
            "After=network-online.target", "Wants=network-online.target",
            "Conflicts=ringwatch.service", *_throttle(c)]
    service = ["Type=notify", "NotifyAccess=main",
               f"ExecStart={t.bin_dir / 'ringd'} run {_where(t)}",
               "ExecReload=/bin/kill -HUP $MAINPID",
               "# The driver sends WATCHDOG=1 with each heartbeat (ring.heartbeat_interval,",
               "# default 10 s), and beats at least every half of this, whatever that says.",
               "WatchdogSec=60", "Restart=always", f"RestartSec={_num(c.watch.restart_sec)}",
               "# 78: configuration error (bad config or roster) - restarting cannot help.",
               "RestartPreventExitStatus=78", "TimeoutStartSec=60",
               "# On SIGTERM the driver gives its agent 3 s, then SIGKILLs the agent's tree.",
               f"TimeoutStopSec={STOP_GRACE_DRIVER}",
               "# Every process of the unit, agents included, is stopped with the driver.",
               "KillMode=control-group"]
    driver = _unit(t, head=head, unit=unit, service=service)

    who = t.user or DYNAMIC_USER
    whead = ["# ring, deployment mode 2: the watcher beside a systemd-owned driver.", "#",
             f"# ringwatch never starts the driver here: {t.config_path} sets",
             "#   watch:",
             "#     restart_command: [systemctl, restart, ringd]",
             "# and it runs that command when the driver's heartbeat goes stale (a hung",
             "# driver that still answers systemd's watchdog, or a wedged heartbeat).",
             f"# The polkit rule {POLKIT_RULE} lets user {who} restart ringd.service (and",
             "# nothing else); it needs polkit (Debian: apt install polkitd).",
             *_install_hint(t)]
    wunit = ["Description=ring watcher (mode 2: restarts the systemd-owned ringd)",
             "Documentation=man:systemd.exec(5)",
             "Wants=ringd.service", "After=ringd.service",
             "Conflicts=ringwatch.service", *_throttle(c)]
    wservice = ["Type=notify", "NotifyAccess=main",
                f"ExecStart={t.bin_dir / 'ringwatch'} {_where(t)}",
                "ExecReload=/bin/kill -HUP $MAINPID",
                "WatchdogSec=60", "Restart=always", f"RestartSec={_num(c.watch.restart_sec)}",
                "RestartPreventExitStatus=70 78", "TimeoutStartSec=60",
                "# Stopping the watcher never stops the driver (it belongs to ringd.service);",
                "# a restart command in flight is killed at once.",
                f"TimeoutStopSec={STOP_GRACE_WATCHER}", "KillMode=control-group"]
    watcher = _unit(t, head=whead, unit=wunit, service=wservice)
    rule = "\n".join([
        f"// ring, deployment mode 2: user {who} (ringwatch-systemd.service) may restart",
        "// ringd.service, and nothing else. Read by polkit from /etc/polkit-1/rules.d/.",
        "polkit.addRule(function(action, subject) {",
        '    if (action.id == "org.freedesktop.systemd1.manage-units" &&',
        '        action.lookup("unit") == "ringd.service" &&',
        f'        subject.user == {json.dumps(who)} &&',   # a JS string ('DOM\\joe', winbind's names)
        '        (action.lookup("verb") == "restart" || action.lookup("verb") == "start")) {',
        "        return polkit.Result.YES;",
        "    }",
        "});", ""])
    return {"ringd.service": driver, "ringwatch-systemd.service": watcher, POLKIT_RULE: rule}


# --- launchd ----------------------------------------------------------------------------

def render_launchd(t: Target, c: Config) -> Dict[str, str]:
    log = t.state_dir / "ringwatch.log"
    if "--" in f"{t.state_dir}{t.config_path}":
        raise OperatorError("a launchd property list cannot name a path containing '--'", EX_BAD_USAGE)
    plist = {
        "Label": LABEL,
        "ProgramArguments": [str(t.bin_dir / "ringwatch"), "--state", str(t.state_dir)]
        + (["--config", str(t.config_path)] if t.config_in_args else []),
        "WorkingDirectory": str(t.state_dir),
        "EnvironmentVariables": {"PATH": f"{t.bin_dir}:/usr/local/bin:/opt/homebrew/bin:/usr/bin:/bin:/usr/sbin:/sbin"},
        "Umask": 0o077,
        "RunAtLoad": True,
        # Relaunch after a crash or a non-zero exit; a clean exit (0, after
        # SIGTERM) leaves it stopped.
        "KeepAlive": {"SuccessfulExit": False},
        "ThrottleInterval": int(c.watch.restart_sec),
        "ExitTimeOut": STOP_GRACE_WATCHER,
        "ProcessType": "Standard",
        "StandardOutPath": str(log),
        "StandardErrorPath": str(log),
    }
    if t.user is not None:
        plist["UserName"] = t.user
    body = plistlib.dumps(plist, sort_keys=True).decode()
    kind = f"a LaunchDaemon running as {t.user}" if t.user else "a LaunchAgent of the installing user"
    # (an XML comment may not hold "--": options are named without their dashes)
    note = ("<!--\n"
            "  ring, deployment mode 1 on macOS: launchd keeps ringwatch alive, ringwatch\n"
            "  owns the driver (`ringd run` is its child).\n"
            f"  This is {kind}.\n"
            "  Rendered by `ringd service print` (mode launchd); `ringd service install`\n"
            f"  writes it and creates {t.state_dir} (0700),\n"
            "  the config and the roster when missing.\n"
            + ("" if t.config_in_args else
               "  ringwatch finds its config as every command does: the user's\n"
               "  ~/.config/ring/ring.yaml (install writes it there).\n")
            +
            f"  ringwatch's own log: {log}\n"
            "-->\n")
    head, _, rest = body.partition("<plist")
    return {f"{LABEL}.plist": head + note + "<plist" + rest}


def render(t: Target) -> Dict[str, str]:
    c = Config()
    if t.mode == "watcher":
        return render_watcher(t, c)
    if t.mode == "systemd":
        return render_systemd(t, c)
    return render_launchd(t, c)


# --- install ------------------------------------------------------------------------------

def destinations(t: Target) -> Dict[str, Path]:
    """Where each rendered file goes (before --root)."""
    if t.mode == "launchd":
        where = Path("/Library/LaunchDaemons") if t.user else Path.home() / "Library" / "LaunchAgents"
        return {name: where / name for name in t.files}
    out = {}
    for name in t.files:
        out[name] = (Path("/etc/polkit-1/rules.d") if name == POLKIT_RULE else Path("/etc/systemd/system")) / name
    return out


def enable_commands(t: Target, root: Optional[Path]) -> List[List[str]]:
    """What turns the service on: run in order, each only if the one before succeeded."""
    if t.mode == "launchd":
        plist = str(_under(root, destinations(t)[f"{LABEL}.plist"]))
        domain = "system" if t.user else f"gui/{os.getuid()}"
        return [["launchctl", "bootstrap", domain, plist]]
    units = list(UNITS[t.mode])
    if root is not None:   # an offline tree: no manager to reload or start
        return [["systemctl", f"--root={root}", "enable", *units]]
    return [["systemctl", "daemon-reload"], ["systemctl", "enable", "--now", *units]]


def _under(root: Optional[Path], p: Path) -> Path:
    return p if root is None else Path(str(root).rstrip("/") + str(p))


@dataclass
class Installed:
    written: List[Path] = field(default_factory=list)
    unchanged: List[Path] = field(default_factory=list)
    layout: Optional[object] = None
    enable: List[List[str]] = field(default_factory=list)
    warnings: List[str] = field(default_factory=list)


def install(t: Target, root: Optional[Path] = None) -> Installed:
    """Write the files (0644) under ``root``; create the state dir, config and
    roster when missing. A file that exists with other content is never
    overwritten: OperatorError(1) naming it, and nothing is written."""
    from ringd.cli.init import Layout, create_missing, default_config_text, make_folders
    result = Installed()
    plan = {name: _under(root, dest) for name, dest in destinations(t).items()}
    clashes = []
    for name, dest in plan.items():
        if dest.exists() or dest.is_symlink():
            # (bytes: a file there that is not UTF-8 is a clash, not a crash)
            if dest.is_file() and not dest.is_symlink() and dest.read_bytes() == t.files[name].encode():
                result.unchanged.append(dest)
            else:
                clashes.append(dest)
    if clashes:
        raise OperatorError(f"{', '.join(map(str, clashes))} already exist{'s' if len(clashes) == 1 else ''} "
                            f"with other content; ringd service install never overwrites (move it aside)", EX_FAILURE)
    owner = pwd.getpwnam(t.user).pw_uid if t.user and os.geteuid() == 0 else None
    restart = RESTART_COMMAND if t.mode == "systemd" else None
    layout = Layout(state_dir=_under(root, t.state_dir), config_path=_under(root, t.config_path),
                    roster_path=_under(root, t.state_dir / "ring.txt"),
                    config_text=default_config_text(restart, state_dir=t.state_dir), owner=owner)
    result.layout = create_missing(layout)
    if layout.config_path in layout.kept:
        result.warnings += kept_config_warnings(layout.config_path, t.state_dir)
    if layout.config_path in layout.kept and t.mode == "systemd":
        if "restart_command: [systemctl, restart, ringd]" not in layout.config_path.read_text():
            result.warnings.append(f"{layout.config_path}: set watch.restart_command: [systemctl, restart, "
                                   f"ringd] for mode systemd (the file was kept as it is)")
    for name, dest in plan.items():
        if dest in result.unchanged:
            continue
        make_folders(dest.parent)   # /etc/polkit-1/rules.d, ~/Library/LaunchAgents: readable by their daemon
        tmp = dest.with_name(f".{dest.name}.tmp")
        fd = create_new(tmp, 0o644)
        try:
            os.write(fd, t.files[name].encode())
        finally:
            os.close(fd)
        os.link(tmp, dest)   # fails if dest appeared meanwhile: still never overwrites
        os.unlink(tmp)
        result.written.append(dest)
    result.enable = enable_commands(t, root)
    return result


def kept_config_warnings(path: Path, state_dir: Path) -> List[str]:
    """A config install kept (never overwritten) whose ``ring.state_dir`` is not the
    service's: commands run without --state would look for another state dir."""
    from ringd.inputs.config import essentials
    try:
        set_to = essentials(path).state_dir
    except ConfigError as e:
        return [f"{path}: kept as it is, but it does not load ({e})"]
    if set_to is not None and Path(os.path.normpath(os.path.join(os.path.dirname(str(path)), set_to))) == state_dir:
        return []
    return [f"{path}: kept as it is; set ring.state_dir: {state_dir} in it, so that every command finds the "
            f"state dir without --state"]


def run_enable(steps: List[List[str]]) -> int:
    """Run the enable commands in order, stopping at the first failure."""
    for step in steps:
        try:
            rc = subprocess.run(step, check=False).returncode
        except OSError as e:
            raise OperatorError(f"{step[0]}: cannot run: {e.strerror}", EX_FAILURE) from None
        if rc != 0:
            return rc
    return 0
