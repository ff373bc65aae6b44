"""Forward skipping: cache the frozen prefix's outputs and train only the suffix.

Freezing removes the backward pass of the frozen front modules; their forward
pass still runs every step. Once modules `0..k-1` are frozen, their output
for a given example never changes, so it is computed once, kept (in memory
or in a file), and the rest of training runs the suffix model (modules
`k..`) on the kept activations. This is Egeria's third mechanism.

Keras's `fit` cannot swap its own input pipeline mid-run, so caching is a
driver, `fit_with_cache`, that calls `model.fit` once per phase: the whole
model until the first freeze, then the suffix model on cached activations.
A phase ends at the end of the epoch in which the frozen prefix changed. The
suffix shares its layers, variables and optimizer with the model, so the
model the user holds is always the whole, trained model. Plain
`model.fit(..., callbacks=[EgeriaCallback()])` is unchanged and never
caches.

Validity. A cached activation is only right if the prefix computes the same
thing for an example every time:

- Random augmentation layers (`RandomFlip`, `RandomCrop`, `GaussianNoise`,
  ...) in a module that may freeze make caching wrong: `cache="memory"` or
  `"disk"` is refused, naming the layers; `cache="auto"` trains without a
  cache and warns.
- Stateless augmentation whose randomness is a function of the example
  (`preprocess(x_batch, example_ids)`) is supported: it is applied once when
  an example's activation is cached.
- Dropout in a frozen module runs as at inference (no dropout) once cached.

Order. The driver shuffles with a permutation of the example ids per epoch
drawn from `(seed, epoch)`, so runs with and without caching see the same
examples in the same order, and each example meets its own activation.
"""

from __future__ import annotations

import math
import os
import shutil
import tempfile
import time
import warnings
from typing import Callable, Sequence

import numpy as np

import keras
import tensorflow as tf

from tf_hwopt import _internals, _structures
from tf_hwopt._checks import check_positive_int
from tf_hwopt.freezing.callback import FreezingCallback
from tf_hwopt.freezing.modules import Module, partition_modules
from tf_hwopt.training.result import TrainingResult

CACHE_MODES = ("memory", "disk", "auto", None)
CACHE_DTYPES = ("float32", "float16", "bfloat16")
DEFAULT_CACHE_BUDGET = 2 * 2**30
# A cache extension pays only if at least this many epochs remain to read it.
_MIN_CACHED_EPOCHS = 2
# Regularisers that are off at inference: allowed in a cached prefix (they run as at inference).
_INFERENCE_IDENTITY = ("Dropout", "SpatialDropout1D", "SpatialDropout2D", "SpatialDropout3D",
                       "GaussianDropout", "AlphaDropout")
_AUGMENTATION = ("AugMix", "RandAugment", "CutMix", "MixUp", "Solarization", "GaussianNoise")


# ------------------------------------------------------------ pure helpers


def cache_bytes(num_examples: int, example_shape: Sequence[int], dtype: str = "float32") -> int:
    """Size of a cache of `num_examples` activations of `example_shape`.

    Example:
    >>> cache_bytes(40_000, (10, 64), "float16")
    51200000
    """
    if dtype not in CACHE_DTYPES:
        raise ValueError(f"`dtype` must be one of {CACHE_DTYPES}. Received: dtype={dtype!r}")
    itemsize = 4 if dtype == "float32" else 2
    return int(num_examples) * int(np.prod(example_shape)) * itemsize


def random_augmentation_layers(modules: Sequence[Module]) -> list[str]:
    """Names of layers in `modules` whose training-mode output is random augmentation."""
    found = []
    for module in modules:
        for layer in module.layers:
            kind = type(layer).__name__
            if kind in _INFERENCE_IDENTITY:
                continue
            if kind.startswith("Random") or kind in _AUGMENTATION:
                found.append(f"{layer.name} ({kind})")
    return found


