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

from typing import Sequence

from tf_hwopt._checks import check_fraction
from tf_hwopt.freezing.callback import FreezingCallback
from tf_hwopt.freezing.policy import Decision, FreezingPolicy


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


class FreezeOutPolicy(FreezingPolicy):
    """FreezeOut's schedule as a policy: the number frozen follows training progress.

    Example:
    >>> policy = FreezeOutPolicy(5, total_steps=100, freeze_start=0.5)
    >>> policy.observe(50).freeze, policy.observe(75).freeze
    ((), (0, 1))
    """

    def __init__(self, num_modules: int, *, total_steps: int, freeze_start: float = 0.5, freeze_level: float = 1.0):
        check_fraction("freeze_start", freeze_start, allow_zero=True)
        check_fraction("freeze_level", freeze_level)
        super().__init__(num_modules, max_frozen_fraction=1.0)
        self.total_steps = total_steps
        self.freeze_start = float(freeze_start)
        self.freeze_level = float(freeze_level)

    @property
    def max_frozen(self) -> int:
        return freezeout_schedule(1.0, self.num_modules - 1, self.freeze_start, self.freeze_level)

    def observe(self, step: int, values: Sequence[float] = (), learning_rate: float | None = None) -> Decision:
        self.evaluations += 1
        progress = step / self.total_steps
        target = freezeout_schedule(progress, self.num_modules - 1, self.freeze_start, self.freeze_level)
        if target <= self.num_frozen:
            return Decision()
        frozen = tuple(range(self.num_frozen, target))
        self.num_frozen = target
        return Decision(
            freeze=frozen,
            reason=f"schedule: {target} of {self.num_modules - 1} modules frozen at {100 * progress:.0f}% of training",
        )


class FreezeOutCallback(FreezingCallback):
    """Freezes front modules on a fixed, linear schedule.

    Args:
        probe_data: inputs for the BatchNormalization check before a freeze
            (default: the data given to `fit`); the schedule itself measures
            nothing.
        freeze_start: fraction of training before which nothing freezes.
        freeze_level: fraction of the freezable modules (all but the head)
            frozen by the end of training.
        eval_every: steps between schedule checks (default: every step; a
            check costs nothing).
        freeze_at: as in `FreezingCallback`; `"step"` by default, so that
            the schedule is followed to the step.
        probe_size, modules, refresh_batch_norm, log_dir, backup_dir,
            seed, verbose: as in `FreezingCallback`.

    Example:
    >>> model.fit(x, y, epochs=20, callbacks=[tf_hwopt.FreezeOutCallback(freeze_start=0.5)])
    """

    TAG = "freezeout"
    STATE_FILE = "freezeout_state.json"

    def __init__(
        self,
        probe_data=None,
        *,
        freeze_start: float = 0.5,
        freeze_level: float = 1.0,
        freeze_at: str = "step",
        **kwargs,
    ):
        super().__init__(probe_data, freeze_at=freeze_at, **kwargs)
        check_fraction("freeze_start", freeze_start, allow_zero=True)
        check_fraction("freeze_level", freeze_level)
        self.freeze_start = float(freeze_start)
        self.freeze_level = float(freeze_level)

    def _default_eval_every(self) -> int:
        return 1

    def _make_policy(self) -> FreezeOutPolicy:
        if self.total_steps is None:
            raise ValueError(
                "FreezeOutCallback schedules freezing by training progress, so the number "
                "of steps must be known: pass `steps_per_epoch` to fit, or data of known size."
            )
        return FreezeOutPolicy(
            len(self.modules),
            total_steps=self.total_steps,
            freeze_start=self.freeze_start,
            freeze_level=self.freeze_level,
        )
