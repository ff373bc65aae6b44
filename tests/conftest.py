"""Shared fixtures: small seeded models and a small MNIST-1D, built once."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import gc  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402

import tf_hwopt  # noqa: E402,F401  (quiet TensorFlow import first)
import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

# Two logical CPU devices (before TensorFlow's runtime starts), so that
# MirroredStrategy's multi-replica paths run here.
tf.config.set_logical_device_configuration(
    tf.config.list_physical_devices("CPU")[0],
    [tf.config.LogicalDeviceConfiguration(), tf.config.LogicalDeviceConfiguration()],
)

from tf_hwopt.data import load_mnist1d  # noqa: E402
from tf_hwopt.models import resnet1d  # noqa: E402

# No tf.config.experimental.enable_op_determinism(): Keras then silently turns
# jit_compile=True off, and the XLA paths would go untested.


@pytest.fixture(autouse=True)
def _collect_then_freeze_the_heap():
    """Collects a test's garbage, then moves what survives out of the collector's sight.

    KerasTuner calls `gc.collect()` (and Keras's `clear_session()` another)
    before building each trial's model. Inside the suite the heap holds what
    every earlier test left alive (shared fixtures, traced functions), so each
    of those collections scanned gigabytes: the search tests ran 4-7x slower
    in the suite than alone, 90% of their time in `gc.collect` (py-spy).
    Frozen objects are still freed by reference counting.
    """
    yield
    gc.collect()
    gc.freeze()


@pytest.fixture(scope="session", autouse=True)
def _cache_dir(tmp_path_factory):
    os.environ["TF_HWOPT_CACHE"] = str(tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="session")
def mnist1d_small():
    """2,000 training and 500 test examples of MNIST-1D."""
    (x, y), (x_test, y_test) = load_mnist1d(2500)
    return x, y, x_test, y_test


def small_resnet(seed: int = 0, **kwargs) -> keras.Model:
    keras.utils.set_random_seed(seed)
    config = dict(widths=(16, 16, 16), strides=(1, 2, 1), stem_width=16)
    config.update(kwargs)
    return resnet1d(**config)


class SmallSubclassed(keras.Model):
    """A subclassed model (no inspectable layer graph): conv -> flatten -> dense."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.conv = keras.layers.Conv1D(8, 3, name="conv")
        self.flat = keras.layers.Flatten(name="flat")
        self.out = keras.layers.Dense(3, name="out")

    def call(self, x):
        return self.out(self.flat(self.conv(x)))


def compile_model(model, optimizer="adam", jit_compile=False, steps_per_execution=1, lr=3e-3):
    opt = keras.optimizers.Adam(lr) if optimizer == "adam" else keras.optimizers.SGD(lr * 10, momentum=0.9)
    model.compile(
        opt,
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
        jit_compile=jit_compile,
        steps_per_execution=steps_per_execution,
    )
    return model


class FreezeWatcher(keras.callbacks.Callback):
    """Snapshots each module's variables when a freezing callback (listed
    before this one) freezes it, and every module's at train begin."""

    def __init__(self, freezer):
        super().__init__()
        self.freezer = freezer
        self.at_freeze = {}
        self.at_begin = None

    def on_train_begin(self, logs=None):
        if self.freezer.modules is not None:
            self._snapshot_begin()

    def _snapshot_begin(self):
        self.at_begin = {
            m.index: [v.numpy().copy() for layer in m.layers for v in layer.weights] for m in self.freezer.modules
        }

    def on_epoch_end(self, epoch, logs=None):
        self.on_train_batch_end(None)  # freezes applied at the epoch end (freeze_at="epoch_end")

    def on_train_batch_end(self, batch, logs=None):
        if self.at_begin is None and self.freezer.modules is not None:
            self._snapshot_begin()  # an unbuilt model: partitioned at its first step
        for event in self.freezer.events:
            i = event["module"]
            if event["kind"] == "freeze" and i not in self.at_freeze:
                self.at_freeze[i] = [v.numpy().copy() for layer in self.freezer.modules[i].layers for v in layer.weights]


class CrashAfterFirstFreeze(keras.callbacks.Callback):
    """Ends fit at the first epoch end after a freeze, as a preemption would."""

    def __init__(self, freezer):
        super().__init__()
        self.freezer = freezer

    def on_epoch_end(self, epoch, logs=None):
        if self.freezer.events:
            raise RuntimeError("simulated preemption")


def module_values(freezer, i):
    return [v.numpy() for layer in freezer.modules[i].layers for v in layer.weights]


def assert_frozen_bit_identical_and_rest_trained(freezer, watcher):
    assert watcher.at_freeze, "no module froze"
    for i, before in watcher.at_freeze.items():
        after = module_values(freezer, i)
        assert all(np.array_equal(a, b) for a, b in zip(before, after)), f"module {i} changed after its freeze"
    head = len(freezer.modules) - 1
    changed = [not np.array_equal(a, b) for a, b in zip(watcher.at_begin[head], module_values(freezer, head))]
    assert all(changed), "the head stopped training"


def eager_freezing(**overrides):
    """EgeriaCallback settings that freeze within a few evaluations (for mechanics tests)."""
    config = dict(
        probe_size=32,
        eval_every=4,
        window=2,
        patience=1,
        tolerance=1e6,
        bootstrap_steps=0,
        max_frozen_fraction=0.5,
        verbose=0,
        asynchronous=False,
        overhead_budget=None,  # mechanics tests: evaluate on schedule, whatever it costs
    )
    config.update(overrides)
    return tf_hwopt.EgeriaCallback(**config)


@pytest.fixture
def rng():
    return np.random.RandomState(0)
