"""Shared quotas, the pure part (ringd.core.quota): what a pool has left at a
clock, when it reopens, whose reserve is held, what a report says, and how the
turn choice passes over an agent its pool holds. Microseconds, no processes."""
import math

import pytest

from ringd.core import quota
from ringd.core.policy import Action, TurnInputs, after_run, plan_turn
from ringd.core.quota import BadReport, Exhausted, Gate, Pool, Refused, RunUse, Used, parse_report, standing
from ringd.core.records import AgentState
from ringd.inputs.config import ConfigError, RingSettings, parse_config

MODEL = Pool("model", limit=100, window=10.0)
MEETING = Pool("model", limit=100, window=10.0, reserve={"meeting": 40})
T0 = 2_000_000_000.0


# --- the window ---------------------------------------------------------------------

def test_a_window_that_rolls_over_mid_run():
    """60 spent at T0; a run starts at T0+8 with 40 left, spends 30 by T0+9; by
    T0+11 the first use has left the window (mid-run): the pool counts 30 and
    reopens when that leaves, at T0+19."""
    uses = [(T0, 60)]
    assert standing(MODEL, uses, T0 + 8).left_for() == 40
    uses.append((T0 + 9, 30))
    at_9 = standing(MODEL, uses, T0 + 9)
    assert (at_9.used, at_9.left_for(), at_9.reset_at) == (90, 10, T0 + 10)
    at_10 = standing(MODEL, uses, T0 + 10)             # the first use leaves exactly one window later
    assert (at_10.used, at_10.left_for(), at_10.reset_at) == (30, 70, T0 + 19)
    assert standing(MODEL, uses, T0 + 19).used == 0 and standing(MODEL, uses, T0 + 19).reset_at is None


def test_a_pool_with_nothing_left_holds_its_agents_until_the_oldest_use_leaves():
    uses = [(T0, 70), (T0 + 3, 30)]
    st = standing(MODEL, uses, T0 + 4)
    assert st.left_for() == 0
    assert st.hold() == quota.Hold("model", T0 + 10, "quota model spent")
    assert standing(MODEL, uses, T0 + 10).hold() is None          # 70 came back


def test_a_use_summed_for_the_same_clock_gives_the_same_answers():
    """The journal hands a pool's use as one (oldest, total) pair summed at the clock of the read."""
    uses = [(T0, 10), (T0 + 2, 20), (T0 + 5, 30)]
    a, b = standing(MODEL, uses, T0 + 6), standing(MODEL, [(T0, 60)], T0 + 6)
    assert (a.used, a.left_for(), a.reset_at) == (b.used, b.left_for(), b.reset_at) == (60, 40, T0 + 10)


# --- exhausted reports ----------------------------------------------------------------

def test_an_exhausted_report_while_the_pool_is_held():
    """The pool is spent until T0+10. A report that the provider refuses until
    T0+30 holds it longer; a later report of T0+7 (the provider changed its mind)
    wins, and then the spent pool still waits for its use to leave."""
    uses = [(T0, 100)]
    held = standing(MODEL, uses, T0 + 5)
    assert held.hold().until == T0 + 10
    longer = standing(MODEL, uses, T0 + 5, exhausted=[Exhausted(T0 + 5, T0 + 30)])
    assert longer.hold() == quota.Hold("model", T0 + 30, "quota model exhausted (reported)")
    assert longer.reset_at == T0 + 30 and longer.exhausted_until == T0 + 30
    reports = [Exhausted(T0 + 5, T0 + 30), Exhausted(T0 + 6, T0 + 7)]
    assert standing(MODEL, uses, T0 + 6, exhausted=reports).hold().until == T0 + 7
    after = standing(MODEL, uses, T0 + 7, exhausted=reports)
    assert after.exhausted_until is None and after.hold() == quota.Hold("model", T0 + 10, "quota model spent")
    assert standing(MODEL, uses, T0 + 10, exhausted=reports).hold() is None


def test_an_exhausted_report_holds_a_pool_with_units_left():
    st = standing(MODEL, [], T0, exhausted=[Exhausted(T0, T0 + 60)])
    assert st.left_for() == 100 and st.hold().until == T0 + 60
    assert standing(MODEL, [], T0 + 60, exhausted=[Exhausted(T0, T0 + 60)]).hold() is None


# --- the clock ------------------------------------------------------------------------

