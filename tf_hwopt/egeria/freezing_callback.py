"""`FreezingCallback`: the base of every freezing policy inside `model.fit`.

One freezing mechanism, several policies. This base class owns what every
policy shares: the module partition, the `FreezingEngine` (the only code that
flips `trainable` and rebuilds the train function), step counting that works
with `steps_per_execution`, the `frozen_modules` entry in the Keras logs, the
event list, the FLOP accounting, the overhead clock, TensorBoard, and handing
the model back fully trainable at the end of `fit`. A policy subclass decides
*when* to call `_freeze`; see `EgeriaCallback`, `FreezeOutCallback` and
`GradientNormFreezeCallback`.
"""

from __future__ import annotations

import time
import warnings

import numpy as np
from typing import Sequence

from tf_hwopt._quiet import import_tensorflow_quietly

import_tensorflow_quietly()

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

from tf_hwopt import _internals  # noqa: E402
from tf_hwopt.egeria.freezing import FreezingEngine  # noqa: E402
from tf_hwopt.egeria.modules import graph_kind, partition_modules  # noqa: E402
from tf_hwopt.egeria.plasticity import ActivationReader  # noqa: E402

# A module is not frozen while its BatchNormalization layers' moving
# statistics are further than this (relative RMS of the normalized output)
# from the batch statistics on the probe: frozen, it would compute something
# else than what training has been computing.
BATCH_NORM_DRIFT_LIMIT = 0.25


def batch_norm_drift(x, moving_mean, moving_variance, *, axis=-1, epsilon: float = 1e-3) -> float:
    """How far a BatchNormalization's moving statistics are from the batch's own.

    For input `x` (a batch), the relative RMS difference between the layer's
    normalized output under its batch statistics (training) and under its
    moving statistics (inference, and once frozen). Per channel with batch
    std `s_b`, moving std `s_m` and means `mu_b`, `mu_m`, the mean squared
    difference of the two normalized outputs is
    `(s_b / s_m - 1)^2 + ((mu_b - mu_m) / s_m)^2`; the result is the square
    root of its mean over channels. 0 when the statistics agree.

    Example:
    >>> x = np.random.RandomState(0).normal(3.0, 2.0, (512, 4))
    >>> round(batch_norm_drift(x, x.mean(0), x.var(0)), 6)
    0.0
    >>> batch_norm_drift(x, np.zeros(4), np.ones(4)) > 1   # statistics at init
    True
    """
    x = np.asarray(x, np.float64)
    axes = [axis] if isinstance(axis, int) else list(axis)
    axes = [a % x.ndim for a in axes]
    reduce = tuple(a for a in range(x.ndim) if a not in axes)
    mean_b = x.mean(axis=reduce)
    std_b = np.sqrt(x.var(axis=reduce) + epsilon)
    mean_m = np.asarray(moving_mean, np.float64).reshape(mean_b.shape)
    std_m = np.sqrt(np.asarray(moving_variance, np.float64).reshape(mean_b.shape) + epsilon)
    squared = (std_b / std_m - 1.0) ** 2 + ((mean_b - mean_m) / std_m) ** 2
    return float(np.sqrt(np.mean(squared)))


def timed(method):
    """Adds the wall time spent in a callback hook to the callback's overhead.

    Re-entrant: a timed hook calling another timed hook counts once.
    """

    def wrapper(self, *args, **kwargs):
        if self._timing_depth:
            return method(self, *args, **kwargs)
        self._timing_depth += 1
        start = time.perf_counter()
        try:
            return method(self, *args, **kwargs)
        finally:
            self._timing_depth -= 1
            self._overhead_seconds += time.perf_counter() - start

    wrapper.__name__ = method.__name__
    wrapper.__doc__ = method.__doc__
    return wrapper


def fit_argument(model, name: str, what: str):
    """Argument `name` (`"x"` or `"y"`) of the `fit` call now running `model`.

    Keras does not hand callbacks the training data; the running `fit` frame
    has it. `what` completes the error raised when it cannot be found.
    """
    value = _internals.fit_argument(model, name)
    if value is None:
        raise ValueError(f"The callback could not find the training data of this fit. It needs {what}.")
    return value


