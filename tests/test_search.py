"""Latency-aware oracles and tuners: search under a step-time budget.

No verdict here depends on this host's speed: candidates get their latency
from an injected timing function (a latency table, as a user with
measurements from the target would pass) or from the roofline estimate.
"""

import json
import os

import keras
import keras_tuner
import numpy as np
import pytest
import tensorflow as tf

from tf_hwopt.search import (
    LatencyAwareBayesianOptimization,
    LatencyAwareBayesianOptimizationOracle,
    LatencyAwareHyperband,
    LatencyAwareHyperbandOracle,
    LatencyAwareRandomSearch,
    LatencyAwareRandomSearchOracle,
    LatencyAwareTuner,
    estimate_step,
    mnasnet_reward,
)

N, FEATURES = 96, 8


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((N, FEATURES)).astype("float32")
    y = (x[:, 0] > 0).astype("int32")
    return x, y


def _mlp(units: int, stride: int = 1, name: str | None = None) -> keras.Model:
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((FEATURES,)), keras.layers.Dense(units, activation="relu"), keras.layers.Dense(2)],
        name=name or f"u{units}_s{stride}",
    )
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    return model


def build_units_stride(hp):
    return _mlp(hp.Choice("units", [8, 16, 32, 64]), hp.Choice("stride", [1, 2, 4]))


class LatencyTable:
    """An injected timing function: latency = units / stride, from the model's name; remembers each call."""

    def __init__(self):
        self.calls = []

    def __call__(self, model, batch):
        units, stride = (int(part[1:]) for part in model.name.split("_")[:2])
        self.calls.append({"name": model.name, "batch_size": int(np.shape(batch[0])[0]),
                           "steps_per_execution": model.steps_per_execution})
        return units / stride


def _rows_by_values(tuner):
    return {tuple(sorted((k, v) for k, v in r["values"].items() if not k.startswith("tuner/"))): r
            for r in tuner.trial_latencies()}


# ------------------------------------------------------------------ oracles


def test_dominance_skips_only_along_known_directions():
    oracle = LatencyAwareRandomSearchOracle(
        "val_accuracy", max_trials=5, latency_budget_ms=10.0,
        latency_increasing=["units"], latency_decreasing=["stride"], latency_independent=["lr"],
    )
    oracle.record_latency({"units": 64, "stride": 2, "act": "relu", "lr": 1e-3, "depth": 2}, 30.0, "measured")
    base = {"units": 64, "stride": 2, "act": "relu", "lr": 1e-3, "depth": 2}
    assert oracle.predicted_over_budget({**base, "units": 128})                 # wider: slower
    assert oracle.predicted_over_budget({**base, "stride": 1, "lr": 5e-3})      # smaller stride, lr irrelevant
    assert not oracle.predicted_over_budget({**base, "stride": 4})              # bigger stride may be fast enough
    assert not oracle.predicted_over_budget({**base, "act": "tanh"})            # another category: time it
    assert not oracle.predicted_over_budget({**base, "depth": 3})               # direction unknown: time it
    assert not oracle.predicted_over_budget({**base, "units": 32})
    # Hyperband's bookkeeping keys do not make a candidate new.
    assert oracle.known_latency({**base, "tuner/epochs": 3, "tuner/trial_id": "7"})["latency_ms"] == 30.0
    soft = LatencyAwareRandomSearchOracle("val_accuracy", max_trials=5, latency_budget_ms=10.0, constraint="soft",
                                          latency_increasing=["units"])
    soft.record_latency({"units": 64}, 30.0, "measured")
    assert not soft.predicted_over_budget({"units": 128})


