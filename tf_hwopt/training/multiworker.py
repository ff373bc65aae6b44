"""A custom training loop for several workers, with the same freezing engine.

Keras 3's `model.fit` does not run under `MultiWorkerMirroredStrategy`
(keras-team/keras#20585: `ValueError: Attempt to convert a value
(PerReplica...)`, reproduced with keras 3.15 and TF 2.21 on two local
workers, with and without XLA). Multi-host data parallelism is where a frozen
module's saved gradient all-reduce matters most, so `fit_multi_worker` trains
there with a custom loop: `strategy.run` over a distributed dataset,
gradients only for the trainable variables, the step function rebuilt after a
freeze (so frozen modules drop out of the gradient all-reduce).

One decision for all workers. The freezing callback (Egeria, FreezeOut, ...)
runs on the chief only; after every step the chief's frozen set is
broadcast to every worker with a collective (an all-reduce of the chief's
0/1 vector against zeros from the others), and each worker applies it before
its next step. Re-computing the decision on every worker would be identical
only if every float of every plasticity evaluation were, which nothing
guarantees across hosts; a broadcast makes it identical by construction, and
a worker can never step with another worker's trainable set (which would
mismatch the collectives and hang).

Which path to take:

- a TPU slice or pod: `TPUStrategy` + `model.fit` with the callback;
- one host with several GPUs: `MirroredStrategy` + `model.fit`;
- several hosts: `MultiWorkerMirroredStrategy` + `fit_multi_worker`.
"""

from __future__ import annotations

import time
from typing import Sequence

import numpy as np

import keras
import tensorflow as tf

from tf_hwopt._checks import check_positive_int
from tf_hwopt.freezing.callback import FreezingCallback
from tf_hwopt.freezing.engine import FreezingEngine
from tf_hwopt.freezing.modules import partition_modules
from tf_hwopt.training.result import TrainingResult


def is_chief(strategy: tf.distribute.Strategy) -> bool:
    """Whether this process is the chief (the worker that decides and saves)."""
    return bool(strategy.extended.should_checkpoint)


def _make_step(model, loss, strategy, global_batch_size):
    variables = list(model.trainable_variables)  # frozen modules are not in it

    def replica_step(inputs):
        x, y = inputs
        with tf.GradientTape() as tape:
            predictions = model(x, training=True)
            per_example = loss.call(y, predictions)
            per_example = tf.reshape(per_example, [tf.shape(per_example)[0], -1])
            value = tf.nn.compute_average_loss(tf.reduce_mean(per_example, axis=1), global_batch_size=global_batch_size)
        gradients = tape.gradient(value, variables)
        model.optimizer.apply_gradients(zip(gradients, variables))
        return value

    @tf.function
    def step(iterator):
        per_replica = strategy.run(replica_step, args=(next(iterator),))
        return strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None)

    return step, len(variables)


def _make_broadcast(strategy):
    @tf.function
    def broadcast(vector):
        per_replica = strategy.run(tf.identity, args=(vector,))
        return strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None)

    return broadcast


