"""Temporary hooks around the `call` of chosen layers.

Used where the layer graph cannot be cut into sub-models: to read the output
of chosen layers of a subclassed model, and to attribute traced ops to layers
unambiguously when counting FLOPs. The hook is an instance attribute that
shadows the class's `call`, and it is removed on exit, whatever happens.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Sequence


@contextlib.contextmanager
def hooked_calls(layers: Sequence, hook: Callable):
    """Within the block, `layer.call(*a, **k)` runs `hook(i, layer.call, a, k)`.

    `i` is the layer's position in `layers`; the hook must call the original
    and return its result.
    """
    patched = []
    try:
        for i, layer in enumerate(layers):
            if "call" in vars(layer):
                raise RuntimeError(f"Layer {layer.name!r} already has a call hook.")
            original = layer.call

            def wrapper(*args, __i=i, __original=original, **kwargs):
                return hook(__i, __original, args, kwargs)

            layer.call = wrapper
            patched.append(layer)
        yield
    finally:
        for layer in patched:
            vars(layer).pop("call", None)