def test_measured_latencies_confirm_a_direction_before_it_is_used():
    oracle = LatencyAwareRandomSearchOracle("val_accuracy", max_trials=5, latency_budget_ms=10.0)
    oracle.record_latency({"depth": 3, "act": "relu"}, 12.0, "measured")
    assert not oracle.predicted_over_budget({"depth": 4, "act": "relu"})  # nothing confirmed yet
    oracle.record_latency({"depth": 1, "act": "relu"}, 4.0, "measured")
    oracle.record_latency({"depth": 2, "act": "relu"}, 8.0, "measured")
    assert oracle.directions() == {"depth": "increasing"}
    assert oracle.predicted_over_budget({"depth": 4, "act": "relu"})
    # A contrary pair withdraws the confirmation.
    oracle.record_latency({"depth": 5, "act": "relu"}, 3.0, "measured")
    assert "depth" not in oracle.directions()
    assert not oracle.predicted_over_budget({"depth": 4, "act": "relu"})


@pytest.mark.parametrize(
    "kwargs,match",
    [(dict(), "latency_budget_ms"), (dict(latency_budget_ms=0), "latency_budget_ms"),
     (dict(latency_budget_ms=float("inf")), "latency_budget_ms"),
     (dict(latency_budget_ms=5, constraint="maybe"), "constraint"),
     (dict(latency_budget_ms=5, latency_increasing="units"), "latency_increasing"),
     (dict(latency_budget_ms=5, latency_increasing=["s"], latency_decreasing=["s"]), "both"),
     (dict(latency_budget_ms=5, max_params=-1), "max_params")],
)
def test_bad_oracle_arguments_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LatencyAwareRandomSearchOracle("val_accuracy", max_trials=3, **kwargs)


def test_mnasnet_reward():
    assert mnasnet_reward(0.9, 10.0, 10.0) == 0.9
    assert mnasnet_reward(0.9, 20.0, 10.0) < 0.9 < mnasnet_reward(0.9, 5.0, 10.0)


# ----------------------------------------------------------- KerasTuner's rules


@pytest.mark.parametrize("oracle_class,kwargs", [
    (LatencyAwareRandomSearchOracle, dict(max_trials=10)),
    (LatencyAwareBayesianOptimizationOracle, dict(max_trials=10, num_initial_points=2)),
    (LatencyAwareHyperbandOracle, dict(max_epochs=3, factor=3)),
])
def test_each_oracle_keeps_kerastuner_behaviour(oracle_class, kwargs, data, tmp_path):
    """Save and reload, an exhausted space ends the search, a failed trial is skipped."""
    x, y = data

    class Tuner(LatencyAwareTuner):
        pass

    def build(hp):
        units = hp.Choice("units", [8, 16])
        if units == 16:
            raise keras_tuner.errors.FailedTrialError("units=16 is refused by this hypermodel")
        return _mlp(units)

    oracle = oracle_class("val_accuracy", latency_budget_ms=100.0, seed=0, **kwargs)
    tuner = Tuner(build, oracle=oracle, timing=LatencyTable(), directory=str(tmp_path), project_name="p")
    tuner.search(x, y, epochs=1, validation_data=(x, y), verbose=0)
    statuses = sorted({t.status for t in oracle.trials.values()})
    assert statuses == ["COMPLETED", "FAILED"]  # the refused candidate failed; the search went on and ended
    assert len({str(t.hyperparameters.get("units")) for t in oracle.trials.values()}) == 2
    # Reload: trials and latency records come back.
    again = oracle_class("val_accuracy", latency_budget_ms=100.0, seed=0, **kwargs)
    Tuner(build, oracle=again, timing=LatencyTable(), directory=str(tmp_path), project_name="p")
    assert again.latencies == oracle.latencies and set(again.trials) == set(oracle.trials)


