"""The int8 reference model: a cheap, recent snapshot of the training model.

Plasticity compares the training model with a *reference* that holds what the
model knew a little while ago. Egeria keeps it quantized to int8 so that it is
cheap, and evaluates it on the host CPU, off the training thread.

Two ways to build it, tried in this order:

``"tfmot"``
    The Keras 3 model is rebuilt layer by layer as a tf_keras (Keras 2) model
    (same layer classes; configs filtered to the arguments tf_keras accepts;
    weights copied), checked to reproduce the Keras 3 model's outputs, then
    quantized with the TensorFlow Model Optimization toolkit:
    `quantize_apply` on a model whose supported layers are annotated (TFMOT's
    default 8-bit registry, plus a kernel-and-output config for kernel layers
    the registry lacks, such as `Conv1D`). Layers TFMOT cannot quantize stay
    float with per-channel int8 weights. The quantizer ranges are calibrated
    on the probe batch: weight ranges by TFMOT itself, activation ranges set
    to the float activations' observed ranges.

``"int8-weights"``
    For models that cannot be rebuilt (subclassed models, custom layers,
    `keras.ops` calls in the graph): a Keras 3 clone whose weights are
    quantized per output channel, symmetric int8.

`Reference.path` says which was taken and `Reference.reason` why.
"""

from __future__ import annotations

import concurrent.futures
import inspect
import logging
import time
import warnings
from typing import Sequence

import numpy as np

from tf_hwopt._quiet import import_tensorflow_quietly, import_tf_keras_quietly

import_tensorflow_quietly()

import keras
import tensorflow as tf

from tf_hwopt import _internals
from tf_hwopt._structures import take
from tf_hwopt.freezing.probe import ActivationReader, conform_inputs, prefix_model

logger = logging.getLogger("tf_hwopt.egeria")

TFMOT_PATH = "tfmot"
FALLBACK_PATH = "int8-weights"
REFERENCE_MODES = ("auto", TFMOT_PATH, FALLBACK_PATH)
# The rebuilt tf_keras model must reproduce the Keras 3 model this closely.
_REBUILD_RTOL = 1e-4


class _NotRebuildable(Exception):
    pass


class ReferenceUnavailable(RuntimeError):
    """Neither way of building the reference model worked for this model."""


def quantize_int8_per_channel(w: np.ndarray) -> np.ndarray:
    """Symmetric int8 fake quantization, one scale per output channel.

    Arrays with fewer than 2 dimensions (biases, normalization parameters)
    are returned unchanged. The last axis is the output channel.

    Example:
    >>> q = quantize_int8_per_channel(np.random.randn(3, 3, 8, 16))
    >>> len(np.unique(q[..., 0])) <= 255
    True
    """
    w = np.asarray(w)
    if w.ndim < 2 or not np.issubdtype(w.dtype, np.floating):
        return w
    axes = tuple(range(w.ndim - 1))
    scale = np.max(np.abs(w), axis=axes, keepdims=True) / 127.0
    scale = np.where(scale == 0, 1.0, scale)
    return (np.clip(np.round(w / scale), -127, 127) * scale).astype(w.dtype)


def _quantize_int8_per_channel_tf(w):
    """`quantize_int8_per_channel` in TensorFlow, inside a compiled function."""
    if w.shape.rank is None or w.shape.rank < 2 or not w.dtype.is_floating:
        return w
    scale = tf.reduce_max(tf.abs(w), axis=list(range(w.shape.rank - 1)), keepdims=True) / 127.0
    scale = tf.where(scale == 0, tf.ones_like(scale), scale)
    return tf.clip_by_value(tf.round(w / scale), -127.0, 127.0) * scale


# --------------------------------------------------------------------------
# Keras 3 -> tf_keras rebuild
# --------------------------------------------------------------------------

_DROPPED_SUFFIXES = ("_initializer", "_regularizer", "_constraint")


def _tf_keras_layer(layer, tf_keras):
    cls_name = type(layer).__name__
    if type(layer) is keras.layers.Lambda:
        # Its function is the user's Python code, not a config: the same
        # function object runs in tf_keras (keras.ops take tf tensors).
        return tf_keras.layers.Lambda(layer.function, arguments=layer.arguments, name=layer.name)
    if not type(layer).__module__.startswith("keras.src.layers"):
        raise _NotRebuildable(f"layer {layer.name!r} is a custom class ({type(layer).__qualname__})")
    cls = getattr(tf_keras.layers, cls_name, None)
    if cls is None:
        raise _NotRebuildable(f"tf_keras has no layer class {cls_name}")
    config = layer.get_config()
    accepted = set(inspect.signature(cls.__init__).parameters) - {"self", "kwargs"}
    kept = {}
    for key, value in config.items():
        if key.endswith(_DROPPED_SUFFIXES) or key == "dtype":
            continue
        if key in accepted or key in ("name", "trainable"):
            if isinstance(value, dict):
                raise _NotRebuildable(f"layer {layer.name!r} has a serialized object in {key!r}")
            kept[key] = value
    try:
        return cls(dtype="float32", **kept)
    except Exception as err:  # noqa: BLE001 - any config mismatch means "cannot rebuild"
        raise _NotRebuildable(f"layer {layer.name!r}: {err}") from err


