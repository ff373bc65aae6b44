import threading

import keras
import numpy as np
import pytest

from tf_hwopt.egeria import Reference, ReferenceBuild, ReferenceUnavailable, quantize_int8_per_channel, sp_loss
from tf_hwopt.freezing import ActivationReader, partition_modules
from tf_hwopt.models import resnet1d
from conftest import SmallSubclassed


def _conv_bn_relu_add_dense():
    inputs = keras.Input((16, 16, 3))
    x = keras.layers.Conv2D(8, 3, padding="same", name="c1")(inputs)
    x = keras.layers.BatchNormalization(name="bn1")(x)
    x = keras.layers.ReLU(name="r1")(x)
    y = keras.layers.Conv2D(8, 3, padding="same", name="c2")(x)
    y = keras.layers.BatchNormalization(name="bn2")(y)
    x = keras.layers.Add(name="add")([x, y])
    x = keras.layers.ReLU(name="r2")(x)
    x = keras.layers.GlobalAveragePooling2D(name="gap")(x)
    return keras.Model(inputs, keras.layers.Dense(5, name="d")(x))


@pytest.mark.parametrize("build", [_conv_bn_relu_add_dense, lambda: resnet1d(widths=(8, 8), strides=(1, 2), stem_width=8)])
def test_tfmot_path_is_close_to_float_model(build, rng):
    keras.utils.set_random_seed(1)
    model = build()
    x = rng.rand(32, *model.inputs[0].shape[1:]).astype(np.float32)
    # Train BN statistics away from their initial values.
    model.compile("adam", "mse")
    model.fit(x, rng.rand(32, 5 if model.output.shape[-1] == 5 else 10), epochs=2, verbose=0)
    mods = partition_modules(model)
    ref = Reference(model, [m.output_layer for m in mods], x, asynchronous=False)
    assert ref.path == "tfmot", ref.reason
    ref.submit_refresh(model)
    reference = ref.activations()
    training = ActivationReader(model, [m.output_layer for m in mods])(x)
    for t, r in zip(training, reference):
        rel = np.linalg.norm(t - r) / np.linalg.norm(t)
        assert 0 < rel < 0.05  # int8, so not exact; within 5% relative (L2)
        assert sp_loss(t, r) < 1e-3


def test_refresh_follows_changed_weights_and_growth_stops_at_max_cover(rng):
    keras.utils.set_random_seed(3)
    model = resnet1d(widths=(8, 8, 8, 8), strides=(1, 2, 1, 2), stem_width=8)
    x = rng.rand(32, 40, 1).astype(np.float32)
    layers = [m.output_layer for m in partition_modules(model)]
    assert len(layers) >= 5
    ref = Reference(model, layers, x, asynchronous=False, cover=2, max_cover=3)
    assert ref.covered_modules == 3
    ref.submit_refresh(model, (0, 1, 2))
    ref.activations()
    # Kernels 10x smaller: int8 steps of weight ranges not set from them would round them away.
    for v in model.weights:
        if len(v.shape) >= 2:
            v.assign(v.numpy() * 0.1)
    ref.submit_refresh(model, (2, 3))
    # Doubling would quantize modules 0..4 at least; max_cover stops it at 3.
    assert ref.covered_modules == 4
    training = ActivationReader(model, [layers[2], layers[3]])(x)
    for t, r in zip(training, ref.activations()):
        assert np.linalg.norm(t - r) / np.linalg.norm(t) < 0.05, np.linalg.norm(t - r) / np.linalg.norm(t)


def test_background_refresh_matches_synchronous(rng):
    keras.utils.set_random_seed(2)
    model = resnet1d(widths=(8,), strides=(1,), stem_width=8)
    x = rng.rand(16, 40, 1).astype(np.float32)
    layers = [m.output_layer for m in partition_modules(model)]
    results = []
    for asynchronous in (False, True):
        ref = Reference(model, layers, x, asynchronous=asynchronous)
        ref.submit_refresh(model)
        results.append(ref.activations())
        ref.close()
    for a, b in zip(*results):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


