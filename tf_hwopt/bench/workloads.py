"""The freezing benchmark's workloads: real data, fixed recipes, two sizes.

A `Workload` is everything a run needs besides the strategy: data, model
builder, loss, metric, epochs, batch size and learning rate. Every strategy
of a workload trains through `tf_hwopt.bench.harness.train_timed` with the
same seed, so runs differ only by their freezing callback.

Training from scratch: `mnist1d`, `charlm` (and `charlm-long`, 12 epochs,
on request). Fine-tuning, where users freeze layers most: `finetune-mnist1d`
(the 1D ResNet pretrained on MNIST-1D, fine-tuned with a fresh head on a
shifted variant: more noise and shear, permuted labels, another seed) and
`finetune-charlm` (the char Transformer pretrained on the standard library's
source, fine-tuned on the prose of `pydoc_data`). Pretrained weights are
built once and kept on disk (`tf_hwopt.bench.pretrained`); building them is
not part of any timing. A large model, on request: `digits-resnet50v2`
(`keras.applications.ResNet50V2`, 23.5M weights, on scikit-learn's digits),
for Egeria's costs where a train-function trace takes seconds.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import keras
import numpy as np

from tf_hwopt.bench.harness import compiled_model
from tf_hwopt.bench.pretrained import pretrained_weights
from tf_hwopt.data import load_digits_images, load_mnist1d, load_prose_chars, load_stdlib_chars
from tf_hwopt.models import char_transformer, resnet1d

PROFILES = ("quick", "full")


@dataclasses.dataclass
class Workload:
    """One training task of the benchmark.

    Attributes:
        name: the key in the results.
        metric: `"accuracy"` (higher is better, from `val_accuracy`) or
            `"loss"` (lower is better, from `val_loss` times `loss_scale`).
        data: `((x, y), (x_val, y_val))`.
        build_model: a function returning a fresh, uncompiled model.
        loss: the Keras loss.
        epochs, batch_size, learning_rate: the recipe (Adam, cosine decay).
        loss_scale: turns `val_loss` into the reported unit (1/ln 2 for bits).
        unit: the reported unit, for tables and plots.
        description: one line for the README table.
    """

    name: str
    metric: str
    data: tuple
    build_model: Callable[[], keras.Model]
    loss: object
    epochs: int
    batch_size: int
    learning_rate: float
    loss_scale: float = 1.0
    unit: str = ""
    description: str = ""
    pretrained: str | None = None

    @property
    def keras_metrics(self) -> list:
        return ["accuracy"] if self.metric == "accuracy" else []

    def metric_curve(self, clock) -> list:
        """The workload's metric at each epoch end, from an `EpochClock`."""
        if self.metric == "accuracy":
            return list(clock.val["val_accuracy"])
        return [v * self.loss_scale for v in clock.val["val_loss"]]


def _check_profile(profile: str) -> None:
    if profile not in PROFILES:
        raise ValueError(f"`profile` must be one of {PROFILES}. Received: profile={profile!r}")


def mnist1d_workload(profile: str = "full") -> Workload:
    """A 1D ResNet on MNIST-1D (40,000 training examples in `full`)."""
    _check_profile(profile)
    samples, epochs = (50_000, 10) if profile == "full" else (3_000, 2)
    data = load_mnist1d(samples)
    return Workload(
        name="mnist1d",
        metric="accuracy",
        data=data,
        build_model=resnet1d,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        epochs=epochs,
        batch_size=256 if profile == "full" else 128,
        learning_rate=2e-3,
        unit="accuracy",
        description=f"1D ResNet (6 modules), MNIST-1D, {len(data[0][1])} train / {len(data[1][1])} test",
    )


_SEQ_LEN = 64


def _charlm_sizes(profile: str) -> tuple:
    """Training characters, validation characters and epochs of the char LM recipes."""
    return (320_000, 100_000, 6) if profile == "full" else (40_000, 12_000, 1)


def _char_model() -> keras.Model:
    return char_transformer(seq_len=_SEQ_LEN, num_blocks=4)


def _char_lm_workload(name, data, build_model, *, epochs, learning_rate, corpus, pretrained=None) -> Workload:
    """A char Transformer workload: validation loss in bits per character, batch 64."""
    return Workload(
        name=name,
        metric="loss",
        data=data,
        build_model=build_model,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        epochs=epochs,
        batch_size=64,
        learning_rate=learning_rate,
        loss_scale=1.0 / math.log(2.0),
        unit="bits/char",
        description=f"{corpus}, {len(data[0][1]) * _SEQ_LEN} train / {len(data[1][1]) * _SEQ_LEN} held-out chars",
        pretrained=pretrained,
    )


def charlm_workload(profile: str = "full", *, epochs: int | None = None, name: str = "charlm") -> Workload:
    """A 4-block character Transformer on the standard library's source.

    Validation is on held-out files; the metric is validation loss in bits
    per character. `epochs` overrides the profile's (6 in `full`).
    """
    _check_profile(profile)
    train_chars, val_chars, default_epochs = _charlm_sizes(profile)
    data = load_stdlib_chars(_SEQ_LEN, max_train_chars=train_chars, max_val_chars=val_chars)
    return _char_lm_workload(
        name, data, _char_model, epochs=epochs or default_epochs, learning_rate=2e-3,
        corpus="char Transformer (4 blocks, d=64), Python stdlib source",
    )


def charlm_long_workload(profile: str = "full") -> Workload:
    """`charlm` trained twice as long (12 epochs in `full`): where the deep blocks have time to settle."""
    _check_profile(profile)
    return charlm_workload(profile, epochs=12 if profile == "full" else 2, name="charlm-long")


