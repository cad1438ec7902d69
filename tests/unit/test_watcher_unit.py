"""The watcher's loop against a scripted environment (tests/fakewatchenv.py): a
fake clock, fake driver processes, a fake restart command and alert helper,
signals at given times, ringwatch.json in memory. Each test runs minutes of
watching in milliseconds; tests/system/test_watch.py keeps the real-process
wiring."""
import signal

import pytest

from fakewatchenv import BOOT0, WALL0, WATCH, Command, Driver, make_watcher
from ringd.core.errors import RingError
from ringd.core.settings import AlertSettings
from ringd.core.timefmt import iso
from ringd.host.alerts import longest as alert_longest
from ringd.host.driverproc import KILL_WAIT
from ringd.loops.watcher import COMMAND_KILL_WAIT, COMMAND_TIMEOUT, STOP_BUDGET, STOP_GRACE

make = make_watcher
STALE, RESTART, POLL = WATCH["stale_after"], WATCH["restart_sec"], WATCH["poll_interval"]
ALERT = AlertSettings(command=("alert",), timeout=20)


def starts(env):
    """When each driver the watcher started began."""
    return [p.started for p in env.started]


def sent(p, sig):
    return [t for t, s in p.signals if s == sig]


# --- start, a dead driver, a stop ------------------------------------------------------

def test_a_watcher_starts_its_driver_says_ready_and_records_itself(tmp_path):
    w, env = make(tmp_path)
    env.send(1.0, signal.SIGTERM)
    assert w.run() == 0
    assert starts(env) == [0.0]
    notes = [m for _, m in env.notes]
    assert notes.index("READY=1") > notes.index("STATUS=started driver pid 1000")
    st = env.state
    assert (st["pid"], st["pid_start"], st["mode"], st["gave_up"]) == (4343, 77, "owner", False)
    assert st["started_at"] == iso(WALL0) and st["restarts"] == [] and st["stopped"] is True
    assert st["driver"] == {"pid": 1000, "pid_start": 7000, "health": "ok"}


def test_a_dead_driver_is_noticed_at_once_and_replaced_after_restart_sec(tmp_path):
    w, env = make(tmp_path, [Driver(exits_at=2.05, code=-signal.SIGKILL)], poll_interval=60, stale_after=60)
    env.send(10.0, signal.SIGTERM)
    assert w.run() == 0
    assert env.said("driver (pid 1000) was killed by signal 9")[0][0] == 2.05   # its pidfd, not the next poll
    assert starts(env) == [0.0, pytest.approx(2.05 + RESTART)]
    assert len(env.state["restarts"]) == 1
    assert [k for _, k, _ in env.alerts] == ["driver-replaced"]


def test_a_sigterm_stops_the_driver_with_sigterm_and_sigcont_and_exits_0(tmp_path):
    w, env = make(tmp_path)
    env.send(3.0, signal.SIGTERM)
    assert w.run() == 0
    (d,) = env.started
    assert sent(d, signal.SIGTERM) == [3.0] and sent(d, signal.SIGCONT) == [3.0] and not sent(d, signal.SIGKILL)
    assert env.said(f"driver (pid {d.pid}) terminated") and env.t == pytest.approx(3.05)
    assert ("STOPPING=1" in [m for _, m in env.notes]) and env.state["stopped"] is True
    assert env.heartbeat()["stopped"] is True
    assert not env.open_fds, "every pidfd is closed"


def test_a_sigterm_as_the_driver_starts_up_stops_it_cleanly(tmp_path):
    w, env = make(tmp_path, [Driver(first_beat=None, term_delay=0.5)])
    env.send(0.0, signal.SIGTERM)
    assert w.run() == 0
    assert env.said("driver (pid 1000) terminated") and not env.said("killed")
    assert env.t == pytest.approx(0.5)


# --- an unhealthy driver: stale, stopped, deaf, unkillable ---------------------------------

