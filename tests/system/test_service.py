"""``ringd init`` and ``ringd service print|install``: files rendered for this
installation, written under --root without touching the box, never overwriting;
the shipped files are what ``print`` renders; systemd-analyze verifies them and
rates them 6.0 or better; a real driver runs on what install laid out; and the
README's route (a fresh venv, pip install, init, service print) names the venv's
own binaries.
"""
from __future__ import annotations

import json
import os
import plistlib
import pwd
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, ring_cmd
from ringd.cli.service import LABEL, POLKIT_RULE, target

SHIPPED_BIN = Path("/opt/ring/bin")   # the README's venv
MAX_EXPOSURE = 6.0
HAVE_ANALYZE = shutil.which("systemd-analyze") is not None


def cli(*args, env=None, cwd=None):
    env = dict(env or os.environ, PYTHONPATH=str(REPO))
    return subprocess.run(ring_cmd(*args), capture_output=True, text=True, timeout=60, env=env, cwd=cwd)


_OUTSIDE_TMP: list = []   # folders made outside /tmp by the running test (removed after it)


def outside_private_tmp(name: str) -> Path:
    """A new folder PrivateTmp=yes would not hide from a unit (``tmp_path`` is
    under /tmp, and service print warns of programs there): under /run or the
    runtime dir when writable, else the home's cache; removed after the test."""
    import tempfile
    for base in (os.environ.get("XDG_RUNTIME_DIR"), "/run", str(Path.home() / ".cache")):
        if base and os.path.isdir(base) and os.access(base, os.W_OK):
            break
    made = Path(tempfile.mkdtemp(prefix="ring-test-", dir=base))
    _OUTSIDE_TMP.append(made)
    (made / name).mkdir()
    return made / name


@pytest.fixture(autouse=True)
def _remove_outside_tmp():
    yield
    while _OUTSIDE_TMP:
        shutil.rmtree(_OUTSIDE_TMP.pop(), ignore_errors=True)


def stub_bin(tmp_path: Path) -> Path:
    """Stand-in ringd/ringwatch (verify checks that ExecStart's program exists),
    in a folder outside /tmp."""
    bindir = outside_private_tmp("bin")
    for prog in ("ringd", "ringwatch"):
        stub = bindir / prog
        stub.write_text(f"#!/bin/sh\nexec {sys.executable} -m {prog} \"$@\"\n")
        stub.chmod(0o755)
    return bindir


def exposure(unit: Path) -> float:
    res = subprocess.run(["systemd-analyze", "security", "--offline=yes", str(unit)],
                         capture_output=True, text=True, timeout=60)
    m = re.search(r"Overall exposure level for \S+: ([0-9.]+)", res.stdout + res.stderr)
    assert m, res.stdout + res.stderr
    return float(m.group(1))


# --- shipped files ------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["watcher", "systemd", "launchd"])
def test_shipped_files_are_what_print_renders(mode):
    t = target(mode, bin_dir=SHIPPED_BIN)
    for name, text in t.files.items():
        folder = REPO / ("launchd" if mode == "launchd" else "systemd")
        assert (folder / name).read_text() == text, f"{folder / name} differs from `ringd service print`"
    res = cli("service", "print", "--mode", mode, "--bin-dir", str(SHIPPED_BIN))
    assert res.returncode == 0, res.stderr
    if len(t.files) == 1:
        assert res.stdout == next(iter(t.files.values()))
    else:
        for name, text in t.files.items():
            assert "# ==> " in res.stdout and f"/{name} <==\n{text}" in res.stdout
    assert "docs/" not in "".join(t.files.values())


