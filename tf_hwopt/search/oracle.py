"""Latency-aware KerasTuner oracles: one per proposal strategy, sharing a latency mixin.

Latency is a constraint, not just a metric. The tuner measures each candidate
before training it (step time; parameter count and a lower bound on device
memory) and reports the numbers at once as trial metrics through KerasTuner's
own `update_trial`, which travels over gRPC to the chief oracle of
KerasTuner's distributed mode. The oracle records them; a candidate over a
budget ends as a failed trial and is never trained, and later proposals that
are known to be at least as costly are skipped without being timed (the
dominance rule of `tf_hwopt.search.dominance`, along directions declared or
confirmed by measurement only). The records are saved with the oracle, so a
search resumed with `overwrite=False` keeps them.

`constraint="soft"` instead scores every trial with MnasNet's reward
`objective * (latency / budget) ** latency_weight` (Tan et al., CVPR 2019;
`latency_weight=-0.07`), and trains every candidate.

- `LatencyAwareRandomSearchOracle`: KerasTuner's random search.
- `LatencyAwareBayesianOptimizationOracle`: Gaussian-process proposals; a
  proposal predicted over budget is replaced by a random in-budget one.
- `LatencyAwareHyperbandOracle`: Hyperband; a first-round slot taken by an
  over-budget candidate is given to another candidate, so no bracket spends
  its budget on one.
"""

from __future__ import annotations

import hashlib
import math

import keras_tuner

from tf_hwopt import _internals
from tf_hwopt.search.dominance import check_directions, confirmed_directions, dominated

OVER_BUDGET = "tf_hwopt:over-budget"
# Metrics the tuner reports before training (no objective exists yet).
CONSTRAINT_METRICS = ("latency_ms", "latency_estimated", "params", "memory_gib")
CONSTRAINTS = ("hard", "soft")
_RUNNING = keras_tuner.engine.trial.TrialStatus.RUNNING
_STOPPED = keras_tuner.engine.trial.TrialStatus.STOPPED
_FAILED = keras_tuner.engine.trial.TrialStatus.FAILED
_COMPLETED = keras_tuner.engine.trial.TrialStatus.COMPLETED


def over_budget_message(reasons: list[str]) -> str:
    """The failed-trial message of a candidate over a budget (the reasons joined)."""
    return f"{OVER_BUDGET} {'; '.join(reasons)}; not trained"


def mnasnet_reward(objective: float, latency_ms: float, budget_ms: float, weight: float = -0.07) -> float:
    """MnasNet's soft-constraint reward `objective * (latency / budget) ** weight`.

    Example:
    >>> round(mnasnet_reward(0.9, 20.0, 10.0), 4)
    0.8575
    """
    return objective * (latency_ms / budget_ms) ** weight


def candidate_values(values: dict) -> dict:
    """A candidate's own hyperparameters: without Hyperband's `tuner/...` bookkeeping."""
    return {k: v for k, v in values.items() if not str(k).startswith("tuner/")}


def _key(values: dict) -> str:
    own = candidate_values(values)
    return hashlib.sha256("".join(f"{k}={own[k]!s};" for k in sorted(own)).encode()).hexdigest()[:32]


def _check_budget(name: str, value, *, optional: bool) -> float | None:
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or math.isinf(value):
        expected = "None or a finite number > 0" if optional else "a finite number > 0"
        raise ValueError(f"`{name}` must be {expected}. Received: {name}={value!r}")
    return float(value)


