"""Plasticity: how much a module's representation is still changing.

Plasticity compares a module's output activation in the training model (T)
with the same module's output in the quantized reference model (R), on a
fixed probe batch, with the similarity-preserving (SP) knowledge-distillation
loss of Tung and Mori (ICCV 2019). SP compares the *structure* of the batch's
representations (which examples look alike), so it ignores the scale of an
activation and most of R's quantization noise, and it rises when what the
module computes really changes.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

_EPS = 1e-12


def _normalized_gram(a: np.ndarray, dtype) -> np.ndarray:
    a = np.asarray(a)
    if a.ndim < 1 or a.shape[0] == 0:
        raise ValueError(f"An activation needs a batch axis; got shape {a.shape}.")
    flat = a.reshape(a.shape[0], -1).astype(dtype, copy=False)
    gram = (flat @ flat.T).astype(np.float64)
    norms = np.linalg.norm(gram, axis=1, keepdims=True)
    return gram / np.maximum(norms, _EPS)


def sp_loss(a, b, *, gram_dtype=np.float64) -> float:
    """Similarity-preserving loss between two activations of the same batch.

    Each activation is flattened to shape `(b, d)`; its Gram matrix
    `G = A @ A.T` (`b x b`) is row-normalised to unit L2 norm; the loss is
    `||G_a - G_b||_F^2 / b^2`. The feature sizes of `a` and `b` may differ;
    the batch size may not.

    Args:
        a: activation of shape `(b, ...)` (NumPy array or tensor).
        b: activation of shape `(b, ...)`.
        gram_dtype: precision of the `A @ A.T` products (the costly part);
            normalisation and the difference are always float64. Egeria's
            evaluation loop uses float32, about 10x faster on a CPU and within
            1e-3 relative of float64 on real activations.

    Returns:
        The loss as a Python float.

    Example:
    >>> x = np.random.rand(8, 4, 3)
    >>> sp_loss(x, x)
    0.0
    >>> round(sp_loss(x, 5.0 * x), 12)
    0.0
    """
    a = np.asarray(a)
    b = np.asarray(b)
    if a.shape[0] != b.shape[0]:
        raise ValueError(
            f"sp_loss needs activations of the same batch; got batch sizes "
            f"{a.shape[0]} and {b.shape[0]}."
        )
    diff = _normalized_gram(a, gram_dtype) - _normalized_gram(b, gram_dtype)
    return float(np.sum(diff * diff) / (a.shape[0] ** 2))


def module_plasticity(
    training_activations: Sequence, reference_activations: Sequence
) -> list[float]:
    """SP loss of each module's output, training model against reference."""
    if len(training_activations) != len(reference_activations):
        raise ValueError(
            f"Got {len(training_activations)} training and "
            f"{len(reference_activations)} reference activations; one per module expected."
        )
    return [sp_loss(t, r) for t, r in zip(training_activations, reference_activations)]


class ActivationReader:
    """Reads the output (or input) of chosen layers of a Keras 3 model on a batch.

    Works for Functional, Sequential and subclassed models alike: while the
    forward function is traced, a hook on each chosen layer's `call` records
    its output (or its first input), and the traced function returns them as
    float32. The trace is reused afterwards (weights are read at run time,
    never copied). The model runs in inference mode.

    Args:
        model: the Keras model.
        layers: the layers to read, in the order of the returned list.
        capture: `"outputs"` or `"inputs"`.

    Example:
    >>> reader = ActivationReader(model, [m.output_layer for m in modules])
    >>> activations = reader(probe_x)   # list of float32 NumPy arrays
    """

    def __init__(self, model, layers: Sequence, *, capture: str = "outputs"):
        import tensorflow as tf

        from tf_hwopt._layer_hooks import hooked_calls

        if capture not in ("outputs", "inputs"):
            raise ValueError(f"`capture` must be 'outputs' or 'inputs'. Received: capture={capture!r}")
        self._model = model
        self._layers = list(layers)
        captured: dict[int, object] = {}

        def record(i, call, args, kwargs):
            out = call(*args, **kwargs)
            captured[i] = out if capture == "outputs" else args[0]
            return out

        def forward(x):
            captured.clear()
            # A parent scope: a model named "_x" is no valid root scope name.
            with hooked_calls(self._layers, record), tf.name_scope("egeria_probe"):
                model(x, training=False)
            missing = [self._layers[i].name for i in range(len(self._layers)) if i not in captured]
            if missing:
                raise ValueError(f"Layers {missing} were not called by the model's forward pass.")
            return [tf.cast(captured[i], tf.float32) for i in range(len(self._layers))]

        self._forward = tf.function(forward, reduce_retracing=True)

    def __call__(self, x) -> list[np.ndarray]:
        return [np.asarray(a) for a in self._forward(conform_inputs(self._model, x))]


