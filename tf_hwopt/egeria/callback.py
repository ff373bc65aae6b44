"""`EgeriaCallback`: knowledge-guided layer freezing inside `model.fit`."""

from __future__ import annotations

import math
import time

import numpy as np
import tensorflow as tf

from tf_hwopt._checks import check_positive_int
from tf_hwopt.egeria.plasticity import sp_loss
from tf_hwopt.egeria.policy import EgeriaPolicy
from tf_hwopt.egeria.reference import REFERENCE_MODES, Reference, ReferenceBuild, ReferenceUnavailable
from tf_hwopt.freezing.budget import stretched_interval
from tf_hwopt.freezing.callback import FreezingCallback
from tf_hwopt.freezing.probe import ActivationReader

STATE_FILE = "egeria_state.json"
# Modules measured behind the candidate, so that the next ones' windows are
# full when the candidate freezes. With 2, replaying recorded runs that
# measured every module gives the same freezes (tests/test_budget.py); with
# 1, a module freezing within `window` evaluations of the one before it
# would wait for its window to fill.
_LOOKAHEAD = 2
# One evaluation (reference refresh, reads, SP losses) against one read of the
# training model's prefix, measured on the benchmark workloads (evaluation
# cost once traced / pre-flight read). With the one-call read and refresh of
# the TFMOT path (2026-12-06): 11.8 ms / 5 ms = 2.4 on finetune-mnist1d
# (3.4 with the SP losses, 2026-12-07); the int8-weights clone: 3.8 on charlm
# before it had a one-call path, 2.0 with it (80 ms / 40 ms, 2026-12-07).
# The higher one, rounded up: a reference built and then not repaid costs
# 5-10% of a short run. (Before the one-call path: 7 to 10 on the MNIST-1D ResNet.)
_EVALUATION_PER_READ = 4.0
# Building the reference model (tf_keras rebuild, quantization, first trace)
# against the first call of the training model's prefix reader (its trace and
# one read), measured at d70f9e0: 0.98 s / 0.068 s = 14x on the MNIST-1D
# ResNet, 0.96 s / 0.28 s = 3.4x on charlm. The higher one: a build that
# cannot be repaid costs 5-10% of a fine-tuning run (finetune-mnist1d).
_BUILD_PER_TRACE = 15.0
# The longest build (as the pre-flight estimates it) that runs mid-epoch on
# the training thread when one-off work waits for the epoch end
# (`freeze_at="epoch_end"`): pauses of 1.5 s did not stall the epoch's
# tf.data iterator (0 of 4), pauses of 3.3 s did (2 of 4; docs/egeria.md).
# A longer one runs on a background thread while training goes on where it
# should end before the epoch does (TFMOT's path), else at the epoch end. Built
# mid-epoch, the reference's window fills during the bootstrap, and front
# modules converged by then freeze an epoch sooner.
_MID_EPOCH_BUILD_SECONDS = 1.5


def _seconds(reader: ActivationReader, x) -> float:
    """Wall seconds of one call of `reader` on `x`."""
    start = time.perf_counter()
    reader(x)
    return time.perf_counter() - start


