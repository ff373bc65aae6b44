"""LatencyAwareOracle / LatencyAwareTuner: search under a step-time budget."""

import json

import keras
import keras_tuner
import numpy as np
import pytest

from tf_hwopt.search import LatencyAwareOracle, LatencyAwareTuner, estimate_step, mnasnet_reward


def build(hp):
    units = hp.Choice("units", [8, 16, 1024, 2048])
    layers = hp.Int("layers", 1, 2)
    model = keras.Sequential(
        [keras.Input((40, 1)), keras.layers.Flatten()]
        + [keras.layers.Dense(units, activation="relu") for _ in range(layers)]
        + [keras.layers.Dense(10)]
    )
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    return model


def _budget(x, y):
    lat = {}
    for units in (16, 1024):
        hp = keras_tuner.HyperParameters()
        hp.values.update({"units": units, "layers": 2 if units == 16 else 1})
        lat[units] = estimate_step(build(hp), (x[:32], y[:32]), "cpu").median_ms
    assert lat[1024] > 3 * lat[16]
    return float(np.sqrt(lat[16] * lat[1024]))


def test_predicted_over_budget_by_dominance():
    oracle = LatencyAwareOracle("val_accuracy", max_trials=5, latency_budget_ms=10.0)
    hp = keras_tuner.HyperParameters()
    hp.Choice("units", [8, 16, 1024]), hp.Int("layers", 1, 3), hp.Choice("act", ["relu", "tanh"]), hp.Float("lr", 1e-4, 1e-2)
    oracle.hyperparameters = hp
    oracle.record_latency({"units": 1024, "layers": 2, "act": "relu", "lr": 1e-3}, 30.0, "measured")
    oracle.record_latency({"units": 16, "layers": 3, "act": "relu", "lr": 1e-3}, 2.0, "measured")
    assert oracle.predicted_over_budget({"units": 1024, "layers": 3, "act": "relu", "lr": 5e-3})  # bigger, lr irrelevant
    assert not oracle.predicted_over_budget({"units": 1024, "layers": 1, "act": "relu", "lr": 1e-3})  # smaller depth
    assert not oracle.predicted_over_budget({"units": 1024, "layers": 3, "act": "tanh", "lr": 1e-3})  # other category
    assert not oracle.predicted_over_budget({"units": 16, "layers": 3, "act": "relu", "lr": 1e-3})
    soft = LatencyAwareOracle("val_accuracy", max_trials=5, latency_budget_ms=10.0, constraint="soft")
    soft.record_latency({"units": 1024}, 30.0, "measured")
    assert not soft.predicted_over_budget({"units": 2048})


def test_mnasnet_reward():
    assert mnasnet_reward(0.9, 10.0, 10.0) == 0.9
    assert mnasnet_reward(0.9, 20.0, 10.0) < 0.9 < mnasnet_reward(0.9, 5.0, 10.0)


@pytest.mark.parametrize(
    "kwargs,match",
    [(dict(latency_budget_ms=0), "latency_budget_ms"), (dict(latency_budget_ms=5, base="grid"), "base"),
     (dict(latency_budget_ms=5, constraint="maybe"), "constraint")],
)
def test_bad_oracle_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LatencyAwareOracle("val_accuracy", max_trials=3, **kwargs)


@pytest.mark.parametrize("base", ["random"])  # the Bayesian base's skipping: test_predicted_over_budget
def test_search_never_trains_over_budget_and_resumes_without_retiming(mnist1d_small, tmp_path, base, capsys):
    x, y, x_val, y_val = mnist1d_small
    x, y = x[:256], y[:256]
    budget = _budget(x, y)
    oracle = LatencyAwareOracle("val_accuracy", max_trials=8, latency_budget_ms=budget, base=base, seed=1)
    tuner = LatencyAwareTuner(build, oracle=oracle, profile="cpu", timing="estimated",
                              directory=str(tmp_path), project_name="p", overwrite=True)
    tuner.search(x, y, epochs=1, batch_size=32, validation_data=(x_val[:64], y_val[:64]), verbose=0)
    searched = capsys.readouterr()
    rows = tuner.trial_latencies()
    assert rows and all(r["latency_ms"] is not None for r in rows)
    over = [r for r in rows if r["latency_ms"] > budget]
    # An over-budget candidate is an outcome, not an error: no traceback printed.
    assert over and "Traceback" not in searched.out + searched.err
    assert all(oracle.trials[r["trial_id"]].message.startswith("tf_hwopt:over-budget") for r in over)
    within = [r for r in rows if r["latency_ms"] <= budget]
    assert within and all(r["trained"] for r in within)
    for r in over:  # never trained: no objective recorded
        assert r["status"] == "FAILED" and not r["trained"]
        assert not oracle.trials[r["trial_id"]].metrics.exists("val_accuracy")
    # Once an over-budget candidate is known, dominated ones are not proposed.
    assert len(over) + len(within) <= 8 and len(over) <= 4
    best = tuner.oracle.get_best_trials(1)[0]
    assert best.metrics.get_last_value("latency_ms") <= budget
    tuner.results_summary(1)
    printed = capsys.readouterr().out
    assert "Latency of every trial" in printed and printed.count("ms (estimated)") == len(rows)
    front = tuner.write_pareto(str(tmp_path / "pareto.json"), str(tmp_path / "pareto.png"))
    assert front and json.loads((tmp_path / "pareto.json").read_text())["budget_ms"] == budget
    assert (tmp_path / "pareto.png").read_bytes()[:4] == b"\x89PNG"

    # Resume: the oracle's latencies come back; known candidates are not re-timed.
    oracle2 = LatencyAwareOracle("val_accuracy", max_trials=8, latency_budget_ms=budget, base=base, seed=1)
    tuner2 = LatencyAwareTuner(build, oracle=oracle2, profile="cpu", timing="estimated",
                               directory=str(tmp_path), project_name="p", overwrite=False)
    assert oracle2.latencies == oracle.latencies
    known = oracle.trials[rows[0]["trial_id"]].hyperparameters
    assert tuner2.time_candidate(known, x, y, batch_size=32).median_ms == rows[0]["latency_ms"]
    assert tuner2.timed_candidates == 0