def test_a_stale_heartbeat_is_stopped_and_replaced_after_stale_after(tmp_path):
    w, env = make(tmp_path, [Driver(hangs_at=3.0)])
    env.send(20.0, signal.SIGTERM)
    w.run()
    hung, new = env.started[:2]
    (termed,) = sent(hung, signal.SIGTERM)
    last_beat = 2.9   # beats at 0.1 + 0.2 k until the hang at 3.0
    assert last_beat + STALE < termed <= last_beat + STALE + POLL + 1e-9
    assert new.started == pytest.approx(termed + 0.05 + RESTART)   # its clean exit, then restart_sec
    assert env.said("driver unhealthy (stale): heartbeat of driver (pid 1000) unchanged for")
    assert len(env.state["restarts"]) == 1


def test_a_sigstopped_driver_gets_sigcont_with_its_sigterm_and_stops_itself(tmp_path):
    w, env = make(tmp_path)
    env.at(2.0, lambda: env.sigstop(env.started[0]))
    env.send(20.0, signal.SIGTERM)
    w.run()
    stopped = env.started[0]
    assert sent(stopped, signal.SIGCONT) == sent(stopped, signal.SIGTERM)
    assert not sent(stopped, signal.SIGKILL) and stopped.clean   # it wrote its stopped beat itself
    assert env.said(f"driver (pid {stopped.pid}) terminated") and len(env.started) == 2


def test_a_driver_deaf_to_sigterm_is_killed_after_the_grace(tmp_path):
    w, env = make(tmp_path, [Driver(hangs_at=1.0, term_delay=None)])
    env.send(30.0, signal.SIGTERM)
    w.run()
    deaf = env.started[0]
    (termed,), (killed,) = sent(deaf, signal.SIGTERM), sent(deaf, signal.SIGKILL)
    assert killed == pytest.approx(termed + STOP_GRACE)
    assert env.said(f"driver (pid {deaf.pid}) killed")
    assert env.started[1].started == pytest.approx(killed + RESTART)


def test_a_driver_sigkill_cannot_end_is_left_within_the_stop_budget(tmp_path):
    w, env = make(tmp_path, [Driver(hangs_at=1.0, term_delay=None, unkillable=True)])
    env.send(40.0, signal.SIGTERM)
    w.run()
    stuck = env.started[0]
    (termed,), (killed,) = sent(stuck, signal.SIGTERM), sent(stuck, signal.SIGKILL)
    (gave_up_at, _), = env.said(f"driver (pid {stuck.pid}) survived")
    assert gave_up_at == pytest.approx(killed + KILL_WAIT) and gave_up_at - termed <= STOP_BUDGET
    assert stuck.alive(env.t) and len(env.started) == 2   # replaced all the same


def test_the_watchers_own_stop_of_a_deaf_driver_fits_its_budget(tmp_path):
    w, env = make(tmp_path, [Driver(term_delay=None, unkillable=True)])
    env.send(5.0, signal.SIGTERM)
    assert w.run() == 0
    (killed,) = sent(env.started[0], signal.SIGKILL)
    assert killed == pytest.approx(5.0 + STOP_GRACE)   # the driver had its grace
    assert env.t - 5.0 <= STOP_BUDGET + 1e-9


def test_a_second_sigterm_during_the_stop_kills_the_driver_at_once(tmp_path):
    w, env = make(tmp_path, [Driver(term_delay=None)])
    env.send(5.0, signal.SIGTERM)
    env.send(6.5, signal.SIGINT)
    assert w.run() == 0
    d = env.started[0]
    assert sent(d, signal.SIGKILL) == [6.5] and env.t == pytest.approx(6.5)
    assert env.said("SIGINT again: killing the driver now") and env.said(f"driver (pid {d.pid}) killed")


def test_a_sigterm_during_a_replace_lets_that_stop_run_its_course_then_exits(tmp_path):
    w, env = make(tmp_path, [Driver(hangs_at=1.0, term_delay=None)])
    deaf = env.started
    env.at(3.5, lambda: env.send(env.t + 1.0, signal.SIGTERM))   # one second into the stop
    assert w.run() == 0
    (termed,), (killed,) = sent(deaf[0], signal.SIGTERM), sent(deaf[0], signal.SIGKILL)
    assert killed == pytest.approx(termed + STOP_GRACE)   # not hurried: one SIGTERM, replacing
    assert len(env.started) == 1 and env.state["restarts"] == []   # and no new driver after it


# --- the start limit ----------------------------------------------------------------------