def epoch_order(num_examples: int, epoch: int, seed: int | None) -> np.ndarray:
    """The example ids of one epoch, in training order (a permutation per `(seed, epoch)`).

    Example:
    >>> epoch_order(5, 0, None).tolist()
    [0, 1, 2, 3, 4]
    """
    if seed is None:
        return np.arange(num_examples)
    return np.random.default_rng([seed, epoch]).permutation(num_examples)


def cut_model(model: keras.Model, modules: Sequence[Module], start: int, stop: int) -> keras.Model:
    """The sub-model from the output of module `start - 1` (the inputs when
    `start == 0`) to the output of module `stop - 1` (the model's outputs
    when `stop == len(modules)`). It shares the model's layers and variables.
    """
    inputs = model.inputs if start == 0 else modules[start - 1].output_layer.output
    outputs = model.outputs if stop == len(modules) else modules[stop - 1].output_layer.output
    try:
        return keras.Model(inputs, outputs, name=f"{model.name}_modules_{start}_{stop}")
    except ValueError as err:
        raise ValueError(
            f"Modules {start}..{stop - 1} of {model.name!r} are not a self-contained sub-graph "
            f"(their input is not only the output of module {start - 1}); caching needs module "
            "boundaries at single tensors, as the automatic partition chooses them."
        ) from err


# ------------------------------------------------------------------- cache