def conform_inputs(model, x):
    """`x` with integer ids fed to a float `Input` cast to its dtype, as `model.predict` takes it.

    Only NumPy arrays and tensors in the structure of `model.inputs` are
    touched; models without symbolic inputs (subclassed) get `x` unchanged.
    """
    import keras

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
    import keras

    if dtype is None or not hasattr(a, "dtype"):
        return a
    want = keras.backend.standardize_dtype(dtype)
    have = keras.backend.standardize_dtype(a.dtype)
    if "float" not in want or "float" in have:
        return a
    return np.asarray(a).astype(want if want != "bfloat16" else "float32")


def _num_examples(x) -> int:
    import keras

    sizes = {int(np.shape(a)[0]) for a in keras.tree.flatten(x)}
    if len(sizes) != 1:
        raise ValueError(f"The inputs' first dimensions differ: {sorted(sizes)}.")
    return sizes.pop()


def _to_numpy(x):
    import keras

    return keras.tree.map_structure(np.asarray, x)


def take(x, index):
    """`x[index]` for an array or each array of a list/dict of them."""
    import keras

    return keras.tree.map_structure(lambda a: a[index], x)


def draw_probe(data, size: int, *, seed: int = 0, input_ndim: int | None = None):
    """Draws the fixed probe batch (inputs only) from training data.

    Args:
        data: the model's inputs (NumPy arrays or tensors, or a list/dict
            of them, as `fit` takes `x`), or a `tf.data.Dataset` yielding `x`
            or `(x, y, ...)`, batched or not.
        size: number of examples in the probe batch.
        seed: seed of the random choice among array examples. The choice uses
            NumPy's own generator, so it never moves TensorFlow's random state
            (the training data order stays what it would be without Egeria).
        input_ndim: rank of the model's (first) input including the batch
            axis, to tell batched from unbatched dataset elements.

    Returns:
        The probe inputs, with `size` examples.

    Raises:
        ValueError: `size` larger than the data, or data of an unsupported kind.
    """
    import tensorflow as tf

    if isinstance(data, tf.data.Dataset):
        return _probe_from_dataset(data, size, input_ndim)
    try:
        data = _to_numpy(data)
        n = _num_examples(data)
    except (TypeError, ValueError, IndexError) as err:
        raise ValueError(
            "Cannot draw Egeria's probe batch from training data of type "
            f"{type(data).__name__}. Pass `probe_data=` (NumPy inputs or a "
            "tf.data.Dataset) to EgeriaCallback."
        ) from err
    if size > n:
        raise ValueError(
            f"`probe_size`={size} is larger than the training data ({n} examples). "
            "Pass a smaller probe_size."
        )
    idx = np.sort(np.random.RandomState(seed).choice(n, size, replace=False))
    return take(data, idx)


def _probe_from_dataset(dataset, size, input_ndim):
    import keras

    chunks, total = [], 0
    for element in dataset:
        x = _to_numpy(element[0] if isinstance(element, tuple) else element)
        if input_ndim is not None and keras.tree.flatten(x)[0].ndim == input_ndim - 1:
            x = take(x, np.newaxis)  # unbatched elements
        chunks.append(x)
        total += _num_examples(x)
        if total >= size:
            break
    if total < size:
        raise ValueError(
            f"`probe_size`={size} is larger than the training data ({total} examples "
            "in the dataset). Pass a smaller probe_size."
        )
    joined = keras.tree.map_structure(lambda *parts: np.concatenate(parts), *chunks)
    return take(joined, slice(0, size))