def test_the_start_limit_gives_up_with_exit_70_and_records_it(tmp_path):
    w, env = make(tmp_path, default=Driver(exits_at=1.0, code=1, last_words="boom"), start_limit_burst=2,
                  alerts=ALERT)
    assert w.run() == 70
    assert len(env.started) == 3
    st = env.state
    assert st["gave_up"] is True and st["stopped"] is True and len(st["restarts"]) == 2
    assert "start_limit_burst 2" in st["gave_up_reason"] and st["gave_up_at"] == iso(WALL0 + env.t - 0.05)
    (loud,) = [m for _, m in env.said("GIVING UP")]
    assert "ringwatch reset" in loud and env.said(f"driver (pid {env.started[-1].pid}) exited 1 (boom)")
    assert [k for _, k, _ in env.alerts] == ["driver-replaced", "driver-replaced", "watcher-gave-up"]


def test_a_watcher_that_gave_up_refuses_to_start_until_reset(tmp_path):
    w, env = make(tmp_path)
    env.state = {"gave_up": True, "gave_up_at": "then", "gave_up_reason": "start limit hit"}
    with pytest.raises(RingError) as refused:
        w.run()
    assert refused.value.code == 70 and "ringwatch reset" in str(refused.value) and not env.started
    env.state, env.marker = {}, True   # recorded in ringwatch.gave-up only (a full disk)
    with pytest.raises(RingError):
        w.run()


def test_the_restart_history_of_an_earlier_watcher_counts(tmp_path):
    from ringd.host.watchstate import encode_restarts
    w, env = make(tmp_path, default=Driver(exits_at=1.0, code=1), start_limit_burst=2)
    env.state = encode_restarts([BOOT0 - 5.0], env.clock())   # one restart 5 s ago
    assert w.run() == 70
    assert len(env.started) == 2   # one more restart was allowed, not two


def test_restarts_further_apart_than_the_window_never_give_up(tmp_path):
    w, env = make(tmp_path, default=Driver(exits_at=10.0, code=1), start_limit_burst=2, start_limit_interval=15)
    env.send(100.0, signal.SIGTERM)
    assert w.run() == 0
    assert len(env.started) == 10 and env.state["restart_clock"]["since_boot"] == {
        env.state["restarts"][0]: BOOT0 + starts(env)[-1]}   # the one in the last 15 s


def test_a_driver_that_cannot_be_started_is_retried_after_restart_sec_then_given_up(tmp_path):
    w, env = make(tmp_path, default=Driver(cannot_start=True), poll_interval=60, stale_after=60,
                  start_limit_burst=2, start_limit_interval=120)
    assert w.run() == 70
    tries = [t for t, _ in env.said("cannot start the driver: Resource temporarily unavailable")]
    assert tries == [0.0, pytest.approx(RESTART), pytest.approx(2 * RESTART)]
    assert env.state["gave_up"] is True


def test_a_full_disk_keeps_the_history_in_memory_and_records_the_give_up_in_the_marker(tmp_path):
    w, env = make(tmp_path, default=Driver(exits_at=1.0, code=1), start_limit_burst=2)
    env.disk_full = True
    assert w.run() == 70
    assert len(env.started) == 3 and env.marker and env.state == {}
    assert len(env.said("cannot write")) == 2   # once for the state, once for the give-up
    assert env.said("the give-up is recorded in")


def test_a_reset_clears_the_history_kept_in_memory_on_a_full_disk(tmp_path):
    """On a full disk the history lives in memory; space freed and a `ringwatch
    reset` run (reset_gen moved), the next restart decision sees no history:
    written back, it would have undone the reset and given up early."""
    from ringd.host.watchstate import reset_fields
    w, env = make(tmp_path, default=Driver(exits_at=1.0, code=1), start_limit_burst=2)
    env.disk_full = True

    def freed_and_reset():
        env.disk_full = False
        env.state = reset_fields(1)
    env.at(2.3, freed_and_reset)   # after two restarts, before the third
    env.send(3.0, signal.SIGTERM)
    assert w.run() == 0
    assert env.said("ringwatch reset: restart history cleared") and not env.said("GIVING UP")
    assert len(env.started) == 3 and len(env.state["restarts"]) == 1 and env.state["reset_gen"] == 1


# --- exits the driver chose: 69, 75, 78 ------------------------------------------------------

