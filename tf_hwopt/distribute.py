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
from tf_hwopt.hardware import HardwareProfile, load_profile

import_tensorflow_quietly()

import tensorflow as tf  # noqa: E402

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
    profile = load_profile(profile) if isinstance(profile, str) else profile
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
