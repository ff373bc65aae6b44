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
