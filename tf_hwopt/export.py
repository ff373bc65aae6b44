"""Export: a trained (or best-found) Keras model leaves as a TensorFlow SavedModel.

`export_saved_model` writes a SavedModel whose `serving_default` signature
takes and returns tensors named like the Keras model's inputs and outputs,
built with Keras 3's own `keras.export.ExportArchive`. Only the model's
variables are tracked: optimizer state and Egeria's frozen flags never reach
the SavedModel, and serving always runs the inference graph
(`training=False`), so a model exported mid-freeze serves exactly like the
same weights exported without freezing.

The export is verified and atomic: it is written to a temporary folder next
to `path`, reloaded with `tf.saved_model.load`, its outputs compared with the
Keras model's on a sample batch, and only then renamed to `path`. A failed
export leaves nothing behind; an existing export is replaced only with
`overwrite=True`, and only once the new one has passed the check.

`int8_tflite=PATH` also writes a full-integer TFLite model (post-training
quantization by the TFLite converter, calibrated on `representative_data`)
and reports its size and, with labelled `eval_data`, its accuracy delta.
"""

from __future__ import annotations

import dataclasses
import math
import os
import shutil
import uuid
import warnings
from typing import Sequence

import numpy as np

from tf_hwopt._io import write_json_atomic
from tf_hwopt._quiet import stderr_silenced, import_tensorflow_quietly

import_tensorflow_quietly()

import keras
import tensorflow as tf

METADATA_FILE = "tf_hwopt.json"


@dataclasses.dataclass
class ExportResult:
    """What `export_saved_model` wrote and checked.

    Attributes:
        path: the SavedModel folder.
        input_names, output_names: the serving signature's tensor names.
        max_abs_diff: largest difference between the reloaded SavedModel's
            outputs and the Keras model's on the sample batch.
        saved_model_bytes: size of the SavedModel folder.
        tflite: for `int8_tflite`, its path, size, and (with `eval_data`)
            float and int8 accuracy and their difference in points.
        metadata: what was stored in `path/tf_hwopt.json`, if anything.
    """

    path: str
    input_names: list
    output_names: list
    max_abs_diff: float
    saved_model_bytes: int
    tflite: dict | None = None
    metadata: dict | None = None

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _folder_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def _input_signature(model: keras.Model, sample) -> tuple:
    """The serving inputs: `(structure, specs)`.

    `structure` is the model's input structure (a name, a list of names or a
    dict of names, as `model.input` has it) and `specs` the `tf.TensorSpec`s
    in `keras.tree.flatten(structure)` order. A subclassed model without
    symbolic inputs takes both from `sample` (it must have been called).
    """
    try:
        structure = model.input
    except (AttributeError, ValueError):
        # A Sequential model never called has `inputs` but no `input` yet.
        inputs = getattr(model, "inputs", None)
        structure = (inputs[0] if len(inputs) == 1 else list(inputs)) if inputs else None
    if structure is not None:
        tensors = keras.tree.flatten(structure)
        names = [t.name.split(":")[0] for t in tensors]
        if len(set(names)) != len(names):
            names = [f"input_{i}" for i in range(len(names))]
        shapes = [tuple(t.shape[1:]) for t in tensors]
        dtypes = [t.dtype for t in tensors]
        packed = keras.tree.pack_sequence_as(structure, names)
    else:
        if sample is None:
            raise ValueError(
                f"`sample` is needed to export model {model.name!r}: it has no symbolic inputs "
                "(a subclassed model), so its serving signature is taken from a batch of real inputs."
            )
        if not model.built:
            raise ValueError(
                f"`model` {model.name!r} is not built: train it or call it on a batch before exporting."
            )
        if isinstance(sample, dict):
            packed = {k: k for k in sample}
        elif isinstance(sample, (list, tuple)):
            packed = [f"input_{i}" for i in range(len(sample))]
        else:
            packed = "input"
        arrays = keras.tree.flatten(sample)
        names = keras.tree.flatten(packed)
        shapes = [tuple(np.shape(a)[1:]) for a in arrays]
        dtypes = [keras.backend.standardize_dtype(getattr(a, "dtype", "float32")) for a in arrays]
    specs = [tf.TensorSpec((None,) + shape, dtype, name=n) for shape, dtype, n in zip(shapes, dtypes, names)]
    return packed, specs


