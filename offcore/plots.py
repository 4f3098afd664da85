"""PNG plots of an ``offcore compare`` run (matplotlib, Agg backend, imported only when drawing).

- :func:`plot_memory`: device bytes over one step, one panel per strategy: measured
  (sampled while the step ran) and predicted (the simulator's lifetimes), with the
  capacity as a line.
- :func:`plot_timeline`: the compute / D2H / H2D / wait timeline of one step per
  strategy, measured (host clock) above predicted.

    >>> from offcore.plots import matplotlib_available
    >>> isinstance(matplotlib_available(), bool)
    True
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Sequence
from typing import Any

from offcore.comparison import StrategyResult

__all__ = ["matplotlib_available", "plot_memory", "plot_timeline"]

_TRACK_ORDER = ("compute", "d2h", "h2d", "wait")
_COLOURS = {
    "forward": "#4C72B0",
    "backward": "#55A868",
    "recompute": "#8172B2",
    "optimizer": "#937860",
    "d2h": "#DD8452",
    "h2d": "#C44E52",
    "wait": "#000000",
    "overhead": "#999999",
}


def matplotlib_available() -> bool:
    """True when matplotlib can be imported (the ``report`` extra: ``pip install 'offcore[report]'``)."""
    return importlib.util.find_spec("matplotlib") is not None


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _colour(kind: str, name: str) -> str:
    for key in ("recompute", "forward", "backward", "optimizer", "overhead"):
        if name.startswith(key) or kind == key:
            return _COLOURS[key]
    return _COLOURS.get(kind, "#777777")


def plot_memory(results: Sequence[StrategyResult], path: str | os.PathLike[str], *, capacity: int | None) -> None:
    """Device memory over one step per strategy: measured (solid) and predicted (dashed), in MiB."""
    plt = _pyplot()
    shown = [r for r in results if r.memory_series or r.predicted_memory]
    fig, axes = plt.subplots(len(shown) or 1, 1, figsize=(9, 1.9 * max(1, len(shown)) + 0.6), squeeze=False)
    for ax, result in zip(axes[:, 0], shown, strict=False):
        if result.memory_series:
            t, b = zip(*result.memory_series, strict=True)
            ax.plot([x * 1e3 for x in t], [y / 2**20 for y in b], lw=1.2, color="C0", label="measured")
        if result.predicted_memory:
            t, b = zip(*result.predicted_memory, strict=True)
            ax.step(
                [x * 1e3 for x in t],
                [y / 2**20 for y in b],
                where="post",
                ls="--",
                lw=1.0,
                color="C1",
                label="predicted",
            )
        if capacity:
            ax.axhline(capacity / 2**20, color="red", lw=0.8, ls=":", label="capacity")
        status = "" if result.ok else f" ({result.status.upper()})"
        ax.set_title(f"{result.name}{status}: {result.plan}", fontsize=9, loc="left")
        ax.set_ylabel("MiB")
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("time in step (ms)")
    if shown:
        handles: dict[str, Any] = {}
        for ax in axes[:, 0]:  # one legend for every line style used in any panel
            for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
                handles.setdefault(label, handle)
        axes[0, 0].legend(list(handles.values()), list(handles), fontsize=7, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_timeline(results: Sequence[StrategyResult], path: str | os.PathLike[str]) -> None:
    """Compute / D2H / H2D / wait spans of one step per strategy: measured, then predicted."""
    plt = _pyplot()
    rows: list[tuple[str, list[tuple[str, str, float, float]]]] = []
    for result in results:
        if result.timeline:
            rows.append((f"{result.name} measured", result.timeline))
        if result.predicted_timeline:
            rows.append((f"{result.name} predicted", result.predicted_timeline))
    fig, axes = plt.subplots(len(rows) or 1, 1, figsize=(10, 1.25 * max(1, len(rows)) + 0.6), squeeze=False)
    for ax, (title, spans) in zip(axes[:, 0], rows, strict=False):
        tracks = [t for t in _TRACK_ORDER if any(s[0] == t for s in spans)] or ["compute"]
        for track, name, start, end in spans:
            if track not in tracks:
                continue
            y = len(tracks) - 1 - tracks.index(track)
            kind = name.split(":")[0].split("#")[0]
            ax.broken_barh(
                [(start * 1e3, max(end - start, 0.0) * 1e3)],
                (y - 0.4, 0.8),
                color=_colour(track if track != "compute" else kind, name),
            )
        ax.set_yticks(range(len(tracks)))
        ax.set_yticklabels(list(reversed(tracks)), fontsize=7)
        ax.set_title(title, fontsize=9, loc="left")
        ax.grid(axis="x", alpha=0.3)
    axes[-1, 0].set_xlabel("time in step (ms)")
    from matplotlib.patches import Patch

    legend = [Patch(color=colour, label=label) for label, colour in _COLOURS.items()]
    fig.legend(handles=legend, loc="upper center", ncol=len(legend), fontsize=7, frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.35 / fig.get_figheight()))
    fig.savefig(path, dpi=110)
    plt.close(fig)