class EgeriaCallback(FreezingCallback):
    """Freezes converged front modules during `model.fit` (Egeria, EuroSys 2023).

    Every `eval_every` training steps the callback measures the *plasticity*
    of the frontmost still-trainable module (the candidate) and of the two
    behind it: the SP loss between its output on a fixed probe batch in the
    training model and in an int8 reference model (built through TFMOT,
    refreshed every `reference_refresh` evaluations, off the training thread
    when a GPU or TPU trains). Freezing goes front to back, so only the
    model's prefix up to those modules runs, in both models. When the
    plasticity of the frontmost still-trainable module has stopped changing
    (least-squares slope over the last `window` values, relative to their
    mean, within `tolerance` for `patience` evaluations), that module is
    frozen: no backward pass, no weight update, no gradient all-reduce.
    A freeze re-traces the train function; one that would save less than
    that before the end of `fit` (a small stem on a large model) is held
    and takes effect with the next one, in one re-trace.

    Add it first in the callback list, so that later callbacks (`CSVLogger`,
    `TensorBoard`) see the `frozen_modules` entry it adds to the logs. At the
    end of `fit` the model is handed back with every layer trainable as
    before; `summary()` and `events` say what was frozen and when.

    Args:
        probe_data: data to draw the probe batch from: model inputs (NumPy
            arrays, or a list/dict of them), a `tf.data.Dataset` or a
            `keras.utils.PyDataset`. Default: the data passed to `fit` (a
            Python generator cannot be read twice: pass `probe_data` with one).
        probe_size: examples in the probe batch.
        modules: explicit partition, a list of lists of layer names front to
            back (required for subclassed models). Default: automatic.
        eval_every: steps between plasticity evaluations. Default: an eighth
            of an epoch (100 steps if the epoch length is unknown), so that
            the default `window` spans one epoch; stretched where evaluations
            would exceed `overhead_budget`.
        window: plasticity values in the sliding window.
        tolerance: largest |relative slope| per evaluation counted as converged.
        patience: consecutive converged evaluations before a freeze.
        bootstrap_steps: no freezing before this step (the critical learning
            period). Default: 10% of the training steps, at least 1 epoch.
        max_frozen_fraction: at most this fraction of modules freezes.
        reopen_lr_factor: re-open frozen modules when the learning rate has
            dropped by this factor since the last freeze (None: never).
        plasticity_level: an evaluation also counts as converged when the
            candidate's plasticity is at most this fraction of its highest so
            far (e.g. 0.02; None: the paper's slope test alone). For models
            whose front plasticity keeps falling geometrically (Transformer
            embeddings); see docs/egeria.md.
        reference_refresh: evaluations between reference-model refreshes.
        reference: how to build the reference model: `"auto"` (TFMOT where
            the model can be rebuilt for it, else a clone with int8 weights;
            the reason is in `summary()["reference_reason"]`), `"tfmot"` or
            `"int8-weights"` (forced; a failure stops Egeria, not `fit`).
        asynchronous: refresh (re-quantize and run) the reference model on a
            background thread on the host CPU; it is built on the training
            thread at train begin, so that a model it cannot handle is known
            at once. `"auto"` (default): only when training
            runs on a GPU or TPU, whose host CPUs are otherwise idle; on a
            CPU-only host the training step already uses every core, and a
            background thread would slow it down more than it saves.
        refresh_batch_norm: give a module's BatchNormalization layers the
            probe batch's statistics just before it freezes, so that the
            frozen module computes what training computed (see
            `FreezingCallback._freeze`).
        freeze_at: `"epoch_end"` (default): a freeze and a refresh that
            quantizes a longer prefix, decided during an epoch, happen at its
            end (at once in the last epoch); the reference is built at once
            where the pre-flight estimates its build at 1.5 s or less, else
            on a background thread while training goes on where it should
            end before the epoch does (TFMOT's path), else at the epoch end;
            `"step"`: everything at once. Work that holds training up for
            seconds mid-epoch made the next epoch start stall (docs/egeria.md).
        log_dir: if set, TensorBoard scalars are written there.
        backup_dir: if set, Egeria's state is saved there at each epoch end
            and restored when `fit` resumes (pass the `backup_dir` of your
            `keras.callbacks.BackupAndRestore`).
        seed: seed of the probe batch choice.
        verbose: 1 prints each freeze, 0 is silent.

    Example:
    >>> egeria = tf_hwopt.EgeriaCallback()
    >>> model.fit(x, y, epochs=20, callbacks=[egeria])
    >>> egeria.summary()["frozen_modules"]
    3
    """

    TAG = "egeria"
    STATE_FILE = STATE_FILE
    VALUE_NAME = "plasticity"
    HOLDS_UNPAID_FREEZES = True

    def __init__(
        self,
        probe_data=None,
        *,
        window: int = 8,
        tolerance: float = 0.15,
        patience: int = 2,
        bootstrap_steps: int | None = None,
        max_frozen_fraction: float = 0.8,
        reopen_lr_factor: float | None = None,
        plasticity_level: float | None = None,
        reference_refresh: int = 1,
        reference: str = "auto",
        asynchronous: bool | str = "auto",
        **kwargs,
    ):
        super().__init__(probe_data, **kwargs)
        check_positive_int("reference_refresh", reference_refresh)
        if reference not in REFERENCE_MODES:
            raise ValueError(f"`reference` must be one of {REFERENCE_MODES}. Received: reference={reference!r}")
        if asynchronous not in (True, False, "auto"):
            raise ValueError(
                f"`asynchronous` must be True, False or 'auto'. Received: asynchronous={asynchronous!r}"
            )
        # The policy validates window, tolerance, patience, bootstrap and cap
        # now, before any training: build a throwaway one.
        EgeriaPolicy(
            2,
            window=window,
            tolerance=tolerance,
            patience=patience,
            bootstrap_steps=0 if bootstrap_steps is None else bootstrap_steps,
            max_frozen_fraction=max_frozen_fraction,
            reopen_lr_factor=reopen_lr_factor,
            level=plasticity_level,
        )
        self.window = window
        self.tolerance = tolerance
        self.patience = patience
        self.bootstrap_steps = bootstrap_steps
        self.max_frozen_fraction = max_frozen_fraction
        self.reopen_lr_factor = reopen_lr_factor
        self.plasticity_level = plasticity_level
        self.reference_refresh = reference_refresh
        self.reference_mode = reference
        self.asynchronous = asynchronous
        self.reference: Reference | None = None
        self._readers: dict = {}
        self._refreshed_sets: set = set()
        self._restored_refreshes = 0
        # One-off work put off until the epoch end (`freeze_at="epoch_end"`):
        # building the reference, or a refresh that must extend its prefix.
        self._build_pending = False
        self._refresh_pending = False
        self._refreshed_with_read = False
        # The reference being built on a background thread, if any.
        self._build_in_flight: ReferenceBuild | None = None

    # ------------------------------------------------------------------ setup

    def _make_policy(self) -> EgeriaPolicy:
        return EgeriaPolicy(
            len(self.modules),
            window=self.window,
            tolerance=self.tolerance,
            patience=self.patience,
            bootstrap_steps=self._resolve_bootstrap(self.bootstrap_steps),
            max_frozen_fraction=self.max_frozen_fraction,
            level=self.plasticity_level,
            reopen_lr_factor=self.reopen_lr_factor,
        )

    def _default_eval_every(self) -> int:
        # An eighth of an epoch: the window (8 evaluations) spans one epoch.
        # With a quarter epoch it spanned two, and a front converged from the
        # start (fine-tuning) or within two epochs (mnist1d) froze an epoch
        # later than it could; measured, seed 0: wall time 1.24x -> 1.47x on
        # finetune-mnist1d and 1.55x on mnist1d, final accuracy within 0.1
        # point (docs/benchmarks.md). On both, the overhead budget allows
        # about as often (an evaluation costs half a step).
        steps = self.steps_per_epoch
        return max(1, steps // 8) if steps else 100

    def _setup(self, first_fit: bool) -> None:
        self.probe  # noqa: B018 - drawn now: bad probe data is an error before training time is spent
        self._readers = {}

    def _reference_options(self) -> dict:
        last = self.policy.max_frozen - 1  # no module past the cap is ever measured
        return dict(
            asynchronous=_has_accelerator() if self.asynchronous == "auto" else self.asynchronous,
            mode=self.reference_mode,
            # Twice the measured prefix at once: each growth of the
            # quantized prefix costs a rebuild and a trace (docs/egeria.md).
            cover=min(2 * max(self._measured_modules(), default=0) + 1, last),
            max_cover=last,
        )

    def _build_reference(self) -> bool:
        """Builds the reference model (or takes the background build's); False when Egeria stepped aside."""
        build, self._build_in_flight = self._build_in_flight, None
        try:
            if build is None:
                self.reference = Reference(
                    self.model, [m.output_layer for m in self.modules], self.probe, **self._reference_options()
                )
            else:
                self.reference = build.result(self.model)
        except ReferenceUnavailable as err:
            self._disable(f"no reference model: {err}")
            return False
        self.reference.refreshes = self._restored_refreshes
        return True

    def _start_build(self, build: float | None) -> None:
        """Builds the reference now, on a background thread, or at the epoch end, as `build`'s estimate says."""
        if not self._build_waits(build):
            self._build_reference()
        elif self._builds_in_background(build):
            self._build_in_flight = ReferenceBuild(
                self.model, [m.output_layer for m in self.modules], self.probe, **self._reference_options()
            )
        else:
            self._build_pending = True  # the clone (it reads the training model), or longer than the epoch

    def _can_pay(self) -> tuple[bool, float | None]:
        """Before the reference is built: can evaluating pay at all in this fit?

        The training model's prefix is timed on the probe batch; an evaluation
        costs about `_EVALUATION_PER_READ` times that (the reference's
        calibration and quantized passes, the weight copies, the SP losses).
        If, spaced within `overhead_budget`, evaluations cannot lead to a
        freeze that repays them before the end, Egeria steps back now, before
        paying for the reference.
        Returns whether it can, and the build's estimate (None where the
        estimate is impossible and evaluation goes on unjudged).
        """
        step_seconds, total = self._step_seconds(), self.total_steps
        shares = self._candidate_flops_shares()
        if self.overhead_budget is None or not step_seconds or total is None or shares is None:
            return True, None
        modules = self._measured_modules()
        reader = self._reader_for(modules)
        trace = _seconds(reader, self.probe)  # traced at its first call
        read = _seconds(reader, self.probe)

        def judge(trace: float, read: float, build_counts: bool = True) -> tuple:
            build, cost = _BUILD_PER_TRACE * trace, _EVALUATION_PER_READ * read
            interval = stretched_interval(self._eval_every, cost, step_seconds, self.overhead_budget)
            earliest = self.policy.earliest_freeze_step(self._step, interval)
            # The build is still to pay, and each freeze's rebuild traces a graph
            # of the model as the build does: the estimate stands in for both.
            # Here, before anything is paid, one rebuild per freeze: the more
            # cautious best case (the stop rule after the build lets held freezes share).
            paid = build if build_counts else 0.0
            pays = self._repays(earliest, interval, cost, shares, step_seconds, freeze_seconds=paid,
                                setup_seconds=paid, shared_rebuilds=False)
            return pays, build, cost, interval, earliest

        pays, build, cost, interval, earliest = judge(trace, read)
        # Whether the build estimate decides: a step-back where a free build
        # would pay, or a build put off to the epoch end (one that runs in the
        # background meanwhile loses no epoch: not worth a second trace).
        if pays:
            build_decides = self._build_waits(build) and not self._builds_in_background(build)
        else:
            build_decides = judge(trace, read, build_counts=False)[0]
        if build_decides:
            # A first trace can take ten times its usual time on a busy host
            # (finetune-mnist1d, 2026-12-07: 0.61 s against 0.07 s, a 9.2 s
            # estimate that stepped back where builds take 1 s; mnist1d:
            # estimates over 1.5 s put 3 of 6 builds off by an epoch, and the
            # first freezes from step 314 to 471): a second trace, of a fresh
            # reader, confirms it, and the faster of the two counts.
            fresh = ActivationReader(self.model, [self.modules[i].output_layer for i in modules])
            trace, read = min(trace, _seconds(fresh, self.probe)), min(read, _seconds(reader, self.probe))
            pays, build, cost, interval, earliest = judge(trace, read)
        if pays:
            return True, build
        self.evaluation_stopped = (
            f"stepped back at step {self._step}, before building the reference: an evaluation would cost "
            f"about {cost:.3f} s against {step_seconds:.3f} s per step, so within overhead_budget="
            f"{self.overhead_budget:g} one every {interval} steps, and module {self.policy.num_frozen} "
            f"could freeze at step {earliest} at the soonest of {total}: too late to repay it and the "
            f"reference build (about {build:.2f} s)"
        )
        self._say(f"{self.evaluation_stopped}.")
        return False, build

    def _builds_in_background(self, build: float | None) -> bool:
        """Whether a build estimated at `build` seconds, too long for a pause mid-epoch, runs meanwhile.

        TFMOT's path reads only the model's configs and a snapshot taken on
        the training thread: it can be built on a background thread while
        training goes on, and is where the estimate says it ends before the
        epoch does (no pause, and the window fills an epoch sooner; where the
        epoch ends first, the epoch end comes as soon, without depending on
        the host's speed). The int8-weights clone reads the training model.
        """
        step_seconds = self._step_seconds()
        if self.reference_mode == "int8-weights" or build is None or not step_seconds or not self.steps_per_epoch:
            return False
        return build < (self.steps_per_epoch - self._last_batch - 1) * step_seconds

    def _build_waits(self, build: float | None) -> bool:
        """Whether a reference build estimated at `build` seconds waits for the epoch end (`freeze_at`)."""
        return self._defers_to_epoch_end() and (build is None or build > _MID_EPOCH_BUILD_SECONDS)

    def _rebuild_stand_in(self) -> float:
        # Until a rebuild is timed: the larger of the reference build and a
        # third of the first step's tracing (both trace a graph of the model;
        # MNIST-1D ResNet, seed 0: a 0.98 s build, a rebuild timed at 0.65 s;
        # ResNet50V2 at 32x32: a 2.1 s build, rebuilds of 5-8 s).
        build = self.reference.build_seconds if self.reference is not None else 0.0
        return max(build, super()._rebuild_stand_in())

    def _teardown(self) -> None:
        if self._build_in_flight is not None:
            # `fit` ended before the build did: the next `fit` starts afresh.
            self._build_in_flight.cancel()
            self._build_in_flight = None
        if self.reference is not None:
            self.reference.close()

    # ------------------------------------------------------------- evaluation

    def _measured_modules(self) -> tuple:
        """The candidate and `_LOOKAHEAD` modules behind it (none past the cap)."""
        k = self.policy.num_frozen
        last = min(k + _LOOKAHEAD, self.policy.max_frozen - 1)
        return tuple(range(k, last + 1))

    def _reader_for(self, modules: tuple) -> ActivationReader:
        if modules not in self._readers:
            self._one_off_work = True  # a new reader: traced at its first call
            self._readers[modules] = ActivationReader(self.model, [self.modules[i].output_layer for i in modules])
        return self._readers[modules]

    def _measure(self) -> list[float] | None:
        """The measured modules' plasticity (NaN elsewhere); None while the reference lacks the candidate."""
        self._refreshed_with_read = False
        if self.reference is None:
            # The first evaluation: the step time is known now. Build the
            # reference only if evaluating can pay (its first refresh follows),
            # at the epoch end if `freeze_at` says so (a build takes seconds).
            # Nothing measured while a build waits or runs: this no-op is no
            # estimate of an evaluation's cost (a zero would unstretch the
            # interval and let the stop rule judge with a free evaluation and
            # no build to repay).
            self._one_off_work = True
            if self._build_pending:
                return None
            if self._build_in_flight is not None:
                if self._build_in_flight.done():
                    if self._build_in_flight.failed and self._defers_to_epoch_end():
                        # TFMOT failed: the int8-weights clone, on this thread, at the epoch end.
                        self._build_pending = True
                    else:
                        self._build_reference()  # its first refresh follows this evaluation
                return None
            pays, build = self._can_pay()
            if pays:
                self._start_build(build)
            return None
        modules = self.reference.refreshed_modules if self.reference.ready() else ()
        if self.policy.num_frozen not in modules:
            return None
        reference = dict(zip(modules, self.reference.activations()))
        # The reference's refresh from the weights of now, when due for the
        # same modules, runs in the same compiled call as the read.
        reads = None
        if modules == self._measured_modules() and self._refresh_due():
            compiled = len(self.reference.compiled)
            reads = self.reference.read_and_refresh(self.model, modules)
            self._one_off_work |= len(self.reference.compiled) > compiled  # traced at its first call
        self._refreshed_with_read = reads is not None
        activations = dict(zip(modules, reads if reads is not None else self._reader_for(modules)(self.probe)))
        return [
            sp_loss(activations[i], reference[i], gram_dtype=np.float32) if i in activations else math.nan
            for i in range(len(self.modules))
        ]

    def _after_evaluation(self, decision) -> None:
        if self.reference is None or self.policy.settled or self.evaluation_stopped or self.disabled_reason:
            return
        modules = self._measured_modules()
        if self._refreshed_with_read and modules == self.reference.refreshed_modules:
            return  # refreshed in the evaluation's read, from the same weights
        if modules and (self._refresh_due() or modules != self.reference.refreshed_modules):
            if max(modules) >= self.reference.covered_modules and self._defers_to_epoch_end():
                self._refresh_pending = True  # quantizing a longer prefix takes seconds: at the epoch end
                return
            if modules not in self._refreshed_sets:
                self._one_off_work = True  # the reference may grow, and traces its first refresh
                self._refreshed_sets.add(modules)
            self.reference.submit_refresh(self.model, modules)

    def _refresh_due(self) -> bool:
        return (self.evaluations - 1) % self.reference_refresh == 0

    def _epoch_end_work(self) -> None:
        build, refresh = self._build_pending, self._refresh_pending
        self._build_pending = self._refresh_pending = False
        if self.policy.settled or self.evaluation_stopped or self.disabled_reason:
            return
        if build and not self._build_reference():
            return
        modules = self._measured_modules()
        if (build or refresh) and modules:
            self._refreshed_sets.add(modules)
            self.reference.submit_refresh(self.model, modules)

    def _extra_state(self) -> dict:
        return {"reference_refreshes": self.reference.refreshes if self.reference else self._restored_refreshes}

    def _load_extra_state(self, state: dict) -> None:
        self._restored_refreshes = int(state.get("reference_refreshes", 0))
        if self.reference is not None:
            self.reference.refreshes = self._restored_refreshes

    def _after_restore(self) -> None:
        # The weights were restored by BackupAndRestore: refresh the reference
        # from them so the next evaluation compares against this state (a
        # reference not built yet is built from them at the next evaluation).
        if self.reference is not None and self._measured_modules():
            self.reference.submit_refresh(self.model, self._measured_modules())

    # ----------------------------------------------------------------- report

    def summary(self) -> dict:
        """What Egeria did, as a JSON-serialisable dict.

        `FreezingCallback.summary()` (modules, events, FLOPs skipped,
        overhead, status) plus `reference_path` and `reference_reason`,
        `reference_refreshes`, `reference_covered_modules` (the quantized
        prefix grows as freezing moves back), `reference_build_seconds` and
        `reference_seconds` (wall time of building and refreshing the
        reference, also when it ran off the training thread: on a small host
        that thread competes with training and is not in `overhead_fraction`).
        """
        report = super().summary()
        ref = self.reference
        report.update(
            {
                "reference_path": ref.path if ref else None,
                "reference_reason": ref.reason if ref else self.disabled_reason,
                "reference_refreshes": ref.refreshes if ref else 0,
                "reference_covered_modules": ref.covered_modules if ref else 0,
                "reference_build_seconds": ref.build_seconds if ref else 0.0,
                "reference_seconds": ref.work_seconds if ref else 0.0,
            }
        )
        return report


def _has_accelerator() -> bool:
    return bool(tf.config.list_logical_devices("GPU") or tf.config.list_logical_devices("TPU"))
