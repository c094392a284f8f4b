"""gc.py plot DIR, and the plots sweep, max-batch and ablate draw as they end: the only module that imports
matplotlib (inside the functions that draw, so a run that draws nothing never loads it)."""
import glob
import hashlib
import json
import os
import statistics
import sys
import textwrap

import numpy as np

from ..console import fail
from ..data import SYNTHETIC
from ..growth import DEPTH_PARAMETERS, growth_exponents
from ..records import read_json
from ..report import plural
from ..runsets import bar_key, counts_text, ordered_labels, policy_base, run_label, run_set_key

# ----- plots --------------------------------------------------------------------------------------------------
NEUTRAL = "0.55"  # gc off: grey, drawn first
COLOURS = {"all": "tab:blue", "sqrt": "tab:orange", "selective": "tab:green", "budget": "tab:red"}


def _pyplot():
    """matplotlib.pyplot, drawing into files (Agg); a clear error where matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError as err:
        raise ImportError("gc.py draws its plots with matplotlib, which is not installed: "
                          "pip install -e '.[experiment]' (or make demo)") from err
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _colour(label):
    return NEUTRAL if policy_base(label) == "off" else COLOURS.get(policy_base(label), "tab:purple")


def _config_text(r, skip=()):
    """The configuration of a record as a plot's subtitle."""
    b, k = r.get("batch_size"), r.get("accumulation_steps") or 1
    parts = [("batch_size", f"batch {b}" if k == 1 else f"batch {b}x{k}"), ("seq_len", f"seq_len {r.get('seq_len')}"),
             ("embedding_size", f"embedding {r.get('embedding_size')}"),
             ("hidden_size", f"feed-forward {r.get('hidden_size')}"),
             ("num_layers", plural(r.get("num_layers"), "layer")), ("num_head", f"{r.get('num_head')} heads"),
             ("vocab_size", f"vocab {r.get('vocab_size')}"),
             ("data", "synthetic data" if r.get("data") == SYNTHETIC
              else f"data {os.path.basename(str(r.get('data')))}"),
             ("device", f"{r.get('device')}, {plural(r.get('threads'), 'thread')}"),
             ("lazy", "lazy" if r.get("lazy") else "eager"),
             ("head", r.get("head") and f"{r['head']} head"),
             ("max_batches", f"{r.get('max_batches')} steps, warmup {r.get('warmup')}")]
    return ", ".join(text for key, text in parts if key not in skip and text)


def _spread(values):
    """(median, [below, above]) of repeated measurements: an error bar from their min to their max."""
    med = statistics.median(values)
    return med, [med - min(values), max(values) - med]


PANELS = [("activation_bytes", "M_act (MiB): held at backward start", 2**20),
          ("peak_activation_bytes", "M_peak (MiB): forward + backward peak", 2**20),
          ("time", "T_step (s): median step time", 1)]


def _unreliable(records):
    return any(not r.get("step_time_reliable", True) for r in records)


