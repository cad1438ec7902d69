"""Config loading and validation: defaults, every error names its key, exit 78."""
import os
from pathlib import Path

import pytest

from ringd.inputs.config import Config, ConfigError, load_config, parse_config

REPO = Path(__file__).resolve().parents[2]


def write(tmp_path, text, mode=0o600):
    p = tmp_path / "ring.yaml"
    p.write_text(text)
    os.chmod(p, mode)
    return p


def test_shipped_config_equals_builtin_defaults(tmp_path):
    # a copy: the checkout's own file is group-writable under umask 002, which
    # load_config refuses (tested elsewhere); this test is about its content
    shipped = load_config(write(tmp_path, (REPO / "config" / "ring.yaml").read_text()))
    default = Config()
    assert shipped.ring == default.ring
    assert shipped.watch == default.watch
    assert shipped.alerts == default.alerts
    assert dict(shipped.agents) == {}


def test_empty_file_is_all_defaults(tmp_path):
    assert load_config(write(tmp_path, "")).ring == Config().ring


def test_per_agent_overrides(tmp_path):
    c = load_config(write(tmp_path, "agents:\n  web: {run_budget: 600, stall_threshold: 900}\n"))
    assert c.limits_for("web").run_budget == 600
    assert c.limits_for("web").stall_threshold == 900
    assert c.limits_for("other").run_budget == 3600


@pytest.mark.parametrize("doc, key", [
    ({"ring": {"run_budget": -1}}, "ring.run_budget"),
    ({"ring": {"run_budget": 0}}, "ring.run_budget"),
    ({"ring": {"run_budget": "soon"}}, "ring.run_budget"),
    ({"ring": {"run_budget": True}}, "ring.run_budget"),
    ({"ring": {"heartbeat_interval": 0}}, "ring.heartbeat_interval"),
    ({"ring": {"lap_pause": -0.5}}, "ring.lap_pause"),
    ({"ring": {"keep_logs": 1.5}}, "ring.keep_logs"),
    ({"ring": {"tempfail_exit_code": 300}}, "ring.tempfail_exit_code"),
    ({"ring": {"stall_threshold": 100, "run_budget": 100}}, "ring.stall_threshold"),
    ({"ring": {"bogus": 1}}, "ring.bogus"),
    ({"nonsense": 1}, "nonsense"),
    ({"ring": [1, 2]}, "ring"),
    ({"agents": {"web": {"run_budget": 5000}}}, "agents.web.run_budget"),
    ({"agents": {"web": {"stall_threshold": 10}}}, "agents.web.stall_threshold"),
    ({"agents": {"web": {"colour": "red"}}}, "agents.web.colour"),
    ({"watch": {"stale_after": 0}}, "watch.stale_after"),
    ({"watch": {"start_limit_burst": 0}}, "watch.start_limit_burst"),
    ({"watch": {"restart_command": "systemctl restart ringd"}}, "watch.restart_command"),
    ({"alerts": {"command": [1]}}, "alerts.command"),
])
def test_bad_values_name_the_key(doc, key):
    with pytest.raises(ConfigError) as e:
        parse_config(doc)
    assert key in str(e.value)


def test_zero_allowed_where_spec_says():
    c = parse_config({"ring": {"lap_pause": 0}, "watch": {"restart_sec": 0}})
    assert c.ring.lap_pause == 0 and c.watch.restart_sec == 0


def test_start_limit_that_never_triggers_is_a_warning():
    c = parse_config({"watch": {"restart_sec": 10, "start_limit_burst": 5, "start_limit_interval": 20}})
    assert any("start_limit_interval" in w for w in c.warnings)


def test_yaml_alias_bomb_is_refused_without_expanding(tmp_path):
    bomb = 'a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]\n'
    for i in range(ord("b"), ord("j")):
        prev = chr(i - 1)
        bomb += f"{chr(i)}: &{chr(i)} [*{prev},*{prev},*{prev},*{prev},*{prev},*{prev},*{prev},*{prev},*{prev}]\n"
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp_path, bomb))
    assert "alias" in str(e.value) and len(str(e.value)) < 300


