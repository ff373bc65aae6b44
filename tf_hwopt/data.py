"""Real data that works offline.

MNIST-1D (Greydanus 2020) is regenerated locally by the `mnist1d` package
from its templates; nothing is downloaded. The result is cached as `.npz`
under `$TF_HWOPT_CACHE` (default `~/.cache/tf_hwopt`) because generation
takes ~13 s for 50,000 examples.
"""

from __future__ import annotations

import os

import numpy as np


def _cache_dir() -> str:
    return os.environ.get("TF_HWOPT_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "tf_hwopt"))


def load_mnist1d(num_samples: int = 50_000, *, seed: int = 42, cache: bool = True):
    """MNIST-1D, regenerated offline.

    Args:
        num_samples: total examples; 80% train, 20% test (the package's split).
        seed: the generator's seed.
        cache: keep the generated arrays on disk for the next call.

    Returns:
        `(x_train, y_train), (x_test, y_test)`, with `x` of shape `(n, 40, 1)`
        float32 and `y` int32 labels in 0..9.

    Example:
    >>> (x, y), (x_test, y_test) = load_mnist1d(50_000)
    >>> x.shape
    (40000, 40, 1)
    """
    if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 10:
        raise ValueError(f"`num_samples` must be an integer >= 10. Received: num_samples={num_samples!r}")
    path = os.path.join(_cache_dir(), f"mnist1d_{num_samples}_{seed}.npz")
    if cache and os.path.exists(path):
        with np.load(path) as f:
            return (f["x"], f["y"]), (f["x_test"], f["y_test"])
    from mnist1d.data import get_dataset_args, make_dataset

    args = get_dataset_args()
    args.num_samples = num_samples
    args.seed = seed
    data = make_dataset(args)
    x = data["x"].astype(np.float32)[..., None]
    x_test = data["x_test"].astype(np.float32)[..., None]
    y = data["y"].astype(np.int32)
    y_test = data["y_test"].astype(np.int32)
    if cache:
        os.makedirs(_cache_dir(), exist_ok=True)
        tmp = path + f".{os.getpid()}.tmp.npz"
        np.savez(tmp, x=x, y=y, x_test=x_test, y_test=y_test)
        os.replace(tmp, path)
    return (x, y), (x_test, y_test)