def _rebuild_tf_keras(model, tf_keras):
    """Rebuilds a Functional or Sequential Keras 3 model as a tf_keras model."""
    from tf_hwopt.freezing.modules import graph_kind

    kind = graph_kind(model)
    if kind == "subclassed":
        raise _NotRebuildable("subclassed model (no layer graph to rebuild)")
    if kind == "sequential":
        try:
            inputs = model.inputs
        except (AttributeError, ValueError):
            inputs = None
        if not inputs:
            raise _NotRebuildable("Sequential model without an Input")
        shape = tuple(inputs[0].shape[1:])
        tk = tf_keras.Sequential(
            [tf_keras.Input(shape, dtype=inputs[0].dtype)]
            + [_tf_keras_layer(layer, tf_keras) for layer in model.layers]
        )
        return tk
    tensors: dict[int, object] = {}
    new_layers: dict[int, object] = {}
    tk_inputs = []
    for tensor in model.inputs:
        t = tf_keras.Input(tuple(tensor.shape[1:]), dtype=tensor.dtype, name=tensor.name)
        tensors[id(tensor)] = t
        tk_inputs.append(t)
    for node in _internals.ordered_nodes(model):
        op = node.operation
        if isinstance(op, keras.layers.InputLayer):
            continue
        if not isinstance(op, keras.layers.Layer):
            raise _NotRebuildable(f"the graph calls a non-layer operation ({type(op).__name__})")
        if id(op) not in new_layers:
            new_layers[id(op)] = _tf_keras_layer(op, tf_keras)
        args = node.arguments

        def convert(x):
            if isinstance(x, keras.KerasTensor):
                if id(x) not in tensors:
                    raise _NotRebuildable("a tensor is used before it is produced")
                return tensors[id(x)]
            return x

        call_args = keras.tree.map_structure(convert, list(args.args))
        call_kwargs = keras.tree.map_structure(convert, dict(args.kwargs))
        outputs = new_layers[id(op)](*call_args, **call_kwargs)
        for old, new in zip(keras.tree.flatten(node.outputs), keras.tree.flatten(outputs)):
            tensors[id(old)] = new
    tk_outputs = keras.tree.map_structure(lambda t: tensors[id(t)], model.outputs)
    return tf_keras.Model(tk_inputs, tk_outputs)


def _snapshot(model, indices: Sequence[int] | None = None) -> dict[int, np.ndarray]:
    """NumPy copies of the model's weights, keyed by their index in `model.weights` (default: all)."""
    variables = model.weights
    indices = range(len(variables)) if indices is None else indices
    return {i: keras.ops.convert_to_numpy(variables[i]) for i in indices}


def _warn_fallback(impl) -> None:
    """The one warning that the reference is the int8-weights clone, not a TFMOT model (mode "auto")."""
    warnings.warn(
        f"EgeriaCallback: the reference model is a clone with int8 weights, not a TFMOT model ({impl.reason}).",
        UserWarning,
        stacklevel=4,
    )


def _head(x, n=8):
    """The first `n` examples of a batch (array, or list/dict of arrays)."""
    return take(x, slice(0, n))


def _set_layer_weights(layer, weights):
    variables = _own_variables(layer)
    if len(variables) != len(weights) or any(
        tuple(v.shape) != tuple(np.shape(w)) for v, w in zip(variables, weights)
    ):
        raise _NotRebuildable(f"layer {layer.name!r} weights do not match in number or shape")
    for variable, value in zip(variables, weights):
        variable.assign(value)


def _kernel_quantize_config_class(tfmot):
    """A QuantizeConfig for kernel layers TFMOT's registry lacks (Conv1D...)."""
    quantizers = tfmot.quantization.keras.quantizers

    class KernelQuantizeConfig(tfmot.quantization.keras.QuantizeConfig):
        def get_weights_and_quantizers(self, layer):
            return [
                (
                    layer.kernel,
                    quantizers.LastValueQuantizer(
                        num_bits=8, per_axis=False, symmetric=True, narrow_range=True
                    ),
                )
            ]

        def get_activations_and_quantizers(self, layer):
            return []

        def set_quantize_weights(self, layer, quantize_weights):
            layer.kernel = quantize_weights[0]

        def set_quantize_activations(self, layer, quantize_activations):
            pass

        def get_output_quantizers(self, layer):
            return [
                quantizers.MovingAverageQuantizer(
                    num_bits=8, per_axis=False, symmetric=False, narrow_range=False
                )
            ]

        def get_config(self):
            return {}

    return KernelQuantizeConfig


