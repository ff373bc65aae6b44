"""The freezing benchmark: Egeria against no freezing, FreezeOut and gradient-norm freezing.

For each workload, every strategy trains with the same seed (initial
weights and data order), the same learning-rate schedule and the same epoch
budget; the only difference is the freezing callback. Seeds are the outer
loop and strategies the inner one, so slow drift of a shared machine falls
on every strategy alike.

    tf-hwopt bench freezing --profile quick --json bench/freezing.json

The target of a workload is no-freeze's final metric (mean over seeds)
minus 0.5 accuracy points, or plus 1% for a loss. A run's time-to-target is
the wall time at the first epoch end where its validation metric reaches
the target.
"""

from __future__ import annotations

import math
import os
import time
from typing import Sequence

import numpy as np

from tf_hwopt._checks import check_positive_int
from tf_hwopt._io import printer, write_json_atomic
from tf_hwopt.bench.throughput import resnet20_throughput
from tf_hwopt.bench.workloads import DEFAULT_WORKLOADS, PROFILES, WORKLOADS, Workload
from tf_hwopt.bench.harness import EpochClock, compiled_model, train_timed
from tf_hwopt.training.cache import fit_with_cache
from tf_hwopt.egeria.callback import EgeriaCallback
from tf_hwopt.peers.freezeout import FreezeOutCallback
from tf_hwopt.peers.gradnorm import GradientNormFreezeCallback

STRATEGIES = {
    "no_freeze": lambda: None,
    # The peers as their papers run them: on their own schedule, without our
    # cost accounting (overhead_budget=None), which is Egeria's to prove.
    "freezeout": lambda: FreezeOutCallback(verbose=0, overhead_budget=None),
    "gradnorm": lambda: GradientNormFreezeCallback(verbose=0, overhead_budget=None),
    "egeria": lambda: EgeriaCallback(verbose=0),
    # Egeria with the opt-in level criterion (docs/egeria.md): a module whose
    # plasticity stays under 2% also counts as converged, as the geometrically
    # falling front blocks of a Transformer do.
    "egeria-level": lambda: EgeriaCallback(verbose=0, plasticity_level=0.02),
    # Egeria plus forward skipping (tf_hwopt.egeria.fit_with_cache, in-memory cache).
    "egeria+cache": lambda: EgeriaCallback(verbose=0),
}
CACHED_STRATEGIES = {"egeria+cache": "memory"}
DEFAULT_STRATEGIES = ("no_freeze", "freezeout", "gradnorm", "egeria", "egeria+cache")
# Forward skipping is measured end to end from scratch on the 1D ResNet and on
# both fine-tuning workloads (where the frozen prefix holds most of the FLOPs).
CACHE_WORKLOADS = ("mnist1d", "finetune-mnist1d", "finetune-charlm")
_ACCURACY_MARGIN = 0.005  # 0.5 points
_LOSS_MARGIN = 0.01  # 1%


# ------------------------------------------------------------ pure helpers


def target_metric(metric: str, baseline_finals: Sequence[float]) -> float:
    """The target: no-freeze's mean final metric, less 0.5 points or plus 1% loss.

    Example:
    >>> round(target_metric("accuracy", [0.98, 0.99]), 4)
    0.98
    >>> round(target_metric("loss", [2.0]), 4)
    2.02
    """
    mean = float(np.mean(baseline_finals))
    if metric == "accuracy":
        return mean - _ACCURACY_MARGIN
    if metric == "loss":
        return mean * (1.0 + _LOSS_MARGIN)
    raise ValueError(f"`metric` must be 'accuracy' or 'loss'. Received: metric={metric!r}")


def reaches(metric: str, value: float, target: float) -> bool:
    """Whether `value` meets `target` (higher accuracy, lower loss)."""
    if not math.isfinite(value):
        return False
    return value >= target if metric == "accuracy" else value <= target


