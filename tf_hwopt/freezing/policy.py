"""The policy contract: what every freezing policy offers the freezing callback.

A policy is a pure object fed with numbers (one value per module, or none);
it answers each evaluation with a `Decision`. It holds no TensorFlow object,
so it can be tested, replayed on a recorded run, and saved as JSON.
`FreezingCallback` does everything else: scheduling, history, events,
TensorBoard, backup and resume, and the freeze itself.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence


@dataclasses.dataclass(frozen=True)
class Decision:
    """What a policy decided at one evaluation.

    Attributes:
        freeze: indices of modules to freeze now (front to back).
        unfreeze: indices of modules to re-open now.
        skipped: True when the evaluation was ignored (non-finite values).
        reason: a human-readable reason when something happened.
        window: the values that justified a freeze (policy-specific).
        relative_slope: for slope-based policies, the slope behind a freeze.
        details: further JSON-serialisable facts recorded with the event.
    """

    freeze: tuple = ()
    unfreeze: tuple = ()
    skipped: bool = False
    reason: str = ""
    window: tuple = ()
    relative_slope: float | None = None
    details: dict = dataclasses.field(default_factory=dict)


def max_frozen_modules(num_modules: int, max_frozen_fraction: float) -> int:
    """How many modules a cap of `max_frozen_fraction` allows (never the head).

    Example:
    >>> max_frozen_modules(5, 0.4), max_frozen_modules(2, 1.0)
    (2, 1)
    """
    return min(num_modules - 1, int(math.floor(max_frozen_fraction * num_modules + 1e-9)))


class FreezingPolicy:
    """Base class of the policies: front-to-back freezing of `num_modules` modules.

    Subclasses implement `observe` and extend `get_state`/`set_state` with
    what they keep. `num_frozen` counts the frozen front modules.

    Example:
    >>> class Every(FreezingPolicy):
    ...     def observe(self, step, values=(), learning_rate=None):
    ...         if self.num_frozen < self.max_frozen:
    ...             self.num_frozen += 1
    ...             return Decision(freeze=(self.num_frozen - 1,), reason="always")
    ...         return Decision()
    """

    def __init__(self, num_modules: int, *, max_frozen_fraction: float = 0.8):
        if isinstance(num_modules, bool) or not isinstance(num_modules, int) or num_modules < 2:
            raise ValueError(
                f"`num_modules` must be an integer >= 2 (modules that can freeze plus "
                f"the head). Received: num_modules={num_modules!r}"
            )
        self.num_modules = num_modules
        self.max_frozen_fraction = float(max_frozen_fraction)
        self.num_frozen = 0
        self.evaluations = 0

    @property
    def max_frozen(self) -> int:
        """How many modules may be frozen at most (the head never is)."""
        return max_frozen_modules(self.num_modules, self.max_frozen_fraction)

    @property
    def settled(self) -> bool:
        """True when no future evaluation can change anything."""
        return self.num_frozen >= self.max_frozen

    def observe(self, step: int, values: Sequence[float] = (), learning_rate: float | None = None) -> Decision:
        """Feeds one evaluation at training `step`; returns what to do now."""
        raise NotImplementedError

    def earliest_freeze_step(self, step: int, interval: int) -> int | None:
        """The soonest step the next freeze can happen, evaluating every `interval` steps (None: never).

        The callback weighs what that freeze could still save against the
        evaluations needed to get there (`tf_hwopt.freezing.budget`). Default:
        the next evaluation.
        """
        return None if self.settled else step + interval

    def get_state(self) -> dict:
        """A JSON-serialisable snapshot (for resuming)."""
        return {"num_modules": self.num_modules, "num_frozen": self.num_frozen, "evaluations": self.evaluations}

    def set_state(self, state: dict) -> None:
        """Restores a snapshot made by `get_state`."""
        if state.get("num_modules") != self.num_modules:
            raise ValueError(
                f"{type(self).__name__} state is for {state.get('num_modules')} modules, but this model "
                f"has {self.num_modules}; it was saved for a different model or partition."
            )
        self.num_frozen = int(state["num_frozen"])
        self.evaluations = int(state["evaluations"])
