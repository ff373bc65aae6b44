import numpy as np
import pytest
import tensorflow as tf

from tf_hwopt.freezing import draw_probe


@pytest.fixture
def arrays():
    x = np.arange(100 * 3, dtype=np.float32).reshape(100, 3)
    return x, np.arange(100)


def test_array_probe_is_a_seeded_sample_without_repeats(arrays):
    x, _ = arrays
    a = draw_probe(x, 20, seed=1)
    assert a.shape == (20, 3)
    assert len({tuple(row) for row in a}) == 20
    np.testing.assert_array_equal(a, draw_probe(x, 20, seed=1))
    assert not np.array_equal(a, draw_probe(x, 20, seed=2))


def test_probe_does_not_move_tensorflow_random_state(arrays):
    x, _ = arrays
    tf.random.set_seed(7)
    expected = tf.random.uniform((3,)).numpy()
    tf.random.set_seed(7)
    draw_probe(x, 10)
    np.testing.assert_array_equal(tf.random.uniform((3,)).numpy(), expected)


@pytest.mark.parametrize("batch", [None, 7])
def test_dataset_probe_batched_or_not(arrays, batch):
    x, y = arrays
    ds = tf.data.Dataset.from_tensor_slices((x, y))
    if batch:
        ds = ds.batch(batch)
    probe = draw_probe(ds, 20, input_ndim=2)
    np.testing.assert_array_equal(probe, x[:20])


def test_dict_inputs(arrays):
    x, _ = arrays
    probe = draw_probe({"a": x, "b": 2 * x}, 5, seed=0)
    np.testing.assert_array_equal(probe["b"], 2 * probe["a"])


def test_probe_larger_than_data(arrays):
    x, y = arrays
    with pytest.raises(ValueError, match="larger than the training data"):
        draw_probe(x, 101)
    with pytest.raises(ValueError, match="larger than the training data"):
        draw_probe(tf.data.Dataset.from_tensor_slices((x, y)).batch(10), 101, input_ndim=2)