def fit_multi_worker(
    model: keras.Model,
    x,
    y,
    *,
    epochs: int,
    batch_size: int,
    freezer: FreezingCallback | None = None,
    validation_data=None,
    callbacks: Sequence[keras.callbacks.Callback] = (),
    seed: int = 0,
    verbose: int = 1,
    loss: keras.losses.Loss,
    strategy: tf.distribute.Strategy,
) -> TrainingResult:
    """Trains `model` under `strategy` with a custom loop, freezing as `freezer` decides.

    Args:
        model: built and compiled (for its optimizer) under `strategy.scope()`.
        x, y: training arrays; every worker passes the same arrays and the
            dataset is sharded by data across workers.
        epochs, batch_size: the run; `batch_size` is the global batch, split
            over all replicas (a short last batch is dropped).
        freezer: a freezing callback; it runs on the chief, whose decisions
            every worker applies at the same step.
        validation_data: `(x_val, y_val)`; its loss is computed at each
            epoch end, on every worker (no collective).
        callbacks: Keras callbacks run on the chief (train, epoch and batch
            hooks, with the `loss` in their logs).
        seed: shuffling seed.
        verbose: 1 prints one line per epoch.
        loss: a Keras loss object (its per-example `call` is used).
        strategy: `MultiWorkerMirroredStrategy` (several workers, from
            `TF_CONFIG`), or `MirroredStrategy` (one host).

    Returns:
        A `TrainingResult`: `history["loss"]` (and `val_loss`) per epoch; one
        phase; `details` with `frozen_at_step` ([indices] per step),
        `gradient_tensors_at_step`, `chief`, `steps` and `seconds`.

    Example:
    >>> strategy = tf.distribute.MultiWorkerMirroredStrategy()   # TF_CONFIG set
    >>> with strategy.scope():
    ...     model = build(); model.compile(optimizer="adam", loss=loss)
    >>> fit_multi_worker(model, x, y, epochs=5, batch_size=256, freezer=tf_hwopt.EgeriaCallback(),
    ...                  loss=loss, strategy=strategy)
    """
    check_positive_int("epochs", epochs)
    check_positive_int("batch_size", batch_size)
    global_batch_size = batch_size
    if getattr(model, "optimizer", None) is None:
        raise ValueError("`model` must be compiled (under `strategy.scope()`) so that it has an optimizer.")
    if not isinstance(loss, keras.losses.Loss):
        raise ValueError(f"`loss` must be a keras.losses.Loss object. Received: {type(loss).__name__}")
    if freezer is not None and not isinstance(freezer, FreezingCallback):
        raise ValueError(f"`freezer` must be a freezing callback. Received: {type(freezer).__name__}")
    steps_per_epoch = len(x) // global_batch_size
    if steps_per_epoch < 1:
        raise ValueError(f"`batch_size`={global_batch_size} is larger than the data ({len(x)} examples).")
    chief = is_chief(strategy)
    local_replicas = strategy.num_replicas_in_sync // _num_workers(strategy)

    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    dataset = (
        tf.data.Dataset.from_tensor_slices((np.asarray(x), np.asarray(y)))
        .shuffle(len(x), seed=seed, reshuffle_each_iteration=True)
        .batch(global_batch_size, drop_remainder=True)
        .repeat()
        .with_options(options)
    )
    iterator = iter(strategy.experimental_distribute_dataset(dataset))

    if freezer is not None:
        freezer.provide_data(np.asarray(x), np.asarray(y))
    modules = partition_modules(model, freezer.module_names if freezer is not None else None)
    if freezer is not None and chief:
        freezer.set_model(model)
        freezer.set_params({"epochs": epochs, "steps": steps_per_epoch, "verbose": verbose})
        freezer.on_train_begin()
        engine = freezer.engine
    else:
        engine = FreezingEngine(model, modules)
    state = {}

    def rebuild(*_):
        state["step"], state["tensors"] = _make_step(model, loss, strategy, global_batch_size)

    rebuild()
    engine.listeners.append(rebuild)
    broadcast = _make_broadcast(strategy)

    history = {"loss": [], "frozen_at_step": [], "gradient_tensors_at_step": [], "chief": chief}
    epoch_loss = {"loss": []}
    user_callbacks = keras.callbacks.CallbackList(list(callbacks), model=model) if chief and callbacks else None
    if user_callbacks is not None:
        user_callbacks.set_params({"epochs": epochs, "steps": steps_per_epoch, "verbose": verbose})
        user_callbacks.on_train_begin()
    started = time.perf_counter()
    agreed = np.zeros(len(modules), bool)  # the last broadcast frozen set

    def sync(agreed):
        """Every worker takes the chief's frozen set; returns it."""
        mine = np.asarray(engine.frozen, np.float32) if chief else np.zeros(len(modules), np.float32)
        decided = np.asarray(broadcast(tf.constant(mine))) / local_replicas > 0.5
        _apply(engine, decided)
        # Same list on every worker (from the broadcast decision), so the
        # collectives below match.
        for i in np.flatnonzero(decided & ~agreed):
            _share_chief_state(modules[i], broadcast, chief, local_replicas)
        return decided

    try:
        for epoch in range(epochs):
            if freezer is not None and chief:
                freezer.on_epoch_begin(epoch)
            if user_callbacks is not None:
                user_callbacks.on_epoch_begin(epoch)
            total = 0.0
            for batch in range(steps_per_epoch):
                value = float(state["step"](iterator))
                total += value
                history["gradient_tensors_at_step"].append(state["tensors"])
                if freezer is not None and chief:
                    freezer.on_train_batch_end(batch, {"loss": value})
                if user_callbacks is not None:
                    user_callbacks.on_train_batch_end(batch, {"loss": value})
                if freezer is not None:
                    agreed = sync(agreed)
                history["frozen_at_step"].append([i for i, f in enumerate(engine.frozen) if f])
            history["loss"].append(total / steps_per_epoch)
            logs = {"loss": history["loss"][-1]}
            if validation_data is not None:
                x_val, y_val = validation_data
                logs["val_loss"] = float(keras.ops.convert_to_numpy(loss(y_val, model(x_val, training=False))))
            for key, value in logs.items():
                epoch_loss.setdefault(key, []).append(value)
            if freezer is not None and chief:
                freezer.on_epoch_end(epoch, dict(logs))
            if freezer is not None:
                agreed = sync(agreed)  # freezes the chief applied at the epoch end (`freeze_at`)
            if user_callbacks is not None:
                user_callbacks.on_epoch_end(epoch, dict(logs))
            if verbose:
                print(f"epoch {epoch + 1}/{epochs}: loss {history['loss'][-1]:.4f}, "
                      f"frozen {engine.num_frozen}", flush=True)
    finally:
        if freezer is not None and chief:
            freezer.on_train_end()
        else:
            engine.restore()
        if user_callbacks is not None:
            user_callbacks.on_train_end()
    history["seconds"] = time.perf_counter() - started
    history["steps"] = len(history["frozen_at_step"])
    del history["loss"]
    return TrainingResult(
        history=epoch_loss,
        phases=[{"first_epoch": 0, "epochs": epochs, "steps_per_epoch": steps_per_epoch}],
        details=history,
        freezer=freezer.summary() if freezer is not None and chief else None,
    )


