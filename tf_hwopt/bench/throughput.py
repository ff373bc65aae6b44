"""Step time with the first k modules frozen, beside the analytic floor.

Mechanics only (synthetic data, no accuracy claim): how much of the
backward pass a frozen prefix actually saves per step, against what FLOP
counting says it could save.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from tf_hwopt._quiet import import_tensorflow_quietly

import_tensorflow_quietly()

import keras  # noqa: E402

from tf_hwopt.egeria.freezing import FreezingEngine  # noqa: E402
from tf_hwopt.egeria.modules import partition_modules  # noqa: E402
from tf_hwopt.search.timing import time_step  # noqa: E402


def analytic_floor_fraction(module_flops: Sequence[float], k: int) -> float:
    """Cost of a step with modules `0..k-1` frozen, as a fraction of a full step.

    A training step is the forward of every module plus a backward of about
    twice its forward for every module that still trains; frozen front
    modules need no backward at all:
    `(F_all + 2 * F_suffix(k)) / (3 * F_all)`.

    Example:
    >>> analytic_floor_fraction([1.0, 1.0, 1.0, 1.0], 2)
    0.6666666666666666
    """
    flops = [float(f) for f in module_flops]
    if not flops or any(f < 0 for f in flops) or sum(flops) <= 0:
        raise ValueError(f"`module_flops` must be non-negative with a positive sum. Received: {module_flops!r}")
    if not 0 <= k <= len(flops):
        raise ValueError(f"`k` must be in 0..{len(flops)}. Received: k={k!r}")
    total = sum(flops)
    return (total + 2.0 * sum(flops[k:])) / (3.0 * total)


def freezing_throughput(
    model: keras.Model,
    batch,
    *,
    steps: int = 20,
    warmup: int = 3,
    jit_compile: bool = True,
    verbose: int = 0,
) -> dict:
    """Times one training step with the first k modules frozen, k = 0..K.

    `model` must be compiled; its modules are found by `partition_modules`
    and K is the number of modules before the head. Each step is timed by
    `tf_hwopt.search.time_step` (XLA-compiled by default, compilation and
    warm-up excluded, weights restored), so timing trains nothing.

    Returns:
        `{"modules": [...], "rows": [{"k", "step_ms", "p10_ms", "p90_ms",
        "floor_fraction", "floor_ms", "measured_over_floor"}, ...]}`; the floor
        is `analytic_floor_fraction(k)` times the measured k=0 step.

    Example:
    >>> result = freezing_throughput(model, (x, y), steps=10)
    >>> [row["step_ms"] for row in result["rows"]]
    """
    modules = partition_modules(model)
    flops = [m.flops for m in modules]
    if any(f is None for f in flops):
        raise ValueError("FLOPs could not be counted for every module of this model.")
    engine = FreezingEngine(model, modules)
    rows = []
    try:
        for k in range(len(modules)):
            engine.freeze_prefix(k)
            timing = time_step(model, batch, steps=steps, warmup=warmup, jit_compile=jit_compile)
            rows.append({"k": k, "step_ms": timing.median_ms, "p10_ms": timing.p10_ms, "p90_ms": timing.p90_ms})
            if verbose:
                print(f"  k={k:2d} frozen: {timing.median_ms:8.2f} ms/step", flush=True)
    finally:
        engine.restore()
    base = rows[0]["step_ms"]
    for row in rows:
        row["floor_fraction"] = analytic_floor_fraction(flops, row["k"])
        row["floor_ms"] = base * row["floor_fraction"]
        row["measured_over_floor"] = row["step_ms"] / row["floor_ms"]
    return {
        "modules": [{"index": m.index, "name": m.name, "flops": m.flops} for m in modules],
        "rows": rows,
        "kind": timing.kind,
        "device": timing.device,
    }


def resnet20_throughput(profile: str = "full", *, seed: int = 0, verbose: int = 0) -> dict:
    """`freezing_throughput` of ResNet-20 on a synthetic CIFAR-shaped batch."""
    from tf_hwopt.models import resnet20

    batch_size, steps = (128, 15) if profile == "full" else (8, 3)
    keras.utils.set_random_seed(seed)
    model = resnet20()
    model.compile(
        optimizer=keras.optimizers.SGD(0.1, momentum=0.9),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    rng = np.random.default_rng(seed)
    batch = (
        rng.standard_normal((batch_size, 32, 32, 3)).astype("float32"),
        rng.integers(0, 10, batch_size).astype("int32"),
    )
    result = freezing_throughput(model, batch, steps=steps, warmup=2 if profile == "full" else 1, verbose=verbose)
    result.update({"model": "resnet20", "batch_size": batch_size, "input_shape": [32, 32, 3], "data": "synthetic"})
    return result
