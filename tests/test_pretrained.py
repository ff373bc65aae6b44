"""Pretrained weights of the fine-tuning workloads: built once, reused, rebuilt on a new recipe."""

import os

import keras
import numpy as np
import pytest

from tf_hwopt.bench import workloads
from tf_hwopt.bench.pretrained import pretrained_weights, recipe_key


def _tiny(seed=0):
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, name="d")])
    return model


def test_recipe_key_is_stable_and_changes_with_any_argument():
    base = {"epochs": 3, "data": {"num_samples": 100}, "learning_rate": 1e-3}
    assert recipe_key(base) == recipe_key(dict(reversed(list(base.items()))))
    assert recipe_key(base) != recipe_key({**base, "epochs": 4})
    assert recipe_key(base) != recipe_key({**base, "data": {"num_samples": 101}})


def test_weights_are_built_once_and_rebuilt_when_the_recipe_changes(tmp_path):
    calls = []

    def pretrain(seed):
        calls.append(seed)
        return _tiny(seed)

    path = pretrained_weights("tiny", {"seed": 0}, lambda: pretrain(0), directory=str(tmp_path))
    again = pretrained_weights("tiny", {"seed": 0}, lambda: pretrain(0), directory=str(tmp_path))
    assert again == path and calls == [0]  # reused, not pretrained again
    other = pretrained_weights("tiny", {"seed": 1}, lambda: pretrain(1), directory=str(tmp_path))
    assert other != path and calls == [0, 1]  # a new recipe pretrains again, in its own file
    assert os.path.exists(path) and os.path.exists(other)
    # The file holds what was trained: loading it reproduces the pretrained model.
    model = _tiny(5)
    model.load_weights(path)
    np.testing.assert_array_equal(model.get_layer("d").kernel.numpy(), _tiny(0).get_layer("d").kernel.numpy())
    assert not [f for f in os.listdir(tmp_path) if ".tmp." in f]  # no half-written file left


def test_finetune_mnist1d_starts_from_the_pretrained_body_with_a_fresh_head(tmp_path, monkeypatch):
    monkeypatch.setenv("TF_HWOPT_CACHE", str(tmp_path))
    calls = []
    original = workloads._pretrain
    monkeypatch.setattr(workloads, "_pretrain", lambda *a: calls.append(1) or original(*a))
    first = workloads.finetune_mnist1d_workload("quick")
    second = workloads.finetune_mnist1d_workload("quick")
    assert len(calls) == 1 and first.pretrained == second.pretrained
    assert first.pretrained.startswith(str(tmp_path))
    base = workloads.resnet1d()
    base.load_weights(first.pretrained)
    keras.utils.set_random_seed(0)
    model = first.build_model()
    for layer, pre in zip(model.layers, base.layers):
        for w, p in zip(layer.weights, pre.weights):
            same = np.array_equal(w.numpy(), p.numpy())
            assert same == (layer.name != "head") or not layer.weights, layer.name
    (x, y), (x_test, y_test) = first.data
    assert sorted(np.unique(y)) == list(range(10)) and len(x) == 1600 and len(x_test) == 400
    # The shifted task's labels are a fixed permutation (not the identity) of the generator's digits.
    raw = workloads.load_mnist1d(2000, seed=7, corr_noise_scale=0.4, iid_noise_scale=0.05, shear_scale=1.0)[0][1]
    mapping = {int(c): set(np.unique(y[raw == c]).tolist()) for c in range(10)}
    assert all(len(v) == 1 for v in mapping.values())
    images = [v.pop() for v in mapping.values()]
    assert sorted(images) == list(range(10)) and images != list(range(10))


@pytest.mark.parametrize("bad", [0, 1.5, "x"])
def test_prose_val_fraction_is_validated(bad):
    from tf_hwopt.data import load_prose_chars

    with pytest.raises(ValueError, match="val_fraction"):
        load_prose_chars(64, val_fraction=bad)