def time_to_target(metric: str, wall: Sequence[float], curve: Sequence[float], target: float) -> float | None:
    """Wall time at the first epoch end whose metric reaches `target`, else None.

    Example:
    >>> time_to_target("accuracy", [10, 20, 30], [0.9, 0.97, 0.98], 0.965)
    20
    """
    for t, value in zip(wall, curve):
        if reaches(metric, value, target):
            return t
    return None


def _mean(values):
    values = [v for v in values if v is not None]
    return float(np.mean(values)) if values else None


def _std(values):
    values = [v for v in values if v is not None]
    return float(np.std(values, ddof=1)) if len(values) > 1 else 0.0


def idle_stalls(epoch_wall: Sequence[float], epoch_cpu: Sequence[float], min_seconds: float = 1.5) -> tuple:
    """Epochs that stood idle, and their idle seconds, from cumulative epoch-end times.

    A run's epochs after the first use a steady number of cores (CPU seconds
    per wall second) when nothing holds them up; the run's norm is the 90th
    percentile over those epochs (not the median: in one charlm-long run, 8
    of 11 epochs waited). An epoch whose wall time exceeds its CPU time at
    that norm by more than `min_seconds` stood idle for the excess. On
    Keras 3.15 / TensorFlow 2.21 this is how the release of the previous
    epoch's autotuned tf.data iterator shows up (docs/benchmarks.md):
    seconds of waiting with no CPU in use, at random epoch starts, in runs
    with and without freezing alike. In a freezing run it also counts the
    callback's own single-threaded seconds (a re-trace, the reference
    build), so the wall time less this idle time flatters a freezing
    strategy: it bounds its gain from above, as the raw wall time does from
    below.

    Returns:
        `(epochs, seconds)`.

    Example:
    >>> idle_stalls([12, 22, 42, 52], [18, 34, 50, 66])  # epoch 3 waited 10 s
    (1, 10.0)
    """
    wall = np.diff(np.asarray(epoch_wall, np.float64))
    cpu = np.diff(np.asarray(epoch_cpu, np.float64))
    if len(wall) == 0 or np.any(wall <= 0):
        return 0, 0.0
    cores = float(np.percentile(cpu / wall, 90))
    if cores <= 0:
        return 0, 0.0
    idle = wall - cpu / cores
    stalled = idle > min_seconds
    return int(stalled.sum()), float(np.round(idle[stalled].sum(), 6))


def summarise_strategy(metric: str, runs: Sequence[dict], target: float) -> dict:
    """Mean (and spread) over seeds of one strategy's runs.

    `time_to_target_s` is the mean over seeds, or None when any seed never
    reaches the target (a strategy is not credited with a time it does not
    always achieve); `reached` says in how many seeds it did.
    """
    ttt = [time_to_target(metric, r["epoch_wall_s"], r["epoch_metric"], target) for r in runs]
    for run, t in zip(runs, ttt):
        run["time_to_target_s"] = t
        run["stalled_epochs"], run["idle_stall_s"] = idle_stalls(run["epoch_wall_s"], run["epoch_cpu_s"])
    finals = [r["final_metric"] for r in runs]
    walls = [r["wall_time_s"] for r in runs]
    return {
        "final_metric": _mean(finals),
        "final_metric_std": _std(finals),
        "wall_time_s": _mean(walls),
        "wall_time_s_std": _std(walls),
        "cpu_time_s": _mean([r["cpu_time_s"] for r in runs]),
        "stalled_epochs": sum(r["stalled_epochs"] for r in runs),
        "idle_stall_s": _mean([r["idle_stall_s"] for r in runs]),
        "wall_without_stalls_s": _mean([r["wall_time_s"] - r["idle_stall_s"] for r in runs]),
        "time_to_target_s": None if any(t is None for t in ttt) else _mean(ttt),
        "time_to_target_s_std": None if any(t is None for t in ttt) else _std(ttt),
        "reached": sum(t is not None for t in ttt),
        "frozen_modules": _mean([r["frozen_modules"] for r in runs]),
        "overhead_fraction": _mean([r["overhead_fraction"] for r in runs]),
        "backward_flops_skipped_fraction": _mean([r["backward_flops_skipped_fraction"] for r in runs]),
        "seeds": list(runs),
    }


