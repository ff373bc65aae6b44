"""Forward skipping: cached prefix activations, the suffix trained on them, and when caching is refused."""

import os
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

from tf_hwopt.freezing import partition_modules
from tf_hwopt.peers import FreezeOutCallback
from tf_hwopt.training import fit_with_cache
from tf_hwopt.training.cache import ActivationCache, cache_bytes, cut_model, epoch_order, random_augmentation_layers
from conftest import compile_model, small_resnet


def _freezeout(**kwargs):
    """FreezeOut on its schedule, without the cost accounting (the mechanics are tested here)."""
    return FreezeOutCallback(verbose=0, overhead_budget=None, **kwargs)


def _loss(model, inputs, y):
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)(y, model(inputs, training=True))


def test_pure_helpers():
    assert cache_bytes(10, (4, 8)) == 10 * 32 * 4 and cache_bytes(10, (4, 8), "bfloat16") == 10 * 32 * 2
    with pytest.raises(ValueError, match="dtype"):
        cache_bytes(10, (4,), "int8")
    a, b = epoch_order(100, 3, seed=7), epoch_order(100, 3, seed=7)
    np.testing.assert_array_equal(a, b)
    assert sorted(a.tolist()) == list(range(100)) and not np.array_equal(a, epoch_order(100, 4, seed=7))


def test_suffix_on_cached_activations_matches_the_whole_model_with_the_prefix_frozen(mnist1d_small):
    x, y = mnist1d_small[0][:64], mnist1d_small[1][:64]
    model = compile_model(small_resnet())
    model.fit(x, y, epochs=1, verbose=0)  # non-trivial BatchNorm statistics
    modules = partition_modules(model)
    k = 2
    for m in modules[:k]:
        for layer in m.layers:
            layer.trainable = False
    cache = ActivationCache(model, modules, x)
    assert cache.set_level(k) == "built"
    ids = np.arange(16, 48)
    suffix = cut_model(model, modules, k, len(modules))
    with tf.GradientTape() as whole_tape:
        whole_loss = _loss(model, x[ids], y[ids])
    with tf.GradientTape() as suffix_tape:
        suffix_loss = _loss(suffix, cache.lookup(ids), y[ids])
    assert suffix.trainable_variables and len(suffix.trainable_variables) == len(model.trainable_variables)
    np.testing.assert_allclose(suffix_loss.numpy(), whole_loss.numpy(), rtol=1e-5)
    whole_grads = whole_tape.gradient(whole_loss, model.trainable_variables)
    suffix_grads = suffix_tape.gradient(suffix_loss, model.trainable_variables)
    for gw, gs in zip(whole_grads, suffix_grads):
        np.testing.assert_allclose(gs.numpy(), gw.numpy(), rtol=1e-5, atol=1e-7)


def _train(data, cache, epochs=4, schedule=(0.2, 0.75), **kwargs):
    x, y, x_test, y_test = data
    model = compile_model(small_resnet())
    freezer = _freezeout(freeze_start=schedule[0], freeze_level=schedule[1])
    result = fit_with_cache(model, x[:1024], y[:1024], epochs=epochs, batch_size=64, freezer=freezer, cache=cache,
                            validation_data=(x_test[:256], y_test[:256]), verbose=0, **kwargs)
    return model, result