def test_exits_69_are_waited_out_with_a_back_off_outside_the_start_limit(tmp_path):
    outage = [Driver(exits_at=0.1, code=69)] * 5
    w, env = make(tmp_path, outage, start_limit_burst=2)
    env.send(60.0, signal.SIGTERM)
    assert w.run() == 0
    gaps = [round(b - a - 0.1, 6) for a, b in zip(starts(env), starts(env)[1:])]
    assert gaps == [1.0, 2.0, 4.0, 8.0, 16.0]   # outage_backoff: restart_sec (at least 1 s), doubling
    assert env.state["restarts"] == [] and env.state["gave_up"] is False
    assert len(env.said("exited 69, an outage")) == 5 and not env.said("GIVING UP")
    assert env.state["driver"]["health"] == "ok"


def test_an_outage_after_the_driver_beat_again_backs_off_from_the_start(tmp_path):
    w, env = make(tmp_path, [Driver(exits_at=0.1, code=69)] * 2 + [Driver(exits_at=5.0, code=69)])
    env.send(30.0, signal.SIGTERM)
    w.run()
    gaps = [round(b - a, 6) for a, b in zip(starts(env), starts(env)[1:])]
    assert gaps == [1.1, 2.1, 6.0]   # 1, 2, then 1 again: it beat in between


def test_a_driver_exit_78_makes_the_watcher_exit_78_without_restarting(tmp_path):
    w, env = make(tmp_path, [Driver(first_beat=None, exits_at=0.3, code=78, last_words="ring.txt: bad name")])
    assert w.run() == 78
    (line,) = [m for _, m in env.said("exited 78")]
    assert "ring.txt: bad name" in line and "not restarting" in line
    assert len(env.started) == 1 and env.state["restarts"] == [] and env.state["stopped"] is True
    assert env.state["driver"]["health"] == "config-error"


def test_a_driver_exit_75_follows_the_driver_holding_the_lock_by_its_heartbeat(tmp_path):
    w, env = make(tmp_path, [Driver(first_beat=None, exits_at=0.3, code=75)])
    other = env.spawn(Driver())   # another driver, started by hand
    env.send(20.0, signal.SIGTERM)
    assert w.run() == 0
    assert len(env.started) == 1 and env.state["restarts"] == []
    assert env.state["driver"] == {"pid": other.pid, "pid_start": other.start_time, "health": "ok"}
    assert sent(other, signal.SIGTERM) == [20.0]   # adopted from its beats: stopped with the watcher


# --- signals: SIGHUP, SIGUSR1 -------------------------------------------------------------

def test_sighup_reloads_the_config_and_forwards_it_to_the_driver(tmp_path):
    from ringd.inputs.config import load_config
    cfg = tmp_path / "ring.yaml"
    cfg.write_text("watch:\n  poll_interval: 0.2\n  stale_after: 1.5\n")
    w, env = make(tmp_path, config_path=cfg)
    w.config = load_config(cfg)
    env.at(2.0, lambda: cfg.write_text("watch:\n  poll_interval: 7\n  stale_after: 9\n"
                                       "  restart_command: [systemctl, restart, ringd]\n"))
    env.send(2.0, signal.SIGHUP)
    env.send(3.0, signal.SIGHUP)
    env.send(4.0, signal.SIGTERM)
    w.run()
    assert sent(env.started[0], signal.SIGHUP) == [2.0, 3.0]
    assert (w.w.poll_interval, w.w.stale_after, w.w.restart_command) == (7, 9, None)
    assert env.said("SIGHUP: configuration reloaded") and env.said("deployment mode only changes")
    assert env.state["reload"] == {"seq": 2, "at": iso(WALL0 + 3.0), "error": None}   # for `ringd reload`


def test_a_sighup_with_a_broken_config_keeps_the_one_in_force_and_records_why(tmp_path):
    from ringd.inputs.config import load_config
    cfg = tmp_path / "ring.yaml"
    cfg.write_text("watch:\n  poll_interval: 0.2\n")
    w, env = make(tmp_path, config_path=cfg)
    w.config = load_config(cfg)
    env.at(1.0, lambda: cfg.write_text("watch:\n  stale_after: -1\n"))
    env.send(1.0, signal.SIGHUP)
    env.send(2.0, signal.SIGTERM)
    w.run()
    assert env.said("configuration not reloaded, keeping the previous one") and w.w.stale_after == 300
    assert sent(env.started[0], signal.SIGHUP) == [1.0]   # the driver reads its config itself
    assert env.state["reload"]["seq"] == 1 and "watch.stale_after" in env.state["reload"]["error"]


