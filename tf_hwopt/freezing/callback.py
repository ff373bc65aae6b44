"""`FreezingCallback`: the base of every freezing policy inside `model.fit`.

One freezing mechanism, several policies. This base class owns what every
policy shares: the module partition, the `FreezingEngine` (the only code that
flips `trainable` and rebuilds the train function), the probe batch, step
counting that works with `steps_per_execution`, evaluation scheduling, the
history of measured values, the event list, the BatchNormalization refresh
before a freeze, the FLOP accounting, the overhead clock, TensorBoard,
`backup_dir` save and restore, stepping aside (one warning) when something
fails, and handing the model back fully trainable at the end of `fit`.

A subclass supplies a `FreezingPolicy` (`_make_policy`) and what to measure
at each evaluation (`_measure`); the policy answers with a `Decision`. See
`EgeriaCallback`, `FreezeOutCallback` and `GradientNormFreezeCallback`.
"""

from __future__ import annotations

import json
import math
import os
import time
import warnings
from typing import Sequence

import keras
import tensorflow as tf

from tf_hwopt import _internals
from tf_hwopt._checks import check_positive_int
from tf_hwopt._io import write_json_atomic
from tf_hwopt.freezing.budget import (
    cache_rebuild_seconds,
    evaluation_cost,
    releases_held_freezes,
    saving_scale,
    stretched_interval,
    worth_evaluating,
)
from tf_hwopt.freezing.batch_norm import BatchNormRefresher, batch_norm_layers
from tf_hwopt.freezing.engine import FreezingEngine
from tf_hwopt.freezing.modules import graph_kind, partition_modules
from tf_hwopt.freezing.policy import Decision, FreezingPolicy
from tf_hwopt.freezing.probe import ProbeSizeError, draw_probe


def timed(method):
    """Adds the wall time spent in a callback hook to the callback's overhead.

    Re-entrant: a timed hook calling another timed hook counts once.
    """

    def wrapper(self, *args, **kwargs):
        if self._timing_depth:
            return method(self, *args, **kwargs)
        self._timing_depth += 1
        start = time.perf_counter()
        try:
            return method(self, *args, **kwargs)
        finally:
            self._timing_depth -= 1
            self._overhead_seconds += time.perf_counter() - start

    wrapper.__name__ = method.__name__
    wrapper.__doc__ = method.__doc__
    return wrapper


_STATE_VERSION = 1
#: Steps timed with and without freezes before their ratio scales the saving estimates.
_MIN_TIMED_STEPS = 20

_FREEZE_AT = ("epoch_end", "step")
_KEPT_SNAPSHOTS = 3


class _ProbeUnavailable(ValueError):
    """No probe batch can be drawn from the data `fit` was given (and none was passed)."""


class _ModuleCount(float):
    """The `frozen_modules` entry of the Keras logs: a number that prints as a count.

    Keras's progress bar formats every logged value with `%.4f` (or `%.4e`
    near zero) after dividing it by 1; this float keeps its type through that
    division and formats as an integer, so the bar shows `frozen_modules: 2`.
    Everything else (History, CSVLogger, TensorBoard) sees a plain number.
    """

    def __truediv__(self, other):
        return _ModuleCount(float(self) / other)

    def __format__(self, spec):
        return str(int(round(self)))


