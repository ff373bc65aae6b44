"""Train a 1D ResNet on MNIST-1D with EgeriaCallback, plot its plasticity, export it.

    python examples/egeria_mnist1d.py                     # 40,000 examples, 10 epochs
    python examples/egeria_mnist1d.py --samples 2000 --epochs 3 --out /tmp/egeria_example

Writes OUT/plasticity.png (plasticity per module, freeze events), OUT/saved_model
(a verified TensorFlow SavedModel of the trained model) and OUT/egeria.json
(what Egeria did: freeze times, skipped backward FLOPs, overhead).
"""

from __future__ import annotations

import argparse
import json
import os

from tf_hwopt._quiet import import_tensorflow_quietly

import_tensorflow_quietly()

import keras  # noqa: E402

import tf_hwopt  # noqa: E402
from tf_hwopt.data import load_mnist1d  # noqa: E402
from tf_hwopt.models import resnet1d  # noqa: E402


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=50_000)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--out", default="egeria_example")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    (x, y), (x_test, y_test) = load_mnist1d(args.samples)
    keras.utils.set_random_seed(args.seed)
    model = resnet1d()
    steps = args.epochs * -(-len(x) // args.batch_size)
    model.compile(
        optimizer=keras.optimizers.Adam(keras.optimizers.schedules.CosineDecay(2e-3, steps)),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    egeria = tf_hwopt.EgeriaCallback(log_dir=os.path.join(args.out, "tensorboard"))
    model.fit(x, y, batch_size=args.batch_size, epochs=args.epochs, validation_data=(x_test, y_test),
              callbacks=[egeria], verbose=2)

    os.makedirs(args.out, exist_ok=True)
    tf_hwopt.egeria.plot(egeria, os.path.join(args.out, "plasticity.png"))
    export = tf_hwopt.export_saved_model(
        model, os.path.join(args.out, "saved_model"), overwrite=True, sample=x_test[:8]
    )
    summary = egeria.summary()
    report = {
        "test_accuracy": float(model.evaluate(x_test, y_test, verbose=0)[1]),
        "frozen_modules": summary["frozen_modules"],
        "num_modules": summary["num_modules"],
        "freeze_events": [(e["module_name"], e["epoch"] + 1) for e in summary["events"] if e["kind"] == "freeze"],
        "backward_flops_skipped_fraction": summary["backward_flops_skipped_fraction"],
        "overhead_fraction": summary["overhead_fraction"],
        "saved_model": export.path,
    }
    with open(os.path.join(args.out, "egeria.json"), "w") as f:
        json.dump(report, f, indent=2)
    print(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