def _output_names(model: keras.Model, structure, batch) -> list:
    try:
        count = len(keras.tree.flatten(model.outputs))
    except (AttributeError, ValueError):  # subclassed: count what it returns
        count = len(keras.tree.flatten(model(keras.tree.pack_sequence_as(structure, batch), training=False)))
    names = list(getattr(model, "output_names", None) or [])
    if len(names) != count or len(set(names)) != count:
        names = [f"output_{i}" for i in range(count)]
    return names


def _sample_batch(structure, specs, sample):
    """Up to 8 examples of `sample` (in any form `model.predict` takes), flattened like `specs`.

    A dict is matched by input name; integer ids fed to a float input are
    cast to its dtype. Without `sample`, a random batch of the input shapes.
    """
    if sample is not None:
        if isinstance(sample, dict):
            names = keras.tree.flatten(structure)
            missing = [n for n in names if n not in sample]
            if missing:
                raise ValueError(f"`sample` has no input(s) {missing}; the model's inputs are {names}.")
            arrays = [sample[n] for n in names]
        else:
            arrays = keras.tree.flatten(sample)
        if len(arrays) != len(specs):
            raise ValueError(f"`sample` must give {len(specs)} input array(s); got {len(arrays)}.")
        return [np.asarray(a)[:8].astype(spec.dtype.as_numpy_dtype) for a, spec in zip(arrays, specs)]
    rng = np.random.default_rng(0)
    batch = []
    for spec in specs:
        shape = (4,) + tuple(d if d is not None else 8 for d in spec.shape[1:])
        if spec.dtype.is_integer:
            batch.append(rng.integers(0, 2, shape).astype(spec.dtype.as_numpy_dtype))
        else:
            batch.append(rng.standard_normal(shape).astype(spec.dtype.as_numpy_dtype))
    return batch


def export_saved_model(
    model: keras.Model,
    path: str,
    *,
    overwrite: bool = False,
    sample=None,
    atol: float = 1e-5,
    int8_tflite: str | None = None,
    representative_data=None,
    eval_data=None,
    metadata: dict | None = None,
) -> ExportResult:
    """Writes `model` as a verified TensorFlow SavedModel at `path`.

    Args:
        model: a built Keras model (Functional, Sequential or subclassed with
            known inputs).
        path: the SavedModel folder to create.
        overwrite: replace an existing export at `path` (only after the new
            one has been verified).
        sample: a batch of real inputs for the output check (default: a
            random batch of the input shapes).
        atol: largest output difference accepted in the check.
        int8_tflite: also write an int8 TFLite model to this file.
        representative_data: inputs (array, or list of arrays) that calibrate
            the int8 model; required with `int8_tflite`.
        eval_data: `(x, y)` with integer class labels; with `int8_tflite`,
            the float and int8 accuracies are measured on it.
        metadata: JSON-serialisable facts stored beside the model in
            `path/tf_hwopt.json` (e.g. its measured step time).

    Returns:
        An `ExportResult`.

    Raises:
        ValueError: bad arguments, or `path` exists without `overwrite=True`
            (checked before anything is written).
        RuntimeError: the reloaded SavedModel does not reproduce the model's
            outputs; nothing is left at `path`.

    Example:
    >>> result = tf_hwopt.export_saved_model(model, "export/resnet1d", sample=x_test[:8])
    >>> served = tf.saved_model.load("export/resnet1d").signatures["serving_default"]
    >>> served(signal=tf.constant(x_test[:8]))["head"]
    """
    if not isinstance(model, keras.Model):
        raise ValueError(f"`model` must be a keras.Model. Received: {type(model).__name__}")
    if not isinstance(path, (str, os.PathLike)) or not str(path):
        raise ValueError(f"`path` must be a folder path. Received: path={path!r}")
    path = os.path.abspath(os.fspath(path))
    if os.path.exists(path) and not overwrite:
        raise ValueError(f"`path` {path!r} already exists; pass overwrite=True to replace it.")
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"`path` {path!r} exists and is not a folder; it will not be replaced.")
    if int8_tflite is not None and representative_data is None:
        raise ValueError("`int8_tflite` needs `representative_data` (inputs that calibrate the int8 ranges).")
    if eval_data is not None and (not isinstance(eval_data, (tuple, list)) or len(eval_data) != 2):
        raise ValueError("`eval_data` must be `(x, y)` with integer class labels.")
    structure, specs = _input_signature(model, sample)
    input_names = [s.name for s in specs]
    batch = _sample_batch(structure, specs, sample)
    output_names = _output_names(model, structure, batch)

    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    staging = os.path.join(parent, f".{os.path.basename(path)}.partial-{uuid.uuid4().hex[:8]}")
    try:
        _write(model, staging, structure, specs, output_names)
        diff = _verify(model, staging, structure, batch, input_names, output_names, atol)
        if metadata is not None:
            write_json_atomic(metadata, os.path.join(staging, METADATA_FILE), default=str)
        tflite = None
        if int8_tflite is not None:
            tflite = _int8_tflite(model, staging, int8_tflite, representative_data, eval_data)
        _replace(staging, path)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return ExportResult(
        path=path,
        input_names=input_names,
        output_names=output_names,
        max_abs_diff=diff,
        saved_model_bytes=_folder_bytes(path),
        tflite=tflite,
        metadata=metadata,
    )