def plot_sweep(records, out_dir):
    """One PNG per sweep in `records` (by sweep_id): M_act (with M_floor), M_peak and T_step against the swept
    parameter, a line per policy, error bars over repeats."""
    plt = _pyplot()
    pngs = []
    by_sweep = {}
    for r in records:
        by_sweep.setdefault(r.get("sweep_id", "?"), []).append(r)
    for sweep_id, rs in by_sweep.items():
        if rs[0].get("sweep_over") == "budget_mb":
            pngs.append(plot_budget_sweep(rs, out_dir, sweep_id))
            continue
        over = rs[0].get("sweep_over") or next(k for k in ("batch_size", "hidden_size", "segment_len", "num_layers")
                                               if len({r.get(k) for r in rs}) > 1)
        xs_all = sorted({r[over] for r in rs})
        depth = over in DEPTH_PARAMETERS  # memory on log axes, each line's growth exponent in the legend
        exponents = growth_exponents(rs, over) if depth else {}
        fig, axes = plt.subplots(1, 3, figsize=(14, 4.4))
        for label in ordered_labels(run_label(r) for r in rs):
            mine = [r for r in rs if run_label(r) == label]
            xs = sorted({r[over] for r in mine})
            for ax, (key, title, unit) in zip(axes, PANELS):
                stats = [_spread([r[key] / unit for r in mine if r[over] == x and r.get(key) is not None]) for x in xs]
                p = exponents.get(label, {}).get({"activation_bytes": "M_act", "peak_activation_bytes": "M_peak"}
                                                 .get(key))
                ax.errorbar(xs, [m for m, _ in stats], yerr=np.array([e for _, e in stats]).T, marker="o",
                            capsize=3, color=_colour(label), zorder=3 if label == "off" else 2,
                            label=label if p is None else f"{label} (p = {p:.2f})")
        floors = [statistics.median(r["floor_bytes"] / 2**20 for r in rs if r[over] == x and r.get("use_gc"))
                  if any(r[over] == x and r.get("use_gc") for r in rs) else None for x in xs_all]
        if any(f is not None for f in floors):
            axes[0].plot([x for x, f in zip(xs_all, floors) if f is not None], [f for f in floors if f is not None],
                         ls="--", color="black", lw=1, label="M_floor")
        _style_sweep_axes(axes, over, xs_all, depth, _unreliable(rs))
        handles, names = axes[0].get_legend_handles_labels()
        order = sorted(range(len(names)), key=lambda i: names[i] == "M_floor")  # the policies first, "off" leading
        axes[0].legend([handles[i] for i in order], [names[i] for i in order], fontsize=8)
        points = {}
        for r in rs:
            points[(run_label(r), r[over])] = points.get((run_label(r), r[over]), 0) + 1
        fig.suptitle(f"gc.py sweep over {over} ({counts_text(points.values(), 'repeat')}, median, bars: min-max)\n"
                     f"{_config_text(rs[0], {over})}", fontsize=10)
        fig.tight_layout()
        png = os.path.join(out_dir, f"sweep_{over}-{sweep_id}.png")
        fig.savefig(png, dpi=100)
        plt.close(fig)
        pngs.append(png)
    return pngs


def _style_sweep_axes(axes, over, xs_all, depth, unreliable):
    """Titles, the swept values as ticks; over a depth (growth.DEPTH_PARAMETERS) memory on log axes, where growth
    v = c + a * L^p is a slope, and each panel its legend (the exponents)."""
    from matplotlib.ticker import MaxNLocator

    for ax, (key, title, _) in zip(axes, PANELS):
        ax.set_title(title + ("\n(some from < 3 timed steps: unreliable)" if key == "time" and unreliable else ""),
                     fontsize=10)
        ax.set_xlabel(over)
        if depth and key != "time":
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.legend(fontsize=7)
        else:
            ax.set_ylim(bottom=0)
        if len(xs_all) <= 12:
            ax.set_xticks(xs_all, [str(x) for x in xs_all])  # the swept values themselves: integers
        else:
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)


# gc.py sweep --over budget_mb: each curve's legend.  "offload" (policy offload) parks what "all" drops whatever the
# budget: Budget has no offload-only mode, so that policy stands for the offload-only curve, and no b bounds it.
CURVE_LABELS = {"budget": "recompute only: Budget(b)",
                "offload": "offload only: policy offload (not bounded by b)",
                "budget-offload": "recompute + offload: Budget(b, offload=True)",
                "off": "gc off"}
CURVE_COLOURS = {"budget": COLOURS["budget"], "offload": "tab:purple", "budget-offload": "tab:cyan", "off": NEUTRAL}


