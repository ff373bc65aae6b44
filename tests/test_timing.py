import keras
import tensorflow as tf
import numpy as np
import pytest

from tf_hwopt.search import check_timeable, estimate_step, median_of_block_medians, time_step, timing_batch
from tf_hwopt.models import resnet1d


def _model(width=32, jit=False):
    keras.utils.set_random_seed(0)
    model = resnet1d(widths=(width,) * 3, strides=(1, 2, 1), stem_width=width)
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True), jit_compile=jit)
    return model


@pytest.fixture(scope="module")
def batch():
    rng = np.random.RandomState(0)
    return rng.randn(128, 40, 1).astype("float32"), rng.randint(0, 10, 128)


def test_measured_train_step_excludes_compilation_and_restores_state(batch):
    model = _model()
    model.fit(*batch, epochs=1, verbose=0)  # optimizer slots exist and are non-zero
    before = [v.numpy().copy() for v in model.variables + model.optimizer.variables]
    timing = time_step(model, batch, mode="train", steps=10)
    assert timing.kind == "measured" and timing.mode == "train" and timing.steps == 10
    assert timing.compile_ms > timing.median_ms > 0  # the first call compiled; it is not in the median
    assert timing.p10_ms <= timing.median_ms <= timing.p90_ms
    after = [v.numpy() for v in model.variables + model.optimizer.variables]
    assert all(np.array_equal(a, b) for a, b in zip(before, after)), "timing trained the model"
    assert model.jit_compile is False  # the user's setting is back


def test_timing_a_fresh_model_leaves_no_optimizer_state_behind(batch):
    """Adam's slots do not exist before the first step: timing must not create them with values."""
    model = _model()
    model.steps_per_execution = 4
    weights = [v.numpy().copy() for v in model.variables]
    timing = time_step(model, batch, steps=8, blocks=2)
    assert timing.blocks == 2 and timing.median_ms > 0
    assert model.optimizer.iterations.numpy() == 0
    assert all(not np.any(v.numpy()) for v in model.optimizer.variables if "iteration" not in v.path
               and "learning_rate" not in v.path)
    assert all(np.array_equal(a, v.numpy()) for a, v in zip(weights, model.variables))
    assert model.steps_per_execution == 4
    model.fit(*batch, batch_size=32, epochs=1, verbose=0)  # the train function still works
    assert model.optimizer.iterations.numpy() == 4


def test_median_of_block_medians():
    assert median_of_block_medians([1, 1, 1, 50, 1, 1], 3) == 1.0  # one spike moves nothing
    assert median_of_block_medians([4.0, 2.0], 1) == 3.0
    with pytest.raises(ValueError, match="blocks"):
        median_of_block_medians([1.0, 2.0], 3)


def test_serve_mode_and_bad_arguments(batch):
    x, y = batch
    model = _model()
    serve = time_step(model, x, mode="serve", steps=5)
    assert serve.mode == "serve" and serve.kind == "measured" and serve.median_ms > 0
    with pytest.raises(ValueError, match="blocks"):
        time_step(model, batch, steps=5, blocks=6)
    with pytest.raises(ValueError, match="mode"):
        time_step(model, batch, mode="infer")
    with pytest.raises(ValueError, match="steps"):
        time_step(model, batch, steps=1)
    with pytest.raises(ValueError, match=r"batch=\(x, y\)"):
        time_step(model, x, mode="train")
    uncompiled = resnet1d(widths=(8,), strides=(1,), stem_width=8)
    with pytest.raises(ValueError, match="compiled"):
        time_step(uncompiled, batch)


def test_candidate_over_profile_memory_is_refused_before_running(batch, tmp_path):
    tiny = tmp_path / "tiny.toml"
    tiny.write_text(
        'name = "tiny"\nkind = "gpu"\npeak_bf16_tflops = 1.0\npeak_fp32_tflops = 1.0\n'
        "memory_gib = 0.0001\nmemory_bandwidth_gbps = 1.0\nmatrix_tile = 8\nbatch_multiple = 8\n"
        'width_multiple = 8\ndtype_policy = "float32"\nstrategy = "default"\n'
    )
    model = _model()
    with pytest.raises(ValueError, match="more than the 0.0001 GiB of tiny"):
        time_step(model, batch, profile=str(tiny))
    assert model.optimizer.iterations.numpy() == 0


def test_estimate_counts_flops_and_is_labelled():
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(32), keras.layers.Dense(10)])
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = np.zeros((16, 64), "float32"), np.zeros((16,), "int32")
    serve = estimate_step(model, x, "tpu-v5e", mode="serve")
    assert serve.kind == "estimated" and serve.device == "tpu-v5e" and serve.steps == 0
    assert serve.flops == 16 * (2 * 64 * 32 + 32 + 2 * 32 * 10 + 10)
    train = estimate_step(model, (x, y), "tpu-v5e", mode="train")
    assert 2.0 < train.flops / serve.flops < 3.5  # backward ~ 2x forward
    assert train.median_ms > serve.median_ms > 0
    assert "estimated" in train.label()


# ----------------------------------------------------- the batch that is timed


def test_timing_batch_takes_the_batch_fit_would_train_on():
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((50, 4)).astype("float32"), np.arange(50)
    bx, by, sw = timing_batch((x, y), {"batch_size": 16})
    assert bx.shape == (16, 4) and by.tolist() == list(range(16)) and sw is None
    assert timing_batch((x, y), {})[0].shape[0] == 32  # fit's default batch size
    assert timing_batch((x[:10], y[:10]), {"batch_size": 64})[0].shape[0] == 10  # fewer rows: all of them
    feats, labels, _ = timing_batch(({"a": x, "b": x[:, :2]}, y), {"batch_size": 8})
    assert feats["a"].shape == (8, 4) and feats["b"].shape == (8, 2) and labels.shape == (8,)
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(20)
    bx, by, _ = timing_batch((ds,), {})
    assert bx.shape == (20, 4) and [int(b[1][0]) for b in ds] == [0, 20, 40]  # the dataset is not consumed

    class Seq(keras.utils.PyDataset):
        def __len__(self):
            return 2

        def __getitem__(self, i):
            return x[i * 25:(i + 1) * 25], y[i * 25:(i + 1) * 25]

    assert timing_batch((Seq(),), {})[0].shape == (25, 4)
    with pytest.raises(ValueError, match="generator or iterator"):
        timing_batch((iter([(x, y)]),), {})
    with pytest.raises(ValueError, match="training input `x`"):
        check_timeable((), {"validation_data": (x, y)})