class ActivationCache:
    """The frozen prefix's output for every training example, indexed by example id.

    In memory, the cache is one `tf.Variable` of `num_examples` rows, as wide
    as the largest activation it may hold, allocated at the first build and
    reused by every level: building and extending run inside TensorFlow
    (rows gathered, the new modules run, rows scattered back in place), and
    the training pipeline gathers its batches from the same variable. On
    disk, each level is a NumPy memory-mapped file.

    Args:
        model: the whole model.
        modules: its modules, front to back.
        x: training inputs: a NumPy array, or a list/dict of them (a model
            with several inputs).
        mode: `"memory"` or `"disk"` (a NumPy memory map in `directory`).
        dtype: storage dtype; `"float16"`/`"bfloat16"` halve the size.
        directory: where `"disk"` caches go (default: a temporary folder).
        preprocess: deterministic `fn(x_batch, ids) -> x_batch` applied
            before the prefix (`x_batch` structured as `x`).
        batch_size: examples per forward pass while building.

    Attributes:
        level: number of front modules whose output is cached (0: none).
        build_seconds: time spent building and extending.

    Example:
    >>> cache = ActivationCache(model, partition_modules(model), x)
    >>> cache.set_level(2)  # "built": outputs of modules 0 and 1
    >>> cache.set_level(3)  # "extended": only module 2 ran, on the cached rows
    >>> cache.lookup([0, 5]).shape
    """

    def __init__(self, model, modules, x, *, mode="memory", dtype="float32", directory=None, preprocess=None,
                 batch_size=1024):
        self.model, self.modules, self.x = model, list(modules), x
        self.mode, self.dtype = mode, dtype
        self.directory, self.preprocess, self.batch_size = directory, preprocess, batch_size
        self.level = 0
        self.build_seconds = 0.0
        self.builds = 0
        self.extensions = 0
        self._table = None  # memory: tf.Variable [num_examples, width]
        self._file = None  # disk: np.memmap of the current level
        self._tmpdir = None

    @property
    def num_examples(self) -> int:
        return _structures.num_examples(self.x)

    def _shape(self, level: int) -> tuple:
        return tuple(self.modules[level - 1].output_layer.output.shape[1:])

    def bytes_for(self, level: int) -> int:
        return cache_bytes(self.num_examples, self._shape(level), self.dtype)

    @property
    def nbytes(self) -> int:
        """Bytes held now (in memory: the whole table, sized for the widest level)."""
        if not self.level:
            return 0
        if self.mode == "memory":
            return int(self._table.shape[0] * self._table.shape[1] * self._table.dtype.size)
        return self.bytes_for(self.level)

    def set_level(self, level: int) -> str:
        """Makes the cache hold the output of modules `0..level-1`.

        Extends from the current level by running only the newly frozen
        modules on the cached activations; after a re-open (a lower level)
        the cache behind it is dropped and rebuilt from the inputs. Returns
        what was done: `"kept"`, `"extended"`, `"built"` or `"dropped"`.
        """
        if level == self.level:
            return "kept"
        start = time.perf_counter()
        if level == 0:
            action = "dropped"
            self._release()
        else:
            extend = level > self.level > 0
            begin = self.level if extend else 0
            sub = cut_model(self.model, self.modules, begin, level)
            fill = self._fill_memory if self.mode == "memory" else self._fill_disk
            fill(sub, begin, level)
            action = "extended" if extend else "built"
            self.extensions += extend
            self.builds += not extend
        self.level = level
        self.build_seconds += time.perf_counter() - start
        return action

    def _batches(self):
        n = self.num_examples
        for start in range(0, n, self.batch_size):
            yield np.arange(start, min(n, start + self.batch_size))

    def _raw_inputs(self, x, ids):
        batch = _structures.take(x, ids)
        return self.preprocess(batch, ids) if self.preprocess is not None else batch

    def _fill_memory(self, sub, begin, level):
        if self._table is None:
            width = max(int(np.prod(self._shape(i))) for i in range(1, len(self.modules)))
            self._table = tf.Variable(tf.zeros([self.num_examples, width], self.dtype), trainable=False,
                                      name="activation_cache")
        table, pad = self._table, self._table.shape[1] - int(np.prod(self._shape(level)))

        def write(ids, inputs):
            rows = tf.reshape(tf.cast(sub(inputs, training=False), table.dtype), [tf.shape(ids)[0], -1])
            table.scatter_update(tf.IndexedSlices(tf.pad(rows, [[0, 0], [0, pad]]), ids))

        if begin:  # extend: each batch's rows are read, then overwritten in place
            old = self._shape(begin)
            step = tf.function(
                lambda ids: write(ids, _unpack(tf.gather(table, ids), old)), reduce_retracing=True, autograph=False
            )
            for ids in self._batches():
                step(tf.constant(ids))
        else:
            step = tf.function(write, reduce_retracing=True, autograph=False)
            for ids in self._batches():
                step(tf.constant(ids), self._raw_inputs(self.x, ids))

    def _storage_dtype(self):
        if self.dtype == "bfloat16":
            import ml_dtypes

            return ml_dtypes.bfloat16
        return np.dtype(self.dtype)

    def _fill_disk(self, sub, begin, level):
        if self._tmpdir is None:
            self._tmpdir = tempfile.mkdtemp(prefix="tf_hwopt_cache_", dir=self.directory)
        path = os.path.join(self._tmpdir, f"level{level}_{time.monotonic_ns()}.npy")
        values = np.lib.format.open_memmap(path, mode="w+", dtype=self._storage_dtype(),
                                           shape=(self.num_examples,) + self._shape(level))
        forward = tf.function(lambda inputs: sub(inputs, training=False), reduce_retracing=True, autograph=False)
        for ids in self._batches():
            batch = self._file[ids[0] : ids[-1] + 1].astype(np.float32) if begin else self._raw_inputs(self.x, ids)
            values[ids[0] : ids[-1] + 1] = np.asarray(forward(batch)).astype(values.dtype)
        values.flush()
        self._release()
        self._file = values

    def _release(self):
        self._table = None
        if self._file is not None:
            path = self._file.filename
            self._file = None
            if path and os.path.exists(path):
                os.remove(path)

    def lookup(self, ids) -> np.ndarray:
        """Cached activations of examples `ids`, as float32."""
        return np.asarray(self.gather(tf.constant(np.asarray(ids, np.int64))))

    def gather(self, ids: tf.Tensor) -> tf.Tensor:
        """Cached activations of examples `ids` (a tensor), as float32; usable inside `tf.data`."""
        if self.level == 0:
            raise ValueError("The cache is empty: call `set_level(k)` with k > 0 first.")
        shape = self._shape(self.level)
        if self.mode == "memory":
            return _unpack(tf.gather(self._table, ids), shape)
        return _numpy_gather(lambda batch_ids: self._file[batch_ids], shape)(ids)

    def close(self) -> None:
        """Frees the memory and deletes the files of the cache."""
        self._release()
        self.level = 0
        if self._tmpdir and os.path.exists(self._tmpdir):
            shutil.rmtree(self._tmpdir, ignore_errors=True)
        self._tmpdir = None


