"""The report's charts: one small matplotlib figure per chart, returned as a base64 PNG for an inline <img>.

Train curves are smoothed the way TensorBoard smooths them (a debiased exponential moving average) and drawn over
their raw values, which stay faint; eval points are drawn as they are, with markers. A series that is constant
beside varying ones (the planner's memory estimate beside the measured peak) is a dashed horizontal line.
"""

from __future__ import annotations

import base64
import io
import math
from dataclasses import dataclass

COLORS = ("#2563eb", "#ea580c", "#16a34a", "#9333ea", "#dc2626", "#0891b2", "#ca8a04", "#db2777")
LINESTYLES = ("-", ":", "-.", (0, (5, 1)))


@dataclass(frozen=True)
class Series:
    """One line of a chart: (step, value) points, drawn in `color` with `linestyle`."""

    label: str
    steps: tuple[int, ...]
    values: tuple[float, ...]
    color: str = COLORS[0]
    eval: bool = False
    linestyle: object = "-"


def smooth(values: list[float], weight: float) -> list[float]:
    """Exponential moving average with TensorBoard's debiasing: s_t = w s_{t-1} + (1 - w) x_t, divided by
    1 - w^t so the first points are not pulled toward zero (weight 0: the values themselves)."""
    out, last = [], 0.0
    for t, value in enumerate(values, start=1):
        last = weight * last + (1 - weight) * value
        out.append(last / (1 - weight**t) if weight > 0 else value)
    return out


def smoothing_weight(points: int) -> float:
    """No smoothing below 10 points; then about a tenth of the run's points in the average, at most 0.9."""
    return 0.0 if points < 10 else min(0.9, 1 - 10 / points)


def is_constant(values: list[float]) -> bool:
    """One value, or the same value every time (within float noise)."""
    return len(values) <= 1 or max(values) - min(values) <= 1e-9 * max(1.0, abs(max(values)))


def draw(title: str, series: list[Series], max_step: int) -> str:
    """A chart as a base64 PNG. max_step: the x axis ends at the run's last step, so charts line up by step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    crowded = len(series) > 4  # the legend goes under the axes instead of over the lines
    fig, ax = plt.subplots(figsize=(4.8, 2.9 + 0.16 * math.ceil(len(series) / 3) * crowded), dpi=110)
    varying = [s for s in series if not is_constant(list(s.values))]
    for s in series:
        if s not in varying and varying:  # a constant beside curves: a reference level, not a flat curve of dots
            ax.axhline(s.values[0], color=s.color, linestyle="--", linewidth=1, alpha=0.8, label=s.label)
        elif s.eval:
            ax.plot(s.steps, s.values, color=s.color, linestyle="--", linewidth=1.2, marker="o", markersize=4,
                    label=s.label)
        else:
            weight = smoothing_weight(len(s.values))
            if weight > 0:
                ax.plot(s.steps, s.values, color=s.color, linestyle=s.linestyle, linewidth=0.8, alpha=0.25)
            ax.plot(s.steps, smooth(list(s.values), weight), color=s.color, linestyle=s.linestyle, linewidth=1.6,
                    marker="." if len(s.values) < 10 else None, label=s.label)
    ax.set_title(title, fontsize=10, loc="left")
    ax.set_xlabel("step", fontsize=8)
    ax.set_xlim(0, max(1, max_step))
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.tick_params(labelsize=8)
    ax.grid(alpha=0.25)
    ax.spines[["top", "right"]].set_visible(False)
    if len(series) > 1 and crowded:  # every series has a legend entry
        fig.legend(fontsize=6.5, frameon=False, loc="lower center", ncol=3)
        fig.tight_layout(rect=(0, 0.055 * math.ceil(len(series) / 3) * 2.9 / fig.get_figheight(), 1, 1))
    else:
        if len(series) > 1:
            ax.legend(fontsize=7, frameon=False, loc="best")
        fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    plt.close(fig)
    return base64.b64encode(buffer.getvalue()).decode("ascii")
