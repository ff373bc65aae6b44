"""SavedModel export: round trips, training state kept out, atomic writes, int8 TFLite, tuner export."""

import glob
import json
import os

import keras
import numpy as np
import pytest
import tensorflow as tf

from tf_hwopt.cli import main
from tf_hwopt.export import export_saved_model
from conftest import compile_model, eager_freezing, small_resnet


def _serve(path, **inputs):
    signature = tf.saved_model.load(path).signatures["serving_default"]
    return {k: v.numpy() for k, v in signature(**{k: tf.constant(v) for k, v in inputs.items()}).items()}


def test_functional_round_trip_keeps_input_and_output_names(tmp_path, mnist1d_small):
    x = mnist1d_small[2][:16]
    model = small_resnet()
    result = export_saved_model(model, str(tmp_path / "fn"), sample=x)
    assert result.input_names == ["signal"] and result.output_names == ["head"]
    assert result.max_abs_diff <= 1e-5 and result.saved_model_bytes > 0
    served = _serve(result.path, signal=x)
    np.testing.assert_allclose(served["head"], model(x, training=False).numpy(), rtol=1e-5, atol=1e-6)
    assert not glob.glob(str(tmp_path / ".fn.partial-*"))


def test_sequential_round_trip(tmp_path):
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((12,), name="features"), keras.layers.Dense(8, activation="relu"), keras.layers.Dropout(0.5),
         keras.layers.Dense(3, name="scores")]
    )
    x = np.random.RandomState(0).rand(5, 12).astype("float32")
    result = export_saved_model(model, str(tmp_path / "seq"))
    served = _serve(result.path, **{result.input_names[0]: x})
    # Dropout is inactive in serving: the SavedModel matches inference mode exactly.
    np.testing.assert_allclose(served[result.output_names[0]], model(x, training=False).numpy(), rtol=1e-5)


class _ExportWhileFrozen(keras.callbacks.Callback):
    def __init__(self, egeria, path):
        super().__init__()
        self.egeria, self.path, self.frozen_at_export = egeria, path, None

    def on_epoch_end(self, epoch, logs=None):
        if self.frozen_at_export is None and self.egeria.num_frozen:
            self.frozen_at_export = self.egeria.num_frozen
            export_saved_model(self.model, self.path)


def test_egeria_frozen_flags_and_optimizer_do_not_leak_into_the_export(tmp_path, mnist1d_small):
    x, y, x_test, _ = mnist1d_small
    model = compile_model(small_resnet())
    egeria = eager_freezing()
    watcher = _ExportWhileFrozen(egeria, str(tmp_path / "mid_freeze"))
    model.fit(x[:512], y[:512], batch_size=32, epochs=3, callbacks=[egeria, watcher], verbose=0)
    assert watcher.frozen_at_export, "no module froze during the run"
    # The same weights, in a fresh model that never froze anything.
    twin = small_resnet(seed=1)
    twin.set_weights(model.get_weights())
    after = export_saved_model(model, str(tmp_path / "after"))
    fresh = export_saved_model(twin, str(tmp_path / "fresh"))
    served_after = _serve(after.path, signal=x_test[:32])["head"]
    np.testing.assert_array_equal(served_after, _serve(fresh.path, signal=x_test[:32])["head"])
    np.testing.assert_allclose(served_after, model(x_test[:32], training=False).numpy(), rtol=1e-5, atol=1e-6)
    # Exported mid-freeze: serves the weights it had then, and carries no optimizer state.
    loaded = tf.saved_model.load(str(tmp_path / "mid_freeze"))
    assert len(loaded.variables) == len(model.variables)
    assert not any("adam" in v.name.lower() or "iteration" in v.name.lower() for v in loaded.variables)