class _TfmotReference:
    """The TFMOT path: the float tf_keras rebuild, quantized one prefix at a time.

    Freezing goes front to back, so an evaluation needs the reference only up
    to the modules it measures. The whole model is rebuilt (and checked)
    at once, so that a model TFMOT cannot take is known at train begin; the
    quantized model covers modules `0..covered` only, and is rebuilt longer
    (at least doubling) when the measured modules move past it. A model
    whose front never converges never pays for quantizing its back.
    """

    path = TFMOT_PATH

    def __init__(self, model, output_layers, probe_x, weights, expected):
        self._tf_keras, self._tfmot = import_tf_keras_quietly()
        self._output_names = [layer.name for layer in output_layers]
        self.float_layers: list[str] = []
        self.covered = -1
        with tf.device("/CPU:0"), _internals.autograph_disabled():
            tk = _rebuild_tf_keras(model, self._tf_keras)
            self._float_full = tk
            index = {id(v): i for i, v in enumerate(model.weights)}
            self._slices = {
                layer.name: [index[id(v)] for v in layer.weights]
                for layer in model.layers
                if layer.weights
            }
            for name, idx in self._slices.items():
                _set_layer_weights(tk.get_layer(name), [weights[i] for i in idx])
            self._check_rebuild(tk, probe_x, expected, model.dtype_policy.compute_dtype)

    @property
    def reason(self) -> str:
        return "rebuilt as tf_keras and quantized with TFMOT" + (
            f"; float layers (int8 weights only): {self.float_layers}" if self.float_layers else ""
        )

    def extend(self, upto: int, limit: int | None = None) -> None:
        """Quantizes the prefix of modules `0..upto` (at least; doubling up to `limit`), unless already covered."""
        if upto <= self.covered:
            return
        last = len(self._output_names) - 1
        grown = 2 * self.covered + 1 if limit is None else min(2 * self.covered + 1, limit)
        upto = min(last, max(upto, grown))
        tf_keras, tfmot = self._tf_keras, self._tfmot
        with tf.device("/CPU:0"), _internals.autograph_disabled(), _internals.tf_keras_own_lambdas_allowed():
            full = self._float_full
            registry = _internals.tfmot_default_registry()
            kernel_config = _kernel_quantize_config_class(tfmot)
            annotate = tfmot.quantization.keras.quantize_annotate_layer

            def clone_fn(layer):
                clone = layer.__class__.from_config(layer.get_config())
                if registry.supports(layer):
                    annotated_layers.append(layer.name)
                    return annotate(clone)
                if hasattr(layer, "kernel") and isinstance(
                    layer, (tf_keras.layers.Conv1D, tf_keras.layers.Conv3D)
                ):
                    annotated_layers.append(layer.name)
                    return annotate(clone, quantize_config=kernel_config())
                if any(len(w.shape) >= 2 for w in layer.weights):
                    float_layers.append(layer.name)
                return clone

            while True:
                self._float = tf_keras.Model(
                    full.inputs, [full.get_layer(name).output for name in self._output_names[: upto + 1]]
                )
                annotated_layers, float_layers = [], []
                annotated = tf_keras.models.clone_model(self._float, clone_function=clone_fn)
                if annotated_layers or upto == last:
                    break
                # Nothing TFMOT quantizes in this prefix (an Embedding alone): take the next module too.
                upto += 1
            with tfmot.quantization.keras.quantize_scope({"KernelQuantizeConfig": kernel_config}):
                self._quantized = tfmot.quantization.keras.quantize_apply(annotated)
            self.float_layers = float_layers
            self._inner = {}
            for layer in self._quantized.layers:
                inner = getattr(layer, "layer", layer)
                self._inner[inner.name] = (layer, inner)
            outputs = [
                _internals.tf_keras_node_output(self._quantized, self._inner[name][0])
                for name in self._output_names[: upto + 1]
            ]
            self._reader = tf_keras.Model(self._quantized.inputs, outputs)
            self._calibration = self._calibration_plan(tf_keras)
            # Compiled once per prefix; a refresh is three calls of compiled functions.
            prefix = {layer.name for layer in self._float.layers}
            targets, self._sources, quantized = [], [], []
            for name, idx in self._slices.items():
                if name not in prefix:
                    continue
                for model_vars, quantize in (
                    (_own_variables(self._float.get_layer(name)), False),
                    (_own_variables(self._inner[name][0]), name in self.float_layers),
                ):
                    if len(model_vars) != len(idx):
                        raise _NotRebuildable(f"layer {name!r} weights do not match in number")
                    targets.extend(model_vars)
                    self._sources.extend((i, quantize) for i in idx)
                # The quantized layer's variables alone, for the one-call refresh (`read_and_refresh`).
                quantized.extend((variable, i, quantize) for variable, i in zip(model_vars, idx))
            self._assign = _compiled_assign(targets)
            self._quantized_targets = quantized
            weight_quantizers = [
                q for layer in self._quantized.layers for q in _internals.tfmot_weight_quantizers(layer)
            ]

            def set_weight_ranges():
                # What a wrapper does to its weights in training mode: TFMOT's
                # quantizer sets the range from the weight. No layer runs.
                for weight, quantizer, range_vars in weight_quantizers:
                    quantizer(weight, True, weights=range_vars)

            # Stock layers and TFMOT wrappers need no AutoGraph; converting them cost most of a build.
            self._weight_ranges = tf.function(set_weight_ranges, autograph=False)
            self._calibrate_and_read = tf.function(self._calibrate_and_read_fn, autograph=False)
        self.covered = upto

    def weight_indices(self) -> list[int]:
        """Indices (in `model.weights`) of the weights the quantized prefix reads."""
        return sorted({i for i, _ in self._sources})

    @staticmethod
    def _check_rebuild(tk, probe_x, expected, compute_dtype):
        # Outputs flattened alike (a dict of outputs: by key, as `model.outputs` is ordered).
        got = [np.asarray(t, np.float64) for t in keras.tree.flatten(tk(_head(probe_x), training=False))]
        want = [np.asarray(t, np.float64) for t in keras.tree.flatten(expected)]
        if [a.shape for a in got] != [b.shape for b in want]:
            raise _NotRebuildable("the rebuilt tf_keras model's outputs differ in number or shape")
        err = max(np.max(np.abs(b - a)) / max(np.max(np.abs(b)), 1e-12) for a, b in zip(got, want))
        # bfloat16 compute in the training model carries ~3 significant digits.
        tolerance = _REBUILD_RTOL if compute_dtype == "float32" else 5e-2
        if not np.isfinite(err) or err > tolerance:
            raise _NotRebuildable(
                f"the rebuilt tf_keras model differs from the Keras 3 model (rel. error {err:.2e})"
            )

    def _calibration_plan(self, tf_keras):
        """Pairs each activation-range variable with the float tensor it quantizes."""
        plan = []  # (min_var, max_var, index of float tensor in self._float_probe outputs)
        float_tensors = []
        self._calibration_layers = []  # the layer (name) producing each float tensor; None: the model input
        input_names = [t.name.split(":")[0] for t in self._float.inputs]
        for layer in self._quantized.layers:
            weight_quantizer_vars = {
                id(v) for _, _, qvars in _internals.tfmot_weight_quantizers(layer) for v in qvars.values()
            }
            ranges = {}
            for v in layer.non_trainable_weights:
                short = v.name.split("/")[-1].split(":")[0]
                if id(v) in weight_quantizer_vars or not short.endswith(("_min", "_max")):
                    continue
                ranges.setdefault(short[:-4], {})[short[-3:]] = v
            if not ranges:
                continue
            inner = getattr(layer, "layer", None)
            if inner is not None:
                name = inner.name
                source = self._float.get_layer(name).output
            else:  # a QuantizeLayer quantizing a model input
                name = _internals.tf_keras_producer(layer).name
                if name in input_names:
                    source = self._float.inputs[input_names.index(name)]
                else:
                    source = self._float.get_layer(name).output
            float_tensors.append(source)
            self._calibration_layers.append(None if name in input_names else name)
            for pair in ranges.values():
                plan.append((pair["min"], pair["max"], len(float_tensors) - 1))
        self._float_probe = tf_keras.Model(self._float.inputs, float_tensors) if float_tensors else None
        return plan

    def _calibrate_and_read_fn(self, x):
        if self._float_probe is not None:
            outs = self._float_probe(x, training=False)
            _set_activation_ranges(self._calibration, outs if isinstance(outs, list) else [outs])
        acts = self._reader(x, training=False)
        return acts if isinstance(acts, list) else [acts]

    def fused_extent(self, modules: Sequence[int]) -> int:
        """The last module a one-call function reads: the whole quantized prefix (one function per prefix)."""
        return self.covered

    def fused(self, model, output_layers: Sequence):
        """One compiled function reading `model` and refreshing the quantized prefix from its weights, or None.

        `fn(probe_x) -> (reads, references)`: the covered modules' outputs
        (`output_layers[0..covered]`) in the training model (float32) and in
        the quantized prefix, after copying the model's current weights into
        the quantized prefix (variable to variable, no host copy) and ranging
        its activations on the training model's activations of the same
        forward pass. What a snapshot, `refresh` and a read of the training
        model compute, in one call (8 ms against 21 ms on the MNIST-1D
        ResNet). None where the training model's prefix is no sub-model, or a
        layer needs int8 weights by hand.
        """
        if any(quantize for _, _, quantize in self._quantized_targets):
            return None
        names, read_layers = self._calibration_layers, list(output_layers)
        layer_names = [name for name in names if name is not None]
        if len(layer_names) < len(names) and len(model.inputs) != 1:
            return None  # a ranged input of several: the snapshot path picks it by name
        try:
            calibration_layers = [model.get_layer(name) for name in layer_names]
        except ValueError:
            return None
        # Each calibrated and each read layer must be called once in the
        # graph, so that its `output` is the one activation to range or read.
        prefix = prefix_model(model, calibration_layers + read_layers)
        if prefix is None:
            return None
        pairs = [(target, model.weights[i]) for target, i, _ in self._quantized_targets]
        calibration, reader, weight_ranges = self._calibration, self._reader, self._weight_ranges

        def fused_fn(x):
            outs = prefix(x, training=False)
            outs = outs if isinstance(outs, (list, tuple)) else [outs]
            produced, reads = iter(outs[: len(layer_names)]), outs[len(layer_names) :]
            # A ranged model input (None) is the input itself, as on the snapshot path.
            floats = [x if name is None else next(produced) for name in names]
            for target, source in pairs:
                target.assign(tf.cast(source.value, target.dtype))
            weight_ranges()
            _set_activation_ranges(calibration, floats)
            refs = reader(x, training=False)
            refs = refs if isinstance(refs, (list, tuple)) else [refs]
            return [tf.cast(r, tf.float32) for r in reads], [tf.cast(r, tf.float32) for r in refs]

        return tf.function(fused_fn, autograph=False)

    def refresh(self, weights: dict, probe_x, modules: Sequence[int]) -> list[np.ndarray]:
        values = [quantize_int8_per_channel(weights[i]) if q else weights[i] for i, q in self._sources]
        with tf.device("/CPU:0"):
            self._assign(values)
            self._weight_ranges()
            # Activation ranges: the float activations' observed ranges.
            acts = self._calibrate_and_read(probe_x)
        return [np.asarray(acts[m], np.float32) for m in modules]


