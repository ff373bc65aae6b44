"""The freeze decision: a pure object fed with plasticity values.

Egeria freezes the frontmost still-trainable module once its plasticity has
stopped changing. `EgeriaPolicy` keeps, for every module, a sliding window of
its last plasticity values; it fits a least-squares line to the window of the
frontmost active module and calls the module converged when the slope,
relative to the window's mean, stays within `tolerance` for `patience`
consecutive evaluations. With `level` set, an evaluation also counts as
converged when the module's plasticity has fallen to `level` times the
highest it has shown (a Transformer's embedding keeps falling geometrically
with no flat stretch for the slope test to find; docs/benchmarks.md). It
never freezes during the bootstrap period (the
critical learning period), never on NaN or on a window that is not yet full,
never the head, never past `max_frozen_fraction` of the modules, and at most
one module per evaluation. When `reopen_lr_factor` is set, a learning-rate
drop by at least that factor since the last freeze re-opens every frozen
module (the training dynamics change; they are re-evaluated).

The policy holds no TensorFlow object: feed it numbers, get decisions.
"""

from __future__ import annotations

import collections
import math
from typing import Sequence

from tf_hwopt._checks import check_fraction, check_positive_int, check_positive_number
from tf_hwopt.freezing.policy import Decision, FreezingPolicy


def relative_slope(values: Sequence[float]) -> float:
    """Least-squares slope of `values` (per step of x = 0, 1, ...) over their mean.

    A module whose plasticity changes by 5% of its level per evaluation has a
    relative slope of about +-0.05. Returns `inf` for fewer than 2 values or
    a zero mean with a nonzero slope, and 0.0 for an all-zero window.

    Example:
    >>> relative_slope([2.0, 2.0, 2.0])
    0.0
    >>> relative_slope([1.0, 2.0, 3.0])
    0.5
    """
    n = len(values)
    if n < 2:
        return math.inf
    mean_x = (n - 1) / 2.0
    mean_y = sum(values) / n
    sxx = sum((i - mean_x) ** 2 for i in range(n))
    sxy = sum((i - mean_x) * (y - mean_y) for i, y in enumerate(values))
    slope = sxy / sxx
    if mean_y == 0.0:
        return 0.0 if slope == 0.0 else math.inf
    return slope / abs(mean_y)


