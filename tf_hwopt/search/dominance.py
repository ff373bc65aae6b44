"""Which candidates are known to be over budget without timing them: the dominance rule.

A candidate is skipped only when a known infeasible candidate (over the
latency budget, or over a memory or parameter budget) is at most as costly
along every hyperparameter, and that must be *known*, not assumed:

- along a hyperparameter whose latency direction is known, `"increasing"`
  (width, depth, batch size: bigger is slower) or `"decreasing"` (stride,
  pool size, patch size: bigger is faster), the candidate must be at least
  as costly (>= resp. <=) as the infeasible one;
- along one known to be `"independent"` of latency (learning rate, dropout
  rate), any value;
- along every other hyperparameter, the same value.

A direction is known when the user declares it, or when the latencies already
measured confirm it: at least `min_pairs` pairs of measured candidates that
differ in that hyperparameter alone all moved the same way (by more than
`tolerance`), and none the other way. Anything else is timed before it is
judged, so a feasible model can never be hidden by a wrong guess.

Example:
>>> directions = {"units": "increasing", "stride": "decreasing"}
>>> infeasible = [{"units": 256, "stride": 1}]
>>> dominated({"units": 512, "stride": 1}, infeasible, directions)
True
>>> dominated({"units": 512, "stride": 2}, infeasible, directions)   # a bigger stride may be fast enough
False
"""

from __future__ import annotations

import itertools
from typing import Iterable, Mapping, Sequence

DIRECTIONS = ("increasing", "decreasing", "independent")


def _at_least_as_costly(value, other, direction: str | None) -> bool:
    if direction == "independent":
        return True
    if direction == "increasing":
        return value >= other
    if direction == "decreasing":
        return value <= other
    return value == other


def dominated(
    values: Mapping,
    infeasible: Iterable[Mapping],
    directions: Mapping[str, str],
) -> bool:
    """Whether `values` is at least as costly as one of the `infeasible` candidates.

    Args:
        values: the candidate's hyperparameter values.
        infeasible: values of candidates known to break a budget.
        directions: hyperparameter name -> `"increasing"`, `"decreasing"` or
            `"independent"`; a name not listed must match exactly.
    """
    for other in infeasible:
        names = set(values) | set(other)
        if all(
            name in values and name in other and _at_least_as_costly(values[name], other[name], directions.get(name))
            for name in names
        ):
            return True
    return False


def confirmed_directions(
    measured: Sequence[tuple[Mapping, float]],
    *,
    min_pairs: int = 2,
    tolerance: float = 0.05,
) -> dict[str, str]:
    """Latency directions that the measurements confirm.

    Args:
        measured: `(values, latency_ms)` of measured candidates.
        min_pairs: pairs differing in one hyperparameter alone needed to
            confirm its direction.
        tolerance: relative latency change below which a pair counts as
            "no change" (evidence of independence, not of a direction).

    Returns:
        name -> direction, for the hyperparameters whose pairs all agree.

    Example:
    >>> runs = [({"u": 8, "lr": 0.1}, 1.0), ({"u": 16, "lr": 0.1}, 2.0), ({"u": 32, "lr": 0.1}, 4.0)]
    >>> confirmed_directions(runs)
    {'u': 'increasing'}
    """
    evidence: dict[str, set] = {}
    counts: dict[str, int] = {}
    for (a, la), (b, lb) in itertools.combinations(measured, 2):
        if set(a) != set(b):
            continue
        differing = [name for name in a if a[name] != b[name]]
        if len(differing) != 1:
            continue
        name = differing[0]
        try:
            bigger_first = a[name] > b[name]
        except TypeError:  # not ordered (strings, booleans mixed with others)
            continue
        (low, l_low), (high, l_high) = ((b, lb), (a, la)) if bigger_first else ((a, la), (b, lb))
        if abs(l_high - l_low) <= tolerance * max(l_low, l_high):
            kind = "independent"
        else:
            kind = "increasing" if l_high > l_low else "decreasing"
        evidence.setdefault(name, set()).add(kind)
        counts[name] = counts.get(name, 0) + 1
    return {
        name: kinds.pop()
        for name, kinds in evidence.items()
        if len(kinds) == 1 and counts[name] >= min_pairs
    }


def check_directions(**declared: Sequence[str]) -> dict[str, str]:
    """Validates declared directions (`latency_increasing=[...]` and so on) into name -> direction.

    Example:
    >>> check_directions(latency_increasing=["units"], latency_decreasing=["stride"], latency_independent=[])
    {'units': 'increasing', 'stride': 'decreasing'}
    """
    directions: dict[str, str] = {}
    for argument, names in declared.items():
        direction = argument.removeprefix("latency_")
        if direction not in DIRECTIONS:
            raise ValueError(f"Unknown direction argument {argument!r}; expected latency_{'/'.join(DIRECTIONS)}.")
        if isinstance(names, str) or not all(isinstance(n, str) for n in names):
            raise ValueError(
                f"`{argument}` must be a list of hyperparameter names. Received: {argument}={names!r}"
            )
        for name in names:
            if name in directions and directions[name] != direction:
                raise ValueError(
                    f"Hyperparameter {name!r} is declared both latency_{directions[name]} and {argument}."
                )
            directions[name] = direction
    return directions
