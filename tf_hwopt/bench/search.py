"""The search benchmark: latency-aware tuners against KerasTuner's own plus a post-hoc filter.

    tf-hwopt bench search --seeds 0,1,2 --json bench_results/search.json

One space (a 1D ResNet on MNIST-1D: width, depth, learning rate), one step
budget set so that at least half of the space is over it. For each seed and
each strategy (random search, Bayesian optimization, Hyperband):

- `<strategy>+filter`: KerasTuner's `RandomSearch` / `BayesianOptimization` /
  `Hyperband` trains every candidate; afterwards each trained model's step is
  timed (as a user would have to; counted in its wall time) and the best
  in-budget one is kept. Its wall time is W.
- `latency-aware <strategy>`: our tuner with the same seed, run until it has
  both made the baseline's number of trials and spent W: every candidate is
  timed first; over-budget ones are never trained.

Reported per strategy, mean and spread over seeds: the wall-time ratio at
equal trials (random, Bayesian), and the best in-budget objective at equal
wall time W (each search's best among the trials finished by W; "in budget"
judged for every search by the same grid of measured step times). Also: the
repeatability of `time_step` (coefficient of variation of repeated medians
on one model), how close its median is to a step of `model.fit`, and the
Spearman rank correlation between estimated (`cpu` profile, calibrated) and
measured step times over the grid.
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
from tf_hwopt.search.spaces import HardwareSpace
from tf_hwopt.search.timing import estimate_step, time_step
from tf_hwopt.search.tuner import LatencyAwareBayesianOptimization, LatencyAwareHyperband, LatencyAwareRandomSearch

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


STRATEGIES = {
    # name: (KerasTuner's tuner, ours, size argument)
    "random": (keras_tuner.RandomSearch, LatencyAwareRandomSearch, "max_trials"),
    "bayesian": (keras_tuner.BayesianOptimization, LatencyAwareBayesianOptimization, "max_trials"),
    "hyperband": (keras_tuner.Hyperband, LatencyAwareHyperband, "max_epochs"),
}
_UNBOUNDED = {"max_trials": 1000, "max_epochs": None}  # ours runs until the deadline


def _grid_timings(build, widths, max_blocks, batch, profile, steps, timing):
    rows = []
    for width in widths:
        for blocks in range(1, max_blocks + 1):
            model = _candidate(build, width, blocks)
            estimated = estimate_step(model, batch, profile)
            if timing == "measured":
                measured = time_step(model, batch, steps=steps)
                ms, cv = measured.median_ms, measured.cv
            else:  # deterministic: the roofline estimate stands in for the measurement
                ms, cv = estimated.median_ms, 0.0
            rows.append({"width": width, "blocks": blocks, "measured_ms": ms, "measured_cv": cv,
                         "estimated_ms": estimated.median_ms})
    return rows


def _recording(cls):
    """`cls` whose trials' end times are recorded, stopping once `stop(trials_ended)` says so."""

    class Recording(cls):
        def on_search_begin(self):
            super().on_search_begin()
            self.started, self.ended = time.perf_counter(), []

        def on_trial_end(self, trial):
            super().on_trial_end(trial)
            self.ended.append((time.perf_counter() - self.started, trial.trial_id))
            if getattr(self, "stop", None) and self.stop(self):
                self.oracle.max_trials = len(self.oracle.trials)  # KerasTuner creates no further trial

    Recording.__name__ = cls.__name__
    return Recording


def _key(values) -> tuple:
    return values.get("width"), values.get("blocks")


def _best_by(tuner, seconds: float, latency: dict, budget: float) -> dict | None:
    """The best trained, in-budget trial among those ended by `seconds` (latency judged from the grid)."""
    ended = {trial_id for t, trial_id in tuner.ended if t <= seconds}
    best = None
    for trial_id in ended:
        trial = tuner.oracle.trials[trial_id]
        if trial.status != "COMPLETED" or trial.score is None or latency[_key(trial.hyperparameters.values)] > budget:
            continue
        if best is None or trial.score > best["score"]:
            best = {"score": trial.score, "values": trial.hyperparameters.values,
                    "latency_ms": latency[_key(trial.hyperparameters.values)]}
    return best