# --- install under --root -------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["watcher", "systemd"])
def test_install_systemd_modes_under_root(tmp_path, mode):
    root = tmp_path / "root"
    bindir = stub_bin(tmp_path)
    res = cli("service", "install", "--mode", mode, "--root", str(root), "--bin-dir", str(bindir))
    assert res.returncode == 0, res.stderr
    units = {"watcher": ["ringwatch.service"], "systemd": ["ringd.service", "ringwatch-systemd.service"]}[mode]
    unitdir = root / "etc/systemd/system"
    state, config = root / "var/lib/ring", root / "etc/ring/ring.yaml"
    for name in units:
        path = unitdir / name
        assert f"wrote {path}" in res.stdout
        assert stat.S_IMODE(path.stat().st_mode) == 0o644
        text = path.read_text()
        assert f"{bindir}/ring" in text and "--state /var/lib/ring --config /etc/ring/ring.yaml" in text
        for line in ("ProtectSystem=strict", "StateDirectory=ring", "PrivateTmp=yes", "NoNewPrivileges=yes",
                     "ProtectKernelTunables=yes", "ProtectKernelModules=yes", "ProtectKernelLogs=yes",
                     "RestrictSUIDSGID=yes", "LockPersonality=yes", "Delegate=yes", "DynamicUser=yes"):
            assert f"\n{line}\n" in text, (name, line)
        assert "#   ReadWritePaths=/the/dir/they/write" in text
    assert stat.S_IMODE(state.stat().st_mode) == 0o700
    assert stat.S_IMODE(config.stat().st_mode) == 0o644
    assert stat.S_IMODE((state / "ring.txt").stat().st_mode) == 0o600
    assert '  state_dir: "/var/lib/ring" ' in config.read_text()   # every command finds the ring from it
    if mode == "systemd":
        assert "restart_command: [systemctl, restart, ringd]" in config.read_text()
        assert (root / "etc/polkit-1/rules.d" / POLKIT_RULE).is_file()
    assert f"enable it with: systemctl --root={root} enable {' '.join(units)}" in res.stdout

    # what install laid out is a valid ring, and a real driver runs it
    assert cli("--state", str(state), "--config", str(config), "check", "--strict").returncode == 0
    done = cli("run", "--once", "--state", str(state), "--config", str(config))
    assert done.returncode == 0, done.stderr
    runs = cli("history", "--json", "--state", str(state), "--config", str(config))
    assert '"status": "ok"' in runs.stdout, runs.stdout

    # again: nothing changes, nothing is overwritten
    again = cli("service", "install", "--mode", mode, "--root", str(root), "--bin-dir", str(bindir))
    assert again.returncode == 0 and "wrote" not in again.stdout and "unchanged" in again.stdout
    edited = unitdir / units[0]
    edited.write_text(edited.read_text() + "# local edit\n")
    clash = cli("service", "install", "--mode", mode, "--root", str(root), "--bin-dir", str(bindir))
    assert clash.returncode == 1 and str(edited) in clash.stderr and "never overwrites" in clash.stderr
    assert len(clash.stderr.splitlines()) == 1 and edited.read_text().endswith("# local edit\n")

    if HAVE_ANALYZE:
        edited.write_text(edited.read_text().replace("# local edit\n", ""))
        paths = [str(unitdir / n) for n in units]
        res = subprocess.run(["systemd-analyze", "verify", "--man=no", *paths],
                             capture_output=True, text=True, timeout=60)
        assert res.returncode == 0 and not any(n in res.stdout + res.stderr for n in units), res.stdout + res.stderr
        for n in units:
            assert exposure(unitdir / n) <= MAX_EXPOSURE, n
    if shutil.which("systemctl"):
        enabled = cli("service", "install", "--mode", mode, "--root", str(root), "--bin-dir", str(bindir),
                      "--enable")
        assert enabled.returncode == 0, enabled.stderr
        for n in units:
            assert (unitdir / "multi-user.target.wants" / n).is_symlink()


@pytest.mark.skipif(not HAVE_ANALYZE, reason="systemd-analyze not installed")
def test_hardening_rating_before_and_after(tmp_path):
    """The units before hardening rated 9.0 UNSAFE; each rendered unit now rates <= 6.0,
    with a named user and a state dir outside /var/lib as well."""
    bare = tmp_path / "bare.service"
    bare.write_text("[Service]\nType=notify\nExecStart=/bin/true\n")
    assert exposure(bare) >= 9.0
    me = pwd.getpwuid(os.getuid()).pw_name
    for kw in ({}, {"user": me, "state": tmp_path / "state"}):
        for mode in ("watcher", "systemd"):
            t = target(mode, bin_dir=stub_bin(tmp_path), **kw)
            for name, text in t.files.items():
                if name.endswith(".service"):
                    path = tmp_path / name
                    path.write_text(text)
                    assert exposure(path) <= MAX_EXPOSURE, (kw, name)
                    if "state" in kw:
                        assert f"ReadWritePaths={tmp_path / 'state'}" in text
                        assert f"User={me}" in text and "DynamicUser" not in text


