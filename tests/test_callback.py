"""EgeriaCallback inside real `model.fit` runs (small models, seeded)."""

import csv
import json
import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_hwopt
from conftest import (
    CrashAfterFirstFreeze,
    FreezeWatcher,
    assert_frozen_bit_identical_and_rest_trained,
    compile_model,
    eager_freezing,
    small_resnet,
)


def test_freezes_during_fit_with_real_plasticity(mnist1d_small):
    x, y, x_test, y_test = mnist1d_small
    model = compile_model(small_resnet())
    egeria = tf_hwopt.EgeriaCallback(
        probe_size=128, eval_every=8, window=3, patience=2, tolerance=0.15, bootstrap_steps=32, verbose=0,
        overhead_budget=None,  # a model this small cannot repay an evaluation: see test_budget.py
    )
    watcher = FreezeWatcher(egeria)
    history = model.fit(x, y, batch_size=64, epochs=8, callbacks=[egeria, watcher], verbose=0)
    assert egeria.reference.path == "tfmot"
    assert egeria.num_frozen >= 1
    first = egeria.events[0]
    assert first["kind"] == "freeze" and first["module"] == 0 and first["step"] >= 32
    assert len(first["window"]) == 3
    assert abs(tf_hwopt.egeria.relative_slope(first["window"])) <= 0.15
    assert_frozen_bit_identical_and_rest_trained(egeria, watcher)
    assert history.history["frozen_modules"][-1] == egeria.num_frozen
    # fit hands the model back fully trainable, as it was.
    assert all(layer.trainable for layer in model.layers)
    assert model.evaluate(x_test, y_test, verbose=0)[1] > 0.5


@pytest.mark.parametrize(
    "jit_compile,steps_per_execution,optimizer,policy,dataset",
    [
        # Each of eager/XLA, steps_per_execution 1 and > 1, Adam/SGD, float32/bf16, NumPy/tf.data at least once.
        (False, 1, "adam", None, False),
        (False, 4, "sgd", None, True),
        (True, 2, "sgd", None, False),
        (True, 3, "adam", "mixed_bfloat16", True),
    ],
)
def test_frozen_weights_stay_bit_identical(mnist1d_small, jit_compile, steps_per_execution, optimizer, policy, dataset):
    x, y, x_test, y_test = mnist1d_small
    previous = keras.config.dtype_policy()
    if policy:
        keras.config.set_dtype_policy(policy)
    try:
        model = compile_model(small_resnet(), optimizer, jit_compile, steps_per_execution)
        egeria = eager_freezing()
        watcher = FreezeWatcher(egeria)
        data = dict(x=x[:512], y=y[:512], batch_size=32)
        if dataset:
            data = dict(x=tf.data.Dataset.from_tensor_slices((x[:512], y[:512])).batch(32))
        model.fit(
            **data, epochs=2, validation_data=(x_test[:64], y_test[:64]), callbacks=[egeria, watcher], verbose=0
        )
    finally:
        keras.config.set_dtype_policy(previous)
    assert egeria.summary()["frozen_modules"] == 2  # the cap: 0.5 of 4 modules
    assert_frozen_bit_identical_and_rest_trained(egeria, watcher)
    assert egeria.summary()["train_function_rebuilds"] >= 2
    # Building and refreshing the reference is timed even off the training thread.
    assert egeria.summary()["reference_seconds"] > 0 and egeria.summary()["reference_refreshes"] >= 1
    assert model.jit_compile == jit_compile  # XLA really was on (or off)


