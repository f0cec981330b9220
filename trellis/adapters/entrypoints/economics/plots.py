"""The economics run's PNG plots: utilization over time, compose latency, refusals by reason.

matplotlib is the `demo` extra and draws off-screen (Agg), so no display is needed. Each plot
puts the pooled run beside the fixed-pods run, from the same Figures the table prints.
"""

from __future__ import annotations

from pathlib import Path

from trellis.adapters.entrypoints.economics.figures import Figures

POOLED_COLOUR = "#1f77b4"
FIXED_COLOUR = "#d62728"


def available() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def draw(
    pooled: Figures,
    fixed: Figures,
    out: Path,
    storm: tuple[float, float] | None = None,
    arrivals_end: float | None = None,
) -> list[Path]:
    """utilization.png, latency.png and refusals.png in `out`; `storm` is (from, to) seconds
    into the runs, shaded on the utilization plot. The time axis runs to the last lease's
    end, past the last arrival at `arrivals_end`, which is marked: the drain is held too."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "utilization.png", out / "latency.png", out / "refusals.png"]
    runs = (("pooled", pooled, POOLED_COLOUR), ("fixed pods", fixed, FIXED_COLOUR))

    figure, (gpu, memory) = pyplot.subplots(2, 1, figsize=(9, 6), sharex=True)
    for name, figures, colour in runs:
        gpu.plot(figures.times, [100 * u for u in figures.gpu_util], label=name, color=colour)
        memory.plot(figures.times, [100 * u for u in figures.memory_util], label=name, color=colour)
    for axes, what in ((gpu, "GPUs held, %"), (memory, "pooled memory held, %")):
        axes.set_ylabel(what)
        axes.set_ylim(0, 105)
        axes.set_xlim(0, max(pooled.span_s, fixed.span_s))
        axes.grid(alpha=0.3)
        if storm is not None:
            axes.axvspan(*storm, color="grey", alpha=0.2, label="failure storm")
        if arrivals_end is not None:
            axes.axvline(arrivals_end, color="black", linestyle="--", linewidth=1)
    if arrivals_end is not None:
        gpu.annotate(
            "last arrival: then the drain,\nleases running out",
            (arrivals_end, 100),
            xytext=(4, -4),
            textcoords="offset points",
            va="top",
            fontsize=8,
            bbox={"facecolor": "white", "alpha": 0.8, "edgecolor": "none"},
        )
    memory.legend(loc="upper right")  # pooled memory is low there, fixed pods hold none
    gpu.set_title("What was held over time (from the log's history)")
    memory.set_xlabel("seconds into the run")
    figure.tight_layout()
    figure.savefig(paths[0], dpi=100)
    pyplot.close(figure)

    figure, axes = pyplot.subplots(figsize=(7, 4))
    # Only the percentiles both runs' compose counts support (figures.supported).
    labels = [q for q in pooled.latency_ms if q in fixed.latency_ms]
    width = 0.38
    for offset, (name, figures, colour) in zip((-width / 2, width / 2), runs, strict=True):
        xs = [k + offset for k in range(len(labels))]
        axes.bar(xs, [figures.latency_ms[q] for q in labels], width, label=name, color=colour)
    axes.set_xticks(range(len(labels)), labels)
    axes.set_ylabel("compose latency, ms (client-measured)")
    axes.set_title("Compose latency percentiles")
    axes.legend()
    axes.grid(axis="y", alpha=0.3)
    figure.tight_layout()
    figure.savefig(paths[1], dpi=100)
    pyplot.close(figure)

    figure, axes = pyplot.subplots(figsize=(8, 4))
    reasons = sorted(set(pooled.refused) | set(fixed.refused)) or ["none"]
    for offset, (name, figures, colour) in zip((-width / 2, width / 2), runs, strict=True):
        xs = [k + offset for k in range(len(reasons))]
        axes.bar(xs, [figures.refused.get(r, 0) for r in reasons], width, label=name, color=colour)
    axes.set_xticks(range(len(reasons)), reasons)
    axes.set_ylabel("requests refused")
    axes.set_title(f"Refusals by reason (of {pooled.requests} requests each)")
    axes.legend()
    axes.grid(axis="y", alpha=0.3)
    figure.tight_layout()
    figure.savefig(paths[2], dpi=100)
    pyplot.close(figure)
    return paths