class FreezingCallback(keras.callbacks.Callback):
    """Base class of the freezing callbacks (subclass it for a new policy).

    Subclasses implement `_after_step()` (called after every training step
    has been counted) and call `self._freeze(indices, reason, ...)`. They may
    override `_setup(first_fit)` and `_sample_input()`, and extend
    `summary()`.

    Args:
        modules: explicit partition, a list of lists of layer names front to
            back (required for subclassed models). Default: automatic.
        batch_norm_drift_limit: a module is not frozen while the moving
            statistics of its BatchNormalization layers are further than this
            from the probe batch's statistics (`batch_norm_drift`): frozen,
            it would switch to statistics that do not describe its input yet
            and training collapses. None: no check.
        log_dir: if set, TensorBoard scalars are written there.
        verbose: 1 prints each freeze, 0 is silent.
    """

    def __init__(
        self,
        *,
        modules: Sequence[Sequence[str]] | None = None,
        batch_norm_drift_limit: float | None = BATCH_NORM_DRIFT_LIMIT,
        log_dir: str | None = None,
        verbose: int = 1,
    ):
        super().__init__()
        if batch_norm_drift_limit is not None and (
            isinstance(batch_norm_drift_limit, bool)
            or not isinstance(batch_norm_drift_limit, (int, float))
            or not batch_norm_drift_limit > 0
        ):
            raise ValueError(
                "`batch_norm_drift_limit` must be a number > 0 or None. "
                f"Received: batch_norm_drift_limit={batch_norm_drift_limit!r}"
            )
        self.batch_norm_drift_limit = batch_norm_drift_limit
        if modules is not None and (isinstance(modules, (str, bytes)) or len(modules) < 2):
            raise ValueError(
                "`modules` must list at least 2 modules (lists of layer names), front "
                f"to back; the last is the head, which never freezes. Received: modules={modules!r}"
            )
        self.module_names = modules
        self.log_dir = log_dir
        self.verbose = verbose
        self.modules = None
        self.engine: FreezingEngine | None = None
        self.events: list[dict] = []
        self._writer = None
        self._step = 0
        self._epoch = 0
        self._last_batch = -1
        self._frozen_flops_steps = 0.0
        self._timing_depth = 0
        self._overhead_seconds = 0.0
        self._wall_start = None
        self._wall_seconds = 0.0
        self._final = None
        # Modules frozen when the last fit ended, frozen again by the next fit.
        self._frozen_between_fits: list[int] = []
        # Set when the callback stepped aside (it cannot handle this model):
        # training goes on, nothing more is frozen.
        self.disabled_reason: str | None = None
        self._setup_pending = False
        self.freezes_deferred = 0
        self._deferral_told: set = set()
        self._batch_norm_readers: dict = {}

    # ----------------------------------------------------------- subclass API

    def _sample_input(self):
        """One batch of model inputs (for FLOP counting of subclassed models)."""
        return None

    def _setup(self, first_fit: bool) -> None:
        """Called at train begin, once modules and engine exist."""

    def _after_step(self) -> None:
        """Called after each counted training step (or execution of several)."""

    def _teardown(self) -> None:
        """Called at train end (release threads, files...)."""

    @property
    def steps_per_epoch(self) -> int | None:
        """Steps per epoch of this fit, when Keras knows it."""
        return self.params.get("steps") if self.params else None

    @property
    def total_steps(self) -> int | None:
        """Training steps this fit will run, when Keras knows it."""
        epochs = self.params.get("epochs") if self.params else None
        return self.steps_per_epoch * epochs if self.steps_per_epoch and epochs else None

    def _resolve_eval_every(self, value: int | None) -> int:
        """`value`, or a quarter epoch (200 steps when the epoch length is unknown)."""
        steps = self.steps_per_epoch
        return value or (max(1, steps // 4) if steps else 200)

    def _resolve_bootstrap(self, value: int | None) -> int:
        """`value`, or 10% of training and at least one epoch (0 when unknown)."""
        if value is not None:
            return value
        return max(self.steps_per_epoch, int(0.1 * self.total_steps)) if self.total_steps else 0

    def _freeze(self, indices, reason: str, **details) -> tuple:
        """Freezes `indices` (front to back) unless a module's output would not stay faithful.

        A frozen BatchNormalization normalizes with its moving statistics
        instead of the batch's. A module whose moving statistics still
        disagree with its batch statistics on the probe batch (see
        `batch_norm_drift`) is not frozen yet; the policy hears of it through
        `_on_freeze_refused` and may propose it again later. Returns the
        modules frozen.
        """
        allowed = []
        for i in indices:
            drift = self._batch_norm_drift(i)
            if drift is not None and drift > self.batch_norm_drift_limit:
                self.freezes_deferred += 1
                if self.verbose and i not in self._deferral_told:
                    self._deferral_told.add(i)
                    print(
                        f"{type(self).__name__}: module {i} ({self.modules[i].name}) not frozen yet at step "
                        f"{self._step}: its BatchNormalization moving statistics are {drift:.2f} (relative RMS) "
                        f"away from the batch statistics (limit {self.batch_norm_drift_limit:g}).",
                        flush=True,
                    )
                self._on_freeze_refused(i)
                break  # front to back: nothing behind it freezes either
            allowed.append(i)
        changed = self.engine.freeze(allowed) if allowed else ()
        self._record("freeze", changed, reason, details)
        return changed

    def _on_freeze_refused(self, index: int) -> None:
        """Tells the policy that module `index` was not frozen after all."""

    def _batch_norm_drift(self, index: int) -> float | None:
        """Largest `batch_norm_drift` of module `index`'s BatchNormalization layers on the probe, or None."""
        layers = [
            layer
            for layer in self.modules[index].layers
            if isinstance(layer, keras.layers.BatchNormalization) and layer.trainable
        ]
        probe = self._sample_input() if layers and self.batch_norm_drift_limit is not None else None
        if probe is None:
            return None
        if index not in self._batch_norm_readers:
            self._batch_norm_readers[index] = ActivationReader(self.model, layers, capture="inputs")
        inputs = self._batch_norm_readers[index](probe)
        return max(
            batch_norm_drift(
                x,
                keras.ops.convert_to_numpy(layer.moving_mean),
                keras.ops.convert_to_numpy(layer.moving_variance),
                axis=layer.axis,
                epsilon=layer.epsilon,
            )
            for layer, x in zip(layers, inputs)
        )

    def _unfreeze(self, indices, reason: str, **details) -> None:
        changed = self.engine.unfreeze(indices)
        self._record("unfreeze", changed, reason, details)

    def _record(self, kind, indices, reason, details) -> None:
        for i in indices:
            event = {
                "kind": kind,
                "module": i,
                "module_name": self.modules[i].name,
                "step": self._step,
                "epoch": self._epoch,
                "reason": reason,
                **details,
            }
            self.events.append(event)
            if self.verbose:
                # Same epoch number as `events` and Keras's logs (0-based),
                # on a line of its own after the progress bar's.
                print(
                    f"{type(self).__name__}: {kind} module {i} ({self.modules[i].name}) at step "
                    f"{self._step} (epoch {self._epoch}): {reason}",
                    flush=True,
                )

    # ------------------------------------------------------------ Keras hooks

    @timed
    def on_train_begin(self, logs=None):
        self._wall_start = time.perf_counter()
        self._final = None
        if getattr(self.model, "optimizer", None) is None:
            raise ValueError(f"{type(self).__name__} needs a compiled model (call `model.compile` first).")
        if self.module_names is None and graph_kind(self.model) == "subclassed":
            raise ValueError(
                f"{type(self).__name__}: model {self.model.name!r} is a subclassed model, whose layer "
                "graph cannot be inspected. Pass `modules`, a list of lists of its layer names "
                "ordered front to back, e.g. modules=[['conv1', 'bn1'], ['block1'], ['head']]."
            )
        if self.disabled_reason is not None:
            return
        # Keras builds an unbuilt (subclassed) model in its first training
        # step: the partition waits for it.
        self._setup_pending = not self.model.built
        if not self._setup_pending:
            self._start()

    def _start(self) -> None:
        """Partition, engine and the policy's setup, once the model is built."""
        self._setup_pending = False
        first_fit = self.modules is None
        if first_fit:
            self.modules = partition_modules(self.model, self.module_names, sample_input=self._sample_input())
        self.engine = FreezingEngine(self.model, self.modules)
        self._batch_norm_readers = {}
        if self.log_dir and self._writer is None:
            self._writer = tf.summary.create_file_writer(self.log_dir)
        try:
            self._setup(first_fit)
        except ValueError:
            raise  # a bad argument or bad data: the user's to fix, before training time is spent
        except Exception as err:  # noqa: BLE001 - whatever else fails, fit goes on
            self._disable(f"setup failed ({type(err).__name__}: {_first_line(err)})")
            return
        # A callback reused for another fit (e.g. one fit per phase) carries on
        # with what it had frozen: no step of the next fit trains those modules.
        self.engine.freeze([i for i in self._frozen_between_fits if not self.engine.frozen[i]])

    def _disable(self, cause: str) -> None:
        """Steps aside for the rest of training, with one warning naming the cause."""
        if self.disabled_reason is not None:
            return
        self.disabled_reason = cause
        warnings.warn(
            f"{type(self).__name__} stopped: {cause}. Training goes on without further freezing"
            + (f" ({self.engine.num_frozen} module(s) stay frozen)." if self.engine and self.engine.num_frozen else "."),
            RuntimeWarning,
            stacklevel=2,
        )

    @property
    def active(self) -> bool:
        """Whether the callback is set up and has not stepped aside."""
        return self.engine is not None and self.disabled_reason is None and not self._setup_pending

    @timed
    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch
        self._last_batch = -1

    @timed
    def on_train_batch_end(self, batch, logs=None):
        # With steps_per_execution > 1, Keras reports the last step of each execution.
        done = batch - self._last_batch if batch > self._last_batch else batch + 1
        self._last_batch = batch
        self._step += done
        if self._setup_pending and self.disabled_reason is None:
            self._start()
        if self.engine is None:
            return
        share = self.engine.frozen_flops_fraction()
        if share is not None:
            self._frozen_flops_steps += share * done
        if self.active:
            try:
                self._after_step()
            except Exception as err:  # noqa: BLE001 - a failure of ours never ends fit
                self._disable(f"{type(err).__name__} at step {self._step}: {_first_line(err)}")
        if logs is not None:
            # An int, so that the progress bar shows `frozen_modules: 2`.
            logs["frozen_modules"] = self.engine.num_frozen

    @timed
    def on_epoch_end(self, epoch, logs=None):
        if self.engine is None:
            return
        if logs is not None:
            logs["frozen_modules"] = self.engine.num_frozen
        if self._writer is not None:
            with self._writer.as_default(step=self._step):
                tf.summary.scalar("freezing/frozen_modules", self.engine.num_frozen)

    @timed
    def on_train_end(self, logs=None):
        self._wall_seconds += time.perf_counter() - self._wall_start
        self._teardown()
        if self.engine is None:
            return
        self._final = self._frozen_state()
        self._frozen_between_fits = [i for i, f in enumerate(self.engine.frozen) if f]
        self.engine.restore()
        if self._writer is not None:
            self._writer.flush()

    # ----------------------------------------------------------------- report

    def _frozen_state(self) -> dict:
        """Frozen modules and their FLOPs share: at the end of fit, or now."""
        if self._final is not None:
            return self._final
        return {
            "frozen_modules": self.engine.num_frozen,
            "frozen_flops_fraction": self.engine.frozen_flops_fraction(),
        }

    @property
    def frozen_prefix(self) -> int:
        """Consecutive frozen modules from the front: now during fit, or at the end of the last fit."""
        if self.engine is None:
            return 0
        if self._final is None:
            return self.engine.frozen_prefix
        k = 0
        while k in self._frozen_between_fits:
            k += 1
        return k

    @property
    def num_frozen(self) -> int:
        """Modules frozen now (during fit) or at the end of the last fit."""
        return self._frozen_state()["frozen_modules"] if self.engine is not None else 0

    def summary(self) -> dict:
        """What the callback did, as a JSON-serialisable dict.

        Keys: `modules` (layers, parameters, share of forward FLOPs);
        `frozen_modules` at the end; `events`; `backward_flops_skipped_fraction`
        (averaged over all training steps) and
        `final_backward_flops_skipped_fraction`; `overhead_fraction` (share of
        fit's wall time the training thread spent in this callback) and the
        seconds behind it; `train_function_rebuilds`.
        """
        wall = self._wall_seconds or (time.perf_counter() - self._wall_start if self._wall_start else 0.0)
        if self.modules is None or self.engine is None:
            # Before fit, or a fit that never got as far as the partition.
            return {
                "strategy": type(self).__name__,
                "status": "disabled" if self.disabled_reason else "not started",
                "disabled_reason": self.disabled_reason,
                "modules": [] if self.modules is None else [m.layer_names for m in self.modules],
                "num_modules": 0 if self.modules is None else len(self.modules),
                "frozen_modules": 0,
                "events": list(self.events),
                "steps": self._step,
                "overhead_seconds": self._overhead_seconds,
                "wall_seconds": wall,
                "overhead_fraction": (self._overhead_seconds / wall) if wall else 0.0,
            }
        total_flops = sum(m.flops or 0.0 for m in self.modules)
        final = self._frozen_state()
        return {
            "strategy": type(self).__name__,
            "status": "disabled" if self.disabled_reason else "active",
            "disabled_reason": self.disabled_reason,
            "modules": [
                {
                    "index": m.index,
                    "name": m.name,
                    "layers": m.layer_names,
                    "params": m.params,
                    "flops_share": (m.flops / total_flops) if total_flops and m.flops is not None else None,
                }
                for m in self.modules
            ],
            "num_modules": len(self.modules),
            "frozen_modules": final["frozen_modules"],
            "events": self.events,
            "steps": self._step,
            "backward_flops_skipped_fraction": (self._frozen_flops_steps / self._step) if self._step else 0.0,
            "final_backward_flops_skipped_fraction": final["frozen_flops_fraction"],
            "overhead_seconds": self._overhead_seconds,
            "wall_seconds": wall,
            "overhead_fraction": (self._overhead_seconds / wall) if wall else 0.0,
            "train_function_rebuilds": self.engine.rebuilds,
            "freezes_deferred": self.freezes_deferred,
        }


def _first_line(err: BaseException, limit: int = 300) -> str:
    lines = str(err).strip().splitlines()
    return lines[0][:limit] if lines else ""
