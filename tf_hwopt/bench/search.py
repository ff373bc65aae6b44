"""The search benchmark: latency-aware search against KerasTuner's own searches plus a filter.

    tf-hwopt bench search --json bench_results/search.json

One space (a 1D ResNet on MNIST-1D: width, depth, learning rate), one step
budget set so that at least half of the space is over it, one `max_trials`
for everyone:

- `latency_aware`: `LatencyAwareOracle` (Bayesian base, hard budget) in a
  `LatencyAwareTuner`: every candidate is timed first; over-budget ones are
  never trained.
- `random+filter` and `bayesian+filter`: KerasTuner's `RandomSearch` and
  `BayesianOptimization` train every candidate; afterwards each trained
  model's step is timed (as a user would have to) and the best in-budget one
  is kept.

Reported: best in-budget objective and total search wall time (timing
included). Also measured here: the repeatability of `time_step` (coefficient
of variation of repeated medians on one model) and the Spearman rank
correlation between estimated (`cpu` profile, calibrated) and measured step
times over a grid of candidates.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from typing import Sequence

import numpy as np

from tf_hwopt._checks import check_positive_int
from tf_hwopt._io import printer, write_json_atomic
import keras
import keras_tuner

from tf_hwopt.data import load_mnist1d
from tf_hwopt.hardware.profiles import load_profile
from tf_hwopt.models import resnet1d
from tf_hwopt.search.oracle import LatencyAwareOracle
from tf_hwopt.search.spaces import HardwareSpace
from tf_hwopt.search.timing import estimate_step, time_step
from tf_hwopt.search.tuner import LatencyAwareTuner

WIDTHS = (16, 32, 64, 128, 192, 256)
MAX_BLOCKS = 4


def spearman(a: Sequence[float], b: Sequence[float]) -> float:
    """Spearman rank correlation (ties get their average rank).

    Example:
    >>> spearman([1, 2, 3, 4], [10, 20, 30, 40])
    1.0
    >>> spearman([1, 2, 3], [3, 2, 1])
    -1.0
    """
    a, b = np.asarray(a, float), np.asarray(b, float)
    if a.shape != b.shape or a.ndim != 1 or len(a) < 2:
        raise ValueError("spearman needs two 1-D sequences of the same length >= 2.")

    def ranks(v):
        order = np.argsort(v, kind="stable")
        r = np.empty(len(v))
        r[order] = np.arange(len(v), dtype=float)
        for value in np.unique(v):  # average the ranks of ties
            tie = v == value
            r[tie] = r[tie].mean()
        return r

    ra, rb = ranks(a), ranks(b)
    ra, rb = ra - ra.mean(), rb - rb.mean()
    denominator = np.sqrt((ra * ra).sum() * (rb * rb).sum())
    return float((ra * rb).sum() / denominator) if denominator else 0.0


def coefficient_of_variation(values: Sequence[float]) -> float:
    """Standard deviation over mean (population).

    Example:
    >>> coefficient_of_variation([10.0, 10.0])
    0.0
    """
    values = np.asarray(values, float)
    return float(values.std() / values.mean())


def make_build(widths: Sequence[int] = WIDTHS, max_blocks: int = MAX_BLOCKS):
    """The benchmark's hypermodel: width (aligned to the cpu profile), depth, learning rate."""

    def build(hp) -> keras.Model:
        space = HardwareSpace(hp, "cpu")
        width = hp.Choice("width", [w for w in widths if w % space.profile.width_multiple == 0])
        blocks = hp.Int("blocks", 1, max_blocks)
        model = resnet1d(widths=(width,) * blocks, strides=(1,) * blocks, stem_width=width)
        model.compile(
            optimizer=keras.optimizers.Adam(hp.Float("learning_rate", 5e-4, 5e-3, sampling="log")),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
        return model

    return build


def _candidate(build, width, blocks, lr=1e-3):
    hp = keras_tuner.HyperParameters()
    hp.values.update({"width": width, "blocks": blocks, "learning_rate": lr})
    return build(hp)


def _grid_timings(build, widths, max_blocks, batch, profile, steps):
    rows = []
    for width in widths:
        for blocks in range(1, max_blocks + 1):
            model = _candidate(build, width, blocks)
            measured = time_step(model, batch, steps=steps)
            estimated = estimate_step(model, batch, profile)
            rows.append({"width": width, "blocks": blocks, "measured_ms": measured.median_ms,
                         "measured_cv": measured.cv, "estimated_ms": estimated.median_ms})
    return rows


def _post_hoc_best(tuner, build, batch, budget, steps, timing_cache):
    """Times every trained trial's model and keeps the best in-budget one."""
    best, timed = None, 0
    for trial in tuner.oracle.get_best_trials(len(tuner.oracle.trials)):
        if trial.status != "COMPLETED" or trial.score is None:
            continue
        key = (trial.hyperparameters.get("width"), trial.hyperparameters.get("blocks"))
        if key not in timing_cache:
            timing_cache[key] = time_step(build(trial.hyperparameters), batch, steps=steps).median_ms
            timed += 1
        if timing_cache[key] <= budget and (best is None or trial.score > best["score"]):
            best = {"score": trial.score, "values": trial.hyperparameters.values, "latency_ms": timing_cache[key]}
    return best, timed


def run_search_benchmark(
    *,
    max_trials: int = 10,
    epochs: int = 2,
    samples: int = 25_000,
    batch_size: int = 128,
    timing_steps: int = 20,
    budget_quantile: float = 0.4,
    widths: Sequence[int] = WIDTHS,
    max_blocks: int = MAX_BLOCKS,
    seed: int = 0,
    json_path: str | None = None,
    directory: str | None = None,
    verbose: int = 1,
) -> dict:
    """Runs the three searches at equal `max_trials` and the timing checks; writes JSON.

    Args:
        max_trials: trials per search (over-budget ones included).
        epochs, samples, batch_size: training of each trial.
        timing_steps: timed steps per measurement.
        budget_quantile: the budget is this quantile of the measured step
            times over the (width, depth) grid, so a fraction
            `1 - budget_quantile` of the space is over it.
        widths, max_blocks: the space (and the timing grid).
        directory: KerasTuner's working folder (default: a temporary one, removed).

    Returns:
        `{"budget_ms", "searches": {name: {"best_in_budget", "wall_time_s",
        "trained_trials", ...}}, "speedup_vs": {...}, "timing": {"cv", "spearman", ...}}`.
    """
    say = printer(verbose)
    for name, value in (("max_trials", max_trials), ("epochs", epochs), ("samples", samples)):
        check_positive_int(name, value)
    if not 0.0 < budget_quantile < 0.5 + 1e-9:
        raise ValueError(f"`budget_quantile` must be in (0, 0.5]. Received: {budget_quantile!r}")
    started = time.perf_counter()
    (x, y), (x_val, y_val) = load_mnist1d(samples)
    batch = (x[:batch_size], y[:batch_size])
    profile = load_profile("cpu", calibrate=True)

    build = make_build(widths, max_blocks)
    say(f"Timing the grid ({len(widths)} widths x {max_blocks} depths): measured and estimated...", flush=True)
    grid = _grid_timings(build, widths, max_blocks, batch, profile, timing_steps)
    measured = [r["measured_ms"] for r in grid]
    budget = float(np.quantile(measured, budget_quantile))
    over = sum(m > budget for m in measured) / len(measured)
    say(f"Budget {budget:.2f} ms/step: {100 * over:.0f}% of the grid is over it.", flush=True)

    say("Repeatability: the same model timed 5 times...", flush=True)
    repeat_model = _candidate(build, widths[len(widths) // 2], max(1, max_blocks // 2))
    repeats = [time_step(repeat_model, batch, steps=timing_steps).median_ms for _ in range(5)]

    workdir = directory or tempfile.mkdtemp(prefix="tf_hwopt_search_bench_")
    fit = dict(epochs=epochs, batch_size=batch_size, validation_data=(x_val, y_val), verbose=0)
    searches = {}
    try:
        # Ours.
        t0 = time.perf_counter()
        oracle = LatencyAwareOracle("val_accuracy", max_trials=max_trials, latency_budget_ms=budget,
                                    base="bayesian", seed=seed)
        tuner = LatencyAwareTuner(build, oracle=oracle, profile="cpu", timing_steps=timing_steps,
                                  directory=workdir, project_name="latency_aware", overwrite=True)
        tuner.search(x, y, **fit)
        rows = tuner.trial_latencies()
        in_budget = [r for r in rows if r["trained"] and r["latency_ms"] <= budget and r["score"] is not None]
        best = max(in_budget, key=lambda r: r["score"]) if in_budget else None
        searches["latency_aware"] = {
            "wall_time_s": time.perf_counter() - t0,
            "trials": len(rows),
            "trained_trials": sum(r["trained"] for r in rows),
            "over_budget_trials": sum(r["latency_ms"] is not None and r["latency_ms"] > budget for r in rows),
            "skipped_proposals": oracle.skipped_proposals,
            "timed_candidates": tuner.timed_candidates,
            "timing_s": tuner.timing_seconds,
            "best_in_budget": None if best is None else
            {"score": best["score"], "values": best["values"], "latency_ms": best["latency_ms"]},
        }
        say(f"  latency_aware: {searches['latency_aware']['wall_time_s']:.1f} s", flush=True)
        # KerasTuner's own, then a post-hoc latency filter.
        for name, cls in (("random+filter", keras_tuner.RandomSearch),
                          ("bayesian+filter", keras_tuner.BayesianOptimization)):
            t0 = time.perf_counter()
            baseline = cls(build, objective="val_accuracy", max_trials=max_trials, seed=seed,
                           directory=workdir, project_name=name.replace("+", "_"), overwrite=True)
            baseline.search(x, y, **fit)
            best, timed = _post_hoc_best(baseline, build, batch, budget, timing_steps, {})
            trials = list(baseline.oracle.trials.values())
            searches[name] = {
                "wall_time_s": time.perf_counter() - t0,
                "trials": len(trials),
                "trained_trials": sum(t.status == "COMPLETED" for t in trials),
                "timed_after_training": timed,
                "best_in_budget": best,
            }
            say(f"  {name}: {searches[name]['wall_time_s']:.1f} s", flush=True)
    finally:
        if directory is None:
            shutil.rmtree(workdir, ignore_errors=True)

    ours = searches["latency_aware"]
    results = {
        "space": {"widths": list(widths), "blocks": [1, max_blocks], "learning_rate": [5e-4, 5e-3]},
        "config": {"max_trials": max_trials, "epochs": epochs, "samples": samples, "batch_size": batch_size,
                   "seed": seed},
        "budget_ms": budget,
        "grid_over_budget_fraction": over,
        "searches": searches,
        "speedup_vs": {name: s["wall_time_s"] / ours["wall_time_s"] for name, s in searches.items()
                       if name != "latency_aware"},
        "timing": {
            "repeat_medians_ms": repeats,
            "repeatability_cv": coefficient_of_variation(repeats),
            "grid": grid,
            "spearman_estimated_vs_measured": spearman([r["estimated_ms"] for r in grid], measured),
            "candidates": len(grid),
        },
        "elapsed_s": time.perf_counter() - started,
    }
    say(format_search_markdown(results))
    if json_path:
        write_json_atomic(results, json_path, default=str)
        say(f"JSON written to {json_path}")
    return results


def format_search_markdown(results: dict) -> str:
    """The search benchmark's table."""
    lines = [
        f"Budget {results['budget_ms']:.2f} ms/step (train step, batch {results['config']['batch_size']}, "
        f"measured on this CPU); {100 * results['grid_over_budget_fraction']:.0f}% of the (width, depth) grid "
        f"is over it; max_trials={results['config']['max_trials']} for every search.",
        "",
        "| search | best in-budget val accuracy | search wall s | trained trials | our speedup |",
        "|---|---|---|---|---|",
    ]
    for name, s in results["searches"].items():
        best = s["best_in_budget"]
        score = "none" if best is None else f"{100 * best['score']:.2f}%"
        speedup = "-" if name == "latency_aware" else f"{results['speedup_vs'][name]:.2f}x"
        lines.append(f"| {name} | {score} | {s['wall_time_s']:.1f} | {s['trained_trials']}/{s['trials']} | {speedup} |")
    ours = results["searches"].get("latency_aware", {})
    t = results["timing"]
    lines += [
        "",
        f"latency_aware timed {ours.get('timed_candidates', '?')} candidates in {ours.get('timing_s', float('nan')):.1f} s "
        "(XLA compilation included) of its search wall time.",
        f"time_step repeatability: CV {100 * t['repeatability_cv']:.1f}% over 5 repeated medians; "
        f"Spearman(estimated, measured) = {t['spearman_estimated_vs_measured']:.3f} over {t['candidates']} candidates.",
    ]
    return "\n".join(lines)
