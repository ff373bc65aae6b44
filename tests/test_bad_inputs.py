"""Bad input, tried across the whole package: each gets a clear error that names the
argument (or file) and what was expected, before any training time is spent, and
none of them changes a user's weights or deletes a checkpoint."""

import os

import keras
import keras_tuner
import numpy as np
import pytest
import tensorflow as tf

import tf_hwopt
from tf_hwopt.bench.freezing import run_freezing_benchmark
from tf_hwopt.data import load_mnist1d, load_stdlib_chars
from tf_hwopt.hardware.distribute import strategy_for
from tf_hwopt.peers import FreezeOutCallback, GradientNormFreezeCallback
from tf_hwopt.training import fit_multi_worker, fit_with_cache
from tf_hwopt.export import export_saved_model
from tf_hwopt.hardware.profiles import load_profile
from tf_hwopt.search import LatencyAwareRandomSearch, LatencyAwareTuner, time_step
from conftest import SmallSubclassed, compile_model, small_resnet


@pytest.fixture(scope="module")
def model():
    return compile_model(small_resnet())


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad")
    (root / "broken.toml").write_text('name = "broken"\nkind = "tpu"\npeak_bf16_tflops = "fast"\n')
    (root / "egeria_state.json").write_text("{truncated")
    (root / "export").mkdir()
    (root / "export" / "saved_model.pb").write_text("an export the user already has")
    return root


def _start(callback, model):
    callback.set_model(model)
    callback.on_train_begin()


def _augmenting():
    inputs = keras.Input((40, 1))
    h = keras.layers.RandomTranslation(0.1, 0.0, name="shift")(keras.layers.Reshape((40, 1, 1))(inputs))
    h = keras.layers.Conv2D(4, (3, 1), name="conv")(h)
    return compile_model(keras.Model(inputs, keras.layers.Dense(10, name="head")(keras.layers.Flatten()(h))))


X = np.zeros((64, 40, 1), "float32")
Y = np.zeros(64, "int32")

CASES = [
    # Egeria and the peer policies: arguments
    ("probe_size", lambda m, f: tf_hwopt.EgeriaCallback(probe_size=1), ValueError, "probe_size"),
    ("window", lambda m, f: tf_hwopt.EgeriaCallback(window=0), ValueError, "window"),
    ("asynchronous", lambda m, f: tf_hwopt.EgeriaCallback(asynchronous="yes"), ValueError, "asynchronous"),
    ("max_frozen_fraction", lambda m, f: tf_hwopt.EgeriaCallback(max_frozen_fraction=1.5), ValueError,
     "max_frozen_fraction"),
    ("freeze_start", lambda m, f: FreezeOutCallback(freeze_start=1.5), ValueError, "freeze_start"),
    ("tolerance", lambda m, f: GradientNormFreezeCallback(tolerance=-1.0), ValueError, "tolerance"),
    # Model kinds
    ("one module", lambda m, f: tf_hwopt.EgeriaCallback(modules=[["stem_conv"]]), ValueError, "at least 2 modules"),
    ("unknown layer", lambda m, f: _start(tf_hwopt.EgeriaCallback(X, probe_size=16, modules=[["nope"], ["head"]], verbose=0), m),
     ValueError, "names layer 'nope'"),
    ("subclassed without modules", lambda m, f: _start(tf_hwopt.EgeriaCallback(probe_data=X, probe_size=16, verbose=0),
                                                       compile_model(SmallSubclassed())), ValueError, "modules"),
    ("uncompiled", lambda m, f: _start(tf_hwopt.EgeriaCallback(probe_data=X, verbose=0), small_resnet(seed=2)),
     ValueError, "compiled"),
    # Datasets
    ("cache on tf.data", lambda m, f: fit_with_cache(m, tf.data.Dataset.from_tensor_slices((X, Y)), Y, epochs=1,
                                                     freezer=FreezeOutCallback()), ValueError, "NumPy array"),
    ("cache with random augmentation", lambda m, f: fit_with_cache(_augmenting(), X, Y, epochs=1, cache="memory",
                                                                   freezer=FreezeOutCallback()),
     ValueError, "shift \\(RandomTranslation\\)"),
    ("x and y lengths", lambda m, f: fit_with_cache(m, X, Y[:10], epochs=1, freezer=FreezeOutCallback()),
     ValueError, "of 64 rows as `x`; got 10 rows"),
    ("mnist1d size", lambda m, f: load_mnist1d(5), ValueError, "num_samples"),
    ("seq_len", lambda m, f: load_stdlib_chars(1), ValueError, "seq_len"),
    # Hardware profiles, strategies, timing, search
    ("unknown profile", lambda m, f: load_profile("tpu-v9"), ValueError, "Unknown hardware profile 'tpu-v9'"),
    ("broken profile", lambda m, f: load_profile(str(f / "broken.toml")), ValueError, "broken.toml"),
    ("TPU profile, no TPU", lambda m, f: strategy_for("tpu-v5e"), ValueError, "no TPU"),
    ("GPU profile, no GPU", lambda m, f: strategy_for("gpu-h100"), ValueError, "has none"),
    ("timing mode", lambda m, f: time_step(m, (X, Y), mode="infer"), ValueError, "mode"),
    ("timing uncompiled", lambda m, f: time_step(small_resnet(seed=3), (X, Y)), ValueError, "compiled"),
    ("budget", lambda m, f: LatencyAwareRandomSearch(lambda hp: m, "val_accuracy", max_trials=2,
                                                     latency_budget_ms=0), ValueError, "latency_budget_ms"),
    ("oracle kind", lambda m, f: LatencyAwareTuner(lambda hp: m, oracle=keras_tuner.oracles.RandomSearchOracle(
        "val_accuracy", max_trials=2)), ValueError, "latency-aware oracle"),
    # Strategy/driver mismatch
    ("multi-worker batch", lambda m, f: fit_multi_worker(m, X, Y, loss=keras.losses.MeanSquaredError(), epochs=1,
                                                         batch_size=0, strategy=tf.distribute.get_strategy()),
     ValueError, "batch_size"),
    # Corrupted state files and existing outputs
    ("corrupted Egeria state", lambda m, f: tf_hwopt.EgeriaCallback(backup_dir=str(f))._read_state(), ValueError,
     "corrupted"),
    ("export over an existing one", lambda m, f: export_saved_model(m, str(f / "export")), ValueError,
     "already exists"),
    ("benchmark profile", lambda m, f: run_freezing_benchmark("huge", verbose=0), ValueError, "profile"),
]


def test_the_table_has_at_least_fifteen_cases():
    assert len(CASES) >= 15 and len({c[0] for c in CASES}) == len(CASES)


@pytest.mark.parametrize("name, call, error, match", CASES, ids=[c[0] for c in CASES])
def test_bad_input_gets_a_clear_error_and_loses_nothing(name, call, error, match, model, files):
    weights = [w.numpy().copy() for w in model.weights]
    listing = sorted(os.listdir(files))
    contents = {p: (files / p).read_bytes() for p in listing if (files / p).is_file()}
    with pytest.raises(error, match=match):
        call(model, files)
    assert all(np.array_equal(a, w.numpy()) for a, w in zip(weights, model.weights)), "weights changed"
    assert sorted(os.listdir(files)) == listing and (files / "export" / "saved_model.pb").exists()
    assert {p: (files / p).read_bytes() for p in contents} == contents, "a user's file changed"