# ------------------------------------------------------------------ driver


def _unpack(rows: tf.Tensor, shape: Sequence[int]) -> tf.Tensor:
    """Table rows (flattened, padded to the table's width) back to float32 activations of `shape`."""
    width = int(np.prod(shape))
    return tf.reshape(tf.cast(rows[:, :width], tf.float32), [-1, *shape])


def _array_gather(array: np.ndarray) -> Callable:
    """`ids -> array[ids]` inside TensorFlow's graph, the array held once in a variable.

    A variable, not a captured constant: a constant captured by a tf.data
    function is copied into every call.
    """
    table = tf.Variable(array, trainable=False, name="resident")

    def gather(ids):
        x = tf.gather(table, ids)
        return tf.cast(x, tf.float32) if x.dtype.is_floating else x

    return gather


def _structure_gather(structure) -> Callable:
    """`ids -> structure[ids]` for an array or a list/dict of them (`_array_gather` on each)."""
    gathers = keras.tree.map_structure(_array_gather, structure)
    return lambda ids: keras.tree.map_structure(lambda gather: gather(ids), gathers)


def _numpy_gather(fn: Callable, shape: Sequence[int] | None = None) -> Callable:
    """`ids -> fn(ids)` for a NumPy function (a file-backed cache, per-example preprocessing).

    Without `shape`, `fn` may return a list/dict of arrays; one call on one
    id gives their structure, shapes and dtypes.
    """
    if shape is None:
        sample = keras.tree.map_structure(np.asarray, fn(np.arange(1)))
    else:
        sample = np.zeros((1, *shape), np.float32)
    leaves = keras.tree.flatten(sample)
    dtypes = [tf.float32 if a.dtype.kind == "f" else tf.as_dtype(a.dtype) for a in leaves]

    def call(batch_ids):
        flat = keras.tree.flatten(fn(batch_ids))
        return [np.asarray(a).astype(d.as_numpy_dtype) for a, d in zip(flat, dtypes)]

    def gather(ids):
        flat = tf.numpy_function(call, [ids], dtypes, stateful=False)
        for tensor, a in zip(flat, leaves):
            tensor.set_shape((None, *a.shape[1:]))
        return keras.tree.pack_sequence_as(sample, flat)

    return gather


def cached_dataset(num_examples, epochs, seed, batch_size, gather, labels):
    """Batches `(gather(ids), labels[ids])` of epochs `epochs`, in `epoch_order`, prefetched.

    `gather` maps a tensor of example ids to their features inside the
    pipeline (`_array_gather`, `_numpy_gather`, `ActivationCache.gather`).
    """
    ids = np.concatenate([epoch_order(num_examples, e, seed) for e in epochs]).astype(np.int64)
    # Batch each epoch on its own, so that a short last batch stays in its epoch.
    bounds = [b for e in range(len(epochs)) for b in range(e * num_examples, (e + 1) * num_examples, batch_size)]
    splits = tf.constant(np.asarray(bounds + [len(ids)], np.int64))
    ids_t = tf.Variable(ids, trainable=False, name="example_ids")
    # One array, or a list/dict of them (a model with several outputs).
    labels_of = _structure_gather(labels)

    def load(i):
        batch_ids = ids_t[splits[i] : splits[i + 1]]
        return gather(batch_ids), labels_of(batch_ids)

    # Fixed parallelism, autotuning off: a batch is one gather, and a phase's
    # fit stops early, which tears the iterator down (measured: up to 20 s
    # waiting for the autotuned pipeline's threads).
    dataset = tf.data.Dataset.range(len(bounds)).map(load, num_parallel_calls=2).prefetch(2)
    options = tf.data.Options()
    options.autotune.enabled = False
    return dataset.with_options(options)