def _write(model, folder, structure, specs, output_names):
    archive = keras.export.ExportArchive()
    archive.track(model)

    def serve(*inputs):
        outputs = model(keras.tree.pack_sequence_as(structure, list(inputs)), training=False)
        return dict(zip(output_names, keras.tree.flatten(outputs)))

    archive.add_endpoint(name="serve", fn=serve, input_signature=specs)
    archive.write_out(folder, verbose=False)


def _verify(model, folder, structure, batch, input_names, output_names, atol) -> float:
    served = tf.saved_model.load(folder).signatures["serving_default"]
    got = served(**{n: tf.constant(a) for n, a in zip(input_names, batch)})
    want = keras.tree.flatten(model(keras.tree.pack_sequence_as(structure, batch), training=False))
    diff = 0.0
    for name, expected in zip(output_names, want):
        diff = max(diff, float(np.max(np.abs(np.asarray(got[name]) - np.asarray(expected)))))
    if not diff <= atol:
        raise RuntimeError(
            f"The reloaded SavedModel's outputs differ from the Keras model's by {diff:.3g} "
            f"(> atol={atol:g}); nothing was exported."
        )
    return diff


def _replace(staging, path):
    """Moves `staging` to `path`; an existing `path` is kept until the move is done."""
    if not os.path.exists(path):
        os.replace(staging, path)
        return
    old = f"{staging}.old"
    os.replace(path, old)
    try:
        os.replace(staging, path)
    except BaseException:
        os.replace(old, path)
        raise
    shutil.rmtree(old, ignore_errors=True)


def _as_list(x) -> list:
    return [np.asarray(a) for a in (x if isinstance(x, (list, tuple)) else [x])]


