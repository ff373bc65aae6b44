"""The training strategy for a hardware profile: the one seam to the devices.

- TPU profiles: `TPUStrategy` through a `TPUClusterResolver` (a TPU name, or
  the local TPU of a Cloud TPU VM), after connecting and initialising the
  TPU system.
- GPU profiles: `MirroredStrategy` over the visible GPUs.
- `multi_worker`: `MultiWorkerMirroredStrategy` (cluster from `TF_CONFIG`).
- CPU: the default strategy, or `MirroredStrategy` over logical CPU devices
  when `devices` names them (the way multi-replica code is tested here).

When the profile's hardware is not reachable, the error says so and how to
search with the `cpu` profile or with estimated timing instead.

Example:
>>> strategy = strategy_for("tpu-v5e", tpu="my-tpu")   # on Cloud TPU
>>> strategy = strategy_for("cpu")                     # anywhere
"""

from __future__ import annotations

import glob
import os
from typing import Sequence

from tf_hwopt._quiet import import_tensorflow_quietly
from tf_hwopt.hardware.profiles import HardwareProfile, as_profile

import_tensorflow_quietly()

import numpy as np
import tensorflow as tf

_HOW_INSTEAD = (
    "To search on this machine, use the `cpu` profile (measured timing), or keep the "
    "target profile and use estimated timing (`timing=\"estimated\"`)."
)


def _local_tpu_present() -> bool:
    return bool(glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*") or os.environ.get("TPU_NAME"))


def tpu_strategy(tpu: str | None = None) -> tf.distribute.TPUStrategy:
    """Connects to a Cloud TPU and returns a `TPUStrategy`.

    Args:
        tpu: the TPU name (or `grpc://` address); `None` uses the local TPU of
            a Cloud TPU VM (or `$TPU_NAME`).

    Raises:
        ValueError: no TPU is reachable (no name given and none attached).
    """
    if tpu is None and not _local_tpu_present():
        raise ValueError(
            "A TPU profile was requested but no TPU is attached to this machine and no "
            "`tpu` name was given. " + _HOW_INSTEAD
        )
    try:
        resolver = tf.distribute.cluster_resolver.TPUClusterResolver(tpu=tpu or "local")
        tf.config.experimental_connect_to_cluster(resolver)
        tf.tpu.experimental.initialize_tpu_system(resolver)
    except (ValueError, RuntimeError, tf.errors.OpError) as err:
        raise ValueError(f"Could not reach TPU {tpu or 'local'!r}: {err}. " + _HOW_INSTEAD) from err
    return tf.distribute.TPUStrategy(resolver)


def strategy_for(
    profile: HardwareProfile | str,
    *,
    tpu: str | None = None,
    devices: Sequence[str] | None = None,
) -> tf.distribute.Strategy:
    """The `tf.distribute` strategy that trains on `profile`'s hardware.

    Args:
        profile: a `HardwareProfile` or profile name.
        tpu: TPU name for TPU profiles (see `tpu_strategy`).
        devices: explicit devices for `MirroredStrategy` (e.g. two logical
            CPUs, `["/cpu:0", "/cpu:1"]`).

    Raises:
        ValueError: the profile's hardware is not present.
    """
    profile = as_profile(profile)
    if profile.strategy == "tpu":
        return tpu_strategy(tpu)
    if devices:
        return tf.distribute.MirroredStrategy(list(devices))
    if profile.strategy == "mirrored":
        gpus = tf.config.list_logical_devices("GPU")
        if not gpus:
            raise ValueError(
                f"Profile {profile.name!r} trains on GPUs, but this machine has none. " + _HOW_INSTEAD
            )
        return tf.distribute.MirroredStrategy([d.name for d in gpus])
    if profile.strategy == "multi_worker":
        return tf.distribute.MultiWorkerMirroredStrategy()
    return tf.distribute.get_strategy()


class CountingCrossDeviceOps(tf.distribute.CrossDeviceOps):
    """Wraps a `CrossDeviceOps` and counts what it aggregates across replicas.

    Keras's optimizer aggregates gradients through the strategy's
    cross-device ops (`batch_reduce`); this wrapper records, for each traced
    aggregation, how many tensors and how many bytes went through it. A
    frozen module's gradients are not computed, so they are not aggregated:
    the counts drop after a freeze.

    Example:
    >>> ops = CountingCrossDeviceOps()
    >>> strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"], cross_device_ops=ops)
    >>> # build, compile and fit under strategy.scope(); then
    >>> ops.calls[-1]   # {"tensors": 22, "bytes": 1234567}
    """

    def __init__(self, inner: tf.distribute.CrossDeviceOps | None = None):
        super().__init__()
        self.inner = inner or tf.distribute.ReductionToOneDevice()
        self.calls: list[dict] = []

    @staticmethod
    def _size(value) -> int:
        tensors = value.values if hasattr(value, "values") else (value,)
        t = tensors[0]
        return int(np.prod(t.shape)) * t.dtype.size

    def _record(self, values) -> None:
        self.calls.append({"tensors": len(values), "bytes": sum(self._size(v) for v in values)})

    def reduce_implementation(self, reduce_op, per_replica_value, destinations, options):
        self._record([per_replica_value])
        return self.inner.reduce_implementation(reduce_op, per_replica_value, destinations, options)

    def batch_reduce_implementation(self, reduce_op, value_destination_pairs, options):
        self._record([value for value, _ in value_destination_pairs])
        return self.inner.batch_reduce_implementation(reduce_op, value_destination_pairs, options)

    def broadcast_implementation(self, tensor, destinations):
        return self.inner.broadcast_implementation(tensor, destinations)


def gradient_aggregation(model) -> dict:
    """Gradient tensors and bytes a data-parallel step aggregates for `model` now.

    One gradient per trainable variable; frozen (non-trainable) variables
    get none. This is the count from the variables; `CountingCrossDeviceOps`
    measures it on the traced step.
    """
    variables = model.trainable_variables
    return {
        "tensors": len(variables),
        "bytes": int(sum(int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize for v in variables)),
    }