def plot_budget_sweep(rs, out_dir, sweep_id):
    """sweep_budget_mb-<id>.png: T_step against the budget b, a curve each for recompute only, offload only and
    both (error bars over repeats), and beside it M_peak against b under the line M_peak = b.  What no budget
    bounds (gc off, offload only) ran once per repeat: a level line across the budgets."""
    plt = _pyplot()
    xs_all = sorted({r["sweep_value"] for r in rs})
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.6))
    for curve in [c for c in CURVE_LABELS if any(r.get("label") == c for r in rs)]:
        mine = [r for r in rs if r.get("label") == curve]
        style = {"color": CURVE_COLOURS[curve], "label": CURVE_LABELS[curve]}
        for ax, key, unit in ((axes[0], "time", 1), (axes[1], "peak_activation_bytes", 2**20)):
            if curve in ("off", "offload"):
                level = statistics.median(r[key] / unit for r in mine)
                ax.plot([xs_all[0], xs_all[-1]], [level, level], ls="--", **style)
                continue
            xs = sorted({r["sweep_value"] for r in mine})
            stats = [_spread([r[key] / unit for r in mine if r["sweep_value"] == x]) for x in xs]
            ax.errorbar(xs, [m for m, _ in stats], yerr=np.array([e for _, e in stats]).T, marker="o", capsize=3,
                        **style)
    axes[1].plot(xs_all, xs_all, color="black", lw=1, ls=":", label="M_peak = b (the bound)")
    titles = ["T_step (s): median step time" + ("\n(some from < 3 timed steps: unreliable)" if _unreliable(rs)
                                                 else ""), "M_peak (MiB): forward + backward peak"]
    for ax, title in zip(axes, titles):
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("budget b (MiB)")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        handles, names = ax.get_legend_handles_labels()  # the curves in CURVE_LABELS' order, the bound last
        rank = {label: i for i, label in enumerate(CURVE_LABELS.values())}
        order = sorted(range(len(names)), key=lambda i: rank.get(names[i], len(rank)))
        ax.legend([handles[i] for i in order], [names[i] for i in order], fontsize=8)
    repeats = len({r.get("repeat") for r in rs})
    fig.suptitle(f"gc.py sweep over the budget: recompute, offload or both ({repeats} repeat"
                 f"{'s' * (repeats != 1)}, median, bars: min-max)\n{_config_text(rs[0])}", fontsize=10)
    fig.tight_layout()
    png = os.path.join(out_dir, f"sweep_budget_mb-{sweep_id}.png")
    fig.savefig(png, dpi=100)
    plt.close(fig)
    return png


def runs_png_name(key, r):
    """A run set's PNG: the model's size and steps to read, and a digest of its whole configuration (`key`), so
    that no other run set in the folder (other steps, precision, ...) is drawn over it."""
    digest = hashlib.sha1(json.dumps(key).encode()).hexdigest()[:8]
    return (f"runs_b{r.get('batch_size')}x{r.get('seq_len')}_e{r.get('embedding_size')}_h{r.get('hidden_size')}_"
            f"l{r.get('num_layers')}_v{r.get('vocab_size')}{'_full' if r.get('head', 'full') == 'full' else ''}_"
            f"{r.get('max_batches')}steps-{digest}.png")


def _tick(label, runs, counts_differ):
    """A bar's name: its label, its count of runs where the bars' counts differ or it has several, and a mark where
    one of its runs was interrupted (its JSON has "complete": false)."""
    stopped = [r for r in runs if r.get("complete") is False]
    count = f"\n({plural(len(runs), 'run')})" if counts_differ or len(runs) > 1 else ""
    return label.replace(", ", ",\n") + count + (f"\n(incomplete: {len(stopped[0]['steps'])} steps)" if stopped else "")


def plot_runs(records, out_dir):
    """One PNG per run set among `records` (`run` JSONs that share every configuration field but the policy's):
    a bar per configuration ("off" first) for M_act (M_floor marked), M_peak and T_step, its runs those equal in
    every field but the seed (repeats), error bars over them where a bar has several."""
    sets = {}
    for r in records:
        sets.setdefault(run_set_key(r), {}).setdefault(bar_key(r), []).append(r)
    return [_plot_run_set(key, list(bars.values()), out_dir) for key, bars in sets.items()]


def _plot_run_set(key, bars, out_dir):
    """One run set's PNG: `bars`, a list of the runs of each bar."""
    plt = _pyplot()
    order = ordered_labels(run_label(runs[0]) for runs in bars)
    bars = sorted(bars, key=lambda runs: order.index(run_label(runs[0])))  # off first, in grey
    labels, counts = [run_label(runs[0]) for runs in bars], [len(runs) for runs in bars]
    rs = [r for runs in bars for r in runs]
    fig, axes = plt.subplots(1, 3, figsize=(4 + 1.6 * len(labels) * 3, 4.4))
    for ax, (field, title, unit) in zip(axes, PANELS):
        stats = [_spread([r[field] / unit for r in runs if r.get(field) is not None] or [0]) for runs in bars]
        # error bars only on a bar with repeats to spread (nan: none drawn on one of a single run)
        errors = np.array([e if n > 1 else [np.nan, np.nan] for (_, e), n in zip(stats, counts)]).T
        drawn = ax.bar(range(len(labels)), [m for m, _ in stats], yerr=errors if max(counts) > 1 else None,
                       capsize=4, color=[_colour(label) for label in labels], zorder=2)
        ax.bar_label(drawn, labels=[f"{m:.3f}" if field == "time" or m < 10 else f"{m:.1f}" for m, _ in stats],
                     fontsize=8, padding=2)
        ax.margins(y=0.12)  # room for the labels
        floors = [r["floor_bytes"] / 2**20 for r in rs if r.get("use_gc") and r.get("floor_bytes") is not None]
        if field == "activation_bytes" and floors:  # the floor is a property of the checkpointed graph
            ax.axhline(statistics.median(floors), color="black", ls="--", lw=1, zorder=3,
                       label="M_floor: what no policy can drop")
            ax.legend(fontsize=8)
        ax.set_xticks(range(len(labels)))
        ax.set_xticklabels([_tick(label, runs, len(set(counts)) > 1) for label, runs in zip(labels, bars)],
                           fontsize=9)
        ax.set_ylim(bottom=0)
        ax.grid(axis="y", alpha=0.3, zorder=0)
        ax.set_title(title + ("\n(from < 3 timed steps: unreliable)" if field == "time" and _unreliable(rs) else ""),
                     fontsize=10)
    spread = ", median, bars: min-max" if max(counts) > 1 else ""
    fig.suptitle(f"gc.py run: gradient checkpointing off vs on ({counts_text(counts, 'run')} per bar{spread})\n"
                 f"{_config_text(rs[0])}", fontsize=10)
    fig.tight_layout()
    png = os.path.join(out_dir, runs_png_name(key, rs[0]))
    fig.savefig(png, dpi=100)
    plt.close(fig)
    return png


