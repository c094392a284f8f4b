"""Snapshots as pictures (matplotlib: optional for needle, imported when a picture is drawn).

`plot_snapshot`: live bytes over the events as stacked areas, one per category, with the phases as light bands
and the peak marked and labelled with the largest tensors alive at that instant. `plot_side_by_side`: several
snapshots (gc off and gc on, say) on one shared y axis, so their heights compare at a glance. Figures are made
with matplotlib's `Figure` directly, not pyplot: no window, no global state, any backend (a notebook's too).
"""
from .recorder import CATEGORIES

# The HTML page's colours (viewer.js), so a PNG and a page read alike (a test keeps them equal).
COLORS = {"parameter": "#4e79a7", "gradient": "#f28e2b", "optimizer_state": "#b07aa1",
          "activation_kept": "#59a14f", "activation_recomputed": "#edc948", "workspace": "#bab0ac",
          "input": "#76b7b2", "other": "#9c755f", "host": "#ff9da7"}
PHASE_COLORS = {"forward": "#e6effc", "backward": "#fce9e7", "recompute": "#fdf5d3", "optimizer": "#e6f4e4"}
MB = 2**20


def describe(block):
    """A block in a few words: what made it, its shape and dtype, its size."""
    what = block.get("name") or " ".join(x for x in (block.get("op"), block.get("module") and
                                                    f"({block['module']})") if x) or block["category"]
    shape = "x".join(map(str, block["shape"])) or "scalar"
    return f"{what} [{shape} {block['dtype']}] {block['bytes'] / MB:.2f} MB"


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
        ax.fill_between(xs, [b / MB for b in bottom], [t / MB for t in top], step="post", linewidth=0,
                        color=COLORS[category], label=category)
        bottom = top
    if any(series["host"]):  # offloaded values' host copies: host memory, beside the device's stack
        ax.plot(xs, [b / MB for b in series["host"]], color=COLORS["host"], linestyle="--", linewidth=1,
                label="host (offloaded copies, not stacked)")
        used.append("host")
    for band in snapshot.phases:
        start, end = band["start"], min(band["end"], len(xs)) - 1
        if end < start or not xs:
            continue
        ax.axvspan(xs[start], xs[end], color=PHASE_COLORS.get(band["phase"], "#ffffff"), zorder=-1)
        ax.text((xs[start] + xs[end]) / 2, 0.99, band["phase"], transform=ax.get_xaxis_transform(), ha="center",
                va="top", fontsize=7, color="#555555", rotation=90 if end - start < 0.06 * len(xs) else 0,
                clip_on=True)
    peak = snapshot.peak
    if peak["event"] is not None:
        at = xs[peak["event"]]
        ax.axvline(at, color="black", linewidth=0.8, linestyle="--")
        ax.plot([at], [peak["bytes"] / MB], marker="v", color="black", markersize=5)
        alive = snapshot.alive_at(peak["event"])
        # What made the peak: the largest tensors besides the parameters and the optimizer's state, which are
        # there all step long (the bottom bands show them).
        shown = [b for b in alive if b["category"] not in ("parameter", "optimizer_state")][:largest] or alive[:largest]
        ax.annotate(f"peak {peak['bytes'] / MB:.1f} MB at event {peak['event']}; its largest tensors besides "
                    f"parameters and optimizer state:\n" + "\n".join(describe(b) for b in shown),
                    xy=(at, peak["bytes"] / MB), xytext=(0.98, 0.03), textcoords="axes fraction", ha="right",
                    va="bottom", fontsize=6.5, bbox=dict(boxstyle="round", facecolor="white", alpha=0.9),
                    arrowprops=dict(arrowstyle="->", linewidth=0.6))
    ax.set_xlabel("time (s)" if x == "time" else "event (an allocation or a free)")
    ax.set_ylabel("live bytes (MB)")
    if title:
        ax.set_title(title, fontsize=9, pad=14)
    return used


def new_figure(**kwargs):
    from matplotlib.figure import Figure  # optional dependency (the experiment extra)
    return Figure(**kwargs)


def plot_snapshot(snapshot, path=None, ax=None, title=None, x="event"):
    """One snapshot's timeline; saved at `path` (PNG) if given. Returns the figure."""
    figure = ax.figure if ax is not None else new_figure(figsize=(10, 4.5))
    ax = ax or figure.add_subplot(1, 1, 1)
    draw(snapshot, ax, title=title, x=x)
    ax.legend(loc="upper right", fontsize=7)
    if path is not None:
        figure.tight_layout()
        figure.savefig(path, dpi=120)
    return figure


def plot_side_by_side(labelled, path, title=None, x="event"):
    """[(label, snapshot), ...] side by side on one shared y axis, one legend; written to `path` (PNG)."""
    from matplotlib.patches import Rectangle  # optional dependency (the experiment extra)
    figure = new_figure(figsize=(6 * len(labelled), 4.8))
    axes = figure.subplots(1, len(labelled), sharey=True, squeeze=False)
    used = []
    for ax, (label, snapshot) in zip(axes[0], labelled):
        used += [c for c in draw(snapshot, ax, title=label, x=x) if c not in used]
    handles = [Rectangle((0, 0), 1, 1, color=COLORS[c]) for c in CATEGORIES if c in used]
    figure.legend(handles, [c for c in CATEGORIES if c in used], loc="lower center", ncol=len(handles), fontsize=8)
    if title:
        figure.suptitle(title, fontsize=10)
    figure.tight_layout(rect=(0, 0.07, 1, 1))
    figure.savefig(path, dpi=120)
    return path
