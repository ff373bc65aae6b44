"""`GradientNormFreezeCallback`: freezing by the gradient-norm change rate.

AutoFreeze (Liu et al. 2021) and PipeTransformer (He et al., ICML 2021)
freeze a front layer once its gradient norm stops changing. Every
`eval_every` steps this callback computes each active module's gradient norm
on a fixed batch of training data and freezes the frontmost active module
when the relative change of its norm since the previous evaluation has stayed
below `threshold` for `patience` evaluations. It is a peer Egeria is
measured against, and it runs on the same freezing engine.
"""

from __future__ import annotations

import math

import numpy as np

from tf_hwopt.egeria.freezing_callback import FreezingCallback, fit_argument
from tf_hwopt.egeria.policy import check_fraction, check_positive_int, check_positive_number, max_frozen_modules


def gradient_norm_change_rate(previous: float, current: float) -> float:
    """|current - previous| / previous; `inf` when undefined.

    Example:
    >>> gradient_norm_change_rate(2.0, 1.5)
    0.25
    """
    if not (math.isfinite(previous) and math.isfinite(current)) or previous <= 0:
        return math.inf
    return abs(current - previous) / previous


class GradientNormPolicy:
    """The decision of `GradientNormFreezeCallback`, as a pure object.

    Example:
    >>> policy = GradientNormPolicy(3, threshold=0.1, patience=1)
    >>> policy.observe(0, [1.0, 1.0, 1.0]), policy.observe(1, [1.05, 2.0, 1.0])
    ((), (0,))
    """

    def __init__(self, num_modules, *, threshold=0.05, patience=2, bootstrap_steps=0, max_frozen_fraction=0.8):
        check_positive_number("threshold", threshold)
        check_positive_int("patience", patience)
        check_fraction("max_frozen_fraction", max_frozen_fraction)
        self.num_modules = num_modules
        self.threshold = float(threshold)
        self.patience = patience
        self.bootstrap_steps = bootstrap_steps
        self.max_frozen = max_frozen_modules(num_modules, max_frozen_fraction)
        self.num_frozen = 0
        self._previous = [math.nan] * num_modules
        self._calm = 0
        self.last_rate = math.inf

    def observe(self, step: int, norms) -> tuple:
        """Feeds the gradient norm of every module; returns modules to freeze."""
        k = self.num_frozen
        rate = gradient_norm_change_rate(self._previous[k], float(norms[k])) if k < self.num_modules else math.inf
        self._previous = [float(v) for v in norms]
        self.last_rate = rate
        if k >= self.max_frozen or step < self.bootstrap_steps:
            return ()
        self._calm = self._calm + 1 if rate < self.threshold else 0
        if self._calm < self.patience:
            return ()
        self.num_frozen += 1
        self._calm = 0
        return (k,)


    def reject(self, index: int) -> None:
        """Module `index`, just decided, was not frozen after all: take the decision back."""
        if index == self.num_frozen - 1:
            self.num_frozen -= 1
            self._calm = 0


class GradientNormFreezeCallback(FreezingCallback):
    """Freezes the frontmost module whose gradient norm has stopped changing.

    Args:
        data: `(x, y)` arrays to draw the fixed gradient batch from. Default:
            the `x` and `y` given to `fit` (NumPy arrays).
        batch_size: examples in the gradient batch.
        eval_every: steps between evaluations (default: a quarter epoch).
        threshold: relative change of the gradient norm counted as calm.
        patience: consecutive calm evaluations before a freeze.
        bootstrap_steps: no freezing before this step (default: 10% of
            training, at least one epoch).
        max_frozen_fraction: at most this fraction of modules freezes.
        seed: seed of the batch choice.
        modules, log_dir, verbose: as in `FreezingCallback`.

    Example:
    >>> model.fit(x, y, epochs=20, callbacks=[tf_hwopt.GradientNormFreezeCallback()])
    """

    def __init__(
        self,
        data=None,
        *,
        batch_size: int = 256,
        eval_every: int | None = None,
        threshold: float = 0.1,
        patience: int = 2,
        bootstrap_steps: int | None = None,
        max_frozen_fraction: float = 0.8,
        seed: int = 0,
        **kwargs,
    ):
        super().__init__(**kwargs)
        check_positive_int("batch_size", batch_size)
        check_positive_int("eval_every", eval_every, allow_none=True)
        GradientNormPolicy(2, threshold=threshold, patience=patience, max_frozen_fraction=max_frozen_fraction)
        self.data = data
        self.batch_size = batch_size
        self.eval_every = eval_every
        self.threshold = threshold
        self.patience = patience
        self.bootstrap_steps = bootstrap_steps
        self.max_frozen_fraction = max_frozen_fraction
        self.seed = seed
        self.policy: GradientNormPolicy | None = None
        self.history: list[dict] = []
        self._batch = None

    def _sample_input(self):
        if self._batch is None:
            self._batch = _draw_labelled_batch(self.data, self.model, self.batch_size, self.seed)
        return self._batch[0]

    def _setup(self, first_fit: bool) -> None:
        self._sample_input()
        if first_fit:
            self.policy = GradientNormPolicy(
                len(self.modules),
                threshold=self.threshold,
                patience=self.patience,
                bootstrap_steps=self._resolve_bootstrap(self.bootstrap_steps),
                max_frozen_fraction=self.max_frozen_fraction,
            )
        self._every = self._resolve_eval_every(self.eval_every)
        self._next_eval = self._step + self._every
        self._grad_norms = self._make_grad_norms()

    def _on_freeze_refused(self, index: int) -> None:
        self.policy.reject(index)

    def _make_grad_norms(self):
        import tensorflow as tf

        model = self.model
        groups = [[v for layer in m.layers for v in layer.trainable_weights] for m in self.modules]
        x, y = self._batch

        @tf.function
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

    def _after_step(self) -> None:
        if self._step < self._next_eval or self.policy.num_frozen >= self.policy.max_frozen:
            return
        while self._next_eval <= self._step:
            self._next_eval += self._every
        # Gradients of frozen modules are not needed; the tape still sees
        # them as constants, so the traced function is rebuilt after a freeze.
        norms = [float(v) for v in np.asarray(self._grad_norms())]
        frozen = self.policy.observe(self._step, norms)
        self.history.append({"step": self._step, "grad_norms": norms, "frozen": self.policy.num_frozen})
        if frozen:
            frozen = self._freeze(
                frozen,
                f"gradient-norm change rate {self.policy.last_rate:.4f} below {self.threshold:g} "
                f"for {self.patience} evaluations",
                change_rate=self.policy.last_rate,
            )
            self._grad_norms = self._make_grad_norms()


def _draw_labelled_batch(data, model, size, seed):
    """A fixed `(x, y)` batch from `data` or from the running fit's `x`, `y`."""
    if data is None:
        what = "labelled NumPy data for its gradient batch: pass `data=(x, y)`"
        data = (fit_argument(model, "x", what), fit_argument(model, "y", what))
    x, y = (np.asarray(a) for a in data)
    if size > len(y):
        raise ValueError(f"`batch_size`={size} is larger than the training data ({len(y)} examples).")
    idx = np.sort(np.random.RandomState(seed).choice(len(y), size, replace=False))
    return x[idx], y[idx]
