"""Step time with the first k modules frozen, beside the analytic floor.

Mechanics only (synthetic data, no accuracy claim): how much of the
backward pass a frozen prefix actually saves per step, against what FLOP
counting says it could save.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

import keras
import tensorflow as tf

from tf_hwopt.freezing.engine import FreezingEngine
from tf_hwopt.freezing.modules import partition_modules
from tf_hwopt.search.timing import time_step


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
    ks=None,
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
        for k in range(len(modules)) if ks is None else sorted(set(ks) | {0}):
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


def _fit_step_ms(model, dataset, steps: int) -> float:
    """Seconds per step of `model.fit` on `dataset` (after a warm-up fit that traces)."""
    import time

    if model.train_function is None:
        model.fit(dataset, steps_per_epoch=2, epochs=1, verbose=0, shuffle=False)  # traces
    start = time.perf_counter()
    model.fit(dataset, steps_per_epoch=steps, epochs=1, verbose=0, shuffle=False)
    return 1e3 * (time.perf_counter() - start) / steps


def caching_throughput(model: keras.Model, x, y, *, batch_size: int, steps: int, ks=None, verbose: int = 0) -> list:
    """Step time of the suffix trained from the activation cache, against a suffix-alone model.

    For each k (default: every module before the head), the first k modules'
    outputs for `x` are cached (`ActivationCache`) and the suffix is trained
    by `model.fit` from the cache pipeline that `fit_with_cache` uses
    (gather by example id, prefetch). The comparison is the same suffix
    trained by `model.fit` on one batch already in memory: a model made of
    the suffix alone, with no cache behind it. Weights are restored after.

    Returns:
        Rows `{"k", "cached_step_ms", "suffix_alone_step_ms", "ratio"}`.
    """
    from tf_hwopt.training.cache import ActivationCache, cached_dataset, compile_like, cut_model

    modules = partition_modules(model)
    ks = list(range(1, len(modules) - 1 + 1)) if ks is None else list(ks)
    saved = [v.numpy() for v in model.variables]
    rows = []
    try:
        for k in ks:
            cache = ActivationCache(model, modules, x)
            cache.set_level(k)
            suffix = cut_model(model, modules, k, len(modules))
            compile_like(suffix, model)
            cached = cached_dataset(len(x), range(100), 0, batch_size, cache.gather, y).repeat()
            batch = (cache.lookup(np.arange(batch_size)), y[:batch_size])
            alone = tf.data.Dataset.from_tensors(batch).repeat()
            # Alternate the two, three times each, and keep the medians: a
            # shared machine's slow minute then falls on both.
            times = {"cached": [], "alone": []}
            for _ in range(3):
                times["cached"].append(_fit_step_ms(suffix, cached, steps))
                times["alone"].append(_fit_step_ms(suffix, alone, steps))
            row = {"k": k, "cached_step_ms": float(np.median(times["cached"])),
                   "suffix_alone_step_ms": float(np.median(times["alone"]))}
            row["ratio"] = row["cached_step_ms"] / row["suffix_alone_step_ms"]
            rows.append(row)
            cache.close()
            if verbose:
                print(f"  k={k:2d} cached: {row['cached_step_ms']:8.2f} ms/step, suffix alone "
                      f"{row['suffix_alone_step_ms']:8.2f} ms/step, ratio {row['ratio']:.3f}", flush=True)
    finally:
        for v, value in zip(model.variables, saved):
            v.assign(value)
    return rows


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
    # The quick profile (a smoke run) times three points of the curve; full times every k.
    quick_ks = None if profile == "full" else [0, 5, 10]
    result = freezing_throughput(model, batch, ks=quick_ks, steps=steps, warmup=2 if profile == "full" else 1,
                                 verbose=verbose)
    n = batch_size * (8 if profile == "full" else 2)
    x = rng.standard_normal((n, 32, 32, 3)).astype("float32")
    y = rng.integers(0, 10, n).astype("int32")
    if verbose:
        print("  with forward skipping (fit_with_cache's pipeline) against the suffix alone:", flush=True)
    last = len(result["modules"]) - 1
    ks = sorted(set(range(1, last + 1, 2)) | {last}) if profile == "full" else [last // 2]
    result["caching"] = caching_throughput(model, x, y, batch_size=batch_size, steps=2 * steps, ks=ks, verbose=verbose)
    result.update({"model": "resnet20", "batch_size": batch_size, "input_shape": [32, 32, 3], "data": "synthetic"})
    return result
