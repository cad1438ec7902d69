"""The effect seam: the loops call nothing on their env that its Protocol does
not name (DriverEnv for the driver, the hop and the leader; WatcherEnv for the
watcher), the real envs and the tests' fakes have all of it with the same
parameters, and the watcher and the leader make no OS call of their own."""
import ast
import inspect
from pathlib import Path

import pytest

from fakeenv import FakeEnv
from fakewatchenv import FakeWatcherEnv
from ringd.host.env import RealEnv
from ringd.host.seam import DriverEnv, WatcherEnv
from ringd.host.watchenv import RealWatcherEnv

LOOPS = Path(__file__).resolve().parents[2] / "ringd" / "loops"
# what only run_driver, which builds the RealEnv, may touch (it is the seam's maker, not a user)
MAKER_ONLY = {"wakeups", "containment"}
# modules whose calls are effects (a clock, a process, a file, a socket)
EFFECTS = {"os", "time", "select", "selectors", "subprocess", "socket", "fcntl", "psutil", "shutil", "sqlite3"}
# what the watcher may import from the host layer: its env's types and maker, and constants and
# pure functions (ringwatch.json's encoding of the restart window)
WATCHER_FROM_HOST = {
    "ringd.host.seam": {"WatcherEnv"},
    "ringd.host.watchenv": {"RealWatcherEnv"},
    "ringd.host.alerts": {"longest"},
    "ringd.host.cgroup": {"KILL_WAIT"},
    "ringd.host.driverproc": {"DRIVER_LOG", "KILL_WAIT"},
    "ringd.host.watchstate": {"GAVE_UP_FILE", "LOCK_FILE", "WRITE_LOCK_WAIT", "encode_restarts", "reset_fields",
                              "restart_times", "state_path"},
}


def members(protocol):
    return sorted(n for n in dir(protocol) if not n.startswith("_"))


def data_members(protocol):
    out = {}
    for klass in reversed(protocol.__mro__):
        out.update(getattr(klass, "__annotations__", {}))
    return sorted(out)


def _called_on_env(path: Path):
    """Attributes read off ``env`` or ``self.env`` in a module."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute):
            base = node.value
            if (isinstance(base, ast.Name) and base.id == "env") or \
               (isinstance(base, ast.Attribute) and base.attr == "env" and isinstance(base.value, ast.Name)):
                yield node.attr, node.lineno


@pytest.mark.parametrize("module, protocol", [("driver.py", DriverEnv), ("hop.py", DriverEnv),
                                              ("leader.py", DriverEnv), ("watcher.py", WatcherEnv)])
def test_the_loops_use_only_the_seam(module, protocol):
    named = set(members(protocol)) | set(data_members(protocol)) | (MAKER_ONLY if protocol is DriverEnv else set())
    stray = [(a, line) for a, line in _called_on_env(LOOPS / module) if a not in named]
    assert not stray, f"{module} calls its env outside {protocol.__name__}: {stray}"


@pytest.mark.parametrize("protocol, impl", [(DriverEnv, RealEnv), (DriverEnv, FakeEnv),
                                            (WatcherEnv, RealWatcherEnv), (WatcherEnv, FakeWatcherEnv)])
def test_each_env_has_its_whole_seam(protocol, impl):
    for name in members(protocol):
        assert hasattr(impl, name), f"{impl.__name__} lacks {name}"
        want = [p for p in inspect.signature(getattr(protocol, name)).parameters if p != "self"]
        try:
            got = [p for p in inspect.signature(getattr(impl, name)).parameters if p != "self"]
        except ValueError:   # a C builtin used as is (time.monotonic): it takes no argument
            got = []
        assert got[:len(want)] == want or "fields" in want, f"{impl.__name__}.{name}{got} is not {want}"


@pytest.mark.parametrize("protocol, env", [(DriverEnv, FakeEnv), (WatcherEnv, FakeWatcherEnv)])
def test_a_fake_env_has_the_data_members(protocol, env):
    fake = env()
    for name in data_members(protocol):
        assert hasattr(fake, name), name


def test_a_real_watcher_env_has_the_data_members_and_no_effect_until_used(tmp_path):
    env = RealWatcherEnv(tmp_path / "not-made-yet", None)
    for name in data_members(WatcherEnv):
        assert hasattr(env, name), name
    assert not (tmp_path / "not-made-yet").exists() and env.signals() == set()


def _imports(tree):
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, None
        elif isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                yield node.module, alias.name


@pytest.mark.parametrize("module", ["watcher.py", "leader.py"])
def test_the_watcher_and_the_leader_reach_the_os_only_through_their_env(module):
    tree = ast.parse((LOOPS / module).read_text())
    effects = [mod for mod, _ in _imports(tree) if mod.split(".")[0] in EFFECTS]
    assert not effects, f"{module} imports {effects}"
    # signal: its numbers only, never a call (pidfd_send_signal, signal.signal, ...)
    calls = [n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
             and n.value.id == "signal" and not (n.attr.startswith("SIG") or n.attr == "Signals")]
    assert not calls, f"{module} calls signal.{calls}"
    allowed = WATCHER_FROM_HOST if module == "watcher.py" else {"ringd.host.seam": {"DriverEnv"}}
    host = [(mod, name) for mod, name in _imports(tree) if mod.startswith("ringd.host")
            and name not in allowed.get(mod, ())]
    assert not host, f"{module} takes effects from the host layer past its env: {host}"
