import pytest

from tf_hwopt.hardware.profiles import HardwareProfile, list_profiles, load_profile, roofline_ms

EXPECTED = {"cpu", "gpu-a100", "gpu-h100", "gpu-h200", "tpu-v4", "tpu-v5e", "tpu-v5p", "tpu-v6e"}

GOOD = """
name = "x"
kind = "tpu"
peak_bf16_tflops = 100.0
peak_fp32_tflops = 25.0
memory_gib = 16.0
memory_bandwidth_gbps = 800.0
matrix_tile = 128
batch_multiple = 128
width_multiple = 128
dtype_policy = "mixed_bfloat16"
strategy = "tpu"
steps_per_execution = [1, 32]
"""


def test_every_bundled_profile_loads():
    assert set(list_profiles()) == EXPECTED
    for name in EXPECTED:
        p = load_profile(name)
        assert isinstance(p, HardwareProfile) and p.name == name
        assert p.peak_bf16_tflops >= p.peak_fp32_tflops > 0
        assert p.width_multiple % p.matrix_tile == 0 or p.kind == "cpu"


def test_vendor_figures_of_method_md():
    assert load_profile("tpu-v4").peak_bf16_tflops == 275.0
    assert load_profile("tpu-v6e").matrix_tile == 256
    assert load_profile("gpu-h200").memory_bandwidth_gbps == 4800.0
    assert load_profile("tpu-v5e").dtype_policy == "mixed_bfloat16"
    assert load_profile("gpu-h100").strategy == "mirrored"


def _write(tmp_path, text):
    path = tmp_path / "p.toml"
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize(
    "edit,match",
    [
        (lambda t: t.replace('kind = "tpu"\n', ""), "missing field `kind`"),
        (lambda t: t.replace("matrix_tile = 128", 'matrix_tile = "128"'), "field `matrix_tile` must be int"),
        (lambda t: t.replace("memory_gib = 16.0", "memory_gib = -1.0"), "field `memory_gib` must be > 0"),
        (lambda t: t.replace('strategy = "tpu"', 'strategy = "magic"'), "field `strategy` must be one of"),
        (lambda t: t.replace("steps_per_execution = [1, 32]", "steps_per_execution = [0]"), "steps_per_execution"),
        (lambda t: t + "colour = 1\n", "unknown field"),
        (lambda t: t + "this is not toml", "not valid TOML"),
        (lambda t: t.replace("peak_bf16_tflops = 100.0", "peak_bf16_tflops = true"), "peak_bf16_tflops"),
    ],
)
def test_broken_profile_names_file_and_field(tmp_path, edit, match):
    path = _write(tmp_path, edit(GOOD))
    with pytest.raises(ValueError, match=match) as err:
        load_profile(path)
    assert path in str(err.value)


def test_good_file_and_unknown_name(tmp_path):
    assert load_profile(_write(tmp_path, GOOD)).steps_per_execution == (1, 32)
    with pytest.raises(ValueError, match="Unknown hardware profile 'tpu-v9'"):
        load_profile("tpu-v9")
    with pytest.raises(FileNotFoundError):
        load_profile(str(tmp_path / "missing.toml"))


def test_roofline_takes_the_larger_bound():
    p = load_profile("tpu-v5e")  # 197 TFLOP/s, 819 GB/s
    assert roofline_ms(197e12, 0, p) == pytest.approx(1000.0)
    assert roofline_ms(0, 819e9, p) == pytest.approx(1000.0)
    assert roofline_ms(197e9, 819e9, p) == pytest.approx(1000.0)  # memory-bound
    assert roofline_ms(197e12, 819e6, p) == pytest.approx(1000.0)  # compute-bound
    assert roofline_ms(1e12, 0, p, dtype="float32") == pytest.approx(1e3 * 1e12 / 49.25e12)
    with pytest.raises(ValueError):
        roofline_ms(-1, 0, p)


def test_cpu_calibration_measures_this_host():
    p = load_profile("cpu", calibrate=True)
    assert p.calibrated and 0.001 < p.peak_fp32_tflops < 10 and 0.1 < p.memory_bandwidth_gbps < 1000
    with pytest.raises(ValueError, match="not the host CPU"):
        load_profile("tpu-v4", calibrate=True)