def _post_hoc_filter_seconds(tuner, build, batch, steps, timing) -> tuple[float, int]:
    """Times every trained candidate as a user would after a stock search; returns (seconds, models timed)."""
    started, timed = time.perf_counter(), set()
    for trial in tuner.oracle.trials.values():
        key = _key(trial.hyperparameters.values)
        if trial.status == "COMPLETED" and key not in timed:
            model = build(trial.hyperparameters)
            time_step(model, batch, steps=steps) if timing == "measured" else estimate_step(model, batch, "cpu")
            timed.add(key)
    return time.perf_counter() - started, len(timed)


def _run_pair(strategy, seed, *, build, fit, size, budget, latency, batch, timing_steps, timing, workdir):
    stock_cls, ours_cls, size_name = STRATEGIES[strategy]
    stock = _recording(stock_cls)(build, objective="val_accuracy", seed=seed, directory=workdir,
                                  project_name=f"{strategy}_filter_{seed}", overwrite=True, **{size_name: size})
    stock.search(**fit)
    filter_s, filtered = _post_hoc_filter_seconds(stock, build, batch, timing_steps, timing)
    wall = stock.ended[-1][0] + filter_s
    trials = len(stock.oracle.trials)

    ours = _recording(ours_cls)(
        build, "val_accuracy", latency_budget_ms=budget, seed=seed, timing=timing, timing_steps=timing_steps,
        latency_increasing=["width", "blocks"], latency_independent=["learning_rate"],
        directory=workdir, project_name=f"{strategy}_ours_{seed}", overwrite=True,
        **({size_name: size, "hyperband_iterations": 100} if size_name == "max_epochs"
           else {size_name: _UNBOUNDED[size_name]}),
    )
    ours.stop = lambda t: len(t.oracle.trials) >= trials and time.perf_counter() - t.started >= wall
    ours.search(**fit)
    ours_at_equal_trials = ours.ended[min(trials, len(ours.ended)) - 1][0]
    rows = ours.trial_latencies()
    stock_trained = sum(t.status == "COMPLETED" for t in stock.oracle.trials.values())
    ours_by_wall = [trial_id for t, trial_id in ours.ended if t <= wall]
    return {
        "stock": {
            "wall_time_s": wall, "post_hoc_timing_s": filter_s, "models_timed_after_training": filtered,
            "trials": trials, "trained_trials": stock_trained,
            "best_in_budget": _best_by(stock, float("inf"), latency, budget),
        },
        "ours": {
            "wall_time_s_at_equal_trials": ours_at_equal_trials,
            "trials_by_equal_wall_time": len(ours_by_wall),
            "trained_by_equal_wall_time": sum(ours.oracle.trials[i].status == "COMPLETED" for i in ours_by_wall),
            "best_in_budget_at_equal_trials": _best_by(ours, ours_at_equal_trials, latency, budget),
            "best_in_budget_at_equal_wall_time": _best_by(ours, wall, latency, budget),
            "over_budget_trials": sum(bool(r["over_budget"]) for r in rows),
            "skipped_proposals": ours.oracle.skipped_proposals,
            "timed_candidates": ours.timed_candidates,
            "timing_s": ours.timing_seconds,
            "trained_over_budget": sum(r["trained"] and latency[_key(r["values"])] > budget for r in rows),
        },
        "wall_time_ratio_at_equal_trials": wall / ours_at_equal_trials,
    }


def _fit_step_ms(build, width, blocks, x, y, batch_size) -> float:
    """The median step of `model.fit` (callback clock), for comparing `time_step` with training."""
    stamps = []
    clock = keras.callbacks.LambdaCallback(on_train_batch_end=lambda batch, logs=None: stamps.append(time.perf_counter()))
    model = _candidate(build, width, blocks)
    model.jit_compile = True
    model.fit(x, y, batch_size=batch_size, epochs=1, shuffle=False, callbacks=[clock], verbose=0)
    return 1e3 * float(np.median(np.diff(stamps[5:])))