def _set_activation_ranges(calibration, floats) -> None:
    """Sets each activation-range variable pair to its float tensor's range (including 0), as TFMOT calibrates."""
    for min_var, max_var, i in calibration:
        value = tf.cast(floats[i], min_var.dtype)
        min_var.assign(tf.minimum(tf.reduce_min(value), 0.0))
        max_var.assign(tf.maximum(tf.reduce_max(value), 0.0))


def _own_variables(layer) -> list:
    """A layer's own variables; for a TFMOT wrapper, those of the wrapped layer.

    A wrapper holds the wrapped layer's variables (kernel, bias...) next to
    its quantizer variables, which live under the wrapper's name.
    """
    if hasattr(layer, "quantize_config") and hasattr(layer, "layer"):
        return [v for v in layer.weights if not v.name.startswith(layer.name + "/")]
    return list(layer.weights)


def _compiled_assign(variables: list):
    """A compiled function assigning a list of values to `variables` in one call."""

    @tf.function(autograph=False)
    def assign(values):
        for variable, value in zip(variables, values):
            variable.assign(value)

    return assign


def _layers_and_operations(model) -> list:
    """Every layer of `model`, then its graph's operations that are not layers.

    A module may end at an operation (`h + a` on Keras tensors is a
    `keras.ops` Add): the clone's counterpart is found by position.
    """
    operations = [op for op in getattr(model, "operations", []) if not isinstance(op, keras.layers.Layer)]
    return _internals.all_layers(model) + operations


