"""The files a driver rewrites at every beat (ringd.heartbeat, ringd.metrics):
whole for every reader, and no fsync but the last beat's."""
import os

from ringd import heartbeat, metrics


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