def plot_max_batch(result, out_dir):
    """The largest batch per policy under the cap, "off" first, with its ratio to gc off's."""
    plt = _pyplot()
    from matplotlib.ticker import MaxNLocator

    best = result["largest_batch"]
    labels = ordered_labels(best)
    fig, ax = plt.subplots(figsize=(max(7.0, 2 + 1.4 * len(labels)), 4.8))
    ax.bar(range(len(labels)), [best[p] for p in labels], color=[_colour(p) for p in labels], zorder=2)
    for i, p in enumerate(labels):
        ratio = f"\n{best[p] / best['off']:.2f}x off" if best.get("off") else ""
        ax.annotate(f"{best[p]}{ratio}", (i, best[p]), ha="center", va="bottom", fontsize=9)
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels(labels)
    ax.set_ylabel("largest batch that trains")
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylim(0, max(list(best.values()) + [1]) * 1.25)
    ax.grid(axis="y", alpha=0.3, zorder=0)
    cap = result.get("memory_limit_bytes")
    cap_text = f"{cap / 2**20:g} MiB" if cap else "?"
    config = textwrap.fill(_config_text(result, {"batch_size", "max_batches"}), 90)
    ax.set_title(f"gc.py max-batch: the largest batch that trains under a cap of {cap_text}\n{config}", fontsize=9)
    fig.tight_layout()
    png = os.path.join(out_dir, f"max_batch-{result.get('max_batch_id', 'result')}.png")
    fig.savefig(png, dpi=100)
    plt.close(fig)
    return png


ROW_COLOURS = {**COLOURS, "offload-all": CURVE_COLOURS["offload"], "budget-offload": CURVE_COLOURS["budget-offload"],
               "baseline": NEUTRAL, "accumulate": "tab:brown", "fused": "tab:purple", "combined": "tab:cyan",
               "mixed-bf16": "tab:pink", "mixed-fp16": "tab:pink", "bf16": "tab:pink", "adam8bit": "tab:olive",
               "adafactor": "tab:olive", "offload": "tab:olive", "toolbox": "black"}


