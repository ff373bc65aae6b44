"""`LatencyAwareOracle`: a KerasTuner oracle with a step-time budget.

Latency is a constraint, not just a metric. The tuner times each candidate
before training it and reports the step time at once as the trial metric
`latency_ms` through KerasTuner's own `update_trial` (which travels over gRPC
to the chief oracle of KerasTuner's distributed mode, unlike a trial's
message); an over-budget candidate is then ended as a failed trial and never
trained. The oracle records every latency it is told and stops proposing
candidates it predicts to be
over budget: a candidate whose latency-relevant hyperparameters (integers and
numeric choices) are all at least those of a known over-budget candidate, with
the same categorical values, is skipped. The state is saved with the oracle,
so a tuner resumed with `overwrite=False` keeps it.

`constraint="soft"` instead scores every trial with MnasNet's reward
`objective * (latency / budget) ** latency_weight` (Tan et al., CVPR 2019;
`latency_weight=-0.07`), and trains every candidate.
"""

from __future__ import annotations

import math

import keras_tuner

OVER_BUDGET = "tf_hwopt:over-budget"
LATENCY_METRICS = ("latency_ms", "latency_estimated")


def over_budget_message(latency_ms: float, kind: str, budget_ms: float) -> str:
    """The failed-trial message that carries an over-budget latency."""
    return f"{OVER_BUDGET} latency_ms={latency_ms:.6g} kind={kind}: over the {budget_ms:g} ms budget; not trained"


def mnasnet_reward(objective: float, latency_ms: float, budget_ms: float, weight: float = -0.07) -> float:
    """MnasNet's soft-constraint reward `objective * (latency / budget) ** weight`.

    Example:
    >>> round(mnasnet_reward(0.9, 20.0, 10.0), 4)
    0.8575
    """
    return objective * (latency_ms / budget_ms) ** weight


