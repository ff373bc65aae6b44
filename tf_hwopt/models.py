"""Reference models used by the demo, the benchmarks and the tests."""

from __future__ import annotations

import keras


def _residual_block(x, filters: int, stride: int, name: str, kernel_size: int = 3, conv=None):
    layers = keras.layers
    conv = conv or layers.Conv1D
    shortcut = x
    y = conv(filters, kernel_size, strides=stride, padding="same", use_bias=False, name=f"{name}_conv1")(x)
    y = layers.BatchNormalization(name=f"{name}_bn1")(y)
    y = layers.ReLU(name=f"{name}_relu1")(y)
    y = conv(filters, kernel_size, padding="same", use_bias=False, name=f"{name}_conv2")(y)
    y = layers.BatchNormalization(name=f"{name}_bn2")(y)
    if stride != 1 or x.shape[-1] != filters:
        shortcut = conv(filters, 1, strides=stride, use_bias=False, name=f"{name}_proj")(x)
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


@keras.saving.register_keras_serializable(package="tf_hwopt")
class PositionEmbedding(keras.layers.Layer):
    """Adds a learned embedding of each position to a `(batch, length, dim)` input.

    Example:
    >>> PositionEmbedding(128)(keras.ops.zeros((2, 128, 64))).shape
    (2, 128, 64)
    """

    def __init__(self, max_length: int, **kwargs):
        super().__init__(**kwargs)
        self.max_length = max_length

    def build(self, input_shape):
        self.embeddings = self.add_weight(
            shape=(self.max_length, input_shape[-1]),
            initializer=keras.initializers.RandomNormal(stddev=0.02),
            name="embeddings",
        )

    def call(self, inputs):
        length = keras.ops.shape(inputs)[1]
        return inputs + keras.ops.cast(self.embeddings[:length], inputs.dtype)

    def get_config(self):
        return {**super().get_config(), "max_length": self.max_length}


def char_transformer(
    vocab_size: int = 128,
    seq_len: int = 128,
    d_model: int = 64,
    num_heads: int = 4,
    num_blocks: int = 4,
    mlp_ratio: int = 4,
    name: str = "char_transformer",
) -> keras.Model:
    """A causal character-level Transformer language model (pre-norm blocks).

    Outputs next-character logits at every position.

    Example:
    >>> model = char_transformer(num_blocks=4)
    >>> model.output.shape
    (None, 128, 128)
    """
    layers = keras.layers
    inputs = keras.Input((seq_len,), dtype="int32", name="chars")
    x = layers.Embedding(vocab_size, d_model, name="embed")(inputs)
    x = PositionEmbedding(seq_len, name="position")(x)
    for i in range(num_blocks):
        n = f"block{i + 1}"
        h = layers.LayerNormalization(epsilon=1e-5, name=f"{n}_ln1")(x)
        h = layers.MultiHeadAttention(num_heads, d_model // num_heads, name=f"{n}_attn")(h, h, use_causal_mask=True)
        x = layers.Add(name=f"{n}_add1")([x, h])
        h = layers.LayerNormalization(epsilon=1e-5, name=f"{n}_ln2")(x)
        h = layers.Dense(mlp_ratio * d_model, activation="gelu", name=f"{n}_mlp1")(h)
        h = layers.Dense(d_model, name=f"{n}_mlp2")(h)
        x = layers.Add(name=f"{n}_add2")([x, h])
    x = layers.LayerNormalization(epsilon=1e-5, name="final_ln")(x)
    outputs = layers.Dense(vocab_size, name="head")(x)
    return keras.Model(inputs, outputs, name=name)


def resnet20(input_shape: tuple = (32, 32, 3), num_classes: int = 10, name: str = "resnet20") -> keras.Model:
    """ResNet-20 for CIFAR-shaped input (He et al. 2016, section 4.2).

    A 3x3 stem of 16 channels, three stages of three basic blocks (16, 32,
    64 channels; stride 2 at the start of stages 2 and 3), global average
    pooling and a dense head: 20 weighted layers, 0.27 M parameters.

    Example:
    >>> resnet20().count_params() > 250_000
    True
    """
    layers = keras.layers
    inputs = keras.Input(input_shape, name="image")
    x = layers.Conv2D(16, 3, padding="same", use_bias=False, name="stem_conv")(inputs)
    x = layers.BatchNormalization(name="stem_bn")(x)
    x = layers.ReLU(name="stem_relu")(x)
    for stage, width in enumerate((16, 32, 64)):
        for block in range(3):
            stride = 2 if stage > 0 and block == 0 else 1
            x = _residual_block(x, width, stride, name=f"s{stage + 1}b{block + 1}", conv=layers.Conv2D)
    x = layers.GlobalAveragePooling2D(name="pool")(x)
    outputs = layers.Dense(num_classes, name="head")(x)
    return keras.Model(inputs, outputs, name=name)
