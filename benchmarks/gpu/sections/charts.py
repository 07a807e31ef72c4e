"""Grouped bar charts for the report (matplotlib, no display)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display on the GPU machine or in CI; chosen before pyplot is imported
import matplotlib.pyplot as plt  # noqa: E402 - after the backend is chosen


def bars(path: Path, groups: list[str], series: dict[str, list[float]], ylabel: str, title: str,
         fmt: str = "%.3g") -> bool:
    """One group of bars per label in ``groups``, one bar per series; False when there is nothing to draw."""
    if not groups or not series:
        return False
    width = 0.8 / len(series)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(groups) * len(series) + 2), 4.5))
    for i, (name, values) in enumerate(series.items()):
        xs = [g + (i - (len(series) - 1) / 2) * width for g in range(len(groups))]
        drawn = ax.bar(xs, values, width, label=name)
        ax.bar_label(drawn, fmt=fmt, fontsize=7, padding=2)
    ax.set_xticks(range(len(groups)), groups, rotation=20 if len(groups) > 4 else 0, ha="right" if
                  len(groups) > 4 else "center", fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.margins(y=0.15)
    if len(series) > 1:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True
