"""The Pareto front of a search: objective against step time.

Example:
>>> rows = [{"score": 0.9, "latency_ms": 5.0}, {"score": 0.8, "latency_ms": 2.0}, {"score": 0.7, "latency_ms": 3.0}]
>>> [r["latency_ms"] for r in pareto_front(rows, maximize=True)]
[2.0, 5.0]
"""

from __future__ import annotations

from typing import Sequence


def pareto_front(rows: Sequence[dict], *, maximize: bool) -> list[dict]:
    """Rows (with `score` and `latency_ms`) not dominated by another, fastest first.

    A row is dominated by one at least as good and at least as fast, and
    strictly better in one of the two.
    """

    def at_least_as_good(a, b):
        return a >= b if maximize else a <= b

    front = [
        r
        for r in rows
        if not any(
            o is not r
            and at_least_as_good(o["score"], r["score"])
            and o["latency_ms"] <= r["latency_ms"]
            and (o["score"] != r["score"] or o["latency_ms"] < r["latency_ms"])
            for o in rows
        )
    ]
    return sorted(front, key=lambda r: r["latency_ms"])


def plot_pareto(rows: Sequence[dict], front: Sequence[dict], *, budget_ms: float, xlabel: str, ylabel: str,
                path: str) -> None:
    """Writes the trials (trained ones as points, untrained ones' latencies as lines) and the front as a PNG."""
    from tf_hwopt._plotting import pyplot

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4), dpi=110)
    trained = [r for r in rows if r["trained"] and r["score"] is not None and r["latency_ms"] is not None]
    ax.scatter([r["latency_ms"] for r in trained], [r["score"] for r in trained], label="trained")
    ax.plot([r["latency_ms"] for r in front], [r["score"] for r in front], "r-o", label="Pareto front")
    for r in rows:
        if not r["trained"] and r["latency_ms"] is not None:
            ax.axvline(r["latency_ms"], color="grey", alpha=0.3)
    ax.axvline(budget_ms, color="k", linestyle="--", label="budget")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
