import math

import pytest

from tf_hwopt.egeria import EgeriaPolicy, relative_slope


def _converging(i):
    return 1.0 + 10.0 * math.exp(-i / 3.0)


def test_relative_slope():
    assert relative_slope([2.0, 2.0, 2.0]) == 0.0
    assert relative_slope([1.0, 2.0, 3.0]) == pytest.approx(0.5)
    assert relative_slope([3.0, 2.0, 1.0]) == pytest.approx(-0.5)
    assert relative_slope([1.0]) == math.inf


def test_converging_series_freezes_after_bootstrap_and_patience():
    policy = EgeriaPolicy(3, window=4, tolerance=0.02, patience=3, bootstrap_steps=2000)
    freeze_steps = []
    for i in range(80):
        step = 100 * i
        d = policy.observe(step, [_converging(i), 1.2**i, 1.0])
        if d.freeze:
            freeze_steps.append((step, d.freeze, d.window))
    assert len(freeze_steps) == 1  # module 1 keeps growing 20% per evaluation: never frozen
    step, which, window = freeze_steps[0]
    assert which == (0,)
    assert step >= 2000
    assert len(window) == 4
    # Converged means: the window's relative slope is within tolerance.
    assert abs(relative_slope(list(window))) <= 0.02
    # It needed `patience` consecutive converged evaluations past bootstrap.
    first_ok = next(
        i for i in range(4, 80)
        if 100 * i >= 2000 and abs(relative_slope([_converging(j) for j in range(i - 3, i + 1)])) <= 0.02
    )
    assert step == 100 * (first_ok + 2)


def test_no_freeze_during_bootstrap():
    policy = EgeriaPolicy(3, window=3, tolerance=0.5, patience=1, bootstrap_steps=10**9)
    for i in range(50):
        assert not policy.observe(i, [1.0, 1.0, 1.0]).freeze


def test_noisy_non_converging_series_never_freezes():
    import random

    rnd = random.Random(0)
    policy = EgeriaPolicy(3, window=5, tolerance=0.05, patience=2)
    for i in range(200):
        trend = 1.15**i  # still rising 15% per evaluation: not converged
        d = policy.observe(i, [trend * (1 + 0.2 * rnd.uniform(-1, 1)), 1.0, 1.0])
        assert not d.freeze
    assert policy.num_frozen == 0


def test_nan_never_freezes_and_is_skipped():
    policy = EgeriaPolicy(2, window=2, tolerance=1e6, patience=1)
    for i in range(20):
        d = policy.observe(i, [math.nan if i % 2 else math.inf, 1.0])
        assert d.skipped and not d.freeze
    assert policy.num_frozen == 0 and policy.evaluations == 0
    assert policy.window_of(0) == []


def test_only_frontmost_active_module_freezes_in_order():
    policy = EgeriaPolicy(4, window=3, tolerance=0.01, patience=1, max_frozen_fraction=1.0)
    frozen = []
    # Module 1 is flat from the start, module 0 keeps changing for a while.
    for i in range(40):
        m0 = 1.0 + i if i < 20 else 21.0
        d = policy.observe(i, [m0, 5.0, 5.0, 5.0])
        frozen.extend(d.freeze)
        if i < 20:
            assert not d.freeze, "module 1 must wait for module 0"
    assert frozen == [0, 1, 2]  # one per evaluation, front to back, never the head (3)


def test_head_and_cap():
    policy = EgeriaPolicy(5, window=2, tolerance=1e6, patience=1, max_frozen_fraction=0.4)
    assert policy.max_frozen == 2
    for i in range(30):
        policy.observe(i, [1.0] * 5)
    assert policy.num_frozen == 2 and policy.settled
    head_only = EgeriaPolicy(2, window=2, tolerance=1e6, patience=1, max_frozen_fraction=1.0)
    for i in range(30):
        head_only.observe(i, [1.0, 1.0])
    assert head_only.num_frozen == 1


def test_reopens_on_large_learning_rate_drop():
    policy = EgeriaPolicy(3, window=2, tolerance=1e6, patience=1, reopen_lr_factor=10)
    for i in range(4):
        policy.observe(i, [1.0, 1.0, 1.0], learning_rate=0.1)
    assert policy.num_frozen == 2
    assert not policy.settled  # a learning-rate drop may still re-open modules
    d = policy.observe(5, [1.0, 1.0, 1.0], learning_rate=0.05)  # 2x: not enough
    assert not d.unfreeze
    d = policy.observe(6, [1.0, 1.0, 1.0], learning_rate=0.01)
    assert d.unfreeze == (0, 1)
    assert policy.num_frozen == 0
    assert policy.window_of(0) == []


def test_state_round_trip():
    policy = EgeriaPolicy(3, window=3, tolerance=0.5, patience=1)
    for i in range(5):
        policy.observe(i, [1.0 + 0.001 * i, 2.0, 3.0], learning_rate=0.1)
    state = policy.get_state()
    other = EgeriaPolicy(3, window=3, tolerance=0.5, patience=1)
    other.set_state(state)
    assert other.get_state() == state
    with pytest.raises(ValueError, match="different model"):
        EgeriaPolicy(4, window=3).set_state(state)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(window=0), "window"),
        (dict(window=-3), "window"),
        (dict(window=1), "window"),
        (dict(patience=0), "patience"),
        (dict(tolerance=0.0), "tolerance"),
        (dict(tolerance=-0.1), "tolerance"),
        (dict(bootstrap_steps=-1), "bootstrap_steps"),
        (dict(max_frozen_fraction=0.0), "max_frozen_fraction"),
        (dict(reopen_lr_factor=0.5), "reopen_lr_factor"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        EgeriaPolicy(3, **kwargs)


def test_too_few_modules():
    with pytest.raises(ValueError, match="num_modules"):
        EgeriaPolicy(1)