def test_one_call_read_and_refresh_matches_a_read_and_a_snapshot_refresh(rng):
    keras.utils.set_random_seed(4)
    model = resnet1d(widths=(8, 8, 8), strides=(1, 2, 1), stem_width=8)
    x = rng.rand(16, 40, 1).astype(np.float32)
    layers = [m.output_layer for m in partition_modules(model)]
    one_call = Reference(model, layers, x, asynchronous=False, cover=2)
    snapshot = Reference(model, layers, x, asynchronous=True, cover=2)  # off-thread: the snapshot path
    for step in range(2):
        reads = one_call.read_and_refresh(model, (1, 2))
        snapshot.submit_refresh(model, (1, 2))
        assert one_call.refreshed_modules == (1, 2) and one_call.refreshes == step + 1
        for a, b in zip(reads, ActivationReader(model, layers[1:3])(x)):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
        for a, b in zip(one_call.activations(), snapshot.activations()):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
        # The next refresh must follow the weights of then, not of the first call.
        for v in model.trainable_weights:
            v.assign(v.numpy() * 0.5 + 0.01)
    assert [fn is not None for fn in one_call.compiled.values()] == [True]  # one function, traced once
    # Where it does not apply (off-thread, or past the quantized prefix), None: read and refresh as usual.
    assert snapshot.read_and_refresh(model, (1, 2)) is None
    assert one_call.read_and_refresh(model, (3,)) is None
    snapshot.close()


def test_one_call_read_and_refresh_of_the_int8_weights_clone_matches_the_snapshot_path(rng):
    keras.utils.set_random_seed(6)
    model = resnet1d(widths=(8, 8, 8), strides=(1, 2, 1), stem_width=8)
    x = rng.rand(16, 40, 1).astype(np.float32)
    layers = [m.output_layer for m in partition_modules(model)]
    one_call = Reference(model, layers, x, asynchronous=False, mode="int8-weights")
    snapshot = Reference(model, layers, x, asynchronous=True, mode="int8-weights")
    assert one_call.path == "int8-weights"
    for _ in range(2):
        reads = one_call.read_and_refresh(model, (1, 2))
        snapshot.submit_refresh(model, (1, 2))
        for a, b in zip(reads, ActivationReader(model, layers[1:3])(x)):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
        for a, b in zip(one_call.activations(), snapshot.activations()):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
        for t, r in zip(reads, one_call.activations()):  # int8 weights: close to the float model, not a copy
            assert 0 < np.linalg.norm(t - r) / np.linalg.norm(t) < 0.05
        # The next refresh must follow the weights of then, not of the first call.
        for v in model.trainable_weights:
            v.assign(v.numpy() * 0.5 + 0.01)
    # The clone covers every module: one function per last module read, each reading only up to it.
    assert one_call.read_and_refresh(model, (3,)) is not None
    assert len(one_call.compiled) == 2 and all(fn is not None for fn in one_call.compiled.values())
    snapshot.close()


def _dense_stack(share_second: bool):
    """Dense layers from the input (TFMOT ranges the input itself); optionally the first layer called twice."""
    inp = keras.Input((8,))
    first = keras.layers.Dense(8, name="first")
    h = keras.layers.ReLU(name="r1")(first(inp))
    h = first(h) if share_second else keras.layers.Dense(8, name="second")(h)
    h = keras.layers.Dense(8, activation="relu", name="d2")(h)
    h = keras.layers.Dense(8, activation="relu", name="d3")(h)
    model = keras.Model(inp, keras.layers.Dense(3, name="out")(h))
    return model, [model.get_layer(n) for n in ("r1", "d2", "d3", "out")]


