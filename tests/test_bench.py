"""The freezing benchmark: its arithmetic, its argument checks, and the quick profile end to end."""

import json
import math

import numpy as np
import pytest

from tf_hwopt.bench.freezing import (
    add_speedups,
    idle_stalls,
    reaches,
    report_freezing_benchmark,
    run_freezing_benchmark,
    run_order,
    summarise_strategy,
    target_metric,
    time_to_target,
)
from tf_hwopt.bench.throughput import analytic_floor_fraction
from tf_hwopt.cli import main
from tf_hwopt.data import encode_chars, load_digits_images, load_stdlib_chars


def test_target_is_half_a_point_below_accuracy_or_one_percent_above_loss():
    assert target_metric("accuracy", [0.97, 0.99]) == pytest.approx(0.975)
    assert target_metric("loss", [2.0, 2.2]) == pytest.approx(2.121)
    with pytest.raises(ValueError, match="metric"):
        target_metric("f1", [0.5])


def test_time_to_target_is_the_first_epoch_end_reaching_it():
    wall = [10.0, 20.0, 30.0, 40.0]
    assert time_to_target("accuracy", wall, [0.5, 0.96, 0.95, 0.97], 0.955) == 20.0
    assert time_to_target("accuracy", wall, [0.5, 0.6, 0.7, 0.8], 0.955) is None
    assert time_to_target("loss", wall, [3.0, 2.5, 2.0, 1.9], 2.02) == 30.0
    assert not reaches("loss", math.nan, 2.0)


def _run(seed, wall, curve, cpu=None):
    cpu = [2 * w for w in wall] if cpu is None else cpu
    return {"seed": seed, "epoch_wall_s": wall, "epoch_cpu_s": cpu, "epoch_metric": curve, "final_metric": curve[-1],
            "wall_time_s": wall[-1], "cpu_time_s": cpu[-1], "frozen_modules": 2,
            "overhead_fraction": 0.05, "backward_flops_skipped_fraction": 0.3, "freeze_events": []}


def test_idle_stalls_are_epochs_waiting_beyond_the_runs_usual_core_use():
    # Epochs of 10 s at 1.6 cores; the third waited 10 s more with no CPU in use.
    assert idle_stalls([12, 22, 42, 52], [18, 34, 50, 66]) == (1, pytest.approx(10.0))
    # A slower host (fewer cores for the whole run) is no stall; nor is a 1 s bump.
    assert idle_stalls([20, 40, 60, 80], [16, 32, 48, 64]) == (0, 0.0)
    assert idle_stalls([12, 22, 33, 43], [18, 34, 50, 66]) == (0, 0.0)
    assert idle_stalls([5.0], [8.0]) == (0, 0.0)  # one epoch: nothing to compare with


def test_wall_without_stalls_is_summarised_and_compared():
    base = summarise_strategy("accuracy", [_run(0, [12, 22, 42, 52], [0.9, 0.95, 0.96, 0.97], [18, 34, 50, 66])], 0.9)
    mine = summarise_strategy("accuracy", [_run(0, [12, 20, 28, 36], [0.9, 0.95, 0.96, 0.97], [18, 30, 42, 54])], 0.9)
    assert base["stalled_epochs"] == 1 and base["wall_without_stalls_s"] == pytest.approx(42.0)
    assert mine["stalled_epochs"] == 0 and mine["wall_without_stalls_s"] == pytest.approx(36.0)
    strategies = {"no_freeze": base, "egeria": mine}
    add_speedups(strategies)
    assert strategies["egeria"]["speedup_wall"] == pytest.approx(52 / 36)
    assert strategies["egeria"]["speedup_wall_without_stalls"] == pytest.approx(42 / 36)


