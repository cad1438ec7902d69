"""The files a driver rewrites at every beat (ringd.heartbeat, ringd.loops.metrics):
whole for every reader, and no fsync but the last beat's."""
import fcntl
import os
import signal
import subprocess
import sys

import pytest

from ringd.host import heartbeat
from ringd.host import lock
from ringd.loops import metrics

from conftest import mounted_tmpfs, wait_until


def test_beats_are_atomic_without_fsync_and_the_last_beat_is_durable(tmp_path, monkeypatch):
    """The heartbeat and metrics are rewritten at every beat: renamed into place
    whole, without an fsync (half of a write's CPU time, and most of an idle
    driver's). The stopped beat, a driver's last word, is fsync'd."""
    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd)))
    beat = heartbeat.Heartbeat(tmp_path, heartbeat.Notifier())
    beat.beat(lap=1, agent="a", run_id=1)
    metrics.write_metrics(tmp_path, "ring_up 1\n")
    assert synced == []
    assert heartbeat.read_json(tmp_path / heartbeat.HEARTBEAT_FILE)["run_id"] == 1
    assert (tmp_path / metrics.METRICS_FILE).read_text() == "ring_up 1\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([heartbeat.HEARTBEAT_FILE, metrics.METRICS_FILE])
    beat.beat(lap=1, agent=None, run_id=None, stopped=True)
    assert len(synced) == 1
    assert heartbeat.read_json(tmp_path / heartbeat.HEARTBEAT_FILE)["stopped"] is True


def test_a_heartbeat_is_this_state_dirs_by_real_path_or_by_inode():
    """Pure: a heartbeat names the state dir it was written for; a copy of another
    ring's (different path and inode) is not this ring's, a renamed dir (same
    inode) or a device renumbered at a reboot (same path) still is; an older
    ring's heartbeat without the keys is taken as this dir's."""
    hb = {"pid": 7, "state_dir": "/srv/ring", "state_id": [64769, 1234]}
    assert heartbeat.of_state_dir(hb, "/srv/ring", [64769, 1234])
    assert heartbeat.of_state_dir(hb, "/srv/ring-renamed", [64769, 1234])
    assert heartbeat.of_state_dir(hb, "/srv/ring", [64770, 1234])
    assert not heartbeat.of_state_dir(hb, "/srv/copy", [64769, 99])
    assert not heartbeat.of_state_dir(hb, "/srv/copy", None)
    assert heartbeat.of_state_dir({"pid": 7}, "/srv/anything", [1, 2])


def test_read_heartbeat_refuses_another_state_dirs_beat(tmp_path):
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    ours.mkdir()
    theirs.mkdir()
    heartbeat.Heartbeat(theirs, heartbeat.Notifier()).beat(lap=1, agent=None, run_id=None)
    assert heartbeat.read_heartbeat(theirs)["pid"] == os.getpid()
    (ours / heartbeat.HEARTBEAT_FILE).write_bytes((theirs / heartbeat.HEARTBEAT_FILE).read_bytes())
    assert heartbeat.read_heartbeat(ours) is None
    (ours / heartbeat.HEARTBEAT_FILE).unlink()
    (ours / heartbeat.HEARTBEAT_FILE).symlink_to(theirs / heartbeat.HEARTBEAT_FILE)
    assert heartbeat.read_heartbeat(ours) is None


def test_a_flock_on_another_file_systems_file_of_the_same_inode_is_not_the_drivers(ring, tmp_path):
    """/proc/locks names a lock by device and inode; inode numbers repeat across
    file systems (each tmpfs counts from 1). A flock another process holds on
    another file system's file whose inode is ringd.lock's was taken for the
    driver's: ringd status, with no heartbeat, said a driver held the lock
    ("stale", exit 1) where none runs ("stopped", exit 3)."""
    with mounted_tmpfs(ring.state), mounted_tmpfs(tmp_path / "other") as other:
        ours = ring.state / lock.LOCK_FILE
        ours.touch(mode=0o600)
        theirs = other / "x"
        theirs.touch()
        if os.stat(theirs).st_ino != os.stat(ours).st_ino:
            pytest.skip("this kernel's tmpfs does not number inodes per file system")
        fd = os.open(theirs, os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            assert lock.holder_pid(theirs) == os.getpid()
            assert lock.holder_pid(ours) is None
            r = ring.cli("status")
            assert r.returncode == 3, r.stdout + r.stderr
        finally:
            os.close(fd)


_KILLED_MID_WRITE = r"""
import os, signal, sys
from pathlib import Path
from ringd.host import heartbeat
os.fsync = lambda fd: os.kill(os.getpid(), signal.SIGKILL)   # a stalled disk's fsync, then a SIGKILL
heartbeat.Heartbeat(Path(sys.argv[1]), heartbeat.Notifier()).beat(lap=1, agent=None, run_id=None, stopped=True)
"""


def test_temp_files_of_writers_killed_mid_write_do_not_pile_up(ring):
    """A writer killed between its temp file's creation and the rename (SIGKILLed
    in a stalled fsync, the OOM killer) leaves ``.NAME.<pid>.tmp``; each such
    death left one in the state dir for good. The next writer of the file - a
    new driver's first beat - removes those of pids no process has, and leaves
    a live writer's alone."""
    env = dict(ring.env)
    for _ in range(3):
        r = subprocess.run([sys.executable, "-c", _KILLED_MID_WRITE, str(ring.state)], env=env)
        assert r.returncode == -signal.SIGKILL
    assert list(ring.state.glob(".ringd.heartbeat.*.tmp")), "the killed writer's temp file is left"
    live = subprocess.Popen(["sleep", "60"])
    try:
        busy = ring.state / f".ringd.heartbeat.{live.pid}.tmp"   # a live writer's, mid-write
        busy.write_text("{")
        ring.roster("a " + str(ring.agent("a", "sleep 30")))
        ring.start_driver()
        wait_until(lambda: (ring.heartbeat() or {}).get("run_id"), timeout=30)
        assert sorted(p.name for p in ring.state.glob(".ringd.heartbeat.*.tmp")) == [busy.name]
    finally:
        live.kill()
        live.wait()