def add_speedups(strategies: dict) -> None:
    """Adds speedups against `no_freeze` (time-to-target, wall, CPU, wall without idle stalls) in place."""
    base = strategies.get("no_freeze")
    if base is None:
        return
    for result in strategies.values():
        for key, out in (
            ("time_to_target_s", "speedup_time_to_target"),
            ("wall_time_s", "speedup_wall"),
            ("cpu_time_s", "speedup_cpu"),
            ("wall_without_stalls_s", "speedup_wall_without_stalls"),
        ):
            mine, theirs = result.get(key), base.get(key)
            result[out] = theirs / mine if mine and theirs else None


# ------------------------------------------------------------------ runs


def run_order(strategies: Sequence[str], seed: int) -> list[str]:
    """The order the strategies run in for `seed`: rotated by one place per seed.

    This host's speed drifts over minutes (the same no-freezing run, repeated
    back to back: 36.7, 38.7, 39.5 s wall). Run always in the same order, the
    later strategies pay for the drift; rotated, each strategy runs at each
    position once in `len(strategies)` seeds, and a steady drift cancels out
    of the means.

    Example:
    >>> [run_order(["no_freeze", "egeria", "egeria+cache"], seed) for seed in range(3)]
    [['no_freeze', 'egeria', 'egeria+cache'], ['egeria', 'egeria+cache', 'no_freeze'], ['egeria+cache', 'no_freeze', 'egeria']]
    """
    shift = seed % len(strategies) if strategies else 0
    return list(strategies[shift:]) + list(strategies[:shift])


def _run(workload: Workload, strategy: str, seed: int, verbose: int) -> dict:
    callback = STRATEGIES[strategy]()
    started = time.perf_counter()
    recipe = dict(epochs=workload.epochs, batch_size=workload.batch_size, loss=workload.loss,
                  metrics=workload.keras_metrics, learning_rate=workload.learning_rate, seed=seed)
    cache_report = None
    if strategy in CACHED_STRATEGIES:
        (x, y), validation = workload.data
        model = compiled_model(workload.build_model, len(y), **recipe)
        clock = EpochClock()
        result = fit_with_cache(model, x, y, epochs=workload.epochs, batch_size=workload.batch_size,
                                freezer=callback, cache=CACHED_STRATEGIES[strategy], validation_data=validation,
                                callbacks=[clock], seed=seed, verbose=0)
        cache_report = {"phases": result["phases"], **result["cache"]}
    else:
        _, clock = train_timed(workload.build_model, workload.data, callbacks=[callback] if callback else [], **recipe)
    curve = workload.metric_curve(clock)
    summary = callback.summary() if callback else None
    steps_per_epoch = int(math.ceil(len(workload.data[0][1]) / workload.batch_size))
    run = {
        "seed": seed,
        "epoch_wall_s": clock.wall,
        "epoch_cpu_s": clock.cpu,
        "epoch_metric": curve,
        "final_metric": curve[-1],
        "wall_time_s": clock.wall[-1],
        "cpu_time_s": clock.cpu[-1],
        "frozen_modules": summary["frozen_modules"] if summary else 0,
        "num_modules": summary["num_modules"] if summary else None,
        "overhead_fraction": summary["overhead_fraction"] if summary else 0.0,
        "backward_flops_skipped_fraction": summary["backward_flops_skipped_fraction"] if summary else 0.0,
        "freeze_events": [
            {
                "kind": e["kind"],
                "module": e["module"],
                "epoch": e["epoch"],
                "step": e["step"],
                "wall_s": _event_wall(e["step"], steps_per_epoch, clock.wall),
                **({"decided_step": e["decided_step"]} if "decided_step" in e else {}),
            }
            for e in (summary["events"] if summary else [])
        ],
    }
    # Egeria's plasticity curves and reference path: the "why" behind its freeze times.
    if summary and "reference_path" in summary:
        run["reference_path"] = summary["reference_path"]
    if getattr(callback, "history", None):
        run["history"] = callback.history
    if summary and summary.get("status") != "not started":
        # What the freezes cost and why evaluation ended: the "why" behind the wall-time ratio.
        for key in ("train_function_rebuilds", "rebuild_seconds", "held_modules", "saving_scale", "evaluation_stopped",
                    "overhead_seconds", "evaluations", "evaluation_seconds", "reference_build_seconds",
                    "reference_seconds", "reference_covered_modules"):
            run[key] = summary.get(key)
    if cache_report is not None:
        run["cache"] = cache_report
    if verbose:
        print(
            f"  {strategy:<10} seed {seed}: {workload.unit} {curve[-1]:.4f}, {clock.wall[-1]:.1f} s wall, "
            f"{clock.cpu[-1]:.1f} s CPU, {run['frozen_modules']} frozen "
            f"({time.perf_counter() - started:.0f} s)",
            flush=True,
        )
    return run