class _CloneReference:
    path = FALLBACK_PATH
    float_layers: list = []

    def __init__(self, model, output_layers, probe_x, reason: str):
        with tf.device("/CPU:0"):
            clone = _clone(model, probe_x)
            originals, clones = _layers_and_operations(model), _layers_and_operations(clone)
            if len(originals) != len(clones):
                raise ReferenceUnavailable(
                    f"the clone of model {model.name!r} has a different layer structure; "
                    "implement `get_config`/`from_config`"
                )
            index = {id(layer): i for i, layer in enumerate(originals)}
            self._clone = clone
            self._layers = [clones[index[id(layer)]] for layer in output_layers]
            self._readers: dict = {}
            self._assign = _compiled_assign(list(clone.weights))
            self._num_weights = len(clone.weights)
        self.covered = len(output_layers) - 1
        self.reason = f"fell back to a Keras 3 clone with per-channel int8 weights: {reason}"

    def extend(self, upto: int, limit: int | None = None) -> None:
        """The clone covers every module."""

    def weight_indices(self) -> list[int]:
        return list(range(self._num_weights))

    def fused_extent(self, modules: Sequence[int]) -> int:
        """The last module a one-call function for `modules` reads: the last of them (the clone covers all)."""
        return max(modules)

    def fused(self, model, output_layers: Sequence):
        """One compiled function reading `model` and refreshing the clone's prefix from its weights, or None.

        `fn(probe_x) -> (reads, references)`: `output_layers`' outputs in the
        training model and in the clone, after quantizing the weights of the
        clone's prefix from the model's (per channel, as
        `quantize_int8_per_channel`, variable to variable). What a snapshot of
        every weight, `refresh` and a read of the training model compute, in
        one call. None where either prefix is no sub-model.
        """
        with tf.device("/CPU:0"):
            prefix = prefix_model(model, list(output_layers))
            clone_prefix = prefix_model(self._clone, self._layers[: len(output_layers)])
        if prefix is None or clone_prefix is None:
            return None
        position = {id(v): i for i, v in enumerate(self._clone.weights)}
        try:
            pairs = [(v, model.weights[position[id(v)]]) for v in clone_prefix.weights]
        except KeyError:
            return None  # a variable the clone's prefix does not hold in its weights: the snapshot path

        def fused_fn(x):
            reads = prefix(x, training=False)
            for target, source in pairs:
                target.assign(_quantize_int8_per_channel_tf(tf.cast(source.value, target.dtype)))
            with tf.device("/CPU:0"):
                refs = clone_prefix(x, training=False)
            reads, refs = (r if isinstance(r, (list, tuple)) else [r] for r in (reads, refs))
            return [tf.cast(r, tf.float32) for r in reads], [tf.cast(r, tf.float32) for r in refs]

        return tf.function(fused_fn, autograph=False)

    def refresh(self, weights: dict, probe_x, modules: Sequence[int]) -> list[np.ndarray]:
        modules = tuple(modules)
        with tf.device("/CPU:0"):
            self._assign([quantize_int8_per_channel(weights[i]) for i in range(self._num_weights)])
            if modules not in self._readers:
                self._readers[modules] = ActivationReader(self._clone, [self._layers[m] for m in modules])
            return self._readers[modules](probe_x)


