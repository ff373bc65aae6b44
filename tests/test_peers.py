"""The peer policies: FreezeOut's schedule and gradient-norm freezing."""

import math

import keras
import numpy as np
import pytest

import tf_hwopt
from conftest import (
    CrashAfterFirstFreeze,
    FreezeWatcher,
    assert_frozen_bit_identical_and_rest_trained,
    compile_model,
    small_resnet,
)
from tf_hwopt.peers import GradientNormPolicy, freezeout_schedule, gradient_norm_change_rate


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
    policy = GradientNormPolicy(4, tolerance=0.05, patience=2, bootstrap_steps=300, max_frozen_fraction=1.0)
    decisions = []
    for i in range(40):
        m0 = 1.0 + 2.0 * math.exp(-i / 2)  # settles quickly
        m1 = 1.0 + 2.0 * math.exp(-i / 8)  # settles later
        m2 = 1.0 + (i % 2)  # oscillates by 100%: never calm
        d = policy.observe(100 * i, [m0, m1, m2, 1.0])
        decisions += [(100 * i, k) for k in d.freeze]
    assert [k for _, k in decisions] == [0, 1]
    step0, step1 = decisions[0][0], decisions[1][0]
    assert step0 >= 300 and step1 > step0
    rate = abs((1 + 2 * math.exp(-step1 / 100 / 8)) - (1 + 2 * math.exp(-(step1 / 100 - 1) / 8)))
    assert rate / (1 + 2 * math.exp(-(step1 / 100 - 1) / 8)) < 0.05


def test_gradient_norm_policy_never_freezes_noisy_or_nan():
    policy = GradientNormPolicy(3, tolerance=0.05, patience=1)
    rng = np.random.RandomState(0)
    for i in range(50):
        assert policy.observe(i, [1.0 + rng.uniform(0.2, 1.0) * (-1) ** i, 1.0, 1.0]).freeze == ()
        assert policy.observe(i, [math.nan, 1.0, 1.0]).freeze == ()


@pytest.mark.parametrize(
    "cls,kwargs,match",
    [
        (tf_hwopt.FreezeOutCallback, dict(freeze_start=1.5), "freeze_start"),
        (tf_hwopt.FreezeOutCallback, dict(freeze_level=0), "freeze_level"),
        (tf_hwopt.GradientNormFreezeCallback, dict(tolerance=0), "tolerance"),
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
    cb = tf_hwopt.FreezeOutCallback(freeze_start=0.5, freeze_level=1.0, verbose=0, overhead_budget=None)
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
        probe_size=64, eval_every=4, tolerance=10.0, patience=1, bootstrap_steps=8, max_frozen_fraction=0.5, verbose=0,
        overhead_budget=None, freeze_at="step",
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


@pytest.mark.parametrize(
    "make",
    [
        lambda backup: tf_hwopt.FreezeOutCallback(
            freeze_start=0.2, freeze_level=1.0, backup_dir=backup, verbose=0, overhead_budget=None
        ),
        lambda backup: tf_hwopt.GradientNormFreezeCallback(
            probe_size=64, eval_every=4, tolerance=10.0, patience=1, bootstrap_steps=8, max_frozen_fraction=0.5,
            backup_dir=backup, verbose=0, overhead_budget=None,
        ),
    ],
    ids=["FreezeOut", "gradient-norm"],
)
def test_peers_resume_after_an_interruption_with_their_state(make, mnist1d_small, tmp_path):
    x, y, _, _ = mnist1d_small
    backup = str(tmp_path / "backup")
    first = make(backup)
    with pytest.raises(RuntimeError, match="simulated preemption"):
        compile_model(small_resnet(seed=5)).fit(x[:320], y[:320], batch_size=32, epochs=6, callbacks=[
            first, keras.callbacks.BackupAndRestore(backup), CrashAfterFirstFreeze(first)], verbose=0)
    state_at_crash = first.policy.get_state()
    events_at_crash = list(first.events)
    assert state_at_crash["num_frozen"] >= 1
    frozen_weights = [v.numpy().copy() for layer in first.modules[0].layers for v in layer.weights]

    # A new process: a fresh model object and a fresh callback.
    second = make(backup)

    class Check(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            if not hasattr(self, "epoch"):
                self.epoch, self.state = epoch, second.policy.get_state()
                self.trainable = [layer.trainable for layer in second.modules[0].layers]

    check = Check()
    compile_model(small_resnet(seed=99)).fit(x[:320], y[:320], batch_size=32, epochs=6, callbacks=[
        second, keras.callbacks.BackupAndRestore(backup), check], verbose=0)
    assert check.epoch >= 1
    assert check.state == state_at_crash
    assert second.events[: len(events_at_crash)] == events_at_crash
    assert check.trainable == [False] * len(check.trainable)
    after = [v.numpy() for layer in second.modules[0].layers for v in layer.weights]
    assert all(np.array_equal(a, b) for a, b in zip(frozen_weights, after))
