"""Egeria under tf.distribute: replicas, several workers, fewer gradients aggregated."""

import json
import os
import socket
import subprocess
import sys

import keras
import numpy as np
import tensorflow as tf

from tf_hwopt.hardware.distribute import CountingCrossDeviceOps, gradient_aggregation
from conftest import FreezeWatcher, assert_frozen_bit_identical_and_rest_trained, eager_freezing, small_resnet

HERE = os.path.dirname(__file__)


def test_egeria_under_mirrored_strategy_stops_aggregating_frozen_gradients(mnist1d_small):
    x, y = mnist1d_small[0][:1024], mnist1d_small[1][:1024]
    devices = [d.name for d in tf.config.list_logical_devices("CPU")][:2]
    ops = CountingCrossDeviceOps()
    strategy = tf.distribute.MirroredStrategy(devices, cross_device_ops=ops)
    with strategy.scope():
        model = small_resnet()
        model.compile(keras.optimizers.Adam(3e-3), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    before = gradient_aggregation(model)
    egeria = eager_freezing()
    watcher = FreezeWatcher(egeria)
    model.fit(x, y, batch_size=64, epochs=2, callbacks=[egeria, watcher], verbose=0)
    assert egeria.num_frozen >= 1 and strategy.num_replicas_in_sync == 2
    assert_frozen_bit_identical_and_rest_trained(egeria, watcher)
    # Measured on the traced steps: the first aggregates every gradient, the last fewer.
    assert ops.calls[0] == before
    frozen_vars = sum(len(layer.trainable_weights) for m in egeria.modules[: egeria.num_frozen] for layer in m.layers)
    assert ops.calls[-1]["tensors"] == before["tensors"] - frozen_vars
    assert ops.calls[-1]["bytes"] < before["bytes"]


def _free_ports(n):
    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(("localhost", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def test_two_workers_apply_the_same_freezes_at_the_same_steps(tmp_path):
    ports = [str(p) for p in _free_ports(2)]
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "CUDA_VISIBLE_DEVICES": ""}
    procs = []
    for index in (0, 1):
        log = open(tmp_path / f"w{index}.log", "w")
        procs.append((subprocess.Popen([sys.executable, os.path.join(HERE, "_mw_worker.py"), str(tmp_path),
                                        str(index), *ports], env=env, stdout=log, stderr=subprocess.STDOUT), log))
    try:
        for index, (proc, _) in enumerate(procs):
            assert proc.wait(timeout=300) == 0, (tmp_path / f"w{index}.log").read_text()[-3000:]
    finally:  # never hang the suite: a stuck collective is killed
        for proc, log in procs:
            if proc.poll() is None:
                proc.kill()
            log.close()
    runs = [json.loads((tmp_path / f"worker{i}.json").read_text()) for i in (0, 1)]
    assert [r["chief"] for r in runs] == [True, False]
    assert runs[0]["frozen_at_step"] == runs[1]["frozen_at_step"]
    assert runs[0]["frozen_at_step"][-1], "nothing froze"
    assert runs[0]["loss"] == runs[1]["loss"]
    tensors = runs[0]["gradient_tensors_at_step"]
    assert tensors[-1] < tensors[0]  # frozen modules left the all-reduce
    weights = [np.load(tmp_path / f"weights{i}.npz") for i in (0, 1)]
    model = small_resnet()
    frozen_layers = set()
    from tf_hwopt.egeria import partition_modules

    for i in runs[0]["frozen_at_step"][-1]:
        frozen_layers |= {layer.name for layer in partition_modules(model)[i].layers}
    for k, w in enumerate(model.weights):
        a, b = weights[0][f"arr_{k}"], weights[1][f"arr_{k}"]
        # Trainable weights are identical (synchronous all-reduce). BatchNorm moving
        # statistics are per-worker (unsynchronised BN), except in frozen modules,
        # which take the chief's when they freeze.
        if w.trainable or w.path.split("/")[0] in frozen_layers:
            np.testing.assert_array_equal(a, b, err_msg=w.path)