# Preprocessing layers whose adapted vocabulary is a lookup table outside
# their config (a copy from the config would look up nothing) and outside
# their weights (nothing to quantize): the clone calls the same layer.
_SHARED_LAYERS = (keras.layers.TextVectorization, keras.layers.StringLookup, keras.layers.IntegerLookup)


def _clone_layer(layer):
    """A fresh copy of `layer` from its config, as `clone_model` makes one.

    A `Lambda` copy runs the same function; a lookup layer (`_SHARED_LAYERS`)
    is not copied.
    """
    if isinstance(layer, _SHARED_LAYERS):
        return layer
    if type(layer) is keras.layers.Lambda:
        return _internals.copy_lambda_layer(layer)
    return layer.__class__.from_config(layer.get_config())


def _clone(model, probe_x):
    """A structurally identical Keras 3 model (weights are assigned later)."""
    attempts = [
        ("clone_model", lambda: keras.models.clone_model(model, clone_function=_clone_layer)),
        ("from_config", lambda: model.__class__.from_config(model.get_config())),
        ("no-argument constructor", lambda: model.__class__()),
    ]
    errors = []
    for label, make in attempts:
        try:
            clone = make()
            clone(_head(probe_x, 1), training=False)
        except Exception as err:  # noqa: BLE001 - try the next way
            errors.append(f"{label}: {str(err).splitlines()[0][:200]}")
            continue
        if [tuple(v.shape) for v in clone.weights] == [tuple(v.shape) for v in model.weights]:
            return clone
        errors.append(f"{label}: the clone's weights differ in number or shape")
    raise ReferenceUnavailable(
        f"cannot clone model {model.name!r} ({'; '.join(errors)}). Give the model "
        "`get_config`/`from_config` (or a constructor without required "
        "arguments) so that Keras can clone it."
    )


def _float_state(model, probe_x) -> tuple[dict, object]:
    """The model's weights and its outputs on the probe's head, taken together: the rebuild is checked against them."""
    weights = _snapshot(model)
    expected = keras.tree.map_structure(keras.ops.convert_to_numpy, model(_head(probe_x), training=False))
    return weights, expected


def _tfmot_reference(model, output_layers, probe_x, state, cover, max_cover) -> _TfmotReference:
    """TFMOT's path: the model rebuilt as tf_keras from `state` (weights, expected outputs), its prefix quantized.

    Reads nothing of `model` but its layer graph and configs: it may run on
    a background thread while the model trains (`ReferenceBuild`).
    """
    impl = _TfmotReference(model, output_layers, probe_x, *state)
    impl.extend(cover, max_cover)
    return impl