class LatencyAwareOracle(_internals.FilteredRandomValues):
    """The latency mixin of the latency-aware oracles (use one of its subclasses).

    Args (besides those of the KerasTuner oracle it is mixed into):
        latency_budget_ms: the step-time budget in milliseconds (required).
        constraint: `"hard"` (a candidate over a budget is never trained) or
            `"soft"` (MnasNet reward; every candidate trains).
        latency_weight: the reward exponent for `"soft"`.
        latency_increasing, latency_decreasing, latency_independent:
            hyperparameter names whose effect on the step time is known
            (bigger is slower / faster / no effect); the dominance rule uses
            them, and directions confirmed by measurement.
        max_params: optional budget on the parameter count.
        memory_budget_gib: optional budget on device memory per step (the
            tuner sets it to its hardware profile's memory when `None`).
        max_proposals: random draws tried per proposal before the oracle
            concludes that no feasible candidate is left.

    Example:
    >>> oracle = LatencyAwareRandomSearchOracle(
    ...     "val_accuracy", max_trials=20, latency_budget_ms=5.0, latency_increasing=["units"])
    """

    def __init__(
        self,
        *args,
        latency_budget_ms: float | None = None,
        constraint: str = "hard",
        latency_weight: float = -0.07,
        latency_increasing=(),
        latency_decreasing=(),
        latency_independent=(),
        max_params: int | None = None,
        memory_budget_gib: float | None = None,
        max_proposals: int = 200,
        max_consecutive_failed_trials: int = 3,
        **kwargs,
    ):
        budget = _check_budget("latency_budget_ms", latency_budget_ms, optional=False)
        if constraint not in CONSTRAINTS:
            raise ValueError(f"`constraint` must be one of {CONSTRAINTS}. Received: constraint={constraint!r}")
        if not isinstance(max_proposals, int) or max_proposals < 1:
            raise ValueError(f"`max_proposals` must be an integer >= 1. Received: {max_proposals!r}")
        self.declared_directions = check_directions(
            latency_increasing=latency_increasing,
            latency_decreasing=latency_decreasing,
            latency_independent=latency_independent,
        )
        # Over-budget trials end FAILED: an outcome, not a crash. KerasTuner's
        # consecutive-failure limit is applied here to the other failures only.
        super().__init__(*args, max_consecutive_failed_trials=2**31 - 1, **kwargs)
        self.max_failures = max_consecutive_failed_trials
        self.latency_budget_ms = budget
        self.constraint = constraint
        self.latency_weight = float(latency_weight)
        self.max_params = _check_budget("max_params", max_params, optional=True)
        self.memory_budget_gib = _check_budget("memory_budget_gib", memory_budget_gib, optional=True)
        self.max_proposals = max_proposals
        # candidate key -> {"values", "latency_ms", "kind", "params", "memory_gib"}
        self.latencies: dict[str, dict] = {}
        self._directions: dict | None = None
        self.skipped_proposals = 0
        self.consecutive_failures = 0

    # ------------------------------------------------------------- records

    def known_latency(self, values: dict) -> dict | None:
        """The record of exactly these values (Hyperband's `tuner/` keys aside), if any."""
        return self.latencies.get(_key(values))

    def record_latency(
        self,
        values: dict,
        latency_ms: float | None = None,
        kind: str | None = None,
        *,
        params: int | None = None,
        memory_gib: float | None = None,
    ) -> dict:
        """Records what was measured of a candidate (merged with what was known)."""
        self._directions = None  # measured directions are re-derived at the next use
        entry = self.latencies.setdefault(_key(values), {"values": candidate_values(values)})
        for name, value in (("latency_ms", latency_ms), ("kind", kind), ("params", params), ("memory_gib", memory_gib)):
            if value is not None:
                entry[name] = value if name == "kind" else float(value)
        return entry

    def violations(self, entry: dict) -> list[str]:
        """The budgets a record breaks, as readable reasons.

        Parameters and memory are hard limits (a model that does not fit does
        not train); the step time is one only under `constraint="hard"`.
        """
        reasons = []
        latency = entry.get("latency_ms")
        if self.constraint == "hard" and latency is not None and latency > self.latency_budget_ms:
            reasons.append(
                f"latency_ms={latency:.6g} kind={entry.get('kind', 'measured')}: over the "
                f"{self.latency_budget_ms:g} ms budget"
            )
        if self.max_params is not None and entry.get("params", 0) > self.max_params:
            reasons.append(f"params={entry['params']:.0f}: over max_params={self.max_params:.0f}")
        if self.memory_budget_gib is not None and entry.get("memory_gib", 0) > self.memory_budget_gib:
            reasons.append(
                f"memory_gib={entry['memory_gib']:.3g}: over memory_budget_gib={self.memory_budget_gib:g}"
            )
        return reasons

    def directions(self) -> dict[str, str]:
        """Latency directions in use: confirmed by measurement, overridden by those declared."""
        if self._directions is None:
            measured = [(e["values"], e["latency_ms"]) for e in self.latencies.values() if "latency_ms" in e]
            self._directions = {**confirmed_directions(measured), **self.declared_directions}
        return self._directions

    def predicted_over_budget(self, values: dict) -> bool:
        """Whether these values are known to break a budget, by record or by dominance."""
        known = self.known_latency(values)
        if known is not None:
            return bool(self.violations(known))
        infeasible = [e["values"] for e in self.latencies.values() if self.violations(e)]
        return bool(infeasible) and dominated(candidate_values(values), infeasible, self.directions())

    def accept_values(self, values: dict) -> bool:
        """A proposal the oracle may make (called for every random draw)."""
        if self.predicted_over_budget(values):
            self.skipped_proposals += 1
            return False
        return True

    # ------------------------------------------------------------ KerasTuner

    def populate_space(self, trial_id):
        proposal = super().populate_space(trial_id)
        values = proposal.get("values")
        if proposal.get("status") != _RUNNING or not values or self.accept_values(values):
            return proposal
        # The strategy's own proposal (the Bayesian model's optimum) is known
        # to be over budget: explore at random instead.
        replacement = self._random_values()
        if replacement is None:
            return {"status": _STOPPED, "values": None}
        replacement.update({k: v for k, v in values.items() if str(k).startswith("tuner/")})
        return {"status": _RUNNING, "values": replacement}

    @keras_tuner.synchronized
    def update_trial(self, trial_id, metrics, step=0):
        """As KerasTuner's, and also takes a constraint-only report.

        Before training, the tuner reports `latency_ms`, `latency_estimated`
        (1.0 for a roofline estimate), `params` and `memory_gib`; they are
        recorded at once, so every worker's next proposal already avoids a
        candidate found over budget.
        """
        trial = self.trials[trial_id]
        reported = {name: metrics[name] for name in CONSTRAINT_METRICS if name in metrics}
        if reported:
            kind = None
            if "latency_ms" in reported:
                kind = "estimated" if reported.get("latency_estimated") else "measured"
            self.record_latency(
                trial.hyperparameters.values, reported.get("latency_ms"), kind,
                params=reported.get("params"), memory_gib=reported.get("memory_gib"),
            )
        if not metrics or set(metrics) - set(CONSTRAINT_METRICS):
            return super().update_trial(trial_id, metrics, step=step)
        for name, value in metrics.items():
            if not trial.metrics.exists(name):
                trial.metrics.register(name, direction="min")
            trial.metrics.update(name, float(value), step=step)
        self._save_trial(trial)
        return trial

    def ended_over_budget(self, trial) -> bool:
        """Whether `trial` failed because it broke a budget (from the records, which reach the chief oracle)."""
        known = self.known_latency(trial.hyperparameters.values)
        return trial.status == _FAILED and known is not None and bool(self.violations(known))

    @keras_tuner.synchronized
    def end_trial(self, trial):
        super().end_trial(trial)
        if trial.status == _FAILED and not self.ended_over_budget(trial):
            self.consecutive_failures += 1
            if self.consecutive_failures >= self.max_failures:
                raise RuntimeError(
                    f"Number of consecutive failures exceeded the limit of {self.max_failures} "
                    f"(over-budget candidates not counted).\n{trial.message or ''}"
                )
        elif trial.status == _COMPLETED:
            self.consecutive_failures = 0

    def score_trial(self, trial):
        super().score_trial(trial)
        if self.constraint == "soft" and trial.metrics.exists("latency_ms") and trial.score is not None:
            factor = (trial.metrics.get_last_value("latency_ms") / self.latency_budget_ms) ** self.latency_weight
            maximize = self.objective.direction == "max"
            trial.score = trial.score * factor if maximize else trial.score / factor

    def get_state(self):
        state = super().get_state()
        state["tf_hwopt"] = {
            "latencies": self.latencies,
            "skipped_proposals": self.skipped_proposals,
            "consecutive_failures": self.consecutive_failures,
        }
        return state

    def set_state(self, state):
        super().set_state(state)
        extra = state.get("tf_hwopt", {})
        self.latencies = dict(extra.get("latencies", {}))
        self._directions = None
        self.skipped_proposals = int(extra.get("skipped_proposals", 0))
        self.consecutive_failures = int(extra.get("consecutive_failures", 0))