def test_a_clock_stepped_forward_past_the_window_opens_the_pool():
    uses, reports = [(T0, 100)], [Exhausted(T0, T0 + 3600)]
    assert standing(MODEL, uses, T0 + 1, exhausted=reports).hold() is not None
    assert standing(MODEL, uses, T0 + 7200, exhausted=reports).hold() is None


def test_a_clock_stepped_back_never_holds_a_pool_longer_than_it_said():
    """Set back an hour: a use stamped an hour ahead counts as spent now and
    leaves within one window of the new clock (not in an hour and a window); an
    exhausted report heard an hour ahead holds for its own length from now."""
    now = T0 - 3600
    st = standing(MODEL, [(T0, 100)], now, exhausted=[Exhausted(T0, T0 + 30)])
    assert st.used == 100 and st.oldest == now
    assert st.exhausted_until == now + 30 and st.reset_at == now + 30
    assert standing(MODEL, [(T0, 100)], now).hold().until == now + MODEL.window


# --- reserves -------------------------------------------------------------------------

def test_a_reserve_is_held_while_its_agent_is_due_within_the_window_and_only_it_may_spend_it():
    uses = [(T0, 50)]
    far = standing(MEETING, uses, T0 + 1, due={"meeting": T0 + 60})
    assert far.reserved == {} and far.left_for() == 50
    near = standing(MEETING, uses, T0 + 1, due={"meeting": T0 + 9})
    assert near.reserved == {"meeting": 40} and near.left_for() == 10 and near.left_for("meeting") == 50
    spent = standing(MEETING, [(T0, 60)], T0 + 1, due={"meeting": T0 + 5})
    assert spent.hold() == quota.Hold("model", T0 + 10, "quota model reserved")
    assert spent.hold("meeting") is None                       # the meeting gets its reserve
    assert standing(MEETING, uses, T0 + 1, due={"meeting": math.inf}).reserved == {}   # a cron never due


def test_a_reserve_whose_agent_is_paused_is_not_held():
    """A paused scheduled agent runs at no due time: its reserve goes back to the
    others while it is paused, and is held again when it is resumed."""
    uses = [(T0, 60)]
    paused = standing(MEETING, uses, T0 + 1, due={"meeting": T0 + 5}, paused={"meeting"})
    assert paused.reserved == {} and paused.left_for() == 40 and paused.hold() is None
    resumed = standing(MEETING, uses, T0 + 1, due={"meeting": T0 + 5})
    assert resumed.left_for() == 0 and resumed.hold() is not None


def test_a_reserve_filling_the_pool_holds_others_until_nothing_by_itself():
    pool = Pool("model", 40, 10.0, {"meeting": 40})
    st = standing(pool, [], T0, due={"meeting": T0 + 5})
    assert st.hold() == quota.Hold("model", None, "quota model reserved") and st.reset_at is None


# --- the environment ----------------------------------------------------------------

def test_the_run_environment():
    pools = {"model": MEETING}
    gate = Gate(pools, {"a": "model", "meeting": "model"}.get, {"model": [(T0, 80)]}, T0 + 1,
                due={"meeting": T0 + 5})
    assert gate.env("a") == {"RING_QUOTA": "model", "RING_QUOTA_LEFT": "0",
                             "RING_QUOTA_RESET": f"{T0 + 10:.3f}"}                    # never negative
    assert gate.env("meeting")["RING_QUOTA_LEFT"] == "20"
    assert gate.env("nobody") == {}
    empty = Gate(pools, {"a": "model"}.get, {}, T0)
    assert empty.env("a") == {"RING_QUOTA": "model", "RING_QUOTA_LEFT": "100", "RING_QUOTA_RESET": ""}
    assert empty.at(T0 + 5).now == T0 + 5


# --- reports --------------------------------------------------------------------------

POOLS = {"model": MODEL}


@pytest.mark.parametrize("key, value, expected", [
    ("X_RING_USED", "model:1234", Used("model", 1234)),
    ("X_RING_USED", " model : 0 ", Used("model", 0)),
    ("X_RING_USED", "model:1000000000000000", Used("model", 10 ** 15)),
    ("X_RING_EXHAUSTED", "model:60", Refused("model", T0 + 60)),
    ("X_RING_EXHAUSTED", "model:1.5", Refused("model", T0 + 1.5)),
    ("X_RING_EXHAUSTED", "model:2033-05-18T03:34:20Z", Refused("model", 2000000060.0)),
    ("X_RING_EXHAUSTED", "model:2033-05-18T03:34:20", Refused("model", 2000000060.0)),   # no zone: UTC
    ("X_RING_EXHAUSTED", "model:2033-05-18T05:34:20+02:00", Refused("model", 2000000060.0)),
    ("X_RING_EXHAUSTED", "model:2001-01-01T00:00:00Z", Refused("model", 978307200.0)),   # past: no hold
])
def test_reports_that_parse(key, value, expected):
    assert parse_report(key, value, T0, POOLS) == expected