def test_consecutive_failures_stop_the_search_but_over_budget_candidates_do_not(data, tmp_path):
    x, y = data

    class Failing(keras_tuner.HyperModel):
        def build(self, hp):
            return _mlp(hp.Int("units", 1, 1000))

        def fit(self, hp, model, *args, **kwargs):
            raise keras_tuner.errors.FailedTrialError("always fails")

    tuner = LatencyAwareRandomSearch(Failing(), "val_accuracy", max_trials=10, latency_budget_ms=1.0,
                                     timing=LatencyTable(), directory=str(tmp_path), project_name="fail")
    with pytest.raises(RuntimeError, match="consecutive failures"):
        tuner.search(x, y, epochs=1, validation_data=(x, y), verbose=0)
    # Eight over-budget candidates in a row are outcomes, not failures.
    over = LatencyAwareRandomSearch(build_units_stride, "val_accuracy", max_trials=8, latency_budget_ms=0.5,
                                    timing=LatencyTable(), directory=str(tmp_path), project_name="over", seed=0)
    over.search(x, y, epochs=1, validation_data=(x, y), verbose=0)
    assert {t.status for t in over.oracle.trials.values()} == {"FAILED"} and len(over.oracle.trials) >= 4


# ------------------------------------------------------------------- tuners


def test_stride_space_every_in_budget_candidate_is_proposed(data, tmp_path):
    """Bigger stride is faster: no known over-budget candidate may hide a feasible one.

    No direction is declared: those the oracle uses are confirmed by its own
    measurements (declared ones: test_dominance_skips_only_along_known_directions).
    """
    x, y = data
    budget = 16.0
    table = LatencyTable()
    tuner = LatencyAwareRandomSearch(build_units_stride, "val_accuracy", max_trials=12, latency_budget_ms=budget,
                                     timing=table, seed=1, directory=str(tmp_path), project_name="stride")
    tuner.search(x, y, epochs=1, batch_size=32, validation_data=(x, y), verbose=0)
    feasible = {(u, s) for u in (8, 16, 32, 64) for s in (1, 2, 4) if u / s <= budget}
    trained = {(r["values"]["units"], r["values"]["stride"]) for r in tuner.trial_latencies() if r["trained"]}
    assert trained == feasible
    assert {c["batch_size"] for c in table.calls} == {32}


def test_tf_data_search_end_to_end(data, tmp_path, capsys):
    x, y = data
    train = tf.data.Dataset.from_tensor_slices((x, y)).batch(24)
    val = tf.data.Dataset.from_tensor_slices((x, y)).batch(48)
    table = LatencyTable()
    tuner = LatencyAwareRandomSearch(build_units_stride, "val_accuracy", max_trials=6, latency_budget_ms=8.0,
                                     timing=table, seed=0, directory=str(tmp_path), project_name="ds")
    tuner.search(train, validation_data=val, epochs=1, verbose=0)
    printed = capsys.readouterr()
    assert "Traceback" not in printed.out + printed.err  # over budget is an outcome, not an error
    rows = tuner.trial_latencies()
    assert len(rows) == 6 and all(r["latency_ms"] is not None for r in rows)
    assert {c["batch_size"] for c in table.calls} == {24}  # timed on the dataset's own batch
    for r in rows:
        trial = tuner.oracle.trials[r["trial_id"]]
        if r["latency_ms"] > 8.0:  # over budget: never trained, and says why in one line
            assert r["status"] == "FAILED" and not trial.metrics.exists("val_accuracy")
            assert trial.message.startswith("tf_hwopt:over-budget latency_ms=") and "\n" not in trial.message
        else:
            assert r["trained"] and trial.metrics.get_last_value("latency_ms") == r["latency_ms"]
    best = tuner.oracle.get_best_trials(1)[0]
    assert best.metrics.get_last_value("latency_ms") <= 8.0
    # The Pareto front is written into the project folder when the search ends.
    report = json.loads((tmp_path / "ds" / "pareto.json").read_text())
    assert report["pareto_front"] and all(p["latency_ms"] <= 8.0 for p in report["pareto_front"])
    assert (tmp_path / "ds" / "pareto.png").read_bytes()[:4] == b"\x89PNG"
    # The best in-budget model leaves as a SavedModel, its latency beside it.
    exported = tuner.export_best(str(tmp_path / "best"))
    assert exported.metadata["latency_ms"] <= 8.0 and exported.metadata["trial_id"] == best.trial_id
    assert tf.saved_model.load(str(tmp_path / "best")) is not None


