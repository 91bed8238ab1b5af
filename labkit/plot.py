"""One plot style for every notebook and benchmark, and one place results are saved."""

from pathlib import Path

from . import ROOT

RESULTS = ROOT / "bench_results"


def setup():
    """Apply the course style; returns pyplot. Uses a file backend when there is no display."""
    import matplotlib

    if not _interactive():
        matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update(
        {
            "figure.figsize": (7, 4),
            "figure.dpi": 110,
            "axes.grid": True,
            "grid.alpha": 0.3,
            "axes.spines.top": False,
            "axes.spines.right": False,
            "font.size": 10,
            "legend.frameon": False,
        }
    )
    return plt


def save(fig, name: str) -> Path:
    """Save under bench_results/<name>.png and return the path."""
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}.png"
    fig.savefig(path, bbox_inches="tight")
    return path


def _interactive() -> bool:
    try:
        from IPython import get_ipython

        return get_ipython() is not None
    except ImportError:
        return False
