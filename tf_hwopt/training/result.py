"""`TrainingResult`: what the training drivers return."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class TrainingResult:
    """What `fit_with_cache` and `fit_multi_worker` return.

    Attributes:
        history: metric name -> one value per epoch, as `History.history`.
        phases: the driver's phases (for `fit_with_cache`, one per change of
            the cached prefix; for `fit_multi_worker`, one for the run).
        details: driver-specific facts (`fit_with_cache`: the cache's mode,
            size and build time; `fit_multi_worker`: frozen modules and
            aggregated gradient tensors per step, whether this worker is the
            chief, seconds).
        freezer: the freezing callback's `summary()`, or None without one.

    `result["history"]`, `result["phases"]` and the keys of `details` can also
    be read by subscript.

    Example:
    >>> result = fit_with_cache(model, x, y, epochs=10, freezer=egeria)
    >>> result.history["loss"][-1], result.freezer["frozen_modules"]
    """

    history: dict
    phases: list
    details: dict
    freezer: dict | None = None

    def __getitem__(self, key: str):
        if key in ("history", "phases", "details", "freezer"):
            return getattr(self, key)
        return self.details[key]
