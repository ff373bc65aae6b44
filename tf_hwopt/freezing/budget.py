"""Cost and benefit of freezing: when to evaluate, and when to stop evaluating.

A freezing callback spends time on the training thread (evaluations, the
reference model, the BatchNormalization refresh) in the hope of a freeze
that saves more. These pure functions do its accounting:

- `stretched_interval`: the steps between evaluations that keep their cost
  within a share (`overhead_budget`) of the training time;
- `evaluation_cost`: what the next evaluation is taken to cost, from the
  last ones timed;
- `freeze_saving_seconds` and `best_case_saving_seconds`: the most the
  freezes still possible can save, from the modules' shares of the forward
  FLOPs, the steps left and the train-function rebuild each costs;
- `worth_evaluating`: whether that best case repays the evaluations still
  needed before the next freeze can happen (and any one-off setup, such as
  building Egeria's reference model, not paid yet).
  When it cannot, the callback stops evaluating and says so in `summary()`;
- `releases_held_freezes`: when freezes held back to share one rebuild
  should take effect (a ski-rental rule: hold while the saving forgone is
  less than the rebuild that holding spares);
- `saving_scale`: how much of the FLOPs estimate a freeze realized, from
  the step times measured before and after it;
- `cache_rebuild_seconds`: what a freeze costs beyond the rebuild when the
  frozen prefix's outputs are cached (`fit_with_cache` runs the prefix
  over the training data again).

A training step costs about three forward passes (forward, then backward
through activations and weights); a frozen module skips its two backward
ones, so freezing a module with share `s` of the forward FLOPs saves about
`2/3 s` of a step (`BACKWARD_SHARE`). Forward skipping (`fit_with_cache`)
saves more; the estimate stays the smaller, freezing-only one, so it errs
on the side of stopping late rather than early. On a CPU, a model of many
small operations (ResNet50V2 at 32x32) may realize less (0.5-1.2 of it,
measured): once a freeze has been timed, the callback scales its
estimates by `saving_scale`.
"""

from __future__ import annotations

import math
from typing import Sequence

#: Share of a training step a frozen module's FLOPs stop costing (2 of ~3 passes).
BACKWARD_SHARE = 2.0 / 3.0

#: The smallest estimated saving (a share of the step) that a step-time
#: measurement is taken to tell apart from noise (`saving_scale`).
MEASURABLE_SAVING = 0.05


def stretched_interval(base: int, evaluation_seconds: float, step_seconds: float, budget: float | None) -> int:
    """Steps between evaluations: `base`, or more when evaluating would exceed `budget`.

    Evaluating every `n` steps costs `evaluation_seconds / (n * step_seconds)`
    of the training time; the result is the smallest `n >= base` that keeps
    it within `budget` (None: no budget).

    Example:
    >>> stretched_interval(10, evaluation_seconds=0.5, step_seconds=0.1, budget=0.02)
    250
    >>> stretched_interval(10, evaluation_seconds=0.01, step_seconds=0.1, budget=0.02)
    10
    """
    if budget is None or step_seconds <= 0 or evaluation_seconds <= 0:
        return base
    return max(base, int(math.ceil(evaluation_seconds / (budget * step_seconds) - 1e-9)))


def evaluation_cost(recent_seconds: Sequence[float]) -> float | None:
    """What the next evaluation is taken to cost: the median of the last three timed, the least of fewer.

    Noise on a shared host only ever adds time, and one sample can be
    several steps' worth (finetune-mnist1d, 2026-12-07: first evaluations
    timed at two to three steps stretched the early intervals to 99 and 74
    steps, against 39 and 37 with normal costs, and the modules froze 250
    steps late). None before any is timed.

    Example:
    >>> evaluation_cost([0.30, 0.04])        # a slow first sample does not decide alone
    0.04
    >>> evaluation_cost([0.30, 0.04, 0.05, 0.06])  # the last three: 0.04, 0.05, 0.06
    0.05
    """
    recent = list(recent_seconds)[-3:]
    if not recent:
        return None
    return sorted(recent)[1] if len(recent) == 3 else min(recent)