def _pretrain(recipe: dict, build: Callable[[], keras.Model], data) -> keras.Model:
    (x, y), _ = data
    model = compiled_model(
        build,
        len(y),
        epochs=recipe["epochs"],
        batch_size=recipe["batch_size"],
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        learning_rate=recipe["learning_rate"],
        seed=recipe["seed"],
    )
    model.fit(x, y, batch_size=recipe["batch_size"], epochs=recipe["epochs"], verbose=0)
    return model


def _fresh_head(model: keras.Model, layer_name: str) -> None:
    """Re-initializes a Dense head (under the caller's seed), as a new task's head starts."""
    head = model.get_layer(layer_name)
    head.kernel.assign(head.kernel_initializer(head.kernel.shape))
    head.bias.assign(np.zeros(head.bias.shape, head.bias.dtype))


def finetune_mnist1d_workload(profile: str = "full") -> Workload:
    """The 1D ResNet pretrained on MNIST-1D, fine-tuned with a fresh head on a shifted variant.

    Shifted: more correlated and i.i.d. noise, more shear, another generator
    seed, and the labels permuted (a new task on the same kind of signal).
    40,000 examples (32,000 train, 2,500 steps in `full`): a fine-tuning run
    of a minute or two. With 10,000 (630 steps, 17 s of training) no freeze
    could repay its train-function rebuild before the end, and Egeria
    stepped back at its pre-flight.
    """
    _check_profile(profile)
    full = profile == "full"
    recipe = {
        "data": {"num_samples": 50_000 if full else 3_000, "seed": 42},
        "model": "resnet1d()",
        "epochs": 6 if full else 2,
        "batch_size": 256 if full else 128,
        "learning_rate": 2e-3,
        "seed": 0,
    }
    path = pretrained_weights(
        f"finetune-mnist1d-{profile}",
        recipe,
        lambda: _pretrain(recipe, resnet1d, load_mnist1d(**recipe["data"])),
    )
    (x, y), (x_test, y_test) = load_mnist1d(
        40_000 if full else 2_000, seed=7, corr_noise_scale=0.4, iid_noise_scale=0.05, shear_scale=1.0
    )
    permutation = np.random.RandomState(7).permutation(10).astype(np.int32)

    def build() -> keras.Model:
        model = resnet1d()
        model.load_weights(path)
        _fresh_head(model, "head")
        return model

    return Workload(
        name="finetune-mnist1d",
        metric="accuracy",
        data=((x, permutation[y]), (x_test, permutation[y_test])),
        build_model=build,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        epochs=10 if full else 2,
        batch_size=128,
        learning_rate=1e-3,
        unit="accuracy",
        description=(
            f"1D ResNet pretrained on MNIST-1D, fresh head; shifted MNIST-1D (noise, shear, permuted labels), "
            f"{len(y)} train / {len(y_test)} test"
        ),
        pretrained=path,
    )


def finetune_charlm_workload(profile: str = "full") -> Workload:
    """The char Transformer pretrained on the standard library's source, fine-tuned on `pydoc_data` prose."""
    _check_profile(profile)
    train_chars, val_chars, epochs = _charlm_sizes(profile)
    recipe = {
        "data": {"source": "stdlib", "seq_len": _SEQ_LEN, "max_train_chars": train_chars},
        "model": f"char_transformer(seq_len={_SEQ_LEN}, num_blocks=4)",
        "epochs": epochs,
        "batch_size": 64,
        "learning_rate": 2e-3,
        "seed": 0,
    }
    path = pretrained_weights(
        f"finetune-charlm-{profile}",
        recipe,
        lambda: _pretrain(
            recipe, _char_model, load_stdlib_chars(_SEQ_LEN, max_train_chars=train_chars, max_val_chars=1_000)
        ),
    )
    data = load_prose_chars(_SEQ_LEN, max_train_chars=train_chars, max_val_chars=val_chars)

    def build_pretrained() -> keras.Model:
        model = _char_model()
        model.load_weights(path)
        return model

    return _char_lm_workload(
        "finetune-charlm", data, build_pretrained, epochs=epochs, learning_rate=1e-3,
        corpus="char Transformer pretrained on the stdlib source, fine-tuned on pydoc_data prose",
        pretrained=path,
    )


def digits_resnet50v2_workload(profile: str = "full") -> Workload:
    """`keras.applications.ResNet50V2` (no pretrained weights) on scikit-learn's digits at 32x32.

    The model a user brings, at full size (23.5M weights, 18 modules): its
    train function takes 10-15 s to trace on a CPU, so every freeze costs
    that much once. 40 epochs of 23 steps in `full`.
    """
    _check_profile(profile)
    (x, y), test = load_digits_images(32)
    if profile == "quick":
        x, y = x[:256], y[:256]

    def build() -> keras.Model:
        return keras.applications.ResNet50V2(weights=None, input_shape=(32, 32, 3), classes=10, classifier_activation=None)

    return Workload(
        name="digits-resnet50v2",
        metric="accuracy",
        data=((x, y), test),
        build_model=build,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        epochs=40 if profile == "full" else 2,
        batch_size=64,
        learning_rate=1e-3,
        unit="accuracy",
        description=f"ResNet50V2 (keras.applications, 18 modules), digits at 32x32, {len(y)} train / {len(test[1])} test",
    )


WORKLOADS = {
    "mnist1d": mnist1d_workload,
    "charlm": charlm_workload,
    "finetune-mnist1d": finetune_mnist1d_workload,
    "finetune-charlm": finetune_charlm_workload,
    "charlm-long": charlm_long_workload,
    "digits-resnet50v2": digits_resnet50v2_workload,
}
#: What `tf-hwopt bench freezing` runs unless told otherwise (charlm-long and digits-resnet50v2 on request).
DEFAULT_WORKLOADS = ("mnist1d", "charlm", "finetune-mnist1d", "finetune-charlm")
