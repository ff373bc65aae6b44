"""Cost and benefit: the overhead budget, the stop rule, and the reduced evaluation."""

import json
import math
import os
import time
import warnings

import keras
import numpy as np
import pytest

import tf_hwopt
from tf_hwopt.egeria.policy import EgeriaPolicy, replay
from tf_hwopt.freezing.budget import (
    BACKWARD_SHARE,
    best_case_saving_seconds,
    evaluation_cost,
    freeze_saving_seconds,
    releases_held_freezes,
    saving_scale,
    stretched_interval,
    worth_evaluating,
)
from tf_hwopt.freezing.callback import FreezingCallback
from tf_hwopt.freezing.policy import Decision, FreezingPolicy

from conftest import compile_model, small_resnet

RECORDED = os.path.join(os.path.dirname(__file__), "data", "recorded_plasticity.json")


# ------------------------------------------------------------ pure functions


def test_stretched_interval_keeps_evaluation_within_budget():
    assert stretched_interval(10, 0.01, 0.1, 0.02) == 10  # 1% of training: base interval kept
    n = stretched_interval(10, 0.5, 0.1, 0.02)
    assert n == 250
    assert 0.5 / (n * 0.1) <= 0.02 < 0.5 / ((n - 1) * 0.1)  # the smallest interval within budget
    assert stretched_interval(10, 0.5, 0.1, None) == 10
    assert stretched_interval(10, 0.5, 0.0, 0.02) == 10  # step time unknown: base


def test_evaluation_cost_is_not_decided_by_one_slow_sample():
    assert evaluation_cost([]) is None
    assert evaluation_cost([0.3]) == 0.3  # all there is
    assert evaluation_cost([0.3, 0.04]) == 0.04  # a slow first sample does not stretch the interval alone
    assert evaluation_cost([0.04, 0.3, 0.05]) == 0.05  # one spike among three: the median
    assert evaluation_cost([0.04, 0.3, 0.29, 0.31]) == 0.3  # the last three: evaluations became costlier


def test_freeze_saving_is_the_backward_share_of_the_module_flops():
    assert freeze_saving_seconds(0.3, 0.1, 1000) == pytest.approx(BACKWARD_SHARE * 0.3 * 100.0)
    assert freeze_saving_seconds(0.3, 0.1, -5) == 0.0
    assert freeze_saving_seconds(0.0, 0.1, 1000) == 0.0


def _held_release(held, step, next_step, rebuild=10.0):
    return releases_held_freezes(
        held, step=step, step_seconds=0.4, total_steps=900, rebuild_seconds=rebuild, next_freeze_step=next_step
    )


def test_held_freezes_take_effect_when_holding_costs_a_rebuild():
    # Saving 2/3 x share x 0.4 s per step; a rebuild costs 10 s.
    stem = [(0.03, 100)]
    assert not _held_release(stem, 200, next_step=223)  # forgone 0.8 s, 0.2 s more until the next can join
    assert _held_release(stem, 200, next_step=None, rebuild=5.0)  # nothing can join: at once (7.0 s > 5 s to the end)
    assert not _held_release(stem, 200, next_step=None)  # ... unless it cannot repay the rebuild alone (7.0 s)
    assert not _held_release(stem, 200, next_step=950)  # the next comes after the end: as alone
    # Ski rental: released once the saving forgone since each was decided reaches a rebuild.
    two = [(0.03, 100), (0.3, 300)]
    forgone = lambda step: sum(freeze_saving_seconds(s, 0.4, step - d) for s, d in two)  # noqa: E731
    release = next(step for step in range(300, 900) if _held_release(two, step, next_step=step + 1))
    assert forgone(release) >= 10.0 > forgone(release - 1)
    # ... or when the soonest the next can join is a rebuild's worth away (3 epochs of 23 steps here).
    assert _held_release([(0.6, 300)], 300, next_step=369)
    assert not _held_release([(0.6, 300)], 300, next_step=323)


def test_saving_scale_is_the_realized_share_of_the_estimate():
    assert saving_scale(0.5, 0.4, 0.3) == pytest.approx(1.0)  # 20% realized of 2/3 x 30%
    assert saving_scale(0.5, 0.45, 0.3) == pytest.approx(0.5)
    assert saving_scale(0.5, 0.55, 0.3) == 0.0  # slower after the freeze: nothing realized
    assert saving_scale(0.5, 0.1, 0.3) == 1.5  # forward skipped too: capped at all three passes
    assert saving_scale(0.5, 0.45, 0.05) is None  # 3.3% estimated: below the noise of step times


