"""The one module that reaches into Keras, tf_keras/TFMOT and KerasTuner internals.

Every use below is private API of another project. Each says why no public
API serves and which versions it was checked on (Keras 3.15, TensorFlow and
tf_keras 2.21, TFMOT 0.8.1, KerasTuner 1.4.8). When one of them changes,
this file is the only place to look.
"""

from __future__ import annotations

import inspect
import re
from typing import Callable


# ----------------------------------------------------------------- Keras 3


def is_functional(model) -> bool:
    """Whether `model` is a Functional model (not Sequential, not subclassed).

    Keras 3 exports no public `Functional` class; a Functional model is the
    one that carries `_nodes_by_depth` (checked on Keras 3.15).
    """
    import keras

    return hasattr(model, "_nodes_by_depth") and not isinstance(model, keras.Sequential)


def is_add_operation(op) -> bool:
    """Whether `op` is the operation `x + y` on Keras tensors puts in a Functional graph.

    A residual written `h + a` adds a `keras.ops` Add operation, not a
    `keras.layers.Add`; its class is exported nowhere public (Keras 3.15:
    `keras.src.ops.numpy.Add`).
    """
    from keras.src.ops.numpy import Add

    return isinstance(op, Add)


def ordered_nodes(model) -> list:
    """A Functional model's layer calls (nodes) in topological order, inputs first.

    No public API lists the call nodes of a Functional model; module
    partitioning needs them to find cut points and to rebuild the graph as a
    tf_keras model (Keras 3.15: `Functional._nodes_by_depth`,
    `Model.operations`).
    """
    depth_keys = sorted(model._nodes_by_depth.keys(), reverse=True)
    op_index = {id(op): i for i, op in enumerate(model.operations)}
    nodes = []
    for depth in depth_keys:
        nodes.extend(sorted(model._nodes_by_depth[depth], key=lambda n: op_index.get(id(n.operation), 0)))
    return nodes


def call_count(layer) -> int:
    """How many times `layer` is called in the graphs it belongs to.

    A layer called once has a single output, and a sub-model ending at
    `layer.output` computes exactly that call. Keras 3's `layer.output`
    silently returns the first call's output of a shared layer instead of
    raising as Keras 2 did, so the number of calls must be read from the
    (private) inbound node list (Keras 3.15: `Operation._inbound_nodes`).
    """
    return len(layer._inbound_nodes)


def all_layers(model) -> list:
    """Every layer inside `model`, nested ones included, outermost first.

    `model.layers` lists only the top level; a subclassed model's nested
    layers (and explicit `modules=` naming them) need the recursive walk
    Keras itself uses (Keras 3.15: `Layer._flatten_layers`).
    """
    return list(model._flatten_layers(include_self=False, recursive=True))


def auto_layer_name_pattern(layer) -> re.Pattern:
    """The names Keras gives a layer of this class when the user gives none.

    A name like `dense_3` carries no block structure; a name like
    `block_3_expand` does. Keras derives default names from its (private)
    `to_snake_case` helper plus a `_N` suffix (Keras 3.15:
    `keras.src.utils.naming`).
    """
    from keras.src.utils import naming

    return re.compile(re.escape(naming.to_snake_case(type(layer).__name__)) + r"(_\d+)?")


_RETIRED_ATTRIBUTE = "_tf_hwopt_retired_train_functions"


def copy_lambda_layer(layer):
    """A new `keras.layers.Lambda` running the same Python function as `layer`.

    `clone_model` copies a layer through its config, where a Python lambda
    is bytecode: Keras refuses it in safe mode and, allowed, loads it
    without its module's globals (a `keras.ops` call inside then fails).
    The function object itself is what a copy needs; Keras keeps the
    `output_shape` argument only privately (Keras 3.15: `Lambda._output_shape`).
    """
    import keras

    return keras.layers.Lambda(
        layer.function,
        output_shape=getattr(layer, "_output_shape", None),
        mask=layer.mask,
        arguments=layer.arguments,
        name=layer.name,
        dtype=layer.dtype_policy,
        trainable=layer.trainable,
    )


def before_optimizer_finalize(model, hook: Callable[[], None]) -> Callable[[], None]:
    """Calls `hook()` when `fit` finalizes `model`'s optimizer, before its variables are read; returns the undo.

    Keras 3.15's `fit` calls `optimizer.finalize_variable_values(
    model.trainable_weights)` after the last epoch and before the callbacks'
    `on_train_end` (`backend/tensorflow/trainer.py`); with `use_ema=True` the
    optimizer pairs that list with its moving averages by position, so a
    freezing callback must make its frozen layers trainable again first (the
    list is read again after `hook`). No callback hook runs at that point.
    """
    optimizer = getattr(model, "optimizer", None)
    original = getattr(optimizer, "finalize_variable_values", None)
    if original is None:
        return lambda: None
    if getattr(original, "_tf_hwopt_hook", False):
        # Left by a fit that ended in an exception (no on_train_end): replaced, not chained.
        original = type(optimizer).finalize_variable_values.__get__(optimizer)

    def finalize_variable_values(var_list):
        hook()
        return original(model.trainable_weights)

    finalize_variable_values._tf_hwopt_hook = True
    optimizer.finalize_variable_values = finalize_variable_values

    def undo() -> None:
        optimizer.__dict__.pop("finalize_variable_values", None)

    return undo


