"""The peer policies: FreezeOut's schedule and gradient-norm freezing."""

import math

import numpy as np
import pytest

import tf_hwopt
from conftest import FreezeWatcher, assert_frozen_bit_identical_and_rest_trained, compile_model, small_resnet
from tf_hwopt.egeria import GradientNormPolicy, freezeout_schedule, gradient_norm_change_rate


@pytest.mark.parametrize(
    "progress,expected",
    [(0.0, 0), (0.49, 0), (0.5, 0), (0.6, 0), (0.625, 1), (0.75, 2), (0.874, 2), (0.875, 3), (1.0, 4), (1.2, 4)],
)
def test_freezeout_schedule_is_linear_after_start(progress, expected):
    assert freezeout_schedule(progress, 4, freeze_start=0.5, freeze_level=1.0) == expected


def test_freezeout_schedule_level_and_edges():
    assert freezeout_schedule(1.0, 4, 0.5, 0.5) == 2
    assert freezeout_schedule(0.0, 4, 0.0, 1.0) == 0
    assert freezeout_schedule(1.0, 4, 1.0, 1.0) == 4
    # Monotone in progress.
    values = [freezeout_schedule(p / 100, 7, 0.3, 0.8) for p in range(101)]
    assert values == sorted(values) and values[-1] == 5


def test_gradient_norm_change_rate():
    assert gradient_norm_change_rate(2.0, 1.5) == 0.25
    assert gradient_norm_change_rate(2.0, 2.5) == 0.25
    assert gradient_norm_change_rate(math.nan, 1.0) == math.inf
    assert gradient_norm_change_rate(0.0, 1.0) == math.inf


def test_gradient_norm_policy_on_synthetic_series():
    policy = GradientNormPolicy(4, threshold=0.05, patience=2, bootstrap_steps=300, max_frozen_fraction=1.0)
    decisions = []
    for i in range(40):
        m0 = 1.0 + 2.0 * math.exp(-i / 2)  # settles quickly
        m1 = 1.0 + 2.0 * math.exp(-i / 8)  # settles later
        m2 = 1.0 + (i % 2)  # oscillates by 100%: never calm
        d = policy.observe(100 * i, [m0, m1, m2, 1.0])
        decisions += [(100 * i, k) for k in d]
    assert [k for _, k in decisions] == [0, 1]
    step0, step1 = decisions[0][0], decisions[1][0]
    assert step0 >= 300 and step1 > step0
    rate = abs((1 + 2 * math.exp(-step1 / 100 / 8)) - (1 + 2 * math.exp(-(step1 / 100 - 1) / 8)))
    assert rate / (1 + 2 * math.exp(-(step1 / 100 - 1) / 8)) < 0.05


def test_gradient_norm_policy_never_freezes_noisy_or_nan():
    policy = GradientNormPolicy(3, threshold=0.05, patience=1)
    rng = np.random.RandomState(0)
    for i in range(50):
        assert policy.observe(i, [1.0 + rng.uniform(0.2, 1.0) * (-1) ** i, 1.0, 1.0]) == ()
        assert policy.observe(i, [math.nan, 1.0, 1.0]) == ()


@pytest.mark.parametrize(
    "cls,kwargs,match",
    [
        (tf_hwopt.FreezeOutCallback, dict(freeze_start=1.5), "freeze_start"),
        (tf_hwopt.FreezeOutCallback, dict(freeze_level=0), "freeze_level"),
        (tf_hwopt.GradientNormFreezeCallback, dict(threshold=0), "threshold"),
        (tf_hwopt.GradientNormFreezeCallback, dict(patience=0), "patience"),
        (tf_hwopt.GradientNormFreezeCallback, dict(eval_every=-1), "eval_every"),
    ],
)
def test_bad_arguments(cls, kwargs, match):
    with pytest.raises(ValueError, match=match):
        cls(**kwargs)


def test_freezeout_callback_follows_the_schedule(mnist1d_small):
    x, y, _, _ = mnist1d_small
    model = compile_model(small_resnet())
    cb = tf_hwopt.FreezeOutCallback(freeze_start=0.5, freeze_level=1.0, verbose=0)
    watcher = FreezeWatcher(cb)
    model.fit(x[:320], y[:320], batch_size=32, epochs=4, callbacks=[cb, watcher], verbose=0)  # 40 steps
    steps = {e["module"]: e["step"] for e in cb.events}
    # 4 modules + head: 4 freezable; module k freezes at 50% + k/4 * 50% of 40 steps.
    assert steps == {0: 25, 1: 30, 2: 35, 3: 40}
    assert cb.summary()["frozen_modules"] == 4
    assert_frozen_bit_identical_and_rest_trained(cb, watcher)


def test_gradient_norm_callback_freezes_on_real_gradients(mnist1d_small):
    x, y, _, _ = mnist1d_small
    model = compile_model(small_resnet())
    cb = tf_hwopt.GradientNormFreezeCallback(
        batch_size=64, eval_every=4, threshold=10.0, patience=1, bootstrap_steps=8, max_frozen_fraction=0.5, verbose=0
    )
    watcher = FreezeWatcher(cb)
    model.fit(x[:320], y[:320], batch_size=32, epochs=3, callbacks=[cb, watcher], verbose=0)
    assert cb.summary()["frozen_modules"] == 2
    assert [e["module"] for e in cb.events] == [0, 1]
    assert all(h["grad_norms"][0] > 0 for h in cb.history[:1])
    # After module 0 froze, its gradient norm is no longer computed (zero).
    after = [h for h in cb.history if h["frozen"] >= 1 and h["step"] > cb.events[0]["step"]]
    assert after and all(h["grad_norms"][0] == 0.0 for h in after)
    assert_frozen_bit_identical_and_rest_trained(cb, watcher)
