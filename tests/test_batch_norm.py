"""The BatchNormalization refresh before a freeze: one call, the same statistics as layer by layer."""

import numpy as np
import pytest

import keras

from tf_hwopt.freezing import batch_norm
from tf_hwopt.freezing.batch_norm import BatchNormRefresher, batch_norm_drift, batch_norm_layers
from tf_hwopt.freezing.probe import ActivationReader


def _bn_net(seed=0):
    """Three BatchNormalization layers in a row, a Dropout between them (inactive at inference)."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((16, 3))
    x = keras.layers.Conv1D(8, 3, padding="same", name="c0")(inputs)
    x = keras.layers.BatchNormalization(name="bn0")(x)
    x = keras.layers.ReLU()(x)
    x = keras.layers.Dropout(0.5)(x)
    x = keras.layers.Conv1D(8, 3, padding="same", name="c1")(x)
    x = keras.layers.BatchNormalization(name="bn1")(x)
    x = keras.layers.ReLU()(x)
    x = keras.layers.BatchNormalization(name="bn2", axis=1)(x)  # another channel axis
    outputs = keras.layers.Dense(2)(keras.layers.Flatten()(x))
    return keras.Model(inputs, outputs)


def _layer_by_layer(model, layers, x):
    """The reference: each layer read, then refreshed, in turn (NumPy moments in float64)."""
    drifts = []
    for layer in layers:
        seen = ActivationReader(model, [layer], capture="inputs")(x)[0]
        axes = tuple(a for a in range(seen.ndim) if a != layer.axis % seen.ndim)
        mean, var = seen.astype(np.float64).mean(axes), seen.astype(np.float64).var(axes)
        drifts.append(batch_norm_drift(seen, layer.moving_mean.numpy(), layer.moving_variance.numpy(),
                                       axis=layer.axis, epsilon=layer.epsilon))
        layer.moving_mean.assign(mean.astype("float32"))
        layer.moving_variance.assign(var.astype("float32"))
    return drifts


@pytest.mark.parametrize("graph", ["functional", "whole-model"])
def test_one_call_refresh_matches_refreshing_layer_by_layer(graph, monkeypatch):
    x = np.random.RandomState(1).normal(2.0, 3.0, (64, 16, 3)).astype("float32")
    expected_model, model = _bn_net(), _bn_net()
    layers = batch_norm_layers(model.layers)
    assert [layer.name for layer in layers] == ["bn0", "bn1", "bn2"]
    want = _layer_by_layer(expected_model, batch_norm_layers(expected_model.layers), x)
    if graph == "whole-model":  # the path of subclassed models and shared layers: the whole forward pass, hooked
        monkeypatch.setattr(batch_norm, "prefix_model", lambda *args, **kwargs: None)
    refresher = BatchNormRefresher(model, layers)
    got = refresher(x)
    # The statistics at init were far from the data's (mean 2, std 3 at the input).
    assert min(want) > 0.1
    np.testing.assert_allclose(got, want, rtol=1e-3)
    for layer, ref in zip(layers, batch_norm_layers(expected_model.layers)):
        np.testing.assert_allclose(layer.moving_mean.numpy(), ref.moving_mean.numpy(), rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(layer.moving_variance.numpy(), ref.moving_variance.numpy(), rtol=1e-4)
    # Refreshed: a second call finds nothing left to correct.
    assert max(refresher(x)) < 1e-3


def test_frozen_and_fixed_batch_norm_layers_are_left_alone():
    model = _bn_net()
    model.get_layer("bn1").trainable = False
    assert [layer.name for layer in batch_norm_layers(model.layers)] == ["bn0", "bn2"]