class LatencyAwareOracle(keras_tuner.oracles.BayesianOptimizationOracle):
    """A KerasTuner oracle that searches under a step-time budget.

    Args:
        objective: as for any KerasTuner oracle (e.g. `"val_accuracy"`).
        max_trials: total trials, over-budget ones included.
        latency_budget_ms: the step-time budget in milliseconds.
        base: `"random"` or `"bayesian"` proposal strategy.
        constraint: `"hard"` (over-budget candidates are never trained) or
            `"soft"` (MnasNet reward).
        latency_weight: the reward exponent for `"soft"`.
        max_proposals: proposals tried per trial before the oracle concludes
            that no in-budget candidate is left.
        **kwargs: passed to `BayesianOptimizationOracle` (`seed`,
            `hyperparameters`, `num_initial_points`...).

    Example:
    >>> oracle = LatencyAwareOracle("val_accuracy", max_trials=20, latency_budget_ms=5.0)
    >>> tuner = LatencyAwareTuner(build, oracle=oracle, profile="cpu", directory="runs")
    """

    def __init__(
        self,
        objective=None,
        max_trials: int = 10,
        latency_budget_ms: float | None = None,
        *,
        base: str = "random",
        constraint: str = "hard",
        latency_weight: float = -0.07,
        max_proposals: int = 200,
        **kwargs,
    ):
        if not isinstance(latency_budget_ms, (int, float)) or not latency_budget_ms > 0 or math.isinf(latency_budget_ms):
            raise ValueError(
                f"`latency_budget_ms` must be a finite number > 0. Received: latency_budget_ms={latency_budget_ms!r}"
            )
        if base not in ("random", "bayesian"):
            raise ValueError(f"`base` must be 'random' or 'bayesian'. Received: base={base!r}")
        if constraint not in ("hard", "soft"):
            raise ValueError(f"`constraint` must be 'hard' or 'soft'. Received: constraint={constraint!r}")
        # Over-budget trials end as FAILED; they are expected, not a crash.
        kwargs.setdefault("max_consecutive_failed_trials", max_trials + 1)
        super().__init__(objective=objective, max_trials=max_trials, **kwargs)
        self.latency_budget_ms = float(latency_budget_ms)
        self.base = base
        self.constraint = constraint
        self.latency_weight = float(latency_weight)
        self.max_proposals = max_proposals
        # values hash -> {"values", "latency_ms", "kind"}
        self.latencies: dict[str, dict] = {}
        self.skipped_proposals = 0

    # ----------------------------------------------------------- latency model

    def known_latency(self, values: dict) -> dict | None:
        """The recorded latency of exactly these values, if any."""
        return self.latencies.get(self._compute_values_hash(values))

    def record_latency(self, values: dict, latency_ms: float, kind: str) -> None:
        self.latencies[self._compute_values_hash(values)] = {
            "values": dict(values),
            "latency_ms": float(latency_ms),
            "kind": kind,
        }

    def _relevant(self):
        numeric, categorical = [], []
        for hp in self.hyperparameters.space:
            kind = type(hp).__name__
            if kind == "Int" or (kind == "Choice" and all(isinstance(v, (int, float)) for v in hp.values)):
                numeric.append(hp.name)
            elif kind in ("Choice", "Boolean", "Fixed"):
                categorical.append(hp.name)
        return numeric, categorical

    def predicted_over_budget(self, values: dict) -> bool:
        """Whether a known over-budget candidate is dominated by `values`."""
        if self.constraint != "hard":
            return False
        known = self.known_latency(values)
        if known is not None:
            return known["latency_ms"] > self.latency_budget_ms
        numeric, categorical = self._relevant()
        for entry in self.latencies.values():
            if entry["latency_ms"] <= self.latency_budget_ms:
                continue
            other = entry["values"]
            if any(values.get(n) != other.get(n) for n in categorical):
                continue
            if all(n in values and n in other and values[n] >= other[n] for n in numeric):
                return True
        return False

    # ------------------------------------------------------------ KerasTuner

    def populate_space(self, trial_id):
        use_bayesian = self.base == "bayesian"
        for _ in range(self.max_proposals):
            if use_bayesian:
                proposal = super().populate_space(trial_id)
                if proposal["status"] != keras_tuner.engine.trial.TrialStatus.RUNNING:
                    return proposal
                values = proposal["values"]
            else:
                values = self._random_values()
                if values is None:
                    return {"status": keras_tuner.engine.trial.TrialStatus.STOPPED, "values": None}
            if not self.predicted_over_budget(values):
                return {"status": keras_tuner.engine.trial.TrialStatus.RUNNING, "values": values}
            self.skipped_proposals += 1
            self._tried_so_far.add(self._compute_values_hash(values))
            use_bayesian = False  # the model's optimum is over budget: explore instead
        return {"status": keras_tuner.engine.trial.TrialStatus.STOPPED, "values": None}

    @keras_tuner.synchronized
    def update_trial(self, trial_id, metrics, step=0):
        """As KerasTuner's, and also takes a latency-only report.

        The tuner reports `{"latency_ms": ..., "latency_estimated": 0.0|1.0}`
        before training (the objective does not exist yet); the latency is
        recorded at once, so every worker's next proposal already avoids it.
        """
        latency_only = bool(metrics) and set(metrics) <= set(LATENCY_METRICS)
        if "latency_ms" in metrics:
            trial = self.trials[trial_id]
            kind = "estimated" if metrics.get("latency_estimated") else "measured"
            self.record_latency(trial.hyperparameters.values, float(metrics["latency_ms"]), kind)
        if not latency_only:
            return super().update_trial(trial_id, metrics, step=step)
        trial = self.trials[trial_id]
        for name, value in metrics.items():
            if not trial.metrics.exists(name):
                trial.metrics.register(name, direction="min")
            trial.metrics.update(name, float(value), step=step)
        self._save_trial(trial)
        return trial

    def score_trial(self, trial):
        super().score_trial(trial)
        if self.constraint == "soft" and trial.metrics.exists("latency_ms") and trial.score is not None:
            factor = (trial.metrics.get_last_value("latency_ms") / self.latency_budget_ms) ** self.latency_weight
            maximize = self.objective.direction == "max"
            trial.score = trial.score * factor if maximize else trial.score / factor

    def get_state(self):
        state = super().get_state()
        state["tf_hwopt"] = {"latencies": self.latencies, "skipped_proposals": self.skipped_proposals}
        return state

    def set_state(self, state):
        super().set_state(state)
        extra = state.get("tf_hwopt", {})
        self.latencies = dict(extra.get("latencies", {}))
        self.skipped_proposals = int(extra.get("skipped_proposals", 0))
