"""One worker of a 2-worker MultiWorkerMirroredStrategy run (for test_distributed.py).

Usage: python _mw_worker.py OUT_DIR INDEX PORT0 PORT1
"""

import json
import os
import sys

out_dir, index, ports = sys.argv[1], int(sys.argv[2]), sys.argv[3:5]
os.environ["TF_CONFIG"] = json.dumps(
    {"cluster": {"worker": [f"localhost:{p}" for p in ports]}, "task": {"type": "worker", "index": index}}
)

import numpy as np  # noqa: E402

import tf_hwopt  # noqa: E402
import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

from tf_hwopt.data import load_mnist1d  # noqa: E402
from tf_hwopt.training.multiworker import fit_multi_worker  # noqa: E402
from tf_hwopt.models import resnet1d  # noqa: E402

strategy = tf.distribute.MultiWorkerMirroredStrategy()
(x, y), _ = load_mnist1d(2500)
x, y = x[:1024], y[:1024]
with strategy.scope():
    keras.utils.set_random_seed(0)
    model = resnet1d(widths=(16, 16, 16), strides=(1, 2, 1), stem_width=16)
    model.compile(optimizer=keras.optimizers.Adam(3e-3))
freezer = tf_hwopt.EgeriaCallback(probe_size=32, eval_every=4, window=2, patience=1, tolerance=1e6,
                                  bootstrap_steps=0, max_frozen_fraction=0.5, verbose=0, asynchronous=False,
                                  overhead_budget=None)
loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
result = fit_multi_worker(model, x, y, epochs=2, batch_size=64, freezer=freezer, verbose=0, loss=loss, strategy=strategy)
np.savez(os.path.join(out_dir, f"weights{index}.npz"), *[w.numpy() for w in model.weights])
with open(os.path.join(out_dir, f"worker{index}.json"), "w") as f:
    json.dump({"loss": result.history["loss"], **{k: result.details[k] for k in ("frozen_at_step", "gradient_tensors_at_step", "chief", "steps")}}, f)
