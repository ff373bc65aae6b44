"""Hardware: profiles (data in `tpu_configs/`), the roofline, and the strategy seam.

`profiles` loads and validates the TOML hardware profiles and computes the
roofline floor; `distribute` is the one place that picks a
`tf.distribute` strategy for a profile (TPUStrategy through a
TPUClusterResolver, MirroredStrategy, or the default).
"""

from tf_hwopt.hardware import distribute
from tf_hwopt.hardware.distribute import CountingCrossDeviceOps, gradient_aggregation, strategy_for, tpu_strategy
from tf_hwopt.hardware.profiles import HardwareProfile, list_profiles, load_profile, roofline_ms
