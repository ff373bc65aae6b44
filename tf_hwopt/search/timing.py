"""Step timing: measured with XLA on the device present, or estimated for a target.

`time_step` compiles the model's train step (Keras's own train function, with
`jit_compile=True`) or its serving forward pass with XLA, runs warm-up steps so
that compilation is excluded, synchronises by reading the result back to the
host before each clock read (device work is asynchronous), times N steps and
reports the median and the spread. The model's weights and optimizer state
are restored afterwards: timing a candidate never trains it.

`estimate_step` is for a target that is not present (a TPU profile on a
laptop): it counts the step's FLOPs with TensorFlow's graph profiler and the
bytes it moves, and returns the roofline floor of the target profile. The
result says `kind="estimated"`; measured results say `kind="measured"`.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

import keras
import tensorflow as tf

from tf_hwopt.flops import graph_float_ops
from tf_hwopt.hardware.profiles import HardwareProfile, as_profile, roofline_ms

MODES = ("train", "serve")


@dataclasses.dataclass(frozen=True)
class StepTiming:
    """The time of one step.

    Attributes:
        median_ms: median step time (or the roofline floor when estimated).
        kind: `"measured"` or `"estimated"`; never mix the two unlabelled.
        mode: `"train"` or `"serve"`.
        p10_ms, p90_ms: spread of the measured steps (equal to the median
            when estimated).
        cv: coefficient of variation of the measured steps.
        steps: number of timed steps (0 when estimated).
        compile_ms: time of the first (compiling) call, excluded from the median.
        peak_memory_bytes: peak device memory where the device reports it.
        flops, bytes_moved: per step, when estimated.
        device: where it was measured, or the target profile's name.
        blocks: blocks the timed steps were split into (the median is the
            median of the block medians).
    """

    median_ms: float
    kind: str
    mode: str
    p10_ms: float
    p90_ms: float
    cv: float
    steps: int
    compile_ms: float | None = None
    peak_memory_bytes: int | None = None
    flops: float | None = None
    bytes_moved: float | None = None
    device: str = ""
    blocks: int = 1

    def label(self) -> str:
        return f"{self.median_ms:.3f} ms ({self.kind}, {self.mode}, {self.device})"


def _check_mode(mode):
    if mode not in MODES:
        raise ValueError(f"`mode` must be one of {MODES}. Received: mode={mode!r}")


def _weights_state(model):
    """Every variable a training step changes, and its value now.

    The optimizer is built first: its slot variables (Adam's moments) would
    otherwise be created by the timed steps and left behind with their values.
    """
    if model.optimizer is not None and not model.optimizer.built:
        with model.distribute_strategy.scope():  # slots live where the strategy places the weights
            model.optimizer.build(model.trainable_variables)
    variables = list(model.variables)
    if model.optimizer is not None:
        variables += list(model.optimizer.variables)
    return variables, [v.numpy() for v in variables]


def _weight_bytes(model) -> int:
    return sum(int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize for v in model.weights)


def _activation_bytes(model, batch_size: int) -> int:
    """One batch of every layer's output, as float32."""
    total = 0
    for layer in model.layers:
        try:
            out = layer.output
        except (AttributeError, ValueError):
            continue
        for t in keras.tree.flatten(out):
            shape = [d for d in t.shape[1:] if d is not None]
            total += int(np.prod(shape)) * batch_size * 4
    return total


def model_memory_bytes(model, batch_size: int, mode: str = "train") -> int:
    """A lower bound on device memory for a step: weights (+ grads and two
    optimizer slots when training) and one batch of every layer's output."""
    factor = 4 if mode == "train" else 1  # weights, grads, 2 Adam slots
    return _weight_bytes(model) * factor + _activation_bytes(model, batch_size)


def time_step(
    model: keras.Model,
    batch,
    *,
    mode: str = "train",
    warmup: int = 5,
    steps: int = 40,
    blocks: int | None = None,
    profile: HardwareProfile | str | None = None,
    jit_compile: bool = True,
    steps_per_execution: int | None = None,
) -> StepTiming:
    """Measures one XLA-compiled step of `model` on `batch` on this device.

    The step is Keras's own train function (as `fit` runs it, fed from a
    `tf.data` iterator, `steps_per_execution` steps per call) or the serving
    forward pass. The timed calls are split into `blocks` consecutive blocks;
    the reported step time is the median of the blocks' median step times,
    which a burst of noise on a shared host moves less than the mean or a
    single median.

    Args:
        model: a Keras model; compiled (loss and optimizer) for `mode="train"`.
        batch: `(x, y)` or `(x, y, sample_weight)` for training, `x` (or
            `(x, y)`) for serving; its first dimension is the batch size.
        mode: `"train"` (forward, backward, optimizer update) or `"serve"`.
        warmup: calls after the first (compiling) one that are not timed.
        steps: timed calls in all.
        blocks: blocks the timed calls are split into (1 <= blocks <= steps;
            default `min(8, steps)`).
        profile: if given, a candidate whose memory lower bound exceeds the
            profile's memory is refused before anything runs.
        jit_compile: compile with XLA (default, as on TPU).
        steps_per_execution: training steps per call (default: the model's
            own, as compiled); the reported time is per step.

    Returns:
        A `StepTiming` with `kind="measured"`.

    Example:
    >>> timing = time_step(model, (x, y), mode="train")
    >>> timing.median_ms, timing.cv
    """
    _check_mode(mode)
    if not isinstance(steps, int) or steps < 3:
        raise ValueError(f"`steps` must be an integer >= 3. Received: steps={steps!r}")
    if not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"`warmup` must be an integer >= 0. Received: warmup={warmup!r}")
    blocks = min(8, steps) if blocks is None else blocks
    if not isinstance(blocks, int) or not 1 <= blocks <= steps:
        raise ValueError(f"`blocks` must be an integer in [1, steps={steps}]. Received: blocks={blocks!r}")
    if steps_per_execution is not None and (not isinstance(steps_per_execution, int) or steps_per_execution < 1):
        raise ValueError(
            f"`steps_per_execution` must be None or an integer >= 1. Received: {steps_per_execution!r}"
        )
    x, y, sample_weight = _unpack(batch)
    batch_size = int(keras.tree.flatten(x)[0].shape[0])
    if profile is not None:
        profile = as_profile(profile)
        need = model_memory_bytes(model, batch_size, mode)
        have = profile.memory_gib * 2**30
        if need > have:
            raise ValueError(
                f"Candidate {model.name!r} needs at least {need / 2**30:.2f} GiB for a {mode} step "
                f"with batch {batch_size}, more than the {profile.memory_gib:g} GiB of {profile.name}."
            )
    if mode == "train":
        if getattr(model, "optimizer", None) is None or getattr(model, "loss", None) is None:
            raise ValueError("time_step(mode='train') needs a compiled model (loss and optimizer).")
        if y is None:
            raise ValueError("time_step(mode='train') needs `batch=(x, y)`.")
        variables, saved = _weights_state(model)
        previous = model.jit_compile, model.steps_per_execution
        per_call = steps_per_execution or int(model.steps_per_execution or 1)
        model.jit_compile = jit_compile
        model.steps_per_execution = per_call
        model.make_train_function(force=True)
        data = (x, y) if sample_weight is None else (x, y, sample_weight)
        # As `fit` feeds it: a (distributed) tf.data iterator of global batches.
        dataset = tf.data.Dataset.from_tensors(data).repeat()
        iterator = iter(model.distribute_strategy.experimental_distribute_dataset(dataset))

        def call():
            return model.train_function(iterator)

    else:
        variables, per_call = None, 1
        forward = tf.function(lambda inputs: model(inputs, training=False), jit_compile=jit_compile, autograph=False)

        def call():
            return forward(x)

    def sync(result):
        for t in keras.tree.flatten(result):
            np.asarray(t)

    try:
        start = time.perf_counter()
        sync(call())
        compile_ms = 1e3 * (time.perf_counter() - start)
        for _ in range(warmup):
            sync(call())
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            sync(call())
            times.append(1e3 * (time.perf_counter() - start) / per_call)
    finally:
        if variables is not None:
            for v, value in zip(variables, saved):
                v.assign(value)
            model.jit_compile, model.steps_per_execution = previous
            model.make_train_function(force=True)
    times = np.asarray(times)
    return StepTiming(
        median_ms=median_of_block_medians(times, blocks),
        kind="measured",
        mode=mode,
        p10_ms=float(np.percentile(times, 10)),
        p90_ms=float(np.percentile(times, 90)),
        cv=float(times.std() / times.mean()),
        steps=steps,
        compile_ms=compile_ms,
        peak_memory_bytes=_peak_memory(),
        device=_device_name(),
        blocks=blocks,
    )