def test_install_launchd_under_root(tmp_path):
    root = tmp_path / "root"
    me = pwd.getpwuid(os.getuid()).pw_name
    res = cli("service", "install", "--mode", "launchd", "--root", str(root), "--user", me)
    assert res.returncode == 0, res.stderr
    plist_path = root / "Library/LaunchDaemons" / f"{LABEL}.plist"
    with open(plist_path, "rb") as f:
        p = plistlib.load(f)
    assert p["Label"] == LABEL and p["UserName"] == me
    assert p["ProgramArguments"][0] == str(Path(sys.executable).parent / "ringwatch") or \
        p["ProgramArguments"][0].endswith("/ringwatch")
    # a LaunchDaemon is a system service: its config where every command looks last
    assert (root / "usr/local/var/ring/ring.txt").is_file() and (root / "etc/ring/ring.yaml").is_file()
    assert p["ProgramArguments"][-2:] == ["--config", "/etc/ring/ring.yaml"]
    assert '  state_dir: "/usr/local/var/ring" ' in (root / "etc/ring/ring.yaml").read_text()
    assert f"launchctl bootstrap system {plist_path}" in res.stdout


def test_install_launchd_agent_writes_the_users_xdg_config(tmp_path):
    """A LaunchAgent is a per-user service: its config goes where that user's
    commands find it ($XDG_CONFIG_HOME/ring/ring.yaml), and the plist names no
    home directory (ringwatch finds the config by the same search)."""
    root, home = tmp_path / "root", tmp_path / "home"
    home.mkdir()
    env = {**os.environ, "HOME": str(home), "XDG_CONFIG_HOME": str(home / "xdg")}
    res = cli("service", "install", "--mode", "launchd", "--root", str(root), env=env)
    assert res.returncode == 0, res.stderr
    config = Path(str(root) + str(home / "xdg/ring/ring.yaml"))
    assert config.is_file() and '  state_dir: "/usr/local/var/ring" ' in config.read_text()
    with open(Path(str(root) + str(home)) / "Library/LaunchAgents" / f"{LABEL}.plist", "rb") as f:
        p = plistlib.load(f)
    assert "--config" not in p["ProgramArguments"] and str(home) not in json.dumps(p)


def test_bad_service_choices_are_one_line(tmp_path):
    for args in (("--user", "no-such-user-here"), ("--state", "/srv/ring"), ("--mode", "upstart"),
                 ("--state", "/var/lib/my ring")):
        res = cli("service", "print", *args)
        assert res.returncode == 2, (args, res.stdout)
        assert len(res.stderr.splitlines()) == 1 and "Traceback" not in res.stderr, res.stderr


def test_paths_a_unit_or_plist_cannot_carry_are_refused_the_programs_too(tmp_path):
    """ExecStart= splits at spaces and expands '%' and '$': --state and --config
    were checked, but a --bin-dir (or this installation's own bin dir) like
    "/opt/my bin" rendered ``ExecStart=/opt/my bin/ringwatch`` (systemd runs
    /opt/my), and a non-UTF-8 path went raw into the unit or crashed the plist."""
    bad = ["/opt/my bin", "/opt/a%b", "/opt/$HOME", "/opt/x\udcff", "/opt/tab\there"]
    long_name = "a" * 256   # over NAME_MAX: no system call takes it, and systemd refuses the unit
    cases = [("--bin-dir", b) for b in bad + [f"/opt/{long_name}"]] + [
        ("--state", "/srv/x\udcff"), ("--config", "/etc/x\udcff"),
        ("--state", f"/srv/{long_name}"), ("--config", f"/etc/{long_name}.yaml")]
    for mode in ("watcher", "launchd"):
        for option, value in cases:
            args = ("service", "print", "--mode", mode, "--user", pwd.getpwuid(os.getuid()).pw_name,
                    "--state", "/srv/ring", option, value)
            res = cli(*args)
            lines = res.stderr.splitlines()
            assert res.returncode == 2 and res.stdout == "", (mode, option, value, res.returncode, res.stdout[:300])
            assert len(lines) == 1 and option in lines[0] and "Traceback" not in res.stderr, res.stderr


