"""Pretrained weights for the fine-tuning workloads, built once and kept on disk.

A fine-tuning workload starts from a model pretrained on another task. The
pretraining is not what the benchmark measures, so it runs once: its weights
are saved under the cache directory (`tf_hwopt.data.cache_dir()`), in a file
named after a hash of the *recipe* (every argument of the pretraining:
data, model, epochs, learning rate, seed, and a format version). The same
recipe finds the file and reuses it; any change of recipe gets a new file
and pretrains again. Files are written atomically, so a run killed while
saving leaves no half-written weights behind.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Callable

import keras

from tf_hwopt.data import cache_dir

# Bump when what a recipe means changes without its arguments changing.
_FORMAT_VERSION = 1


def recipe_key(recipe: dict) -> str:
    """A short, stable hash of a JSON-serialisable recipe.

    Example:
    >>> recipe_key({"epochs": 3}) == recipe_key({"epochs": 3})
    True
    >>> recipe_key({"epochs": 3}) == recipe_key({"epochs": 4})
    False
    """
    text = json.dumps({"version": _FORMAT_VERSION, **recipe}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def pretrained_weights(
    name: str, recipe: dict, pretrain: Callable[[], keras.Model], *, directory: str | None = None
) -> str:
    """The path of `name`'s pretrained weights for `recipe`, pretraining first if they are not on disk.

    Args:
        name: the workload's name (the file's prefix).
        recipe: everything the pretraining depends on (JSON-serialisable).
        pretrain: builds and trains the model; called only when the file for
            this recipe is missing.
        directory: where weights are kept (default: `cache_dir()/pretrained`).

    Returns:
        The `.weights.h5` path.

    Example:
    >>> path = pretrained_weights("finetune-mnist1d", recipe, lambda: train_base(recipe))
    >>> model.load_weights(path)
    """
    directory = directory or os.path.join(cache_dir(), "pretrained")
    path = os.path.join(directory, f"{name}-{recipe_key(recipe)}.weights.h5")
    if os.path.exists(path):
        return path
    model = pretrain()
    os.makedirs(directory, exist_ok=True)
    tmp = f"{path[: -len('.weights.h5')]}.{os.getpid()}.tmp.weights.h5"
    model.save_weights(tmp)
    os.replace(tmp, path)
    with open(path[: -len(".weights.h5")] + ".json", "w") as f:
        json.dump({"name": name, "recipe": recipe, "version": _FORMAT_VERSION}, f, indent=2, default=str)
    return path