def _event_wall(step: int, steps_per_epoch: int, wall: Sequence[float]) -> float:
    """Wall time of a step, interpolated within its epoch (for plot markers)."""
    epoch_ends = [0.0] + list(wall)
    position = step / steps_per_epoch
    return float(np.interp(position, np.arange(len(epoch_ends)), epoch_ends))


def _check_arguments(profile, seeds, workloads, strategies):
    if profile not in PROFILES:
        raise ValueError(f"`profile` must be one of {PROFILES}. Received: profile={profile!r}")
    check_positive_int("seeds", seeds)
    for name, given, known in (("workloads", workloads, WORKLOADS), ("strategies", strategies, STRATEGIES)):
        unknown = [w for w in given if w not in known]
        if unknown or not given:
            raise ValueError(f"`{name}` must be a non-empty subset of {sorted(known)}. Received: {name}={list(given)!r}")
    if "no_freeze" not in strategies:
        raise ValueError("`strategies` must include 'no_freeze': the target and speedups are measured against it.")


def run_freezing_benchmark(
    profile: str = "quick",
    *,
    seeds: int | None = None,
    workloads: Sequence[str] = DEFAULT_WORKLOADS,
    strategies: Sequence[str] = DEFAULT_STRATEGIES,
    throughput: bool = True,
    json_path: str | None = None,
    out_dir: str | None = None,
    verbose: int = 1,
) -> dict:
    """Runs the freezing benchmark; writes JSON, a markdown table and plots.

    Args:
        profile: `"quick"` (a smoke run of a few minutes, one seed, small
            data) or `"full"` (the documented run, 3 seeds).
        seeds: number of seeds (default: 1 for quick, 3 for full).
        workloads: names from `WORKLOADS` (default: `DEFAULT_WORKLOADS`,
            all but `charlm-long`).
        strategies: names from `STRATEGIES`; must include `"no_freeze"`
            (default: `DEFAULT_STRATEGIES`, all but `"egeria-level"`).
        throughput: also run the ResNet-20 step-time measurement.
        json_path: where to write the results.
        out_dir: where the markdown table and plots go (default: next to
            `json_path`, or nothing when neither is given).

    Returns:
        `{"profile", "seeds", "workloads": {name: {"metric", "target",
        "strategies": {name: {"final_metric", "wall_time_s",
        "time_to_target_s", "frozen_modules", "overhead_fraction", ...}}}},
        "throughput": {...}}`.

    Example:
    >>> results = run_freezing_benchmark("quick", json_path="bench/freezing.json")
    >>> results["workloads"]["mnist1d"]["strategies"]["egeria"]["speedup_time_to_target"]
    """
    seeds = (1 if profile == "quick" else 3) if seeds is None else seeds
    workloads, strategies = list(workloads), list(strategies)
    _check_arguments(profile, seeds, workloads, strategies)
    if out_dir is None and json_path:
        out_dir = os.path.dirname(os.path.abspath(json_path))
    say = printer(verbose)
    started = time.perf_counter()
    results = {"profile": profile, "seeds": seeds, "workloads": {}}
    for name in workloads:
        workload = WORKLOADS[name](profile)
        say(f"[{name}] {workload.description}; {workload.epochs} epochs, batch {workload.batch_size}", flush=True)
        here = [s for s in strategies if s not in CACHED_STRATEGIES or name in CACHE_WORKLOADS]
        runs = {s: [] for s in here}
        for seed in range(seeds):
            for position, strategy in enumerate(run_order(here, seed)):
                runs[strategy].append({**_run(workload, strategy, seed, verbose), "run_position": position})
        results["workloads"][name] = {
            "metric": workload.metric,
            "unit": workload.unit,
            "description": workload.description,
            "epochs": workload.epochs,
            "batch_size": workload.batch_size,
            **_summarise_workload(workload.metric, runs),
        }
    if throughput:
        say("[resnet20-throughput] ResNet-20, synthetic 32x32x3 batch: step time with k modules frozen", flush=True)
        results["throughput"] = {"resnet20-throughput": resnet20_throughput(profile, verbose=verbose)}
    results["elapsed_s"] = time.perf_counter() - started
    _write_outputs(results, json_path, out_dir, say)
    return results