class _PicksBatchSize(keras_tuner.HyperModel):
    def build(self, hp):
        return _mlp(hp.Choice("units", [8, 64]), name=None)

    def fit(self, hp, model, *args, **kwargs):
        return model.fit(*args, batch_size=hp.Choice("batch_size", [16, 48]), **kwargs)


class _StepCounter(keras.callbacks.Callback):
    steps = []

    def on_train_begin(self, logs=None):
        self.steps.append(0)

    def on_train_batch_end(self, batch, logs=None):
        self.steps[-1] += 1


def test_timed_batch_is_the_trained_batch_when_the_hypermodel_picks_it(data, tmp_path):
    x, y = data
    seen = []

    def timing(model, batch):
        seen.append((int(np.shape(batch[0])[0]), model.steps_per_execution))
        return 1.0

    _StepCounter.steps = []
    tuner = LatencyAwareBayesianOptimization(_PicksBatchSize(), "val_accuracy", max_trials=4, latency_budget_ms=5.0,
                                             timing=timing, num_initial_points=4, seed=2,
                                             directory=str(tmp_path), project_name="bs")
    tuner.search(x, y, epochs=1, validation_data=(x, y), callbacks=[_StepCounter()], verbose=0)
    trials = [t for t in tuner.oracle.trials.values() if t.status == "COMPLETED"]
    assert len(trials) == len(seen) == len(_StepCounter.steps) >= 2
    for (timed_batch, spe), trial, steps in zip(seen, trials, _StepCounter.steps):
        assert timed_batch == trial.hyperparameters.get("batch_size")
        assert steps == int(np.ceil(N / timed_batch))  # trained at that batch size
        assert spe == 1


def test_hyperband_never_trains_over_budget_and_does_not_retime_promotions(data, tmp_path):
    x, y = data
    table = LatencyTable()
    tuner = LatencyAwareHyperband(build_units_stride, "val_accuracy", max_epochs=3, factor=3,
                                  latency_budget_ms=16.0, timing=table, seed=0,
                                  latency_increasing=["units"], latency_decreasing=["stride"],
                                  directory=str(tmp_path), project_name="hb")
    tuner.search(x, y, validation_data=(x, y), verbose=0)
    rows = tuner.trial_latencies()
    trained = [r for r in rows if r["trained"]]
    assert trained and all(r["latency_ms"] <= 16.0 for r in trained)
    over = [r for r in rows if r["latency_ms"] > 16.0]
    assert over and all(not r["trained"] for r in over)  # some were drawn, timed and refused
    promoted = [r for r in trained if r["values"].get("tuner/round", 0) > 0]
    assert promoted  # Hyperband ran its later rounds on in-budget candidates
    assert len(table.calls) == len({c["name"] for c in table.calls})  # each candidate timed once
    # Every first-round slot of every bracket (2 + 3, of 9 in-budget candidates) went to an in-budget one.
    first_round = [r for r in trained if r["values"].get("tuner/round") == 0]
    oracle = tuner.oracle
    assert len(first_round) == sum(oracle._get_size(b, 0) for b in range(oracle._get_num_brackets()))


def test_params_budget_is_checked_before_timing(data, tmp_path):
    x, y = data
    table = LatencyTable()
    limit = _mlp(16).count_params()
    tuner = LatencyAwareRandomSearch(build_units_stride, "val_accuracy", max_trials=12, latency_budget_ms=1e9,
                                     max_params=limit, timing=table, seed=0, latency_increasing=["units"],
                                     latency_independent=["stride"], directory=str(tmp_path), project_name="pp")
    tuner.search(x, y, epochs=1, validation_data=(x, y), verbose=0)
    rows = tuner.trial_latencies()
    assert {r["values"]["units"] for r in rows if r["trained"]} == {8, 16}
    for r in rows:
        if r["params"] > limit:
            assert not r["trained"] and r["latency_ms"] is None  # refused before timing
            assert "params=" in tuner.oracle.trials[r["trial_id"]].message
    assert all(c["name"].startswith(("u8_", "u16_")) for c in table.calls)


