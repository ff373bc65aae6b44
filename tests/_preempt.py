"""A training run that SIGKILLs itself after its first freeze (for test_preemption.py).

Usage: python _preempt.py OUT_JSON BACKUP_DIR KILL(0|1)
The kill happens once: a marker file in BACKUP_DIR's parent remembers it.
"""

import json
import os
import signal
import sys

out_json, backup_dir, kill = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
marker = backup_dir.rstrip("/") + ".killed.json"

import tf_hwopt  # noqa: E402
import keras  # noqa: E402

from tf_hwopt.data import load_mnist1d  # noqa: E402
from tf_hwopt.models import resnet1d  # noqa: E402


class KillAfterFirstFreeze(keras.callbacks.Callback):
    def __init__(self, egeria):
        super().__init__()
        self.egeria = egeria

    def on_epoch_end(self, epoch, logs=None):
        if kill and self.egeria.num_frozen and not os.path.exists(marker):
            with open(marker, "w") as f:
                json.dump({"epoch": epoch, "frozen": self.egeria.engine.frozen,
                           "policy": self.egeria.policy.get_state()}, f)
            os.kill(os.getpid(), signal.SIGKILL)


class ResumeRecorder(keras.callbacks.Callback):
    """The frozen set and policy state when training (re)starts."""

    def __init__(self, egeria):
        super().__init__()
        self.egeria, self.first = egeria, None

    def on_epoch_begin(self, epoch, logs=None):
        if self.first is None:
            self.first = {"epoch": epoch, "frozen": list(self.egeria.engine.frozen),
                          "policy": self.egeria.policy.get_state()}


(x, y), (x_test, y_test) = load_mnist1d(2500)
keras.utils.set_random_seed(0)
model = resnet1d(widths=(16, 16, 16), strides=(1, 2, 1), stem_width=16)
model.compile(keras.optimizers.Adam(3e-3), keras.losses.SparseCategoricalCrossentropy(from_logits=True),
              metrics=["accuracy"])
model(x[:1])
egeria = tf_hwopt.EgeriaCallback(probe_size=64, eval_every=8, window=3, patience=1, tolerance=0.5,
                                 bootstrap_steps=16, max_frozen_fraction=0.6, verbose=0, backup_dir=backup_dir,
                                 overhead_budget=None)
backup = tf_hwopt.AtomicBackupAndRestore(backup_dir)
recorder = ResumeRecorder(egeria)
model.fit(x, y, batch_size=64, epochs=8, validation_data=(x_test, y_test),
          callbacks=[egeria, recorder, backup, KillAfterFirstFreeze(egeria)], verbose=0)
with open(out_json, "w") as f:
    json.dump({"accuracy": float(model.evaluate(x_test, y_test, verbose=0)[1]), "resumed": recorder.first,
               "events": [(e["kind"], e["module"], e["epoch"]) for e in egeria.events]}, f)