class EgeriaPolicy(FreezingPolicy):
    """Decides which module to freeze from a stream of plasticity values.

    Args:
        num_modules: number of modules, including the head (at least 2).
        window: number of recent plasticity values the slope is fitted to.
        tolerance: the largest |relative slope| per evaluation that counts as
            converged (> 0).
        patience: consecutive converged evaluations needed before a freeze.
        bootstrap_steps: no freezing before this training step.
        max_frozen_fraction: at most this fraction of all modules is frozen.
        reopen_lr_factor: re-open all frozen modules when the learning rate
            has fallen by this factor since the last freeze (`None`: never).
        level: an evaluation also counts as converged when the candidate's
            plasticity is at most `level` times its highest so far (`None`:
            the slope test alone, as in the paper).

    Example:
    >>> policy = EgeriaPolicy(num_modules=4, window=3, patience=2, tolerance=0.05)
    >>> for step, values in enumerate(stream):
    ...     decision = policy.observe(step * 100, values)
    ...     if decision.freeze:
    ...         freeze(decision.freeze)
    """

    def __init__(
        self,
        num_modules: int,
        *,
        window: int = 8,
        tolerance: float = 0.15,
        patience: int = 2,
        bootstrap_steps: int = 0,
        max_frozen_fraction: float = 0.8,
        reopen_lr_factor: float | None = None,
        level: float | None = None,
    ):
        super().__init__(num_modules, max_frozen_fraction=max_frozen_fraction)
        if level is not None:
            check_fraction("level", level)
        check_positive_int("window", window)
        if window < 2:
            raise ValueError(f"`window` must be at least 2 to fit a slope. Received: window={window}")
        check_positive_int("patience", patience)
        check_positive_number("tolerance", tolerance)
        if isinstance(bootstrap_steps, bool) or not isinstance(bootstrap_steps, int) or bootstrap_steps < 0:
            raise ValueError(
                f"`bootstrap_steps` must be an integer >= 0. Received: bootstrap_steps={bootstrap_steps!r}"
            )
        check_fraction("max_frozen_fraction", max_frozen_fraction)
        if reopen_lr_factor is not None and (
            not isinstance(reopen_lr_factor, (int, float)) or not reopen_lr_factor > 1
        ):
            raise ValueError(
                "`reopen_lr_factor` must be a number > 1 or None. "
                f"Received: reopen_lr_factor={reopen_lr_factor!r}"
            )
        self.window = window
        self.tolerance = float(tolerance)
        self.patience = patience
        self.bootstrap_steps = bootstrap_steps
        self.reopen_lr_factor = reopen_lr_factor
        self._windows = [collections.deque(maxlen=window) for _ in range(num_modules)]
        self._stable = [0] * num_modules
        self._lr_at_freeze: float | None = None
        self.level = None if level is None else float(level)
        self._peak = [0.0] * num_modules

    @property
    def settled(self) -> bool:
        """True when no future evaluation can change anything (cap reached, no re-opening)."""
        return self.num_frozen >= self.max_frozen and self.reopen_lr_factor is None

    def window_of(self, module: int) -> list[float]:
        return list(self._windows[module])

    def observe(
        self, step: int, plasticity: Sequence[float], learning_rate: float | None = None
    ) -> Decision:
        """Feeds one evaluation: the plasticity of every module at `step`.

        Values of frozen modules are ignored (pass anything, e.g. NaN). Of
        the active ones, the frontmost (the candidate) must be measured;
        modules behind it may be NaN (not measured at this evaluation: their
        windows wait). An infinite value skips the evaluation.
        """
        if len(plasticity) != self.num_modules:
            raise ValueError(
                f"`plasticity` must have one value per module ({self.num_modules}); "
                f"got {len(plasticity)}."
            )
        active = [float(v) for v in plasticity[self.num_frozen :]]
        if not active or not math.isfinite(active[0]) or any(math.isinf(v) for v in active):
            return Decision(skipped=True, reason="non-finite plasticity; evaluation skipped")
        self.evaluations += 1
        if learning_rate is not None and self._lr_at_freeze is None:
            self._lr_at_freeze = float(learning_rate)
        if (
            self.reopen_lr_factor is not None
            and learning_rate is not None
            and self.num_frozen > 0
            and learning_rate * self.reopen_lr_factor <= self._lr_at_freeze * (1 + 1e-9)
        ):
            reopened = tuple(range(self.num_frozen))
            reason = (
                f"learning rate fell from {self._lr_at_freeze:g} to {learning_rate:g} "
                f"(>= {self.reopen_lr_factor:g}x): re-opening modules {list(reopened)}"
            )
            self.num_frozen = 0
            self._lr_at_freeze = float(learning_rate)
            for w in self._windows:
                w.clear()
            self._stable = [0] * self.num_modules
            return Decision(unfreeze=reopened, reason=reason)
        for offset, value in enumerate(active):
            if not math.isnan(value):
                self._windows[self.num_frozen + offset].append(value)
                self._peak[self.num_frozen + offset] = max(self._peak[self.num_frozen + offset], value)
        candidate = self.num_frozen
        if candidate >= self.max_frozen or step < self.bootstrap_steps:
            return Decision()
        values = self._windows[candidate]
        if len(values) < self.window:
            return Decision()
        slope = relative_slope(list(values))
        low = self.level is not None and values[-1] <= self.level * self._peak[candidate]
        if abs(slope) <= self.tolerance or low:
            self._stable[candidate] += 1
        else:
            self._stable[candidate] = 0
        if self._stable[candidate] < self.patience:
            return Decision()
        self.num_frozen += 1
        if learning_rate is not None:
            self._lr_at_freeze = float(learning_rate)
        return Decision(
            freeze=(candidate,),
            reason=(
                f"relative slope {slope:+.4f} within +-{self.tolerance:g}"
                + (f" or plasticity at most {self.level:g} of its peak" if self.level is not None else "")
                + f" for {self.patience} evaluations"
            ),
            window=tuple(values),
            relative_slope=slope,
        )

    def evaluations_to_freeze(self) -> int | None:
        """Evaluations the candidate needs at the least before it can freeze (None: it never can).

        Its window must fill, then its slope stay within tolerance for
        `patience` evaluations (the bootstrap period aside).

        Example:
        >>> EgeriaPolicy(4, window=3, patience=2).evaluations_to_freeze()
        4
        """
        candidate = self.num_frozen
        if candidate >= self.max_frozen:
            return None
        filled = len(self._windows[candidate])
        if filled < self.window:
            return self.window - filled + self.patience - 1
        return max(1, self.patience - self._stable[candidate])

    def earliest_freeze_step(self, step: int, interval: int) -> int | None:
        """The soonest step the candidate can freeze, evaluating every `interval` steps (None: never)."""
        needed = self.evaluations_to_freeze()
        if needed is None:
            return None
        return max(step + needed * interval, self.bootstrap_steps)

    def get_state(self) -> dict:
        """A JSON-serialisable snapshot (for resuming)."""
        return {
            **super().get_state(),
            "windows": [list(w) for w in self._windows],
            "stable": list(self._stable),
            "lr_at_freeze": self._lr_at_freeze,
            "peak": list(self._peak),
        }

    def set_state(self, state: dict) -> None:
        """Restores a snapshot made by `get_state`."""
        super().set_state(state)
        self._windows = [collections.deque(w, maxlen=self.window) for w in state["windows"]]
        self._stable = [int(s) for s in state["stable"]]
        self._lr_at_freeze = state["lr_at_freeze"]
        self._peak = [float(p) for p in state.get("peak", [0.0] * self.num_modules)]


def replay(policy: EgeriaPolicy, history: Sequence[dict], *, lookahead: int | None = None) -> list[tuple[int, int]]:
    """Feeds a recorded run's plasticity to `policy`; returns its freezes as `(module, step)`.

    `history` is `EgeriaCallback.history` (or the `history` of a benchmark
    run): entries with `step` and `plasticity` (None where not measured).
    With `lookahead=L`, only the candidate and the `L` modules behind it are
    shown to the policy, as `EgeriaCallback` measures them; None shows every
    recorded value. Re-opening is not replayed.

    Example:
    >>> replay(EgeriaPolicy(6, bootstrap_steps=157), run["history"], lookahead=2)
    [(0, 390), (1, 546), (2, 624), (3, 1053)]
    """
    freezes = []
    for entry in history:
        values = [math.nan if v is None else float(v) for v in entry["plasticity"]]
        k = policy.num_frozen
        if lookahead is not None:
            values = [v if k <= i <= k + lookahead else math.nan for i, v in enumerate(values)]
        if k < len(values) and math.isnan(values[k]):
            continue  # the candidate was not measured then
        decision = policy.observe(entry["step"], values)
        freezes.extend((module, entry["step"]) for module in decision.freeze)
    return freezes