@pytest.mark.parametrize("shared", [False, True], ids=["ranged-input", "shared-layer"])
def test_one_call_read_and_refresh_ranges_the_input_and_skips_shared_layers(rng, shared):
    keras.utils.set_random_seed(5)
    model, layers = _dense_stack(shared)
    x = rng.rand(16, 8).astype(np.float32)
    one_call = Reference(model, layers, x, asynchronous=False, cover=2)
    snapshot = Reference(model, layers, x, asynchronous=True, cover=2)
    reads = one_call.read_and_refresh(model, (0, 1))
    snapshot.submit_refresh(model, (0, 1))
    snapshot.close()
    if shared:
        # A layer called twice has no one output to range: read and refresh the usual way.
        assert reads is None and one_call.refreshes == 0
        return
    for a, b in zip(reads, ActivationReader(model, layers[:2])(x)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
    for a, b in zip(one_call.activations(), snapshot.activations()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_a_reference_built_in_the_background_while_the_model_trains_equals_one_built_at_once(rng, monkeypatch):
    """`ReferenceBuild` takes the weights and the expected outputs on the calling thread and rebuilds and
    quantizes on a background thread, while training changes the weights: refreshed from the same
    weights, its reference computes what a reference built at once computes."""
    import tf_hwopt.egeria.reference as reference

    keras.utils.set_random_seed(4)
    model = resnet1d(widths=(8, 8, 8), strides=(1, 2, 1), stem_width=8)
    model.compile("adam", "mse")
    x = rng.rand(32, 40, 1).astype(np.float32)
    layers = [m.output_layer for m in partition_modules(model)]
    threads = []
    real_init = reference._TfmotReference.__init__

    def init(self, *args, **kwargs):
        threads.append(threading.current_thread().name)
        real_init(self, *args, **kwargs)

    monkeypatch.setattr(reference._TfmotReference, "__init__", init)
    build = ReferenceBuild(model, layers, x, asynchronous=False, cover=2)
    before = [v.numpy() for v in model.trainable_weights]
    model.fit(x, rng.rand(32, 10).astype(np.float32), epochs=2, verbose=0)  # the weights change meanwhile
    assert not all(np.array_equal(a, v.numpy()) for a, v in zip(before, model.trainable_weights))
    background = build.result(model)
    at_once = Reference(model, layers, x, asynchronous=False, cover=2)
    assert threads[0].startswith("egeria-reference-build") and threads[1] == threading.current_thread().name
    assert background.path == "tfmot" and background.covered_modules == at_once.covered_modules == 3
    assert not build.failed and build.thread_seconds > 0 and background.build_seconds >= build.thread_seconds
    for ref in (background, at_once):
        ref.submit_refresh(model, (0, 1, 2))
    for a, b in zip(background.activations(), at_once.activations()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", ["auto", "tfmot"])
def test_a_background_build_that_tfmot_cannot_take_falls_back_on_the_calling_thread(rng, mode):
    """TFMOT's path fails on a subclassed model: the background build says so (`failed`), and `result()`
    builds the int8-weights clone (mode "auto", with the cause) or raises (mode "tfmot")."""
    model = SmallSubclassed()
    x = rng.rand(8, 10, 1).astype(np.float32)
    model(x)
    layers = [m.output_layer for m in partition_modules(model, [["conv"], ["flat", "out"]], sample_input=x)]
    build = ReferenceBuild(model, layers, x, asynchronous=False, mode=mode)
    build.cancel()  # waits for the background part
    assert build.done() and build.failed
    if mode == "tfmot":
        with pytest.raises(ReferenceUnavailable, match="TFMOT reference .forced. failed: subclassed"):
            build.result(model)
        return
    with pytest.warns(UserWarning, match="clone with int8 weights"):
        ref = build.result(model)
    assert ref.path == "int8-weights" and "subclassed" in ref.reason
    with pytest.raises(ValueError, match="`mode` must be 'auto' or 'tfmot'"):
        ReferenceBuild(model, layers, x, mode="int8-weights")


def test_fallback_for_subclassed_model_is_reported(rng):
    model = SmallSubclassed()
    x = rng.rand(8, 10, 1).astype(np.float32)
    model(x)
    mods = partition_modules(model, [["conv"], ["flat", "out"]], sample_input=x)
    ref = Reference(model, [m.output_layer for m in mods], x, asynchronous=False)
    assert ref.path == "int8-weights"
    assert "subclassed" in ref.reason
    ref.submit_refresh(model)
    r = ref.activations()
    t = ActivationReader(model, [m.output_layer for m in mods])(x)
    assert r[0].shape == t[0].shape
    assert np.linalg.norm(t[0] - r[0]) / np.linalg.norm(t[0]) < 0.02
    assert not np.array_equal(t[0], r[0])  # the weights really were quantized


def test_quantize_int8_per_channel(rng):
    w = rng.randn(3, 4, 6).astype(np.float32)
    w[..., 2] *= 100.0  # one channel with a much larger range
    q = quantize_int8_per_channel(w)
    assert q.dtype == w.dtype and q.shape == w.shape
    for c in range(6):
        levels = np.unique(np.round(q[..., c] / (np.abs(w[..., c]).max() / 127)))
        assert len(levels) <= 255 and np.abs(levels).max() <= 127
        step = np.abs(w[..., c]).max() / 127
        assert np.abs(q[..., c] - w[..., c]).max() <= step / 2 + 1e-6
    bias = rng.randn(6)
    assert quantize_int8_per_channel(bias) is bias