def test_under_systemd_status_follows_the_driver_between_checks(tmp_path):
    w, env = make(tmp_path, [Driver(status="lap 3: running web", status_from=5.0)], poll_interval=60,
                  stale_after=60, ring={"heartbeat_interval": 0.2}, env_args={"notifying": True})
    env.send(6.0, signal.SIGTERM)
    w.run()
    said = [(t, m) for t, m in env.notes if m.startswith("STATUS=driver ok")]
    assert said[0] == (pytest.approx(0.2), "STATUS=driver ok (pid 1000): starting")   # a heartbeat later
    assert (pytest.approx(5.2), "STATUS=driver ok (pid 1000): lap 3: running web") in said
    assert not env.said("unhealthy") and env.state["last_poll_at"] == iso(WALL0)   # no check came of it


def test_without_a_service_manager_the_heartbeat_is_read_only_at_checks(tmp_path):
    w, env = make(tmp_path, poll_interval=60, stale_after=60)
    env.send(30.0, signal.SIGTERM)
    w.run()
    assert env.waits <= 3 and not [m for _, m in env.notes if m.startswith("STATUS=driver ok")]


def test_sigusr1_makes_the_watcher_check_at_once(tmp_path):
    w, env = make(tmp_path, poll_interval=60, stale_after=60)
    polls = []
    env.at(5.0, lambda: polls.append(env.state.get("last_poll_at")))
    env.send(5.0, signal.SIGUSR1)
    env.send(5.5, signal.SIGTERM)
    assert w.run() == 0
    assert polls == [iso(WALL0)] and env.state["last_poll_at"] == iso(WALL0 + 5.0)
    assert len(env.started) == 1


# --- a new driver's grace; a frozen watcher; a stepped clock ---------------------------------

def test_a_new_driver_has_stale_after_to_beat_first(tmp_path):
    w, env = make(tmp_path, [Driver(first_beat=1.4)])
    env.send(10.0, signal.SIGTERM)
    w.run()
    assert len(env.started) == 1   # late, within its grace

    w, env = make(tmp_path, [Driver(first_beat=None)])
    env.send(10.0, signal.SIGTERM)
    w.run()
    (termed,) = sent(env.started[0], signal.SIGTERM)
    assert STALE < termed <= STALE + 0.01   # judged the moment its grace ran out, not a poll later
    assert env.said("no heartbeat from driver (pid 1000) within 1.5s of its start")


def test_a_driver_that_exits_before_its_first_beat_is_dead_at_once(tmp_path):
    w, env = make(tmp_path, [Driver(first_beat=None, exits_at=0.5, code=1)])
    env.send(5.0, signal.SIGTERM)
    w.run()
    assert env.said("driver (pid 1000) exited before its first heartbeat")[0][0] == 0.5
    assert starts(env)[1] == pytest.approx(0.5 + RESTART)


def test_a_watcher_frozen_past_stale_after_leaves_its_beating_driver_alone(tmp_path):
    """The watcher SIGSTOPped (a debugger, a frozen cgroup) while its driver beats
    on: when it wakes its monotonic clock has run on past ``stale_after`` since
    the last beat it saw, but it reads the heartbeat before judging, finds it
    changed, and kills nothing."""
    w, env = make(tmp_path)
    env.freeze(2.0, 3 * STALE)
    env.send(10.0, signal.SIGTERM)
    w.run()
    assert len(env.started) == 1 and env.state["restarts"] == [] and not env.said("unhealthy")


def test_a_stepped_wall_clock_changes_nothing(tmp_path):
    w, env = make(tmp_path, default=Driver(exits_at=4.0, code=1), start_limit_burst=2, start_limit_interval=8)
    env.at(3.0, lambda: setattr(env, "wall_step", -3600.0))     # an hour back
    env.at(13.0, lambda: setattr(env, "wall_step", 86400.0))    # then a day ahead
    env.send(40.0, signal.SIGTERM)
    assert w.run() == 0   # 4.2 s apart, one within 8 s before each: never a burst, whatever the wall clock did
    assert len(env.started) == 10 and not env.said("unhealthy (stale)")
    assert sorted(env.state["restart_clock"]["since_boot"].values()) == [BOOT0 + t for t in starts(env)[-2:]]