def test_report_only_summarises_recorded_runs_again_without_training(tmp_path):
    runs = {"no_freeze": [_run(0, [12, 22, 42, 52], [0.9, 0.95, 0.96, 0.97], [18, 34, 50, 66])],
            "egeria": [_run(0, [12, 20, 28, 36], [0.9, 0.94, 0.96, 0.965], [18, 30, 42, 54])]}
    recorded = {"profile": "full", "seeds": 1, "workloads": {"mnist1d": {
        "metric": "accuracy", "unit": "accuracy", "description": "d", "epochs": 4, "batch_size": 8,
        "target": 0.5, "strategies": {s: {"seeds": r} for s, r in runs.items()}}}}
    path = tmp_path / "freezing_long.json"
    path.write_text(json.dumps(recorded))
    assert main(["bench", "freezing", "--report-only", "--json", str(path)]) == 0
    w = json.loads(path.read_text())["workloads"]["mnist1d"]
    assert w["target"] == pytest.approx(0.965)  # from no freezing's runs, not the stale value
    egeria = w["strategies"]["egeria"]
    assert egeria["seeds"][0]["epoch_wall_s"] == [12, 20, 28, 36]  # the records are kept
    assert egeria["time_to_target_s"] == pytest.approx(36.0) and egeria["speedup_cpu"] == pytest.approx(66 / 54)
    table = (tmp_path / "freezing_long.md").read_text()  # named after the JSON
    assert "| egeria |" in table and "| 1; 10.0 s |" in table
    with pytest.raises(SystemExit):
        main(["bench", "freezing", "--report-only", "--json", str(tmp_path / "missing.json")])


def test_summary_over_seeds_credits_a_time_only_when_every_seed_reaches_the_target():
    runs = [_run(0, [1, 2, 3], [0.5, 0.9, 0.95]), _run(1, [1, 2, 4], [0.5, 0.92, 0.96])]
    s = summarise_strategy("accuracy", runs, 0.91)
    assert s["time_to_target_s"] == pytest.approx(2.5)  # at 3 s and at 2 s
    assert s["final_metric"] == pytest.approx(0.955)
    assert s["final_metric_std"] == pytest.approx(np.std([0.95, 0.96], ddof=1))
    assert s["reached"] == 2 and [r["time_to_target_s"] for r in s["seeds"]] == [3, 2]
    slow = summarise_strategy("accuracy", [_run(0, [1, 2, 3], [0.5, 0.9, 0.95]),
                                           _run(1, [1, 2, 3], [0.5, 0.8, 0.9])], 0.91)
    assert slow["time_to_target_s"] is None and slow["reached"] == 1


def test_speedups_are_against_no_freeze():
    strategies = {"no_freeze": {"time_to_target_s": 30.0, "wall_time_s": 40.0, "cpu_time_s": 80.0},
                  "egeria": {"time_to_target_s": 20.0, "wall_time_s": 32.0, "cpu_time_s": 60.0},
                  "slow": {"time_to_target_s": None, "wall_time_s": 50.0, "cpu_time_s": 90.0}}
    add_speedups(strategies)
    assert strategies["egeria"]["speedup_time_to_target"] == pytest.approx(1.5)
    assert strategies["egeria"]["speedup_wall"] == pytest.approx(1.25)
    assert strategies["slow"]["speedup_time_to_target"] is None
    assert strategies["no_freeze"]["speedup_cpu"] == pytest.approx(1.0)


def test_analytic_floor():
    flops = [1.0, 3.0, 4.0, 2.0]
    assert analytic_floor_fraction(flops, 0) == pytest.approx(1.0)
    # Everything frozen but nothing skipped in the forward: one third.
    assert analytic_floor_fraction(flops, 4) == pytest.approx(1 / 3)
    assert analytic_floor_fraction(flops, 2) == pytest.approx((10 + 2 * 6) / 30)
    for bad in ({"module_flops": [], "k": 0}, {"module_flops": [1.0], "k": 2}, {"module_flops": [-1.0, 2.0], "k": 0}):
        with pytest.raises(ValueError):
            analytic_floor_fraction(**bad)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"profile": "huge"}, "profile"),
        ({"seeds": 0}, "seeds"),
        ({"workloads": ["imagenet"]}, "workloads"),
        ({"strategies": ["egeria"]}, "no_freeze"),
        ({"strategies": ["no_freeze", "magic"]}, "strategies"),
    ],
)
def test_bad_arguments_are_refused_before_any_training(kwargs, match):
    kwargs = {"profile": "quick", **kwargs}
    with pytest.raises(ValueError, match=match):
        run_freezing_benchmark(kwargs.pop("profile"), verbose=0, **kwargs)


def test_stdlib_character_data_is_shifted_by_one_and_held_out_by_file():
    (x, y), (x_val, y_val) = load_stdlib_chars(32, max_train_chars=20_000, max_val_chars=5_000)
    assert x.shape[1] == 32 and x.dtype == np.int32 and len(x) == (20_000 - 1) // 32
    np.testing.assert_array_equal(x[:, 1:], y[:, :-1])
    np.testing.assert_array_equal(x[1:, 0], y[:-1, -1])  # windows are contiguous
    assert x.max() < 128 and x_val.max() < 128
    # Validation text comes from other files than the training text.
    assert not any(np.array_equal(x_val[0], row) for row in x)
    assert encode_chars("a\u00e9\n").tolist() == [97, 0, 10]
    with pytest.raises(ValueError, match="seq_len"):
        load_stdlib_chars(1)


