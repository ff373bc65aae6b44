"""`LatencyAwareTuner`: a KerasTuner tuner that times each candidate before training it."""

from __future__ import annotations

import time

import keras_tuner
import numpy as np
import tensorflow as tf

from tf_hwopt import _internals
from tf_hwopt._io import write_json_atomic
from tf_hwopt.hardware.profiles import HardwareProfile, as_profile
from tf_hwopt.search.oracle import LatencyAwareOracle, over_budget_message
from tf_hwopt.search.timing import StepTiming, estimate_step, time_step

TIMINGS = ("measured", "estimated")


class LatencyAwareTuner(keras_tuner.Tuner):
    """Times every candidate (XLA-compiled step) before training it.

    The step time is recorded as the trial metric `latency_ms` (with
    `latency_estimated` = 1.0 when it is a roofline estimate, 0.0 when
    measured). Under a hard budget an over-budget candidate is never trained:
    its trial ends as failed with its latency in the message, and the oracle
    learns from it. Known candidates (e.g. after a resume) are not re-timed.

    Args:
        hypermodel: a `keras_tuner.HyperModel` or `build(hp)` function
            returning a compiled model.
        oracle: a `LatencyAwareOracle`.
        profile: the target hardware profile (name or `HardwareProfile`).
        timing: `"measured"` (on this machine's device) or `"estimated"`
            (roofline floor of `profile`).
        timing_mode: `"train"` or `"serve"` step.
        timing_steps: timed steps per candidate.
        timing_jit_compile: compile the timed step with XLA. `"auto"`: yes,
            except under a `MirroredStrategy` over CPU devices, where XLA
            cannot reach the other replicas' variables (TensorFlow's
            "variable on a different device" limitation).
        **kwargs: passed to `keras_tuner.Tuner` (`directory`, `project_name`,
            `overwrite`, `distribution_strategy`...).

    Example:
    >>> tuner = LatencyAwareTuner(build, oracle=oracle, profile="cpu", directory="runs")
    >>> tuner.search(x, y, epochs=3, validation_data=(x_val, y_val))
    >>> tuner.write_pareto("pareto.json", "pareto.png")
    """

    def __init__(
        self,
        hypermodel=None,
        oracle: LatencyAwareOracle | None = None,
        *,
        profile: HardwareProfile | str = "cpu",
        timing: str = "measured",
        timing_mode: str = "train",
        timing_steps: int = 10,
        timing_jit_compile: bool | str = "auto",
        **kwargs,
    ):
        if not isinstance(oracle, LatencyAwareOracle):
            raise ValueError(
                f"`oracle` must be a tf_hwopt.search.LatencyAwareOracle. Received: {type(oracle).__name__}"
            )
        if timing not in TIMINGS:
            raise ValueError(f"`timing` must be one of {TIMINGS}. Received: timing={timing!r}")
        self.profile = as_profile(profile)
        self.timing = timing
        self.timing_mode = timing_mode
        self.timing_steps = timing_steps
        if timing_jit_compile not in (True, False, "auto"):
            raise ValueError(
                f"`timing_jit_compile` must be True, False or 'auto'. Received: {timing_jit_compile!r}"
            )
        self.timing_jit_compile = timing_jit_compile
        self.timed_candidates = 0
        self.timing_seconds = 0.0  # wall time spent timing candidates (compilation included)
        # In KerasTuner's distributed mode a worker's `self.oracle` becomes a
        # gRPC client of the chief's; this local copy keeps the budget.
        self.latency_oracle = oracle
        super().__init__(oracle=oracle, hypermodel=hypermodel, **kwargs)

    def _timing_batch(self, hp, args, kwargs):
        x = kwargs.get("x", args[0] if args else None)
        y = kwargs.get("y", args[1] if len(args) > 1 else None)
        if x is None or y is None:
            raise ValueError("LatencyAwareTuner.search needs NumPy `x` and `y` to time candidates.")
        size = int(hp.values.get("batch_size", kwargs.get("batch_size", 32)))
        x, y = np.asarray(x), np.asarray(y)
        reps = int(np.ceil(size / len(x)))
        if reps > 1:
            x, y = np.concatenate([x] * reps), np.concatenate([y] * reps)
        return x[:size], y[:size]

    def time_candidate(self, hp, *args, **kwargs) -> StepTiming:
        """The step time of the candidate `hp` (from the oracle's record when known).

        A record carries only the median and its label: the spread fields of
        the returned `StepTiming` then equal the median and `steps` is 0.
        """
        known = self.latency_oracle.known_latency(hp.values)
        if known is not None:
            ms = known["latency_ms"]
            return StepTiming(ms, known["kind"], self.timing_mode, ms, ms, 0.0, 0, device="oracle record")
        started = time.perf_counter()
        model = self._try_build(hp)
        batch = self._timing_batch(hp, args, kwargs)
        if self.timing == "measured":
            result = time_step(
                model, batch, mode=self.timing_mode, steps=self.timing_steps, profile=self.profile,
                jit_compile=self._jit_compile(),
            )
        else:
            result = estimate_step(model, batch, self.profile, mode=self.timing_mode)
        self.timed_candidates += 1
        self.timing_seconds += time.perf_counter() - started
        self.latency_oracle.record_latency(hp.values, result.median_ms, result.kind)
        return result

    def _jit_compile(self) -> bool:
        if self.timing_jit_compile != "auto":
            return self.timing_jit_compile
        strategy = self.distribution_strategy
        if isinstance(strategy, tf.distribute.MirroredStrategy):
            return not all("CPU" in d.upper() for d in strategy.extended.worker_devices)
        return True

    def _report_latency(self, trial, latency: float, kind: str) -> None:
        # Reported before training: the (chief) oracle learns it even when
        # the trial then fails or is never trained.
        self.oracle.update_trial(
            trial.trial_id, {"latency_ms": latency, "latency_estimated": 1.0 if kind == "estimated" else 0.0}
        )

    def _over_budget(self, latency: float) -> bool:
        oracle = self.latency_oracle
        return oracle.constraint == "hard" and latency > oracle.latency_budget_ms

    def _try_run_and_update_trial(self, trial, *args, **kwargs):
        # An over-budget candidate is an expected outcome, not an error: its
        # trial ends FAILED with the reason, without the traceback KerasTuner
        # prints for failing trials. Anything else goes through KerasTuner.
        try:
            timing = self.time_candidate(trial.hyperparameters, *args, **kwargs)
            latency, kind = timing.median_ms, timing.kind
        except Exception:  # noqa: BLE001 - raised again, and reported, by run_trial below
            latency = None
        if latency is not None and self._over_budget(latency):
            self._report_latency(trial, latency, kind)
            trial.status = keras_tuner.engine.trial.TrialStatus.FAILED
            trial.message = over_budget_message(latency, kind, self.latency_oracle.latency_budget_ms)
            return
        super()._try_run_and_update_trial(trial, *args, **kwargs)

    def run_trial(self, trial, *args, **kwargs):
        timing = self.time_candidate(trial.hyperparameters, *args, **kwargs)
        latency, kind = timing.median_ms, timing.kind
        oracle = self.latency_oracle
        self._report_latency(trial, latency, kind)
        if self._over_budget(latency):
            raise keras_tuner.errors.FailedTrialError(over_budget_message(latency, kind, oracle.latency_budget_ms))
        histories = super().run_trial(trial, *args, **kwargs)
        metrics = _internals.metrics_dict(histories, oracle.objective)
        metrics["latency_ms"] = latency
        metrics["latency_estimated"] = 1.0 if kind == "estimated" else 0.0
        return metrics

    # ----------------------------------------------------------------- report

    def trial_latencies(self) -> list[dict]:
        """Every trial with its latency, status, and objective when trained."""
        rows = []
        for trial in self.oracle.trials.values():
            entry = self.oracle.known_latency(trial.hyperparameters.values)
            rows.append(
                {
                    "trial_id": trial.trial_id,
                    "status": trial.status,
                    "values": trial.hyperparameters.values,
                    "latency_ms": entry["latency_ms"] if entry else None,
                    "latency_kind": entry["kind"] if entry else None,
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
        """Trained trials not dominated in (objective, latency)."""
        maximize = self.oracle.objective.direction == "max"
        rows = [r for r in self.trial_latencies() if r["trained"] and r["latency_ms"] is not None and r["score"] is not None]
        front = []
        for r in rows:
            better = lambda a, b: a >= b if maximize else a <= b  # noqa: E731
            dominated = any(
                o is not r
                and better(o["score"], r["score"])
                and o["latency_ms"] <= r["latency_ms"]
                and (o["score"] != r["score"] or o["latency_ms"] < r["latency_ms"])
                for o in rows
            )
            if not dominated:
                front.append(r)
        return sorted(front, key=lambda r: r["latency_ms"])

    def write_pareto(self, json_path: str, png_path: str | None = None) -> list[dict]:
        """Writes the Pareto front (and all trials) as JSON, and as a plot."""
        front = self.pareto_front()
        write_json_atomic(
            {"budget_ms": self.oracle.latency_budget_ms, "profile": self.profile.name,
             "pareto_front": front, "trials": self.trial_latencies()},
            json_path,
            default=str,
        )
        if png_path:
            from tf_hwopt._plotting import pyplot

            plt = pyplot()

            rows = self.trial_latencies()
            fig, ax = plt.subplots(figsize=(6, 4), dpi=110)
            trained = [r for r in rows if r["trained"] and r["score"] is not None]
            ax.scatter([r["latency_ms"] for r in trained], [r["score"] for r in trained], label="trained")
            ax.plot([r["latency_ms"] for r in front], [r["score"] for r in front], "r-o", label="Pareto front")
            skipped = [r for r in rows if not r["trained"] and r["latency_ms"] is not None]
            for r in skipped:
                ax.axvline(r["latency_ms"], color="grey", alpha=0.3)
            ax.axvline(self.oracle.latency_budget_ms, color="k", linestyle="--", label="budget")
            ax.set_xlabel(f"step latency (ms, {self.profile.name})")
            ax.set_ylabel(self.oracle.objective.name)
            ax.legend()
            fig.tight_layout()
            fig.savefig(png_path)
            plt.close(fig)
        return front


def is_search_worker() -> bool:
    """Whether this process is a worker of KerasTuner's distributed mode (not the chief oracle).

    Example:
    >>> if is_search_worker():
    ...     pass   # workers run trials; only the chief writes reports
    """
    return _internals.kerastuner_is_worker()