def epoch_dataset(x, y, *, epochs: int, batch_size: int, seed: int | None) -> tf.data.Dataset:
    """All `epochs` of `(x, y)` as one finite dataset, each epoch in `epoch_order`.

    The pipeline `fit_with_cache` trains its uncached phase on, for a plain
    `model.fit` that should see the same batches: pass it with
    `steps_per_epoch=ceil(len(y) / batch_size)` and `shuffle=False`. Keras
    then keeps one iterator for the whole run; given arrays (or a finite
    dataset without `steps_per_epoch`) it makes a new autotuned iterator each
    epoch, and on Keras 3.15 / TensorFlow 2.21 releasing the old one
    sometimes stands idle for seconds (docs/benchmarks.md).

    Example:
    >>> data = epoch_dataset(x, y, epochs=3, batch_size=32, seed=0)
    >>> model.fit(data, epochs=3, steps_per_epoch=-(-len(y) // 32), shuffle=False)
    """
    x, y = keras.tree.map_structure(np.asarray, x), keras.tree.map_structure(np.asarray, y)
    return cached_dataset(_structures.num_examples(y), range(epochs), seed, batch_size, _structure_gather(x), y)


class _EndPhaseOnPrefixChange(keras.callbacks.Callback):
    """Stops this phase's fit at the end of an epoch in which the frozen prefix changed.

    A longer prefix ends the phase only while `_MIN_CACHED_EPOCHS` epochs
    remain: extending the cache costs one forward pass of the newly frozen
    modules over the data, which one cached epoch saves back, so with fewer
    epochs left it cannot pay (the module trains frozen, uncached, to the
    end). A shorter prefix (a re-opened module) always ends it: the suffix
    being trained does not contain that module.
    """

    def __init__(self, freezer, level, epochs):
        super().__init__()
        self.freezer, self.level, self.epochs = freezer, level, epochs

    def on_epoch_end(self, epoch, logs=None):
        prefix = self.freezer.frozen_prefix
        if prefix < self.level or (prefix > self.level and self.epochs - (epoch + 1) >= _MIN_CACHED_EPOCHS):
            self.model.stop_training = True


def _rebuild(model) -> None:
    """Rebuilds `model`'s train function, keeping the replaced one (see `FreezingEngine.rebuild`)."""
    _internals.retire_train_function(model)
    model.make_train_function(force=True)


class _OnWholeModel(keras.callbacks.Callback):
    """Runs a freezing callback for the whole model while `fit` trains the suffix."""

    def __init__(self, inner: FreezingCallback, whole: keras.Model):
        super().__init__()
        self.inner, self.whole = inner, whole

    def set_model(self, model):
        super().set_model(model)
        self.inner.set_model(self.whole)

    def set_params(self, params):
        super().set_params(params)
        self.inner.set_params(params)

    def on_train_begin(self, logs=None):
        self.inner.on_train_begin(logs)
        # A freeze mid-phase flips `trainable` on layers the suffix shares:
        # its train function must be rebuilt too.
        self.inner.engine.listeners.append(lambda kind, indices: _rebuild(self.model))

    def on_train_end(self, logs=None):
        self.inner.on_train_end(logs)

    def on_epoch_begin(self, epoch, logs=None):
        self.inner.on_epoch_begin(epoch, logs)

    def on_epoch_end(self, epoch, logs=None):
        self.inner.on_epoch_end(epoch, logs)

    def on_train_batch_begin(self, batch, logs=None):
        self.inner.on_train_batch_begin(batch, logs)

    def on_train_batch_end(self, batch, logs=None):
        self.inner.on_train_batch_end(batch, logs)


