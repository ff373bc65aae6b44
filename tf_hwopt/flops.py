"""Floating-point operation counts of a Keras model's forward pass.

The count comes from TensorFlow's own graph profiler run on the traced
forward function (batch size 1), so it covers every layer TensorFlow has a
FLOP statistic for (matmuls, convolutions, element-wise ops). Each op is
attributed to the outermost requested layer whose call produced it (a name
scope marks each call while tracing), so nested layers count inside the
layer that owns them.
"""

from __future__ import annotations

import re
from typing import Iterable

from tf_hwopt import _internals
from tf_hwopt._layer_hooks import hooked_calls
from tf_hwopt._quiet import stderr_silenced
import keras
import tensorflow as tf

_MARK = "hwoptlayer"
_MARK_RE = re.compile(rf"^{_MARK}(\d+)(_\d+)?$")


def graph_float_ops(graph) -> dict[str, int]:
    from tensorflow.python.profiler import model_analyzer, option_builder

    options = (
        option_builder.ProfileOptionBuilder(
            option_builder.ProfileOptionBuilder.float_operation()
        )
        .with_empty_output()
        .build()
    )
    with stderr_silenced():  # "N ops no flops stats due to incomplete shapes." (C++, every model with a None dim)
        profile = model_analyzer.profile(graph, options=options)
    ops: dict[str, int] = {}

    def walk(node):
        for child in node.children:
            if child.float_ops:
                ops[child.name] = ops.get(child.name, 0) + int(child.float_ops)
            walk(child)

    walk(profile)
    return ops


def forward_flops_by_layer(
    model: keras.Model, layer_names: Iterable[str], sample_input=None
) -> dict[str, float]:
    """Forward FLOPs per example of each named layer of `model`.

    Args:
        model: a built Keras model.
        layer_names: the layers to attribute FLOPs to.
        sample_input: one batch of inputs (any batch size), needed only when
            the model has no symbolic inputs (subclassed models).

    Returns:
        A dict from layer name to FLOPs per example; layers with no counted
        ops get 0. Ops outside every named layer are left out.

    Example:
    >>> flops = forward_flops_by_layer(model, [l.name for l in model.layers])
    """
    names = list(dict.fromkeys(layer_names))
    by_name = {}
    for layer in _internals.all_layers(model):
        by_name.setdefault(layer.name, layer)
    layers = [by_name[name] for name in names]
    specs = _batch_one_specs(model, sample_input)

    def scoped(i, call, args, kwargs):
        with tf.name_scope(f"{_MARK}{i}"):
            return call(*args, **kwargs)

    structure = sample_input if sample_input is not None else _input_structure(model)

    def forward(*xs):
        # A parent scope: a model named "_x" is no valid root scope name.
        with tf.name_scope("forward"):
            # The inputs as the model takes them (a dict-input model called with a list warns).
            inputs = keras.tree.pack_sequence_as(structure, list(xs)) if structure is not None else list(xs)
            return model(inputs[0] if isinstance(inputs, list) and len(inputs) == 1 else inputs, training=False)

    fn = tf.function(forward, autograph=False)
    with hooked_calls(layers, scoped):
        graph = fn.get_concrete_function(*specs).graph
    counts = {name: 0.0 for name in names}
    for op_name, value in graph_float_ops(graph).items():
        # The outermost marker on the path owns the op (nested layers count
        # inside the layer that contains them).
        for part in op_name.split("/"):
            match = _MARK_RE.match(part)
            if match:
                counts[names[int(match.group(1))]] += value
                break
    return counts


def _input_structure(model):
    """The nested structure of a Functional model's inputs (a dict, a list...); None when it has none."""
    try:
        return model.input
    except (AttributeError, ValueError):  # a Sequential model never called, a subclassed model
        return None


def _batch_one_specs(model, sample_input):
    if sample_input is not None:
        flat = keras.tree.flatten(sample_input)
        return [tf.TensorSpec((1,) + tuple(x.shape[1:]), tf.as_dtype(x.dtype)) for x in flat]
    try:
        inputs = model.inputs
    except (AttributeError, ValueError):
        inputs = None
    if not inputs:
        raise ValueError(
            f"Cannot count FLOPs of model {model.name!r}: it has no symbolic "
            "inputs. Pass `sample_input`, one batch of its inputs."
        )
    return [tf.TensorSpec((1,) + tuple(t.shape[1:]), t.dtype) for t in inputs]
