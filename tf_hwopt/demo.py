"""The demo: a 1D ResNet on MNIST-1D, trained without and with Egeria.

Both runs use the same seed (same initial weights), the same data order, the
same learning-rate schedule and the same number of epochs; the only
difference is `EgeriaCallback` in the callback list.

Two clocks are reported. Wall time is what a user waits. Process CPU time is
the compute actually spent; on a shared host, where the cores the training
gets vary from minute to minute, it is the steadier of the two, and the one
to read the saving from when wall-time ratios disagree between runs.
"""

from __future__ import annotations

import os

import keras

from tf_hwopt._io import printer, write_json_atomic
from tf_hwopt.bench.harness import train_timed
from tf_hwopt.data import load_mnist1d
from tf_hwopt.egeria.callback import EgeriaCallback
from tf_hwopt.models import resnet1d


def train_mnist1d(
    data,
    *,
    epochs: int,
    batch_size: int = 256,
    seed: int = 0,
    learning_rate: float = 2e-3,
    callbacks=(),
    model_kwargs=None,
    verbose: int = 0,
):
    """Trains the demo's ResNet on MNIST-1D; returns (model, clock, test accuracy)."""
    model, clock = train_timed(
        lambda: resnet1d(**(model_kwargs or {})),
        data,
        epochs=epochs,
        batch_size=batch_size,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
        learning_rate=learning_rate,
        seed=seed,
        callbacks=callbacks,
        verbose=verbose,
    )
    (_, _), (x_test, y_test) = data
    accuracy = float(model.evaluate(x_test, y_test, batch_size=1024, verbose=0)[1])
    return model, clock, accuracy


def run_demo(
    *,
    num_samples: int = 50_000,
    epochs: int = 10,
    batch_size: int = 256,
    seed: int = 0,
    plot_path: str | None = "egeria_demo.png",
    json_path: str | None = None,
    model_kwargs: dict | None = None,
    egeria_kwargs: dict | None = None,
    verbose: int = 1,
) -> dict:
    """Runs the demo, prints the comparison table, writes the plot and JSON.

    Example:
    >>> results = run_demo(epochs=10)
    >>> results["speedup_wall"]
    """
    say = printer(verbose)
    say(f"Regenerating MNIST-1D offline ({num_samples} examples)...", flush=True)
    data = load_mnist1d(num_samples)
    (x, _), (x_test, _) = data
    say(f"{len(x)} training / {len(x_test)} test examples; {epochs} epochs, batch {batch_size}.")
    runs = {}
    say("Training without freezing...", flush=True)
    _, clock, acc = train_mnist1d(
        data, epochs=epochs, batch_size=batch_size, seed=seed, model_kwargs=model_kwargs
    )
    runs["no_freezing"] = {"clock": clock, "accuracy": acc}
    say("Training with EgeriaCallback...", flush=True)
    egeria = EgeriaCallback(verbose=verbose, **(egeria_kwargs or {}))
    _, clock, acc = train_mnist1d(
        data, epochs=epochs, batch_size=batch_size, seed=seed, callbacks=[egeria], model_kwargs=model_kwargs
    )
    runs["egeria"] = {"clock": clock, "accuracy": acc}
    summary = egeria.summary()
    base, eg = runs["no_freezing"], runs["egeria"]
    results = {
        "config": {"num_samples": num_samples, "epochs": epochs, "batch_size": batch_size, "seed": seed},
        "runs": {
            name: {
                "wall_time_s": r["clock"].wall[-1],
                "cpu_time_s": r["clock"].cpu[-1],
                "test_accuracy": r["accuracy"],
                "epoch_wall_s": r["clock"].wall,
                "epoch_cpu_s": r["clock"].cpu,
                "epoch_val_accuracy": r["clock"].val_accuracy,
            }
            for name, r in runs.items()
        },
        "speedup_wall": base["clock"].wall[-1] / eg["clock"].wall[-1],
        "speedup_cpu": base["clock"].cpu[-1] / eg["clock"].cpu[-1],
        "accuracy_delta_points": 100.0 * (eg["accuracy"] - base["accuracy"]),
        "egeria": summary,
        "plasticity_history": egeria.history,
    }
    say(format_table(results))
    if plot_path:
        _plot(results, egeria, plot_path)
        say(f"Plot written to {plot_path}")
    if json_path:
        write_json_atomic(results, json_path)
        say(f"JSON written to {json_path}")
    return results


def format_table(results: dict) -> str:
    """The demo's comparison table as text."""
    eg = results["egeria"]
    freezes = ", ".join(
        f"{e['module']}@ep{e['epoch'] + 1}" for e in eg["events"] if e["kind"] == "freeze"
    ) or "none"
    rows = [
        f"{'':<14}{'wall s':>9}{'CPU s':>9}{'test acc':>10}  frozen modules (module@epoch)",
    ]
    for name, label in (("no_freezing", "no freezing"), ("egeria", "Egeria")):
        r = results["runs"][name]
        extra = f"{eg['frozen_modules']}/{eg['num_modules']}: {freezes}" if name == "egeria" else "-"
        rows.append(
            f"{label:<14}{r['wall_time_s']:>9.1f}{r['cpu_time_s']:>9.1f}{100 * r['test_accuracy']:>9.2f}%  {extra}"
        )
    rows.append(
        f"speedup: {results['speedup_wall']:.2f}x wall, {results['speedup_cpu']:.2f}x CPU; "
        f"accuracy change {results['accuracy_delta_points']:+.2f} points; backward FLOPs skipped "
        f"{100 * eg['backward_flops_skipped_fraction']:.0f}% (averaged over training); Egeria overhead "
        f"{100 * eg['overhead_fraction']:.1f}% of wall time (reference path: {eg['reference_path']})"
    )
    return "\n".join(rows)


def _plot(results, egeria, path):
    from tf_hwopt._plotting import pyplot

    plt = pyplot()

    from tf_hwopt.egeria.plot import draw_plasticity

    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.8), dpi=110)
    if egeria.history:
        draw_plasticity(left, egeria)
    else:
        left.text(0.5, 0.5, "no plasticity evaluation ran\n(training too short)", ha="center", transform=left.transAxes)
    for name, label in (("no_freezing", "no freezing"), ("egeria", "Egeria")):
        r = results["runs"][name]
        right.plot(r["epoch_wall_s"], [100 * a for a in r["epoch_val_accuracy"]], marker="o", label=label)
    late = [100 * a for r in results["runs"].values() for a in r["epoch_val_accuracy"][len(r["epoch_val_accuracy"]) // 3 :]]
    right.set_ylim(max(0.0, min(late) - 1.0) if late else 0.0, 100.0)
    right.set_xlabel("wall-clock time (s)")
    right.set_ylabel("test accuracy (%)")
    right.set_title(
        f"MNIST-1D 1D-ResNet: {results['speedup_wall']:.2f}x wall, {results['speedup_cpu']:.2f}x CPU"
    )
    right.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
