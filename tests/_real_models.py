"""Models people train, built small: keras.applications, stock-layer and
custom-layer Transformers, dict inputs, a subclassed model. Shared by the
real-model tests and the `tf-hwopt` overhead measurement in the closing note."""

import keras
import numpy as np

VOCAB, SEQ = 40, 16


def mobilenet_v2():
    return keras.applications.MobileNetV2(input_shape=(32, 32, 3), alpha=0.35, weights=None, classes=4)


def efficientnet_b0():
    return keras.applications.EfficientNetB0(input_shape=(32, 32, 3), weights=None, classes=4)


def resnet50_v2():
    return keras.applications.ResNet50V2(input_shape=(32, 32, 3), weights=None, classes=4)


def stock_transformer_lm(pre_ln: bool, blocks: int = 2, dim: int = 32, float_ids: bool = False,
                         residual_ops: bool = False):
    """A character LM written with stock Keras layers only (no custom class).

    `residual_ops`: the residuals written `h + a` (a `keras.ops` operation in
    the graph, not a layer) instead of `keras.layers.Add`."""
    add = (lambda pair: pair[0] + pair[1]) if residual_ops else (lambda pair: keras.layers.Add()(pair))
    ids = keras.Input((SEQ,), dtype="float32" if float_ids else "int32", name="ids")
    h = keras.layers.Embedding(VOCAB, dim, name="embed")(ids)
    for _ in range(blocks):
        if pre_ln:
            a = keras.layers.LayerNormalization()(h)
            a = keras.layers.MultiHeadAttention(2, dim // 2)(a, a, use_causal_mask=True)
            h = add([h, a])
            f = keras.layers.LayerNormalization()(h)
            f = keras.layers.Dense(2 * dim, activation="gelu")(f)
            f = keras.layers.Dense(dim)(f)
            h = add([h, f])
        else:
            a = keras.layers.MultiHeadAttention(2, dim // 2)(h, h, use_causal_mask=True)
            h = keras.layers.LayerNormalization()(add([h, keras.layers.Dropout(0.1)(a)]))
            f = keras.layers.Dense(2 * dim, activation="relu")(h)
            f = keras.layers.Dense(dim)(f)
            h = keras.layers.LayerNormalization()(add([h, f]))
    if pre_ln:
        h = keras.layers.LayerNormalization()(h)
    return keras.Model(ids, keras.layers.Dense(VOCAB, name="logits")(h))


def dict_input_model():
    signal = keras.Input((24,), name="signal")
    meta = keras.Input((4,), name="meta")
    h = keras.layers.Dense(32, activation="relu", name="signal_dense")(signal)
    h = keras.layers.Concatenate(name="join")([h, meta])
    h = keras.layers.Dense(32, activation="relu", name="mid")(h)
    return keras.Model({"signal": signal, "meta": meta}, keras.layers.Dense(4, name="head")(h))


def lambda_cnn():
    """A CNN with Python lambdas in `Lambda` layers (keras.ops inside, an `arguments` dict)."""
    i = keras.Input((32, 32, 3))
    h = keras.layers.Lambda(lambda t: t / 2.0 - 0.5, name="scale")(i)
    h = keras.layers.Conv2D(8, 3, padding="same", activation="relu", name="c1")(h)
    h = keras.layers.Lambda(lambda t, s: keras.ops.relu(t - s), arguments={"s": 0.1}, name="shift")(h)
    h = keras.layers.Conv2D(8, 3, padding="same", activation="relu", name="c2")(h)
    h = keras.layers.GlobalAveragePooling2D()(h)
    return keras.Model(i, keras.layers.Dense(4, name="head")(h))


def two_head_cnn():
    """A CNN with a dict of two outputs (a class and a value), as multi-task models are written."""
    i = keras.Input((32, 32, 3), name="img")
    h = keras.layers.Conv2D(8, 3, activation="relu", name="c1")(i)
    h = keras.layers.BatchNormalization(name="bn1")(h)
    h = keras.layers.Conv2D(8, 3, activation="relu", name="c2")(h)
    h = keras.layers.GlobalAveragePooling2D()(h)
    return keras.Model(i, {"label": keras.layers.Dense(4, name="label")(h), "value": keras.layers.Dense(1, name="value")(h)})


_WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta"]


def text_data(n=256, seed=0):
    """Sentences of 6 words and whether "alpha" is among them."""
    rng = np.random.RandomState(seed)
    texts = np.array([" ".join(rng.choice(_WORDS, 6)) for _ in range(n)])
    return texts[:, None], np.array(["alpha" in t for t in texts], "int32")


def text_classifier(texts):
    """Raw strings in, `TextVectorization` adapted to `texts` inside the model (as Keras's text examples export it)."""
    vectorize = keras.layers.TextVectorization(max_tokens=16, output_sequence_length=6, name="vectorize")
    vectorize.adapt(texts)
    x = keras.Input((1,), dtype="string")
    h = keras.layers.Embedding(16, 8, name="embed")(vectorize(x))
    h = keras.layers.Conv1D(8, 3, activation="relu", name="conv")(h)
    h = keras.layers.Dense(8, activation="relu", name="mid")(keras.layers.GlobalAveragePooling1D()(h))
    return keras.Model(x, keras.layers.Dense(2, name="head")(h))


class SubclassedMLP(keras.Model):
    """Written the way users write them: layers in __init__, never built before fit."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.d1 = keras.layers.Dense(32, activation="relu", name="d1")
        self.d2 = keras.layers.Dense(32, activation="relu", name="d2")
        self.out = keras.layers.Dense(4, name="out")

    def call(self, x):
        return self.out(self.d2(self.d1(x)))


def image_data(n=128, seed=0, scale=1.0):
    rng = np.random.RandomState(seed)
    y = rng.randint(0, 4, n)
    x = rng.normal(0, 1, (n, 32, 32, 3)).astype("float32") + y[:, None, None, None] * 0.5
    return x * scale, y


def token_data(n=256, seed=0):
    rng = np.random.RandomState(seed)
    seqs = (np.arange(SEQ + 1)[None, :] * rng.randint(1, 4, (n, 1)) + rng.randint(0, VOCAB, (n, 1))) % VOCAB
    return seqs[:, :-1].astype("int32"), seqs[:, 1:].astype("int32")


def dict_data(n=256, seed=0):
    rng = np.random.RandomState(seed)
    y = rng.randint(0, 4, n)
    x = {
        "signal": (rng.rand(n, 24) + y[:, None] * 0.1).astype("float32"),
        "meta": rng.rand(n, 4).astype("float32"),
    }
    return x, y


def vector_data(n=256, seed=0):
    rng = np.random.RandomState(seed)
    y = rng.randint(0, 4, n)
    return (rng.rand(n, 8) + y[:, None] * 0.2).astype("float32"), y
