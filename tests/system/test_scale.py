"""The cost of one hop does not grow with legal-but-large state: the roster's
length, agents paused or scheduled, stuck state earlier runs left behind.
Counted operations, never timings (the commits that brought each test give theirs)."""
import math
from collections.abc import Sequence

from ringd.core.policy import Action, TurnInputs, plan_turn


class CountingRoster(Sequence):
    """A roster of ``n`` (name, line) pairs that counts the entries read."""

    def __init__(self, n):
        self.n, self.reads = n, 0

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if isinstance(i, slice):
            raise TypeError("no slices")
        if not -self.n <= i < self.n:
            raise IndexError(i)
        self.reads += 1
        return (f"a{i % self.n:05d}", "/bin/true")


def test_a_turn_with_a_scheduled_agent_reads_no_more_of_the_roster_than_it_walks():
    """One scheduled agent made every turn look at every roster entry for the
    scheduled ones (0.36 ms a turn at 10,000 agents, a fifth of a hop). With
    the scheduled agents' positions given, a turn reads the entries it walks."""
    roster = CountingRoster(10000)
    plan = plan_turn(TurnInputs(roster, 5000, {}, 100.0, scheduled={"a09999": 500.0},
                                scheduled_at={"a09999": 9999}))
    assert (plan.index, plan.decision.action, plan.scheduled) == (5000, Action.RUN, False)
    assert roster.reads <= 3, f"{roster.reads} roster entries read for one turn"
    # due: taken first, at its position, still without a pass over the roster
    roster.reads = 0
    plan = plan_turn(TurnInputs(roster, 5000, {}, 600.0, scheduled={"a09999": 500.0},
                                scheduled_at={"a09999": 9999}))
    assert (plan.index, plan.scheduled) == (9999, True) and roster.reads <= 3


def test_scheduled_positions_given_or_not_choose_the_same_turns():
    """``scheduled_at`` only spares the pass: every plan is the one the pass gives."""
    import random
    rng = random.Random(7)
    for _ in range(300):
        n = rng.randint(1, 12)
        roster = [(f"x{i}", f"l{i}") for i in range(n)]
        names = [name for name, _ in roster]
        sched = {name: rng.choice([50.0, 99.0, 150.0, float("inf")]) for name in rng.sample(names, rng.randint(0, n))}
        paused = frozenset(rng.sample(names, rng.randint(0, min(2, n))))
        ran = frozenset(rng.sample(sorted(sched), rng.randint(0, len(sched)))) if sched else frozenset()
        # a dict in another order than the roster's: the roster's order still rules
        order = list(sched.items())
        rng.shuffle(order)
        base = dict(roster=roster, start=rng.randrange(n), states={}, now=100.0, paused=paused,
                    scheduled=dict(order), ran_scheduled=ran, limit=rng.choice([None, n]))
        at = {name: names.index(name) for name in reversed([k for k, _ in order])}
        assert plan_turn(TurnInputs(**base, scheduled_at=at)) == plan_turn(TurnInputs(**base))


def _driver(tmp_path, names, agents=None, **ring):
    from fakeenv import make_driver
    d, _, journal = make_driver(tmp_path, names, once=True, agents=agents, **ring)
    return d, journal


def test_the_driver_gives_each_turn_the_scheduled_agents_positions(tmp_path, monkeypatch):
    """The driver's turn hands plan_turn its scheduled agents' roster positions
    (kept with the view, made once per roster read), so no turn passes over the roster."""
    from ringd.loops import driver as driver_mod
    from ringd.inputs.config import AgentOverride
    names = [f"a{i:03d}" for i in range(200)]
    d, journal = _driver(tmp_path, names, agents={"a150": AgentOverride(every=3600.0),
                                                  "a020": AgentOverride(every=3600.0)})
    seen = []
    real = driver_mod.plan_turn

    def spy(inp):
        seen.append(inp.scheduled_at)
        return real(inp)
    monkeypatch.setattr(driver_mod, "plan_turn", spy)
    try:
        assert d.run() == 0
    finally:
        journal.close()
    assert seen and all(at == {"a020": 20, "a150": 150} for at in seen), seen[:3]


def _vm_steps_of_a_lap(tmp_path, paused):
    """SQLite virtual-machine steps of a ``--once`` lap of three agents, with
    ``paused`` agents paused by an operator and since removed from the roster
    (their pauses stay in the journal: legal state, as large as it likes)."""
    tmp_path.mkdir()
    d, journal = _driver(tmp_path, ["a", "b", "c"])
    with journal.transaction() as tx:
        for i in range(paused):
            tx.set_meta(f"paused:gone{i:05d}", "1")
    steps = [0]

    def step():
        steps[0] += 1
        return 0
    journal.con.set_progress_handler(step, 1)
    try:
        assert d.run() == 0
    finally:
        journal.close()
    return steps[0]