@pytest.mark.parametrize(
    "share,step,earliest,eval_s,freeze_s,expected",
    [
        (0.2, 100, 180, 0.5, 0.0, True),  # 820 steps x 0.1 s x 2/3 x 0.2 = 10.9 s > 4 x 0.5 s
        (0.2, 900, 980, 0.5, 0.0, False),  # 20 steps left: 0.27 s < 2 s of evaluations
        (0.2, 100, 180, 0.5, 20.0, False),  # the rebuild alone costs more than the saving
        (0.001, 100, 180, 0.5, 0.0, False),  # a module with almost no FLOPs never repays
        (0.9, 100, 1000, 0.0, 0.0, False),  # cannot freeze before the end
    ],
)
def test_worth_evaluating(share, step, earliest, eval_s, freeze_s, expected):
    assert (
        worth_evaluating(
            flops_shares=[share],
            step_seconds=0.1,
            step=step,
            total_steps=1000,
            earliest_freeze_step=earliest,
            interval=20,
            evaluation_seconds=eval_s,
            freeze_seconds=freeze_s,
        )
        is expected
    )


def _brute_force_best_case(shares, step_seconds, total_steps, earliest, interval, rebuild):
    """Every way of freezing a prefix of the modules in consecutive groups, each when its last can."""
    import itertools

    best = 0.0
    for count in range(1, len(shares) + 1):
        if earliest + (count - 1) * interval >= total_steps:
            break
        for cuts in itertools.product([False, True], repeat=count - 1):
            ends = [j for j, cut in enumerate(cuts) if cut] + [count - 1]
            saving, start = 0.0, 0
            for end in ends:
                left = total_steps - (earliest + end * interval)
                saving += sum(freeze_saving_seconds(s, step_seconds, left) for s in shares[start : end + 1]) - rebuild
                start = end + 1
            best = max(best, saving)
    return best


@pytest.mark.parametrize("seed", range(5))
def test_best_case_with_shared_rebuilds_is_the_best_grouping(seed):
    rng = np.random.default_rng(seed)
    shares = list(rng.dirichlet(np.ones(7)) * 0.8)
    kw = dict(step_seconds=0.4, total_steps=920, earliest_freeze_step=400, interval=40)
    for rebuild in (0.0, 3.0, 8.0, 30.0):
        grouped = best_case_saving_seconds(shares, freeze_seconds=rebuild, shared_rebuilds=True, **kw)
        one_each = best_case_saving_seconds(shares, freeze_seconds=rebuild, **kw)
        expected = _brute_force_best_case(shares, 0.4, 920, 400, 40, rebuild)
        assert grouped == pytest.approx(expected)
        assert grouped >= one_each - 1e-9
    # Small modules that cannot repay a rebuild each may repay one together.
    assert best_case_saving_seconds([0.04] * 10, freeze_seconds=8.0, **kw) == 0.0
    assert best_case_saving_seconds([0.04] * 10, freeze_seconds=8.0, shared_rebuilds=True, **kw) > 0.0


def test_worth_evaluating_counts_setup_still_to_pay():
    """A one-off cost not paid yet (Egeria's reference build) must be repaid too; 0 once it is sunk."""
    kwargs = dict(flops_shares=[0.2], step_seconds=0.1, step=100, total_steps=1000, earliest_freeze_step=180,
                  interval=20, evaluation_seconds=0.5)
    saving = best_case_saving_seconds([0.2], step_seconds=0.1, total_steps=1000, earliest_freeze_step=180,
                                      interval=20)  # 10.9 s against 4 evaluations of 0.5 s
    assert worth_evaluating(**kwargs, setup_seconds=saving - 2.0 - 0.01)
    assert not worth_evaluating(**kwargs, setup_seconds=saving - 2.0 + 0.01)


def test_best_case_counts_the_modules_a_small_front_opens_the_way_to():
    kwargs = dict(step_seconds=0.1, total_steps=1000, earliest_freeze_step=100, interval=10, freeze_seconds=1.0)
    stem_alone = best_case_saving_seconds([0.01], **kwargs)
    assert stem_alone == 0.0  # 0.6 s saved < 1 s rebuild
    with_block = best_case_saving_seconds([0.01, 0.3], **kwargs)
    assert with_block == pytest.approx(
        freeze_saving_seconds(0.01, 0.1, 900) + freeze_saving_seconds(0.3, 0.1, 890) - 2.0
    )
    # A module behind that cannot repay its own rebuild is left out of the best case.
    assert best_case_saving_seconds([0.01, 0.3, 0.0001], **kwargs) == pytest.approx(with_block)
    # Near the end nothing repays its rebuild; freezes after the end count for nothing.
    assert best_case_saving_seconds([0.3, 0.3], **{**kwargs, "earliest_freeze_step": 995}) == 0.0
    assert best_case_saving_seconds([0.3, 0.3], **{**kwargs, "earliest_freeze_step": 1000}) == 0.0