def test_garbage_yaml_is_one_line(tmp_path):
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp_path, "ring: [unclosed\n  : : :"))
    assert "\n" not in str(e.value) and "ring.yaml" in str(e.value)


def test_group_writable_config_is_refused(tmp_path):
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp_path, "", mode=0o664))
    assert "writable by group or others" in str(e.value) and "0664" in str(e.value)


@pytest.mark.parametrize("text, line, key", [
    ("ring: {run_budget: 2, stall_threshold: 3}\nring: {run_budget: 5}\n", "line 2", "'ring'"),
    ("ring:\n  run_budget: 2\n  stall_threshold: 3\n  run_budget: 9\n", "line 4", "'run_budget'"),
    ("agents:\n  web: {cwd: /srv}\n  'web': {run_budget: 5}\n", "line 3", "'web'"),
])
def test_a_duplicate_key_is_refused_never_last_one_wins(tmp_path, text, line, key):
    # PyYAML keeps the last of two equal keys: the first section's settings vanished
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp_path, text))
    assert f"{line}: duplicate key {key}" in str(e.value) and "ring.yaml" in str(e.value)


def test_a_merge_key_is_not_a_duplicate(tmp_path):
    cfg = load_config(write(tmp_path, "ring:\n  <<: {run_budget: 2, stall_threshold: 3}\n  run_budget: 1\n"))
    assert (cfg.ring.run_budget, cfg.ring.stall_threshold) == (1, 3)


@pytest.mark.parametrize("text, value, kind", [
    ("ring: {run_budget: !!int '0b12'}\n", "'0b12'", "int"),
    ("ring: {run_budget: !!float abc}\n", "'abc'", "float"),
    ("ring: {run_budget: !!bool maybe}\n", "'maybe'", "bool"),
    ("ring: {run_budget: !!timestamp 2001-13-45}\n", "'2001-13-45'", "timestamp"),
    ("ring: {run_budget: 2001-02-30}\n", "'2001-02-30'", "timestamp"),
    ("ring: {keep_logs: " + "9" * 5000 + "}\n", "'99999", "int"),   # past int()'s 4300 digits
    ("agents:\n  2001-02-30: {}\n", "'2001-02-30'", "timestamp"),
    ("ring: {backoff_max: !!timestamp 3600}\n", "'3600'", "timestamp"),   # AttributeError inside PyYAML
])
def test_a_scalar_no_yaml_constructor_can_read_is_one_config_error(tmp_path, text, value, kind):
    # PyYAML raises a bare ValueError/KeyError for these: a traceback from run
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp_path, text))
    msg = str(e.value)
    assert "invalid YAML: cannot read " + value in msg and msg.endswith(f" as {kind}") and len(msg) < 300, msg


@pytest.mark.parametrize("text", ["alerts: {failures_in_a_row: !!set 5}\n", "ring: !!set [a]\n",
                                  "ring: !!omap 5\n"])
def test_a_collection_tag_on_the_wrong_kind_of_node_is_one_config_error(tmp_path, text):
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp_path, text))
    assert "line 1: invalid YAML" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("text", [
    'ring: {"typo\\n\\e[2Jcleared": 1}\n',       # a newline and a terminal escape in a key
    '"top\\nlevel": 1\n',
    'agents: {web: {"x\\ny": 1}}\n',
    'ring: {"x\\ny": "\\0"}\n',
    "? " + "k" * 50_000 + "\n: 1\n",              # an explicit key has no length limit in YAML
])
def test_a_key_is_quoted_as_an_excerpt_never_echoed_raw(tmp_path, text):
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp_path, text))
    msg = str(e.value)
    assert "\n" not in msg and "\x1b" not in msg and len(msg) < 400, msg[:500]


