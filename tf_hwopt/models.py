"""Reference models used by the demo, the benchmarks and the tests."""

from __future__ import annotations

from tf_hwopt._quiet import import_tensorflow_quietly

import_tensorflow_quietly()

import keras  # noqa: E402


def _residual_block(x, filters: int, stride: int, name: str, kernel_size: int = 3):
    layers = keras.layers
    shortcut = x
    y = layers.Conv1D(filters, kernel_size, strides=stride, padding="same", use_bias=False, name=f"{name}_conv1")(x)
    y = layers.BatchNormalization(name=f"{name}_bn1")(y)
    y = layers.ReLU(name=f"{name}_relu1")(y)
    y = layers.Conv1D(filters, kernel_size, padding="same", use_bias=False, name=f"{name}_conv2")(y)
    y = layers.BatchNormalization(name=f"{name}_bn2")(y)
    if stride != 1 or x.shape[-1] != filters:
        shortcut = layers.Conv1D(filters, 1, strides=stride, use_bias=False, name=f"{name}_proj")(x)
        shortcut = layers.BatchNormalization(name=f"{name}_proj_bn")(shortcut)
    y = layers.Add(name=f"{name}_add")([shortcut, y])
    return layers.ReLU(name=f"{name}_out")(y)


def resnet1d(
    input_length: int = 40,
    num_classes: int = 10,
    widths: tuple = (64, 64, 64, 64),
    strides: tuple = (1, 1, 2, 2),
    stem_width: int = 64,
    name: str = "resnet1d",
) -> keras.Model:
    """A 1D ResNet for MNIST-1D: a conv stem, residual blocks, a dense head.

    Example:
    >>> model = resnet1d()
    >>> model.output.shape
    (None, 10)
    """
    layers = keras.layers
    inputs = keras.Input((input_length, 1), name="signal")
    x = layers.Conv1D(stem_width, 5, padding="same", use_bias=False, name="stem_conv")(inputs)
    x = layers.BatchNormalization(name="stem_bn")(x)
    x = layers.ReLU(name="stem_relu")(x)
    for i, (width, stride) in enumerate(zip(widths, strides)):
        x = _residual_block(x, width, stride, name=f"block{i + 1}")
    x = layers.GlobalAveragePooling1D(name="pool")(x)
    outputs = layers.Dense(num_classes, name="head")(x)
    return keras.Model(inputs, outputs, name=name)