def test_egeria_policy_knows_how_soon_it_can_freeze():
    policy = EgeriaPolicy(4, window=3, patience=2, bootstrap_steps=0)
    # window of 3 to fill, then 2 converged evaluations (the filling one counts).
    assert policy.evaluations_to_freeze() == 4
    assert policy.earliest_freeze_step(100, 10) == 140
    policy.observe(10, [1.0, 1.0, 1.0, 1.0])
    assert policy.evaluations_to_freeze() == 3
    policy.observe(20, [1.0, 1.0, 1.0, 1.0])
    policy.observe(30, [1.0, 1.0, 1.0, 1.0])  # window full, slope 0: stable 1
    assert policy.evaluations_to_freeze() == 1
    assert policy.observe(40, [1.0, 1.0, 1.0, 1.0]).freeze == (0,)
    late = EgeriaPolicy(4, window=3, patience=2, bootstrap_steps=500)
    assert late.earliest_freeze_step(100, 10) == 500
    capped = EgeriaPolicy(4, max_frozen_fraction=0.25)
    capped.num_frozen = 1
    assert capped.evaluations_to_freeze() is None and capped.earliest_freeze_step(0, 10) is None


def test_policy_waits_for_unmeasured_modules_and_skips_an_unmeasured_candidate():
    policy = EgeriaPolicy(4, window=2, patience=1, tolerance=1.0)
    policy.observe(1, [1.0, 1.0, math.nan, math.nan])
    assert policy.window_of(2) == []  # not measured: its window waits
    skipped = policy.observe(2, [math.nan, 1.0, 1.0, 1.0])
    assert skipped.skipped and policy.window_of(1) == [1.0]


# ------------------------------------------------ reduced evaluation = full


def _recorded():
    with open(RECORDED) as f:
        data = json.load(f)
    return [
        (workload, run, data["bootstrap_steps"][workload])
        for workload, runs in data["runs"].items()
        for run in runs
    ]


@pytest.mark.parametrize("workload,run,bootstrap", _recorded(), ids=lambda v: str(v) if isinstance(v, str) else "")
def test_reduced_evaluation_gives_the_recorded_freezes(workload, run, bootstrap):
    """Runs that measured every module, replayed with only what EgeriaCallback now measures.

    With the candidate and the two modules behind it (the callback's
    lookahead), the freezes are the recorded ones, step for step. With one
    module behind, a module that froze within `window` evaluations of the
    one before it (mnist1d seeds 0 and 2: module 2, two evaluations after
    module 1) has too short a window then; the recording, which has no
    values of a frozen module, cannot say when it would have frozen.
    """
    make = lambda: EgeriaPolicy(run["num_modules"], bootstrap_steps=bootstrap)  # noqa: E731 - defaults of the recording
    recorded = [tuple(f) for f in run["freezes"]]
    assert replay(make(), run["history"]) == recorded  # the replay itself is faithful
    assert replay(make(), run["history"], lookahead=2) == recorded
    one_behind = replay(make(), run["history"], lookahead=1)
    assert one_behind == recorded[: len(one_behind)]


def test_level_criterion_freezes_the_geometrically_falling_front_of_the_recorded_transformer():
    """charlm's front plasticity falls 20-45% per evaluation all run: the slope test froze module 0 in one
    seed of three; with `level=0.02` module 0 freezes in every seed, and never before its value has stayed
    at or under 2% of its peak for `patience` evaluations."""
    with open(RECORDED) as f:
        data = json.load(f)
    bootstrap = data["bootstrap_steps"]["charlm"]
    for run in data["runs"]["charlm"]:
        slope_only = replay(EgeriaPolicy(run["num_modules"], bootstrap_steps=bootstrap), run["history"])
        assert slope_only == [tuple(f) for f in run["freezes"]]
        policy = EgeriaPolicy(run["num_modules"], bootstrap_steps=bootstrap, level=0.02)
        with_level = replay(policy, run["history"], lookahead=2)
        assert with_level and with_level[0][0] == 0
        if with_level[0] not in slope_only:  # frozen by the level test: its last 2 values are low
            module0 = [e["plasticity"][0] for e in run["history"] if e["step"] <= with_level[0][1]]
            assert all(v <= 0.02 * max(module0) for v in module0[-2:])
        assert len(with_level) >= len(slope_only)
        state = policy.get_state()
        again = EgeriaPolicy(run["num_modules"], bootstrap_steps=bootstrap, level=0.02)
        again.set_state(state)
        assert again.get_state() == state
    with pytest.raises(ValueError, match="level"):
        EgeriaPolicy(4, level=1.5)