# --- adoption and heartbeats that are not our driver's -----------------------------------------

def test_a_running_driver_is_adopted_watched_and_stopped(tmp_path):
    w, env = make(tmp_path)
    running = env.spawn(Driver())
    env.t = 1.0
    env.send(5.0, signal.SIGTERM)
    assert w.run() == 0
    assert not env.started and env.said(f"driver already running (pid {running.pid}); watching it")
    assert sent(running, signal.SIGTERM) == [5.0] and env.state["restarts"] == []


def test_a_heartbeat_naming_a_recycled_pid_never_gets_that_process_signalled(tmp_path):
    w, env = make(tmp_path, restart_command=("restart",), start_limit_burst=1,
                  env_args={"command": Command(starts=None)})
    stranger = env.spawn(Driver(first_beat=None))
    env.at(1.0, lambda: env.write_heartbeat({"pid": stranger.pid, "pid_start": stranger.start_time + 1,
                                             "seq": 1, "at_epoch": env.wall(), "boot_id": "fake-boot"}))
    assert w.run() == 70
    assert env.said(f"driver (pid {stranger.pid}) is gone") and not stranger.signals


def test_a_heartbeat_from_an_earlier_boot_names_no_driver(tmp_path):
    w, env = make(tmp_path)
    stranger = env.spawn(Driver(first_beat=None))
    env.write_heartbeat({"pid": stranger.pid, "pid_start": stranger.start_time, "seq": 7,
                         "at_epoch": env.wall(), "boot_id": "another-boot"})
    env.send(4 * STALE, signal.SIGTERM)
    w.run()
    assert [p.pid for p in env.started] == [stranger.pid + 1] and not stranger.signals


# --- restart_command mode -----------------------------------------------------------------

def test_restart_command_mode_runs_the_command_once_and_never_starts_a_driver(tmp_path):
    w, env = make(tmp_path, restart_command=("systemctl", "restart", "ringd"))
    first = env.spawn(Driver(exits_at=2.0, code=-signal.SIGKILL))
    env.t = 0.5
    env.send(10.0, signal.SIGTERM)
    assert w.run() == 0
    assert env.commands == [(pytest.approx(2.0 + RESTART), ["systemctl", "restart", "ringd"])]
    assert not env.started and len(env.state["restarts"]) == 1
    new = env.procs[-1]
    assert new.alive(env.t) and not new.signals, "the driver belongs to the service manager"
    assert env.state["mode"] == "restart_command" and env.state["driver"]["pid"] == new.pid != first.pid


def test_restart_command_mode_without_a_driver_waits_its_grace_then_runs_the_command(tmp_path):
    w, env = make(tmp_path, restart_command=("restart",))
    env.send(10.0, signal.SIGTERM)
    assert w.run() == 0
    (ran,) = env.commands
    assert STALE < ran[0] <= STALE + RESTART + 0.01 and env.said("no live driver yet")


def test_a_sigterm_while_the_restart_command_runs_kills_it_and_one_sigkill_cannot_end_is_left(tmp_path):
    w, env = make(tmp_path, restart_command=("restart",),
                  env_args={"command": Command(runs_for=None, killable=False, starts=None)})
    env.send(3.0, signal.SIGTERM)
    assert w.run() == 0
    cmd = env.procs[-1]
    assert sent(cmd, signal.SIGKILL) == [3.0]
    assert env.said(f"restart command (pid {cmd.pid}) did not die of SIGKILL within {COMMAND_KILL_WAIT}s")
    assert env.t - 3.0 < COMMAND_KILL_WAIT + 1.5   # it left it behind; the stop itself is short


def test_a_restart_command_still_running_after_its_timeout_is_killed(tmp_path):
    w, env = make(tmp_path, restart_command=("restart",), env_args={"command": Command(runs_for=None)})
    env.send(200.0, signal.SIGTERM)
    w.run()
    (ran, _), = env.commands[:1]
    (killed,) = sent(env.procs[0], signal.SIGKILL)
    assert killed == pytest.approx(ran + COMMAND_TIMEOUT)
    assert env.said(f"still running after {COMMAND_TIMEOUT}s; killing it")