def median_of_block_medians(times, blocks: int) -> float:
    """The median over `blocks` consecutive blocks of each block's median.

    Example:
    >>> median_of_block_medians([1.0, 1.0, 9.0, 2.0, 2.0, 2.0], 2)
    1.5
    """
    times = np.asarray(times, float)
    if not 1 <= blocks <= len(times):
        raise ValueError(f"`blocks` must be in [1, {len(times)}]. Received: blocks={blocks!r}")
    return float(np.median([np.median(block) for block in np.array_split(times, blocks)]))


def _unpack(batch):
    """`(x, y, sample_weight)` from a batch as `fit` takes it (`x`, `(x, y)` or `(x, y, sample_weight)`)."""
    if isinstance(batch, tuple) and len(batch) in (2, 3):
        return batch + (None,) * (3 - len(batch))
    return batch, None, None


def _device_name() -> str:
    gpus = tf.config.list_logical_devices("GPU")
    return gpus[0].name if gpus else "/CPU:0"


def _peak_memory() -> int | None:
    for device in ("GPU:0", "TPU:0"):
        try:
            return int(tf.config.experimental.get_memory_info(device)["peak"])
        except (ValueError, tf.errors.NotFoundError, KeyError):
            continue
    return None


def estimate_step(
    model: keras.Model,
    batch,
    profile: HardwareProfile | str,
    *,
    mode: str = "train",
) -> StepTiming:
    """Estimates one step on `profile` from FLOPs and bytes moved (roofline floor).

    FLOPs are counted by TensorFlow's graph profiler on the traced step
    (forward; plus backward when training, by differentiating the loss).
    Bytes moved: weights read (and, when training, gradients written, weights
    and two optimizer slots read and written) plus every layer's output
    written once and, when training, read again by the backward pass.

    Returns:
        A `StepTiming` with `kind="estimated"`.
    """
    _check_mode(mode)
    profile = as_profile(profile)
    x, y, _ = _unpack(batch)
    specs = keras.tree.map_structure(lambda a: tf.TensorSpec(np.shape(a), tf.as_dtype(np.asarray(a).dtype)), x)
    trainable = model.trainable_variables

    if mode == "train":
        if getattr(model, "loss", None) is None or y is None:
            raise ValueError("estimate_step(mode='train') needs a compiled model and `batch=(x, y)`.")
        y_spec = tf.TensorSpec(np.shape(y), tf.as_dtype(np.asarray(y).dtype))

        def fn(inputs, labels):
            with tf.name_scope("step"), tf.GradientTape() as tape:
                y_pred = model(inputs, training=True)
                loss = model.compute_loss(x=inputs, y=labels, y_pred=y_pred, training=True)
            return tape.gradient(loss, trainable)

        graph = tf.function(fn, autograph=False).get_concrete_function(specs, y_spec).graph
    else:

        def fn(inputs):
            with tf.name_scope("step"):
                return model(inputs, training=False)

        graph = tf.function(fn, autograph=False).get_concrete_function(specs).graph
    flops = float(sum(graph_float_ops(graph).values()))
    batch_size = int(keras.tree.flatten(x)[0].shape[0])
    weight_bytes = _weight_bytes(model)
    activation_bytes = _activation_bytes(model, batch_size)
    if mode == "train":
        bytes_moved = 7 * weight_bytes + 2 * activation_bytes
    else:
        bytes_moved = weight_bytes + activation_bytes
    # The target trains and serves in its profile's dtype policy.
    compute_dtype = "float32" if profile.dtype_policy == "float32" else "bfloat16"
    ms = roofline_ms(flops, bytes_moved, profile, dtype=compute_dtype)
    return StepTiming(
        median_ms=ms,
        kind="estimated",
        mode=mode,
        p10_ms=ms,
        p90_ms=ms,
        cv=0.0,
        steps=0,
        flops=flops,
        bytes_moved=float(bytes_moved),
        device=profile.name,
    )