@pytest.mark.parametrize("key, value, kind", [
    ("X_RING_USED", "model:-5", "number"),
    ("X_RING_USED", "model:1e400", "number"),
    ("X_RING_USED", "model:12.5", "number"),
    ("X_RING_USED", "model:" + "9" * 16, "number"),
    ("X_RING_USED", "model:1000000000000001", "number"),
    ("X_RING_USED", "model:" + "9" * 10_000, "parse"),          # 10 kB of digits
    ("X_RING_USED", "model:", "number"),
    ("X_RING_USED", "1234", "parse"),
    ("X_RING_USED", ":12", "parse"),
    ("X_RING_USED", "other:12", "pool"),
    ("X_RING_USED", "mo del:12", "parse"),
    ("X_RING_EXHAUSTED", "model:-1", "parse"),
    ("X_RING_EXHAUSTED", "model:1e400", "parse"),
    ("X_RING_EXHAUSTED", "model:99999999999", "number"),       # 3,000 years
    ("X_RING_EXHAUSTED", "model:9999-12-31T23:59:59Z", "number"),
    ("X_RING_EXHAUSTED", "model:tomorrow", "parse"),
    ("X_RING_EXHAUSTED", "model:nan", "parse"),
    ("X_RING_OTHER", "model:1", "parse"),
])
def test_reports_that_are_refused_say_which_kind(key, value, kind):
    with pytest.raises(BadReport) as e:
        parse_report(key, value, T0, POOLS)
    assert e.value.kind == kind and len(str(e.value)) < 200 and "\n" not in str(e.value)


def test_a_runs_reports_last_use_wins_and_only_a_change_is_news():
    use = RunUse()
    use.take(Used("model", 10), T0)
    use.take(Used("model", 25), T0 + 1)
    assert use.used == {"model": (25, T0 + 1)} and use.dirty
    use.dirty = False
    use.take(Used("model", 25), T0 + 2)
    assert not use.dirty and use.used["model"] == (25, T0 + 1)
    use.take(Refused("model", T0 + 60), T0 + 3)
    assert use.dirty and use.exhausts("model", T0 + 59) and not use.exhausts("model", T0 + 60)
    assert not use.exhausts(None, T0) and not use.exhausts("other", T0)


# --- the turn -----------------------------------------------------------------------

def turn(names, gate, now=T0 + 1, start=0, scheduled=None, paused=frozenset()):
    roster = [(n, f"{n} /bin/{n}") for n in names]
    return plan_turn(TurnInputs(roster, start, {}, now, quota=gate, scheduled=scheduled or {}, paused=paused))


def test_an_agent_its_pool_holds_is_passed_over_and_other_pools_go_on():
    pools = {"model": MODEL, "api": Pool("api", 10, 60.0)}
    of = {"a": "model", "b": "model", "c": "api"}.get
    gate = Gate(pools, of, {"model": [(T0, 100)]}, T0 + 1)
    plan = turn(["a", "b", "c", "d"], gate)
    assert plan.index == 2 and plan.passed == [0, 1]              # c (api) takes the turn
    plan = turn(["a", "b", "d"], gate)
    assert plan.index == 2                                        # d has no pool
    assert plan.decision.action is Action.RUN


def test_when_every_agent_is_held_the_driver_waits_until_the_earliest_reset():
    pools = {"model": MODEL, "api": Pool("api", 10, 60.0)}
    gate = Gate(pools, {"a": "model", "c": "api"}.get, {"model": [(T0, 100)]}, T0 + 1,
                exhausted={"api": [Exhausted(T0, T0 + 30)]})
    plan = turn(["a", "c"], gate)
    assert plan.index is None and plan.until == T0 + 10


def test_the_scheduled_agent_runs_on_its_reserve_while_the_others_wait():
    gate = Gate({"model": MEETING}, {"a": "model", "meeting": "model"}.get, {"model": [(T0, 60)]}, T0 + 5,
                due={"meeting": T0 + 5})
    plan = turn(["a", "meeting"], gate, now=T0 + 5, scheduled={"meeting": T0 + 5})
    assert plan.scheduled and plan.index == 1
    gate = gate.at(T0 + 5)
    later = turn(["a", "meeting"], Gate({"model": MEETING}, {"a": "model", "meeting": "model"}.get,
                                        {"model": [(T0, 60)]}, T0 + 5, due={"meeting": T0 + 9}),
                 now=T0 + 5, scheduled={"meeting": T0 + 9})
    assert later.index is None and later.until == T0 + 9          # its due time, before the reset