# --- the give-up alert, sd_notify, the state lock ---------------------------------------------

def test_the_give_up_alert_is_awaited_before_the_watcher_exits(tmp_path):
    w, env = make(tmp_path, default=Driver(exits_at=1.0, code=1), start_limit_burst=1, alerts=ALERT)
    env.alert_runs_for = 1.0
    assert w.run() == 70
    (gave_up_at, _, _), = [a for a in env.alerts if a[1] == "watcher-gave-up"]
    assert env.t == pytest.approx(gave_up_at + 1.0)


def test_the_wait_for_the_give_up_alert_is_bounded_by_alerts_longest(tmp_path):
    """The watcher waits for its give-up alert (systemd kills what is left of the
    unit once it exits) "at most alerts.timeout + 10 s": a helper that never
    ends is given up at that bound, and the watcher says so."""
    assert alert_longest(20) == 30 and alert_longest(0.5) == 10.5   # docs/service.md: "alerts.timeout + 10 s"
    w, env = make(tmp_path, default=Driver(exits_at=1.0, code=1), start_limit_burst=1, alerts=ALERT)
    env.alert_runs_for = None   # a helper that never ends
    assert w.run() == 70
    (gave_up_at, _, _), = [a for a in env.alerts if a[1] == "watcher-gave-up"]
    assert env.t == pytest.approx(gave_up_at + alert_longest(20))
    assert env.said("still running; exiting without it")


def test_a_sigterm_during_the_give_up_alert_ends_the_wait_and_keeps_the_give_up(tmp_path):
    w, env = make(tmp_path, default=Driver(exits_at=1.0, code=1), start_limit_burst=1, alerts=ALERT)
    env.alert_runs_for = None
    env.send(5.0, signal.SIGTERM)
    assert w.run() == 70
    assert env.t == 5.0 and env.said("exiting before the alert helper") and env.state["gave_up"] is True


def test_sd_notify_ready_status_and_a_watchdog_ping_in_time(tmp_path):
    w, env = make(tmp_path, poll_interval=1, stale_after=60, env_args={"watchdog_every": 0.4})
    env.send(10.0, signal.SIGTERM)
    w.run()
    pings = [t for t, m in env.notes if m == "WATCHDOG=1"]
    assert max(b - a for a, b in zip(pings, pings[1:])) <= 0.4 + 1e-9 and pings[-1] >= 9.6
    notes = [m for _, m in env.notes]
    assert "READY=1" in notes and "STATUS=driver ok (pid 1000): idle" in notes   # and what the driver said


def test_a_sigterm_while_waiting_for_the_state_files_lock_is_heard_at_once(tmp_path):
    w, env = make(tmp_path)
    env.at(2.0, lambda: setattr(env, "state_lock_held_until", 100.0))   # a stopped `ringwatch reset`
    env.send(3.0, signal.SIGTERM)
    assert w.run() == 0
    assert env.t < 3.0 + 1.5   # the driver's clean stop and a short wait for the lock; was 10 s more
    assert env.said("without its lock")


def test_a_lock_file_replaced_under_the_watcher_is_said_once(tmp_path):
    w, env = make(tmp_path)
    env.lock_verdicts = ["ok", "retaken", "lost", "lost", "lost"]
    env.send(2.0, signal.SIGTERM)
    w.run()
    assert len(env.said("was removed or replaced; locked it again")) == 1
    assert len(env.said("another process holds its lock; watching on")) == 1


def test_a_second_watcher_is_refused_naming_the_first(tmp_path):
    w, env = make(tmp_path)
    env.lock_holder = 999
    with pytest.raises(RingError) as refused:
        w.run()
    assert refused.value.code == 75 and "pid 999" in str(refused.value) and not env.started


def test_a_quiet_watch_sleeps_a_poll_at_a_time(tmp_path):
    w, env = make(tmp_path, poll_interval=5, stale_after=30)
    env.send(3600.0, signal.SIGTERM)
    w.run()
    assert env.waits <= 3600 / 5 + 5 and not env.open_fds
