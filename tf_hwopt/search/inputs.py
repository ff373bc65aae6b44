"""One training batch from what `model.fit` is given, to time the step that will train.

A candidate is timed on a batch of the input it trains on, at the batch size
it trains with: the `batch_size` passed to `fit` (by `search(...)` or by a
`HyperModel.fit` that picks it, e.g. `hp.Choice("batch_size", ...)`), or the
batch a `tf.data.Dataset` or `keras.utils.PyDataset` yields. Taking the batch
never consumes the user's data: a dataset is read through a fresh iterator, a
`PyDataset` by index. A Python generator or iterator cannot be read without
taking a batch from training, so it cannot be timed: `check_timeable` says so
before any trial starts.

Example:
>>> batch = timing_batch((x, y), {"batch_size": 64})       # NumPy: the first 64 rows
>>> batch = timing_batch((train_ds,), {})                  # a batched tf.data.Dataset
"""

from __future__ import annotations

import collections.abc

import keras
import tensorflow as tf

from tf_hwopt._structures import num_examples, take

_DEFAULT_BATCH_SIZE = 32  # `model.fit`'s own default


def _fit_arg(args, kwargs, index: int, name: str):
    if name in kwargs:
        return kwargs[name]
    return args[index] if len(args) > index else None


def _is_untimeable(x) -> bool:
    """A generator or one-shot iterator: reading a batch would take it from training."""
    if isinstance(x, (tf.data.Dataset, keras.utils.PyDataset)):
        return False
    return isinstance(x, collections.abc.Iterator)


def check_timeable(args, kwargs, *, component: str = "LatencyAwareTuner.search") -> None:
    """Raises `ValueError` before any trial when the training input cannot be timed.

    Args:
        args, kwargs: what `search` was given (as `model.fit`'s arguments).
        component: named in the error.
    """
    x = _fit_arg(args, kwargs, 0, "x")
    if x is None:
        raise ValueError(
            f"{component} needs the training input `x` (as for `model.fit`) to time each candidate "
            "on the batch it trains with."
        )
    if _is_untimeable(x):
        raise ValueError(
            f"{component} cannot time candidates on `x` of type {type(x).__name__}: a Python generator or "
            "iterator would lose the batch taken for timing. Pass a tf.data.Dataset, a keras.utils.PyDataset "
            "or arrays instead."
        )


def timing_batch(args, kwargs) -> tuple:
    """The first batch `model.fit(*args, **kwargs)` would train on, as `(x, y, sample_weight)`.

    `y` and `sample_weight` are `None` where the input has none. Arrays (NumPy,
    tensors, dicts and lists of them, pandas) give their first `batch_size`
    rows (default 32, as `fit`); a `tf.data.Dataset` its first element (a
    batched dataset's batch), a `PyDataset` its item 0.

    Raises:
        ValueError: for an input that cannot be timed (see `check_timeable`).
    """
    check_timeable(args, kwargs, component="tf_hwopt.search.timing_batch")
    x = _fit_arg(args, kwargs, 0, "x")
    if isinstance(x, tf.data.Dataset):
        element = next(iter(x.take(1)))
        return keras.utils.unpack_x_y_sample_weight(element)
    if isinstance(x, keras.utils.PyDataset):
        return keras.utils.unpack_x_y_sample_weight(x[0])
    y = _fit_arg(args, kwargs, 1, "y")
    sample_weight = kwargs.get("sample_weight")
    size = _fit_arg(args, kwargs, 2, "batch_size") or _DEFAULT_BATCH_SIZE
    rows = slice(0, min(int(size), num_examples(x)))  # fewer rows than a batch: fit trains on them all
    return (
        take(x, rows),
        None if y is None else take(y, rows),
        None if sample_weight is None else take(sample_weight, rows),
    )


def batch_size_of(batch) -> int:
    """The number of examples in a batch from `timing_batch`."""
    return num_examples(batch[0])