def plot_ablation(result, out_dir):
    """ablation.png: a bar per row (baseline on top, in grey) of the step's peak of all live bytes, M_peak (M_act
    inside it), resident memory in use at the step's peak and T_step, each labelled with its change from the
    baseline; the final loss beside each row's name."""
    plt = _pyplot()
    rows = [r for r in result["rows"] if "failed" not in r]
    names = [f"{r['row']}\nloss {r['loss']:.4f}" if r.get("loss") is not None else r["row"] for r in rows]
    names = [f"{name}\n(per rank)" if r.get("parallel") else name for name, r in zip(names, rows)]
    colours = [ROW_COLOURS.get(r["row"], "tab:olive") for r in rows]
    y = np.arange(len(rows))
    fig, axes = plt.subplots(1, 4, figsize=(20, 1.6 + 0.62 * len(rows)), sharey=True)
    panels = [("peak_bytes", "the step's peak (MiB): all live bytes", 2**20, "peak_bytes_change"),
              ("peak_activation_bytes", "M_peak (MiB), M_act inside (hatched)", 2**20, "peak_change"),
              ("rss_peak_bytes", "resident memory a step uses at its peak (MiB)", 2**20, None),
              ("step_time_seconds", "T_step (s): median step time", 1, "time_change")]
    for ax, (key, title, unit, change) in zip(axes, panels):
        values = [(r.get(key) or 0) / unit for r in rows]
        ax.barh(y, values, color=colours, zorder=2, height=0.7)
        if key == "peak_activation_bytes":
            ax.barh(y, [r["activation_bytes"] / unit for r in rows], color="none", edgecolor="black", hatch="//",
                    height=0.35, lw=0.6, zorder=3)
        for i, (r, v) in enumerate(zip(rows, values)):
            text = f"{v:.3f}" if unit == 1 else f"{v:.1f}"
            if unit != 1 and r.get("parallel"):  # one rank's memory: no change from the baseline's whole model
                text += " per rank"
            elif change and r.get(change) is not None and r["row"] != "baseline":
                text += f" ({r[change] * 100:+.0f}%)"
            ax.annotate(text, (v, i), xytext=(3, 0), textcoords="offset points", va="center", fontsize=8)
        ax.set_xlim(0, max(values + [1e-9]) * 1.35)
        ax.set_title(title + ("\n(from < 3 timed steps: unreliable)" if key == "step_time_seconds"
                              and _unreliable(rows) else ""), fontsize=10)
        ax.grid(axis="x", alpha=0.3, zorder=0)
    axes[0].set_yticks(y)
    axes[0].set_yticklabels(names, fontsize=9)
    axes[0].invert_yaxis()  # the rows in the table's order, baseline first
    config = textwrap.fill(_config_text(result, {"max_batches"}) + f", {result.get('steps_per_row')} steps per row, "
                           f"warmup {result.get('warmup')}", 150)
    fig.suptitle(f"gc.py ablate: each technique trains the same model for the same steps (a fresh process per row)"
                 f"\n{config}", fontsize=10)
    fig.tight_layout()
    png = os.path.join(out_dir, "ablation.png")
    fig.savefig(png, dpi=100)
    plt.close(fig)
    return png


def main(config):
    folder = config.dir
    if not os.path.isdir(folder):
        fail(f"plot: {folder} is not a folder")
    runs, sweeps, searches, ablations, skipped = [], {}, {}, [], []
    for path in sorted(glob.glob(os.path.join(folder, "*.json"))):
        try:
            data = read_json(path)
        except (OSError, ValueError):
            skipped.append(path)
            continue
        if isinstance(data, list) and data and all(isinstance(r, dict) and "sweep_id" in r for r in data):
            for r in data:
                value = r.get("sweep_value", r.get(r.get("sweep_over") or "batch_size"))
                sweeps.setdefault(r["sweep_id"], {})[(r.get("json"), r.get("repeat"), run_label(r), value)] = r
                # (sweep.json repeats a sweep-<id>.json: counted once)
        elif isinstance(data, dict) and "largest_batch" in data:
            searches[data.get("max_batch_id", path)] = data
        elif isinstance(data, dict) and data.get("kind") == "ablation":
            ablations.append(data)
        elif isinstance(data, dict) and "steps" in data and "activation_bytes" in data:
            if not {"sweep_id", "max_batch_id", "ablation_id"} & set(data):  # plotted with their sweep/search/ablation
                runs.append(data)
        else:
            skipped.append(path)
    pngs = []
    if runs:
        pngs += plot_runs(runs, folder)
    for rs in sweeps.values():
        pngs += plot_sweep(list(rs.values()), folder)
    for result in searches.values():
        if result.get("largest_batch"):
            pngs.append(plot_max_batch(result, folder))
    for result in ablations:  # ablate writes one ablation.json per folder
        if any("failed" not in r for r in result["rows"]):
            pngs.append(plot_ablation(result, folder))
    if not pngs:
        fail(f"plot: {folder} holds no gc.py run, sweep, max-batch or ablation JSON")
    for path in skipped:
        print(f"skipped {path} (not a gc.py JSON)", file=sys.stderr)
    subfolders = [d for d in sorted(glob.glob(os.path.join(folder, "*", ""))) if glob.glob(os.path.join(d, "*.json"))]
    for d in subfolders:
        print(f"({d} holds JSON too: python gc.py plot {d})", file=sys.stderr)
    print(f"wrote {', '.join(pngs)}")
