"""Real data that works offline.

MNIST-1D (Greydanus 2020) is regenerated locally by the `mnist1d` package
from its templates; nothing is downloaded. The result is cached as `.npz`
under `$TF_HWOPT_CACHE` (default `~/.cache/tf_hwopt`) because generation
takes ~13 s for 50,000 examples. The other sources ship with what is
installed: the Python standard library's source and `pydoc_data` prose
(character language models), scikit-learn's 8x8 digits (images).
"""

from __future__ import annotations

import os

import numpy as np


def cache_dir() -> str:
    """Where generated data and pretrained weights are kept: `$TF_HWOPT_CACHE`, default `~/.cache/tf_hwopt`."""
    return os.environ.get("TF_HWOPT_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "tf_hwopt"))


def load_mnist1d(
    num_samples: int = 50_000,
    *,
    seed: int = 42,
    corr_noise_scale: float | None = None,
    iid_noise_scale: float | None = None,
    shear_scale: float | None = None,
    cache: bool = True,
):
    """MNIST-1D, regenerated offline.

    Args:
        num_samples: total examples; 80% train, 20% test (the package's split).
        seed: the generator's seed.
        corr_noise_scale, iid_noise_scale, shear_scale: the generator's
            distortions (None: the package's defaults, 0.25, 0.02 and 0.75);
            larger values give a shifted variant (the fine-tuning benchmark).
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
    distortions = {"corr_noise_scale": corr_noise_scale, "iid_noise_scale": iid_noise_scale, "shear_scale": shear_scale}
    distortions = {k: float(v) for k, v in distortions.items() if v is not None}
    suffix = "".join(f"_{k.split('_')[0]}{v:g}" for k, v in sorted(distortions.items()))
    path = os.path.join(cache_dir(), f"mnist1d_{num_samples}_{seed}{suffix}.npz")
    if cache and os.path.exists(path):
        with np.load(path) as f:
            return (f["x"], f["y"]), (f["x_test"], f["y_test"])
    from mnist1d.data import get_dataset_args, make_dataset

    args = get_dataset_args()
    args.num_samples = num_samples
    args.seed = seed
    for key, value in distortions.items():
        setattr(args, key, value)
    data = make_dataset(args)
    x = data["x"].astype(np.float32)[..., None]
    x_test = data["x_test"].astype(np.float32)[..., None]
    y = data["y"].astype(np.int32)
    y_test = data["y_test"].astype(np.int32)
    if cache:
        os.makedirs(cache_dir(), exist_ok=True)
        tmp = path + f".{os.getpid()}.tmp.npz"
        np.savez(tmp, x=x, y=y, x_test=x_test, y_test=y_test)
        os.replace(tmp, path)
    return (x, y), (x_test, y_test)


def _stdlib_sources() -> list:
    """The standard library's top-level `.py` files, sorted by name."""
    import glob
    import sysconfig

    root = sysconfig.get_paths()["stdlib"]
    return sorted(glob.glob(os.path.join(root, "*.py")))


def encode_chars(text: str) -> np.ndarray:
    """Characters to ids: ASCII keeps its code (0..127); anything else is 0.

    Example:
    >>> encode_chars("ab\\u00e9").tolist()
    [97, 98, 0]
    """
    codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
    return np.where(codes < 128, codes, 0).astype(np.int32)


def load_stdlib_chars(
    seq_len: int = 128,
    *,
    max_train_chars: int | None = None,
    max_val_chars: int | None = None,
    val_every: int = 10,
):
    """Character language-model data from the Python standard library's own source.

    The text of the interpreter's top-level standard-library `.py` files
    (sorted by name; every `val_every`-th file held out for validation) is
    encoded as ASCII ids (see `encode_chars`) and cut into non-overlapping
    windows of `seq_len + 1` characters: inputs are the first `seq_len`,
    targets the same shifted by one. Real text, present on every machine
    that runs Python, nothing downloaded.

    Returns:
        `(x_train, y_train), (x_val, y_val)`, int32 arrays of shape
        `(n, seq_len)`.

    Example:
    >>> (x, y), (x_val, y_val) = load_stdlib_chars(128, max_train_chars=1_000_000)
    >>> bool((x[:, 1:] == y[:, :-1]).all())
    True
    """
    _check_window_args(seq_len, val_every)
    files = _stdlib_sources()
    if len(files) < val_every:
        raise RuntimeError(f"Found only {len(files)} standard-library .py files; expected at least {val_every}.")
    train, val = [], []
    for i, path in enumerate(files):
        with open(path, encoding="utf-8", errors="replace") as f:
            (val if i % val_every == val_every - 1 else train).append(f.read())

    return _windows(train, seq_len, max_train_chars), _windows(val, seq_len, max_val_chars)


def load_prose_chars(
    seq_len: int = 128,
    *,
    max_train_chars: int | None = None,
    max_val_chars: int | None = None,
    val_fraction: float = 0.1,
):
    """Character language-model data from English prose that ships with Python.

    The text of `pydoc_data.topics` (the language reference's topics that
    `help()` shows, about 465,000 characters), topics sorted by name; the
    last `val_fraction` of the text (the last topics) is held out. Windows
    as in `load_stdlib_chars`. Prose, where `load_stdlib_chars` is code: the
    fine-tuning benchmark pretrains on one and fine-tunes on the other.

    Returns:
        `(x_train, y_train), (x_val, y_val)`, int32 arrays of shape `(n, seq_len)`.

    Example:
    >>> (x, y), (x_val, y_val) = load_prose_chars(64, max_train_chars=200_000)
    """
    _check_window_args(seq_len, 2)
    if not isinstance(val_fraction, float) or not 0 < val_fraction < 1:
        raise ValueError(f"`val_fraction` must be a float in (0, 1). Received: val_fraction={val_fraction!r}")
    from pydoc_data.topics import topics

    text = "\n".join(topics[key] for key in sorted(topics))
    split = int(len(text) * (1 - val_fraction))
    return _windows([text[:split]], seq_len, max_train_chars), _windows([text[split:]], seq_len, max_val_chars)


def load_digits_images(size: int = 32, *, test_fraction: float = 0.2, seed: int = 0):
    """scikit-learn's bundled handwritten digits as small RGB images.

    The 1,797 real 8x8 digits of `sklearn.datasets.load_digits` (shipped
    with scikit-learn, nothing downloaded), scaled to [0, 1], enlarged to
    `size` x `size` by pixel repetition and repeated over 3 channels, so that
    image models built for RGB input (`keras.applications`) take them.
    A fixed shuffle (`seed`) holds out `test_fraction` of them.

    Returns:
        `(x_train, y_train), (x_test, y_test)`: float32 images of shape
        `(n, size, size, 3)` and int32 labels in 0..9.

    Example:
    >>> (x, y), (x_test, y_test) = load_digits_images(32)
    >>> x.shape, x_test.shape
    ((1438, 32, 32, 3), (359, 32, 32, 3))
    """
    if isinstance(size, bool) or not isinstance(size, int) or size < 8 or size % 8:
        raise ValueError(f"`size` must be a multiple of 8 (the digits are 8x8). Received: size={size!r}")
    if not isinstance(test_fraction, float) or not 0 < test_fraction < 1:
        raise ValueError(f"`test_fraction` must be a float in (0, 1). Received: test_fraction={test_fraction!r}")
    from sklearn.datasets import load_digits

    digits = load_digits()
    scale = size // 8
    images = (digits.images / 16.0).astype(np.float32)
    images = images.repeat(scale, axis=1).repeat(scale, axis=2)
    x = np.repeat(images[..., None], 3, axis=-1)
    y = digits.target.astype(np.int32)
    order = np.random.RandomState(seed).permutation(len(y))
    split = len(y) - int(round(test_fraction * len(y)))
    train, test = order[:split], order[split:]
    return (x[train], y[train]), (x[test], y[test])


def _check_window_args(seq_len, val_every) -> None:
    for name, value in (("seq_len", seq_len), ("val_every", val_every)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 2:
            raise ValueError(f"`{name}` must be an integer >= 2. Received: {name}={value!r}")


def _windows(texts, seq_len: int, limit):
    """Inputs and next-character targets: non-overlapping windows of `seq_len + 1` characters."""
    ids = encode_chars("\n".join(texts))
    if limit is not None:
        ids = ids[:limit]
    n = (len(ids) - 1) // seq_len
    if n < 1:
        raise ValueError(f"Not enough text for one window of {seq_len} characters.")
    x = ids[: n * seq_len].reshape(n, seq_len)
    y = ids[1 : n * seq_len + 1].reshape(n, seq_len)
    return x, y