# ------------------------------------------------------------ the stop rule


class _NeverConverges(FreezingPolicy):
    def observe(self, step, values=(), learning_rate=None):
        self.evaluations += 1
        return Decision()

    def earliest_freeze_step(self, step, interval):
        return step + interval


class _CostlyProbe(FreezingCallback):
    """A policy whose every evaluation costs 0.3 s: far more than a tiny model's step can repay."""

    def _make_policy(self):
        return _NeverConverges(len(self.modules))

    def _measure(self):
        time.sleep(0.3)
        return [1.0] * len(self.modules)


def test_evaluation_stops_when_the_saving_cannot_repay_it(mnist1d_small):
    x, y, _, _ = mnist1d_small
    model = compile_model(small_resnet())
    callback = _CostlyProbe(eval_every=4, verbose=0)
    model.fit(x[:1024], y[:1024], batch_size=32, epochs=3, callbacks=[callback], verbose=0)
    summary = callback.summary()
    scheduled = 3 * 32 // 4
    # Either reason: within the 1% budget the next evaluation would come after the end, or it would not repay.
    assert summary["evaluation_stopped"] is not None
    assert "cannot freeze before the end" in summary["evaluation_stopped"] or "would save less" in summary[
        "evaluation_stopped"
    ]
    # Stopped after the first estimate (one-off-free evaluation), long before the schedule's 24.
    assert summary["evaluations"] <= 2 < scheduled
    assert summary["status"] == "active"  # stepping back is not a failure


def test_no_budget_evaluates_on_schedule(mnist1d_small):
    x, y, _, _ = mnist1d_small
    model = compile_model(small_resnet())
    callback = _CostlyProbe(eval_every=16, overhead_budget=None, verbose=0)
    callback._measure = lambda: [1.0] * len(callback.modules)  # free evaluations; the schedule alone counts
    model.fit(x[:1024], y[:1024], batch_size=32, epochs=2, callbacks=[callback], verbose=0)
    summary = callback.summary()
    assert summary["evaluation_stopped"] is None
    assert summary["evaluations"] == 2 * 32 // 16
    assert summary["eval_interval"] == 16


class _FreezesAtEvaluations(FreezingPolicy):
    """Freezes module 0 at the 1st evaluation and module 1 at the 3rd (or at the evaluations `at`)."""

    def __init__(self, num_modules, at=(1, 3), **kwargs):
        super().__init__(num_modules, **kwargs)
        self.at = at

    def observe(self, step, values=(), learning_rate=None):
        self.evaluations += 1
        if self.evaluations in self.at:
            self.num_frozen += 1
            return Decision(freeze=(self.num_frozen - 1,), reason=f"evaluation {self.evaluations}")
        return Decision()


class _SmallFrontFreezes(FreezingCallback):
    """Free evaluations; a train-function rebuild costs what freezing module 0 and half of module 1 saves.

    The policy settles after module 1: nothing can join a freeze held then.
    """

    def __init__(self, holds: bool, **kwargs):
        super().__init__(freeze_at="step", **kwargs)
        self.HOLDS_UNPAID_FREEZES = holds
        self.notified = []

    def _make_policy(self):
        return _FreezesAtEvaluations(len(self.modules), max_frozen_fraction=2 / len(self.modules))

    def _setup(self, first_fit):
        self.engine.listeners.append(
            lambda kind, indices: self.notified.append((kind, indices, self._step, self._front_weights()))
        )

    def _front_weights(self):
        return [v.numpy().copy() for layer in self.modules[0].layers for v in layer.weights]

    def _measure(self):
        self.measured_front = self.measured_front if self.evaluations > 2 else self._front_weights()
        return [1.0] * len(self.modules)

    def _repays(self, *args, **kwargs):
        return True  # not the stop rule under test: evaluate on schedule

    def _rebuild_stand_in(self):
        shares = [m.flops / sum(n.flops for n in self.modules) for m in self.modules]
        return freeze_saving_seconds(shares[0] + shares[1] / 2, self._step_seconds(), self.total_steps - self._step)