def report_freezing_benchmark(json_path: str, *, out_dir: str | None = None, verbose: int = 1) -> dict:
    """Summarises a recorded benchmark again and rewrites its JSON, table and plots; trains nothing.

    The per-seed records are kept as they are; the per-strategy summaries
    (and the measures added since the run, such as idle stalls) are computed
    from them again.

    Example:
    >>> results = report_freezing_benchmark("bench_results/freezing.json")
    """
    import json

    with open(json_path) as f:
        results = json.load(f)
    for w in results.get("workloads", {}).values():
        runs = {name: s["seeds"] for name, s in w["strategies"].items()}
        if "no_freeze" not in runs:
            raise ValueError(f"benchmark report: {json_path!r} has a workload without 'no_freeze' runs")
        w.update(_summarise_workload(w["metric"], runs))
    if out_dir is None:
        out_dir = os.path.dirname(os.path.abspath(json_path))
    _write_outputs(results, json_path, out_dir, printer(verbose))
    return results


def _summarise_workload(metric: str, runs: dict) -> dict:
    """The target (from no freezing's runs) and every strategy's summary with its speedups."""
    target = target_metric(metric, [r["final_metric"] for r in runs["no_freeze"]])
    summary = {s: summarise_strategy(metric, r, target) for s, r in runs.items()}
    add_speedups(summary)
    return {"target": target, "strategies": summary}


def _write_outputs(results: dict, json_path: str | None, out_dir: str | None, say) -> None:
    table = format_markdown(results)
    say(table)
    if json_path:
        write_json_atomic(results, json_path)
        say(f"JSON written to {json_path}")
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        # Named after the JSON (freezing_long.json -> freezing_long.md), so two runs can share a folder.
        stem = os.path.splitext(os.path.basename(json_path))[0] if json_path else "freezing"
        with open(os.path.join(out_dir, f"{stem}.md"), "w") as f:
            f.write(table + "\n")
        for name in results["workloads"]:
            path = os.path.join(out_dir, f"freezing_{name}.png")
            plot_workload(results, name, path)
            say(f"Plot written to {path}")


# ---------------------------------------------------------------- report


def _fmt(value, spec, missing="never"):
    return missing if value is None else format(value, spec)


