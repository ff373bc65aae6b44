"""`AtomicBackupAndRestore`: Keras's `BackupAndRestore`, with checkpoints that survive a kill.

Keras's `BackupAndRestore` overwrites `latest.weights.h5` in place and then
writes `training_metadata.json`: a process killed during the first write
leaves a truncated weights file, and one killed between the two leaves
weights of one epoch with the epoch counter of the previous one (the resumed
run trains an epoch twice). Preempted TPU and multi-worker jobs are killed
exactly like that.

Here each checkpoint is a new, uniquely named weights file, flushed to disk,
and the checkpoint becomes current by one atomic rename of a small pointer
file (`checkpoint.json`: weights file, epoch, batch). A kill at any moment
leaves the pointer naming a complete checkpoint: the new one or the previous
one. Older weights files are deleted only after the pointer moved on.
Use it exactly like `keras.callbacks.BackupAndRestore`, and give
`EgeriaCallback` the same `backup_dir` so that its state resumes with it.
"""

from __future__ import annotations

import json
import os
import uuid

from tf_hwopt._io import write_json_atomic
import keras

POINTER = "checkpoint.json"


class AtomicBackupAndRestore(keras.callbacks.BackupAndRestore):
    """`keras.callbacks.BackupAndRestore` whose checkpoints are committed atomically.

    Args:
        backup_dir, save_freq, delete_checkpoint: as for Keras's callback.
            (`double_checkpoint` is not needed: the previous checkpoint stays
            current until the new one is complete.)

    Example:
    >>> backup = tf_hwopt.AtomicBackupAndRestore("/ckpt/run1")
    >>> egeria = tf_hwopt.EgeriaCallback(backup_dir="/ckpt/run1")
    >>> model.fit(x, y, epochs=30, callbacks=[egeria, backup])   # rerun the same line after a kill
    """

    def __init__(self, backup_dir, save_freq="epoch", delete_checkpoint=True):
        super().__init__(backup_dir, save_freq=save_freq, double_checkpoint=False, delete_checkpoint=delete_checkpoint)

    @property
    def pointer_path(self) -> str:
        return os.path.join(self.backup_dir, POINTER)

    def read_pointer(self) -> dict | None:
        """The current checkpoint's record, or None when there is none."""
        if not os.path.exists(self.pointer_path):
            return None
        try:
            with open(self.pointer_path) as f:
                record = json.load(f)
            if not isinstance(record, dict) or not {"weights", "epoch", "batch"} <= set(record):
                raise ValueError("missing fields")
        except (OSError, ValueError) as err:
            raise ValueError(
                f"Checkpoint pointer {self.pointer_path!r} is unreadable ({err}); it and the weights "
                "files next to it were left untouched. Move the folder away to start training afresh."
            ) from err
        return record

    def on_train_begin(self, logs=None):
        self._load_model()

    def _load_model(self):
        if not self.model.built:
            raise ValueError(
                "To use AtomicBackupAndRestore the model must be built before `fit()` "
                "(call it on a batch of data first)."
            )
        record = self.read_pointer()
        if record is None:
            return
        weights = os.path.join(self.backup_dir, record["weights"])
        if not os.path.exists(weights):
            raise ValueError(
                f"Checkpoint pointer {self.pointer_path!r} names {record['weights']!r}, which is "
                "missing; nothing was changed."
            )
        if self.model.optimizer is not None and not self.model.optimizer.built:
            self.model.optimizer.build(self.model.trainable_variables)
        self.model.load_weights(weights)
        self.model._initial_epoch = record["epoch"]

    def _save_model(self):
        os.makedirs(self.backup_dir, exist_ok=True)
        name = f"ckpt-e{self._current_epoch}-b{self._last_batch_seen}-{uuid.uuid4().hex[:8]}.weights.h5"
        path = os.path.join(self.backup_dir, name)
        self.model.save_weights(path, overwrite=True)
        with open(path, "rb") as f:
            os.fsync(f.fileno())
        # The commit point: before this rename the previous checkpoint is current.
        write_json_atomic({"weights": name, "epoch": self._current_epoch, "batch": self._last_batch_seen},
                          self.pointer_path)
        # Only now may older checkpoints (and any left by a kill mid-save) go.
        for old in os.listdir(self.backup_dir):
            if old.startswith("ckpt-") and old.endswith(".weights.h5") and old != name:
                os.remove(os.path.join(self.backup_dir, old))
