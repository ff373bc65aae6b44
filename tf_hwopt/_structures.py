"""Rows of nested inputs as `model.fit` takes them: arrays, tensors, pandas, lists and dicts of them."""

from __future__ import annotations

import numpy as np

import keras


def take(structure, index):
    """`a[index]` for every array of `structure` (pandas columns through `.to_numpy()`).

    Example:
    >>> take({"a": np.arange(4), "b": np.ones((4, 2))}, slice(0, 2))["a"]
    array([0, 1])
    """

    def one(a):
        if hasattr(a, "to_numpy"):  # pandas DataFrame / Series
            a = a.to_numpy()
        return a[index]

    return keras.tree.map_structure(one, structure)


def num_examples(structure) -> int:
    """The first dimension shared by every array of `structure`.

    Raises:
        ValueError: when the arrays' first dimensions differ.
    """
    sizes = {int(np.shape(a)[0]) for a in keras.tree.flatten(structure)}
    if len(sizes) != 1:
        raise ValueError(f"The inputs' first dimensions differ: {sorted(sizes)}.")
    return sizes.pop()
