"""Hardware profiles: what a TPU, GPU or CPU target can do, as data.

Profiles are TOML files in `tpu_configs/` (shipped as `tf_hwopt.tpu_configs`),
one per target, with the source of each vendor figure in a comment.
`load_profile` validates them: a missing field, a field of the wrong type or
an out-of-range value is an error that names the file and the field.

Example:
>>> profile = load_profile("tpu-v5e")
>>> profile.matrix_tile, profile.dtype_policy
(128, 'mixed_bfloat16')
>>> roofline_ms(flops=2e12, bytes_moved=1e9, profile=profile)  # doctest: +ELLIPSIS
10.15...
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import os
import time
import tomllib

KINDS = ("tpu", "gpu", "cpu")
STRATEGIES = ("tpu", "mirrored", "multi_worker", "default")
DTYPE_POLICIES = ("float32", "mixed_bfloat16", "mixed_float16", "bfloat16")


@dataclasses.dataclass(frozen=True)
class HardwareProfile:
    """One accelerator (per chip) as the search and the estimator see it.

    Attributes:
        name: profile name, e.g. `"tpu-v5e"`.
        kind: `"tpu"`, `"gpu"` or `"cpu"`.
        peak_bf16_tflops, peak_fp32_tflops: peak dense matmul rates.
        memory_gib: accelerator memory.
        memory_bandwidth_gbps: memory bandwidth in GB/s (1e9 bytes/s).
        matrix_tile: edge of the matrix unit (128 on TPU v4/v5, 256 on v6e,
            8/16 for GPU tensor cores).
        batch_multiple, width_multiple: preferred multiples for batch sizes
            and layer widths.
        dtype_policy: the Keras dtype policy to train with.
        strategy: `tf.distribute` strategy kind.
        steps_per_execution: choices offered to the search.
        source: the file it was read from.
        calibrated: True when peaks and bandwidth were measured on this host.
    """

    name: str
    kind: str
    peak_bf16_tflops: float
    peak_fp32_tflops: float
    memory_gib: float
    memory_bandwidth_gbps: float
    matrix_tile: int
    batch_multiple: int
    width_multiple: int
    dtype_policy: str
    strategy: str
    steps_per_execution: tuple = (1,)
    source: str = ""
    calibrated: bool = False

    def peak_tflops(self, dtype: str) -> float:
        """Peak rate for a compute dtype (`"bfloat16"`/`"float16"` use the bf16 peak)."""
        return self.peak_bf16_tflops if dtype in ("bfloat16", "float16") else self.peak_fp32_tflops


_FIELDS = {
    "name": str,
    "kind": str,
    "peak_bf16_tflops": float,
    "peak_fp32_tflops": float,
    "memory_gib": float,
    "memory_bandwidth_gbps": float,
    "matrix_tile": int,
    "batch_multiple": int,
    "width_multiple": int,
    "dtype_policy": str,
    "strategy": str,
}
_CHOICES = {"kind": KINDS, "strategy": STRATEGIES, "dtype_policy": DTYPE_POLICIES}


def _config_dir():
    override = os.environ.get("TF_HWOPT_CONFIGS")
    if override:
        return override
    return importlib.resources.files("tf_hwopt.tpu_configs")


def list_profiles() -> list[str]:
    """Names of the bundled profiles."""
    root = _config_dir()
    entries = os.listdir(root) if isinstance(root, str) else [p.name for p in root.iterdir()]
    return sorted(name[: -len(".toml")] for name in entries if name.endswith(".toml"))


def _resolve(name_or_path: str) -> str:
    if os.path.sep in name_or_path or name_or_path.endswith(".toml"):
        if not os.path.exists(name_or_path):
            raise FileNotFoundError(f"Hardware profile file {name_or_path!r} does not exist.")
        return name_or_path
    root = _config_dir()
    path = os.path.join(str(root), f"{name_or_path}.toml")
    if not os.path.exists(path):
        raise ValueError(
            f"Unknown hardware profile {name_or_path!r}. Known profiles: {list_profiles()}; "
            "or pass the path of a .toml file."
        )
    return path


def load_profile(name_or_path: str, *, calibrate: bool = False) -> HardwareProfile:
    """Loads and validates a hardware profile.

    Args:
        name_or_path: a bundled profile name (`"tpu-v4"`, `"gpu-h100"`,
            `"cpu"`, ...) or the path of a TOML file.
        calibrate: for a `cpu` profile, replace the peaks and the bandwidth
            with figures measured on this host.

    Raises:
        ValueError: unknown name; a missing, mistyped or out-of-range field
            (the message names the file and the field).
    """
    path = _resolve(name_or_path)
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except tomllib.TOMLDecodeError as err:
        raise ValueError(f"Hardware profile {path}: not valid TOML ({err}).") from err
    values = {}
    for field, kind in _FIELDS.items():
        if field not in data:
            raise ValueError(f"Hardware profile {path}: missing field `{field}` ({kind.__name__}).")
        value = data[field]
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, kind) or isinstance(value, bool):
            raise ValueError(
                f"Hardware profile {path}: field `{field}` must be {kind.__name__}, "
                f"got {type(value).__name__} ({value!r})."
            )
        if kind in (int, float) and value <= 0:
            raise ValueError(f"Hardware profile {path}: field `{field}` must be > 0, got {value!r}.")
        if field in _CHOICES and value not in _CHOICES[field]:
            raise ValueError(
                f"Hardware profile {path}: field `{field}` must be one of {_CHOICES[field]}, got {value!r}."
            )
        values[field] = value
    spe = data.get("steps_per_execution", [1])
    if not isinstance(spe, list) or not spe or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in spe):
        raise ValueError(
            f"Hardware profile {path}: field `steps_per_execution` must be a non-empty list of "
            f"positive integers, got {spe!r}."
        )
    unknown = set(data) - set(_FIELDS) - {"steps_per_execution"}
    if unknown:
        raise ValueError(f"Hardware profile {path}: unknown field(s) {sorted(unknown)}.")
    profile = HardwareProfile(**values, steps_per_execution=tuple(spe), source=str(path))
    if calibrate:
        if profile.kind != "cpu":
            raise ValueError(
                f"`calibrate=True` measures this host; profile {profile.name!r} is a {profile.kind}, not the host CPU."
            )
        profile = _calibrated(profile)
    return profile


def as_profile(profile: "HardwareProfile | str") -> HardwareProfile:
    """`profile` itself, or the profile that `load_profile` finds by that name or path.

    Example:
    >>> as_profile("tpu-v5e").name
    'tpu-v5e'
    """
    return load_profile(profile) if isinstance(profile, str) else profile


def roofline_ms(flops: float, bytes_moved: float, profile: HardwareProfile, dtype: str = "bfloat16") -> float:
    """The roofline floor of one step: max(FLOPs / peak, bytes / bandwidth), in ms.

    Example:
    >>> roofline_ms(1e12, 0, load_profile("gpu-a100"))  # doctest: +ELLIPSIS
    3.20...
    """
    if flops < 0 or bytes_moved < 0:
        raise ValueError(f"flops and bytes_moved must be >= 0; got {flops}, {bytes_moved}.")
    compute_s = flops / (profile.peak_tflops(dtype) * 1e12)
    memory_s = bytes_moved / (profile.memory_bandwidth_gbps * 1e9)
    return 1e3 * max(compute_s, memory_s)


def _calibrated(profile: HardwareProfile) -> HardwareProfile:
    """Measures a float32 matmul rate and a copy bandwidth on this host."""
    import numpy as np

    from tf_hwopt._quiet import import_tensorflow_quietly

    import_tensorflow_quietly()
    import tensorflow as tf

    n = 1024
    a = tf.random.stateless_uniform((n, n), seed=(1, 2))
    matmul = tf.function(lambda x: tf.linalg.matmul(x, x))
    matmul(a).numpy()
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        matmul(a).numpy()
        best = min(best, time.perf_counter() - start)
    tflops = 2 * n**3 / best / 1e12
    buf = np.ones(32 * 1024 * 1024 // 8)  # 32 MiB
    out = np.empty_like(buf)
    best_copy = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        np.copyto(out, buf)
        best_copy = min(best_copy, time.perf_counter() - start)
    bandwidth = 2 * buf.nbytes / best_copy / 1e9  # read + write
    return dataclasses.replace(
        profile,
        peak_bf16_tflops=tflops,
        peak_fp32_tflops=tflops,
        memory_bandwidth_gbps=bandwidth,
        calibrated=True,
    )