def test_refuses_to_overwrite_and_replaces_only_when_asked(tmp_path):
    model = small_resnet()
    path = str(tmp_path / "m")
    export_saved_model(model, path)
    stamp = os.path.getmtime(os.path.join(path, "saved_model.pb"))
    with pytest.raises(ValueError, match="already exists.*overwrite=True"):
        export_saved_model(model, path)
    assert os.path.getmtime(os.path.join(path, "saved_model.pb")) == stamp
    other = small_resnet(seed=5)
    export_saved_model(other, path, overwrite=True)
    x = np.ones((2, 40, 1), "float32")
    np.testing.assert_allclose(_serve(path, signal=x)["head"], other(x).numpy(), rtol=1e-5, atol=1e-6)


def test_a_failed_export_leaves_nothing_partial_and_keeps_the_old_one(tmp_path, monkeypatch):
    model = small_resnet()
    path = str(tmp_path / "m")
    with pytest.raises(RuntimeError, match="differ"):
        export_saved_model(model, path, atol=-1.0)  # the verification cannot pass
    assert os.listdir(tmp_path) == []
    export_saved_model(model, path)
    before = sorted(os.listdir(path))

    def crash(*args, **kwargs):
        raise OSError("disk full (injected)")

    monkeypatch.setattr("tf_hwopt.export._verify", crash)
    with pytest.raises(OSError, match="injected"):
        export_saved_model(small_resnet(seed=3), path, overwrite=True)
    assert sorted(os.listdir(tmp_path)) == ["m"] and sorted(os.listdir(path)) == before
    x = np.ones((2, 40, 1), "float32")
    np.testing.assert_allclose(_serve(path, signal=x)["head"], model(x).numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "kwargs, match",
    [({"int8_tflite": "m.tflite"}, "representative_data"), ({"eval_data": np.zeros(3)}, "eval_data")],
)
def test_bad_arguments_fail_before_writing(tmp_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        export_saved_model(small_resnet(), str(tmp_path / "m"), **kwargs)
    with pytest.raises(ValueError, match="keras.Model"):
        export_saved_model("model.keras", str(tmp_path / "m"))
    assert os.listdir(tmp_path) == []


def test_int8_tflite_reports_size_and_accuracy_delta_on_mnist1d(tmp_path, mnist1d_small):
    x, y, x_test, y_test = mnist1d_small
    model = compile_model(small_resnet())
    model.fit(x, y, batch_size=32, epochs=8, verbose=0)
    result = export_saved_model(
        model, str(tmp_path / "m"), int8_tflite=str(tmp_path / "m.tflite"),
        representative_data=x[:200], eval_data=(x_test, y_test),
    )
    t = result.tflite
    assert t["bytes"] == os.path.getsize(tmp_path / "m.tflite")
    assert t["bytes"] < result.saved_model_bytes / 4  # int8 weights, no graph overhead
    assert t["float_accuracy"] > 0.25  # trained beyond chance (10%)
    assert abs(t["accuracy_delta_points"]) <= 3.0 and t["agreement"] >= 0.9


def test_cli_export(tmp_path, capsys):
    model = compile_model(small_resnet())
    model.save(tmp_path / "m.keras")
    x = np.random.RandomState(0).rand(64, 40, 1).astype("float32")
    np.save(tmp_path / "rep.npy", x)
    out = tmp_path / "served"
    assert main(["export", str(tmp_path / "m.keras"), str(out), "--int8-tflite",
                 "--representative-data", str(tmp_path / "rep.npy")]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["path"] == str(out) and os.path.exists(out / "saved_model.pb")
    assert os.path.getsize(report["tflite"]["path"]) == report["tflite"]["bytes"]
    np.testing.assert_allclose(_serve(str(out), signal=x[:4])["head"], model(x[:4]).numpy(), rtol=1e-5, atol=1e-6)
    with pytest.raises(SystemExit) as err:  # exists, no --overwrite: refused, named
        main(["export", str(tmp_path / "m.keras"), str(out)])
    assert err.value.code == 2 and "overwrite" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["export", str(tmp_path / "m.keras"), str(tmp_path / "o2"), "--int8-tflite"])
    assert "representative" in capsys.readouterr().err