@pytest.mark.parametrize("key, value", [("ring.heartbeat_interval", "1us"), ("ring.heartbeat_interval", 1e-9),
                                        ("watch.poll_interval", "1ms"), ("watch.poll_interval", 0.001)])
def test_a_wake_up_period_too_short_to_be_anything_but_a_spin_is_refused(key, value):
    section, name = key.split(".")
    with pytest.raises(ConfigError) as e:
        parse_config({section: {name: value}})
    assert str(e.value).startswith(f"{key}: must be at least 0.05 s")
    assert parse_config({section: {name: 0.05}})   # the floor itself is fine


@pytest.mark.parametrize("name, shown", [("on", "True"), ("no", "False"), ("123", "123"), ("1_0", "10")])
def test_an_agent_name_yaml_reads_as_another_type_says_to_quote_it(name, shown):
    import yaml
    with pytest.raises(ConfigError) as e:
        parse_config(yaml.safe_load(f"agents:\n  {name}: {{run_budget: 5, stall_threshold: 9}}\n"))
    assert f"agents: keys must be strings, got {shown}" in str(e.value) and "in quotes" in str(e.value)
    cfg = parse_config(yaml.safe_load(f"agents:\n  '{name}': {{run_budget: 5, stall_threshold: 9}}\n"))
    assert cfg.limits_for(name).run_budget == 5


@pytest.mark.parametrize("kind", ["dangling-symlink", "directory", "fifo"])
def test_a_default_config_that_exists_but_cannot_be_read_is_an_error_never_the_defaults(tmp_path, monkeypatch,
                                                                                        kind):
    """SPEC: the config is ./config/ring.yaml *if it exists*. A dangling symlink
    (its target on a file system not mounted yet), a directory or a FIFO there
    exists: it was passed over as if absent, and the ring ran silently on the
    built-in defaults (another roster path, budgets, alert command)."""
    from ringd.inputs.config import resolve_config_path
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("RING_CONFIG", raising=False)
    (tmp_path / "config").mkdir()
    default = tmp_path / "config" / "ring.yaml"
    {"dangling-symlink": lambda: os.symlink(tmp_path / "mnt" / "ring.yaml", default),
     "directory": default.mkdir,
     "fifo": lambda: os.mkfifo(default, 0o600)}[kind]()
    path = resolve_config_path(None)
    assert path == default
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert str(default) in str(e.value) and "\n" not in str(e.value)


def test_no_default_config_means_builtin_defaults(tmp_path, monkeypatch):
    from ringd.inputs.config import resolve_config_path
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("RING_CONFIG", raising=False)
    assert resolve_config_path(None) is None


def test_a_stale_after_no_longer_than_the_heartbeat_interval_is_a_config_warning():
    """ringwatch warned of it from a copy of the rule of its own, so ``ringd
    check`` (which prints the config's warnings) passed such a config in silence,
    and the watcher then stopped a healthy driver between two of its beats."""
    c = parse_config({"ring": {"heartbeat_interval": 10}, "watch": {"stale_after": 10}})
    assert any(w.startswith("watch.stale_after (10) is not longer than ring.heartbeat_interval (10)")
               for w in c.warnings), c.warnings
    assert not parse_config({"ring": {"heartbeat_interval": 10}, "watch": {"stale_after": 11}}).warnings


def test_a_config_that_is_not_utf8_names_the_line(tmp_path):
    """The roster's decoding error names its line; the config's named only a
    byte offset, which no editor shows."""
    p = tmp_path / "ring.yaml"
    p.write_bytes(b"ring:\n  run_budget: 5\n  # caf\xe9\n")
    os.chmod(p, 0o600)
    with pytest.raises(ConfigError) as e:
        load_config(p)
    assert f"{p}: line 3: config file is not UTF-8 text" in str(e.value), str(e.value)
