"""Finding the ring (SPEC "Finding the ring: commands need no flags"), with real
files at real paths: ./config/ring.yaml, $XDG_CONFIG_HOME/ring/ring.yaml and
/etc/ring/ring.yaml. /etc is a private overlay in a mount namespace of the test's
own (``unshare -m``), so the machine's /etc is never touched; every command
runs in it through ``nsenter``.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, kill_tree, read_until, ring_cmd, wait_until


class Namespace:
    """A mount namespace whose /etc is an overlay on a tmpfs (writes stay in it),
    kept alive by one ``sleep`` until the test ends."""

    def __init__(self, holder: subprocess.Popen):
        self.holder = holder

    def run(self, argv, *, cwd, env, timeout=60, **kw):
        # (entering a mount namespace moves to its root: --wd puts the command where it was asked)
        return subprocess.run(["nsenter", "-t", str(self.holder.pid), "-m", f"--wd={cwd}", "--", *argv],
                              env=env, capture_output=True, text=True, timeout=timeout, **kw)

    def write(self, path: str, text: str, mode: int = 0o644) -> None:
        script = "import os, sys; os.makedirs(os.path.dirname(sys.argv[1]), exist_ok=True); " \
                 "open(sys.argv[1], 'w').write(sys.argv[2]); os.chmod(sys.argv[1], int(sys.argv[3], 8))"
        r = self.run([sys.executable, "-c", script, path, text, oct(mode)[2:]], cwd="/", env=os.environ)
        assert r.returncode == 0, r.stderr

    def remove(self, path: str) -> None:
        assert self.run(["rm", "-f", path], cwd="/", env=os.environ).returncode == 0


@pytest.fixture
def ns(tmp_path):
    if os.geteuid() != 0 or not (shutil.which("unshare") and shutil.which("nsenter")):
        pytest.skip("needs root, unshare and nsenter for a private /etc")
    before = os.path.lexists("/etc/ring")
    lower = tmp_path / "etc-overlay"
    lower.mkdir()
    script = (f"set -e; mount -t tmpfs tmpfs {lower}; mkdir {lower}/u {lower}/w; "
              f"mount -t overlay overlay -o lowerdir=/etc,upperdir={lower}/u,workdir={lower}/w /etc; "
              "mkdir -p /etc/ring; echo ready; exec sleep 600")
    holder = subprocess.Popen(["unshare", "-m", "--propagation", "private", "sh", "-c", script],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        try:
            read_until(holder.stdout, lambda b: b"ready" in b, timeout=20, message="the private /etc")
        except AssertionError:
            holder.kill()
            pytest.skip(f"cannot make a private /etc here: {holder.stderr.read().decode()[-300:]}")
        yield Namespace(holder)
    finally:
        kill_tree(holder.pid)
        holder.wait(timeout=10)
        holder.stdout.close()
        holder.stderr.close()
    assert os.path.lexists("/etc/ring") == before, "the machine's /etc was touched"


def env_for(tmp_path: Path, **extra) -> dict:
    """A user with an empty home (no ~/.config/ring) and no RING_* variables."""
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RING_", "XDG_"))}
    env.update(HOME=str(home), PYTHONPATH=str(REPO), **extra)
    env.pop("NOTIFY_SOCKET", None)
    return env


def status(ns, cwd, env, *args):
    r = ns.run(ring_cmd("status", "--json", *args), cwd=cwd, env=env)
    assert r.stdout.strip(), r.stderr
    return json.loads(r.stdout), r


def test_the_search_order_with_real_files_at_real_paths(ns, tmp_path):
    """./config/ring.yaml > $XDG_CONFIG_HOME/ring/ring.yaml > /etc/ring/ring.yaml,
    each found where it really is; each config's ring.state_dir names its ring."""
    here = tmp_path / "here"
    (here / "config").mkdir(parents=True)
    env = env_for(tmp_path, XDG_CONFIG_HOME=str(tmp_path / "xdg"))
    places = {"local": str(here / "config/ring.yaml"), "user": str(tmp_path / "xdg/ring/ring.yaml"),
              "system": "/etc/ring/ring.yaml"}
    for name, path in places.items():
        (tmp_path / f"state-{name}").mkdir(mode=0o700)
        ns.write(path, f"ring:\n  state_dir: {tmp_path / f'state-{name}'}\n", 0o600)
    assert not os.path.exists("/etc/ring/ring.yaml"), "written into the machine's /etc"
    for name in ("local", "user", "system"):
        doc, r = status(ns, here, env)
        assert r.returncode == 3, r.stderr
        assert doc["config"]["path"] == places[name] and doc["config"]["from"] == "search", doc["config"]
        assert doc["state_dir"] == str(tmp_path / f"state-{name}") and doc["state_from"] == "ring.state_dir"
        text = ns.run(ring_cmd("status"), cwd=here, env=env).stdout.splitlines()
        assert text[0].split() == ["state", doc["state_dir"], "(ring.state_dir", "of", f"{places[name]})"], text
        assert text[1].split()[:3] == ["config", places[name], "(found)"], text
        ns.remove(places[name])
    # none left: the built-in defaults and ./STATE, and check and run say so
    (here / "STATE").mkdir(mode=0o700)
    doc, _ = status(ns, here, env)
    assert doc["config"]["path"] is None and doc["state_dir"] == str(here / "STATE")
    assert doc["config"]["searched"] == list(places.values())
    (here / "STATE/ring.txt").write_text("a /bin/true\n")
    os.chmod(here / "STATE/ring.txt", 0o600)
    r = ns.run(ring_cmd("check"), cwd=here, env=env)
    assert r.returncode == 0 and "built-in defaults: no file at " + ", ".join(places.values()) in r.stdout, r.stdout
    r = ns.run(ring_cmd("run", "--once"), cwd=here, env=env)
    assert r.returncode == 0 and "config built-in defaults (none at " in r.stderr, r.stderr
    # RING_CONFIG comes before all of them
    ns.write(places["system"], f"ring:\n  state_dir: {tmp_path / 'state-system'}\n", 0o600)
    other = tmp_path / "other.yaml"
    other.write_text(f"ring:\n  state_dir: {tmp_path / 'state-user'}\n")
    os.chmod(other, 0o600)
    doc, _ = status(ns, here, {**env, "RING_CONFIG": str(other)})
    assert doc["config"]["path"] == str(other) and doc["state_dir"] == str(tmp_path / "state-user")


