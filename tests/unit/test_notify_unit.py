"""ringd.host.notify's pure parts: a datagram's message, a run's notes, the count of datagrams not heard."""
from ringd.host.notify import Heard, Message, Notes, read_message
from fakeenv import Behaviour, FakeEnv, make_driver


def test_read_message_is_where_each_key_is_understood():
    assert read_message({"STATUS": "step 2", "WATCHDOG": "1"}) == Message("step 2", ping=True)
    assert read_message({"WATCHDOG": "trigger", "READY": "1"}) == Message(trigger=True)
    assert read_message({"MAINPID": "1", "FDSTORE": "1"}) == Message()


def test_heard_adds_messages_and_notes_count_what_was_dropped():
    heard = Heard()
    heard.add(Message("a", ping=True))
    heard.add(Message(ping=True))
    heard.dropped += 2
    assert (heard.accepted, heard.pings, heard.phase, heard.triggered) == (2, 2, "a", False)
    notes = Notes(run_id=4)
    notes.hear(heard, wall_now=10.0)
    notes.written_at, notes.dirty = 0.0, False
    notes.hear(Heard(dropped=3), wall_now=11.0)    # only drops: still news for status
    assert notes.dirty and notes.as_json() == {"run_id": 4, "phase": "a", "agent_beat_at": 10.0, "pings": 2,
                                               "dropped": 5}


class DroppingSocket:
    """A run's notify socket that hears nothing and drops ``per_drain`` datagrams each of ``drains`` times."""
    env = "/fake/notify.sock"

    def __init__(self, drains, per_drain):
        self.left, self.per_drain = drains, per_drain

    def fileno(self):
        return 7777

    def set_agent(self, pid):
        pass

    def drain(self):
        if self.left <= 0:
            return Heard()
        self.left -= 1
        return Heard(dropped=self.per_drain)


class DroppingEnv(FakeEnv):
    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.socks, self.published = [], []

    def open_notify(self, run_id):
        self.socks.append(DroppingSocket(drains=2, per_drain=3))
        return self.socks[-1]

    def write_notes(self, notes, now):
        notes.written_at, notes.dirty = now, False
        self.published.append(notes.as_json())

    def wait(self, timeout, fds=()):
        sock = self.socks[-1] if self.socks else None
        if sock is not None and sock.left > 0:
            self.waits += 1
            return self._due_signals(), {sock.fileno()}
        return super().wait(timeout, fds)


def test_datagrams_not_heard_are_counted_per_run_and_in_the_drivers_life(tmp_path):
    """status --json: ``current.notify_dropped`` (the run's notes) and
    ``driver.notify_dropped`` (the heartbeat: every run of this driver)."""
    d, env, j = make_driver(tmp_path, ["a", "b"], once=True, default=Behaviour(runs_for=3.0),
                            env_class=DroppingEnv)
    assert d.run() == 0
    assert [r.status for r in j.history(limit=10)] == ["ok", "ok"]
    assert d.notify_dropped == 2 * 2 * 3
    assert max(doc["dropped"] for doc in env.published if doc["run_id"] == 1) == 6
    assert env.beats[-1][1]["extra"]["notify_dropped"] == 12