class LatencyAwareRandomSearchOracle(LatencyAwareOracle, keras_tuner.oracles.RandomSearchOracle):
    """KerasTuner's `RandomSearchOracle` under a step-time budget (see `LatencyAwareOracle`).

    Example:
    >>> oracle = LatencyAwareRandomSearchOracle("val_accuracy", max_trials=20, latency_budget_ms=5.0)
    """


class LatencyAwareBayesianOptimizationOracle(LatencyAwareOracle, keras_tuner.oracles.BayesianOptimizationOracle):
    """KerasTuner's `BayesianOptimizationOracle` under a step-time budget (see `LatencyAwareOracle`).

    Example:
    >>> oracle = LatencyAwareBayesianOptimizationOracle("val_accuracy", max_trials=20, latency_budget_ms=5.0)
    """


class LatencyAwareHyperbandOracle(LatencyAwareOracle, keras_tuner.oracles.HyperbandOracle):
    """KerasTuner's `HyperbandOracle` under a step-time budget (see `LatencyAwareOracle`).

    Example:
    >>> oracle = LatencyAwareHyperbandOracle("val_accuracy", max_epochs=9, latency_budget_ms=5.0)
    """

    @keras_tuner.synchronized
    def end_trial(self, trial):
        if self.ended_over_budget(trial):
            # Its first-round slot goes to another candidate: no bracket is
            # left with a candidate fewer to promote.
            _internals.hyperband_release_slot(self, trial.trial_id)
        super().end_trial(trial)