def test_one_off_work_waits_for_the_epoch_end(mnist1d_small):
    x, y, _, _ = mnist1d_small
    runs = {}
    for freeze_at in ("epoch_end", "step"):
        model = compile_model(small_resnet())
        egeria = eager_freezing(freeze_at=freeze_at)
        watcher = FreezeWatcher(egeria)
        model.fit(x[:512], y[:512], batch_size=32, epochs=3, callbacks=[egeria, watcher], verbose=0)  # 16 steps/epoch
        assert_frozen_bit_identical_and_rest_trained(egeria, watcher)
        runs[freeze_at] = egeria
    deferred, at_once = runs["epoch_end"], runs["step"]
    # The reference is built at the first epoch end, so the first plasticity comes after it.
    assert deferred.history[0]["step"] > 16 and at_once.history[0]["step"] < 16
    assert deferred.events and all(e["kind"] == "freeze" for e in deferred.events)
    assert any(e.get("decided_step", e["step"]) < e["step"] for e in deferred.events)  # one really waited
    for event in deferred.events:
        if event["epoch"] < 2:  # another epoch follows: applied at this epoch's end
            assert event["step"] % 16 == 0 and event["step"] - 16 < event["decided_step"] <= event["step"]
        else:  # the last epoch: at once
            assert "decided_step" not in event
    assert at_once.events and all("decided_step" not in e for e in at_once.events)
    # A freeze applied at an epoch end is timed from the next epoch's start to its first step.
    assert deferred.summary()["rebuild_seconds"] is not None


def test_egeria_evaluates_every_eighth_of_an_epoch_by_default(mnist1d_small):
    """The default window of 8 evaluations spans one epoch (a quarter-epoch interval made it two)."""
    x, y, _, _ = mnist1d_small
    model = compile_model(small_resnet())
    egeria = tf_hwopt.EgeriaCallback(overhead_budget=None, verbose=0)
    model.fit(x[:512], y[:512], batch_size=32, epochs=1, callbacks=[egeria], verbose=0)  # 16 steps
    assert egeria.summary()["eval_every"] == 2
    assert egeria.evaluations == 8


def test_freeze_at_is_checked():
    with pytest.raises(ValueError, match="freeze_at"):
        tf_hwopt.EgeriaCallback(freeze_at="batch")


class _ForceFreeze(keras.callbacks.Callback):
    """At `step`, freezes module 0 (or only rebuilds), then records Adam's slots."""

    def __init__(self, modules, step, freeze):
        super().__init__()
        self.modules, self.step, self.freeze = modules, step, freeze
        self.seen = 0

    def on_train_begin(self, logs=None):
        self.engine = tf_hwopt.egeria.FreezingEngine(self.model, self.modules)

    def on_train_batch_end(self, batch, logs=None):
        self.seen += 1
        if self.seen == self.step:
            before = _slots(self.model)
            if self.freeze:
                self.engine.freeze([0])
            else:
                self.engine.rebuild()
            after = _slots(self.model)
            assert all(np.array_equal(before[k], after[k]) for k in after), "rebuild changed optimizer slots"
            self.right_after = after


def _slots(model):
    opt = model.optimizer
    out = {}
    for v in model.trainable_variables + [w for layer in model.layers for w in layer.weights if not layer.trainable]:
        for name in ("momentums", "velocities"):
            slot = getattr(opt, f"_{name}")[opt._get_variable_index(v)]
            # Keyed without the model's (run-dependent) name.
            out[(v.path.split("/", 1)[1], name)] = slot.numpy().copy()
    return out


