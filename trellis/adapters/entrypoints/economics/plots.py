"""The economics run's PNG plots: what was held over time (utilization.png: held, not busy),
compose latency, refusals by reason.

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


def time_axis(pooled: Figures, fixed: Figures, seconds: float) -> tuple[float, float]:
    """The held plot's time axis: the whole run (its `seconds`, where the storm and the last
    arrival fall) and every step, to the last lease's end."""
    steps = [t for f in (pooled, fixed) for t, _, _ in f.held_steps]
    return 0.0, max(seconds, pooled.span_s, fixed.span_s, *steps)


def draw(
    pooled: Figures,
    fixed: Figures,
    out: Path,
    storm: tuple[float, float],
    seconds: float,
) -> list[Path]:
    """utilization.png (GPUs and pooled memory held), latency.png and refusals.png in `out`;
    `storm` is (from, to) seconds into the runs, shaded on the held plot, whose time axis
    covers the run's `seconds` and the drain after the last arrival, which is marked."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot
    from matplotlib.ticker import MaxNLocator

    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "utilization.png", out / "latency.png", out / "refusals.png"]
    runs = (("pooled", pooled, POOLED_COLOUR), ("fixed pods", fixed, FIXED_COLOUR))

    figure, (gpu, memory) = pyplot.subplots(2, 1, figsize=(9, 6), sharex=True)
    arrivals_end = max(pooled.last_arrival_s, fixed.last_arrival_s)
    for name, figures, colour in runs:
        # The exact steps (not the sparklines' samples), so the plot shows the table's peak.
        times = [t for t, _, _ in figures.held_steps]
        gpus = [100 * g for _, g, _ in figures.held_steps]
        gpu.plot(times, gpus, label=name, color=colour, drawstyle="steps-post")
        memory_held = [100 * m for _, _, m in figures.held_steps]
        memory.plot(times, memory_held, label=name, color=colour, drawstyle="steps-post")
    for axes, what in ((gpu, "GPUs held, %"), (memory, "pooled memory held, %")):
        axes.set_ylabel(what)
        axes.set_ylim(0, 105)
        axes.set_xlim(*time_axis(pooled, fixed, seconds))
        axes.grid(alpha=0.3)
        axes.axvspan(*storm, color="grey", alpha=0.2, label="failure storm")
        axes.axvline(arrivals_end, color="black", linestyle="--", linewidth=1)
    # Above the axes, where no data is drawn: why the time axis runs past the run.
    gpu.annotate(
        "last arrival (dashed line); past it, the drain: leases running out",
        (arrivals_end, 1.0),
        xycoords=("data", "axes fraction"),
        xytext=(0, 3),
        textcoords="offset points",
        ha="right",
        va="bottom",
        fontsize=8,
        annotation_clip=False,
    )
    memory.legend(loc="upper right")  # pooled memory is low there, fixed pods hold none
    figure.suptitle("What was held over time (from the log's history)")
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
    reasons = sorted(set(pooled.refused) | set(fixed.refused))
    if reasons:
        for offset, (name, figures, colour) in zip((-width / 2, width / 2), runs, strict=True):
            xs = [k + offset for k in range(len(reasons))]
            counts = [figures.refused.get(r, 0) for r in reasons]
            axes.bar(xs, counts, width, label=name, color=colour)
        axes.set_xticks(range(len(reasons)), reasons)
        axes.legend()
    else:  # nothing to draw: say so, on a count axis that still starts at 0
        axes.set_xticks([])
        axes.set_ylim(0, 1)
        axes.text(
            0.5,
            0.5,
            "no refusals in either run",
            transform=axes.transAxes,
            ha="center",
            va="center",
        )
    axes.set_ylim(bottom=0)  # a count: never below 0
    axes.yaxis.set_major_locator(MaxNLocator(integer=True))
    axes.set_ylabel("requests refused")
    axes.set_title(f"Refusals by reason (of {pooled.requests} requests each)")
    axes.grid(axis="y", alpha=0.3)
    figure.tight_layout()
    figure.savefig(paths[2], dpi=100)
    pyplot.close(figure)
    return paths
