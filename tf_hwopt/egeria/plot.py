"""Plot of plasticity per module over training, with freeze markers."""

from __future__ import annotations

import os
import textwrap


def plot(callback, path: str, *, title: str | None = None) -> str:
    """Writes a PNG of each module's plasticity against the training step.

    Each module's line ends where it froze; a dashed vertical line marks each
    freeze (and a dotted one each re-opening).

    Args:
        callback: an `EgeriaCallback` that has run (or is running) in `fit`.
        path: where to write the PNG.
        title: optional figure title.

    Returns:
        `path`.

    Example:
    >>> tf_hwopt.egeria.plot(egeria, "plasticity.png")
    """
    from tf_hwopt._plotting import pyplot

    plt = pyplot()

    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=110)
    draw_plasticity(ax, callback, title=title)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def draw_plasticity(ax, callback, *, title: str | None = None) -> None:
    """Draws the plasticity curves and freeze markers of `callback` on `ax`."""
    import matplotlib.pyplot as plt

    if not callback.history:  # nothing measured (yet, or Egeria stepped back): say why on the plot
        why = getattr(callback, "evaluation_stopped", None) or "no plasticity evaluation has run yet"
        ax.text(0.5, 0.5, "\n".join(textwrap.wrap(f"No plasticity to plot: {why}.", 70)),
                ha="center", va="center", transform=ax.transAxes, fontsize=8)
        ax.set_axis_off()
        if title:
            ax.set_title(title)
        return
    n = len(callback.history[0]["plasticity"])
    names = [m.name for m in callback.modules] if callback.modules else [str(i) for i in range(n)]
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    steps = [h["step"] for h in callback.history]
    for i in range(n - 1):  # the head never freezes; its curve is not decisive
        values = [h["plasticity"][i] for h in callback.history]
        xs = [s for s, v in zip(steps, values) if v is not None and v > 0]
        ys = [v for v in values if v is not None and v > 0]
        if xs:
            ax.plot(xs, ys, marker=".", color=colors[i % len(colors)], label=f"{i}: {names[i]}")
    for event in callback.events:
        i = event["module"]
        style = "--" if event["kind"] == "freeze" else ":"
        ax.axvline(event["step"], linestyle=style, color=colors[i % len(colors)], alpha=0.8)
        ax.annotate(
            f"{event['kind']} {i}",
            (event["step"], 1.0),
            xycoords=("data", "axes fraction"),
            rotation=90,
            va="top",
            ha="right",
            fontsize=8,
        )
    ax.set_yscale("log")
    ax.set_xlabel("training step")
    ax.set_ylabel("plasticity (SP loss vs int8 reference)")
    ax.set_title(title or "Egeria: plasticity per module")
    ax.legend(fontsize=7, loc="lower left")
