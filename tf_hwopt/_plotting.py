"""matplotlib with a file backend, set up in one place for every plot of the package."""

from __future__ import annotations


def pyplot():
    """`matplotlib.pyplot` on the non-interactive Agg backend (plots go to files; no display needed).

    Example:
    >>> plt = pyplot()
    >>> fig, ax = plt.subplots()
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
