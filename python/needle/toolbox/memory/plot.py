"""Snapshots as pictures (matplotlib: optional for needle, imported when a picture is drawn).

`plot_snapshot`: live bytes (MiB) over the events as stacked areas, one per category, with the phases as light
bands (named where the name fits, and in the legend) and the peak marked and labelled with the largest tensors
alive at that instant; above them, as a line, the bytes the allocator holds resident (reserved: live + what it
keeps cached for reuse, where the backend reports it; the gap is its cache and fragmentation).
`plot_side_by_side`: several snapshots (gc off and gc on, say) on one shared y axis, so their heights compare at
a glance. Figures are made with matplotlib's `Figure` directly, not pyplot: no window, no global state, any
backend (a notebook's too).
"""
from .recorder import CATEGORIES

# The HTML page's colours (viewer.js), so a PNG and a page read alike (a test keeps them equal).
COLORS = {"parameter": "#4e79a7", "gradient": "#f28e2b", "optimizer_state": "#b07aa1",
          "activation_kept": "#59a14f", "activation_recomputed": "#edc948", "workspace": "#bab0ac",
          "input": "#76b7b2", "other": "#9c755f", "host": "#ff9da7"}
PHASE_COLORS = {"forward": "#e6effc", "backward": "#fce9e7", "recompute": "#fdf5d3", "optimizer": "#e6f4e4"}
MIB = 2**20  # binary units, labelled as such: MiB


def describe(block):
    """A block in a few words: what made it, its shape and dtype, its size."""
    what = block.get("name") or " ".join(x for x in (block.get("op"), block.get("module") and
                                                    f"({block['module']})") if x) or block["category"]
    shape = "x".join(map(str, block["shape"])) or "scalar"
    return f"{what} [{shape} {block['dtype']}] {block['bytes'] / MIB:.2f} MiB"


def draw(snapshot, ax, title=None, x="event", largest=3):
    """Draw one snapshot on `ax`; returns the categories drawn (for a shared legend)."""
    series = snapshot.bytes_by_category()
    if x == "time":
        xs = [e["time"] for e in snapshot.events]
    else:
        xs = list(range(len(snapshot.events)))
    baseline = snapshot.data["baseline_bytes"]
    used = [c for c in CATEGORIES if c != "host" and any(series[c])]  # the device's bytes, stacked
    bottom = [baseline] * len(xs)
    for category in used:
        top = [b + v for b, v in zip(bottom, series[category])]
        ax.fill_between(xs, [b / MIB for b in bottom], [t / MIB for t in top], step="post", linewidth=0,
                        color=COLORS[category], label=category)
        bottom = top
    if any(series["host"]):  # offloaded values' host copies: host memory, beside the device's stack
        ax.plot(xs, [b / MIB for b in series["host"]], color=COLORS["host"], linestyle="--", linewidth=1,
                label="host (offloaded copies, not stacked)")
        used.append("host")
    reserved = [e.get("reserved_bytes") for e in snapshot.events]
    if reserved and None not in reserved:  # what the allocator holds resident: live + cached (fragmentation shows)
        ax.step(xs, [b / MIB for b in reserved], where="post", color="black", linewidth=0.8,
                label="reserved (live + cached for reuse)")
        used.append("reserved")
    draw_phases(snapshot, ax, xs)
    peak = snapshot.peak
    if peak["event"] is not None:
        at = xs[peak["event"]]
        ax.axvline(at, color="black", linewidth=0.8, linestyle="--")
        ax.plot([at], [peak["bytes"] / MIB], marker="v", color="black", markersize=5)
        alive = snapshot.alive_at(peak["event"])
        # What made the peak: the largest tensors besides the parameters and the optimizer's state, which are
        # there all step long (the bottom bands show them).
        shown = [b for b in alive if b["category"] not in ("parameter", "optimizer_state")][:largest] or alive[:largest]
        ax.annotate(f"peak {peak['bytes'] / MIB:.1f} MiB at event {peak['event']}; its largest tensors besides "
                    f"parameters and optimizer state:\n" + "\n".join(describe(b) for b in shown),
                    xy=(at, peak["bytes"] / MIB), xytext=(0.98, 0.03), textcoords="axes fraction", ha="right",
                    va="bottom", fontsize=6.5, bbox=dict(boxstyle="round", facecolor="white", alpha=0.9),
                    arrowprops=dict(arrowstyle="->", linewidth=0.6))
    ax.set_xlabel("time (s)" if x == "time" else "event (an allocation or a free)")
    ax.set_ylabel("live bytes (MiB)")
    if title:
        ax.set_title(title, fontsize=9, pad=14)
    return used


