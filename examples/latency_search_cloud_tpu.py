"""Latency-aware hyperparameter search, locally or on Cloud TPU.

Searches a 1D ResNet on MNIST-1D (block width, depth, batch size, learning
rate; aligned to the hardware profile; random search, Bayesian optimization or
Hyperband) for the most accurate model whose training step fits a
time budget. Candidates are timed (XLA-compiled step) before training; those
over budget are never trained. The best in-budget model is exported as a
SavedModel at the end.

Locally, on this machine's CPU (measured step times):

    python examples/latency_search_cloud_tpu.py --profile cpu --budget-ms 40

For a TPU that is not here (estimated step times from the profile's roofline):

    python examples/latency_search_cloud_tpu.py --profile tpu-v5e --timing estimated --budget-ms 0.05

On a Cloud TPU VM (TPUStrategy through TPUClusterResolver, measured):

    python examples/latency_search_cloud_tpu.py --tpu my-tpu --profile tpu-v5e --budget-ms 2

With several machines, KerasTuner's distributed mode works unchanged: run the
same command on each, with `KERASTUNER_TUNER_ID` (`chief` on one, `tuner0`,
`tuner1`, ... on the others), `KERASTUNER_ORACLE_IP` and
`KERASTUNER_ORACLE_PORT` (the chief's address) in the environment, and a
`--directory` they share.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from tf_hwopt._quiet import import_tensorflow_quietly

import_tensorflow_quietly()

import keras  # noqa: E402

from tf_hwopt.data import load_mnist1d  # noqa: E402
from tf_hwopt.hardware.distribute import strategy_for  # noqa: E402
from tf_hwopt.hardware.profiles import load_profile  # noqa: E402
import keras_tuner  # noqa: E402
from tf_hwopt.search import (  # noqa: E402
    HardwareSpace,
    LatencyAwareBayesianOptimization,
    LatencyAwareHyperband,
    LatencyAwareRandomSearch,
    is_search_worker,
)


class ResNetSpace(keras_tuner.HyperModel):
    """A 1D ResNet whose space follows a hardware profile; the batch size is a hyperparameter of `fit`.

    The tuner times each candidate on the batch size its `fit` picks here, so
    no tuner subclass is needed for it.
    """

    def __init__(self, profile, max_width: int, max_blocks: int, max_batch: int):
        super().__init__()
        self.profile, self.max_width, self.max_blocks, self.max_batch = profile, max_width, max_blocks, max_batch

    def build(self, hp):
        from tf_hwopt.models import resnet1d

        space = HardwareSpace(hp, self.profile)
        width = space.width("width", 16, self.max_width)
        blocks = hp.Int("blocks", 1, self.max_blocks)
        keras.config.set_dtype_policy(space.dtype_policy())
        try:
            model = resnet1d(widths=(width,) * blocks, strides=(1,) * blocks, stem_width=width)
        finally:
            keras.config.set_dtype_policy("float32")
        model.compile(
            optimizer=keras.optimizers.Adam(hp.Float("learning_rate", 1e-3, 1e-2, sampling="log")),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
            steps_per_execution=space.steps_per_execution(),
        )
        return model

    def fit(self, hp, model, *args, **kwargs):
        batch_size = HardwareSpace(hp, self.profile).batch_size(32, self.max_batch)
        return model.fit(*args, batch_size=batch_size, **kwargs)


TUNERS = {
    "random": LatencyAwareRandomSearch,
    "bayesian": LatencyAwareBayesianOptimization,
    "hyperband": LatencyAwareHyperband,
}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default="cpu", help="hardware profile name or TOML path")
    parser.add_argument("--tpu", default=None, help="Cloud TPU name (TPUClusterResolver); '' for a TPU VM")
    parser.add_argument("--timing", choices=("measured", "estimated"), default="measured")
    parser.add_argument("--budget-ms", type=float, default=40.0, help="training step budget (ms)")
    parser.add_argument("--max-trials", type=int, default=10)
    parser.add_argument("--tuner", choices=tuple(TUNERS), default="bayesian")
    parser.add_argument("--epochs", type=int, default=3, help="epochs per trial (Hyperband: max_epochs)")
    parser.add_argument("--samples", type=int, default=10_000)
    parser.add_argument("--max-width", type=int, default=256)
    parser.add_argument("--max-blocks", type=int, default=4)
    parser.add_argument("--max-batch", type=int, default=256)
    parser.add_argument("--directory", default="latency_search")
    parser.add_argument("--project", default="mnist1d_resnet")
    parser.add_argument("--overwrite", action="store_true", help="start over instead of resuming")
    parser.add_argument("--export", default="best_model", help="SavedModel path for the best model ('' for none)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    profile = load_profile(args.profile)
    # Measured timing on a TPU or GPU profile trains there (a clear error says
    # so when that hardware is absent); estimated timing runs anywhere.
    strategy = None
    if args.tpu is not None or (args.timing == "measured" and profile.strategy != "default"):
        strategy = strategy_for(profile, tpu=args.tpu or None)
    (x, y), (x_val, y_val) = load_mnist1d(args.samples)
    size = {"max_epochs": args.epochs} if args.tuner == "hyperband" else {"max_trials": args.max_trials}
    tuner = TUNERS[args.tuner](
        ResNetSpace(profile, args.max_width, args.max_blocks, args.max_batch),
        "val_accuracy",
        latency_budget_ms=args.budget_ms,
        profile=profile,
        timing=args.timing,
        # Wider, deeper and bigger batches are slower per step: the oracle
        # skips what a known over-budget candidate dominates along these.
        latency_increasing=["width", "blocks", "batch_size"],
        latency_independent=["learning_rate"],
        seed=args.seed,
        distribution_strategy=strategy,
        directory=args.directory,
        project_name=args.project,
        overwrite=args.overwrite,
        **size,
    )
    fit = {} if args.tuner == "hyperband" else {"epochs": args.epochs}
    tuner.search(x, y, validation_data=(x_val, y_val), verbose=0, **fit)
    if is_search_worker():
        return {"role": os.environ["KERASTUNER_TUNER_ID"]}  # a worker: the chief reports
    tuner.results_summary(num_trials=3)
    front = tuner.pareto_front()  # also written to the project folder as pareto.json / pareto.png
    rows = tuner.trial_latencies()
    summary = {
        "profile": profile.name,
        "budget_ms": args.budget_ms,
        "trials": len(rows),
        "trained": sum(r["trained"] for r in rows),
        "over_budget_not_trained": sum(
            (not r["trained"]) and r["latency_ms"] is not None and r["latency_ms"] > args.budget_ms for r in rows
        ),
        "pareto_front": front,
    }
    if args.export and summary["trained"]:
        from tf_hwopt.export import export_best

        summary["export"] = export_best(tuner, args.export, overwrite=True).to_dict()
    print(json.dumps({k: v for k, v in summary.items() if k != "pareto_front"}, indent=2, default=str))
    return summary


if __name__ == "__main__":
    try:
        main()
    except ValueError as err:  # bad arguments or absent hardware: say so, no traceback
        sys.exit(f"error: {err}")
