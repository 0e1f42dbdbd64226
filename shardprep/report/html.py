"""The HTML and plot helpers of the dataset report, shared by its sections (``report``, ``curation_report``):
row sampling, matplotlib figures as inline PNGs (the object API: no pyplot, no global state, safe in any
thread), histograms, table rows and numbers."""

from __future__ import annotations

import base64
import html
import io

import numpy as np


def spaced(n: int, k: int) -> np.ndarray:
    """At most ``k`` evenly spaced row indices of ``n`` (all of them when ``n <= k``)."""
    return np.arange(n) if n <= k else np.unique(np.linspace(0, n - 1, k).astype(np.int64))


def png(fig) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight")
    return base64.b64encode(buf.getvalue()).decode("ascii")


def figure(width: float = 7.0, height: float = 3.2):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height))
    return fig, fig.add_subplot()


def empty(ax, what: str) -> None:
    ax.text(0.5, 0.5, f"no {what} yet", ha="center", va="center", transform=ax.transAxes)
    ax.set_xticks([])
    ax.set_yticks([])


def hist(values: np.ndarray, title: str, xlabel: str, what: str, bins: int = 40,
         value_range: tuple[float, float] | None = None) -> str:
    """``value_range``: the bins' span (two histograms meant to be compared share one)."""
    fig, ax = figure()
    if values.size:
        ax.hist(values, bins=bins, range=value_range, color="#55a868")
        ax.ticklabel_format(axis="x", useOffset=False)  # norms sit near 1: show 0.9999, not "+1"
        ax.set_xlabel(xlabel)
        ax.set_ylabel("samples")
    else:
        empty(ax, what)
    ax.set_title(f"{title} ({values.size} samples)")
    return png(fig)


def row(cells: list, header: bool = False) -> str:
    tag = "th" if header else "td"
    return "<tr>" + "".join(f"<{tag}>{html.escape(str(c))}</{tag}>" for c in cells) + "</tr>"


def fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:,.4g}" if abs(v) < 1e6 else f"{v:,.0f}"
    if isinstance(v, int):
        return f"{v:,}"
    return "-" if v is None else str(v)
