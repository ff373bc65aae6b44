"""Latency-aware KerasTuner tuners: every candidate is timed on the step it will train.

`LatencyAwareRandomSearch`, `LatencyAwareBayesianOptimization` and
`LatencyAwareHyperband` are used as KerasTuner's `RandomSearch`,
`BayesianOptimization` and `Hyperband` are, with a step-time budget and a
hardware profile; each builds its latency-aware oracle. `LatencyAwareTuner`
is their base, for a custom `run_trial` or an oracle of your own.

Timed = trained: the check runs inside the trial's first `model.fit` call,
after the model is built and compiled and with the arguments it trains with,
so the batch size (from `search(...)`, a batched `tf.data.Dataset`, or a
`HyperModel.fit` that picks it) and `steps_per_execution` are those of
training. A candidate over a budget raises there, before its first step: it
never trains.
"""

from __future__ import annotations

import os
import time
import warnings

import keras_tuner
import tensorflow as tf

from tf_hwopt import _internals
from tf_hwopt._io import write_json_atomic
from tf_hwopt.hardware.profiles import HardwareProfile, as_profile
from tf_hwopt.search.inputs import batch_size_of, check_timeable, timing_batch
from tf_hwopt.search.oracle import (
    LatencyAwareBayesianOptimizationOracle,
    LatencyAwareHyperbandOracle,
    LatencyAwareOracle,
    LatencyAwareRandomSearchOracle,
    over_budget_message,
)
from tf_hwopt.search.pareto import pareto_front, plot_pareto
from tf_hwopt.search.timing import MODES, StepTiming, estimate_step, model_memory_bytes, time_step

TIMINGS = ("measured", "estimated")
# Arguments of a latency-aware tuner that go to the oracle it builds.
_ORACLE_ARGUMENTS = (
    "constraint", "latency_weight", "latency_increasing", "latency_decreasing", "latency_independent",
    "max_params", "memory_budget_gib", "max_proposals", "seed", "hyperparameters", "tune_new_entries",
    "allow_new_entries", "max_retries_per_trial", "max_consecutive_failed_trials",
)


def _metrics(entry: dict) -> dict:
    """A record as the trial metrics reported for it (only what is known)."""
    metrics = {name: float(entry[name]) for name in ("latency_ms", "params", "memory_gib") if name in entry}
    if "latency_ms" in entry:
        metrics["latency_estimated"] = 1.0 if entry.get("kind") == "estimated" else 0.0
    return metrics


def _oracle_arguments(kwargs: dict, extra: tuple = ()) -> dict:
    return {name: kwargs.pop(name) for name in _ORACLE_ARGUMENTS + extra if name in kwargs}


class _TimedHyperModel(keras_tuner.HyperModel):
    """The user's hypermodel; the first `model.fit` of its `fit` calls `before_fit` first."""

    def __init__(self, hypermodel, before_fit):
        super().__init__(name=hypermodel.name, tunable=hypermodel.tunable)
        self.hypermodel = hypermodel
        self._before_fit = before_fit

    def build(self, hp):
        return self.hypermodel.build(hp)

    def fit(self, hp, model, *args, **kwargs):
        fit, checked = model.fit, []

        def fit_after_check(*fit_args, **fit_kwargs):
            if not checked:
                checked.append(True)
                self._before_fit(hp, model, fit_args, fit_kwargs)
            return fit(*fit_args, **fit_kwargs)

        model.fit = fit_after_check
        try:
            return self.hypermodel.fit(hp, model, *args, **kwargs)
        finally:
            del model.fit


class OverBudgetError(keras_tuner.errors.FailedTrialError):
    """A candidate over a budget: its trial ends FAILED with the reason, and it never trains."""


