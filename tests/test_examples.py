"""Every example runs, with tiny sizes, and produces what it promises."""

import json
import os
import subprocess
import sys


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(script, *args, cwd):
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", script), *args],
        cwd=cwd, capture_output=True, text=True, timeout=600,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    # The report is the last JSON object printed.
    text = proc.stdout[proc.stdout.rindex("\n{") + 1 :] if "\n{" in proc.stdout else proc.stdout
    return json.loads(text), proc


def test_egeria_mnist1d_example(tmp_path):
    report, _ = _run("egeria_mnist1d.py", "--samples", "1500", "--epochs", "2", "--batch-size", "128",
                     "--out", str(tmp_path / "out"), cwd=tmp_path)
    assert 0.0 <= report["test_accuracy"] <= 1.0 and report["num_modules"] == 6
    assert (tmp_path / "out" / "plasticity.png").read_bytes()[:4] == b"\x89PNG"
    assert os.path.exists(os.path.join(report["saved_model"], "saved_model.pb"))


def test_export_and_serve_example(tmp_path):
    report, _ = _run("export_and_serve.py", "--samples", "1500", "--epochs", "1", "--out", str(tmp_path / "o"),
                     cwd=tmp_path)
    assert report["signature"] == {"inputs": ["signal"], "outputs": ["head"]}
    assert report["max_abs_diff_vs_keras"] < 1e-4
    assert report["int8_tflite"]["bytes"] > 0 and "accuracy_delta_points" in report["int8_tflite"]


def test_latency_search_example_runs_locally_and_exports_the_best(tmp_path):
    report, proc = _run(
        "latency_search_cloud_tpu.py", "--profile", "cpu", "--budget-ms", "1000", "--max-trials", "2",
        "--samples", "1000", "--epochs", "1", "--max-width", "32", "--max-blocks", "2", "--max-batch", "64",
        "--directory", str(tmp_path / "search"), "--export", str(tmp_path / "best"), "--overwrite", cwd=tmp_path,
    )
    assert report["trials"] == 2 and report["trained"] >= 1
    meta = json.loads((tmp_path / "best" / "tf_hwopt.json").read_text())
    assert meta["latency_kind"] == "measured" and 0 < meta["latency_ms"] <= 1000
    assert os.path.exists(tmp_path / "search" / "mnist1d_resnet" / "pareto.json")
    assert "Latency of every trial" in proc.stdout


def test_latency_search_example_refuses_a_tpu_profile_without_a_tpu(tmp_path):
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", "latency_search_cloud_tpu.py"), "--profile", "tpu-v5e",
         "--directory", str(tmp_path / "s")],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode != 0
    assert "no TPU" in proc.stderr and "cpu" in proc.stderr
    assert not os.path.exists(tmp_path / "s")
