"""One process of a KerasTuner distributed search (chief or worker), for test_search_distributed.py.

Usage: python _kt_distributed.py OUT_DIR PROJECT_DIR BUDGET_MS MAX_TRIALS
with KERASTUNER_TUNER_ID / KERASTUNER_ORACLE_IP / KERASTUNER_ORACLE_PORT set.
"""

import json
import os
import sys

import tf_hwopt  # noqa: F401  (quiet TensorFlow import first)
import keras
import numpy as np

from tf_hwopt.search import LatencyAwareRandomSearchOracle, LatencyAwareTuner


def build(hp):
    units = hp.Choice("units", [8, 16, 32, 1024, 2048])
    layers = hp.Int("layers", 1, 2)
    model = keras.Sequential(
        [keras.Input((40,))] + [keras.layers.Dense(units, activation="relu") for _ in range(layers)] + [keras.layers.Dense(10)]
    )
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    return model


class RecordingTuner(LatencyAwareTuner):
    """Remembers which trials this process ran."""

    ran = []

    def on_trial_end(self, trial):
        self.ran.append({"trial_id": trial.trial_id, "status": trial.status})
        super().on_trial_end(trial)


def main(out_dir, project_dir, budget_ms, max_trials):
    role = os.environ["KERASTUNER_TUNER_ID"]
    rng = np.random.default_rng(0)
    x = rng.standard_normal((256, 40)).astype("float32")
    y = rng.integers(0, 10, 256).astype("int32")
    oracle = LatencyAwareRandomSearchOracle("val_accuracy", max_trials=max_trials, latency_budget_ms=budget_ms, seed=3)
    tuner = RecordingTuner(build, oracle=oracle, profile="cpu", timing="estimated",
                           directory=os.path.dirname(project_dir), project_name=os.path.basename(project_dir))
    tuner.search(x, y, epochs=1, batch_size=32, validation_data=(x[:64], y[:64]), verbose=0)
    if role == "chief":
        report = {"trials": tuner.trial_latencies(), "latencies": list(oracle.latencies.values())}
    else:
        report = {"ran": tuner.ran}
    with open(os.path.join(out_dir, f"{role}.json"), "w") as f:
        json.dump(report, f, default=str)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4]))