def test_input_that_cannot_be_timed_is_refused_before_any_trial(data, tmp_path):
    x, y = data
    tuner = LatencyAwareRandomSearch(build_units_stride, "val_accuracy", max_trials=2, latency_budget_ms=5.0,
                                     timing=LatencyTable(), directory=str(tmp_path), project_name="gen")
    with pytest.raises(ValueError, match="LatencyAwareRandomSearch.search cannot time candidates on `x`"):
        tuner.search(((x[i:i + 8], y[i:i + 8]) for i in range(0, N, 8)), epochs=1)
    assert not tuner.oracle.trials


@pytest.mark.parametrize("make", [
    lambda b: LatencyAwareRandomSearch(b, "val_accuracy", max_trials=2),
    lambda b: LatencyAwareHyperband(b, "val_accuracy", max_epochs=2, latency_budget_ms=-1),
    lambda b: LatencyAwareRandomSearch(b, "val_accuracy", max_trials=2, latency_budget_ms=1, timing="fast"),
    lambda b: LatencyAwareTuner(b, oracle=keras_tuner.oracles.RandomSearchOracle("val_accuracy", max_trials=2)),
])
def test_bad_tuner_arguments_are_refused_at_construction(make, tmp_path):
    with pytest.raises(ValueError, match="latency_budget_ms|timing|latency-aware oracle"):
        make(build_units_stride)


def test_estimated_search_resumes_without_retiming(data, tmp_path):
    x, y = data
    kwargs = dict(max_trials=5, latency_budget_ms=None, timing="estimated", seed=1,
                  directory=str(tmp_path), project_name="resume")
    lat = {u: estimate_step(_mlp(u), (x[:32], y[:32]), "cpu").median_ms for u in (8, 64)}
    kwargs["latency_budget_ms"] = float(np.sqrt(lat[8] * lat[64]))
    tuner = LatencyAwareRandomSearch(build_units_stride, "val_accuracy", **kwargs)
    tuner.search(x, y, epochs=1, batch_size=32, validation_data=(x, y), verbose=0)
    rows = tuner.trial_latencies()
    assert {r["latency_kind"] for r in rows} == {"estimated"}
    again = LatencyAwareRandomSearch(build_units_stride, "val_accuracy", overwrite=False, **kwargs)
    assert again.oracle.latencies == tuner.oracle.latencies
    known = tuner.oracle.trials[rows[0]["trial_id"]].hyperparameters
    assert again.time_candidate(known, x, y, batch_size=32).median_ms == rows[0]["latency_ms"]
    assert again.timed_candidates == 0
    assert os.path.exists(tmp_path / "resume" / "pareto.json")


def test_a_hypermodel_that_trains_without_model_fit_is_timed_after_training_with_one_warning(data, tmp_path):
    x, y = data

    class Scores(keras_tuner.HyperModel):
        def build(self, hp):
            return _mlp(hp.Choice("units", [8, 16, 32]))

        def fit(self, hp, model, *args, **kwargs):
            return {"val_accuracy": hp.get("units") / 100.0}  # a custom loop, no model.fit

    table = LatencyTable()
    tuner = LatencyAwareRandomSearch(Scores(), "val_accuracy", max_trials=3, latency_budget_ms=100.0,
                                     timing=table, seed=0, directory=str(tmp_path), project_name="nofit")
    with pytest.warns(UserWarning, match="without calling model.fit") as caught:
        tuner.search(x, y, batch_size=16)
    assert sum("without calling model.fit" in str(w.message) for w in caught) == 1
    rows = tuner.trial_latencies()
    assert len(rows) == 3 and all(r["trained"] and r["latency_ms"] > 0 for r in rows)
    assert {c["batch_size"] for c in table.calls} == {16}
