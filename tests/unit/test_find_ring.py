"""The one search order (SPEC "Finding the ring: commands need no flags"), as a
pure function of options, environment, current directory and what exists."""
from __future__ import annotations

import pytest

from ringd.core.errors import ConfigError
from ringd.inputs.config import BUILT_IN, SYSTEM_CONFIG, config_candidates, find_ring

CWD = "/work/here"
HOME = "/home/op"
LOCAL, USER = f"{CWD}/config/ring.yaml", f"{HOME}/.config/ring/ring.yaml"


def find(config=None, state=None, *, env=None, files=(), state_dirs=None, driver=None):
    env = {"HOME": HOME} if env is None else env
    present = set(files)
    return find_ring(config, state, env=env, cwd=CWD, exists=present.__contains__,
                     state_dir_of=(state_dirs or {}).get,
                     driver_config_of=(lambda s: driver.get(s, (False, None))) if driver is not None else None)


def test_the_config_search_takes_the_first_file_that_exists():
    every = (LOCAL, USER, SYSTEM_CONFIG)
    assert find(files=every).config_path == LOCAL
    assert find(files=every[1:]).config_path == USER
    assert find(files=every[2:]).config_path == SYSTEM_CONFIG
    f = find(files=())
    assert f.config_path is None and f.config_from == BUILT_IN and f.searched == every


def test_options_and_variables_come_before_the_search():
    every = (LOCAL, USER, SYSTEM_CONFIG)
    env = {"HOME": HOME, "RING_CONFIG": "/srv/r.yaml", "RING_STATE": "/srv/state"}
    f = find(env=env, files=every)
    assert (f.config_path, f.config_from, f.state_dir, f.state_from) == \
        ("/srv/r.yaml", "$RING_CONFIG", "/srv/state", "$RING_STATE")
    f = find("rel/c.yaml", "../s", env=env, files=every)
    assert (f.config_path, f.config_from, f.state_dir, f.state_from) == \
        (f"{CWD}/rel/c.yaml", "--config", "/work/s", "--state")


def test_xdg_config_home_is_used_only_when_absolute():
    assert config_candidates({"HOME": HOME, "XDG_CONFIG_HOME": "/x"}, CWD)[1] == "/x/ring/ring.yaml"
    assert config_candidates({"HOME": HOME, "XDG_CONFIG_HOME": "rel"}, CWD)[1] == USER
    assert config_candidates({}, CWD) == (LOCAL, SYSTEM_CONFIG)   # no home: that place is not looked at


def test_the_state_dir_comes_from_the_config_relative_to_its_folder():
    f = find(files=(SYSTEM_CONFIG,), state_dirs={SYSTEM_CONFIG: "/var/lib/ring"})
    assert (f.state_dir, f.state_from) == ("/var/lib/ring", "ring.state_dir")
    f = find(files=(USER,), state_dirs={USER: "../../ring-state"})
    assert f.state_dir == f"{HOME}/ring-state"
    f = find(files=(USER,), state_dirs={})
    assert (f.state_dir, f.state_from) == (f"{CWD}/STATE", "./STATE")
    # --state wins over ring.state_dir
    assert find(state="/s", files=(USER,), state_dirs={USER: "/elsewhere"}).state_dir == "/s"


def test_given_only_a_state_dir_the_drivers_config_is_used():
    drv = {"/s": (True, "/opt/ring/ring.yaml")}
    f = find(state="/s", files=(LOCAL,), driver=drv)
    assert (f.config_path, f.config_from) == ("/opt/ring/ring.yaml", "its driver's heartbeat")
    # its driver runs on the built-in defaults: so does the command, whatever the search would find
    f = find(state="/s", files=(LOCAL,), driver={"/s": (True, None)})
    assert f.config_path is None and f.config_from == "its driver's heartbeat"
    # no heartbeat says: the search; --config still wins; a daemon never follows (driver None)
    assert find(state="/s", files=(LOCAL,), driver={}).config_path == LOCAL
    assert find("/c.yaml", "/s", files=(LOCAL,), driver=drv).config_path == "/c.yaml"
    assert find(state="/s", files=(LOCAL,)).config_path == LOCAL


@pytest.mark.parametrize("config, state", [("", None), (None, "")])
def test_an_empty_option_is_refused_never_the_default(config, state):
    with pytest.raises(ConfigError, match="an empty path"):
        find(config, state)