def test_digits_images_are_the_real_digits_enlarged_and_split_without_overlap():
    from sklearn.datasets import load_digits

    (x, y), (x_test, y_test) = load_digits_images(16)
    digits = load_digits()
    assert x.shape == (1438, 16, 16, 3) and x_test.shape == (359, 16, 16, 3) and x.dtype == np.float32
    assert y.dtype == np.int32 and set(np.unique(y)) == set(range(10))
    assert 0.0 <= x.min() and x.max() == 1.0
    # Each pixel is repeated 2x2 and over the channels: shrinking gives a digit back.
    small = x[:, ::2, ::2, 0] * 16
    np.testing.assert_array_equal(x[:, 1::2, 1::2, 2] * 16, small)
    row = next(i for i, image in enumerate(digits.images) if np.array_equal(image, small[0]))
    assert digits.target[row] == y[0]
    # Train and test are disjoint, and the split is the same each call.
    train_rows = {img.tobytes() for img in x[:, ::2, ::2, 0]}
    assert not any(img.tobytes() in train_rows for img in x_test[:, ::2, ::2, 0])  # no digit is there twice
    np.testing.assert_array_equal(load_digits_images(16)[1][1], y_test)
    with pytest.raises(ValueError, match="size"):
        load_digits_images(12)


def test_quick_profile_writes_complete_and_sane_json(tmp_path, capsys):
    out = tmp_path / "freezing.json"
    # The fine-tuning workloads' pretraining is tested in test_pretrained.py, gradient-norm freezing in
    # test_peers.py; here the two workloads from scratch and the other strategies.
    assert main(["bench", "freezing", "--profile", "quick", "--workloads", "mnist1d,charlm",
                 "--strategies", "no_freeze,freezeout,egeria,egeria+cache", "--json", str(out)]) == 0
    results = json.loads(out.read_text())
    assert set(results["workloads"]) == {"mnist1d", "charlm"}
    for name, w in results["workloads"].items():
        assert w["metric"] in ("accuracy", "loss")
        expected = {"no_freeze", "freezeout", "egeria"} | ({"egeria+cache"} if name == "mnist1d" else set())
        assert set(w["strategies"]) == expected
        base = w["strategies"]["no_freeze"]
        assert w["target"] == pytest.approx(target_metric(w["metric"], [base["final_metric"]]))
        # No-freeze reaches its own target, at the latest at its last epoch.
        assert base["time_to_target_s"] is not None and base["time_to_target_s"] <= base["wall_time_s"]
        for s, r in w["strategies"].items():
            for key in ("final_metric", "wall_time_s", "time_to_target_s", "frozen_modules", "overhead_fraction"):
                assert key in r, (name, s, key)
            assert math.isfinite(r["final_metric"])
            assert 0 < r["wall_time_s"] and 0.0 <= r["overhead_fraction"] < 1.0
            if w["metric"] == "accuracy":
                assert 0.0 <= r["final_metric"] <= 1.0
            else:
                assert 0.0 < r["final_metric"] < 8.0  # bits/char of a 128-symbol alphabet
            run = r["seeds"][0]
            assert run["run_position"] == run_order(list(w["strategies"]), 0).index(s)
            assert len(run["epoch_wall_s"]) == len(run["epoch_metric"]) == w["epochs"]
            assert np.all(np.diff(run["epoch_wall_s"]) > 0)
            assert r["frozen_modules"] == sum(e["kind"] == "freeze" for e in run["freeze_events"]) - sum(
                e["kind"] == "unfreeze" for e in run["freeze_events"])
        assert w["strategies"]["no_freeze"]["frozen_modules"] == 0
        # FreezeOut's schedule always freezes by the end of training.
        assert w["strategies"]["freezeout"]["frozen_modules"] > 0
    rows = results["throughput"]["resnet20-throughput"]["rows"]
    assert [r["k"] for r in rows] == [0, 5, 10]  # quick: three points; full: every k
    assert rows[0]["floor_ms"] == pytest.approx(rows[0]["step_ms"])
    assert all(r["step_ms"] > 0 for r in rows)
    floors = [r["floor_fraction"] for r in rows]
    assert all(a > b for a, b in zip(floors, floors[1:])) and floors[-1] > 1 / 3 - 1e-9
    caching = results["throughput"]["resnet20-throughput"]["caching"]
    assert [r["k"] for r in caching] == [5]
    assert all(r["cached_step_ms"] > 0 and r["ratio"] == pytest.approx(r["cached_step_ms"] / r["suffix_alone_step_ms"])
               for r in caching)
    cached_run = results["workloads"]["mnist1d"]["strategies"]["egeria+cache"]["seeds"][0]
    assert cached_run["cache"]["phases"][0]["first_epoch"] == 0
    assert (tmp_path / "freezing_mnist1d.png").read_bytes()[:4] == b"\x89PNG"
    assert "| egeria |" in (tmp_path / "freezing.md").read_text()


