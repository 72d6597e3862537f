"""The training-curve PNG of a run's reports: the driver writes it at the end, ``report`` on demand,
and the MLflow upload logs it as an artifact. Its own module because it is the one matplotlib user
and needs nothing of MLflow.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

CURVE_PANELS = (("train/loss", "loss"), ("train/accuracy", "accuracy"), ("train/learning_rate", "learning rate"),
                ("train/throughput", "samples/s (global)"))


def curve_rows(history: list[dict[str, Any]], key: str) -> list[dict[str, Any]]:
    """Reports holding a number for ``key``, one per step in step order. Steps redone after a
    restart were reported twice: the later report of a step is the one the run continued from."""
    by_step = {h["step"]: h for h in history
               if isinstance(h.get("step"), int) and isinstance(h.get(key), (int, float))}
    return [by_step[k] for k in sorted(by_step)]


def plot_curves(history: list[dict[str, Any]], out: Path) -> bool:
    """Loss, accuracy, learning rate and throughput against step (validation points on the first
    two); False when no report has a training loss. Written to a temporary name, then renamed,
    so a reader never sees half a PNG."""
    rows = curve_rows(history, "train/loss")
    if not rows:
        return False
    # A first import builds matplotlib's font cache and logs that it does (INFO; a WARNING when it takes
    # over 5 s) onto the CLI's console: not the user's concern.
    logging.getLogger("matplotlib.font_manager").setLevel(logging.ERROR)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(CURVE_PANELS), figsize=(16, 3.6))
    for ax, (key, title) in zip(axes, CURVE_PANELS, strict=True):
        points = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float))]
        if points:
            ax.plot([p[0] for p in points], [p[1] for p in points], label="train")
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    val = [(h["step"], h["val/loss"], h.get("val/accuracy")) for h in curve_rows(history, "val/loss")]
    if val:
        axes[0].plot([v[0] for v in val], [v[1] for v in val], "o-", label="val")
        acc = [(v[0], v[2]) for v in val if isinstance(v[2], (int, float))]
        axes[1].plot([a[0] for a in acc], [a[1] for a in acc], "o-", label="val")
    for ax in axes[:2]:
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    try:
        fig.savefig(tmp, dpi=90, format="png")
        os.replace(tmp, out)
    except OSError:
        tmp.unlink(missing_ok=True)  # no half-written picture left behind (e.g. a full disk)
        raise
    finally:
        plt.close(fig)
    return True
