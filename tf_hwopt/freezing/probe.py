"""The probe batch and reading activations of chosen layers on it.

Every freezing policy looks at the model on a fixed *probe* batch drawn once
from the training data: Egeria compares module outputs with its reference,
the BatchNormalization drift check reads normalization inputs, the
gradient-norm peer takes gradients on it. This module draws the batch in any
form `model.fit` takes (`draw_probe`) and reads chosen layers' outputs or
inputs on it (`ActivationReader`).
"""

from __future__ import annotations

import itertools
from typing import Sequence

import keras
import numpy as np
import tensorflow as tf

from tf_hwopt import _internals
from tf_hwopt._layer_hooks import hooked_calls
from tf_hwopt._structures import num_examples, take


class ActivationReader:
    """Reads the output (or input) of chosen layers of a Keras 3 model on a batch.

    For a Functional model whose chosen layers are each called once, their
    outputs (or inputs) are read from a sub-model that ends at them, so only
    the layers they depend on run (freezing goes front to back: the front is
    all an evaluation needs). Otherwise (subclassed models, shared layers) a
    hook on each chosen layer's `call` records its output (or its
    first input) while the whole forward function is traced. Either way the
    traced function returns float32 tensors and is reused afterwards
    (weights are read at run time, never copied). The model runs in
    inference mode.

    Args:
        model: the Keras model.
        layers: the layers to read, in the order of the returned list.
        capture: `"outputs"` or `"inputs"`.

    Example:
    >>> reader = ActivationReader(model, [m.output_layer for m in modules])
    >>> activations = reader(probe_x)   # list of float32 NumPy arrays
    """

    def __init__(self, model, layers: Sequence, *, capture: str = "outputs"):
        if capture not in ("outputs", "inputs"):
            raise ValueError(f"`capture` must be 'outputs' or 'inputs'. Received: capture={capture!r}")
        self._model = model
        self._layers = list(layers)
        prefix = prefix_model(model, self._layers, capture)
        self.prefix_only = prefix is not None
        # Traced without AutoGraph, as Keras traces its own train step
        # (`do_not_convert`): whatever `fit` runs traces here too, and
        # converting every layer's `call` is tracing time bought for nothing.
        if prefix is not None:

            def forward(x):
                with tf.name_scope("egeria_probe"):
                    outs = prefix(x, training=False)
                outs = outs if isinstance(outs, (list, tuple)) else [outs]
                return [tf.cast(o, tf.float32) for o in outs]

            self._forward = tf.function(forward, reduce_retracing=True, autograph=False)
            return
        captured: dict[int, object] = {}

        def record(i, call, args, kwargs):
            out = call(*args, **kwargs)
            captured[i] = out if capture == "outputs" else args[0]
            return out

        def hooked_forward(x):
            captured.clear()
            # A parent scope: a model named "_x" is no valid root scope name.
            with hooked_calls(self._layers, record), tf.name_scope("egeria_probe"):
                model(x, training=False)
            missing = [self._layers[i].name for i in range(len(self._layers)) if i not in captured]
            if missing:
                raise ValueError(f"Layers {missing} were not called by the model's forward pass.")
            return [tf.cast(captured[i], tf.float32) for i in range(len(self._layers))]

        self._forward = tf.function(hooked_forward, reduce_retracing=True, autograph=False)

    def __call__(self, x) -> list[np.ndarray]:
        return [np.asarray(a) for a in self._forward(conform_inputs(self._model, x))]


def prefix_model(model, layers, capture: str = "outputs"):
    """A Functional model from `model`'s inputs to `layers`' outputs (or inputs), or None where there is none.

    Needs a Functional (or built Sequential) model whose `layers` are each
    called once in its graph (`layer.output` is then their output), on a
    single tensor when their inputs are read.
    """
    if not isinstance(model, keras.Model) or not layers:
        return None
    try:
        inputs = model.input
        outputs = [layer.output if capture == "outputs" else layer.input for layer in layers]
        if not all(isinstance(t, keras.KerasTensor) for t in outputs):
            return None
        if any(_internals.call_count(layer) != 1 for layer in layers):
            return None
        return keras.Model(inputs, outputs)
    except (AttributeError, ValueError, TypeError, IndexError):
        return None


