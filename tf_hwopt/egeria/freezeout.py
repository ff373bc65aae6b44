"""`FreezeOutCallback`: the fixed freezing schedule of FreezeOut and Composer.

FreezeOut (Brock et al. 2017) and MosaicML Composer's `LayerFreezing` freeze
on a schedule, not on a measurement: nothing freezes before a fraction
`freeze_start` of training; from there, modules freeze front to back,
linearly in training time, so that a fraction `freeze_level` of the
freezable modules (all but the head) is frozen at the end. It is the peer
Egeria is measured against, and it runs on the same freezing engine.
"""

from __future__ import annotations

import math

from tf_hwopt.egeria.freezing_callback import FreezingCallback
from tf_hwopt.egeria.policy import check_fraction


def freezeout_schedule(progress: float, num_freezable: int, freeze_start: float, freeze_level: float) -> int:
    """How many front modules are frozen at `progress` (0..1) of training.

    Example:
    >>> [freezeout_schedule(p, 4, 0.5, 1.0) for p in (0.0, 0.5, 0.625, 0.75, 1.0)]
    [0, 0, 1, 2, 4]
    """
    if progress < freeze_start:
        return 0
    span = 1.0 - freeze_start
    fraction = 1.0 if span <= 0 else min(1.0, (progress - freeze_start) / span)
    return min(num_freezable, int(math.floor(fraction * freeze_level * num_freezable + 1e-9)))


class FreezeOutCallback(FreezingCallback):
    """Freezes front modules on a fixed, linear schedule.

    Args:
        freeze_start: fraction of training before which nothing freezes.
        freeze_level: fraction of the freezable modules (all but the head)
            frozen by the end of training.
        modules, log_dir, verbose: as in `FreezingCallback`.

    Example:
    >>> model.fit(x, y, epochs=20, callbacks=[tf_hwopt.FreezeOutCallback(freeze_start=0.5)])
    """

    def __init__(self, freeze_start: float = 0.5, freeze_level: float = 1.0, **kwargs):
        super().__init__(**kwargs)
        check_fraction("freeze_start", freeze_start, allow_zero=True)
        check_fraction("freeze_level", freeze_level)
        self.freeze_start = float(freeze_start)
        self.freeze_level = float(freeze_level)

    def _setup(self, first_fit: bool) -> None:
        if self.total_steps is None:
            raise ValueError(
                "FreezeOutCallback schedules freezing by training progress, so the number "
                "of steps must be known: pass `steps_per_epoch` to fit, or data of known size."
            )

    def _after_step(self) -> None:
        target = freezeout_schedule(
            self._step / self.total_steps, len(self.modules) - 1, self.freeze_start, self.freeze_level
        )
        current = self.engine.frozen_prefix
        if target > current:
            self._freeze(
                range(current, target),
                f"schedule: {target} of {len(self.modules) - 1} modules frozen at "
                f"{100 * self._step / self.total_steps:.0f}% of training",
            )