def compile_like(suffix: keras.Model, model: keras.Model) -> None:
    """Compiles `suffix` as `model` was compiled, sharing its optimizer (same slots and step counter)."""
    config = _internals.compile_config(model)
    if not config:
        raise ValueError("fit_with_cache needs a model compiled with `model.compile(...)`.")
    suffix.compile(
        optimizer=model.optimizer,  # shared: same slots, same step counter, same LR schedule
        loss=config.get("loss"),
        loss_weights=config.get("loss_weights"),
        metrics=config.get("metrics"),
        weighted_metrics=config.get("weighted_metrics"),
        run_eagerly=model.run_eagerly,
        steps_per_execution=config.get("steps_per_execution", 1),
        jit_compile=model.jit_compile,
    )


def _check(model, x, y, epochs, batch_size, freezer, cache, cache_dtype, cache_budget, validation_data):
    if not isinstance(model, keras.Model) or getattr(model, "optimizer", None) is None:
        raise ValueError("`model` must be a compiled keras.Model (call `model.compile(...)` first).")
    optimizer = getattr(model.optimizer, "inner_optimizer", model.optimizer)  # under a LossScaleOptimizer
    if getattr(optimizer, "use_ema", False):
        raise ValueError(
            "fit_with_cache cannot train with an optimizer with `use_ema=True`: Keras swaps the weights for "
            "their moving averages at the end of every `fit`, and fit_with_cache trains in several. "
            "Use `model.fit` with the freezing callback, or an optimizer without `use_ema`."
        )
    leaves = keras.tree.flatten(x) if isinstance(x, (list, tuple, dict)) else [x]
    if isinstance(x, tf.data.Dataset) or not leaves or not all(hasattr(a, "shape") and np.ndim(a) for a in leaves):
        raise ValueError(
            "`x` must be a NumPy array, or a list/dict of them (one per model input): caching keys "
            f"activations by example id, which a tf.data pipeline does not expose. Received: {type(x).__name__}"
        )
    try:
        examples = _structures.num_examples(x)
    except ValueError as err:  # "The inputs' first dimensions differ: [...]."
        raise ValueError(f"`x`: {_lower_first(err)}.") from err
    try:
        rows = _structures.num_examples(y)
        got = f"{rows} rows"
    except ValueError as err:
        rows, got = None, _lower_first(err)
    except (TypeError, IndexError):
        rows, got = None, type(y).__name__
    if rows != examples:
        raise ValueError(
            f"`y` must be a NumPy array, or a list/dict of them (one per output), of {examples} rows as `x`; got {got}"
        )
    check_positive_int("epochs", epochs)
    check_positive_int("batch_size", batch_size)
    if freezer is not None and not isinstance(freezer, FreezingCallback):
        raise ValueError(
            "`freezer` must be a freezing callback (EgeriaCallback, FreezeOutCallback, "
            f"GradientNormFreezeCallback). Received: {type(freezer).__name__}"
        )
    if cache not in CACHE_MODES:
        raise ValueError(f"`cache` must be one of {CACHE_MODES}. Received: cache={cache!r}")
    if cache_dtype not in CACHE_DTYPES:
        raise ValueError(f"`cache_dtype` must be one of {CACHE_DTYPES}. Received: cache_dtype={cache_dtype!r}")
    if not isinstance(cache_budget, (int, float)) or cache_budget <= 0:
        raise ValueError(f"`cache_budget` must be a positive number of bytes. Received: {cache_budget!r}")
    if validation_data is not None and (not isinstance(validation_data, (tuple, list)) or len(validation_data) != 2):
        raise ValueError(
            "`validation_data` must be `(x_val, y_val)`: NumPy arrays, or lists/dicts of them as `x` and `y`."
        )