class Reference:
    """The int8 reference model, refreshed from the training model.

    The reference is built when the object is created, on the calling
    thread, so that a model it cannot handle is known at once (or, while
    training goes on, on a background thread: `ReferenceBuild`). With
    `mode="auto"`, any failure of the TFMOT path falls back to the
    int8-weights clone (the cause is kept in `reason`); `ReferenceUnavailable`
    is raised only when both fail, or when the forced path fails.

    Args:
        model: the Keras 3 training model.
        output_layers: the layers whose outputs are the module boundaries.
        probe_x: the fixed probe batch (inputs only).
        asynchronous: refresh (quantize and evaluate) on a background thread.
        mode: `"auto"` (TFMOT, else int8 weights), `"tfmot"` or
            `"int8-weights"` (forced).
        cover: the last module the TFMOT model quantizes at first (it grows
            on demand, see `submit_refresh`).
        max_cover: the last module a refresh will ask for (default: the
            last module); growing never quantizes past it unasked.

    Attributes:
        path: `"tfmot"` or `"int8-weights"`.
        reason: why that path was taken.
        float_layers: layers TFMOT left in float (int8 weights only).
        refreshes: how many times the reference was refreshed.
        compiled: the one-call read-and-refresh function of each quantized
            prefix (`read_and_refresh`; None where it does not apply).
        build_seconds: wall time of the build.
        work_seconds: wall time of the build and every refresh, wherever they ran.

    Example:
    >>> ref = Reference(model, [m.output_layer for m in modules], probe_x)
    >>> ref.submit_refresh(model)          # snapshot now, quantize off-thread
    >>> activations = ref.activations()    # waits only if not finished yet
    """

    def __init__(
        self,
        model,
        output_layers: Sequence,
        probe_x,
        *,
        asynchronous: bool = True,
        mode: str = "auto",
        cover: int = 0,
        max_cover: int | None = None,
        _tfmot_built: tuple | None = None,
    ):
        # `_tfmot_built`: (reference, error, seconds) of TFMOT's path, built by `ReferenceBuild`.
        if mode not in REFERENCE_MODES:
            raise ValueError(f"`reference` must be one of {REFERENCE_MODES}. Received: reference={mode!r}")
        self._probe_x = probe_x
        self._executor = (
            concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="egeria-reference")
            if asynchronous
            else None
        )
        self._future: concurrent.futures.Future | None = None
        self._mode = mode
        self._output_layers = list(output_layers)
        self._max_cover = max_cover
        self.refreshes = 0
        self.refreshed_modules: tuple = ()
        # read_and_refresh's compiled function of each quantized prefix (None: not applicable).
        self.compiled: dict = {}
        start = time.perf_counter()
        self._impl = self._build(model, self._output_layers, mode, cover, _tfmot_built)
        self.build_seconds = time.perf_counter() - start + (_tfmot_built[2] if _tfmot_built else 0.0)
        self.work_seconds = self.build_seconds

    def _build(self, model, output_layers, mode, cover, tfmot_built=None):
        tfmot_error = None
        if mode in ("auto", TFMOT_PATH):
            try:
                if tfmot_built is None:
                    impl = _tfmot_reference(model, output_layers, self._probe_x, _float_state(model, self._probe_x),
                                            cover, self._max_cover)
                elif tfmot_built[1] is not None:
                    raise tfmot_built[1]
                else:
                    impl = tfmot_built[0]
                logger.info("Egeria reference model: %s (%s)", impl.path, impl.reason)
                return impl
            except Exception as err:  # noqa: BLE001 - any failure of TFMOT's path falls back
                tfmot_error = _one_line(err)
                if mode == TFMOT_PATH:
                    raise ReferenceUnavailable(f"the TFMOT reference (forced) failed: {tfmot_error}") from err
        reason = tfmot_error or "int8-weights path chosen with reference='int8-weights'"
        try:
            impl = _CloneReference(model, output_layers, self._probe_x, reason=reason)
        except Exception as err:  # noqa: BLE001 - reported with both causes
            causes = f"TFMOT: {tfmot_error}; int8 weights: {_one_line(err)}" if tfmot_error else _one_line(err)
            raise ReferenceUnavailable(f"no reference model could be built ({causes})") from err
        logger.info("Egeria reference model: %s (%s)", impl.path, impl.reason)
        if tfmot_error is not None:
            _warn_fallback(impl)
        return impl

    def _run(self, fn) -> concurrent.futures.Future:
        def timed():
            start = time.perf_counter()
            try:
                return fn()
            finally:
                self.work_seconds += time.perf_counter() - start

        if self._executor is not None:
            return self._executor.submit(timed)
        future: concurrent.futures.Future = concurrent.futures.Future()
        try:
            future.set_result(timed())
        except Exception as err:  # noqa: BLE001 - re-raised by .result()
            future.set_exception(err)
        return future

    @property
    def path(self) -> str:
        """`"tfmot"` or `"int8-weights"`."""
        return self._impl.path

    @property
    def reason(self) -> str:
        return self._impl.reason

    @property
    def float_layers(self) -> list:
        return list(self._impl.float_layers)

    @property
    def covered_modules(self) -> int:
        """How many front modules the quantized model covers now (it grows on demand)."""
        return self._impl.covered + 1

    def _extend(self, model, upto: int) -> None:
        """Covers modules `0..upto`; a TFMOT failure there falls back to the clone (mode "auto")."""
        if upto <= self._impl.covered:
            return
        start = time.perf_counter()
        try:
            self._impl.extend(upto, self._max_cover)
        except Exception as err:  # noqa: BLE001 - as at build time: fall back, or report
            if self._mode != "auto" or self._impl.path != TFMOT_PATH:
                raise ReferenceUnavailable(f"the {self._impl.path} reference failed: {_one_line(err)}") from err
            self._impl = _CloneReference(model, self._output_layers, self._probe_x, reason=_one_line(err))
            _warn_fallback(self._impl)
        finally:
            elapsed = time.perf_counter() - start
            self.build_seconds += elapsed
            self.work_seconds += elapsed

    def submit_refresh(self, model, modules: Sequence[int] | None = None) -> None:
        """Snapshots the weights `modules` depend on now; quantizes and evaluates them (off-thread if asynchronous).

        `modules` (default: all) are module indices, front to back; the
        reference covers the prefix up to the last one (built on demand, on
        this thread). `activations()` then returns their outputs, in order.
        """
        modules = tuple(range(len(self._output_layers))) if modules is None else tuple(modules)
        self._extend(model, max(modules))
        if self.read_and_refresh(model, modules) is not None:
            return  # on the training thread: the one-call refresh (its read unused)
        weights = _snapshot(model, self._impl.weight_indices())
        impl = self._impl
        self.refreshes += 1
        self.refreshed_modules = modules
        self._future = self._run(lambda: impl.refresh(weights, self._probe_x, modules))

    def _fused(self, model, modules: tuple):
        """The one-call read and refresh reading `modules` (built once per prefix it reads), or None."""
        if self._executor is not None:
            return None
        # A function per prefix: TFMOT's whole quantized prefix (rebuilt when
        # it grows), the clone's up to the last module read.
        extent = self._impl.fused_extent(modules)
        key = (id(self._impl), extent)
        if key not in self.compiled:
            self.compiled[key] = self._impl.fused(model, self._output_layers[: extent + 1])
        return self.compiled[key]

    def read_and_refresh(self, model, modules: Sequence[int]) -> list[np.ndarray] | None:
        """Reads `modules`' outputs in `model` on the probe and refreshes them, in one compiled call.

        The same result as reading the training model and then calling
        `submit_refresh(model, modules)`, at less than half the cost (no
        weight snapshot through the host; on the TFMOT path one forward pass
        of the training model's prefix serves the read and the calibration).
        Only on the training thread (not `asynchronous`), for modules the
        reference covers already (TFMOT's quantized prefix; the int8-weights
        clone covers every module). Returns the
        training model's activations (float32), or None where it does not
        apply: the caller then reads and refreshes the usual way.
        """
        modules = tuple(modules)
        fn = self._fused(model, modules) if max(modules) <= self._impl.covered else None
        if fn is None:
            return None
        start = time.perf_counter()
        reads, refs = fn(conform_inputs(model, self._probe_x))  # each op where its variables are
        activations = [np.asarray(refs[m]) for m in modules]
        self.refreshes += 1
        self.refreshed_modules = modules
        self._future = concurrent.futures.Future()
        self._future.set_result(activations)
        self.work_seconds += time.perf_counter() - start
        return [np.asarray(reads[m]) for m in modules]

    def ready(self) -> bool:
        """Whether a refresh has been submitted (its result may still be pending)."""
        return self._future is not None

    def activations(self) -> list[np.ndarray]:
        """The reference's outputs of `refreshed_modules` on the probe batch (latest refresh)."""
        if self._future is None:
            raise RuntimeError("The reference model has not been refreshed yet.")
        return self._future.result()

    def close(self) -> None:
        """Stops the background thread (waits for a refresh in flight)."""
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None