class FreezingCallback(keras.callbacks.Callback):
    """Base class of the freezing callbacks (subclass it for a new policy).

    Subclasses implement `_make_policy()` (a `FreezingPolicy`, built once the
    modules are known) and `_measure()` (the values fed to the policy at an
    evaluation, one per module, or None to skip it). They may override
    `_setup(first_fit)`, `_after_evaluation(decision)`, `_teardown()`,
    `_extra_state()`/`_load_extra_state(state)` and extend `summary()`.

    Args:
        probe_data: data to draw the fixed probe batch from, in a form
            `model.fit` takes: inputs (NumPy arrays or a list/dict of them),
            `(x, y)` for policies that need labels, a `tf.data.Dataset` or a
            `keras.utils.PyDataset`. Default: the data passed to `fit` (a
            Python generator cannot be read twice: pass `probe_data` with one).
        probe_size: examples in the probe batch.
        modules: explicit partition, a list of lists of layer names front to
            back (required for subclassed models). Default: automatic.
        eval_every: steps between evaluations. Default: the policy's.
        overhead_budget: the largest share of training time evaluations may
            take; the interval between them is lengthened to stay within it.
            Besides, evaluation stops for good when the next freeze could no
            longer repay the evaluations it needs (the summary says when and
            why; see `tf_hwopt.freezing.budget`). None: neither, evaluate
            every `eval_every` steps whatever it costs.
        refresh_batch_norm: before a module freezes, set its
            BatchNormalization layers' moving statistics to those of their
            input on the probe batch, so that the frozen module computes what
            training computed (see `_freeze`).
        freeze_at: when a freeze decided during an epoch takes effect (and
            a subclass's other one-off work, see `_epoch_end_work`):
            `"epoch_end"` (default; in a fit's last epoch, or when the epoch
            length is unknown, at once) or `"step"` (at once). A freeze
            rebuilds the train function, whose re-tracing holds up the
            epoch's tf.data iterator for seconds; with TensorFlow 2.21 such a
            pause made the iterator's release at the next epoch start wait
            6.5-10 s more, about half the time (docs/egeria.md).
        log_dir: if set, TensorBoard scalars are written there.
        backup_dir: if set, the policy's state is saved there at each epoch
            end and restored when `fit` resumes (pass the `backup_dir` of
            your `keras.callbacks.BackupAndRestore`).
        seed: seed of the probe batch choice.
        verbose: 1 prints each freeze, 0 is silent.
    """

    #: The file in `backup_dir` that holds this callback's state.
    STATE_FILE = "freezing_state.json"
    #: The name of the measured values in history and TensorBoard.
    VALUE_NAME = "value"
    #: The TensorBoard tag prefix of this policy's scalars.
    TAG = "freezing"
    #: Whether the probe batch needs labels (`(x, y)`).
    LABELLED_PROBE = False
    #: Whether a freeze that costs more to take effect alone (a train-function
    #: rebuild) than to wait for the next one is held, to take effect with it
    #: in one rebuild (see `_freeze_or_hold`). Off for the peers, which reproduce
    #: their published methods.
    HOLDS_UNPAID_FREEZES = False

    def __init__(
        self,
        probe_data=None,
        *,
        probe_size: int = 128,
        modules: Sequence[Sequence[str]] | None = None,
        eval_every: int | None = None,
        overhead_budget: float | None = 0.02,
        refresh_batch_norm: bool = True,
        freeze_at: str = "epoch_end",
        log_dir: str | None = None,
        backup_dir: str | None = None,
        seed: int = 0,
        verbose: int = 1,
    ):
        super().__init__()
        if modules is not None and (isinstance(modules, (str, bytes)) or len(modules) < 2):
            raise ValueError(
                "`modules` must list at least 2 modules (lists of layer names), front "
                f"to back; the last is the head, which never freezes. Received: modules={modules!r}"
            )
        check_positive_int("probe_size", probe_size)
        if probe_size < 2:
            raise ValueError(f"`probe_size` must be at least 2. Received: probe_size={probe_size}")
        check_positive_int("eval_every", eval_every, allow_none=True)
        if overhead_budget is not None and (
            isinstance(overhead_budget, bool)
            or not isinstance(overhead_budget, (int, float))
            or not 0 < overhead_budget < 1
        ):
            raise ValueError(
                f"`overhead_budget` must be a fraction in (0, 1) or None. Received: overhead_budget={overhead_budget!r}"
            )
        if not isinstance(refresh_batch_norm, bool):
            raise ValueError(f"`refresh_batch_norm` must be True or False. Received: {refresh_batch_norm!r}")
        if freeze_at not in _FREEZE_AT:
            raise ValueError(f"`freeze_at` must be one of {_FREEZE_AT}. Received: freeze_at={freeze_at!r}")
        self.probe_data = probe_data
        self.probe_size = probe_size
        self.module_names = modules
        self.eval_every = eval_every
        self.overhead_budget = overhead_budget
        self.refresh_batch_norm = refresh_batch_norm
        self.freeze_at = freeze_at
        self.log_dir = log_dir
        self.backup_dir = backup_dir
        self.seed = seed
        self.verbose = verbose

        self.modules = None
        self.engine: FreezingEngine | None = None
        self.policy: FreezingPolicy | None = None
        self.events: list[dict] = []
        self.history: list[dict] = []
        self.evaluations = 0
        self.skipped_evaluations = 0
        # Set (to the reason) when evaluating stopped because no further
        # freeze could repay its cost; frozen modules stay frozen.
        self.evaluation_stopped: str | None = None
        self.evaluation_seconds = 0.0
        self._evaluation_costs: list[float] = []
        # Set by a subclass during an evaluation that traced or built something
        # (a first call): its cost is left out of the estimate of the next ones.
        self._one_off_work = False
        self._interval = None
        # This fit's clock: its start, our overhead then, its steps, its first step.
        self._fit_clock = None
        # What rebuilding the train function after a freeze costs: measured on
        # the first step after one (None until then).
        self._rebuild_seconds: float | None = None
        self._rebuilds_seen = 0
        # Set by `fit_with_cache` while it trains: each change of the frozen
        # set also rebuilds the activation cache, which the holds and the
        # stop rule count as part of the rebuild.
        self.rebuilds_cache = False
        # Timed steps of this fit, [frozen FLOPs share, seconds, steps]: with
        # nothing frozen (`_base_phase`) and since the last rebuild (`_phase`).
        self._base_phase: list | None = None
        self._phase: list | None = None
        # The share of the FLOPs estimate of a freeze's saving measured (`saving_scale`).
        self._saving_scale: float | None = None
        # Set when the callback stepped aside (it cannot handle this model):
        # training goes on, nothing more is frozen.
        self.disabled_reason: str | None = None
        self._fit_data = None
        self._probe = None
        self._writer = None
        self._step = 0
        self._epoch = 0
        self._last_batch = -1
        self._next_eval = None
        self._eval_every = None
        self._frozen_flops_steps = 0.0
        self._timing_depth = 0
        self._overhead_seconds = 0.0
        self._wall_start = None
        self._wall_seconds = 0.0
        self._final = None
        self._undo_finalize_hook = _no_op
        self._resume_checked = False
        self._setup_pending = False
        self._batch_norm_refreshers: dict = {}
        # Modules frozen when the last fit ended, frozen again by the next fit.
        self._frozen_between_fits: list[int] = []
        # Freezes decided during this epoch, applied at its end (`freeze_at`).
        self._pending_freezes: list[tuple] = []
        # Freezes decided but held, to share a rebuild with the next
        # (`_freeze_or_hold`): (indices, reason, details with `decided_step`).
        self._held: list[tuple] = []

    # ----------------------------------------------------------- subclass API

    def _make_policy(self) -> FreezingPolicy:
        """The policy, once `self.modules` and the fit's length are known."""
        raise NotImplementedError

    def _measure(self) -> Sequence[float] | None:
        """The values fed to the policy at this evaluation (None: skip it)."""
        return ()

    def _default_eval_every(self) -> int:
        """Steps between evaluations when `eval_every` is None: a quarter epoch (200 if unknown)."""
        steps = self.steps_per_epoch
        return max(1, steps // 4) if steps else 200

    def _setup(self, first_fit: bool) -> None:
        """Called at train begin, once modules, engine and policy exist."""

    def _after_evaluation(self, decision: Decision | None) -> None:
        """Called after each evaluation (`decision` is None when it was skipped)."""

    def _teardown(self) -> None:
        """Called at train end (release threads, files...)."""

    def _epoch_end_work(self) -> None:
        """Called at an epoch end that another epoch follows: one-off work put off until then."""

    def _extra_state(self) -> dict:
        """What a subclass saves with the policy's state in `backup_dir`."""
        return {}

    def _load_extra_state(self, state: dict) -> None:
        """Restores what `_extra_state` saved."""

    def _after_restore(self) -> None:
        """Called once the state was restored from `backup_dir` and the frozen modules frozen again."""

    def provide_data(self, x, y=None) -> None:
        """Hands the callback the training data of a fit that does not run through `model.fit`.

        Drivers such as `fit_with_cache` and `fit_multi_worker` call it so that
        the probe batch comes from the data being trained on, as it would in
        `model.fit`. An explicit `probe_data` still wins.
        """
        self._fit_data = (x, y)

    @property
    def probe(self):
        """The fixed probe batch: inputs, or `(x, y)` for a policy that needs labels."""
        if self._probe is None:
            self._probe = self._draw_probe()
        return self._probe

    @property
    def probe_inputs(self):
        """The probe batch's inputs."""
        return self.probe[0] if self.LABELLED_PROBE else self.probe

    def _draw_probe(self):
        try:
            input_ndim = len(self.model.inputs[0].shape)
        except (AttributeError, ValueError, IndexError, TypeError):
            input_ndim = None
        data = self.probe_data
        explicit = data is not None
        if data is None and self._fit_data is not None:
            data = self._fit_data if self.LABELLED_PROBE else self._fit_data[0]
        if data is None:
            x = _internals.fit_argument(self.model, "x")
            if x is None:
                raise _ProbeUnavailable("the training data of this fit could not be found")
            y = _internals.fit_argument(self.model, "y")
            data = (x, y) if self.LABELLED_PROBE and y is not None else x
        try:
            if self.LABELLED_PROBE and not (isinstance(data, tuple) and len(data) == 2) and not isinstance(
                data, (tf.data.Dataset, keras.utils.PyDataset)
            ):
                raise ValueError(
                    "labelled probe data is needed: `probe_data=(x, y)`, or a tf.data.Dataset or PyDataset of (x, y)"
                )
            return draw_probe(
                data, self.probe_size, seed=self.seed, input_ndim=input_ndim, labelled=self.LABELLED_PROBE
            )
        except ProbeSizeError:
            raise  # the user's own argument: a clear error before training time is spent
        except ValueError as err:
            if explicit:
                raise  # the user's own argument, as above
            # Data `fit` takes but we cannot draw from (a Python generator: read once).
            raise _ProbeUnavailable(str(err)) from err

    @property
    def steps_per_epoch(self) -> int | None:
        """Steps per epoch of this fit, when Keras knows it."""
        return self.params.get("steps") if self.params else None

    @property
    def total_steps(self) -> int | None:
        """Training steps this fit will run, when Keras knows it."""
        epochs = self.params.get("epochs") if self.params else None
        return self.steps_per_epoch * epochs if self.steps_per_epoch and epochs else None

    def _resolve_bootstrap(self, value: int | None) -> int:
        """`value`, or 10% of training and at least one epoch (0 when unknown)."""
        if value is not None:
            return value
        return max(self.steps_per_epoch, int(0.1 * self.total_steps)) if self.total_steps else 0

    # ------------------------------------------------------------ evaluation

    def _after_step(self) -> None:
        if self._step < self._next_eval or self.policy.settled or self.evaluation_stopped:
            return
        start = time.perf_counter()
        self._one_off_work = False
        self._evaluate()
        cost = time.perf_counter() - start
        self.evaluation_seconds += cost
        if not self._one_off_work:
            # Evaluations that traced or built something once are no estimate of the next ones.
            self._evaluation_costs = (self._evaluation_costs + [cost])[-3:]
        self._plan_next_evaluation()
        if not self._defers_to_epoch_end():
            self._release_held()

    def _step_seconds(self) -> float | None:
        """Seconds per training step in this fit, without our hooks and the first (tracing) step."""
        clock = self._fit_clock
        if clock is None or clock["first_step"] is None or clock["steps"] <= clock["first_steps"]:
            return None
        elapsed = time.perf_counter() - clock["start"] - (self._overhead_seconds - clock["overhead"])
        return max(0.0, elapsed - clock["first_step"]) / (clock["steps"] - clock["first_steps"])

    def _repays(self, earliest, interval: int, cost: float, shares, step_seconds: float,
                freeze_seconds: float = 0.0, setup_seconds: float = 0.0, shared_rebuilds: bool | None = None) -> bool:
        """Whether freezes from step `earliest` on can still repay evaluations of `cost` every `interval` steps.

        Freezes share rebuilds where they are held to (`HOLDS_UNPAID_FREEZES`), unless `shared_rebuilds` says.
        """
        return earliest is not None and worth_evaluating(
            flops_shares=shares,
            step_seconds=step_seconds,
            step=self._step,
            total_steps=self.total_steps,
            earliest_freeze_step=earliest,
            interval=interval,
            evaluation_seconds=cost,
            freeze_seconds=freeze_seconds,
            setup_seconds=setup_seconds,
            shared_rebuilds=self.HOLDS_UNPAID_FREEZES if shared_rebuilds is None else shared_rebuilds,
        )

    def _plan_next_evaluation(self) -> None:
        """Schedules the next evaluation within `overhead_budget`; stops evaluating when it cannot pay."""
        cost = evaluation_cost(self._evaluation_costs)
        step_seconds = self._step_seconds()
        interval = self._eval_every
        if cost is not None and step_seconds:
            interval = stretched_interval(self._eval_every, cost, step_seconds, self.overhead_budget)
        self._interval = interval
        self._next_eval = self._step + interval
        if cost is None:
            return
        total = self.total_steps
        earliest = self.policy.earliest_freeze_step(self._step, interval)
        if self.overhead_budget is None or self.policy.settled or total is None or not step_seconds:
            return
        shares = self._candidate_flops_shares()
        if earliest is not None and shares is None:
            return  # FLOPs unknown: no estimate, evaluation goes on
        # Measured costs only: a rebuild counts once one has been timed, and
        # until then the stand-in measured in its place (`_rebuild_stand_in`).
        rebuild = self._rebuild_estimate()
        if self._repays(earliest, interval, cost, self._saving_shares(shares), step_seconds, rebuild):
            return
        module = self.policy.num_frozen
        self.evaluation_stopped = (
            f"evaluation stopped at step {self._step}: module {module} cannot freeze before the end"
            if earliest is None or earliest >= total
            else f"evaluation stopped at step {self._step}: freezing module {module} (at step {earliest} at the "
            f"soonest) and the ones behind it ({100 * sum(shares):.1f}% of the FLOPs) would save less than the "
            f"{math.ceil((earliest - self._step) / interval)} evaluation(s) ({cost:.3f} s each) and the "
            f"train-function rebuilds ({rebuild:.2f} s each) they need"
        )
        self._say(f"{self.evaluation_stopped}.")

    def _say(self, message: str) -> None:
        """Prints `message` after the callback's name when `verbose`."""
        if self.verbose:
            print(f"{type(self).__name__}: {message}", flush=True)

    def _start_phase(self, share: float | None) -> None:
        """Starts timing steps at the frozen FLOPs `share` (none timed if FLOPs are unknown)."""
        self._phase = None if share is None else [share, 0.0, 0]
        if self._phase is not None and share == 0 and self._base_phase is None:
            self._base_phase = self._phase

    def _time_step(self, seconds: float, steps: int) -> None:
        """Adds a timed step (from one batch end to the next, our hooks left out) to the phase.

        Once `_MIN_TIMED_STEPS` steps are timed both with nothing frozen and
        with the present freezes, `_saving_scale` is what they realized of
        the FLOPs estimate (`saving_scale`; kept if too small to tell).
        """
        phase, base = self._phase, self._base_phase
        phase[1] += seconds
        phase[2] += steps
        if phase is base or base is None or min(phase[2], base[2]) < _MIN_TIMED_STEPS:
            return
        scale = saving_scale(base[1] / base[2], phase[1] / phase[2], phase[0])
        if scale is not None:
            self._saving_scale = scale

    def _saving_shares(self, shares: Sequence[float]) -> list[float]:
        """FLOPs `shares` scaled by the measured `_saving_scale` (as they are until one is measured)."""
        scale = 1.0 if self._saving_scale is None else self._saving_scale
        return [scale * share for share in shares]

    def _rebuild_estimate(self, cache: bool = True) -> float:
        """Seconds the next freeze's rebuild costs: the train function's (the one timed, else the stand-in),
        and under `fit_with_cache` (unless `cache=False`) the cache's (`cache_rebuild_seconds`, for the
        prefix up to the candidate)."""
        rebuild = self._rebuild_seconds if self._rebuild_seconds is not None else self._rebuild_stand_in()
        if not (cache and self.rebuilds_cache):
            return rebuild
        step_seconds = self._step_seconds()
        share = self._flops_share(range(min(self.policy.num_frozen, self.policy.max_frozen - 1) + 1))
        if share is None or not step_seconds or not self.steps_per_epoch:
            return rebuild
        return rebuild + cache_rebuild_seconds(share, step_seconds, self.steps_per_epoch)

    def _rebuild_stand_in(self) -> float:
        """Seconds a train-function rebuild is taken to cost before one has been timed.

        A third of the fit's first step beyond a plain one: that step traces
        the train function as a rebuild does, and also starts the input
        pipeline and initialises kernels. Measured: MNIST-1D ResNet, first
        step 5.3 s, rebuild 1.7 s; ResNet50V2 at 32x32, first step about
        15 s, rebuilds 5-8 s.
        """
        clock, step_seconds = self._fit_clock, self._step_seconds() or 0.0
        if clock is None or clock["first_step"] is None:
            return 0.0
        return max(0.0, clock["first_step"] - clock["first_steps"] * step_seconds) / 3.0

    def _flops_share(self, indices) -> float | None:
        """The share of the model's forward FLOPs in modules `indices` (None if unknown)."""
        total = sum(m.flops or 0.0 for m in self.modules)
        flops = [self.modules[i].flops for i in indices]
        if not total or None in flops:
            return None
        return sum(flops) / total

    def _candidate_flops_shares(self) -> list[float] | None:
        """FLOPs shares of the modules that may still freeze, front to back (None if unknown)."""
        shares = [self._flops_share([i]) for i in range(self.policy.num_frozen, self.policy.max_frozen)]
        held = self._flops_share(self._held_modules)
        if not shares or held is None or None in shares:
            return None
        shares[0] += held  # the held modules freeze with the candidate
        return shares

    def _evaluate(self) -> None:
        self.evaluations += 1
        values = self._measure()
        decision = None
        if values is not None:
            k = self.policy.num_frozen
            decision = self.policy.observe(self._step, values, self._learning_rate())
            if len(values):
                self.history.append(
                    {
                        "step": self._step,
                        "epoch": self._epoch,
                        self.VALUE_NAME: [float(v) if math.isfinite(v) else None for v in values],
                        "frozen": k,
                    }
                )
            self._apply(decision)
            if self._writer is not None and len(values):
                with self._writer.as_default(step=self._step):
                    for i, value in enumerate(values):
                        if math.isfinite(value):
                            tf.summary.scalar(f"{self.TAG}/{self.VALUE_NAME}/module_{i}", value)
                    tf.summary.scalar(f"{self.TAG}/frozen_modules", self.engine.num_frozen)
        self._after_evaluation(decision)

    def _learning_rate(self) -> float | None:
        try:
            return float(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate))
        except (AttributeError, TypeError, ValueError):
            return None

    def _apply(self, decision: Decision) -> None:
        if decision.skipped:
            self.skipped_evaluations += 1
            warnings.warn(
                f"{type(self).__name__}: {decision.reason} at step {self._step}; this evaluation "
                "cannot lead to a freeze.",
                RuntimeWarning,
                stacklevel=3,
            )
            return
        details = dict(decision.details)
        if decision.window:
            details["window"] = [float(v) for v in decision.window]
        if decision.relative_slope is not None:
            details["relative_slope"] = decision.relative_slope
        if decision.unfreeze:
            self._held = []  # re-opened in the policy's eyes too: their convergence is to be shown again
            changed = self.engine.unfreeze(decision.unfreeze)
            self._record("unfreeze", changed, decision.reason, details)
        if decision.freeze:
            if self._defers_to_epoch_end():
                self._pending_freezes.append((tuple(decision.freeze), decision.reason, self._step, details))
            else:
                self._freeze_or_hold([(decision.freeze, decision.reason, details)])

    def _defers_to_epoch_end(self) -> bool:
        """Whether one-off work (a freeze, a subclass's build) decided now waits for the epoch end.

        Per `freeze_at`, and only if another epoch follows. Work that holds up
        training for seconds mid-epoch makes the release of the epoch's
        tf.data iterator stall at the next epoch start (see `freeze_at`).
        """
        epochs = self.params.get("epochs") if self.params else None
        return self.freeze_at == "epoch_end" and bool(self.steps_per_epoch) and bool(epochs) and (
            self._epoch + 1 < epochs
        )

    def _apply_pending_freezes(self) -> None:
        pending, self._pending_freezes = self._pending_freezes, []
        if pending:
            self._freeze_or_hold(
                [(indices, reason, {**details, "decided_step": decided}) for indices, reason, decided, details in pending]
            )

    @property
    def _held_modules(self) -> list[int]:
        return [i for indices, *_ in self._held for i in indices]

    def _freeze_or_hold(self, groups) -> tuple:
        """Freezes the modules of `groups`, `(indices, reason, details)`, now or with the next in one rebuild.

        Each freeze rebuilds (re-traces) the train function: seconds on a
        large model, more than a small module saves in the steps it waits
        for the next (ResNet50V2's stem, 3% of the FLOPs: its re-trace took
        5-10 s). With `HOLDS_UNPAID_FREEZES`, a decided freeze joins those
        held, and they take effect together when `_release_held` says so;
        until then the modules go on training and the policy goes on to the
        next module. The events of freezes that waited carry their
        `decided_step`. Returns the modules frozen.
        """
        groups = [(tuple(indices), reason, dict(details)) for indices, reason, details in groups]
        if not self.HOLDS_UNPAID_FREEZES:
            return self._freeze(groups)
        for _, _, details in groups:
            details.setdefault("decided_step", self._step)
        self._held.extend(groups)
        changed = self._release_held()
        if not changed:
            self._say(
                f"module(s) {[i for indices, *_ in groups for i in indices]} converged (epoch {self._epoch}); "
                "the freeze is held, to share a train-function rebuild with the next."
            )
        return changed

    def _release_held(self) -> tuple:
        """Freezes the held modules if `releases_held_freezes` says so; returns the modules frozen.

        Checked when a freeze is decided and at each epoch end (with
        `freeze_at="step"`, after each evaluation too). The next freeze can
        come no sooner than the policy's earliest step, rounded up to an
        epoch end when freezes wait for one, and never once the policy is
        settled or evaluation stopped. Where the saving cannot be estimated
        (no budget, unknown FLOPs, length or step time), nothing is held.
        """
        if not self._held:
            return ()
        step_seconds, total = self._step_seconds(), self.total_steps
        shares = [self._flops_share(indices) for indices, *_ in self._held]
        if self.overhead_budget is None or not step_seconds or total is None or None in shares:
            released = True
        else:
            next_step = None
            if not (self.policy.settled or self.evaluation_stopped):
                next_step = self.policy.earliest_freeze_step(self._step, self._interval or self._eval_every)
            spe = self.steps_per_epoch
            if next_step is not None and self._defers_to_epoch_end():
                next_step = self._step + spe * max(1, math.ceil((next_step - self._step) / spe))
            shares = self._saving_shares(shares)
            released = releases_held_freezes(
                [(share, details["decided_step"]) for share, (_, _, details) in zip(shares, self._held)],
                step=self._step,
                step_seconds=step_seconds,
                total_steps=total,
                # The train function's rebuild alone: the cache is extended module
                # by module, so its forward passes cost the same held or not.
                rebuild_seconds=self._rebuild_estimate(cache=False),
                next_freeze_step=next_step,
            )
        if not released:
            return ()
        groups, self._held = self._held, []
        for _, _, details in groups:
            if details["decided_step"] == self._step:
                del details["decided_step"]  # it did not wait
        return self._freeze(groups)

    # ---------------------------------------------------------------- freezing

    def _freeze(self, groups) -> tuple:
        """Freezes the modules of `groups`, `(indices, reason, details)` front to back, in one rebuild.

        Returns the modules frozen.

        Unless `refresh_batch_norm=False`, the BatchNormalization layers of
        the modules about to freeze first get the statistics of their input
        on the probe batch (`batch_norm.py`: a frozen one normalizes with its
        moving statistics, which may still lag far behind; seen to collapse
        training accuracy from 66% to 10%). How far they were
        (`batch_norm_drift`, the largest in the module) is recorded with the
        event.
        """
        self._one_off_work = True  # a freeze is no estimate of the next evaluations' cost
        indices = [i for group in groups for i in group[0]]
        drifts = self._refresh_batch_norm(indices) if self.refresh_batch_norm else {}
        changed = self.engine.freeze(indices)
        for group_indices, reason, details in groups:
            for i in group_indices:
                if i in changed:
                    extra = {} if drifts.get(i) is None else {"batch_norm_drift": drifts[i]}
                    self._record("freeze", (i,), reason, {**details, **extra})
        return changed

    def _refresh_batch_norm(self, indices: Sequence[int]) -> dict:
        """Sets the modules' BatchNormalization moving statistics to the probe's, in one call; their largest drifts."""
        owners = [(i, layer) for i in indices for layer in batch_norm_layers(self.modules[i].layers)]
        if not owners:
            return {}
        try:
            probe = self.probe_inputs
        except _ProbeUnavailable:
            return {}  # no probe data: nothing to refresh from
        key = tuple(indices)
        if key not in self._batch_norm_refreshers:
            self._batch_norm_refreshers[key] = BatchNormRefresher(self.model, [layer for _, layer in owners])
        drifts: dict = {}
        for (i, _), drift in zip(owners, self._batch_norm_refreshers[key](probe)):
            drifts[i] = max(drifts.get(i, drift), drift)
        return drifts

    def _record(self, kind, indices, reason, details) -> None:
        for i in indices:
            event = {
                "kind": kind,
                "module": i,
                "module_name": self.modules[i].name,
                "step": self._step,
                "epoch": self._epoch,
                "reason": reason,
                **details,
            }
            self.events.append(event)
            # Same epoch number as `events` and Keras's logs (0-based),
            # on a line of its own after the progress bar's.
            self._say(f"{kind} module {i} ({self.modules[i].name}) at step {self._step} (epoch {self._epoch}): {reason}")

    # ------------------------------------------------------------ Keras hooks

    @timed
    def on_train_begin(self, logs=None):
        self._wall_start = time.perf_counter()
        self._fit_clock = {
            "start": self._wall_start,
            "overhead": self._overhead_seconds,
            "steps": 0,
            "first_step": None,
            "first_steps": 0,
        }
        if self.engine is not None and self._final is None:
            # The last fit ended in an exception, before `_end_of_fit`: carry on with its freezes.
            self._frozen_between_fits = [i for i, f in enumerate(self.engine.frozen) if f]
        self._final = None
        self._phase = self._base_phase = None
        if getattr(self.model, "optimizer", None) is None:
            raise ValueError(f"{type(self).__name__} needs a compiled model (call `model.compile` first).")
        if self.module_names is None and graph_kind(self.model) == "subclassed":
            raise ValueError(
                f"{type(self).__name__}: model {self.model.name!r} is a subclassed model, whose layer "
                "graph cannot be inspected. Pass `modules`, a list of lists of its layer names "
                "ordered front to back, e.g. modules=[['conv1', 'bn1'], ['block1'], ['head']]."
            )
        self._undo_finalize_hook = _internals.before_optimizer_finalize(self.model, self._end_of_fit)
        if self.disabled_reason is not None:
            return
        # Keras builds an unbuilt (subclassed) model in its first training
        # step: the partition waits for it.
        self._setup_pending = not self.model.built
        if not self._setup_pending:
            self._start()

    def _start(self) -> None:
        """Partition, engine, policy and the subclass's setup, once the model is built."""
        self._setup_pending = False
        first_fit = self.modules is None
        try:
            if first_fit:
                try:
                    sample = self.probe_inputs if graph_kind(self.model) == "subclassed" else None
                except _ProbeUnavailable:
                    sample = None  # FLOPs then stay unknown; the setup below reports the missing probe
                self.modules = partition_modules(self.model, self.module_names, sample_input=sample)
            self.engine = FreezingEngine(self.model, self.modules)
            self._rebuilds_seen = 0
            self._batch_norm_refreshers = {}
            if self.log_dir and self._writer is None:
                self._writer = tf.summary.create_file_writer(self.log_dir)
            if first_fit:
                self.policy = self._make_policy()
            self._setup(first_fit)
        except _ProbeUnavailable as err:
            self._disable(f"no probe batch: {err}")
            return
        except ValueError:
            raise  # a bad argument or bad data: the user's to fix, before training time is spent
        except Exception as err:  # noqa: BLE001 - whatever else fails, fit goes on
            self._disable(f"setup failed ({type(err).__name__}: {_first_line(err)})")
            return
        self._eval_every = self.eval_every or self._default_eval_every()
        self._next_eval = self._step + self._eval_every
        self._resume_checked = False
        # A callback reused for another fit (e.g. one fit per phase) carries on
        # with what it had frozen: no step of the next fit trains those modules.
        self.engine.freeze([i for i in self._frozen_between_fits if not self.engine.frozen[i]])

    def _disable(self, cause: str) -> None:
        """Steps aside for the rest of training, with one warning naming the cause."""
        if self.disabled_reason is not None:
            return
        self.disabled_reason = cause
        warnings.warn(
            f"{type(self).__name__} stopped: {cause}. Training goes on without further freezing"
            + (f" ({self.engine.num_frozen} module(s) stay frozen)." if self.engine and self.engine.num_frozen else "."),
            RuntimeWarning,
            stacklevel=2,
        )

    @property
    def active(self) -> bool:
        """Whether the callback is set up and has not stepped aside."""
        return self.engine is not None and self.disabled_reason is None and not self._setup_pending

    @timed
    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch
        self._last_batch = -1
        if self._fit_clock is not None:
            # The gap across an epoch end holds validation, not a rebuild; a
            # rebuild at the epoch end is timed from here to the first step.
            rebuilt = self.engine is not None and self.engine.rebuilds > self._rebuilds_seen
            self._fit_clock["last"] = time.perf_counter() if rebuilt else None
        if not self._resume_checked and self.active:
            self._resume_checked = True
            if epoch > 0 and self.backup_dir:
                self._restore(epoch)

    @timed
    def on_train_batch_end(self, batch, logs=None):
        # With steps_per_execution > 1, Keras reports the last step of each execution.
        done = batch - self._last_batch if batch > self._last_batch else batch + 1
        self._last_batch = batch
        self._step += done
        clock = self._fit_clock
        clock["steps"] += done
        now = time.perf_counter()
        rebuilt = self.engine is not None and self.engine.rebuilds > self._rebuilds_seen
        if clock["first_step"] is None:
            # The first call of the train function: Keras traces it (left out of the step time).
            clock["first_step"] = now - clock["start"] - (self._overhead_seconds - clock["overhead"])
            clock["first_steps"] = done
        elif rebuilt and clock.get("last"):
            # The step after a freeze ran the rebuilt (re-traced) train function.
            step_seconds = self._step_seconds() or 0.0
            self._rebuild_seconds = max(0.0, now - clock["last"] - done * step_seconds)
        elif clock.get("last") and self._phase is not None:
            self._time_step(now - clock["last"], done)
        if self.engine is not None:
            self._rebuilds_seen = self.engine.rebuilds
        if self._setup_pending and self.disabled_reason is None:
            self._start()
        if self.engine is None:
            return
        share = self.engine.frozen_flops_fraction()
        if share is not None:
            self._frozen_flops_steps += share * done
        if rebuilt or self._phase is None:
            self._start_phase(share)
        if self.active:
            try:
                self._after_step()
            except Exception as err:  # noqa: BLE001 - a failure of ours never ends fit
                self._disable(f"{type(err).__name__} at step {self._step}: {_first_line(err)}")
        if logs is not None:
            logs["frozen_modules"] = _ModuleCount(self.engine.num_frozen)
        clock["last"] = time.perf_counter()

    @timed
    def on_epoch_end(self, epoch, logs=None):
        if self.engine is None:
            return
        if self.active:
            epochs = self.params.get("epochs") if self.params else None
            if epochs is None or epoch + 1 < epochs:
                try:
                    self._apply_pending_freezes()
                    self._release_held()
                    self._epoch_end_work()
                except Exception as err:  # noqa: BLE001 - a failure of ours never ends fit
                    self._disable(f"{type(err).__name__} at the end of epoch {epoch}: {_first_line(err)}")
        if logs is not None:
            logs["frozen_modules"] = _ModuleCount(self.engine.num_frozen)
        if self._writer is not None:
            with self._writer.as_default(step=self._step):
                tf.summary.scalar("freezing/frozen_modules", self.engine.num_frozen)
        if self.backup_dir and self.policy is not None:
            self._save(epoch + 1)

    @timed
    def on_train_end(self, logs=None):
        self._wall_seconds += time.perf_counter() - self._wall_start
        self._teardown()
        self._undo_finalize_hook()
        self._undo_finalize_hook = _no_op
        self._end_of_fit()
        if self._writer is not None:
            self._writer.flush()

    def _end_of_fit(self) -> None:
        """Records what is frozen and makes every module trainable again; once per fit.

        Runs when `fit` finalizes the optimizer's variables (just before
        `on_train_end`): an optimizer with `use_ema=True` pairs the model's
        trainable variables with its averages by position there.
        """
        if self.engine is None or self._final is not None:
            return
        self._final = self._frozen_state()
        # Freezes decided in the last epoch take effect in the next fit, if any.
        pending = [i for indices, *_ in self._pending_freezes for i in indices] if self.active else []
        self._pending_freezes = []
        self._frozen_between_fits = sorted({i for i, f in enumerate(self.engine.frozen) if f} | set(pending))
        self.engine.restore()

    # ----------------------------------------------------------------- resume

    def _state_path(self) -> str:
        return os.path.join(self.backup_dir, self.STATE_FILE)

    def _snapshot(self) -> dict:
        return {
            "policy": self.policy.get_state(),
            "step": self._step,
            "evaluations": self.evaluations,
            "events": self.events,
            "history": self.history,
            "skipped_evaluations": self.skipped_evaluations,
            "evaluation_stopped": self.evaluation_stopped,
            "frozen_flops_steps": self._frozen_flops_steps,
            "held": [[list(indices), reason, details] for indices, reason, details in self._held],
            "extra": self._extra_state(),
        }

    def _read_state(self) -> dict | None:
        path = self._state_path()
        if not os.path.exists(path):
            return None
        try:
            with open(path) as f:
                state = json.load(f)
            if state.get("version") != _STATE_VERSION or not isinstance(state.get("snapshots"), dict):
                raise ValueError("unknown layout")
        except (OSError, ValueError) as err:
            raise ValueError(
                f"{type(self).__name__} state file {path!r} is corrupted or not a freezing state ({err}). "
                "It was left untouched; move it away to restart the freezing decisions from scratch."
            ) from err
        return state

    def _save(self, next_epoch: int) -> None:
        os.makedirs(self.backup_dir, exist_ok=True)
        state = self._read_state() or {"version": _STATE_VERSION, "snapshots": {}}
        state["num_modules"] = len(self.modules)
        state["module_layers"] = [m.layer_names for m in self.modules]
        state["snapshots"][str(next_epoch)] = self._snapshot()
        keep = sorted(state["snapshots"], key=int)[-_KEPT_SNAPSHOTS:]
        state["snapshots"] = {k: state["snapshots"][k] for k in keep}
        # Atomic: a kill during the write leaves the previous file intact.
        write_json_atomic(state, self._state_path(), indent=None)

    def _restore(self, epoch: int) -> None:
        state = self._read_state()
        if state is None:
            warnings.warn(
                f"{type(self).__name__}: fit resumes at epoch {epoch + 1} but {self._state_path()!r} has no "
                "saved state; freezing decisions start from scratch.",
                RuntimeWarning,
                stacklevel=3,
            )
            return
        if state.get("module_layers") != [m.layer_names for m in self.modules]:
            raise ValueError(
                f"{type(self).__name__} state file {self._state_path()!r} was saved for other modules "
                f"({state.get('module_layers')}); this model's modules are "
                f"{[m.layer_names for m in self.modules]}."
            )
        usable = [int(k) for k in state["snapshots"] if int(k) <= epoch]
        if not usable:
            return
        snap = state["snapshots"][str(max(usable))]
        self.policy.set_state(snap["policy"])
        self._step = int(snap["step"])
        self.evaluations = int(snap["evaluations"])
        self.events = list(snap["events"])
        self.history = list(snap["history"])
        self.skipped_evaluations = int(snap["skipped_evaluations"])
        self.evaluation_stopped = snap.get("evaluation_stopped")
        self._frozen_flops_steps = float(snap["frozen_flops_steps"])
        self._load_extra_state(snap.get("extra", {}))
        self._next_eval = self._step + self._eval_every
        self._held = [(tuple(group[0]), *group[1:]) for group in snap.get("held", [])]
        # The policy counts the held modules as frozen; they train until they freeze.
        self.engine.freeze_prefix(self.policy.num_frozen - len(self._held_modules))
        self._after_restore()
        self._say(f"resumed at epoch {epoch + 1} with {self.policy.num_frozen} frozen module(s).")

    # ----------------------------------------------------------------- report

    def _frozen_state(self) -> dict:
        """Frozen modules and their FLOPs share: at the end of fit, or now."""
        if self._final is not None:
            return self._final
        return {
            "frozen_modules": self.engine.num_frozen,
            "frozen_flops_fraction": self.engine.frozen_flops_fraction(),
        }

    @property
    def frozen_prefix(self) -> int:
        """Consecutive frozen modules from the front: now during fit, or at the end of the last fit."""
        if self.engine is None:
            return 0
        if self._final is None:
            return self.engine.frozen_prefix
        k = 0
        while k in self._frozen_between_fits:
            k += 1
        return k

    @property
    def num_frozen(self) -> int:
        """Modules frozen now (during fit) or at the end of the last fit."""
        return self._frozen_state()["frozen_modules"] if self.engine is not None else 0

    def summary(self) -> dict:
        """What the callback did, as a JSON-serialisable dict.

        Keys: `modules` (layers, parameters, share of forward FLOPs);
        `frozen_modules` at the end; `events`; `backward_flops_skipped_fraction`
        (averaged over all training steps) and
        `final_backward_flops_skipped_fraction`; `overhead_fraction` (share of
        fit's wall time the training thread spent in this callback) and the
        seconds behind it; `train_function_rebuilds` and `rebuild_seconds`
        (the first one timed); `held_modules` (converged, their freeze held
        to share a rebuild with the next, see `_freeze_or_hold`);
        `saving_scale` (the share of the FLOPs estimate of the saving that
        the steps timed after a freeze realized; None until measured);
        `status` (`"not started"`, `"active"` or `"disabled"`) and `disabled_reason`;
        `eval_every`, `evaluations`, `skipped_evaluations`. Works at any time,
        before `fit` too.
        """
        wall = self._wall_seconds or (time.perf_counter() - self._wall_start if self._wall_start else 0.0)
        if self.modules is None or self.engine is None:
            # Before fit, or a fit that never got as far as the partition.
            return {
                "strategy": type(self).__name__,
                "status": "disabled" if self.disabled_reason else "not started",
                "disabled_reason": self.disabled_reason,
                "modules": [] if self.modules is None else [m.layer_names for m in self.modules],
                "num_modules": 0 if self.modules is None else len(self.modules),
                "frozen_modules": 0,
                "events": list(self.events),
                "steps": self._step,
                "overhead_seconds": self._overhead_seconds,
                "wall_seconds": wall,
                "overhead_fraction": (self._overhead_seconds / wall) if wall else 0.0,
            }
        final = self._frozen_state()
        return {
            "strategy": type(self).__name__,
            "status": "disabled" if self.disabled_reason else "active",
            "disabled_reason": self.disabled_reason,
            "modules": [
                {
                    "index": m.index,
                    "name": m.name,
                    "layers": m.layer_names,
                    "params": m.params,
                    "flops_share": self._flops_share([i]),
                }
                for i, m in enumerate(self.modules)
            ],
            "num_modules": len(self.modules),
            "frozen_modules": final["frozen_modules"],
            "events": self.events,
            "steps": self._step,
            "backward_flops_skipped_fraction": (self._frozen_flops_steps / self._step) if self._step else 0.0,
            "final_backward_flops_skipped_fraction": final["frozen_flops_fraction"],
            "overhead_seconds": self._overhead_seconds,
            "wall_seconds": wall,
            "overhead_fraction": (self._overhead_seconds / wall) if wall else 0.0,
            "train_function_rebuilds": self.engine.rebuilds,
            "eval_every": self._eval_every or self.eval_every,
            "eval_interval": self._interval or self._eval_every or self.eval_every,
            "evaluations": self.evaluations,
            "evaluation_seconds": self.evaluation_seconds,
            "rebuild_seconds": self._rebuild_seconds,
            "held_modules": self._held_modules,
            "saving_scale": self._saving_scale,
            "evaluation_stopped": self.evaluation_stopped,
            "skipped_evaluations": self.skipped_evaluations,
        }


def _no_op() -> None:
    pass


def _first_line(err: BaseException, limit: int = 300) -> str:
    lines = str(err).strip().splitlines()
    return lines[0][:limit] if lines else ""