def freeze_saving_seconds(flops_share: float, step_seconds: float, steps: float) -> float:
    """Seconds a freeze saves: `BACKWARD_SHARE` of the module's FLOPs share of each of `steps` steps.

    Example:
    >>> round(freeze_saving_seconds(0.3, step_seconds=0.1, steps=1000), 6)
    20.0
    """
    return max(0.0, BACKWARD_SHARE * flops_share * step_seconds * steps)


def best_case_saving_seconds(
    flops_shares: Sequence[float],
    *,
    step_seconds: float,
    total_steps: int,
    earliest_freeze_step: int,
    interval: int,
    freeze_seconds: float = 0.0,
    shared_rebuilds: bool = False,
) -> float:
    """The most the freezes still possible can save, net of their train-function rebuilds.

    Freezing goes front to back: `flops_shares` are the shares of the
    modules that may still freeze, the candidate first. Best case, the
    candidate can freeze at `earliest_freeze_step` and each next one an
    `interval` later, all staying frozen to `total_steps`; each freeze costs
    `freeze_seconds`. Freezing the candidate may pay only through the ones
    behind it (a stem with 1% of the FLOPs opens the way to a block with
    30%), so the best prefix of freezes counts, not the candidate alone.
    With `shared_rebuilds` (freezes held to take effect together, as
    Egeria's are), consecutive modules may also freeze as one group, when
    the last of them can, for one rebuild: the best grouping counts.

    Example:
    >>> round(best_case_saving_seconds([0.01, 0.3], step_seconds=0.1, total_steps=1000,
    ...                                earliest_freeze_step=100, interval=10, freeze_seconds=1.0), 2)
    16.4
    >>> kw = dict(step_seconds=0.4, total_steps=920, earliest_freeze_step=400, interval=20, freeze_seconds=8.0)
    >>> best_case_saving_seconds([0.04] * 10, **kw)  # ResNet50V2's blocks: none repays a rebuild alone
    0.0
    >>> round(best_case_saving_seconds([0.04] * 10, shared_rebuilds=True, **kw), 1)  # together they do
    28.3
    """
    ats = [earliest_freeze_step + j * interval for j in range(len(flops_shares))]
    shares = [share for share, at in zip(flops_shares, ats) if at < total_steps]
    # best[c]: the most the first c modules save, frozen in the best grouping
    # (a group freezes when its last module can; each group costs a rebuild).
    best = [0.0]
    for j in range(1, len(shares) + 1):
        left = total_steps - ats[j - 1]
        starts = range(j) if shared_rebuilds else [j - 1]
        best.append(
            max(
                best[i] + sum(freeze_saving_seconds(share, step_seconds, left) for share in shares[i:j]) - freeze_seconds
                for i in starts
            )
        )
    return max(best)


def worth_evaluating(
    *,
    flops_shares: Sequence[float],
    step_seconds: float,
    step: int,
    total_steps: int,
    earliest_freeze_step: int,
    interval: int,
    evaluation_seconds: float,
    freeze_seconds: float = 0.0,
    setup_seconds: float = 0.0,
    shared_rebuilds: bool = False,
) -> bool:
    """Whether the freezes still possible can repay the evaluations the next one needs.

    `best_case_saving_seconds` against one evaluation every `interval` steps
    from `step` to `earliest_freeze_step`, plus `setup_seconds` of one-off
    work still to pay before the first evaluation (0 once it is paid: a sunk
    cost does not count).

    Example:
    >>> worth_evaluating(flops_shares=[0.2], step_seconds=0.1, step=900, total_steps=1000,
    ...                  earliest_freeze_step=980, interval=20, evaluation_seconds=0.5)
    False
    >>> worth_evaluating(flops_shares=[0.2], step_seconds=0.1, step=100, total_steps=1000,
    ...                  earliest_freeze_step=180, interval=20, evaluation_seconds=0.5)
    True
    >>> worth_evaluating(flops_shares=[0.2], step_seconds=0.1, step=100, total_steps=1000,
    ...                  earliest_freeze_step=180, interval=20, evaluation_seconds=0.5, setup_seconds=10.0)
    False
    """
    if earliest_freeze_step >= total_steps:
        return False
    evaluations = max(1, math.ceil((earliest_freeze_step - step) / max(1, interval)))
    saving = best_case_saving_seconds(
        flops_shares,
        step_seconds=step_seconds,
        total_steps=total_steps,
        earliest_freeze_step=earliest_freeze_step,
        interval=interval,
        freeze_seconds=freeze_seconds,
        shared_rebuilds=shared_rebuilds,
    )
    return saving > evaluations * evaluation_seconds + setup_seconds


