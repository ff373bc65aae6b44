"""The training harness every compared run goes through (benchmarks and the demo).

Same seed (initial weights, data order: `epoch_dataset`), same Adam + cosine schedule, same
epochs; the runs differ only by their callbacks. `EpochClock` records wall
and process CPU time per epoch.
"""

from __future__ import annotations

import time

import keras
import numpy as np

from tf_hwopt.training.cache import epoch_dataset


class EpochClock(keras.callbacks.Callback):
    """Records wall and process CPU time at each epoch end, from train begin,
    and the epoch's validation logs.

    Example:
    >>> clock = EpochClock()
    >>> model.fit(x, y, epochs=3, validation_data=(x_val, y_val), callbacks=[clock])
    >>> clock.wall  # cumulative seconds at the end of epochs 1, 2, 3
    >>> clock.val["val_loss"]  # one value per epoch
    """

    def __init__(self):
        super().__init__()
        self._wall0 = None

    def on_train_begin(self, logs=None):
        # Started once: a run made of several fits (one per phase) has one clock.
        if self._wall0 is None:
            self.wall, self.cpu, self.val = [], [], {}
            self._wall0, self._cpu0 = time.perf_counter(), time.process_time()

    def on_epoch_end(self, epoch, logs=None):
        self.wall.append(time.perf_counter() - self._wall0)
        self.cpu.append(time.process_time() - self._cpu0)
        for key, value in (logs or {}).items():
            if key.startswith("val_"):
                self.val.setdefault(key, []).append(float(value))

    @property
    def val_accuracy(self) -> list:
        return self.val.get("val_accuracy", [])


def compiled_model(build_model, num_examples: int, *, epochs: int, batch_size: int, loss, metrics=(),
                   learning_rate: float = 2e-3, seed: int = 0):
    """A model from `build_model()` under `seed`, compiled with Adam and a cosine
    decay over `epochs` of `num_examples` (the recipe every compared run shares)."""
    keras.utils.set_random_seed(seed)
    model = build_model()
    steps = epochs * int(np.ceil(num_examples / batch_size))
    model.compile(
        optimizer=keras.optimizers.Adam(keras.optimizers.schedules.CosineDecay(learning_rate, steps)),
        loss=loss,
        metrics=list(metrics),
    )
    return model


def train_timed(
    build_model,
    data,
    *,
    epochs: int,
    batch_size: int,
    loss,
    metrics=(),
    learning_rate: float = 2e-3,
    seed: int = 0,
    callbacks=(),
    verbose: int = 0,
):
    """Builds, compiles and fits a model under a fixed seed and LR schedule.

    Every run of a comparison goes through here, so that runs differ only by
    their callbacks: `keras.utils.set_random_seed(seed)` before building
    (same initial weights), Adam with a cosine decay over the whole run,
    validation at each epoch end, and the batches of `epoch_dataset` (the
    order `fit_with_cache` trains in, one iterator for the whole run: Keras's
    own array pipeline stands idle for seconds at random epoch starts, with
    or without a callback, which would drown the differences measured).

    Returns:
        `(model, clock)`, with the `EpochClock` of the run.
    """
    (x, y), validation = data
    model = compiled_model(build_model, len(y), epochs=epochs, batch_size=batch_size, loss=loss, metrics=metrics,
                           learning_rate=learning_rate, seed=seed)
    for callback in callbacks:
        if hasattr(callback, "provide_data"):
            callback.provide_data(x, y)  # the probe batch `fit_with_cache` would draw
    clock = EpochClock()
    model.fit(
        epoch_dataset(x, y, epochs=epochs, batch_size=batch_size, seed=seed),
        epochs=epochs,
        steps_per_epoch=int(np.ceil(len(y) / batch_size)),
        shuffle=False,
        validation_data=validation,
        callbacks=list(callbacks) + [clock],
        verbose=verbose,
    )
    return model, clock
