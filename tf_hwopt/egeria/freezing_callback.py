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

import inspect
import time
from typing import Sequence

from tf_hwopt._quiet import import_tensorflow_quietly

import_tensorflow_quietly()

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

from tf_hwopt.egeria.freezing import FreezingEngine  # noqa: E402
from tf_hwopt.egeria.modules import partition_modules  # noqa: E402


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
    raise ValueError(f"The callback could not find the training data of this fit. It needs {what}.")


class FreezingCallback(keras.callbacks.Callback):
    """Base class of the freezing callbacks (subclass it for a new policy).

    Subclasses implement `_after_step()` (called after every training step
    has been counted) and call `self._freeze(indices, reason, ...)`. They may
    override `_setup(first_fit)` and `_sample_input()`, and extend
    `summary()`.

    Args:
        modules: explicit partition, a list of lists of layer names front to
            back (required for subclassed models). Default: automatic.
        log_dir: if set, TensorBoard scalars are written there.
        verbose: 1 prints each freeze, 0 is silent.
    """

    def __init__(self, *, modules: Sequence[Sequence[str]] | None = None, log_dir: str | None = None, verbose: int = 1):
        super().__init__()
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

    # ----------------------------------------------------------- subclass API

    def _sample_input(self):
        """One batch of model inputs (for FLOP counting of subclassed models)."""
        return None

    def _setup(self, first_fit: bool) -> None:
        """Called at train begin, once modules and engine exist."""

    def _after_step(self) -> None:
        """Called after each counted training step (or execution of several)."""

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

    def _freeze(self, indices, reason: str, **details) -> None:
        changed = self.engine.freeze(indices)
        self._record("freeze", changed, reason, details)

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
                print(
                    f"\n{type(self).__name__}: {kind} module {i} ({self.modules[i].name}) at step "
                    f"{self._step} (epoch {self._epoch + 1}): {reason}",
                    flush=True,
                )

    # ------------------------------------------------------------ Keras hooks

    @timed
    def on_train_begin(self, logs=None):
        self._wall_start = time.perf_counter()
        self._final = None
        if getattr(self.model, "optimizer", None) is None:
            raise ValueError(f"{type(self).__name__} needs a compiled model (call `model.compile` first).")
        first_fit = self.modules is None
        if first_fit:
            self.modules = partition_modules(self.model, self.module_names, sample_input=self._sample_input())
        self.engine = FreezingEngine(self.model, self.modules)
        if self.log_dir:
            self._writer = tf.summary.create_file_writer(self.log_dir)
        self._setup(first_fit)
        # A callback reused for another fit (e.g. one fit per phase) carries on
        # with what it had frozen: no step of the next fit trains those modules.
        self.engine.freeze([i for i in self._frozen_between_fits if not self.engine.frozen[i]])

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
        share = self.engine.frozen_flops_fraction()
        if share is not None:
            self._frozen_flops_steps += share * done
        self._after_step()
        if logs is not None:
            logs["frozen_modules"] = self.engine.num_frozen

    @timed
    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs["frozen_modules"] = self.engine.num_frozen
        if self._writer is not None:
            with self._writer.as_default(step=self._step):
                tf.summary.scalar("freezing/frozen_modules", self.engine.num_frozen)

    @timed
    def on_train_end(self, logs=None):
        self._wall_seconds += time.perf_counter() - self._wall_start
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
        if self.modules is None:
            raise RuntimeError("summary() is available once fit has started.")
        total_flops = sum(m.flops or 0.0 for m in self.modules)
        wall = self._wall_seconds or (time.perf_counter() - self._wall_start if self._wall_start else 0.0)
        final = self._frozen_state()
        return {
            "strategy": type(self).__name__,
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
        }