@pytest.mark.parametrize("name", ["a%b", "DOM\\joe", 'x"y'])
def test_a_user_name_systemd_or_polkit_would_read_otherwise_is_escaped(tmp_path, name):
    """--user is an account that exists (winbind names them 'DOM\\joe'), rendered
    raw: ``User=a%b`` ran the ring as 'a' + the boot id (%b is a specifier), and
    the polkit rule compared ``subject.user == "DOM\\joe"`` - JavaScript reads
    'DOMjoe', so the watcher could never restart ringd ('x"y' was a syntax error)."""
    from ringd.cli.service import Target, render
    t = Target(mode="systemd", bin_dir=stub_bin(tmp_path), state_dir=Path("/srv/ring"),
               config_path=Path("/etc/ring/ring.yaml"), user=name)
    files = render(t)
    for unit in ("ringd.service", "ringwatch-systemd.service"):
        value = re.search(r"^User=(.*)$", files[unit], re.M).group(1)
        assert re.fullmatch(r"(?:[^%]|%%)*", value) and value.replace("%%", "%") == name, value
    literal = re.search(r"subject\.user == (.*) &&$", files[POLKIT_RULE], re.M).group(1)
    assert json.loads(literal) == name, literal   # a JSON string is a JavaScript string
    if HAVE_ANALYZE:   # systemd names the user it will run as
        (tmp_path / "ringd.service").write_text(files["ringd.service"])
        res = subprocess.run(["systemd-analyze", "verify", str(tmp_path / "ringd.service")],
                             capture_output=True, text=True, timeout=60)
        said = re.findall(r"Accepting user/group name '(.*)'", res.stderr)
        assert said in ([], [name]), res.stderr


@pytest.mark.parametrize("umask", [0o027, 0o077])
def test_folders_install_makes_on_the_way_are_readable_whatever_the_umask(tmp_path, umask):
    """Folders install made on the way took root's umask (027 on a hardened box,
    sudo keeps it): a new /etc/ring was 0750 root, so the service's own user
    could not read its config (ringd exits 78 at every start), nor reach a state
    dir under a new /srv/ring; a new /etc/polkit-1/rules.d hid the rule from
    polkitd. Each folder made is 0755; the state dir stays 0700."""
    root = tmp_path / "root"
    root.mkdir()
    me = pwd.getpwuid(os.getuid()).pw_name
    res = subprocess.run(ring_cmd("service", "install", "--mode", "systemd", "--user", me, "--root", str(root),
                                  "--bin-dir", str(stub_bin(tmp_path)), "--state", "/srv/ring/state",
                                  "--config", "/srv/ring/conf/ring.yaml"),
                         capture_output=True, text=True, timeout=60, env=dict(os.environ, PYTHONPATH=str(REPO)),
                         preexec_fn=lambda: os.umask(umask))
    assert res.returncode == 0, res.stderr
    made = [p for p in root.rglob("*") if p.is_dir()]
    assert root / "srv/ring/conf" in made and root / "etc/polkit-1/rules.d" in made
    for folder in made:
        want = 0o700 if folder == root / "srv/ring/state" else 0o755
        assert stat.S_IMODE(folder.stat().st_mode) == want, (folder, oct(folder.stat().st_mode))
    assert stat.S_IMODE((root / "srv/ring/conf/ring.yaml").stat().st_mode) == 0o644

    ring = tmp_path / "ring"
    done = subprocess.run(ring_cmd("init", str(ring)), capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, PYTHONPATH=str(REPO)), preexec_fn=lambda: os.umask(umask))
    assert done.returncode == 0, done.stderr
    assert stat.S_IMODE((ring / "config").stat().st_mode) == 0o755   # beside its 0644 ring.yaml


# --- init ------------------------------------------------------------------------------------

def test_init_lays_out_a_ring_that_runs_and_never_overwrites(tmp_path):
    d = tmp_path / "ring"
    res = cli("init", str(d))
    assert res.returncode == 0, res.stderr
    config, state, roster = d / "config/ring.yaml", d / "STATE", d / "STATE/ring.txt"
    assert config.read_text() == (REPO / "config/ring.yaml").read_text()
    assert stat.S_IMODE(state.stat().st_mode) == 0o700
    assert stat.S_IMODE(roster.stat().st_mode) == 0o600
    assert stat.S_IMODE(config.stat().st_mode) == 0o644
    # the defaults, from the init'ed directory, with no options at all
    assert cli("check", "--strict", cwd=d).returncode == 0
    run = cli("run", "--once", cwd=d)
    assert run.returncode == 0, run.stderr
    assert "hello from hello" in cli("logs", "hello", cwd=d).stdout

    again = cli("init", str(d))
    assert again.returncode == 1 and str(config) in again.stderr and str(roster) in again.stderr
    assert len(again.stderr.splitlines()) == 1
    # init in the current directory by default
    here = tmp_path / "here"
    here.mkdir()
    assert cli("init", cwd=here).returncode == 0 and (here / "STATE/ring.txt").is_file()


def test_package_data_is_the_shipped_config():
    assert (REPO / "ringd/data/ring.yaml").read_text() == (REPO / "config/ring.yaml").read_text()