def test_a_turn_reads_no_pause_of_an_agent_it_does_not_walk(tmp_path):
    """Every turn read every agent's pause (``ringd pause NAME``): 1 us each,
    5 ms a turn with 5,000 paused. The turn now looks up the pauses of the
    agents it walks; 2,000 paused agents elsewhere cost it nothing."""
    few = _vm_steps_of_a_lap(tmp_path / "none", 0)
    many = _vm_steps_of_a_lap(tmp_path / "many", 2000)
    assert many <= few * 1.05, f"SQLite steps of a lap: {few} with no paused agent, {many} with 2,000"


def test_paused_agents_are_passed_over_and_an_agent_paused_at_the_start_is_known_at_once(tmp_path):
    """The lazy pauses keep the rule: a paused agent is passed over wherever it stands."""
    d, journal = _driver(tmp_path, ["a", "b", "c", "d"])
    for name in ("a", "c"):
        journal.set_paused(name, True)
    try:
        with journal.transaction() as tx:
            controls = tx.controls(first="a")
            assert "a" in controls.paused and "b" not in controls.paused and "c" in controls.paused
            assert sorted(controls.paused) == ["a", "c"] and len(controls.paused) == 2
            assert controls.paused == tx.controls().paused
        assert d.run() == 0
        assert [r.agent for r in journal.history(limit=10)[::-1]] == ["b", "d"]
    finally:
        journal.close()


class _SpentCgroup:
    """Stands in for an ended run's cgroup that cannot be removed: counts the tries."""

    def __init__(self, stuck):
        self.stuck, self.tries = stuck, 0

    def remove(self, timeout=0.0):
        self.tries += 1
        return False


def test_cgroups_left_populated_by_processes_sigkill_could_not_end_are_not_retried_at_every_wait(tmp_path,
                                                                                                monkeypatch):
    """Each wait tried to remove every such cgroup (an rmdir, a stat, a listing
    of its sub-cgroups): 16 of them cost every hop 58 us, 344 us with a
    sub-cgroup each. They are tried once every env.STUCK_RETRY now; a cgroup
    the kernel is still releasing is still tried at every wait."""
    from ringd.host import env as env_mod
    monkeypatch.setattr(env_mod, "STUCK_RETRY", 60.0, raising=False)
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    env = env_mod.RealEnv(state, lambda m, level: None, prove_containment=False)
    stuck = [_SpentCgroup(True) for _ in range(env_mod.SPENT_KEPT - 1)]
    busy = _SpentCgroup(False)
    env._spent_cgroups.extend([*stuck, busy])
    try:
        for _ in range(50):
            env.wait(0)
        assert [cg.tries for cg in stuck] == [1] * len(stuck), "each stuck cgroup tried once in 50 waits"
        assert busy.tries == 50
        assert env._spent_cgroups == [*stuck, busy], "none given up on"
    finally:
        env._spent_cgroups = []
        env.close()


def test_a_lowered_keep_logs_prunes_a_full_folder_over_several_runs_not_in_one_hop(tmp_path):
    """keep_logs lowered below an agent's full log folder: the next run's end
    unlinked the whole excess at once - 100,000 logs took one hop 5 s, the
    driver deaf to its signals. Each run end now prunes env.PRUNE_LOGS_AT_ONCE
    at most, oldest first, until the folder is down to keep_logs."""
    from ringd.host import env as env_mod
    state = tmp_path / "state"
    (state / "logs" / "a").mkdir(parents=True, mode=0o700)
    for run_id in range(1, 1001):
        (state / "logs" / "a" / f"{run_id}.log").touch()
    env = env_mod.RealEnv(state, lambda m, level: None, prove_containment=False)
    try:
        def left():
            return sorted(int(p.stem) for p in (state / "logs" / "a").iterdir())
        (state / "logs" / "a" / "1001.log").touch()
        env.keep_logs("a", 1001, keep=5)
        assert left() == list(range(env_mod.PRUNE_LOGS_AT_ONCE + 1, 1002)), "the oldest, at most the cap"
        runs = 1
        while len(left()) > 5:
            run_id = 1001 + runs
            (state / "logs" / "a" / f"{run_id}.log").touch()
            env.keep_logs("a", run_id, keep=5)
            runs += 1
            assert runs < 100
        cap = env_mod.PRUNE_LOGS_AT_ONCE   # each later run adds its log and prunes up to cap
        assert left() == list(range(1001 + runs - 5, 1001 + runs)), left()[:3]
        assert runs == 1 + math.ceil((1001 - cap - 5) / (cap - 1)), runs
    finally:
        env.close()