PHASE_FONT = 7  # points


def draw_phases(snapshot, ax, xs):
    """The phases as light bands, each named at its top where the name fits inside it (so no two names overlap:
    a backward interleaved with short recomputations has bands a few events wide); phase_handles() gives the
    legend that names them all."""
    if not xs:
        return
    span = (xs[-1] - xs[0]) or 1
    axes_inches = ax.get_position().width * ax.figure.get_figwidth()
    char = PHASE_FONT * 0.6 / 72 / axes_inches * 1.1  # a character's width, a share of the axes (with a margin)
    for band in snapshot.phases:
        start, end = band["start"], min(band["end"], len(xs)) - 1
        if end < start:
            continue
        ax.axvspan(xs[start], xs[end], color=PHASE_COLORS.get(band["phase"], "#ffffff"), zorder=-1)
        if (xs[end] - xs[start]) / span >= (len(band["phase"]) + 1) * char:
            ax.text((xs[start] + xs[end]) / 2, 0.99, band["phase"], transform=ax.get_xaxis_transform(),
                    ha="center", va="top", fontsize=PHASE_FONT, color="#555555", clip_on=True)


def phase_handles(snapshots):
    """(legend patches, names) of the phases the snapshots have, in PHASE_COLORS' order."""
    from matplotlib.patches import Patch  # optional dependency (the experiment extra)
    seen = {band["phase"] for s in snapshots for band in s.phases}
    names = [p for p in PHASE_COLORS if p in seen]
    return [Patch(facecolor=PHASE_COLORS[p], edgecolor="#bbbbbb") for p in names], names


def new_figure(**kwargs):
    from matplotlib.figure import Figure  # optional dependency (the experiment extra)
    return Figure(**kwargs)


def plot_snapshot(snapshot, path=None, ax=None, title=None, x="event"):
    """One snapshot's timeline; saved at `path` (PNG) if given. Returns the figure."""
    figure = ax.figure if ax is not None else new_figure(figsize=(10, 4.5))
    ax = ax or figure.add_subplot(1, 1, 1)
    draw(snapshot, ax, title=title, x=x)
    handles, names = ax.get_legend_handles_labels()
    phases, phase_names = phase_handles([snapshot])
    ax.legend(handles + phases, names + [f"phase: {p}" for p in phase_names], loc="upper right", fontsize=7)
    if path is not None:
        figure.tight_layout()
        figure.savefig(path, dpi=120)
    return figure


def plot_side_by_side(labelled, path, title=None, x="event"):
    """[(label, snapshot), ...] side by side on one shared y axis, one legend; written to `path` (PNG)."""
    from matplotlib.lines import Line2D  # optional dependency (the experiment extra)
    from matplotlib.patches import Rectangle
    figure = new_figure(figsize=(6 * len(labelled), 4.8))
    axes = figure.subplots(1, len(labelled), sharey=True, squeeze=False)
    used = []
    for ax, (label, snapshot) in zip(axes[0], labelled):
        used += [c for c in draw(snapshot, ax, title=label, x=x) if c not in used]
    handles = [Rectangle((0, 0), 1, 1, color=COLORS[c]) for c in CATEGORIES if c in used]
    names = [c for c in CATEGORIES if c in used]
    if "reserved" in used:
        handles.append(Line2D([], [], color="black", linewidth=0.8))
        names.append("reserved (live + cached for reuse)")
    phases, phase_names = phase_handles([snapshot for _, snapshot in labelled])
    entries = len(handles + phases)
    rows = 1 + (entries > 7)  # two rows where one would run past the figure's edges
    figure.legend(handles + phases, names + [f"phase: {p}" for p in phase_names],
                  loc="lower center", ncol=-(-entries // rows), fontsize=8)
    if title:
        figure.suptitle(title, fontsize=10)
    figure.tight_layout(rect=(0, 0.03 + 0.045 * rows, 1, 1))
    figure.savefig(path, dpi=120)
    return path
