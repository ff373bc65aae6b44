import numpy as np
import pytest

from tf_hwopt.egeria import sp_loss


def _reference_sp(a, b):
    """Textbook SP loss (Tung & Mori 2019), float64, written independently."""
    a = a.reshape(a.shape[0], -1).astype(np.float64)
    b = b.reshape(b.shape[0], -1).astype(np.float64)
    ga, gb = a @ a.T, b @ b.T
    ga = ga / np.sqrt((ga**2).sum(axis=1, keepdims=True))
    gb = gb / np.sqrt((gb**2).sum(axis=1, keepdims=True))
    n = a.shape[0]
    return sum((ga[i, j] - gb[i, j]) ** 2 for i in range(n) for j in range(n)) / n**2


@pytest.mark.parametrize("shape_a,shape_b", [((8, 5), (8, 5)), ((6, 4, 3), (6, 7)), ((16, 2, 2, 3), (16, 12))])
def test_matches_float64_reference(rng, shape_a, shape_b):
    a = rng.randn(*shape_a).astype(np.float32)
    b = rng.randn(*shape_b).astype(np.float32)
    assert sp_loss(a, b) == pytest.approx(_reference_sp(a, b), rel=1e-10)
    assert sp_loss(a, b) > 1e-3


def test_zero_for_identical(rng):
    a = rng.randn(10, 4, 4)
    assert sp_loss(a, a) == 0.0


def test_invariant_to_scaling(rng):
    a, b = rng.randn(12, 9), rng.randn(12, 9)
    assert sp_loss(3.5 * a, b) == pytest.approx(sp_loss(a, b), rel=1e-9)
    assert sp_loss(a, 1e-3 * b) == pytest.approx(sp_loss(a, b), rel=1e-9)


def test_equivariant_to_batch_permutation(rng):
    a, b = rng.randn(12, 9), rng.randn(12, 9)
    perm = rng.permutation(12)
    assert sp_loss(a[perm], b[perm]) == pytest.approx(sp_loss(a, b), rel=1e-9)
    # Permuting only one side breaks the pairing of examples, so the loss changes.
    assert sp_loss(a[perm], b) != pytest.approx(sp_loss(a, b), rel=1e-3)


def test_grows_with_real_change(rng):
    a = rng.randn(16, 20)
    small = sp_loss(a, a + 0.01 * rng.randn(16, 20))
    large = sp_loss(a, a + 1.0 * rng.randn(16, 20))
    assert 0 < small < large


def test_batch_mismatch_is_an_error(rng):
    with pytest.raises(ValueError, match="same batch"):
        sp_loss(rng.randn(4, 3), rng.randn(5, 3))


def test_float32_gram_is_close_to_float64(rng):
    a = np.maximum(rng.randn(64, 300), 0).astype(np.float32)  # ReLU-like activations
    b = a + 0.05 * rng.randn(64, 300).astype(np.float32)
    exact = sp_loss(a, b)
    assert sp_loss(a, b, gram_dtype=np.float32) == pytest.approx(exact, rel=1e-3)