def timing_repeatability(build, width: int, blocks: int, data, batch_size: int, *, repeats: int = 8,
                         steps: int = 40) -> dict:
    """Times one candidate `repeats` times with `time_step`, and a step of `model.fit`.

    Returns:
        `{"repeat_medians_ms", "repeatability_cv", "repeat_spread_ms",
        "fit_step_ms", "time_step_over_fit_step"}` (the last: the median of
        the repeated medians over the fit step).
    """
    x, y = data
    batch = (x[:batch_size], y[:batch_size])
    model = _candidate(build, width, blocks)
    medians = [time_step(model, batch, steps=steps).median_ms for _ in range(repeats)]
    fit_ms = _fit_step_ms(build, width, blocks, np.tile(batch[0], (40, 1, 1)), np.tile(batch[1], 40), batch_size)
    return {
        "candidate": {"width": width, "blocks": blocks, "batch_size": batch_size},
        "repeat_medians_ms": medians,
        "repeatability_cv": coefficient_of_variation(medians),
        "repeat_spread_ms": [float(np.min(medians)), float(np.max(medians))],
        "fit_step_ms": fit_ms,
        "time_step_over_fit_step": float(np.median(medians)) / fit_ms,
    }


def format_timing_markdown(t: dict) -> str:
    """One line: `time_step`'s repeatability and its match with a `model.fit` step."""
    lo, hi = t["repeat_spread_ms"]
    return (f"time_step repeatability: CV {100 * t['repeatability_cv']:.1f}% over {len(t['repeat_medians_ms'])} "
            f"repeated medians ({lo:.2f}-{hi:.2f} ms); time_step / model.fit step = "
            f"{t['time_step_over_fit_step']:.2f}.")


