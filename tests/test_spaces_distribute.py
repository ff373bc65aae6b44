import keras
import keras_tuner
import numpy as np
import pytest
import tensorflow as tf

from tf_hwopt.hardware.distribute import strategy_for
from tf_hwopt.search import HardwareSpace, aligned_range, load_space, power_of_two_multiples
from tf_hwopt.hardware.profiles import load_profile


def test_aligned_helpers():
    assert aligned_range(100, 1000, 128) == (128, 896)
    assert aligned_range(1, 20, 8) == (8, 16)
    assert power_of_two_multiples(64, 1024, 128) == [128, 256, 512, 1024]
    assert power_of_two_multiples(8, 100, 16) == [16, 32, 64]
    with pytest.raises(ValueError, match="No multiple of 256"):
        aligned_range(10, 200, 256)


@pytest.mark.parametrize(
    "profile,tile,policy,spe",
    [("tpu-v5e", 128, "mixed_bfloat16", [1, 32, 128]), ("tpu-v6e", 256, "mixed_bfloat16", [1, 32, 128]),
     ("gpu-h100", 16, "mixed_bfloat16", [1]), ("cpu", 8, "float32", [1])],
)
def test_same_hypermodel_gets_the_profile_space(profile, tile, policy, spe):
    hp = keras_tuner.HyperParameters()
    space = HardwareSpace(hp, profile)
    space.width("units", 64, 1024)
    space.batch_size(16, 1024)
    space.dtype_policy()
    space.steps_per_execution()
    units = hp._hps["units"][0]
    assert units.step == tile and units.min_value % tile == 0 and units.max_value % tile == 0
    assert all(b % tile == 0 for b in hp._hps["batch_size"][0].values)
    assert hp.get("dtype_policy") == policy
    spe_hp = hp._hps["steps_per_execution"][0]
    assert (list(spe_hp.values) if hasattr(spe_hp, "values") else [spe_hp.value]) == spe
    # Every sampled value respects the tile.
    for seed in range(20):
        values = hp.copy()
        sampled = {p.name: p.random_sample(seed) for p in values.space}
        assert sampled["units"] % tile == 0 and sampled["batch_size"] % tile == 0


def test_space_file(tmp_path):
    hp = keras_tuner.HyperParameters()
    values = load_space("tpu_configs/spaces/mlp.toml", hp, "tpu-v4")
    assert values["units"] % 128 == 0 and values["dtype_policy"] == "mixed_bfloat16"
    assert {"units", "layers", "learning_rate", "batch_size", "dtype_policy", "steps_per_execution"} == set(values)
    bad = tmp_path / "bad.toml"
    bad.write_text('[units]\ntype = "width"\nmin = 8\n')
    with pytest.raises(ValueError, match=r"`units` \(width\) needs field 'max'"):
        load_space(str(bad), keras_tuner.HyperParameters(), "cpu")


def test_strategy_for_cpu_and_missing_hardware():
    assert strategy_for("cpu") is tf.distribute.get_strategy()
    with pytest.raises(ValueError, match="no TPU is attached.*`cpu` profile"):
        strategy_for("tpu-v5e")
    with pytest.raises(ValueError, match="has none.*`cpu` profile"):
        strategy_for("gpu-a100")


def test_mirrored_strategy_over_two_logical_cpus_trains():
    strategy = strategy_for("cpu", devices=["/cpu:0", "/cpu:1"])
    assert strategy.num_replicas_in_sync == 2
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8), keras.layers.Dense(1)])
        model.compile("sgd", "mse")
    x = np.random.RandomState(0).rand(64, 4).astype("float32")
    history = model.fit(x, x.sum(axis=1, keepdims=True), batch_size=16, epochs=3, verbose=0)
    assert history.history["loss"][-1] < history.history["loss"][0]
    assert load_profile("cpu").strategy == "default"