def releases_held_freezes(
    held: Sequence[tuple[float, int]],
    *,
    step: int,
    step_seconds: float,
    total_steps: int,
    rebuild_seconds: float,
    next_freeze_step: int | None,
) -> bool:
    """Whether freezes held back (to share one train-function rebuild) should take effect now.

    `held` lists `(flops_share, decided_step)` per held freeze. Never while
    they would save less than a rebuild before `total_steps`. Otherwise now
    when no further freeze can come (`next_freeze_step` None or past the
    end) to share the rebuild with; else when holding costs a rebuild's
    worth: the saving already forgone since each was decided, or the saving
    forgone until `next_freeze_step`, the soonest the next freeze could join
    them, reaches `rebuild_seconds`. Holding until the forgone saving equals
    the rebuild it spares is the ski-rental rule: whatever comes next, it
    loses at most one rebuild against knowing the future.

    Example:
    >>> kw = dict(step=500, step_seconds=0.4, total_steps=900, rebuild_seconds=10.0)
    >>> releases_held_freezes([(0.03, 138)], next_freeze_step=523, **kw)  # the stem: 2.9 s forgone
    False
    >>> releases_held_freezes([(0.03, 138), (0.3, 400)], next_freeze_step=523, **kw)  # 10.9 s forgone
    True
    >>> releases_held_freezes([(0.03, 138)], next_freeze_step=None, **kw)  # alone to the end: 3.2 s < 10 s
    False
    """
    share = sum(s for s, _ in held)
    if not held or freeze_saving_seconds(share, step_seconds, total_steps - step) <= rebuild_seconds:
        return False
    if next_freeze_step is None or next_freeze_step >= total_steps:
        return True
    forgone = sum(freeze_saving_seconds(s, step_seconds, step - decided) for s, decided in held)
    ahead = freeze_saving_seconds(share, step_seconds, next_freeze_step - step)
    return max(forgone, ahead) >= rebuild_seconds


def saving_scale(base_step_seconds: float, step_seconds: float, frozen_flops_share: float) -> float | None:
    """The share of the estimated saving a freeze realized, from timed steps (None: too small to tell).

    `base_step_seconds` is a step's time with nothing frozen, `step_seconds`
    its time with `frozen_flops_share` of the forward FLOPs frozen; the
    estimate is `BACKWARD_SHARE` of that share. Below `MEASURABLE_SAVING`
    the run-to-run noise of step times hides it (None). The result lies in
    [0, 1.5]: 0 when the step got no faster, 1.5 when the frozen FLOPs
    stopped costing all three passes.

    Example:
    >>> round(saving_scale(0.42, 0.37, 0.276), 2)  # ResNet50V2: 12% realized, 18% estimated
    0.65
    >>> saving_scale(0.42, 0.42, 0.03) is None
    True
    """
    estimated = BACKWARD_SHARE * frozen_flops_share
    if base_step_seconds <= 0 or estimated < MEASURABLE_SAVING:
        return None
    return min(1.5, max(0.0, (1.0 - step_seconds / base_step_seconds) / estimated))


def cache_rebuild_seconds(prefix_flops_share: float, step_seconds: float, steps_per_epoch: int) -> float:
    """Seconds to rebuild an activation cache: one epoch of forward passes through the frozen prefix.

    A forward pass is about a third of a training step (`BACKWARD_SHARE`),
    the prefix `prefix_flops_share` of it. Measured on mnist1d (157 steps of
    0.05 s, a prefix with 75% of the FLOPs): 1.9-2.3 s, against 2.0 s here.

    Example:
    >>> round(cache_rebuild_seconds(0.75, step_seconds=0.05, steps_per_epoch=157), 2)
    1.96
    """
    return max(0.0, (1.0 - BACKWARD_SHARE) * prefix_flops_share * step_seconds * steps_per_epoch)