def retire_train_function(model) -> None:
    """Keeps `model`'s train function alive as long as the model, before `make_train_function(force=True)`.

    Measured on Keras 3.15 / TensorFlow 2.21 (char Transformer, NumPy
    inputs, a freeze at an epoch start): when the replaced train function
    was released, the previous epoch's tf.data iterator was then destroyed
    waiting 9.5-10 s for its autotuning thread, with no CPU used, in 3 of 4
    runs; with the replaced function kept, in none of 4. Kept until the
    model is released, it then goes in 0.2-0.4 s. Stored with
    `object.__setattr__`, outside Keras's attribute tracking (Keras 3.15:
    `Layer.__setattr__` wraps lists).
    """
    function = getattr(model, "train_function", None)
    if function is None:
        return
    retired = model.__dict__.get(_RETIRED_ATTRIBUTE)
    if retired is None:
        retired = []
        object.__setattr__(model, _RETIRED_ATTRIBUTE, retired)
    retired.append(function)


def compile_config(model) -> dict | None:
    """The arguments `model.compile` was called with, or None.

    Re-compiling a model like the user did (e.g. a suffix model that trains
    on cached activations) needs them; Keras keeps them only in a private
    serialized config (Keras 3.15: `Model._compile_config`).
    """
    config = getattr(model, "_compile_config", None)
    return None if config is None else config.config


def fit_argument(model, name: str):
    """Argument `name` (`"x"`, `"y"`, `"batch_size"`...) of the `fit` running `model`, or None.

    Keras does not hand callbacks the training data; the running `fit` frame
    has it. Only read, never changed (Keras 3.15: `Trainer.fit` locals).
    """
    frame = inspect.currentframe()
    try:
        while frame is not None:
            if frame.f_code.co_name == "fit" and frame.f_locals.get("self") is model:
                value = frame.f_locals.get(name)
                if value is not None:
                    return value
            frame = frame.f_back
    finally:
        del frame
    return None


# ------------------------------------------------------- tf_keras and TFMOT


def autograph_disabled():
    """A context in which tf_keras builds layer graphs without AutoGraph.

    tf_keras converts every layer's `call` with AutoGraph when it builds a
    Functional graph (`base_layer._infer_output_signature` asks
    `ag_ctx.control_status_ctx()`). For the stock layers and TFMOT wrappers
    of the reference model, which need no conversion, that is 2/3 of the
    reference build's time. `tf.function(autograph=False)` covers traced
    functions only; the status context that layer construction reads is
    private (TensorFlow 2.21: `autograph.core.ag_ctx.ControlStatusCtx`).
    """
    from tensorflow.python.autograph.core import ag_ctx

    return ag_ctx.ControlStatusCtx(status=ag_ctx.Status.DISABLED)


def tf_keras_own_lambdas_allowed():
    """A context in which tf_keras deserializes Python lambdas (of `Lambda` layers).

    TFMOT's `quantize_apply` rebuilds the reference model from its config
    several times; tf_keras refuses a `Lambda` layer's Python function there
    unless safe mode is off. The function is the user's own, already loaded
    in this process: nothing from a file is deserialized. tf_keras exports
    only a global switch (`enable_unsafe_deserialization`); its thread-local
    scope is private (tf_keras 2.21: `saving.serialization_lib.SafeModeScope`).
    """
    from tf_keras.src.saving.serialization_lib import SafeModeScope

    return SafeModeScope(False)


def tf_keras_node_output(model, layer):
    """The output tensor of `layer`'s call *inside* `model` (a tf_keras model).

    TFMOT's `quantize_apply` reuses some layer objects of the annotated model
    (a BatchNormalization folded into the convolution before it, an
    Embedding, a LayerNormalization), which then have two inbound nodes, one
    per graph; `layer.output` is then ambiguous and reading it builds a
    disconnected graph. The node that belongs to `model` is the one listed
    in its `_network_nodes` (tf_keras 2.21, TFMOT 0.8.1).
    """
    nodes = layer._inbound_nodes
    for i, node in enumerate(nodes):
        if f"{layer.name}_ib-{i}" in model._network_nodes:
            return node.outputs
    raise ValueError(f"layer {layer.name!r} is not called inside model {model.name!r}")


def tf_keras_producer(layer):
    """The layer feeding `layer`'s first call (tf_keras 2.21: `_inbound_nodes`).

    TFMOT's `QuantizeLayer` quantizes a tensor; calibration needs to know
    which float tensor, and no public API names a layer's inbound layer.
    """
    producer = layer._inbound_nodes[0].inbound_layers
    return producer[0] if isinstance(producer, list) else producer