def run_timing_benchmark(*, repeats: int = 8, steps: int = 40, samples: int = 10_000, batch_size: int = 128,
                         json_path: str | None = None, verbose: int = 1) -> dict:
    """The timing part of the search benchmark alone: repeatability and `time_step` vs `model.fit`.

    Example:
    >>> report = run_timing_benchmark(repeats=8, json_path="bench_results/timing.json")
    >>> report["repeatability_cv"], report["time_step_over_fit_step"]
    """
    check_positive_int("repeats", repeats)
    check_positive_int("samples", samples)
    say = printer(verbose)
    (x, y), _ = load_mnist1d(samples)
    started = time.perf_counter()
    report = timing_repeatability(make_build(), WIDTHS[len(WIDTHS) // 2], max(1, MAX_BLOCKS // 2), (x, y),
                                  batch_size, repeats=repeats, steps=steps)
    report["elapsed_s"] = time.perf_counter() - started
    say(format_timing_markdown(report))
    if json_path:
        write_json_atomic(report, json_path)
        say(f"JSON written to {json_path}")
    return report


def _spread(values) -> dict:
    values = [v for v in values if v is not None]
    if not values:
        return {"mean": None, "min": None, "max": None, "n": 0}
    return {"mean": float(np.mean(values)), "std": float(np.std(values)), "min": float(np.min(values)),
            "max": float(np.max(values)), "n": len(values)}


def run_search_benchmark(
    *,
    seeds: Sequence[int] = (0, 1, 2),
    strategies: Sequence[str] = tuple(STRATEGIES),
    max_trials: int = 8,
    max_epochs: int = 4,
    epochs: int = 2,
    samples: int = 10_000,
    batch_size: int = 128,
    timing_steps: int = 40,
    repeats: int = 8,
    budget_quantile: float = 0.4,
    widths: Sequence[int] = WIDTHS,
    max_blocks: int = MAX_BLOCKS,
    timing: str = "measured",
    json_path: str | None = None,
    directory: str | None = None,
    verbose: int = 1,
) -> dict:
    """Runs each strategy's stock search + filter and our latency-aware one, per seed; writes JSON.

    Args:
        seeds: one run of every strategy per seed.
        strategies: among `"random"`, `"bayesian"`, `"hyperband"`.
        max_trials: trials of the random and Bayesian baselines.
        max_epochs: Hyperband's `max_epochs` (baseline: one iteration).
        epochs, samples, batch_size: training of each trial (Hyperband sets epochs itself).
        timing_steps: timed steps per measurement; `repeats`: repeated
            measurements of one model for the repeatability figure.
        budget_quantile: the budget is this quantile of the measured step
            times over the (width, depth) grid, so a fraction
            `1 - budget_quantile` of the space is over it.
        widths, max_blocks: the space (and the timing grid).
        timing: `"measured"`, or `"estimated"` (roofline estimates stand in for
            every measurement: deterministic, for tests).
        directory: KerasTuner's working folder (default: a temporary one, removed).

    Returns:
        `{"budget_ms", "runs": {strategy: [per seed]}, "summary": {strategy: spreads}, "timing": {...}}`.
    """
    say = printer(verbose)
    for name, value in (("max_trials", max_trials), ("max_epochs", max_epochs), ("epochs", epochs),
                        ("samples", samples), ("repeats", repeats)):
        check_positive_int(name, value)
    if not 0.0 < budget_quantile < 0.5 + 1e-9:
        raise ValueError(f"`budget_quantile` must be in (0, 0.5]. Received: {budget_quantile!r}")
    unknown = [s for s in strategies if s not in STRATEGIES]
    if unknown or not strategies:
        raise ValueError(f"`strategies` must be among {tuple(STRATEGIES)}. Received: {list(strategies)!r}")
    if timing not in ("measured", "estimated"):
        raise ValueError(f"`timing` must be 'measured' or 'estimated'. Received: {timing!r}")
    if not seeds:
        raise ValueError("`seeds` must name at least one seed.")
    started = time.perf_counter()
    (x, y), (x_val, y_val) = load_mnist1d(samples)
    batch = (x[:batch_size], y[:batch_size])
    profile = load_profile("cpu", calibrate=True)

    build = make_build(widths, max_blocks)
    say(f"Timing the grid ({len(widths)} widths x {max_blocks} depths): {timing} and estimated...", flush=True)
    grid = _grid_timings(build, widths, max_blocks, batch, profile, timing_steps, timing)
    measured = [r["measured_ms"] for r in grid]
    latency = {(r["width"], r["blocks"]): r["measured_ms"] for r in grid}
    budget = float(np.quantile(measured, budget_quantile))
    over = sum(m > budget for m in measured) / len(measured)
    say(f"Budget {budget:.3g} ms/step: {100 * over:.0f}% of the grid is over it.", flush=True)

    timing_report = {"grid": grid, "candidates": len(grid),
                     "spearman_estimated_vs_measured": spearman([r["estimated_ms"] for r in grid], measured)}
    if timing == "measured":
        say(f"Repeatability: the same model timed {repeats} times; and a step of model.fit...", flush=True)
        timing_report.update(timing_repeatability(build, widths[len(widths) // 2], max(1, max_blocks // 2),
                                                  (x, y), batch_size, repeats=repeats, steps=timing_steps))

    workdir = directory or tempfile.mkdtemp(prefix="tf_hwopt_search_bench_")
    fit = dict(x=x, y=y, epochs=epochs, batch_size=batch_size, validation_data=(x_val, y_val), verbose=0)
    runs: dict[str, list] = {s: [] for s in strategies}
    try:
        for seed in seeds:
            for strategy in strategies:
                size = max_epochs if STRATEGIES[strategy][2] == "max_epochs" else max_trials
                run = _run_pair(strategy, seed, build=build, fit=fit, size=size, budget=budget, latency=latency,
                                batch=batch, timing_steps=timing_steps, timing=timing, workdir=workdir)
                run["seed"] = seed
                runs[strategy].append(run)
                say(f"  seed {seed} {strategy}: stock+filter {run['stock']['wall_time_s']:.0f} s, ours "
                    f"{run['ours']['wall_time_s_at_equal_trials']:.0f} s at equal trials", flush=True)
    finally:
        if directory is None:
            shutil.rmtree(workdir, ignore_errors=True)

    def score(best):
        return None if best is None else best["score"]

    summary = {}
    for strategy, per_seed in runs.items():
        summary[strategy] = {
            "wall_time_ratio_at_equal_trials": _spread([r["wall_time_ratio_at_equal_trials"] for r in per_seed]),
            "stock_best_in_budget": _spread([score(r["stock"]["best_in_budget"]) for r in per_seed]),
            "ours_best_in_budget_at_equal_trials": _spread(
                [score(r["ours"]["best_in_budget_at_equal_trials"]) for r in per_seed]),
            "ours_best_in_budget_at_equal_wall_time": _spread(
                [score(r["ours"]["best_in_budget_at_equal_wall_time"]) for r in per_seed]),
            "stock_trained_trials": _spread([r["stock"]["trained_trials"] for r in per_seed]),
            "ours_trained_by_equal_wall_time": _spread([r["ours"]["trained_by_equal_wall_time"] for r in per_seed]),
            "ours_trained_over_budget": sum(r["ours"]["trained_over_budget"] for r in per_seed),
        }
    results = {
        "space": {"widths": list(widths), "blocks": [1, max_blocks], "learning_rate": [5e-4, 5e-3]},
        "config": {"seeds": list(seeds), "strategies": list(strategies), "max_trials": max_trials,
                   "max_epochs": max_epochs, "epochs": epochs, "samples": samples, "batch_size": batch_size,
                   "timing": timing, "timing_steps": timing_steps},
        "budget_ms": budget,
        "grid_over_budget_fraction": over,
        "runs": runs,
        "summary": summary,
        "timing": timing_report,
        "elapsed_s": time.perf_counter() - started,
    }
    say(format_search_markdown(results))
    if json_path:
        write_json_atomic(results, json_path, default=str)
        say(f"JSON written to {json_path}")
    return results


def _pm(spread: dict, scale: float = 1.0, fmt: str = ".2f", unit: str = "") -> str:
    if not spread.get("n"):
        return "none"
    return (f"{scale * spread['mean']:{fmt}}{unit} ({scale * spread['min']:{fmt}}-{scale * spread['max']:{fmt}})")


def format_search_markdown(results: dict) -> str:
    """The search benchmark's table: means over seeds, (min-max) beside them."""
    config = results["config"]
    lines = [
        f"Budget {results['budget_ms']:.3g} ms/step (train step, batch {config['batch_size']}, {config['timing']} "
        f"on this host); {100 * results['grid_over_budget_fraction']:.0f}% of the (width, depth) grid is over it. "
        f"Seeds {config['seeds']}; random/Bayesian: {config['max_trials']} trials, Hyperband: "
        f"max_epochs={config['max_epochs']}. Mean (min-max) over seeds.",
        "",
        "| strategy | wall-time ratio, equal trials | best in-budget val acc: stock + filter | ours, equal trials "
        "| ours, equal wall time | trained: stock / ours in equal wall time |",
        "|---|---|---|---|---|---|",
    ]
    for strategy, s in results["summary"].items():
        ratio = "-" if strategy == "hyperband" else _pm(s["wall_time_ratio_at_equal_trials"], unit="x")
        equal_trials = ("-" if strategy == "hyperband"
                        else _pm(s["ours_best_in_budget_at_equal_trials"], 100, ".1f", "%"))
        lines.append(
            f"| {strategy} | {ratio} | {_pm(s['stock_best_in_budget'], 100, '.1f', '%')} | {equal_trials} "
            f"| {_pm(s['ours_best_in_budget_at_equal_wall_time'], 100, '.1f', '%')} "
            f"| {_pm(s['stock_trained_trials'], fmt='.1f')} / {_pm(s['ours_trained_by_equal_wall_time'], fmt='.1f')} |"
        )
    t = results["timing"]
    over_trained = sum(s["ours_trained_over_budget"] for s in results["summary"].values())
    lines += ["", f"Over-budget candidates trained by our tuners (judged by the grid): {over_trained}."]
    if "repeatability_cv" in t:
        lines.append(format_timing_markdown(t))
    lines.append(f"Spearman(estimated, measured) = {t['spearman_estimated_vs_measured']:.3f} over "
                 f"{t['candidates']} candidates.")
    return "\n".join(lines)