def _lower_first(err: Exception) -> str:
    """An error's message as the tail of a sentence: lowercase first letter, no final period."""
    text = str(err).rstrip(".")
    return text[:1].lower() + text[1:]


def _choose_mode(cache, estimate, budget, directory) -> tuple[str | None, str | None]:
    """(mode, message) for a cache of `estimate` bytes under `budget`."""
    mib = lambda b: f"{b / 2**20:,.1f} MiB"  # noqa: E731
    if cache is None:
        return None, None
    if cache in ("memory", "auto") and estimate <= budget:
        return "memory", None
    free = shutil.disk_usage(directory or tempfile.gettempdir()).free
    if cache == "disk" or estimate <= free // 2:
        if estimate > free // 2:
            return None, (f"the cache needs {mib(estimate)}, more than half the {mib(free)} free on disk; "
                          "training without a cache")
        why = "" if cache == "disk" else (f"the cache needs {mib(estimate)}, over cache_budget={mib(budget)}; "
                                          "keeping it on disk instead of in memory")
        return "disk", why or None
    return None, f"the cache needs {mib(estimate)}, over cache_budget={mib(budget)} and the disk; no cache"


def fit_with_cache(
    model: keras.Model,
    x,
    y,
    *,
    epochs: int,
    batch_size: int = 32,
    freezer: FreezingCallback | None = None,
    validation_data=None,
    callbacks: Sequence[keras.callbacks.Callback] = (),
    seed: int | None = 0,
    verbose: int = 1,
    cache: str | None = "auto",
    cache_dtype: str = "float32",
    cache_budget: float = DEFAULT_CACHE_BUDGET,
    cache_dir: str | None = None,
    preprocess: Callable | None = None,
) -> TrainingResult:
    """Trains `model` with a freezing callback, caching the frozen prefix's outputs.

    Args:
        model: a compiled Functional or Sequential model.
        x, y: training inputs (a NumPy array, or a list/dict of them for a
            model with several inputs) and targets (a NumPy array, or a
            list/dict of them for a model with several outputs).
        epochs, batch_size: as for `model.fit`.
        freezer: the freezing callback that decides what freezes
            (usually `EgeriaCallback()`); None trains without freezing.
        cache: `"memory"`, `"disk"`, `"auto"` (memory within budget, else
            disk, else none) or `None` (same driver, same data order, no
            cache: the baseline to compare with).
        cache_dtype: `"float32"`, or `"float16"`/`"bfloat16"` to halve it.
        cache_budget: the most bytes the cache may take in memory.
        cache_dir: folder of `"disk"` caches (default: a temporary folder,
            removed at the end).
        preprocess: deterministic `fn(x_batch, example_ids) -> x_batch`
            (stateless augmentation with per-example seeds; `x_batch` is
            structured as `x`).
        validation_data: `(x_val, y_val)`, evaluated at each epoch end.
        callbacks: more Keras callbacks (they see the model being fit: the
            whole model before the first cached phase, then the suffix).
        seed: shuffling seed (`None`: no shuffling).

    Returns:
        A `TrainingResult`: `history` per epoch; `phases`, each with its first
        epoch, frozen prefix, cache action and size; `details["cache"]`.

    Example:
    >>> egeria = tf_hwopt.EgeriaCallback()
    >>> result = tf_hwopt.training.fit_with_cache(model, x, y, epochs=10, batch_size=256,
    ...                                           freezer=egeria, cache="memory")
    >>> result.phases
    """
    _check(model, x, y, epochs, batch_size, freezer, cache, cache_dtype, cache_budget, validation_data)
    x, y = keras.tree.map_structure(np.asarray, x), keras.tree.map_structure(np.asarray, y)
    num_examples = _structures.num_examples(x)
    if freezer is None:
        cache = None  # nothing freezes, so nothing is cached
    modules = (freezer.modules if freezer is not None else None) or partition_modules(
        model, freezer.module_names if freezer is not None else None
    )
    augmenting = random_augmentation_layers(modules[:-1])
    if augmenting and cache is not None:
        message = (f"random augmentation in modules that may freeze ({', '.join(augmenting)}): a cached "
                   "activation would repeat one random draw forever. Move augmentation to `preprocess` "
                   "with per-example seeds, or train without a cache")
        if cache != "auto":
            raise ValueError(f"Cannot cache: {message}.")
        warnings.warn(f"fit_with_cache: {message}; training without a cache.", stacklevel=2)
        cache = None
    largest = max(cache_bytes(num_examples, m.output_layer.output.shape[1:], cache_dtype) for m in modules[:-1])
    mode, message = _choose_mode(cache, largest, cache_budget, cache_dir)
    if message:
        warnings.warn(f"fit_with_cache: {message}.", stacklevel=2)
    if freezer is not None:
        freezer.provide_data(x, y)

    store = ActivationCache(model, modules, x, mode=mode or "memory", dtype=cache_dtype,
                            directory=cache_dir, preprocess=preprocess,
                            batch_size=max(batch_size, 256))
    steps = int(math.ceil(num_examples / batch_size))
    raw = _structure_gather(x) if preprocess is None else _numpy_gather(lambda ids: store._raw_inputs(x, ids))
    # Validation inputs get their own cache, extended alongside the training one.
    val_store = None if validation_data is None else ActivationCache(
        model, modules, keras.tree.map_structure(np.asarray, validation_data[0]), mode=store.mode,
        dtype=cache_dtype, directory=cache_dir, batch_size=store.batch_size)
    history, phases = {}, []
    epoch, suffixes = 0, {}
    if freezer is not None:
        freezer.rebuilds_cache = mode is not None  # a freeze costs a cache rebuild too: its holds count it
    try:
        while epoch < epochs:
            level = freezer.frozen_prefix if freezer is not None else 0
            if mode is None:
                level_cached = 0
            else:
                level_cached = level
                action = store.set_level(level)
            if level_cached == 0:
                target, features, fit_callbacks = model, raw, [freezer] if freezer is not None else []
                val = validation_data
            else:
                if level not in suffixes:
                    suffixes[level] = cut_model(model, modules, level, len(modules))
                    compile_like(suffixes[level], model)
                target, features = suffixes[level], store.gather
                fit_callbacks = [_OnWholeModel(freezer, model)]
                val = None
                if val_store is not None:
                    val_store.set_level(level)
                    val = cached_dataset(val_store.num_examples, [0], None, store.batch_size, val_store.gather,
                                         keras.tree.map_structure(np.asarray, validation_data[1]))
            phases.append({
                "first_epoch": epoch, "frozen_prefix": level, "cached_modules": level_cached,
                "cache_action": action if mode is not None else "off",
                "cache_bytes": store.nbytes if level_cached else 0,
            })
            data = cached_dataset(num_examples, range(epoch, epochs), seed, batch_size, features, y)
            stopper = _EndPhaseOnPrefixChange(freezer, level, epochs) if mode is not None else None
            result = target.fit(
                data, epochs=epochs, initial_epoch=epoch, steps_per_epoch=steps, validation_data=val,
                callbacks=fit_callbacks + list(callbacks) + ([stopper] if stopper else []), verbose=verbose,
                shuffle=False,  # the pipeline is already in `epoch_order`
            )
            for key, values in result.history.items():
                history.setdefault(key, []).extend(values)
            if not result.epoch:
                break
            epoch = result.epoch[-1] + 1
    finally:
        if freezer is not None:
            freezer.rebuilds_cache = False
        summary = {"mode": mode, "dtype": cache_dtype, "build_seconds": store.build_seconds,
                   "builds": store.builds, "extensions": store.extensions,
                   "largest_bytes_estimate": largest}
        store.close()
        if val_store is not None:
            val_store.close()
    return TrainingResult(
        history=history,
        phases=phases,
        details={"cache": summary},
        freezer=freezer.summary() if freezer is not None else None,
    )