def test_spearman_and_cv():
    from tf_hwopt.bench.search import coefficient_of_variation, spearman

    assert spearman([1, 2, 3, 4], [1, 4, 9, 16]) == pytest.approx(1.0)  # monotone, not linear
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert spearman([1, 1, 2], [5, 5, 9]) == pytest.approx(1.0)  # ties
    assert coefficient_of_variation([9.0, 11.0]) == pytest.approx(0.1)
    with pytest.raises(ValueError):
        spearman([1], [1])


def test_search_benchmark_tiny_run_is_complete(tmp_path):
    """Estimated timing stands in for measurements: no verdict here depends on this host's speed."""
    from tf_hwopt.bench.search import format_search_markdown, run_search_benchmark

    out = tmp_path / "search.json"
    results = run_search_benchmark(seeds=(0,), strategies=("random", "hyperband"), max_trials=3, max_epochs=2,
                                   epochs=1, samples=1000, batch_size=32, timing_steps=3, widths=(16, 128),
                                   max_blocks=2, timing="estimated", json_path=str(out), verbose=0)
    saved = json.loads(out.read_text())
    assert saved["budget_ms"] == pytest.approx(results["budget_ms"])
    assert saved["grid_over_budget_fraction"] >= 0.5
    assert set(saved["runs"]) == set(saved["summary"]) == {"random", "hyperband"}  # Bayesian: as random
    for strategy, (run,) in saved["runs"].items():
        stock, ours = run["stock"], run["ours"]
        assert stock["wall_time_s"] > 0 and stock["models_timed_after_training"] == stock["trained_trials"] > 0
        assert ours["trained_over_budget"] == 0  # never trains an over-budget candidate
        for best in (stock["best_in_budget"], ours["best_in_budget_at_equal_wall_time"]):
            assert best is None or best["latency_ms"] <= saved["budget_ms"]
        if strategy != "hyperband":
            assert stock["trials"] == 3 and run["wall_time_ratio_at_equal_trials"] > 0
    assert len(saved["timing"]["grid"]) == 4 and saved["timing"]["spearman_estimated_vs_measured"] == 1.0
    assert "| hyperband |" in format_search_markdown(saved)


def test_timing_benchmark_writes_repeated_medians_and_the_fit_ratio(tmp_path, capsys):
    from tf_hwopt.bench.search import run_timing_benchmark

    path = tmp_path / "timing.json"
    run_timing_benchmark(repeats=3, steps=4, samples=600, batch_size=32, json_path=str(path))
    report = json.loads(path.read_text())
    medians = report["repeat_medians_ms"]
    assert len(medians) == 3 and all(m > 0 for m in medians)
    assert report["repeat_spread_ms"] == [min(medians), max(medians)]
    assert report["repeatability_cv"] >= 0 and report["fit_step_ms"] > 0
    assert math.isclose(report["time_step_over_fit_step"], float(np.median(medians)) / report["fit_step_ms"])
    assert "time_step repeatability: CV" in capsys.readouterr().out


def test_run_order_puts_every_strategy_at_every_position_once_per_cycle():
    strategies = ["no_freeze", "egeria", "egeria+cache"]
    orders = [run_order(strategies, seed) for seed in range(3)]
    assert all(sorted(order) == sorted(strategies) for order in orders)
    for position in range(3):
        assert sorted(order[position] for order in orders) == sorted(strategies)
    assert run_order(strategies, 3) == run_order(strategies, 0) == strategies
    assert run_order(["no_freeze"], 5) == ["no_freeze"]
