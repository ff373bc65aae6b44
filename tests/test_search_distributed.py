"""The latency-aware oracle in KerasTuner's own distributed mode, and under MirroredStrategy."""

import json
import os
import socket
import subprocess
import sys

import keras_tuner
import numpy as np
import tensorflow as tf

from tf_hwopt.search import LatencyAwareRandomSearch, estimate_step

HERE = os.path.dirname(__file__)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _budget():
    sys.path.insert(0, HERE)
    try:
        from _kt_distributed import build
    finally:
        sys.path.remove(HERE)
    x, y = np.zeros((32, 40), "float32"), np.zeros(32, "int32")
    lat = {}
    for units in (32, 1024):
        hp = keras_tuner.HyperParameters()
        hp.values.update({"units": units, "layers": 2})
        lat[units] = estimate_step(build(hp), (x, y), "cpu").median_ms
    return float(np.sqrt(lat[32] * lat[1024])), build


def test_chief_and_two_workers_run_every_trial_exactly_once(tmp_path):
    budget, _ = _budget()
    max_trials = 8
    port = _free_port()
    project = tmp_path / "search" / "dist"
    env = {**os.environ, "KERASTUNER_ORACLE_IP": "127.0.0.1", "KERASTUNER_ORACLE_PORT": str(port),
           "TF_CPP_MIN_LOG_LEVEL": "3", "CUDA_VISIBLE_DEVICES": ""}
    procs = {}
    for role in ("chief", "tuner0", "tuner1"):
        log = open(tmp_path / f"{role}.log", "w")
        procs[role] = (subprocess.Popen(
            [sys.executable, os.path.join(HERE, "_kt_distributed.py"), str(tmp_path), str(project),
             repr(budget), str(max_trials)],
            env={**env, "KERASTUNER_TUNER_ID": role}, stdout=log, stderr=subprocess.STDOUT), log)
    try:
        for role, (proc, _) in procs.items():
            assert proc.wait(timeout=420) == 0, (role, (tmp_path / f"{role}.log").read_text()[-3000:])
    finally:
        for proc, log in procs.values():
            if proc.poll() is None:
                proc.kill()
            log.close()
    chief = json.loads((tmp_path / "chief.json").read_text())
    ran = {role: json.loads((tmp_path / f"{role}.json").read_text())["ran"] for role in ("tuner0", "tuner1")}
    ids = {role: [r["trial_id"] for r in rows] for role, rows in ran.items()}
    trials = chief["trials"]
    assert len(trials) == max_trials
    # No trial lost, none run twice, and both workers took part.
    assert sorted(ids["tuner0"] + ids["tuner1"]) == sorted(t["trial_id"] for t in trials)
    assert not set(ids["tuner0"]) & set(ids["tuner1"])
    assert ids["tuner0"] and ids["tuner1"]
    assert len({json.dumps(t["values"], sort_keys=True) for t in trials}) == max_trials
    # The chief learned every latency over gRPC, over-budget ones included.
    assert all(t["latency_ms"] is not None for t in trials)
    over = [t for t in trials if t["latency_ms"] > budget]
    within = [t for t in trials if t["latency_ms"] <= budget]
    assert over and within
    assert all(t["status"] == "FAILED" and not t["trained"] and t["score"] is None for t in over)
    assert all(t["status"] == "COMPLETED" and t["score"] is not None for t in within)


def test_mirrored_strategy_over_two_logical_cpus_runs_a_trial(tmp_path):
    devices = [d.name for d in tf.config.list_logical_devices("CPU")][:2]
    assert len(devices) == 2  # configured in conftest
    # Not the default collective all-reduce: two collective MirroredStrategies in one
    # test process can collide on collective instance keys.
    strategy = tf.distribute.MirroredStrategy(devices, cross_device_ops=tf.distribute.ReductionToOneDevice())
    budget, build = _budget()
    tuner = LatencyAwareRandomSearch(build, "val_accuracy", max_trials=1, latency_budget_ms=1e6, seed=0,
                                     timing="measured", timing_steps=3,
                                     distribution_strategy=strategy, directory=str(tmp_path), project_name="mirrored")
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((128, 40)).astype("float32"), rng.integers(0, 10, 128).astype("int32")
    tuner.search(x, y, epochs=1, batch_size=32, validation_data=(x[:64], y[:64]), verbose=0)
    (trial,) = tuner.oracle.trials.values()
    assert trial.status == "COMPLETED"
    assert trial.metrics.exists("val_accuracy") and trial.metrics.get_last_value("latency_ms") > 0
    model = tuner.get_best_models(1)[0]
    assert model.count_params() > 0