class ReferenceBuild:
    """Builds a `Reference` on a background thread while training goes on.

    For the TFMOT path only: the training model's weights and its outputs on
    the probe (which the rebuild is checked against) are taken at once, on
    the calling thread; the tf_keras rebuild, TFMOT's `quantize_apply` and
    the check run on a background thread, which reads nothing of the
    training model but its layer graph and configs, so training may update
    the weights meanwhile. `result()` then makes the `Reference` on the
    calling thread. With `mode="auto"`, where TFMOT's path failed (`failed`),
    that is where the int8-weights clone is built (a clone reads the
    training model, which only the training thread may do while it trains).

    Args: as `Reference` (`mode` `"auto"` or `"tfmot"`).

    Attributes:
        thread_seconds: wall time of the background part (None while it runs).

    Example:
    >>> build = ReferenceBuild(model, [m.output_layer for m in modules], probe_x, cover=2)
    >>> # ... training steps ...
    >>> if build.done():
    ...     ref = build.result(model)
    """

    def __init__(
        self,
        model,
        output_layers: Sequence,
        probe_x,
        *,
        asynchronous: bool = True,
        mode: str = "auto",
        cover: int = 0,
        max_cover: int | None = None,
    ):
        if mode not in ("auto", TFMOT_PATH):
            raise ValueError(f"`mode` must be 'auto' or 'tfmot' to build in the background. Received: mode={mode!r}")
        self._output_layers = list(output_layers)
        self._probe_x = probe_x
        self._options = dict(asynchronous=asynchronous, mode=mode, cover=cover, max_cover=max_cover)
        start = time.perf_counter()
        state = _float_state(model, probe_x)
        self._calling_seconds = time.perf_counter() - start
        self.thread_seconds: float | None = None

        def build() -> tuple:
            start = time.perf_counter()
            try:
                built = _tfmot_reference(model, self._output_layers, probe_x, state, cover, max_cover), None
            except Exception as err:  # noqa: BLE001 - handed to `Reference`, which falls back or reports
                built = None, err
            self.thread_seconds = time.perf_counter() - start
            return built

        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="egeria-reference-build"
        )
        self._future = self._executor.submit(build)
        self._executor.shutdown(wait=False)  # the thread ends with the build

    def done(self) -> bool:
        """Whether the background part has finished (`result()` will not wait for it)."""
        return self._future.done()

    @property
    def failed(self) -> bool:
        """Whether TFMOT's path failed (`result()` then builds the clone, or raises with `mode="tfmot"`)."""
        return self._future.done() and self._future.result()[1] is not None

    def result(self, model) -> Reference:
        """The `Reference` (waits for the background part); raises `ReferenceUnavailable` as `Reference` does."""
        reference, error = self._future.result()
        return Reference(
            model,
            self._output_layers,
            self._probe_x,
            **self._options,
            _tfmot_built=(reference, error, self._calling_seconds + self.thread_seconds),
        )

    def cancel(self) -> None:
        """Waits for the background part and its thread to end (a thread cannot be stopped)."""
        self._executor.shutdown(wait=True)


def _one_line(err: BaseException, limit: int = 300) -> str:
    text = str(err).strip().splitlines()
    first = text[0][:limit] if text else ""
    return first if isinstance(err, _NotRebuildable) else f"{type(err).__name__}: {first}"