def test_after_service_install_every_command_needs_no_flags(ns, tmp_path):
    """``ringd service install`` writes /etc/ring/ring.yaml with ring.state_dir
    set: from any directory, with no flag, each command finds the ring."""
    state = tmp_path / "srv-state"
    bindir = tmp_path / "bin"
    bindir.mkdir()
    for prog in ("ringd", "ringwatch"):
        (bindir / prog).write_text(f"#!/bin/sh\nexec {sys.executable} -m {prog} \"$@\"\n")
        (bindir / prog).chmod(0o755)
    env = env_for(tmp_path)
    anywhere = tmp_path / "anywhere"
    anywhere.mkdir()
    r = ns.run(ring_cmd("service", "install", "--mode", "watcher", "--user", "root", "--state", str(state),
                        "--bin-dir", str(bindir)), cwd=anywhere, env=env)
    assert r.returncode == 0, r.stderr
    assert "wrote /etc/systemd/system/ringwatch.service" in r.stdout
    assert not os.path.exists("/etc/systemd/system/ringwatch.service"), "written into the machine's /etc"
    r = ns.run(ring_cmd("run", "--once"), cwd=anywhere, env=env)
    assert r.returncode == 0, r.stderr
    doc, r = status(ns, "/", env)
    assert doc["state_dir"] == str(state) and doc["config"]["path"] == "/etc/ring/ring.yaml", doc
    hist = ns.run(ring_cmd("history", "--json"), cwd=str(tmp_path), env=env)
    assert hist.returncode == 0 and {h["agent"] for h in json.loads(hist.stdout)} == {"hello", "clock"}
    logs = ns.run(ring_cmd("logs", "hello"), cwd="/", env=env)
    assert logs.returncode == 0 and "hello from hello" in logs.stdout, logs.stderr


def test_given_only_a_state_dir_a_command_uses_its_drivers_config(ring, tmp_path):
    """The heartbeat names the config its driver runs with: ``--state`` alone (from
    a folder with no config) reads that one, never the built-in defaults."""
    ring.write_config(ring={"run_budget": 5, "stall_threshold": 6})
    ring.agent("a", "sleep 30")
    ring.roster(f"a {ring.agents_dir}/a.sh")
    ring.start_driver()
    wait_until(lambda: (ring.heartbeat() or {}).get("agent") == "a", 20, message="a running")
    assert ring.heartbeat()["config"] == str(ring.config_path)
    empty = tmp_path / "empty"
    empty.mkdir()
    env = env_for(tmp_path)
    r = subprocess.run(ring_cmd("status", "--json", "--state", str(ring.state)), cwd=empty, env=env,
                       capture_output=True, text=True, timeout=30)
    doc = json.loads(r.stdout)
    assert r.returncode == 0 and doc["config"]["path"] == str(ring.config_path), r.stderr
    assert doc["config"]["from"] == "its driver's heartbeat" and doc["current"]["run_budget"] == 5
