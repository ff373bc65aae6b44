"""Export a Keras model as a SavedModel (and an int8 TFLite), reload it, serve a batch.

    python examples/export_and_serve.py --out /tmp/served

The model is the demo's 1D ResNet, briefly trained on MNIST-1D. Serving uses
only TensorFlow (`tf.saved_model.load` and the `serving_default` signature,
as TF Serving and Vertex AI do): no Keras and no tf_hwopt at serving time.
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np

from tf_hwopt._quiet import import_tensorflow_quietly

import_tensorflow_quietly()

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf_hwopt  # noqa: E402
from tf_hwopt.data import load_mnist1d  # noqa: E402
from tf_hwopt.models import resnet1d  # noqa: E402


def serve(saved_model_dir: str, batch: np.ndarray) -> np.ndarray:
    """What a server does: load the SavedModel, call its serving signature."""
    loaded = tf.saved_model.load(saved_model_dir)
    signature = loaded.signatures["serving_default"]
    (input_name,) = signature.structured_input_signature[1]
    (output_name,) = signature.structured_outputs
    return signature(**{input_name: tf.constant(batch)})[output_name].numpy()


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=10_000)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--out", default="served_model")
    args = parser.parse_args(argv)

    (x, y), (x_test, y_test) = load_mnist1d(args.samples)
    keras.utils.set_random_seed(0)
    model = resnet1d(widths=(32, 32, 32), strides=(1, 2, 2), stem_width=32)
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    model.fit(x, y, batch_size=128, epochs=args.epochs, verbose=0)

    saved_model_dir = os.path.join(args.out, "saved_model")
    result = tf_hwopt.export_saved_model(
        model, saved_model_dir, overwrite=True, sample=x_test[:8],
        int8_tflite=os.path.join(args.out, "model_int8.tflite"),
        representative_data=x[:500], eval_data=(x_test, y_test),
    )
    logits = serve(saved_model_dir, x_test[:32])
    served_accuracy = float(np.mean(np.argmax(logits, -1) == y_test[:32]))
    report = {
        "saved_model": result.path,
        "signature": {"inputs": result.input_names, "outputs": result.output_names},
        "saved_model_bytes": result.saved_model_bytes,
        "served_batch_accuracy": served_accuracy,
        "max_abs_diff_vs_keras": float(np.max(np.abs(logits - model.predict(x_test[:32], verbose=0)))),
        "int8_tflite": result.tflite,
    }
    print(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
