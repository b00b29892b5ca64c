"""PNG plots of per-step metrics, one panel per metric, one line per run.

Rewards of single RL steps are noisy (each step sees different prompts), so a trailing moving average is
drawn over the raw values.
"""

from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

Panel = Tuple[str, str]  # (metric key, title)

RL_PANELS: Tuple[Panel, ...] = (
    ("reward_mean", "reward (mean over samples)"),
    ("accuracy", "accuracy (sampled)"),
    ("kl", "KL to the reference"),
    ("response_length", "response length (tokens)"),
)


def moving_average(values: Sequence[float], window: int) -> List[float]:
    """Trailing mean over the last ``window`` values (fewer at the start)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def plot_runs(
    runs: Dict[str, List[dict]],
    panels: Sequence[Panel],
    png_path: str,
    smooth: int = 10,
    title: str = "",
    unsmoothed: Sequence[str] = (),
) -> List[str]:
    """Draw ``panels`` for every run into ``png_path``; returns the metric keys that had data.

    Args:
        runs: Run name -> its rows (``metrics.jsonl``), each with a ``step``.
        panels: ``(metric key, title)``; panels no run has data for are left out.
        smooth: Moving-average window drawn over the raw line; <= 1 draws the raw values only.
        unsmoothed: Runs drawn as they are, with markers (e.g. periodic held-out evaluations).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    present = [(k, t) for k, t in panels if any(k in row for rows in runs.values() for row in rows)]
    if not present:
        raise ValueError(f"none of {[k for k, _ in panels]} is in the metrics")
    cols = 2 if len(present) > 1 else 1
    n_rows = -(-len(present) // cols)
    fig, axes = plt.subplots(n_rows, cols, figsize=(6 * cols, 3.2 * n_rows), squeeze=False)
    for ax, (key, heading) in zip(axes.flat, present):
        for i, (name, rows) in enumerate(runs.items()):
            points = [(row["step"], float(row[key])) for row in rows if key in row]
            if not points:
                continue
            steps, values = zip(*points)
            color = f"C{i}"
            if name in unsmoothed:
                ax.plot(steps, values, color=color, linewidth=2, marker="o", label=name)
            elif smooth > 1:
                ax.plot(steps, values, color=color, alpha=0.25, linewidth=1)
                ax.plot(
                    steps,
                    moving_average(values, smooth),
                    color=color,
                    linewidth=2,
                    label=f"{name} ({smooth}-step mean)",
                )
            else:
                ax.plot(steps, values, color=color, linewidth=1.5, label=name)
        ax.set_title(heading)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if len(runs) > 1 or smooth > 1:
            ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(present) :]:
        ax.axis("off")
    if title:
        fig.suptitle(title)
    # leave ~0.45 inch at the top for the title, whatever the figure's height
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.45 / fig.get_figheight()) if title else None)
    fig.savefig(png_path, dpi=110)
    plt.close(fig)
    return [k for k, _ in present]
