"""The effect seam: the loops call nothing on their env that DriverEnv does not
name, and RealEnv and the tests' FakeEnv both have all of it, with the same
parameters."""
import ast
import inspect
from pathlib import Path

import pytest

from fakeenv import FakeEnv
from ringd.host.env import RealEnv
from ringd.host.seam import DriverEnv

LOOPS = Path(__file__).resolve().parents[2] / "ringd" / "loops"
MEMBERS = sorted(n for n in dir(DriverEnv) if not n.startswith("_")) + sorted(DriverEnv.__annotations__)
# what only run_driver, which builds the RealEnv, may touch (it is the seam's maker, not a user)
MAKER_ONLY = {"wakeups", "containment"}


def _called_on_env(path: Path):
    """Attributes read off ``env`` or ``self.env`` in a module."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute):
            base = node.value
            if (isinstance(base, ast.Name) and base.id == "env") or \
               (isinstance(base, ast.Attribute) and base.attr == "env" and isinstance(base.value, ast.Name)):
                yield node.attr, node.lineno


@pytest.mark.parametrize("module", ["driver.py", "hop.py", "leader.py"])
def test_the_loops_use_only_the_seam(module):
    named = set(MEMBERS) | MAKER_ONLY
    stray = [(a, line) for a, line in _called_on_env(LOOPS / module) if a not in named]
    assert not stray, f"{module} calls its env outside DriverEnv: {stray}"


@pytest.mark.parametrize("impl", [RealEnv, FakeEnv])
def test_both_envs_have_the_whole_seam(impl):
    for name in sorted(n for n in dir(DriverEnv) if not n.startswith("_")):
        assert hasattr(impl, name), f"{impl.__name__} lacks {name}"
        want = [p for p in inspect.signature(getattr(DriverEnv, name)).parameters if p != "self"]
        try:
            got = [p for p in inspect.signature(getattr(impl, name)).parameters if p != "self"]
        except ValueError:   # a C builtin used as is (time.monotonic): it takes no argument
            got = []
        assert got[:len(want)] == want or "fields" in want, f"{impl.__name__}.{name}{got} is not {want}"


def test_a_fake_env_has_the_data_members():
    env = FakeEnv()
    for name in DriverEnv.__annotations__:
        assert hasattr(env, name), name