# --- the README's install route ------------------------------------------------------------------

def test_readme_route_fresh_venv(tmp_path):
    venv = tmp_path / "opt-ring"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True, timeout=120)
    src = tmp_path / "src"
    shutil.copytree(REPO, src, ignore=shutil.ignore_patterns(".git", "STATE", "*.egg-info", "build",
                                                              "__pycache__", ".pytest_cache"))
    # Offline when the build backend is at hand (setuptools + wheel), else pip's usual isolated build.
    try:
        import wheel  # noqa: F401
        isolation = ["--no-build-isolation"]
    except ImportError:
        isolation = []
    pip = subprocess.run([str(venv / "bin/pip"), "install", "--quiet", "--no-deps", *isolation,
                          "--disable-pip-version-check", str(src)], capture_output=True, text=True, timeout=300)
    assert pip.returncode == 0, pip.stdout + pip.stderr
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    bin_ = venv / "bin"
    ver = subprocess.run([str(bin_ / "ringd"), "--version"], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert ver.returncode == 0 and "0.1.0" in ver.stdout
    ring_dir = tmp_path / "myring"
    res = subprocess.run([str(bin_ / "ringd"), "init", str(ring_dir)], capture_output=True, text=True, env=env,
                         cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert (ring_dir / "config/ring.yaml").read_text() == (REPO / "config/ring.yaml").read_text()
    for mode, prog in (("watcher", "ringwatch"), ("systemd", "ringd"), ("launchd", "ringwatch")):
        out = subprocess.run([str(bin_ / "ringd"), "service", "print", "--mode", mode], capture_output=True,
                             text=True, env=env, cwd=tmp_path)
        assert out.returncode == 0, out.stderr
        assert f"{bin_}/{prog}" in out.stdout, out.stdout
        assert "/opt/ring/bin" not in out.stdout


def test_install_never_reads_or_writes_through_what_squats_a_destination(tmp_path):
    """A unit file already there that is not UTF-8 (an editor's Latin-1 comment)
    made install crash ("internal error: UnicodeDecodeError"), and a FIFO at the
    temp name install writes first (``.<unit>.tmp``) hung it forever. A clash is
    a clash whatever its bytes; a squatter at the temp name is removed."""
    root = tmp_path / "root"
    bindir = stub_bin(tmp_path)
    unitdir = root / "etc/systemd/system"
    unitdir.mkdir(parents=True)
    os.mkfifo(unitdir / ".ringwatch.service.tmp", 0o600)
    done = subprocess.Popen(ring_cmd("service", "install", "--mode", "watcher", "--root", str(root),
                                     "--bin-dir", str(bindir)),
                            env=dict(os.environ, PYTHONPATH=str(REPO)), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = done.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(done.pid, 9)
        done.communicate()
        raise AssertionError("service install hung on the FIFO at its temp name")
    assert done.returncode == 0, err
    assert (unitdir / "ringwatch.service").is_file() and not (unitdir / ".ringwatch.service.tmp").exists()
    latin1 = "# \xe9dit\xe9 \u00e0 la main\n".encode("latin-1")
    (unitdir / "ringwatch.service").write_bytes(latin1)
    clash = cli("service", "install", "--mode", "watcher", "--root", str(root), "--bin-dir", str(bindir))
    assert clash.returncode == 1 and "never overwrites" in clash.stderr, clash.stderr
    assert len(clash.stderr.splitlines()) == 1 and "internal error" not in clash.stderr
    assert (unitdir / "ringwatch.service").read_bytes() == latin1


def test_a_bin_dir_without_the_programs_is_warned_about(tmp_path):
    """A unit whose ExecStart names a program that does not exist fails
    ``systemd-analyze verify`` and never starts; print and install rendered one
    silently (a --bin-dir typo, or a ring run from a checkout, not installed).
    They warn in one line naming it (exit still 0: --bin-dir may be another box's)."""
    empty = outside_private_tmp("nobin")
    root = tmp_path / "root"
    for mode, progs in (("watcher", ["ringwatch"]), ("systemd", ["ringd", "ringwatch"]),
                        ("launchd", ["ringwatch"])):
        res = cli("service", "print", "--mode", mode, "--bin-dir", str(empty))
        assert res.returncode == 0 and res.stdout, res.stderr
        lines = res.stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith("ringd: warning: "), res.stderr
        assert all(f"{empty}/{p}" in lines[0] for p in progs), lines[0]
    res = cli("service", "install", "--mode", "watcher", "--root", str(root), "--bin-dir", str(empty))
    assert res.returncode == 0 and f"{empty}/ringwatch" in res.stderr, res.stderr
    ok = cli("service", "print", "--mode", "systemd", "--bin-dir", str(stub_bin(tmp_path)))
    assert ok.returncode == 0 and ok.stderr == "", ok.stderr


@pytest.mark.parametrize("kind", ["state-is-a-file", "state-writable-by-others", "config-is-a-file"])
def test_init_refuses_a_layout_ringd_run_would_refuse_before_creating_anything(tmp_path, kind):
    """A STATE that is a file failed half way (config/ring.yaml written, then
    'STATE: File exists'; a second init then refused over the config it had
    made); a STATE others may write was kept as it was and init said 'next:
    ringwatch', which refuses it. Either is one line, and nothing is created."""
    d = tmp_path / "ring"
    d.mkdir()
    if kind == "state-is-a-file":
        (d / "STATE").write_text("")
    elif kind == "state-writable-by-others":
        (d / "STATE").mkdir()
        os.chmod(d / "STATE", 0o777)
    else:
        (d / "config").write_text("")
    before = sorted(p.relative_to(d) for p in d.rglob("*"))
    res = cli("init", str(d))
    assert res.returncode != 0 and len(res.stderr.splitlines()) == 1 and "Traceback" not in res.stderr
    assert str(d / ("config" if kind == "config-is-a-file" else "STATE")) in res.stderr, res.stderr
    assert sorted(p.relative_to(d) for p in d.rglob("*")) == before, "init created part of the layout"


def test_a_unit_whose_programs_private_tmp_hides_is_warned_about(tmp_path):
    """A unit runs with PrivateTmp=yes: programs under /tmp or /var/tmp (a venv
    made there) are not there for it, and it fails with 203/EXEC. print
    rendered one without a word; it warns in one line (exit still 0), as it
    does of a program that is missing, and so does install."""
    stubs = stub_bin(tmp_path)
    in_tmp = tmp_path / "venv-bin"
    shutil.copytree(stubs, in_tmp)
    linked = outside_private_tmp("linked") / "bin"
    linked.symlink_to(in_tmp)   # (a path outside /tmp that leads into it)
    for bindir in (in_tmp, linked):
        for mode, progs in (("watcher", ["ringwatch"]), ("systemd", ["ringd", "ringwatch"])):
            res = cli("service", "print", "--mode", mode, "--bin-dir", str(bindir))
            lines = res.stderr.splitlines()
            assert res.returncode == 0 and res.stdout, res.stderr
            assert len(lines) == 1 and lines[0].startswith("ringd: warning: ") and "PrivateTmp" in lines[0], lines
            assert all(f"{bindir}/{p}" in lines[0] for p in progs), lines[0]
    res = cli("service", "print", "--mode", "launchd", "--bin-dir", str(in_tmp))   # (launchd has no PrivateTmp)
    assert res.returncode == 0 and res.stderr == "", res.stderr
    res = cli("service", "install", "--mode", "watcher", "--root", str(tmp_path / "root"), "--bin-dir", str(in_tmp))
    assert res.returncode == 0 and "PrivateTmp" in res.stderr, res.stderr
    ok = cli("service", "print", "--mode", "systemd", "--bin-dir", str(stubs))
    assert ok.returncode == 0 and ok.stderr == "", ok.stderr


def test_nobody_is_refused_as_the_services_user(tmp_path):
    """``service install --user nobody`` wrote units (and a polkit rule) for the
    kernel's overflow user, whose uid every unmapped id appears as: refused in
    one line, as print, for every mode; nothing is written."""
    try:
        nobody = pwd.getpwuid(65534).pw_name
    except KeyError:
        pytest.skip("no user with uid 65534 here")
    root = tmp_path / "root"
    for name in dict.fromkeys(("nobody", nobody)):
        try:
            pwd.getpwnam(name)
        except KeyError:
            continue
        for mode in ("watcher", "systemd", "launchd"):
            for verb in (("print",), ("install", "--root", str(root))):
                res = cli("service", *verb, "--mode", mode, "--user", name, "--state", "/srv/ring",
                          "--bin-dir", str(stub_bin(tmp_path)))
                lines = res.stderr.splitlines()
                assert res.returncode == 2 and res.stdout == "", (mode, verb, res.returncode, res.stdout[:300])
                assert len(lines) == 1 and f"--user {name}: {name} is not a service user" in lines[0], lines
    assert not root.exists()