class LatencyAwareTuner(_internals.QuietTrialOutcomes, keras_tuner.Tuner):
    """Times every candidate (XLA-compiled step) before training it.

    The trial metrics `latency_ms` (with `latency_estimated` = 1.0 for a
    roofline estimate), `params` and `memory_gib` are reported before
    training. A candidate over a budget under `constraint="hard"` is never
    trained: its trial ends as failed, the message says which budget, and the
    oracle learns from it. Known candidates (a Hyperband promotion, a resumed
    search) are not timed again.

    Args:
        hypermodel: a `keras_tuner.HyperModel` or `build(hp)` function
            returning a compiled model.
        oracle: a latency-aware oracle (`LatencyAwareRandomSearchOracle`...).
        profile: the target hardware profile (name or `HardwareProfile`); its
            memory is the memory budget unless the oracle has one.
        timing: `"measured"` (on this machine's device), `"estimated"`
            (roofline floor of `profile`), or a function `(model, batch) ->
            milliseconds or StepTiming` (a latency table measured on the
            target, a predictor).
        timing_mode: `"train"` or `"serve"` step.
        timing_steps, timing_blocks: timed steps per candidate, and the blocks
            they are split into (default `min(8, timing_steps)`); the budget
            is compared with the median of the block medians.
        timing_jit_compile: compile the timed step with XLA. `"auto"`: yes,
            except under a `MirroredStrategy` over CPU devices, where XLA
            cannot reach the other replicas' variables (TensorFlow's
            "variable on a different device" limitation).
        **kwargs: passed to `keras_tuner.Tuner` (`directory`, `project_name`,
            `overwrite`, `distribution_strategy`...).

    Example:
    >>> oracle = LatencyAwareRandomSearchOracle("val_accuracy", max_trials=10, latency_budget_ms=5.0)
    >>> tuner = LatencyAwareTuner(build, oracle=oracle, profile="cpu", directory="runs")
    >>> tuner.search(train_ds, validation_data=val_ds, epochs=3)
    """

    outcome_error = OverBudgetError  # ends its trial FAILED quietly (see _internals.QuietTrialOutcomes)

    def __init__(
        self,
        hypermodel=None,
        oracle: LatencyAwareOracle | None = None,
        *,
        profile: HardwareProfile | str = "cpu",
        timing="measured",
        timing_mode: str = "train",
        timing_steps: int = 40,
        timing_blocks: int | None = None,
        timing_jit_compile: bool | str = "auto",
        **kwargs,
    ):
        if not isinstance(oracle, LatencyAwareOracle):
            raise ValueError(
                "`oracle` must be a latency-aware oracle (tf_hwopt.search.LatencyAwareRandomSearchOracle, "
                f"LatencyAwareBayesianOptimizationOracle, LatencyAwareHyperbandOracle). Received: "
                f"{type(oracle).__name__}"
            )
        if timing not in TIMINGS and not callable(timing):
            raise ValueError(f"`timing` must be one of {TIMINGS} or a function. Received: timing={timing!r}")
        if timing_mode not in MODES:
            raise ValueError(f"`timing_mode` must be one of {MODES}. Received: timing_mode={timing_mode!r}")
        if not isinstance(timing_steps, int) or timing_steps < 3:
            raise ValueError(f"`timing_steps` must be an integer >= 3. Received: {timing_steps!r}")
        if timing_blocks is not None and (not isinstance(timing_blocks, int) or not 1 <= timing_blocks <= timing_steps):
            raise ValueError(f"`timing_blocks` must be an integer in [1, timing_steps]. Received: {timing_blocks!r}")
        if timing_jit_compile not in (True, False, "auto"):
            raise ValueError(
                f"`timing_jit_compile` must be True, False or 'auto'. Received: {timing_jit_compile!r}"
            )
        self.profile = as_profile(profile)
        self.timing = timing
        self.timing_mode = timing_mode
        self.timing_steps = timing_steps
        self.timing_blocks = timing_blocks
        self.timing_jit_compile = timing_jit_compile
        self.timed_candidates = 0
        self.timing_seconds = 0.0  # wall time spent timing candidates (compilation included)
        if oracle.memory_budget_gib is None:
            oracle.memory_budget_gib = float(self.profile.memory_gib)
        # In KerasTuner's distributed mode a worker's `self.oracle` becomes a
        # gRPC client of the chief's; this local copy keeps the budgets.
        self.latency_oracle = oracle
        self._trial = None  # the trial whose model is being fitted
        self._reports: dict[str, dict] = {}
        self._warned: set[str] = set()
        # Not `super().__init__`: in LatencyAwareHyperband the next class is
        # keras_tuner.Hyperband, whose __init__ only builds its own oracle.
        keras_tuner.Tuner.__init__(self, oracle=oracle, hypermodel=hypermodel, **kwargs)
        if self.hypermodel is not None:
            self.hypermodel = _TimedHyperModel(self.hypermodel, self._before_fit)

    # ------------------------------------------------------------ measuring

    def _jit_compile(self) -> bool:
        if self.timing_jit_compile != "auto":
            return self.timing_jit_compile
        strategy = self.distribution_strategy
        if isinstance(strategy, tf.distribute.MirroredStrategy):
            return not all("CPU" in d.upper() for d in strategy.extended.worker_devices)
        return True

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(f"{type(self).__name__}: {message}", UserWarning, stacklevel=3)

    def _measure(self, model, batch) -> StepTiming:
        started = time.perf_counter()
        if callable(self.timing):
            result = self.timing(model, batch)
            if not isinstance(result, StepTiming):
                ms = float(result)
                result = StepTiming(ms, "provided", self.timing_mode, ms, ms, 0.0, 0, device="timing function")
        elif self.timing == "estimated":
            result = estimate_step(model, batch, self.profile, mode=self.timing_mode)
        else:
            run = dict(mode=self.timing_mode, steps=self.timing_steps, blocks=self.timing_blocks)
            try:
                result = time_step(model, batch, jit_compile=self._jit_compile(), **run)
            except (tf.errors.OpError, ValueError, NotImplementedError) as err:
                if not self._jit_compile():
                    raise
                self._warn_once("xla", f"a candidate's step did not compile with XLA ({type(err).__name__}); "
                                       "such candidates are timed without XLA.")
                result = time_step(model, batch, jit_compile=False, **run)
        self.timed_candidates += 1
        self.timing_seconds += time.perf_counter() - started
        return result

    def _size(self, model, batch) -> dict:
        """Parameter count and a lower bound on device memory per step (no step run)."""
        size = {"memory_gib": model_memory_bytes(model, batch_size_of(batch), self.timing_mode) / 2**30}
        if model.built:
            size["params"] = model.count_params()
        return size

    def _report(self, trial, **measured) -> dict:
        """Records what was measured here and with the (chief) oracle; returns the record.

        `measured`: `latency_ms` and `kind`, and/or `params` and `memory_gib`.
        """
        entry = self.latency_oracle.record_latency(trial.hyperparameters.values, **measured)
        metrics = _metrics(entry)
        self.oracle.update_trial(trial.trial_id, metrics)  # the chief's, in distributed mode
        self._reports[trial.trial_id] = metrics
        return entry

    def _before_fit(self, hp, model, fit_args, fit_kwargs) -> None:
        """Measures the candidate on the batch it trains with; raises when it is over a budget."""
        trial = self._trial
        if trial is None:  # a fit outside `search` (e.g. retraining the best model)
            return
        oracle = self.latency_oracle
        entry = oracle.known_latency(hp.values)
        if entry is not None and "latency_ms" in entry:
            self._report(trial)
        else:
            try:
                batch = timing_batch(fit_args, fit_kwargs)
            except ValueError as err:  # an input `search` could not see (HyperModel.fit made it): step aside
                self._warn_once("untimeable", f"{err} Such trials train untimed.")
                self._reports[trial.trial_id] = {}
                return
            entry = self._report(trial, **self._size(model, batch))
            if not oracle.violations(entry):  # over memory or parameters: no need to time it
                timing = self._measure(model, batch)
                entry = self._report(trial, latency_ms=timing.median_ms, kind=timing.kind)
        reasons = oracle.violations(entry)
        if reasons:
            raise OverBudgetError(over_budget_message(reasons))

    def time_candidate(self, hp, *fit_args, **fit_kwargs) -> StepTiming:
        """The step time of the candidate `hp` on the batch `fit(*fit_args, **fit_kwargs)` trains on.

        From the oracle's record when known (a record carries only the median
        and its label: the spread fields equal the median, `steps` is 0).
        """
        known = self.latency_oracle.known_latency(hp.values)
        if known is not None and "latency_ms" in known:
            ms = known["latency_ms"]
            return StepTiming(ms, known["kind"], self.timing_mode, ms, ms, 0.0, 0, device="oracle record")
        timing = self._measure(self.hypermodel.build(hp), timing_batch(fit_args, fit_kwargs))
        self.latency_oracle.record_latency(hp.values, timing.median_ms, timing.kind)
        return timing

    # ------------------------------------------------------------ KerasTuner

    def search(self, *fit_args, **fit_kwargs):
        """As KerasTuner's `search`; an input that cannot be timed is refused before any trial."""
        if fit_args or "x" in fit_kwargs:
            check_timeable(fit_args, fit_kwargs, component=f"{type(self).__name__}.search")
        return super().search(*fit_args, **fit_kwargs)

    def run_trial(self, trial, *args, **kwargs):
        self._trial = trial
        try:
            histories = super().run_trial(trial, *args, **kwargs)
        finally:
            self._trial = None
        report = self._reports.pop(trial.trial_id, None)
        if report is None and self.hypermodel is None:
            self._warn_once("no-fit", "run_trial trains without a hypermodel, so candidates cannot be timed.")
            report = {}
        elif report is None:
            self._warn_once("no-fit", "HyperModel.fit trained without calling model.fit, so candidates could "
                                      "not be timed before training; they are timed after it.")
            self.time_candidate(trial.hyperparameters, *args, **kwargs)
            report = _metrics(self.latency_oracle.known_latency(trial.hyperparameters.values))
            self.oracle.update_trial(trial.trial_id, report)
        metrics = _internals.metrics_dict(histories, self.oracle.objective)
        metrics.update(report)
        return metrics

    def on_search_end(self):
        super().on_search_end()
        if not _internals.kerastuner_is_worker():
            self.write_pareto(os.path.join(self.project_dir, "pareto.json"),
                              os.path.join(self.project_dir, "pareto.png"))

    # ----------------------------------------------------------------- report

    def trial_latencies(self) -> list[dict]:
        """Every trial with its latency, size, status, and objective when trained."""
        rows = []
        for trial in self.oracle.trials.values():
            entry = self.oracle.known_latency(trial.hyperparameters.values) or {}
            rows.append(
                {
                    "trial_id": trial.trial_id,
                    "status": trial.status,
                    "values": trial.hyperparameters.values,
                    "latency_ms": entry.get("latency_ms"),
                    "latency_kind": entry.get("kind"),
                    "params": entry.get("params"),
                    "memory_gib": entry.get("memory_gib"),
                    "over_budget": self.oracle.violations(entry) if entry else [],
                    "score": trial.score,
                    "trained": trial.status == "COMPLETED",
                }
            )
        return rows

    def results_summary(self, num_trials: int = 10):
        super().results_summary(num_trials)
        print(f"\nLatency of every trial (budget {self.oracle.latency_budget_ms:g} ms, {self.profile.name}):")
        for row in self.trial_latencies():
            lat = "n/a" if row["latency_ms"] is None else f"{row['latency_ms']:.3f} ms ({row['latency_kind']})"
            score = "not trained" if not row["trained"] else f"score {row['score']:.4f}"
            print(f"  trial {row['trial_id']}: {lat}, {row['status']}, {score}")

    def export_best(self, path: str, **kwargs) -> dict:
        """Exports the best in-budget model as a SavedModel, with its latency beside it.

        See `tf_hwopt.export_best`.
        """
        from tf_hwopt.export import export_best

        return export_best(self, path, **kwargs)

    def pareto_front(self) -> list[dict]:
        """Trained trials not dominated in (objective, latency), fastest first."""
        rows = [r for r in self.trial_latencies() if r["trained"] and r["latency_ms"] is not None
                and r["score"] is not None]
        return pareto_front(rows, maximize=self.oracle.objective.direction == "max")

    def write_pareto(self, json_path: str, png_path: str | None = None) -> list[dict]:
        """Writes the Pareto front (and all trials) as JSON, and as a plot.

        A search writes both into its project folder when it ends
        (`pareto.json`, `pareto.png`).
        """
        front, rows = self.pareto_front(), self.trial_latencies()
        write_json_atomic(
            {"budget_ms": self.oracle.latency_budget_ms, "profile": self.profile.name,
             "objective": self.oracle.objective.name, "pareto_front": front, "trials": rows},
            json_path,
            default=str,
        )
        if png_path:
            plot_pareto(rows, front, budget_ms=self.oracle.latency_budget_ms,
                        xlabel=f"step latency (ms, {self.profile.name})", ylabel=self.oracle.objective.name,
                        path=png_path)
        return front