@pytest.mark.parametrize("holds", [True, False], ids=["held", "peer"])
def test_a_freeze_that_cannot_repay_its_rebuild_is_held_until_the_next(mnist1d_small, holds):
    x, y, _, _ = mnist1d_small
    model = compile_model(small_resnet())
    callback = _SmallFrontFreezes(holds, eval_every=4, overhead_budget=0.9, verbose=0)  # on schedule
    model.fit(x[:1024], y[:1024], batch_size=32, epochs=2, callbacks=[callback], verbose=0)
    freezes = [(indices, step) for kind, indices, step, _ in callback.notified if kind == "freeze"]
    events = {e["module"]: e for e in callback.events}
    first, third = callback.history[0]["step"], callback.history[2]["step"]
    if not holds:  # the peers' behaviour: each decision at once, one rebuild each
        assert freezes == [((0,), first), ((1,), third)]
        return
    # Module 0's freeze would not repay a rebuild: held, then frozen with module 1's (the last), in one rebuild.
    assert freezes == [((0, 1), third)]
    assert events[0]["step"] == events[1]["step"] == third and events[0]["decided_step"] == first < third
    assert "decided_step" not in events[1]
    assert callback.summary()["held_modules"] == []
    assert callback.summary()["train_function_rebuilds"] == 2  # the freeze, and the restore at train end
    # Held, module 0 trained on (from the 2nd evaluation to its freeze at the 3rd); frozen, it stayed put.
    at_freeze = callback.notified[0][3]
    assert any(not np.array_equal(a, b) for a, b in zip(callback.measured_front, at_freeze))
    assert all(np.array_equal(a, b) for a, b in zip(at_freeze, callback._front_weights()))


class _StemFreezesAlone(_SmallFrontFreezes):
    """Module 0 freezes at the 1st evaluation, nothing after; a rebuild costs module 0's saving over 10 steps."""

    def _make_policy(self):
        return _FreezesAtEvaluations(len(self.modules), at=(1,))

    def _rebuild_stand_in(self):
        share = self.modules[0].flops / sum(m.flops for m in self.modules)
        return freeze_saving_seconds(share, self._step_seconds(), 10)


def test_a_held_freeze_takes_effect_alone_once_holding_it_cost_a_rebuild(mnist1d_small):
    x, y, _, _ = mnist1d_small
    model = compile_model(small_resnet())
    callback = _StemFreezesAlone(True, eval_every=4, overhead_budget=0.9, verbose=0)
    model.fit(x[:1024], y[:1024], batch_size=32, epochs=2, callbacks=[callback], verbose=0)
    freezes = [(indices, step) for kind, indices, step, _ in callback.notified if kind == "freeze"]
    steps = [entry["step"] for entry in callback.history]
    # Decided at the 1st evaluation (step 4), nothing joins; forgone 8 steps' saving at the 3rd, 12 at the 4th (>= 10).
    assert freezes == [((0,), steps[3])] and steps[3] - steps[0] == 12
    assert callback.events[0]["decided_step"] == steps[0]


def test_step_times_before_and_after_a_freeze_scale_the_saving_estimates():
    callback = _SmallFrontFreezes(True, verbose=0)
    callback._base_phase = [0.0, 10.0, 20]  # 20 steps of 0.5 s with nothing frozen
    callback._phase = [0.3, 0.0, 0]
    for _ in range(19):
        callback._time_step(0.45, 1)
    assert callback._saving_scale is None  # 19 steps timed: not yet
    callback._time_step(0.45, 1)  # 10% faster of the 20% that 30% of the FLOPs should give
    assert callback._saving_scale == pytest.approx(0.5)
    assert callback._saving_shares([0.2, 0.4]) == pytest.approx([0.1, 0.2])


def test_a_held_freeze_counts_in_the_stop_rule_and_is_saved_with_the_state(tmp_path):
    callback = _SmallFrontFreezes(True, backup_dir=str(tmp_path), verbose=0)
    callback.modules = [type("M", (), {"flops": f, "index": i})() for i, f in enumerate([1.0, 3.0, 4.0, 2.0])]
    callback.policy = _FreezesAtEvaluations(4)
    callback.policy.num_frozen = 1
    callback._held = [((0,), "evaluation 1", {"decided_step": 4})]
    # Module 0 is held: it freezes with the candidate (module 1), so their shares count together.
    assert callback._candidate_flops_shares() == [0.4, 0.4]
    assert callback._snapshot()["held"] == [[[0], "evaluation 1", {"decided_step": 4}]]


def test_overhead_budget_is_validated():
    for bad in (0, 1.0, -0.1, "2%", True):
        with pytest.raises(ValueError, match="overhead_budget"):
            tf_hwopt.EgeriaCallback(overhead_budget=bad)


