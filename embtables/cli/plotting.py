"""matplotlib for the command-line jobs: headless (the Agg backend), and optional."""

from __future__ import annotations

from typing import Any


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the Agg backend, or None when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def finish(plt: Any, fig: Any, ax: Any, xlabel: str, ylabel: str, title: str, path: Any) -> None:
    """Label, grid and legend ``ax``, write ``fig`` to ``path`` (PNG) and close it: the common end of
    every job's curve plot."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