class LatencyAwareRandomSearch(LatencyAwareTuner):
    """KerasTuner's `RandomSearch` under a step-time budget.

    Args:
        hypermodel, objective, max_trials: as for `keras_tuner.RandomSearch`.
        latency_budget_ms: the step-time budget in milliseconds (required).
        profile: the target hardware profile (name or `HardwareProfile`).
        **kwargs: the oracle's (`constraint`, `latency_increasing`,
            `latency_decreasing`, `latency_independent`, `max_params`,
            `memory_budget_gib`, `seed`, `hyperparameters`...), then
            `LatencyAwareTuner`'s (`timing`, `timing_steps`...) and
            `keras_tuner.Tuner`'s (`directory`, `project_name`...).

    Example:
    >>> tuner = LatencyAwareRandomSearch(build, "val_accuracy", max_trials=20, latency_budget_ms=5.0,
    ...                                  profile="tpu-v5e", latency_increasing=["units"])
    >>> tuner.search(train_ds, validation_data=val_ds, epochs=3)
    """

    def __init__(self, hypermodel=None, objective=None, max_trials: int = 10, latency_budget_ms: float | None = None,
                 profile: HardwareProfile | str = "cpu", **kwargs):
        oracle = LatencyAwareRandomSearchOracle(
            objective, max_trials=max_trials, latency_budget_ms=latency_budget_ms, **_oracle_arguments(kwargs)
        )
        super().__init__(hypermodel, oracle, profile=profile, **kwargs)