def test_egeria_measures_only_the_front_and_builds_its_reference_on_demand(mnist1d_small):
    x, y, _, _ = mnist1d_small
    model = compile_model(small_resnet())
    egeria = tf_hwopt.EgeriaCallback(
        probe_size=64, eval_every=4, window=2, patience=1, tolerance=1e6, bootstrap_steps=0,
        max_frozen_fraction=0.8, overhead_budget=None, asynchronous=False, verbose=0, freeze_at="step",
    )
    model.fit(x[:512], y[:512], batch_size=32, epochs=2, callbacks=[egeria], verbose=0)
    num_modules = len(egeria.modules)
    for entry in egeria.history:
        measured = [i for i, v in enumerate(entry["plasticity"]) if v is not None]
        k = entry["frozen"]
        assert measured == list(range(k, min(k + 3, egeria.policy.max_frozen)))
    assert egeria.num_frozen == egeria.policy.max_frozen == 4
    summary = egeria.summary()
    assert summary["reference_covered_modules"] <= num_modules
    assert np.isfinite(summary["evaluation_seconds"]) and summary["evaluation_seconds"] > 0
    # The step after a freeze ran the rebuilt train function: its extra time is the rebuild's cost.
    assert summary["rebuild_seconds"] is not None and summary["rebuild_seconds"] >= 0.0


def test_egeria_steps_back_before_building_the_reference_when_evaluating_cannot_pay(mnist1d_small):
    """A small model trained for 64 steps: one evaluation costs several steps, so within the 2%
    budget the next ones would come after the end. Egeria steps back at its first evaluation,
    before paying for the reference model, and says why."""
    x, y, _, _ = mnist1d_small
    model = compile_model(small_resnet())
    egeria = tf_hwopt.EgeriaCallback(eval_every=8, verbose=0)
    model.fit(x[:1024], y[:1024], batch_size=32, epochs=2, callbacks=[egeria], verbose=0)
    summary = egeria.summary()
    assert summary["evaluation_stopped"].startswith("stepped back at step 8, before building the reference")
    assert egeria.reference is None and summary["reference_build_seconds"] == 0.0
    assert summary["status"] == "active" and summary["evaluations"] == 1 and summary["frozen_modules"] == 0


@pytest.mark.parametrize("build_per_trace", [0.0, 1e6])
def test_egeria_preflight_counts_the_reference_build(mnist1d_small, monkeypatch, build_per_trace):
    """With a generous budget Egeria builds its reference; when the build (estimated from the
    prefix reader's trace) could not be repaid, it steps back before building and says so."""
    import tf_hwopt.egeria.callback as egeria_callback

    monkeypatch.setattr(egeria_callback, "_BUILD_PER_TRACE", build_per_trace)
    # Free rebuilds: the pre-flight alone is under test (a tiny model's rebuild, a third of its
    # first step, would make the stop rule end evaluation soon after).
    monkeypatch.setattr(egeria_callback.EgeriaCallback, "_rebuild_stand_in", lambda self: 0.0)
    x, y, _, _ = mnist1d_small
    model = compile_model(small_resnet())
    egeria = tf_hwopt.EgeriaCallback(eval_every=4, overhead_budget=0.9, bootstrap_steps=0, verbose=0)
    model.fit(x[:1024], y[:1024], batch_size=32, epochs=8, callbacks=[egeria], verbose=0)
    stopped = egeria.summary()["evaluation_stopped"] or ""
    if build_per_trace:
        assert stopped.startswith("stepped back at step 4, before building the reference")
        assert "reference build (about" in stopped and egeria.reference is None
    else:
        assert not stopped.startswith("stepped back") and egeria.reference is not None