def conform_inputs(model, x):
    """`x` with integer ids fed to a float `Input` cast to its dtype, as `model.predict` takes it.

    Only NumPy arrays and tensors in the structure of `model.inputs` are
    touched; models without symbolic inputs (subclassed) get `x` unchanged.
    """
    try:
        inputs = list(model.inputs or [])
    except (AttributeError, ValueError):
        return x
    if isinstance(x, dict):
        by_name = {t.name: t.dtype for t in inputs}
        return {k: _cast_to(v, by_name.get(k)) for k, v in x.items()}
    flat = keras.tree.flatten(x)
    if len(flat) != len(inputs):
        return x
    cast = [_cast_to(a, t.dtype) for a, t in zip(flat, inputs)]
    return keras.tree.pack_sequence_as(x, cast)


def _cast_to(a, dtype):
    """Integer or bool data cast to a float input's dtype (NumPy), else `a` unchanged."""
    if dtype is None or not hasattr(a, "dtype") or getattr(a.dtype, "kind", None) in ("O", "S", "U"):
        return a  # strings (bytes objects from a dataset): nothing to cast
    want = keras.backend.standardize_dtype(dtype)
    have = keras.backend.standardize_dtype(a.dtype)
    if "float" not in want or "float" in have:
        return a
    return np.asarray(a).astype(want if want != "bfloat16" else "float32")


def _to_numpy(x):
    return keras.tree.map_structure(np.asarray, x)


class ProbeSizeError(ValueError):
    """`probe_size` asks for more examples than the data holds (the user's argument to fix)."""


def draw_probe(data, size: int, *, seed: int = 0, input_ndim: int | None = None, labelled: bool = False):
    """Draws the fixed probe batch from training data.

    Args:
        data: the model's inputs (NumPy arrays or tensors, or a list/dict
            of them, as `fit` takes `x`), or a `tf.data.Dataset` yielding `x`
            or `(x, y, ...)`, batched or not, or a `keras.utils.PyDataset` (its
            first batches are read). With `labelled=True`: `(x, y)`, or a
            dataset yielding `(x, y, ...)`.
        size: number of examples in the probe batch.
        seed: seed of the random choice among array examples. The choice uses
            NumPy's own generator, so it never moves TensorFlow's random state
            (the training data order stays what it would be without us).
        input_ndim: rank of the model's (first) input including the batch
            axis, to tell batched from unbatched dataset elements.
        labelled: return `(x, y)` instead of the inputs alone.

    Returns:
        The probe inputs (or `(x, y)`), with `size` examples.

    Raises:
        ProbeSizeError: `size` larger than the data.
        ValueError: data of an unsupported kind.

    Example:
    >>> probe = draw_probe(x_train, 256)            # 256 examples, always the same ones
    >>> x, y = draw_probe((x_train, y_train), 64, labelled=True)
    """
    if isinstance(data, tf.data.Dataset):
        return _probe_from_batches(data, size, input_ndim, labelled, "the dataset")
    if isinstance(data, keras.utils.PyDataset):
        count = data.num_batches
        batches = (data[i] for i in (range(count) if count is not None else itertools.count()))
        return _probe_from_batches(batches, size, input_ndim, labelled, "the PyDataset")
    kind = type(data).__name__
    try:
        data = _to_numpy(data)
        n = num_examples(data)
    except (TypeError, ValueError, IndexError) as err:
        raise ValueError(
            f"Cannot draw the probe batch from training data of type {kind}. Pass "
            "`probe_data=` (NumPy inputs, (x, y), a tf.data.Dataset or a PyDataset) to the callback."
        ) from err
    if size > n:
        raise ProbeSizeError(
            f"`probe_size`={size} is larger than the training data ({n} examples). "
            "Pass a smaller probe_size."
        )
    idx = np.sort(np.random.RandomState(seed).choice(n, size, replace=False))
    return take(data, idx)


def _probe_from_batches(elements, size, input_ndim, labelled, source):
    """The first `size` examples of a dataset's (or a PyDataset's) elements."""
    chunks, total = [], 0
    for element in elements:
        if labelled:
            x = _to_numpy(tuple(element[:2]))
            first = keras.tree.flatten(x[0])[0]
        else:
            x = _to_numpy(element[0] if isinstance(element, tuple) else element)
            first = keras.tree.flatten(x)[0]
        if input_ndim is not None and first.ndim == input_ndim - 1:
            x = take(x, np.newaxis)  # unbatched elements
        chunks.append(x)
        total += num_examples(x)
        if total >= size:
            break
    if total < size:
        raise ProbeSizeError(
            f"`probe_size`={size} is larger than the training data ({total} examples "
            f"in {source}). Pass a smaller probe_size."
        )
    joined = keras.tree.map_structure(lambda *parts: np.concatenate(parts), *chunks)
    return take(joined, slice(0, size))