class LatencyAwareBayesianOptimization(LatencyAwareTuner):
    """KerasTuner's `BayesianOptimization` under a step-time budget.

    Arguments as `LatencyAwareRandomSearch`, plus the Bayesian oracle's
    `num_initial_points`, `alpha` and `beta`. A Gaussian-process proposal
    known to be over budget is replaced by a random in-budget one.

    Example:
    >>> tuner = LatencyAwareBayesianOptimization(build, "val_accuracy", max_trials=20, latency_budget_ms=5.0)
    """

    def __init__(self, hypermodel=None, objective=None, max_trials: int = 10, latency_budget_ms: float | None = None,
                 profile: HardwareProfile | str = "cpu", **kwargs):
        oracle = LatencyAwareBayesianOptimizationOracle(
            objective, max_trials=max_trials, latency_budget_ms=latency_budget_ms,
            **_oracle_arguments(kwargs, ("num_initial_points", "alpha", "beta")),
        )
        super().__init__(hypermodel, oracle, profile=profile, **kwargs)


class LatencyAwareHyperband(LatencyAwareTuner, keras_tuner.Hyperband):
    """KerasTuner's `Hyperband` under a step-time budget.

    Arguments as `LatencyAwareRandomSearch` with `max_epochs` instead of
    `max_trials`, plus Hyperband's `factor` and `hyperband_iterations`. A
    candidate over budget is never trained and its first-round slot goes to
    another candidate; promoted candidates are not timed again.

    Example:
    >>> tuner = LatencyAwareHyperband(build, "val_accuracy", max_epochs=9, latency_budget_ms=5.0)
    >>> tuner.search(train_ds, validation_data=val_ds)
    """

    def __init__(self, hypermodel=None, objective=None, max_epochs: int = 100, latency_budget_ms: float | None = None,
                 profile: HardwareProfile | str = "cpu", **kwargs):
        oracle = LatencyAwareHyperbandOracle(
            objective, max_epochs=max_epochs, latency_budget_ms=latency_budget_ms,
            **_oracle_arguments(kwargs, ("factor", "hyperband_iterations")),
        )
        super().__init__(hypermodel, oracle, profile=profile, **kwargs)


def is_search_worker() -> bool:
    """Whether this process is a worker of KerasTuner's distributed mode (not the chief oracle).

    Example:
    >>> if is_search_worker():
    ...     pass   # workers run trials; only the chief writes reports
    """
    return _internals.kerastuner_is_worker()
