"""FreezingEngine: what freezing and re-opening leave on the user's model."""

import os

import keras
import numpy as np
import pytest

import tf_hwopt
from conftest import CrashAfterFirstFreeze, compile_model, eager_freezing, small_resnet
from tf_hwopt.freezing import FreezingEngine, partition_modules


def _fine_tuning_model():
    """A nested base with a layer the user froze, under a fresh top (the transfer-learning pattern)."""
    base = keras.Sequential(
        [keras.Input((12, 12, 3)), keras.layers.Conv2D(4, 3, name="b1"), keras.layers.BatchNormalization(name="bn"),
         keras.layers.Conv2D(4, 3, name="b2")],
        name="base",
    )
    base.get_layer("b1").trainable = False
    x = keras.Input((12, 12, 3))
    h = keras.layers.Conv2D(4, 3, activation="relu", name="top")(base(x))
    out = keras.layers.Dense(3, name="head")(keras.layers.GlobalAveragePooling2D()(h))
    model = keras.Model(x, out)
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def _flags(model):
    return {layer.name: layer.trainable for layer in tf_hwopt._internals.all_layers(model)}


def test_reopening_a_nested_base_gives_back_each_inner_layer_its_own_trainable():
    model = _fine_tuning_model()
    before, trainable_count = _flags(model), len(model.trainable_weights)
    engine = FreezingEngine(model, partition_modules(model, count_flops=False))
    assert [layer.name for layer in engine.modules[0].layers] == ["base"]
    engine.freeze([0])
    assert not any(_flags(model)[name] for name in ("base", "b1", "bn", "b2"))
    assert len(model.trainable_weights) == 4  # top and head only
    engine.restore()
    # Keras's setter makes every inner layer trainable: b1, which the user froze, must stay frozen.
    assert _flags(model) == before and len(model.trainable_weights) == trainable_count


def test_a_model_saved_while_modules_are_frozen_loads_as_the_user_built_it(tmp_path, mnist1d_small):
    x, y, _, _ = mnist1d_small
    model = keras.Sequential(
        [keras.Input((40, 1)), keras.layers.Conv1D(8, 3, activation="relu", name="c1"),
         keras.layers.Conv1D(8, 3, activation="relu", name="c2"), keras.layers.Flatten(),
         keras.layers.Dense(10, name="out")]
    )
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    freezer = eager_freezing()
    path = os.path.join(tmp_path, "epoch_{epoch}.keras")
    saved_frozen = []

    class Record(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            saved_frozen.append([layer.name for layer in model.layers if not layer.trainable])

    # ModelCheckpoint after the freezer, as users list callbacks: it saves a model with frozen modules.
    model.fit(x[:512], y[:512], batch_size=64, epochs=3, verbose=0,
              callbacks=[freezer, Record(), keras.callbacks.ModelCheckpoint(path)])
    assert saved_frozen[-1], "no module was frozen when the last checkpoint was written"
    for epoch in (1, 2, 3):
        loaded = keras.models.load_model(path.format(epoch=epoch))
        assert all(layer.trainable for layer in loaded.layers)
        assert len(loaded.trainable_weights) == len(model.trainable_weights) == 6
    for a, b in zip(loaded.weights, model.weights):  # the last checkpoint holds the trained weights
        np.testing.assert_array_equal(a.numpy(), b.numpy())


def test_an_optimizer_with_moving_averages_finalizes_every_variable(mnist1d_small):
    # Keras finalizes the optimizer (with use_ema: weights <- their averages, paired by
    # position with model.trainable_weights) before on_train_end: the modules must be
    # trainable again by then (it raised a shape mismatch).
    x, y, _, _ = mnist1d_small
    model = keras.Sequential(
        [keras.Input((40, 1)), keras.layers.Conv1D(8, 3, activation="relu", name="c1"),
         keras.layers.Conv1D(8, 3, activation="relu", name="c2"), keras.layers.Flatten(),
         keras.layers.Dense(10, name="out")]
    )
    model.compile(keras.optimizers.SGD(0.05, use_ema=True, ema_overwrite_frequency=None),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    freezer = eager_freezing()
    history = model.fit(x[:512], y[:512], batch_size=64, epochs=3, verbose=0, callbacks=[freezer])
    assert len(history.history["loss"]) == 3 and freezer.summary()["frozen_modules"] >= 1
    assert all(layer.trainable for layer in model.layers)
    assert all(np.isfinite(w.numpy()).all() for w in model.weights)
    # The optimizer is the user's own again (no hook of ours left on it).
    assert "finalize_variable_values" not in vars(model.optimizer)


def test_a_hook_left_by_an_interrupted_fit_is_replaced_not_chained():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(keras.optimizers.SGD(use_ema=True), "mse")
    model.fit(np.ones((4, 3)), np.ones((4, 2)), verbose=0)  # builds the optimizer and its averages
    calls = []
    tf_hwopt._internals.before_optimizer_finalize(model, lambda: calls.append("interrupted fit"))  # never undone
    undo = tf_hwopt._internals.before_optimizer_finalize(model, lambda: calls.append("this fit"))
    model.optimizer.finalize_variable_values(model.trainable_weights)
    assert calls == ["this fit"]
    undo()
    assert "finalize_variable_values" not in vars(model.optimizer)


def test_freezes_left_by_a_fit_that_raised_are_undone_or_carried_on(mnist1d_small):
    # Keras runs no on_train_end when fit raises: the frozen modules stayed frozen for good.
    x, y = mnist1d_small[0][:512], mnist1d_small[1][:512]
    for follow in ("new callback", "same callback"):
        keras.utils.set_random_seed(0)
        model = compile_model(small_resnet())
        trainable = len(model.trainable_weights)
        freezer = eager_freezing()
        with pytest.raises(RuntimeError, match="simulated preemption"):
            model.fit(x, y, batch_size=64, epochs=4, verbose=0, callbacks=[freezer, CrashAfterFirstFreeze(freezer)])
        assert len(model.trainable_weights) < trainable
        front = [v.numpy().copy() for layer in freezer.modules[0].layers for v in layer.weights]
        # window=50: the next fit decides no freeze of its own.
        nxt = eager_freezing(window=50) if follow == "new callback" else freezer
        model.fit(x, y, batch_size=64, epochs=1, verbose=0, callbacks=[nxt])
        moved = any(not np.array_equal(a, v.numpy())
                    for a, v in zip(front, [v for layer in freezer.modules[0].layers for v in layer.weights]))
        # A new callback starts from the user's model; the same one carries on with what it had frozen.
        assert moved == (follow == "new callback"), follow
        assert len(model.trainable_weights) == trainable