def test_a_skip_an_operator_asked_for_is_taken_even_when_the_pool_holds_the_agent():
    gate = Gate({"model": MODEL}, {"a": "model"}.get, {"model": [(T0, 100)]}, T0 + 1)
    roster = [("a", "a /bin/a")]
    plan = plan_turn(TurnInputs(roster, 0, {"a": AgentState("a", skip_requested=True)}, T0 + 1, quota=gate))
    assert plan.decision.action is Action.SKIP


def test_a_deferral_with_its_pool_reported_exhausted_is_not_backed_off():
    ring = RingSettings(backoff_initial=60, backoff_max=3600)
    state = AgentState("a", consecutive_deferrals=2)
    plain = after_run(state, "deferred", "driver", T0, ring).state
    assert plain.consecutive_deferrals == 3 and plain.backoff_until == T0 + 240
    pooled = after_run(state, "deferred", "driver", T0, ring, pool_exhausted=True).state
    assert pooled.consecutive_deferrals == 2 and pooled.backoff_until is None
    failed = after_run(state, "error", "driver", T0, ring, pool_exhausted=True).state
    assert failed.backoff_until is not None                       # only a deferral waits for its pool


# --- configuration ------------------------------------------------------------------

GOOD = {"quotas": {"model": {"limit": 100, "window": "5h", "reserve": {"meeting": 40}}},
        "agents": {"meeting": {"schedule": "0 0 * * *", "quota": "model"}, "a": {"quota": "model"}}}


def test_a_good_quota_config():
    c = parse_config(GOOD)
    assert c.quotas["model"] == Pool("model", 100, 18000.0, {"meeting": 40})
    assert c.quota_for("a") == "model" and c.quota_for("b") is None


@pytest.mark.parametrize("change, key", [
    (lambda d: d["quotas"]["model"].update(limit=-1), "quotas.model.limit"),
    (lambda d: d["quotas"]["model"].update(limit=1.5), "quotas.model.limit"),
    (lambda d: d["quotas"]["model"].update(window=0), "quotas.model.window"),
    (lambda d: d["quotas"]["model"].pop("window"), "quotas.model.window"),
    (lambda d: d["quotas"]["model"].update(burst=3), "quotas.model.burst"),
    (lambda d: d["agents"]["a"].update(quota="nope"), "agents.a.quota"),
    (lambda d: d["quotas"]["model"]["reserve"].update(a=10), "quotas.model.reserve.a"),
    (lambda d: d["quotas"]["model"]["reserve"].update(meeting=101), "quotas.model.reserve.meeting"),
    (lambda d: d["quotas"]["model"]["reserve"].update(meeting=-1), "quotas.model.reserve.meeting"),
    (lambda d: d["agents"]["meeting"].update(quota=None), "quotas.model.reserve.meeting"),
    (lambda d: d["quotas"].update({"bad pool": {"limit": 1, "window": 1}}), "quotas"),
])
def test_bad_quota_config_names_the_key(change, key):
    import copy
    doc = copy.deepcopy(GOOD)
    change(doc)
    with pytest.raises(ConfigError) as e:
        parse_config(doc)
    assert str(e.value).startswith(key + ":") or str(e.value).startswith(key + " "), str(e.value)


def test_a_read_of_the_pools_holds_until_a_use_leaves_its_window():
    """The driver keeps its read of the pools across turns (the sums change
    only when its own runs record use, and it drops the read then) while it
    holds: until a pool's oldest use leaves its window; not across a clock set
    back, nor for other windows."""
    windows = (("api", 60.0), ("model", 10.0))
    read = quota.Read(T0, windows, {"model": [(T0 - 4, 50)], "api": [(T0 - 30, 1)]}, {})
    assert read.until == T0 + 6
    assert read.holds(windows, T0) and read.holds(windows, T0 + 5.9)
    assert not read.holds(windows, T0 + 6)                       # the model use left: read again
    assert not read.holds(windows, T0 - 1)                       # the clock was set back
    assert not read.holds((("model", 20.0),), T0 + 1)            # a reloaded config
    assert quota.Read(T0, windows, {}, {"model": [Exhausted(T0, T0 + 5)]}).holds(windows, T0 + 1e6)