def tfmot_default_registry():
    """TFMOT's default 8-bit quantize registry.

    `quantize_model` applies it to whole models only; annotating layer by
    layer (so that unsupported layers stay float instead of failing the whole
    model) needs to ask it which layers it supports. Not exported
    (TFMOT 0.8.1: `default_8bit.default_8bit_quantize_registry`).
    """
    from tensorflow_model_optimization.python.core.quantization.keras.default_8bit import (
        default_8bit_quantize_registry as registry_lib,
    )

    return registry_lib.Default8BitQuantizeRegistry()


def tfmot_weight_quantizers(layer) -> list:
    """A TFMOT wrapper's `(weight, quantizer, range variables)` triples (TFMOT 0.8.1: `_weight_vars`).

    Calibration sets the weight ranges by calling each quantizer on its
    weight in training mode, as the wrapper's own `call` does, without
    running the layers; and it sets activation ranges itself, so it must
    tell the two kinds of range variables apart. Only this private list
    says which quantizer belongs to which weight.
    """
    return list(getattr(layer, "_weight_vars", []))


# --------------------------------------------------------------- KerasTuner


def metrics_dict(histories, objective) -> dict:
    """The metrics dict KerasTuner makes of what `run_trial` returns.

    A tuner that adds its own metrics (the step time) to a trial's results
    must first turn the fit histories into KerasTuner's dict exactly as
    `Tuner.run_trial`'s caller would; the helper doing it is private
    (KerasTuner 1.4.8: `keras_tuner.src.engine.tuner_utils.convert_to_metrics_dict`).
    """
    from keras_tuner.src.engine import tuner_utils

    return tuner_utils.convert_to_metrics_dict(histories, objective)


def kerastuner_is_worker() -> bool:
    """Whether this process is a worker (not the chief) of KerasTuner's distributed mode.

    KerasTuner reads the `KERASTUNER_*` environment in a private helper and
    exports no public test (KerasTuner 1.4.8: `keras_tuner.src.distribute.utils`).
    """
    from keras_tuner.src.distribute import utils as dist_utils

    return dist_utils.has_chief_oracle() and not dist_utils.is_chief_oracle()


class FilteredRandomValues:
    """Oracle mixin: randomly drawn values must pass `self.accept_values(values)`.

    KerasTuner draws random candidates in the private `Oracle._random_values`
    (RandomSearch's proposals, BayesianOptimization's initial points,
    Hyperband's first rounds) and offers no public hook to veto one
    (KerasTuner 1.4.8). A rejected draw is marked tried (the private
    `Oracle._tried_so_far`, keyed by `_compute_values_hash`) so that it is not
    drawn again. KerasTuner gives up after 20 repeated draws in a row, which
    ends a search while feasible candidates are still untried once most of a
    small space is rejected; this keeps drawing up to `self.max_proposals`
    times.
    """

    def _random_values(self):
        for _ in range(self.max_proposals):
            values = super()._random_values()
            if values is None:  # 20 repeats in a row: not necessarily exhausted
                continue
            if self.accept_values(values):
                return values
            self._tried_so_far.add(self._compute_values_hash(values))
        return None


def hyperband_release_slot(oracle, trial_id: str) -> bool:
    """Frees a Hyperband bracket's slot held by a trial that never trained.

    Hyperband counts a first-round slot as used once a trial is created in it,
    and an over-budget trial (ended before training) would leave its bracket
    with one candidate fewer to promote. The bracket bookkeeping is private
    (KerasTuner 1.4.8: `HyperbandOracle._brackets`, each with `rounds` of
    `{"past_id", "id"}`); removing the entry lets the oracle fill the slot with
    another candidate. Returns whether a slot was freed.
    """
    freed = False
    for bracket in oracle._brackets:
        for round_info in bracket["rounds"]:
            kept = [info for info in round_info if info["id"] != trial_id]
            freed |= len(kept) != len(round_info)
            round_info[:] = kept
    return freed


class QuietTrialOutcomes:
    """Tuner mixin: an exception of type `self.outcome_error` ends its trial FAILED, with its message, quietly.

    KerasTuner prints the traceback of every failing trial (its `config.DEBUG`
    is True by default) in the private `BaseTuner._try_run_and_update_trial`,
    which runs the trial through the private `_run_and_update_trial`
    (KerasTuner 1.4.8). A candidate over budget is an expected outcome, not an
    error: it is caught here, and the trial is ended FAILED with the reason in
    the public `on_trial_end`, before the (chief) oracle sees it.
    """

    outcome_error: type = Exception

    def _run_and_update_trial(self, trial, *fit_args, **fit_kwargs):
        try:
            return super()._run_and_update_trial(trial, *fit_args, **fit_kwargs)
        except self.outcome_error as err:
            self.__dict__.setdefault("_trial_outcomes", {})[trial.trial_id] = str(err)

    def on_trial_end(self, trial):
        message = self.__dict__.get("_trial_outcomes", {}).pop(trial.trial_id, None)
        if message is not None:
            trial.status, trial.message = "FAILED", message
        super().on_trial_end(trial)