def test_adam_moments_of_unfrozen_variables_match_a_rebuild_without_freezing(mnist1d_small):
    x, y, _, _ = mnist1d_small
    dense = lambda: keras.Sequential(  # noqa: E731 - no BatchNorm: module 0's forward is the same frozen or not
        [keras.Input((40, 1)), keras.layers.Flatten(), keras.layers.Dense(32, activation="relu", name="front"),
         keras.layers.Dense(32, activation="relu", name="middle"), keras.layers.Dense(10, name="out")]
    )
    results = {}
    for freeze in (True, False):
        keras.utils.set_random_seed(3)
        model = compile_model(dense(), "adam")
        modules = tf_hwopt.egeria.partition_modules(model)
        forcer = _ForceFreeze(modules, step=5, freeze=freeze)
        # 6 steps: the rebuild after step 5, then one step in which module 0's
        # weights are still equal in both runs.
        model.fit(x[:192], y[:192], batch_size=32, epochs=1, shuffle=False, callbacks=[forcer], verbose=0)
        results[freeze] = (_slots(model), forcer.right_after, model)
    frozen_slots, frozen_right_after, frozen_model = results[True]
    plain_slots, _, _ = results[False]
    unfrozen = [k for k in frozen_slots if not k[0].startswith("front")]
    assert unfrozen
    for key in unfrozen:
        np.testing.assert_allclose(frozen_slots[key], plain_slots[key], rtol=1e-5, atol=1e-9)
        assert not np.array_equal(frozen_slots[key], frozen_right_after[key])  # the step did update them
    # The frozen module's slots were not touched by the last step.
    for key in frozen_slots:
        if key[0].startswith("front"):
            assert np.array_equal(frozen_slots[key], frozen_right_after[key])


