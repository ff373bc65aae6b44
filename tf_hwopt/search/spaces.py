"""KerasTuner search spaces aligned to a hardware profile.

The same hypermodel gets a TPU space or a GPU space by naming the profile:
widths and batch sizes are multiples of the matrix tile (128 on TPU v4/v5,
256 on v6e, 8/16 for GPU tensor cores), the dtype policy is the profile's
(bf16 on TPU), and `steps_per_execution` is offered where host-loop overhead
matters (TPU).

Example:
>>> def build(hp):
...     space = HardwareSpace(hp, "tpu-v5e")
...     width = space.width("units", 128, 1024)          # 128, 256, ..., 1024
...     model = keras.Sequential([keras.layers.Dense(width), keras.layers.Dense(10)])
...     model.compile("adam", "mse", steps_per_execution=space.steps_per_execution())
...     return model
"""

from __future__ import annotations

import math
import tomllib

from tf_hwopt.hardware.profiles import HardwareProfile, as_profile


def aligned_range(min_value: int, max_value: int, multiple: int) -> tuple[int, int]:
    """`[min, max]` shrunk to multiples of `multiple` (min rounded up, max down).

    Example:
    >>> aligned_range(100, 1000, 128)
    (128, 896)
    """
    if multiple <= 0:
        raise ValueError(f"`multiple` must be positive; got {multiple}.")
    low = max(multiple, int(math.ceil(min_value / multiple)) * multiple)
    high = int(math.floor(max_value / multiple)) * multiple
    if high < low:
        raise ValueError(
            f"No multiple of {multiple} lies in [{min_value}, {max_value}]; widen the range "
            f"for this hardware (e.g. [{multiple}, {4 * multiple}])."
        )
    return low, high


def power_of_two_multiples(min_value: int, max_value: int, multiple: int) -> list[int]:
    """`multiple * 2**k` values within `[min_value, max_value]` (batch sizes).

    Example:
    >>> power_of_two_multiples(64, 1024, 128)
    [128, 256, 512, 1024]
    """
    low, high = aligned_range(min_value, max_value, multiple)
    values, v = [], multiple
    while v <= high:
        if v >= low:
            values.append(v)
        v *= 2
    if not values:
        raise ValueError(f"No power-of-two multiple of {multiple} lies in [{min_value}, {max_value}].")
    return values


class HardwareSpace:
    """Declares KerasTuner hyperparameters whose choices follow a hardware profile.

    Args:
        hp: the `keras_tuner.HyperParameters` passed to `build(hp)`.
        profile: a `HardwareProfile` or a profile name (`"tpu-v5e"`, `"gpu-h100"`, `"cpu"`...).
    """

    def __init__(self, hp, profile: HardwareProfile | str):
        self.hp = hp
        self.profile = as_profile(profile)

    def width(self, name: str, min_value: int, max_value: int) -> int:
        """A layer width: multiples of the profile's `width_multiple`."""
        m = self.profile.width_multiple
        low, high = aligned_range(min_value, max_value, m)
        return self.hp.Int(name, min_value=low, max_value=high, step=m)

    def batch_size(self, min_value: int, max_value: int, name: str = "batch_size") -> int:
        """A batch size: power-of-two multiples of the profile's `batch_multiple`."""
        return self.hp.Choice(name, power_of_two_multiples(min_value, max_value, self.profile.batch_multiple))

    def dtype_policy(self, name: str = "dtype_policy") -> str:
        """The profile's dtype policy (bf16 on TPU), recorded with the trial."""
        return self.hp.Fixed(name, self.profile.dtype_policy)

    def steps_per_execution(self, name: str = "steps_per_execution") -> int:
        """`steps_per_execution` choices of the profile (several on TPU)."""
        choices = list(self.profile.steps_per_execution)
        if len(choices) == 1:
            return self.hp.Fixed(name, choices[0])
        return self.hp.Choice(name, choices)


def load_space(path: str, hp, profile: HardwareProfile | str) -> dict:
    """Declares the hyperparameters of a space file (TOML) and returns their values.

    Each table is one hyperparameter: `type` is `"width"` (`min`, `max`),
    `"batch_size"` (`min`, `max`), `"int"` (`min`, `max`, optional `step`),
    `"float"` (`min`, `max`, optional `sampling`), `"choice"` (`values`),
    `"dtype_policy"` or `"steps_per_execution"`.

    Example (`tpu_configs/spaces/mlp.toml`):
    >>> values = load_space("tpu_configs/spaces/mlp.toml", hp, "tpu-v5e")
    """
    with open(path, "rb") as f:
        try:
            tables = tomllib.load(f)
        except tomllib.TOMLDecodeError as err:
            raise ValueError(f"Search space {path}: not valid TOML ({err}).") from err
    space = HardwareSpace(hp, profile)
    values = {}
    for name, spec in tables.items():
        if not isinstance(spec, dict) or "type" not in spec:
            raise ValueError(f"Search space {path}: `{name}` must be a table with a `type`.")
        kind = spec["type"]
        try:
            if kind == "width":
                values[name] = space.width(name, spec["min"], spec["max"])
            elif kind == "batch_size":
                values[name] = space.batch_size(spec["min"], spec["max"], name=name)
            elif kind == "int":
                values[name] = hp.Int(name, spec["min"], spec["max"], step=spec.get("step", 1))
            elif kind == "float":
                values[name] = hp.Float(name, spec["min"], spec["max"], sampling=spec.get("sampling", "linear"))
            elif kind == "choice":
                values[name] = hp.Choice(name, spec["values"])
            elif kind == "dtype_policy":
                values[name] = space.dtype_policy(name)
            elif kind == "steps_per_execution":
                values[name] = space.steps_per_execution(name)
            else:
                raise ValueError(f"unknown type {kind!r}")
        except KeyError as err:
            raise ValueError(f"Search space {path}: `{name}` ({kind}) needs field {err}.") from err
        except ValueError as err:
            raise ValueError(f"Search space {path}: `{name}`: {err}") from err
    return values
