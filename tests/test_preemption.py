"""Preemption: SIGKILL after the first freeze, restart, resume with the same Egeria state; atomic checkpoints."""

import json
import os
import stat
import subprocess
import sys

import numpy as np
import pytest

import tf_hwopt
from tf_hwopt.backup import POINTER
from conftest import compile_model, small_resnet

HERE = os.path.dirname(__file__)


def _run(out, backup, kill):
    return subprocess.run([sys.executable, os.path.join(HERE, "_preempt.py"), str(out), str(backup), kill],
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})


def test_sigkill_after_the_first_freeze_resumes_with_the_same_state(tmp_path):
    whole = _run(tmp_path / "whole.json", tmp_path / "whole_backup", "0")
    assert whole.returncode == 0, whole.stderr[-3000:]
    killed = _run(tmp_path / "resumed.json", tmp_path / "backup", "1")
    assert killed.returncode == -9, killed.stderr[-3000:]  # SIGKILL
    at_kill = json.loads((tmp_path / "backup.killed.json").read_text())
    assert any(at_kill["frozen"])
    assert (tmp_path / "backup" / POINTER).exists() and (tmp_path / "backup" / "egeria_state.json").exists()
    resumed = _run(tmp_path / "resumed.json", tmp_path / "backup", "1")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    result = json.loads((tmp_path / "resumed.json").read_text())
    # It resumed after the killed epoch, with the frozen set and policy state saved then.
    assert result["resumed"]["epoch"] == at_kill["epoch"] + 1
    assert result["resumed"]["frozen"] == at_kill["frozen"]
    assert result["resumed"]["policy"] == at_kill["policy"]
    reference = json.loads((tmp_path / "whole.json").read_text())
    assert abs(result["accuracy"] - reference["accuracy"]) <= 0.05
    assert not (tmp_path / "backup").exists()  # deleted at the end of the completed run


def test_a_kill_during_a_checkpoint_write_leaves_the_previous_checkpoint(tmp_path, mnist1d_small, monkeypatch):
    x, y = mnist1d_small[0][:256], mnist1d_small[1][:256]
    backup_dir = str(tmp_path / "b")
    model = compile_model(small_resnet())
    model.fit(x, y, epochs=2, batch_size=64, verbose=0,
              callbacks=[tf_hwopt.AtomicBackupAndRestore(backup_dir, delete_checkpoint=False)])
    saved = [w.numpy().copy() for w in model.weights]

    def killed_mid_commit(*args, **kwargs):
        raise KeyboardInterrupt("killed while committing (injected)")

    monkeypatch.setattr("tf_hwopt.backup.write_json_atomic", killed_mid_commit)
    with pytest.raises(KeyboardInterrupt):
        model.fit(x, y, epochs=3, batch_size=64, verbose=0,
                  callbacks=[tf_hwopt.AtomicBackupAndRestore(backup_dir, delete_checkpoint=False)])
    monkeypatch.undo()
    # A fresh process restores the last complete checkpoint: epoch 2's weights.
    fresh = compile_model(small_resnet(seed=9))
    fresh(x[:1])
    backup = tf_hwopt.AtomicBackupAndRestore(backup_dir, delete_checkpoint=False)
    backup.set_model(fresh)
    backup.on_train_begin()
    assert backup.read_pointer()["epoch"] == 2 and fresh._initial_epoch == 2
    for a, w in zip(saved, fresh.weights):
        np.testing.assert_array_equal(a, w.numpy())


def test_a_corrupted_pointer_is_a_clear_error_and_nothing_is_deleted(tmp_path, mnist1d_small):
    x, y = mnist1d_small[0][:128], mnist1d_small[1][:128]
    backup_dir = tmp_path / "b"
    model = compile_model(small_resnet())
    model.fit(x, y, epochs=1, batch_size=64, verbose=0,
              callbacks=[tf_hwopt.AtomicBackupAndRestore(str(backup_dir), delete_checkpoint=False)])
    (backup_dir / POINTER).write_text("{not json")
    before = sorted(os.listdir(backup_dir))
    with pytest.raises(ValueError, match="unreadable.*left untouched"):
        model.fit(x, y, epochs=2, batch_size=64, verbose=0,
                  callbacks=[tf_hwopt.AtomicBackupAndRestore(str(backup_dir), delete_checkpoint=False)])
    assert sorted(os.listdir(backup_dir)) == before


def test_atomic_json_writes_keep_the_permissions_a_plain_open_gives(tmp_path):
    from tf_hwopt._io import write_json_atomic

    plain = tmp_path / "plain.json"
    plain.write_text("{}")
    atomic = tmp_path / "atomic.json"
    write_json_atomic({"a": 1}, str(atomic))
    assert json.loads(atomic.read_text()) == {"a": 1}
    assert stat.S_IMODE(os.stat(atomic).st_mode) == stat.S_IMODE(os.stat(plain).st_mode)  # not mkstemp's 0600
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []
