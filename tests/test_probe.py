import keras
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


class _Batches(keras.utils.PyDataset):
    def __init__(self, x, y, batch, **kwargs):
        super().__init__(**kwargs)
        self.x, self.y, self.batch = x, y, batch

    def __len__(self):
        return len(self.x) // self.batch

    def __getitem__(self, i):
        s = slice(i * self.batch, (i + 1) * self.batch)
        return self.x[s], self.y[s]


def test_py_dataset_probe_reads_its_first_batches(arrays):
    x, y = arrays
    data = _Batches(x, y, 8)
    np.testing.assert_array_equal(draw_probe(data, 20, input_ndim=2), x[:20])
    px, py = draw_probe(data, 12, input_ndim=2, labelled=True)
    np.testing.assert_array_equal(px, x[:12])
    np.testing.assert_array_equal(py, y[:12])
    with pytest.raises(ValueError, match=r"larger than the training data \(96 examples in the PyDataset\)"):
        draw_probe(data, 97, input_ndim=2)


def test_generator_is_refused_by_name(arrays):
    x, _ = arrays
    with pytest.raises(ValueError, match="of type generator. Pass `probe_data=`"):
        draw_probe((x[i : i + 10] for i in range(0, 100, 10)), 20)


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
