"""The freezing benchmark's workloads: real data, fixed recipes, two sizes.

A `Workload` is everything a run needs besides the strategy: data, model
builder, loss, metric, epochs, batch size and learning rate. Every strategy
of a workload trains through `tf_hwopt.demo.train_timed` with the same
seed, so runs differ only by their freezing callback.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import keras

from tf_hwopt.data import load_mnist1d, load_stdlib_chars
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


def charlm_workload(profile: str = "full") -> Workload:
    """A 4-block character Transformer on the standard library's source.

    Validation is on held-out files; the metric is validation loss in bits
    per character.
    """
    _check_profile(profile)
    seq_len = 64
    if profile == "full":
        train_chars, val_chars, epochs = 320_000, 100_000, 6
    else:
        train_chars, val_chars, epochs = 40_000, 12_000, 1
    data = load_stdlib_chars(seq_len, max_train_chars=train_chars, max_val_chars=val_chars)
    return Workload(
        name="charlm",
        metric="loss",
        data=data,
        build_model=lambda: char_transformer(seq_len=seq_len, num_blocks=4),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        epochs=epochs,
        batch_size=64,
        learning_rate=2e-3,
        loss_scale=1.0 / math.log(2.0),
        unit="bits/char",
        description=(
            f"char Transformer (4 blocks, d=64), Python stdlib source, "
            f"{len(data[0][1]) * seq_len} train / {len(data[1][1]) * seq_len} held-out chars"
        ),
    )


WORKLOADS = {"mnist1d": mnist1d_workload, "charlm": charlm_workload}