def test_logs_events_summary_tensorboard_and_plot(mnist1d_small, tmp_path):
    x, y, _, _ = mnist1d_small
    model = compile_model(small_resnet())
    egeria = eager_freezing(log_dir=str(tmp_path / "tb"))
    csv_path = tmp_path / "log.csv"
    history = model.fit(
        x[:256], y[:256], batch_size=32, epochs=3, callbacks=[egeria, keras.callbacks.CSVLogger(str(csv_path))], verbose=0
    )
    with open(csv_path) as f:
        rows = list(csv.DictReader(f))
    expected = [sum(e["epoch"] <= epoch for e in egeria.events) for epoch in range(3)]
    assert expected[-1] == 2
    assert [float(r["frozen_modules"]) for r in rows] == expected
    assert history.history["frozen_modules"] == expected
    summary = egeria.summary()
    json.dumps(summary)  # JSON-serialisable
    assert summary["frozen_modules"] == 2 and len(summary["events"]) == 2
    assert {"step", "epoch", "module", "window", "kind"} <= set(summary["events"][0])
    assert 0 < summary["final_backward_flops_skipped_fraction"] < 1
    assert 0 < summary["backward_flops_skipped_fraction"] <= summary["final_backward_flops_skipped_fraction"]
    assert 0 < summary["overhead_fraction"] < 1
    assert summary["reference_path"] == "tfmot"
    # Once the cap is reached nothing can change: evaluation stops.
    assert all(h["frozen"] < 2 for h in egeria.history)
    tags = set()
    for root, _, files in os.walk(tmp_path / "tb"):
        for name in files:
            for event in tf.compat.v1.train.summary_iterator(os.path.join(root, name)):
                tags.update(v.tag for v in event.summary.value)
    assert {"egeria/frozen_modules", "egeria/plasticity/module_0"} <= tags
    png = tmp_path / "p.png"
    tf_hwopt.egeria.plot(egeria, str(png))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_resume_with_backup_and_restore_keeps_frozen_set(mnist1d_small, tmp_path):
    x, y, _, _ = mnist1d_small
    backup = str(tmp_path / "backup")
    settings = dict(eval_every=6, window=2, patience=1, tolerance=1e6, bootstrap_steps=8, max_frozen_fraction=0.75)
    model = compile_model(small_resnet(seed=5))
    egeria = eager_freezing(backup_dir=backup, **settings)
    with pytest.raises(RuntimeError, match="simulated preemption"):
        model.fit(x[:256], y[:256], batch_size=32, epochs=6, callbacks=[
            egeria, keras.callbacks.BackupAndRestore(backup), CrashAfterFirstFreeze(egeria)], verbose=0)
    frozen_at_crash = egeria.policy.num_frozen
    windows_at_crash = [egeria.policy.window_of(i) for i in range(len(egeria.modules))]
    assert frozen_at_crash >= 1
    frozen_weights = [v.numpy().copy() for layer in egeria.modules[0].layers for v in layer.weights]

    # A new process: a fresh model object and a fresh callback.
    model2 = compile_model(small_resnet(seed=99))
    egeria2 = eager_freezing(backup_dir=backup, **settings)

    class Check(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            if not hasattr(self, "epoch"):
                self.epoch = epoch
                self.frozen = egeria2.policy.num_frozen
                self.windows = [egeria2.policy.window_of(i) for i in range(len(egeria2.modules))]
                self.trainable = [layer.trainable for layer in egeria2.modules[0].layers]

    check = Check()
    model2.fit(x[:256], y[:256], batch_size=32, epochs=6, callbacks=[
        egeria2, keras.callbacks.BackupAndRestore(backup), check], verbose=0)
    assert check.epoch >= 1
    assert check.frozen == frozen_at_crash
    assert check.windows == windows_at_crash
    assert check.trainable == [False] * len(check.trainable)
    assert egeria2.reference.refreshes > egeria.reference.refreshes
    after = [v.numpy() for layer in egeria2.modules[0].layers for v in layer.weights]
    assert all(np.array_equal(a, b) for a, b in zip(frozen_weights, after))


def test_corrupted_state_file_is_a_clear_error_and_is_kept(mnist1d_small, tmp_path):
    x, y, _, _ = mnist1d_small
    backup = tmp_path / "backup"
    backup.mkdir()
    (backup / "egeria_state.json").write_text("{not json")
    model = compile_model(small_resnet())
    egeria = eager_freezing(backup_dir=str(backup))
    with pytest.raises(ValueError, match="corrupted"):
        model.fit(x[:64], y[:64], batch_size=32, epochs=1, callbacks=[egeria], verbose=0)
    assert (backup / "egeria_state.json").read_text() == "{not json"


def test_nan_plasticity_warns_and_never_freezes(mnist1d_small):
    x, y, _, _ = mnist1d_small
    probe = x[:32].copy()
    probe[0, 0, 0] = np.nan
    model = compile_model(small_resnet())
    egeria = eager_freezing(probe_data=probe)
    with pytest.warns(RuntimeWarning, match="non-finite plasticity"):
        model.fit(x[:256], y[:256], batch_size=32, epochs=1, callbacks=[egeria], verbose=0)
    assert egeria.events == [] and egeria.skipped_evaluations >= 1


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(window=0), "window"),
        (dict(window=-2), "window"),
        (dict(eval_every=0), "eval_every"),
        (dict(reference_refresh=0), "reference_refresh"),
        (dict(patience=0), "patience"),
        (dict(tolerance=0), "tolerance"),
        (dict(tolerance=-1.0), "tolerance"),
        (dict(probe_size=0), "probe_size"),
        (dict(modules=[["stem_conv"]]), "at least 2"),
        (dict(asynchronous="yes"), "asynchronous"),
    ],
)
def test_bad_arguments_fail_at_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        tf_hwopt.EgeriaCallback(**kwargs)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(modules=[["stem_conv"], ["no_such_layer"]]), "does not have"),
        (dict(modules=[["stem_conv", "stem_bn"], ["stem_bn", "head"]]), "both"),
        (dict(modules=[["head"], ["stem_conv"]]), "out of order"),
        (dict(probe_size=301), "larger than the training data"),
    ],
)
def test_bad_inputs_fail_before_any_training_step(mnist1d_small, kwargs, match):
    x, y, _, _ = mnist1d_small
    model = compile_model(small_resnet())
    before = [v.numpy().copy() for v in model.weights]
    with pytest.raises(ValueError, match=match):
        model.fit(x[:300], y[:300], batch_size=32, epochs=1, callbacks=[tf_hwopt.EgeriaCallback(**kwargs)], verbose=0)
    assert all(np.array_equal(a, v.numpy()) for a, v in zip(before, model.weights))
    assert int(model.optimizer.iterations.numpy()) == 0
