"""`EgeriaCallback`: knowledge-guided layer freezing inside `model.fit`."""

from __future__ import annotations

import json
import math
import os
import warnings
from typing import Sequence

from tf_hwopt._quiet import import_tensorflow_quietly

import_tensorflow_quietly()

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from tf_hwopt._io import write_json_atomic  # noqa: E402
from tf_hwopt.egeria.freezing_callback import BATCH_NORM_DRIFT_LIMIT, FreezingCallback, fit_argument, timed  # noqa: E402
from tf_hwopt.egeria.plasticity import ActivationReader, draw_probe, sp_loss  # noqa: E402
from tf_hwopt.egeria.policy import EgeriaPolicy, check_positive_int  # noqa: E402
from tf_hwopt.egeria.reference import REFERENCE_MODES, TFMOT_PATH, Reference, ReferenceUnavailable  # noqa: E402

STATE_FILE = "egeria_state.json"
_STATE_VERSION = 1
_KEPT_SNAPSHOTS = 3


class EgeriaCallback(FreezingCallback):
    """Freezes converged front modules during `model.fit` (Egeria, EuroSys 2023).

    Every `eval_every` training steps the callback measures each module's
    *plasticity*: the SP loss between its output on a fixed probe batch in the
    training model and in an int8 reference model (built through TFMOT,
    refreshed every `reference_refresh` evaluations, off the training thread
    when a GPU or TPU trains). When the
    plasticity of the frontmost still-trainable module has stopped changing
    (least-squares slope over the last `window` values, relative to their
    mean, within `tolerance` for `patience` evaluations), that module is
    frozen: no backward pass, no weight update, no gradient all-reduce.

    Add it first in the callback list, so that later callbacks (`CSVLogger`,
    `TensorBoard`) see the `frozen_modules` entry it adds to the logs. At the
    end of `fit` the model is handed back with every layer trainable as
    before; `summary()` and `events` say what was frozen and when.

    Args:
        probe_data: data to draw the probe batch from: model inputs (NumPy
            arrays, or a list/dict of them) or a `tf.data.Dataset`. Default:
            the `x` passed to `fit`.
        probe_size: examples in the probe batch.
        modules: explicit partition, a list of lists of layer names front to
            back (required for subclassed models). Default: automatic.
        eval_every: steps between plasticity evaluations. Default: a quarter
            of an epoch (200 steps if the epoch length is unknown).
        window: plasticity values in the sliding window.
        tolerance: largest |relative slope| per evaluation counted as converged.
        patience: consecutive converged evaluations before a freeze.
        bootstrap_steps: no freezing before this step (the critical learning
            period). Default: 10% of the training steps, at least 1 epoch.
        max_frozen_fraction: at most this fraction of modules freezes.
        reopen_lr_factor: re-open frozen modules when the learning rate has
            dropped by this factor since the last freeze (None: never).
        reference_refresh: evaluations between reference-model refreshes.
        reference: how to build the reference model: `"auto"` (TFMOT where
            the model can be rebuilt for it, else a clone with int8 weights;
            the reason is in `summary()["reference_reason"]`), `"tfmot"` or
            `"int8-weights"` (forced; a failure stops Egeria, not `fit`).
        asynchronous: build and run the reference model on a background
            thread on the host CPU. `"auto"` (default): only when training
            runs on a GPU or TPU, whose host CPUs are otherwise idle; on a
            CPU-only host the training step already uses every core, and a
            background thread would slow it down more than it saves.
        batch_norm_drift_limit: no freeze while a module's BatchNormalization
            moving statistics are further than this from the probe batch's
            (see `FreezingCallback`); None: no check.
        log_dir: if set, TensorBoard scalars are written there.
        backup_dir: if set, Egeria's state is saved there at each epoch end
            and restored when `fit` resumes (pass the `backup_dir` of your
            `keras.callbacks.BackupAndRestore`).
        seed: seed of the probe batch choice.
        verbose: 1 prints each freeze, 0 is silent.

    Example:
    >>> egeria = tf_hwopt.EgeriaCallback()
    >>> model.fit(x, y, epochs=20, callbacks=[egeria])
    >>> egeria.summary()["frozen_modules"]
    3
    """

    def __init__(
        self,
        probe_data=None,
        *,
        probe_size: int = 256,
        modules: Sequence[Sequence[str]] | None = None,
        eval_every: int | None = None,
        window: int = 8,
        tolerance: float = 0.15,
        patience: int = 2,
        bootstrap_steps: int | None = None,
        max_frozen_fraction: float = 0.8,
        reopen_lr_factor: float | None = None,
        reference_refresh: int = 1,
        reference: str = "auto",
        asynchronous: bool | str = "auto",
        batch_norm_drift_limit: float | None = BATCH_NORM_DRIFT_LIMIT,
        log_dir: str | None = None,
        backup_dir: str | None = None,
        seed: int = 0,
        verbose: int = 1,
    ):
        super().__init__(
            modules=modules, batch_norm_drift_limit=batch_norm_drift_limit, log_dir=log_dir, verbose=verbose
        )
        check_positive_int("probe_size", probe_size)
        if probe_size < 2:
            raise ValueError(f"`probe_size` must be at least 2. Received: probe_size={probe_size}")
        check_positive_int("eval_every", eval_every, allow_none=True)
        check_positive_int("reference_refresh", reference_refresh)
        if reference not in REFERENCE_MODES:
            raise ValueError(f"`reference` must be one of {REFERENCE_MODES}. Received: reference={reference!r}")
        if asynchronous not in (True, False, "auto"):
            raise ValueError(
                f"`asynchronous` must be True, False or 'auto'. Received: asynchronous={asynchronous!r}"
            )
        # The policy validates window, tolerance, patience, bootstrap and cap
        # now, before any training: build a throwaway one.
        EgeriaPolicy(
            2,
            window=window,
            tolerance=tolerance,
            patience=patience,
            bootstrap_steps=0 if bootstrap_steps is None else bootstrap_steps,
            max_frozen_fraction=max_frozen_fraction,
            reopen_lr_factor=reopen_lr_factor,
        )
        self.probe_data = probe_data
        self.probe_size = probe_size
        self.eval_every = eval_every
        self.window = window
        self.tolerance = tolerance
        self.patience = patience
        self.bootstrap_steps = bootstrap_steps
        self.max_frozen_fraction = max_frozen_fraction
        self.reopen_lr_factor = reopen_lr_factor
        self.reference_refresh = reference_refresh
        self.reference_mode = reference
        self.asynchronous = asynchronous
        self.backup_dir = backup_dir
        self.seed = seed

        self.policy: EgeriaPolicy | None = None
        self.reference: Reference | None = None
        self.history: list[dict] = []
        self.skipped_evaluations = 0
        self._probe = None
        self._reader = None
        self._next_eval = None
        self._evaluations = 0
        self._resume_checked = False

    # ------------------------------------------------------------------ setup

    def _sample_input(self):
        if self._probe is None:
            try:
                input_ndim = len(self.model.inputs[0].shape)
            except (AttributeError, ValueError, IndexError, TypeError):
                input_ndim = None
            data = self.probe_data
            if data is None:
                data = fit_argument(self.model, "x", "`probe_data=` (training inputs or a tf.data.Dataset)")
            self._probe = draw_probe(data, self.probe_size, seed=self.seed, input_ndim=input_ndim)
        return self._probe

    def _setup(self, first_fit: bool) -> None:
        model = self.model
        self._sample_input()
        if first_fit:
            self.policy = self._make_policy()
        self._reader = ActivationReader(model, [m.output_layer for m in self.modules])
        if self.reference is None:
            try:
                self.reference = Reference(
                    model,
                    [m.output_layer for m in self.modules],
                    self._probe,
                    asynchronous=_has_accelerator() if self.asynchronous == "auto" else self.asynchronous,
                    mode=self.reference_mode,
                )
            except ReferenceUnavailable as err:
                self._disable(f"no reference model: {err}")
                return
            if self.reference_mode == "auto" and self.reference.path != TFMOT_PATH:
                warnings.warn(
                    f"EgeriaCallback: the reference model is a clone with int8 weights, not a TFMOT "
                    f"model ({self.reference.reason}).",
                    UserWarning,
                    stacklevel=2,
                )
        self._eval_every = self._resolve_eval_every(self.eval_every)
        self._next_eval = self._step + self._eval_every
        self._resume_checked = False

    def _make_policy(self) -> EgeriaPolicy:
        bootstrap = self._resolve_bootstrap(self.bootstrap_steps)
        return EgeriaPolicy(
            len(self.modules),
            window=self.window,
            tolerance=self.tolerance,
            patience=self.patience,
            bootstrap_steps=bootstrap,
            max_frozen_fraction=self.max_frozen_fraction,
            reopen_lr_factor=self.reopen_lr_factor,
        )

    # --------------------------------------------------------------- training

    @timed
    def on_epoch_begin(self, epoch, logs=None):
        super().on_epoch_begin(epoch, logs)
        if not self._resume_checked:
            self._resume_checked = True
            if epoch > 0 and self.backup_dir:
                self._restore(epoch)

    def _teardown(self) -> None:
        if self.reference is not None:
            self.reference.close()

    def _on_freeze_refused(self, index: int) -> None:
        self.policy.reject(index)

    def _after_step(self) -> None:
        if self._step >= self._next_eval and not self.policy.settled:
            self._evaluate()
            while self._next_eval <= self._step:
                self._next_eval += self._eval_every

    @timed
    def on_epoch_end(self, epoch, logs=None):
        super().on_epoch_end(epoch, logs)
        if self.backup_dir:
            self._save(epoch + 1)

    def _learning_rate(self) -> float | None:
        try:
            return float(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate))
        except (AttributeError, TypeError, ValueError):
            return None

    def _evaluate(self) -> None:
        activations = self._reader(self._probe)
        n = len(self.modules)
        k = self.policy.num_frozen
        plasticity = [math.nan] * n
        if self.reference.ready():
            reference = self.reference.activations()
            for i in range(k, n):
                plasticity[i] = sp_loss(activations[i], reference[i], gram_dtype=np.float32)
            decision = self.policy.observe(self._step, plasticity, self._learning_rate())
            self.history.append(
                {
                    "step": self._step,
                    "epoch": self._epoch,
                    "plasticity": [v if math.isfinite(v) else None for v in plasticity],
                    "frozen": k,
                }
            )
            self._apply(decision)
        self._evaluations += 1
        if (self._evaluations - 1) % self.reference_refresh == 0:
            self.reference.submit_refresh(self.model)
        if self._writer is not None:
            with self._writer.as_default(step=self._step):
                for i, value in enumerate(plasticity):
                    if math.isfinite(value):
                        tf.summary.scalar(f"egeria/plasticity/module_{i}", value)
                tf.summary.scalar("egeria/frozen_modules", self.engine.num_frozen)

    def _apply(self, decision) -> None:
        if decision.skipped:
            self.skipped_evaluations += 1
            warnings.warn(
                f"Egeria: non-finite plasticity at step {self._step}; this evaluation is "
                "skipped and cannot lead to a freeze.",
                RuntimeWarning,
                stacklevel=3,
            )
            return
        details = {
            "window": [float(v) for v in decision.window],
            "relative_slope": decision.relative_slope,
        }
        if decision.unfreeze:
            self._unfreeze(decision.unfreeze, decision.reason, **details)
        if decision.freeze:
            self._freeze(decision.freeze, decision.reason, **details)

    # ----------------------------------------------------------------- resume

    def _state_path(self) -> str:
        return os.path.join(self.backup_dir, STATE_FILE)

    def _snapshot(self) -> dict:
        return {
            "policy": self.policy.get_state(),
            "step": self._step,
            "evaluations": self._evaluations,
            "reference_refreshes": self.reference.refreshes,
            "events": self.events,
            "history": self.history,
            "skipped_evaluations": self.skipped_evaluations,
            "frozen_flops_steps": self._frozen_flops_steps,
        }

    def _read_state(self) -> dict | None:
        path = self._state_path()
        if not os.path.exists(path):
            return None
        try:
            with open(path) as f:
                state = json.load(f)
            if state.get("version") != _STATE_VERSION or not isinstance(state.get("snapshots"), dict):
                raise ValueError("unknown layout")
        except (OSError, ValueError) as err:
            raise ValueError(
                f"Egeria state file {path!r} is corrupted or not an Egeria state ({err}). "
                "It was left untouched; move it away to restart Egeria's decisions from scratch."
            ) from err
        return state

    def _save(self, next_epoch: int) -> None:
        os.makedirs(self.backup_dir, exist_ok=True)
        state = self._read_state() or {"version": _STATE_VERSION, "snapshots": {}}
        state["num_modules"] = len(self.modules)
        state["module_layers"] = [m.layer_names for m in self.modules]
        state["snapshots"][str(next_epoch)] = self._snapshot()
        keep = sorted(state["snapshots"], key=int)[-_KEPT_SNAPSHOTS:]
        state["snapshots"] = {k: state["snapshots"][k] for k in keep}
        # Atomic: a kill during the write leaves the previous file intact.
        write_json_atomic(state, self._state_path(), indent=None)

    def _restore(self, epoch: int) -> None:
        state = self._read_state()
        if state is None:
            warnings.warn(
                f"Egeria: fit resumes at epoch {epoch + 1} but {self._state_path()!r} has no "
                "Egeria state; freezing decisions start from scratch.",
                RuntimeWarning,
                stacklevel=3,
            )
            return
        if state.get("module_layers") != [m.layer_names for m in self.modules]:
            raise ValueError(
                f"Egeria state file {self._state_path()!r} was saved for other modules "
                f"({state.get('module_layers')}); this model's modules are "
                f"{[m.layer_names for m in self.modules]}."
            )
        usable = [int(k) for k in state["snapshots"] if int(k) <= epoch]
        if not usable:
            return
        snap = state["snapshots"][str(max(usable))]
        self.policy.set_state(snap["policy"])
        self._step = int(snap["step"])
        self._evaluations = int(snap["evaluations"])
        self.reference.refreshes = int(snap["reference_refreshes"])
        self.events = list(snap["events"])
        self.history = list(snap["history"])
        self.skipped_evaluations = int(snap["skipped_evaluations"])
        self._frozen_flops_steps = float(snap["frozen_flops_steps"])
        self._next_eval = self._step + self._eval_every
        self.engine.freeze_prefix(self.policy.num_frozen)
        # The weights were restored by BackupAndRestore: refresh the reference
        # from them so the next evaluation compares against this state.
        self.reference.submit_refresh(self.model)
        if self.verbose:
            print(
                f"Egeria: resumed at epoch {epoch + 1} with {self.policy.num_frozen} frozen module(s).",
                flush=True,
            )

    # ----------------------------------------------------------------- report

    def summary(self) -> dict:
        """What Egeria did, as a JSON-serialisable dict.

        `FreezingCallback.summary()` (modules, events, FLOPs skipped,
        overhead) plus `reference_path` and `reference_reason`,
        `reference_refreshes`, `reference_seconds` (wall time of building
        and refreshing the reference, also when it ran off the training
        thread: on a small host that thread competes with training and is
        not in `overhead_fraction`), `eval_every`, `evaluations` and
        `skipped_evaluations`.
        """
        report = super().summary()
        ref = self.reference
        report.update(
            {
                "reference_path": ref.path if ref else None,
                "reference_reason": ref.reason if ref else self.disabled_reason,
                "reference_refreshes": ref.refreshes if ref else 0,
                "reference_build_seconds": ref.build_seconds if ref else 0.0,
                "reference_seconds": ref.work_seconds if ref else 0.0,
                "eval_every": getattr(self, "_eval_every", self.eval_every),
                "evaluations": self._evaluations,
                "skipped_evaluations": self.skipped_evaluations,
            }
        )
        return report


def _has_accelerator() -> bool:
    return bool(tf.config.list_logical_devices("GPU") or tf.config.list_logical_devices("TPU"))