def _num_workers(strategy) -> int:
    resolver = strategy.cluster_resolver
    if resolver is None:
        return 1
    spec = resolver.cluster_spec().as_dict()
    return max(1, len(spec.get("worker", [])) + len(spec.get("chief", [])))


def _share_chief_state(module, broadcast, chief: bool, local_replicas: int) -> None:
    """Gives a newly frozen module the chief's non-trainable state on every worker.

    BatchNormalization's moving statistics are updated from each worker's
    own batches (unsynchronised BatchNormalization), so they differ between
    workers; a frozen module then computes with them for the rest of
    training. Copying the chief's makes the frozen module identical everywhere.
    """
    for layer in module.layers:
        for variable in layer.non_trainable_weights:
            if not variable.dtype.startswith("float"):
                continue
            mine = variable.numpy() if chief else np.zeros(variable.shape, variable.dtype)
            variable.assign(np.asarray(broadcast(tf.constant(mine))) / local_replicas)


def _apply(engine: FreezingEngine, decided) -> None:
    """Makes the local frozen set exactly `decided` (the chief's)."""
    thaw = [i for i, (f, d) in enumerate(zip(engine.frozen, decided)) if f and not d]
    freeze = [i for i, (f, d) in enumerate(zip(engine.frozen, decided)) if d and not f]
    if thaw:
        engine.unfreeze(thaw)
    if freeze:
        engine.freeze(freeze)