def _int8_tflite(model, saved_model_dir, out_path, representative_data, eval_data) -> dict:
    converter = tf.lite.TFLiteConverter.from_saved_model(saved_model_dir, signature_keys=["serving_default"])
    converter.optimizations = [tf.lite.Optimize.DEFAULT]
    arrays = _as_list(representative_data)
    # The converter feeds inputs by signature order, which is sorted by name.
    _, specs = _input_signature(model, representative_data)
    order = sorted(range(len(specs)), key=lambda i: specs[i].name)

    def representative():
        for i in range(min(len(arrays[0]), 200)):
            yield [arrays[j][i : i + 1].astype(specs[j].dtype.as_numpy_dtype) for j in order]

    converter.representative_dataset = representative
    converter.target_spec.supported_ops = [tf.lite.OpsSet.TFLITE_BUILTINS_INT8]
    with stderr_silenced():  # the converter's C++ progress lines
        flatbuffer = converter.convert()
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    tmp = f"{out_path}.{uuid.uuid4().hex[:8]}.tmp"
    with open(tmp, "wb") as f:
        f.write(flatbuffer)
    os.replace(tmp, out_path)
    report = {"path": os.path.abspath(out_path), "bytes": len(flatbuffer)}
    if eval_data is not None:
        x, y = eval_data
        float_pred = np.argmax(np.asarray(model.predict(x, batch_size=1024, verbose=0)), axis=-1)
        int8_pred = np.argmax(tflite_predict(out_path, x), axis=-1)
        y = np.asarray(y).reshape(-1)
        report["float_accuracy"] = float(np.mean(float_pred == y))
        report["int8_accuracy"] = float(np.mean(int8_pred == y))
        report["accuracy_delta_points"] = 100.0 * (report["int8_accuracy"] - report["float_accuracy"])
        report["agreement"] = float(np.mean(float_pred == int8_pred))
    return report


def tflite_predict(tflite_path: str, x: Sequence | np.ndarray) -> np.ndarray:
    """Runs a single-input, single-output TFLite model on `x`, one example at a time."""
    with warnings.catch_warnings(), stderr_silenced():
        # TF's interpreter warns that it moves to ai_edge_litert; it is what TF 2.21 ships.
        warnings.simplefilter("ignore", UserWarning)
        interpreter = tf.lite.Interpreter(model_path=tflite_path)
        interpreter.allocate_tensors()
    (inp,) = interpreter.get_input_details()
    (out,) = interpreter.get_output_details()
    in_scale, in_zero = inp["quantization"]
    out_scale, out_zero = out["quantization"]
    x = np.asarray(x)
    results = []
    for row in x:
        value = row[None]
        if in_scale:
            value = np.clip(np.round(value / in_scale + in_zero), -128, 127)
        interpreter.set_tensor(inp["index"], value.astype(inp["dtype"]))
        interpreter.invoke()
        y = interpreter.get_tensor(out["index"]).astype(np.float32)
        results.append((y - out_zero) * out_scale if out_scale else y)
    return np.concatenate(results)


def export_best(tuner, path: str, *, overwrite: bool = False, sample=None) -> ExportResult:
    """Exports the best in-budget model of a `LatencyAwareTuner`, retrain-free.

    Loads the best completed trial whose step time fits the budget (its
    checkpoint, as `tuner.get_best_models` does) and exports it with
    `export_saved_model`; the trial's hyperparameters, score and step time
    (with its `measured`/`estimated` label) are stored beside it in
    `path/tf_hwopt.json`.

    Returns:
        The `ExportResult`; its `metadata` holds what was written beside the model.

    Example:
    >>> tuner.search(x, y, epochs=3, validation_data=(x_val, y_val))
    >>> tf_hwopt.export_best(tuner, "export/best")
    """
    oracle = tuner.latency_oracle
    budget = oracle.latency_budget_ms
    candidates = []
    for trial in oracle.get_best_trials(len(oracle.trials)):
        latency = oracle.known_latency(trial.hyperparameters.values)
        if (trial.status == "COMPLETED" and latency is not None and latency.get("latency_ms", math.inf) <= budget
                and not oracle.violations(latency)):
            candidates.append((trial, latency))
    if not candidates:
        raise ValueError(f"No completed trial fits the {budget:g} ms budget; nothing to export.")
    trial, latency = candidates[0]
    model = tuner.load_model(trial)
    metadata = {
        "source": "tf_hwopt.search.LatencyAwareTuner",
        "trial_id": trial.trial_id,
        "hyperparameters": trial.hyperparameters.values,
        "objective": oracle.objective.name,
        "score": trial.score,
        "latency_ms": latency["latency_ms"],
        "latency_kind": latency["kind"],
        "latency_mode": tuner.timing_mode,
        "budget_ms": budget,
        "profile": tuner.profile.name,
    }
    return export_saved_model(model, path, overwrite=overwrite, sample=sample, metadata=metadata)
