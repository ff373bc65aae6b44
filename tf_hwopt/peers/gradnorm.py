"""`GradientNormFreezeCallback`: freezing by the gradient-norm change rate.

AutoFreeze (Liu et al. 2021) and PipeTransformer (He et al., ICML 2021)
freeze a front layer once its gradient norm stops changing. Every
`eval_every` steps this callback computes each active module's gradient norm
on a fixed batch of training data and freezes the frontmost active module
when the relative change of its norm since the previous evaluation has stayed
below `tolerance` for `patience` evaluations. It is a peer Egeria is
measured against, and it runs on the same freezing engine.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np
import tensorflow as tf

from tf_hwopt._checks import check_fraction, check_positive_int, check_positive_number
from tf_hwopt.freezing.callback import FreezingCallback
from tf_hwopt.freezing.policy import Decision, FreezingPolicy


def gradient_norm_change_rate(previous: float, current: float) -> float:
    """|current - previous| / previous; `inf` when undefined.

    Example:
    >>> gradient_norm_change_rate(2.0, 1.5)
    0.25
    """
    if not (math.isfinite(previous) and math.isfinite(current)) or previous <= 0:
        return math.inf
    return abs(current - previous) / previous


class GradientNormPolicy(FreezingPolicy):
    """The decision of `GradientNormFreezeCallback`, as a pure object.

    Freezes the frontmost active module once the relative change of its
    gradient norm between evaluations has stayed below `tolerance` for
    `patience` evaluations (never before `bootstrap_steps`).

    Example:
    >>> policy = GradientNormPolicy(3, tolerance=0.1, patience=1)
    >>> policy.observe(0, [1.0, 1.0, 1.0]).freeze, policy.observe(1, [1.05, 2.0, 1.0]).freeze
    ((), (0,))
    """

    def __init__(self, num_modules, *, tolerance=0.1, patience=2, bootstrap_steps=0, max_frozen_fraction=0.8):
        check_positive_number("tolerance", tolerance)
        check_positive_int("patience", patience)
        check_fraction("max_frozen_fraction", max_frozen_fraction)
        super().__init__(num_modules, max_frozen_fraction=max_frozen_fraction)
        self.tolerance = float(tolerance)
        self.patience = patience
        self.bootstrap_steps = bootstrap_steps
        self._previous = [math.nan] * num_modules
        self._calm = 0
        self.last_rate = math.inf

    def observe(self, step: int, values: Sequence[float] = (), learning_rate: float | None = None) -> Decision:
        """Feeds the gradient norm of every module at `step`."""
        self.evaluations += 1
        k = self.num_frozen
        rate = gradient_norm_change_rate(self._previous[k], float(values[k])) if k < self.num_modules else math.inf
        self._previous = [float(v) for v in values]
        self.last_rate = rate
        if k >= self.max_frozen or step < self.bootstrap_steps:
            return Decision()
        self._calm = self._calm + 1 if rate < self.tolerance else 0
        if self._calm < self.patience:
            return Decision()
        self.num_frozen += 1
        self._calm = 0
        return Decision(
            freeze=(k,),
            reason=f"gradient-norm change rate {rate:.4f} below {self.tolerance:g} for {self.patience} evaluations",
            details={"change_rate": rate},
        )

    def get_state(self) -> dict:
        return {
            **super().get_state(),
            "previous": [v if math.isfinite(v) else None for v in self._previous],
            "calm": self._calm,
        }

    def set_state(self, state: dict) -> None:
        super().set_state(state)
        self._previous = [math.nan if v is None else float(v) for v in state["previous"]]
        self._calm = int(state["calm"])


class GradientNormFreezeCallback(FreezingCallback):
    """Freezes the frontmost module whose gradient norm has stopped changing.

    Args:
        probe_data: `(x, y)` to draw the fixed gradient batch from (arrays,
            or a `tf.data.Dataset` of `(x, y)`). Default: the data given to
            `fit`.
        probe_size: examples in the gradient batch.
        eval_every: steps between evaluations (default: a quarter epoch).
        tolerance: relative change of the gradient norm counted as calm.
        patience: consecutive calm evaluations before a freeze.
        bootstrap_steps: no freezing before this step (default: 10% of
            training, at least one epoch).
        max_frozen_fraction: at most this fraction of modules freezes.
        modules, refresh_batch_norm, log_dir, backup_dir, seed, verbose:
            as in `FreezingCallback`.

    Example:
    >>> model.fit(x, y, epochs=20, callbacks=[tf_hwopt.GradientNormFreezeCallback()])
    """

    TAG = "gradnorm"
    STATE_FILE = "gradnorm_state.json"
    VALUE_NAME = "grad_norms"
    LABELLED_PROBE = True

    def __init__(
        self,
        probe_data=None,
        *,
        tolerance: float = 0.1,
        patience: int = 2,
        bootstrap_steps: int | None = None,
        max_frozen_fraction: float = 0.8,
        **kwargs,
    ):
        super().__init__(probe_data, **kwargs)
        GradientNormPolicy(2, tolerance=tolerance, patience=patience, max_frozen_fraction=max_frozen_fraction)
        self.tolerance = tolerance
        self.patience = patience
        self.bootstrap_steps = bootstrap_steps
        self.max_frozen_fraction = max_frozen_fraction
        self._grad_norms = None

    def _make_policy(self) -> GradientNormPolicy:
        return GradientNormPolicy(
            len(self.modules),
            tolerance=self.tolerance,
            patience=self.patience,
            bootstrap_steps=self._resolve_bootstrap(self.bootstrap_steps),
            max_frozen_fraction=self.max_frozen_fraction,
        )

    def _setup(self, first_fit: bool) -> None:
        self._grad_norms = self._make_grad_norms()

    def _make_grad_norms(self):
        model = self.model
        groups = [[v for layer in m.layers for v in layer.trainable_weights] for m in self.modules]
        x, y = self.probe

        @tf.function(autograph=False)
        def grad_norms():
            variables = [v for g in groups for v in g]
            with tf.GradientTape() as tape:
                y_pred = model(x, training=False)
                loss = model.compute_loss(x=x, y=y, y_pred=y_pred, training=False)
            grads = tape.gradient(loss, variables)
            norms, start = [], 0
            for g in groups:
                part = [gr for gr in grads[start : start + len(g)] if gr is not None]
                start += len(g)
                norms.append(tf.linalg.global_norm(part) if part else tf.constant(0.0))
            return tf.stack(norms)

        return grad_norms

    def _measure(self) -> list[float]:
        return [float(v) for v in np.asarray(self._grad_norms())]

    def _after_evaluation(self, decision) -> None:
        # Gradients of frozen modules are not needed; the tape still sees
        # them as constants, so the traced function is rebuilt after a freeze.
        if decision is not None and decision.freeze:
            self._grad_norms = self._make_grad_norms()