def _fit_seeing_the_first_epochs_last_batch(egeria, mnist1d_small, see) -> list:
    """Fits the small ResNet for 8 epochs of 32 steps with `egeria`; returns `[see()]` taken at step
    32, the first epoch's last batch, before its end (and before any epoch-end work)."""
    x, y, _, _ = mnist1d_small
    model = compile_model(small_resnet())
    seen = []

    class _LastBatchOfFirstEpoch(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if egeria._step == 32:
                seen.append(see())

    model.fit(x[:1024], y[:1024], batch_size=32, epochs=8, callbacks=[egeria, _LastBatchOfFirstEpoch()], verbose=0)
    return seen


def _background_builds_done_after(monkeypatch, polls: int) -> None:
    """A background reference build reports itself unfinished for its first `polls` polls, then waits
    for its thread and reports done: when it is taken no longer depends on the host's speed."""
    from tf_hwopt.egeria.reference import ReferenceBuild

    seen = {}

    def done(self):
        seen[id(self)] = seen.get(id(self), 0) + 1
        if seen[id(self)] <= polls:
            return False
        self.cancel()  # waits for the thread
        return self._future.done()

    monkeypatch.setattr(ReferenceBuild, "done", done)


@pytest.mark.parametrize("second_trace_slow", [False, True])
@pytest.mark.parametrize("decides", ["step_back", "deferral"])
def test_a_decision_resting_on_a_slow_first_trace_is_confirmed_by_a_second(
    mnist1d_small, monkeypatch, decides, second_trace_slow
):
    """A busy host can make the prefix reader's first trace ten times slower than usual. Where the
    build estimated from it decides (a step-back where a free build would pay, or a build put off
    to the epoch end), a fresh reader is traced again and the faster trace counts: Egeria builds
    its reference, at once, unless the second trace is slow too."""
    import tf_hwopt.egeria.callback as egeria_callback

    traced = []

    def seconds(reader, x):  # the first call of a reader is its trace: 1000 s where slow, free otherwise
        reader(x)
        if id(reader) in traced:
            return 0.0
        traced.append(id(reader))
        return 1e3 if len(traced) == 1 or second_trace_slow else 0.0

    monkeypatch.setattr(egeria_callback, "_seconds", seconds)
    monkeypatch.setattr(egeria_callback.EgeriaCallback, "_rebuild_stand_in", lambda self: 0.0)
    if decides == "deferral":  # any build pays: only whether it waits for the epoch end is left to decide
        monkeypatch.setattr(egeria_callback.EgeriaCallback, "_repays", lambda self, *args, **kwargs: True)
    egeria = tf_hwopt.EgeriaCallback(eval_every=4, overhead_budget=0.9, bootstrap_steps=0, verbose=0)
    built_in_first_epoch = _fit_seeing_the_first_epochs_last_batch(
        egeria, mnist1d_small, lambda: egeria.reference is not None
    )
    stopped = egeria.summary()["evaluation_stopped"] or ""
    assert len(traced) == 2  # the decision was checked with a second trace
    if decides == "step_back" and second_trace_slow:
        assert stopped.startswith("stepped back at step 4") and "reference build (about 15000.00 s)" in stopped
        assert egeria.reference is None
    else:
        assert not stopped.startswith("stepped back") and egeria.reference is not None
        assert built_in_first_epoch == [not second_trace_slow]


@pytest.mark.parametrize("when", ["at_once", "background", "epoch_end_long", "epoch_end_clone", "tfmot_fails"])
def test_a_short_build_is_done_at_once_a_long_one_meanwhile_and_neither_gives_a_cost_estimate_until_done(
    mnist1d_small, monkeypatch, when
):
    """A reference the pre-flight estimates at most `_MID_EPOCH_BUILD_SECONDS` to build is built
    at once, on the training thread. A longer one that should end before the epoch does is built on
    a background thread while the steps go on (TFMOT's path) and taken at the first evaluation
    after it is done, mid-epoch; one that should not, and the int8-weights clone (which reads the
    training model), wait for the epoch end, as does the clone where TFMOT's path failed in the
    background. The evaluations due while a build runs or waits measure nothing, so they give the
    stop rule no (zero) cost."""
    import threading

    import tf_hwopt.egeria.callback as egeria_callback
    import tf_hwopt.egeria.reference as reference

    # The estimate is 0 s (free build, as above; or 1e9 s, and any build pays): the thresholds decide.
    monkeypatch.setattr(egeria_callback, "_BUILD_PER_TRACE", 1e9 if when == "epoch_end_long" else 0.0)
    monkeypatch.setattr(egeria_callback, "_MID_EPOCH_BUILD_SECONDS", 1.5 if when == "at_once" else -1.0)
    monkeypatch.setattr(egeria_callback.EgeriaCallback, "_rebuild_stand_in", lambda self: 0.0)
    monkeypatch.setattr(egeria_callback.EgeriaCallback, "_repays", lambda self, *args, **kwargs: True)
    _background_builds_done_after(monkeypatch, polls=3)
    threads = []
    real_init = reference._TfmotReference.__init__

    def init(self, *args, **kwargs):
        threads.append(threading.current_thread() is threading.main_thread())
        if when == "tfmot_fails":
            raise reference._NotRebuildable("a layer TFMOT cannot take")
        real_init(self, *args, **kwargs)

    monkeypatch.setattr(reference._TfmotReference, "__init__", init)
    egeria = tf_hwopt.EgeriaCallback(eval_every=2, overhead_budget=0.9, bootstrap_steps=0, verbose=0,
                                     reference="int8-weights" if when == "epoch_end_clone" else "auto")
    x, y, _, _ = mnist1d_small
    model = compile_model(small_resnet())
    seen = []  # per step of the first epoch: (built, in flight, cost samples, evaluations)

    class _FirstEpoch(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if egeria._step <= 32:
                seen.append((egeria.reference is not None, egeria._build_in_flight is not None,
                             len(egeria._evaluation_costs), egeria.evaluations))

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(x[:1024], y[:1024], batch_size=32, epochs=8, callbacks=[egeria, _FirstEpoch()], verbose=0)
    fallbacks = [w for w in caught if "clone with int8 weights" in str(w.message)]
    assert seen[-1][3] >= 10  # by step 32: the pre-flight, then one evaluation every 2 steps
    waiting = [costs for built, _, costs, _ in seen if not built]
    assert waiting and not any(waiting)  # no cost sample before the reference exists
    assert egeria.reference is not None  # built at the first epoch end at the latest
    if when == "tfmot_fails":  # tried in the background; the clone built at the epoch end, with one warning
        assert threads == [False] and any(in_flight for _, in_flight, _, _ in seen) and not seen[-1][0]
        assert egeria.reference.path == "int8-weights" and "a layer TFMOT cannot take" in egeria.reference.reason
        assert len(fallbacks) == 1
        return
    assert fallbacks == []
    if when.startswith("epoch_end"):
        assert not seen[-1][0] and not any(in_flight for _, in_flight, _, _ in seen)
        return
    assert seen[-1][0] and seen[-1][2] > 0  # built mid-epoch; real evaluations followed
    if when == "at_once":
        assert threads == [True] and not any(in_flight for _, in_flight, _, _ in seen)
    else:
        assert threads == [False] and egeria.reference.path == "tfmot"
        in_flight = [evaluations for _, flying, _, evaluations in seen if flying]
        assert max(in_flight) - min(in_flight) >= 3  # evaluations went on while it was built (3 polls)


def test_a_fit_that_ends_before_its_background_build_drops_it_and_the_next_fit_starts_afresh(
    mnist1d_small, monkeypatch
):
    """A background build still running when `fit` ends is waited for and dropped: no thread is left
    behind, nothing half-built is kept, and the same callback builds its reference in the next `fit`."""
    import threading

    import tf_hwopt.egeria.callback as egeria_callback
    from tf_hwopt.egeria.reference import ReferenceBuild

    monkeypatch.setattr(egeria_callback, "_BUILD_PER_TRACE", 0.0)
    monkeypatch.setattr(egeria_callback, "_MID_EPOCH_BUILD_SECONDS", -1.0)  # every build in the background
    monkeypatch.setattr(egeria_callback.EgeriaCallback, "_rebuild_stand_in", lambda self: 0.0)
    monkeypatch.setattr(egeria_callback.EgeriaCallback, "_repays", lambda self, *args, **kwargs: True)
    _background_builds_done_after(monkeypatch, polls=10**9)  # never finished within the first fit
    x, y, _, _ = mnist1d_small
    model = compile_model(small_resnet())
    egeria = tf_hwopt.EgeriaCallback(eval_every=2, overhead_budget=0.9, bootstrap_steps=0, verbose=0)
    started = []
    real_init = ReferenceBuild.__init__

    def init(self, *args, **kwargs):
        started.append(egeria._step)
        real_init(self, *args, **kwargs)

    monkeypatch.setattr(ReferenceBuild, "__init__", init)
    model.fit(x[:512], y[:512], batch_size=32, epochs=3, callbacks=[egeria], verbose=0)
    assert len(started) == 1 and egeria.reference is None and egeria._build_in_flight is None
    assert not [t for t in threading.enumerate() if t.name.startswith("egeria-reference-build")]
    assert egeria.summary()["status"] != "disabled"

    _background_builds_done_after(monkeypatch, polls=0)  # done when polled
    model.fit(x[:512], y[:512], batch_size=32, epochs=3, callbacks=[egeria], verbose=0)
    assert len(started) == 2 and egeria.reference is not None and egeria.reference.path == "tfmot"


def test_budget_docstring_examples_hold():
    """The examples in the cost/benefit functions' docstrings are the numbers users read: keep them true."""
    import doctest

    import tf_hwopt.freezing.budget as budget

    result = doctest.testmod(budget)
    assert result.attempted >= 6 and result.failed == 0