def test_a_run_with_and_without_the_cache_ends_with_equal_weights(mnist1d_small):
    # Frozen prefix at the epoch ends: 0, 1, 2, 2, 3, 4.
    base, plain = _train(mnist1d_small, None, epochs=6, schedule=(0.0, 1.0))
    cached, result = _train(mnist1d_small, "memory", epochs=6, schedule=(0.0, 1.0))
    assert [p["cache_action"] for p in plain["phases"]] == ["off"]
    actions = [p["cache_action"] for p in result["phases"]]
    assert "built" in actions and "extended" in actions, result["phases"]
    # A cache is (re)built only while it can still be read for 2 epochs.
    assert all(p["first_epoch"] <= 6 - 2 for p in result["phases"]), result["phases"]
    assert max(p["cached_modules"] for p in result["phases"]) >= 2
    for a, b in zip(base.weights, cached.weights):
        np.testing.assert_allclose(b.numpy(), a.numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(result["history"]["val_loss"], plain["history"]["val_loss"], rtol=1e-5)
    # The user holds the whole model, trainable again, not the suffix.
    assert cached.count_params() == base.count_params() and all(layer.trainable for layer in cached.layers)


def test_held_freezes_under_the_cache_weigh_the_train_function_rebuild_alone(mnist1d_small, monkeypatch):
    # The cache grows module by module: a freeze's forward passes cost the same held or not,
    # so holding a freeze shares only the train function's rebuild.
    from tf_hwopt.freezing import callback as callback_module

    x, y = mnist1d_small[0][:1024], mnist1d_small[1][:1024]
    freezer = FreezeOutCallback(verbose=0, freeze_start=0.0, freeze_level=1.0)
    freezer.HOLDS_UNPAID_FREEZES = True
    asked, release = [], callback_module.releases_held_freezes

    def spy(held, **kwargs):
        asked.append((kwargs["rebuild_seconds"], freezer._rebuild_estimate(cache=False), freezer._rebuild_estimate()))
        return release(held, **kwargs)

    monkeypatch.setattr(callback_module, "releases_held_freezes", spy)
    # A re-trace taken as cheap as on a big run's scale, so that this short fit's freezes can pay.
    monkeypatch.setattr(FreezeOutCallback, "_rebuild_stand_in", lambda self: 0.01)
    fit_with_cache(compile_model(small_resnet()), x, y, epochs=3, batch_size=64, freezer=freezer, cache="memory",
                   verbose=0)
    assert asked
    assert all(given == train_function < with_cache for given, train_function, with_cache in asked), asked


def test_under_the_cache_a_freeze_counts_the_cache_rebuild(mnist1d_small):
    """The holds and the stop rule count a freeze's cache rebuild: an epoch of the prefix's forward passes."""
    x, y = mnist1d_small[0][:1024], mnist1d_small[1][:1024]
    freezer = _freezeout(freeze_start=0.0, freeze_level=1.0)
    seen = []

    class Spy(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            train_function = freezer._rebuild_seconds
            if train_function is None:
                train_function = freezer._rebuild_stand_in()
            seen.append((freezer.rebuilds_cache, freezer._rebuild_estimate() - train_function,
                         freezer._step_seconds(), freezer.policy.num_frozen))

    fit_with_cache(compile_model(small_resnet()), x, y, epochs=2, batch_size=64, freezer=freezer, cache="memory",
                   callbacks=[Spy()], verbose=0)
    assert seen and all(flag for flag, *_ in seen) and not freezer.rebuilds_cache  # set while it trains only
    total = sum(m.flops for m in freezer.modules)
    for _, extra, step_seconds, frozen in seen[2:]:
        share = sum(m.flops for m in freezer.modules[: frozen + 1]) / total
        assert extra == pytest.approx(share * step_seconds * 16 / 3, rel=0.02)  # 16 steps of forward passes
    fit_with_cache(compile_model(small_resnet()), x, y, epochs=1, batch_size=64, freezer=freezer, cache=None,
                   callbacks=[Spy()], verbose=0)
    assert not seen[-1][0] and seen[-1][1] == 0.0  # no cache: the train function's rebuild alone


def test_a_further_freeze_runs_only_the_new_module_and_a_reopen_drops_the_cache_behind_it(mnist1d_small):
    x = mnist1d_small[0][:300]
    model = small_resnet()
    modules = partition_modules(model)
    cache = ActivationCache(model, modules, x, batch_size=128)
    assert cache.set_level(1) == "built"
    calls = []
    stem = modules[0].layers[0]
    original = stem.call
    stem.call = lambda *a, **k: calls.append(1) or original(*a, **k)
    try:
        assert cache.set_level(3) == "extended"
        assert not calls, "extending the cache ran the already-cached module again"
    finally:
        stem.call = original
    fresh = cut_model(model, modules, 0, 3).predict(x, verbose=0)
    np.testing.assert_allclose(cache.lookup(np.arange(300)), fresh, rtol=1e-5, atol=1e-6)
    assert cache.set_level(2) == "built"  # re-opened module 2: its output is no longer cached
    np.testing.assert_allclose(cache.lookup([5, 7]), cut_model(model, modules, 0, 2).predict(x[[5, 7]], verbose=0),
                               rtol=1e-5, atol=1e-6)
    assert cache.set_level(0) == "dropped" and cache.level == 0 and cache.nbytes == 0


def _augmenting_model():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((40, 1), name="signal")
    h = keras.layers.GaussianNoise(0.1, name="jitter")(inputs)
    h = keras.layers.Conv1D(8, 3, name="conv")(h)
    h = keras.layers.Flatten(name="flat")(h)
    return compile_model(keras.Model(inputs, keras.layers.Dense(10, name="head")(h)))


def test_random_augmentation_in_the_prefix_is_refused_or_disables_the_cache(mnist1d_small):
    x, y = mnist1d_small[0][:256], mnist1d_small[1][:256]
    model = _augmenting_model()
    assert random_augmentation_layers(partition_modules(model)) == ["jitter (GaussianNoise)"]
    before = [w.numpy().copy() for w in model.weights]
    with pytest.raises(ValueError, match="jitter \\(GaussianNoise\\)"):
        fit_with_cache(model, x, y, epochs=1, freezer=_freezeout(), cache="memory", verbose=0)
    assert all(np.array_equal(a, w.numpy()) for a, w in zip(before, model.weights))  # refused before training
    with pytest.warns(UserWarning, match="random augmentation.*without a cache"):
        result = fit_with_cache(model, x, y, epochs=2, freezer=_freezeout(), cache="auto", verbose=0)
    assert {p["cache_action"] for p in result["phases"]} == {"off"}


def test_stateless_per_example_augmentation_is_cached(mnist1d_small):
    def shift(batch, ids):  # the same shift for an example every epoch
        return np.stack([np.roll(row, int(i % 3) - 1, axis=0) for row, i in zip(batch, ids)])

    base, _ = _train(mnist1d_small, None, preprocess=shift)
    cached, result = _train(mnist1d_small, "memory", preprocess=shift)
    assert any(p["cached_modules"] for p in result["phases"])
    for a, b in zip(base.weights, cached.weights):
        np.testing.assert_allclose(b.numpy(), a.numpy(), rtol=1e-5, atol=1e-5)


def test_over_budget_goes_to_disk_with_the_numbers_and_the_files_are_removed(mnist1d_small, tmp_path):
    with pytest.warns(UserWarning, match=r"needs [0-9.,]+ MiB, over cache_budget=0\.0 MiB.*on disk"):
        _, result = _train(mnist1d_small, "memory", cache_budget=1000, cache_dir=str(tmp_path), cache_dtype="float16")
    assert result["cache"]["mode"] == "disk" and result["cache"]["dtype"] == "float16"
    assert any(p["cache_bytes"] for p in result["phases"])
    assert os.listdir(tmp_path) == []  # the cache files are gone at the end


@pytest.mark.parametrize(
    "kwargs, match",
    [({"cache": "ram"}, "cache"), ({"cache_dtype": "int8"}, "cache_dtype"), ({"epochs": 0}, "epochs"),
     ({"freezer": keras.callbacks.History()}, "freezer"), ({"cache_budget": -1}, "cache_budget")],
)
def test_bad_arguments_are_named(kwargs, match, mnist1d_small):
    x, y = mnist1d_small[0][:64], mnist1d_small[1][:64]
    args = {"epochs": 1, "freezer": _freezeout(), **kwargs}
    with pytest.raises(ValueError, match=match):
        fit_with_cache(compile_model(small_resnet()), x, y, **args)
    with pytest.raises(ValueError, match="NumPy array"):
        fit_with_cache(compile_model(small_resnet()), tf.data.Dataset.from_tensor_slices((x, y)), y, epochs=1,
                       freezer=_freezeout())


@pytest.mark.parametrize("in_memory", [True, False])
def test_the_pipeline_gives_each_example_its_own_activation_in_epoch_order(in_memory):
    from tf_hwopt.training.cache import _array_gather, _numpy_gather, cached_dataset

    n, batch = 50, 16
    features = np.repeat(np.arange(n, dtype=np.float32)[:, None], 3, axis=1)  # row i holds i
    labels = np.arange(n, dtype=np.int32)
    source = _array_gather(features) if in_memory else _numpy_gather(lambda ids: features[ids])
    batches = list(cached_dataset(n, range(2, 4), 7, batch, source, labels).as_numpy_iterator())
    assert [len(b[1]) for b in batches] == [16, 16, 16, 2] * 2  # the short batch stays in its epoch
    for x, y in batches:
        np.testing.assert_array_equal(x[:, 0], y)  # keyed by example id
    ids = np.concatenate([y for _, y in batches])
    np.testing.assert_array_equal(ids[:n], epoch_order(n, 2, 7))
    np.testing.assert_array_equal(ids[n:], epoch_order(n, 3, 7))


def test_epoch_dataset_feeds_plain_fit_the_cached_drivers_order_without_running_out():
    from tf_hwopt.training.cache import epoch_dataset

    n, batch, epochs = 40, 16, 3
    x = np.arange(n, dtype=np.float32)[:, None]
    y = np.arange(n, dtype=np.int32)
    data = epoch_dataset(x, y, epochs=epochs, batch_size=batch, seed=5)
    ids = np.concatenate([b for _, b in data.as_numpy_iterator()])
    np.testing.assert_array_equal(ids, np.concatenate([epoch_order(n, e, 5) for e in range(epochs)]))

    seen = []

    class Record(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            seen.append(epoch)

    model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(data, epochs=epochs, steps_per_epoch=-(-n // batch), shuffle=False, verbose=0, callbacks=[Record()])
    assert seen == [0, 1, 2]
    assert not [w for w in caught if "ran out of data" in str(w.message)]


def _two_output_model():
    x = keras.Input((40, 1))
    h = keras.layers.Conv1D(8, 3, activation="relu", name="c1")(x)
    h = keras.layers.Conv1D(8, 3, activation="relu", name="c2")(h)
    h = keras.layers.GlobalAveragePooling1D()(h)
    model = keras.Model(x, {"digit": keras.layers.Dense(10, name="digit")(h), "odd": keras.layers.Dense(1, name="odd")(h)})
    model.compile("adam", {"digit": keras.losses.SparseCategoricalCrossentropy(from_logits=True), "odd": "mse"})
    return model


def test_a_model_with_a_dict_of_outputs_trains_on_cached_activations(mnist1d_small):
    x, y, x_test, y_test = mnist1d_small
    targets = lambda labels: {"digit": labels, "odd": (labels % 2)[:, None].astype("float32")}  # noqa: E731
    runs = []
    for cache in (None, "memory"):
        keras.utils.set_random_seed(0)
        model = _two_output_model()
        result = fit_with_cache(model, x[:512], targets(y[:512]), epochs=4, batch_size=64, cache=cache,
                                freezer=_freezeout(freeze_start=0.0, freeze_level=1.0), verbose=0,
                                validation_data=(x_test[:128], targets(y_test[:128])))
        runs.append((model, result))
    (base, plain), (cached, result) = runs
    assert max(p["cached_modules"] for p in result["phases"]) >= 1, result["phases"]
    assert {"val_digit_loss", "val_odd_loss"} <= set(result["history"])
    for a, b in zip(base.weights, cached.weights):
        np.testing.assert_allclose(b.numpy(), a.numpy(), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="`y` must be .* of 512 rows as `x`; got 100 rows"):
        fit_with_cache(_two_output_model(), x[:512], targets(y[:100]), epochs=1, freezer=_freezeout())


def _two_input_model():
    signal, parity = keras.Input((40, 1), name="signal"), keras.Input((40, 1), name="parity")
    h = keras.layers.Concatenate(name="join")([signal, parity])
    h = keras.layers.Conv1D(8, 3, activation="relu", name="c1")(h)
    h = keras.layers.Conv1D(8, 3, activation="relu", name="c2")(h)
    h = keras.layers.GlobalAveragePooling1D()(h)
    return compile_model(keras.Model({"signal": signal, "parity": parity}, keras.layers.Dense(10, name="head")(h)))


def _shift_by_id(batch, ids):
    """A deterministic per-example change of every input (stands in for seeded augmentation)."""
    return {name: value + 0.01 * (ids % 3)[:, None, None] for name, value in batch.items()}


@pytest.mark.parametrize("cache,preprocess", [("memory", None), ("disk", None), ("memory", _shift_by_id)])
def test_a_model_with_a_dict_of_inputs_trains_on_cached_activations(mnist1d_small, cache, preprocess, tmp_path):
    x, y, x_test, y_test = mnist1d_small
    inputs = lambda a: {"signal": a, "parity": a[:, ::-1] * 0.5}  # noqa: E731
    runs = []
    for mode in (None, cache):
        keras.utils.set_random_seed(0)
        model = _two_input_model()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = fit_with_cache(model, inputs(x[:512]), y[:512], epochs=4, batch_size=64, cache=mode,
                                    cache_dir=str(tmp_path), freezer=_freezeout(freeze_start=0.0, freeze_level=1.0),
                                    validation_data=(inputs(x_test[:128]), y_test[:128]), preprocess=preprocess,
                                    verbose=0)
        assert not [w for w in caught if "structure" in str(w.message).lower()]
        runs.append((model, result))
    (base, _), (cached, result) = runs
    assert max(p["cached_modules"] for p in result["phases"]) >= 1, result["phases"]
    assert len(result["history"]["val_loss"]) == 4
    for a, b in zip(base.weights, cached.weights):
        np.testing.assert_allclose(b.numpy(), a.numpy(), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"`x`: the inputs' first dimensions differ: \[100, 512\]"):
        fit_with_cache(_two_input_model(), {"signal": x[:512], "parity": x[:100]}, y[:512], epochs=1,
                       freezer=_freezeout())


def test_an_optimizer_with_moving_averages_is_refused_before_training(mnist1d_small):
    x, y = mnist1d_small[0][:64], mnist1d_small[1][:64]
    model = small_resnet()
    model.compile(keras.optimizers.Adam(use_ema=True), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    with pytest.raises(ValueError, match="fit_with_cache cannot train with an optimizer with `use_ema=True`"):
        fit_with_cache(model, x, y, epochs=1, freezer=_freezeout())
    assert model.optimizer.iterations.numpy() == 0