def format_markdown(results: dict) -> str:
    """The results as markdown tables, one per workload plus the throughput table."""
    lines = []
    for name, w in results["workloads"].items():
        scale, unit = (100.0, "%") if w["metric"] == "accuracy" else (1.0, f" {w['unit']}")
        lines += [
            f"**{name}** ({w['description']}; {w['epochs']} epochs; seeds: {results['seeds']}); "
            f"target {scale * w['target']:.3f}{unit}",
            "",
            "| strategy | final metric | wall s | CPU s | time-to-target s | speedup (time-to-target) "
            "| speedup (wall) | speedup (CPU) | idle (epochs; s per run) | speedup (wall less idle) "
            "| frozen modules | overhead |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for s, r in w["strategies"].items():
            spread = f" ± {scale * r['final_metric_std']:.2f}" if results["seeds"] > 1 else ""
            reached = "" if r["reached"] == results["seeds"] else f" ({r['reached']}/{results['seeds']} seeds)"
            lines.append(
                f"| {s} | {scale * r['final_metric']:.2f}{spread}{unit} | {r['wall_time_s']:.1f} "
                f"| {r['cpu_time_s']:.1f} | {_fmt(r['time_to_target_s'], '.1f')}{reached} "
                f"| {_fmt(r['speedup_time_to_target'], '.2f', '-')}x | {_fmt(r['speedup_wall'], '.2f', '-')}x "
                f"| {_fmt(r.get('speedup_cpu'), '.2f', '-')}x "
                f"| {r.get('stalled_epochs', 0)}; {r.get('idle_stall_s') or 0.0:.1f} s "
                f"| {_fmt(r.get('speedup_wall_without_stalls'), '.2f', '-')}x "
                f"| {r['frozen_modules']:.1f} | {100 * r['overhead_fraction']:.1f}% |"
            )
        lines.append("")
    for name, t in results.get("throughput", {}).items():
        lines += [
            f"**{name}** ({t['model']}, {t['data']} batch of {t['batch_size']}, {t['kind']} on {t['device']})",
            "",
            "| k frozen | step ms | analytic floor ms | measured / floor |",
            "|---|---|---|---|",
        ]
        for row in t["rows"]:
            lines.append(
                f"| {row['k']} | {row['step_ms']:.2f} | {row['floor_ms']:.2f} | {row['measured_over_floor']:.2f} |"
            )
        lines.append("")
        if t.get("caching"):
            lines += [
                "Forward skipping: the suffix trained from the activation cache (fit_with_cache's pipeline) "
                "against the suffix alone on a batch in memory",
                "",
                "| k cached | cached step ms | suffix-alone step ms | ratio |",
                "|---|---|---|---|",
            ]
            for row in t["caching"]:
                lines.append(f"| {row['k']} | {row['cached_step_ms']:.2f} | {row['suffix_alone_step_ms']:.2f} "
                             f"| {row['ratio']:.3f} |")
            lines.append("")
    return "\n".join(lines)


def plot_workload(results: dict, name: str, path: str) -> None:
    """Metric against wall time, one line per strategy (first seed), freezes marked."""
    from tf_hwopt._plotting import pyplot

    plt = pyplot()

    w = results["workloads"][name]
    scale = 100.0 if w["metric"] == "accuracy" else 1.0
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=110)
    for strategy, r in w["strategies"].items():
        run = r["seeds"][0]
        wall = [0.0] + run["epoch_wall_s"]
        curve = [scale * v for v in run["epoch_metric"]]
        (line,) = ax.plot(run["epoch_wall_s"], curve, marker="o", markersize=3, label=strategy)
        freezes = [e["wall_s"] for e in run["freeze_events"] if e["kind"] == "freeze"]
        if freezes:
            ys = np.interp(freezes, wall[1:], curve)
            ax.scatter(freezes, ys, marker="x", s=40, color=line.get_color(), zorder=3)
    ax.axhline(scale * w["target"], color="grey", linestyle="--", linewidth=1, label="target")
    late = [scale * v for r in w["strategies"].values() for v in r["seeds"][0]["epoch_metric"][1:]]
    if late:
        lo, hi = min(late), max(late)
        pad = 0.1 * (hi - lo or 1.0)
        ax.set_ylim(lo - pad, hi + pad)
    ax.set_xlabel("wall-clock time (s)")
    ax.set_ylabel("validation accuracy (%)" if w["metric"] == "accuracy" else f"validation loss ({w['unit']})")
    ax.set_title(f"{name}: metric against time (x = a module freezes), seed 0")
    ax.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
