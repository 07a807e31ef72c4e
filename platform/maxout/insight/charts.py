"""The bar chart of ratios per cell that ``maxout benchmark`` and ``maxout audit`` draw (speed-up, memory ratio).

Its own module so that drawing or reading a report needs matplotlib and pandas only: benchmark.py imports the whole
training stack (torch, transformers), which the audit's report, and the GPU report's parent process that renders
it, never need (4.6 CPU-s of imports there).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def plot(table: Any, column: str, title: str, path: Path) -> None:
    """A horizontal bar per cell of ``table`` (a DataFrame with a ``cell`` column) that has ``column``, labelled
    with its ratio, and a dashed line at 1.0 (the baseline)."""
    import matplotlib  # lazy: 0.6 s to import, and only the charts need it

    matplotlib.use("Agg")  # no display on servers and in CI; chosen before pyplot is imported
    import matplotlib.pyplot as plt  # lazy: after the backend is chosen

    ran = table[table[column].notna()]
    fig, ax = plt.subplots(figsize=(9, 0.45 * max(len(ran), 1) + 1.5))
    bars = ax.barh(list(ran["cell"]), list(ran[column]), color="tab:blue")
    ax.bar_label(bars, fmt="%.2fx", padding=2, fontsize=8)
    ax.margins(x=0.12)  # room for the labels
    ax.axvline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.invert_yaxis()
    ax.set_xlabel(f"{column} (x baseline)")
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
