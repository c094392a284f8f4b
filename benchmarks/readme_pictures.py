"""The pictures of README and docs/offloading.md, drawn by gc.py and copied into docs/img/, with their figures.

    python benchmarks/readme_pictures.py timeline       # gc.py timeline on the demo model -> docs/img/timeline.png
    python benchmarks/readme_pictures.py budget-sweep   # gc.py sweep --over budget_mb -> docs/img/budget-sweep.png
    python benchmarks/readme_pictures.py capture-plan   # ndl.jit.capture's memory plans -> docs/img/capture-plan.png

Each prints Markdown on stdout: the picture's link and a small table of what it shows (benchmarks/figures.py writes
it into its page under its stamp, so the picture and its numbers are remade, and listed as stale, together). The
link is relative to that page: README.md for timeline, docs/offloading.md for budget-sweep, docs/capture.md for
capture-plan.
"""
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
IMG = os.path.join(ROOT, "docs", "img")
MB = 2**20


def gc_py(*argv, env=None):
    """Run gc.py in a fresh process from the repository root; its stdout."""
    done = subprocess.run([sys.executable, os.path.join(ROOT, "gc.py"), *argv, "--no-progress"], cwd=ROOT,
                          capture_output=True, text=True, check=True, env=env)
    return done.stdout


def timeline():
    """gc off beside gc on ("all") on the demo model: one step each, every allocation."""
    with tempfile.TemporaryDirectory() as out:
        gc_py("timeline", "--out", out)
        (png,) = glob.glob(os.path.join(out, "*.png"))
        os.makedirs(IMG, exist_ok=True)
        shutil.copyfile(png, os.path.join(IMG, "timeline.png"))
        rows = []
        for name in sorted(glob.glob(os.path.join(out, "*.json")), key=lambda p: not p.endswith("_off.json")):
            with open(name) as f:
                snap = json.load(f)
            recomputed = [b for b in snap["blocks"] if b["category"] == "activation_recomputed"]
            start = first_backward(snap)
            kept = sum(b["bytes"] for b in snap["blocks"] if b["category"] == "activation_kept"
                       and b["alloc"] is not None and b["alloc"] < start and (b["free"] is None or b["free"] > start))
            rows.append(f"| {'gc off' if name.endswith('_off.json') else 'gc on (all)'} | {len(snap['events']):,} | "
                        f"{snap['peak']['bytes'] / MB:.1f} MB | {phase_at(snap, snap['peak']['event'])} | "
                        f"{kept / MB:.1f} MB | {len(recomputed)} ({sum(b['bytes'] for b in recomputed) / MB:.1f} MB) |")
    print("![one training step of the demo model, gc off beside gc on](docs/img/timeline.png)\n")
    print("| pass | events | peak (all live bytes) | peak in | activations kept at backward's start | "
          "buffers recomputed |")
    print("| --- | --- | --- | --- | --- | --- |")
    print("\n".join(rows))


def first_backward(snap):
    return next((p["start"] for p in snap["phases"] if p["phase"] == "backward"), len(snap["events"]))


def phase_at(snap, event):
    return next((p["phase"] for p in snap["phases"] if p["start"] <= event < p["end"]), "?")


def budget_sweep():
    """Step time against the budget on gc.py's model with 16 layers (gc off's M_peak: about 235 MB; "all"'s: 48 MB):
    recompute only, offload only, both (issue #29's three curves)."""
    with tempfile.TemporaryDirectory() as out:
        # The cost model is calibrated afresh, in this run (its first child measures it, before its steps; the rest
        # read it): a calibration cached hours earlier on this shared machine ran at another load, and the
        # predicted times are set beside steps measured now.
        env = {**os.environ, "NEEDLE_CACHE_DIR": os.path.join(out, "calibration")}
        gc_py("sweep", "--over", "budget_mb", "--values", "25", "50", "90", "130", "170", "210", "--num-layers", "16",
              "--repeats", "1", "--max-batches", "10", "--warmup", "1", "--out", out, env=env)
        (png,) = glob.glob(os.path.join(out, "sweep_budget_mb-*.png"))
        os.makedirs(IMG, exist_ok=True)
        shutil.copyfile(png, os.path.join(IMG, "budget-sweep.png"))
        with open(os.path.join(out, "sweep.json")) as f:
            records = json.load(f)
    # The link as docs/offloading.md, the page of this figure, reaches the picture.
    print("![step time against the budget: recompute only, offload only, both](img/budget-sweep.png)\n")
    print("| curve | budget | M_peak | T_step | predicted T_step (/ measured) | first step (planning) / T_step | "
          "host peak |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in sorted(records, key=lambda r: (r.get("label"), r.get("budget_bytes") or 0)):
        curve = {"budget": "recompute only", "offload": "offload only (policy offload)",
                 "budget-offload": "recompute + offload"}.get(r.get("label"), r.get("label"))
        budget = f"{r['budget_bytes'] / MB:.0f} MB" if r.get("budget_bytes") else "none"
        measured, predicted = r.get("step_time_seconds"), r.get("predicted_time_seconds")
        first = (r.get("steps") or [{}])[0].get("time_seconds")
        print(f"| {curve} | {budget} | {fmt_mb(r.get('peak_activation_bytes'))} | {fmt_s(measured)} | "
              f"{fmt_s(predicted)}{f' ({predicted / measured:.2f})' if predicted and measured else ''} | "
              f"{f'{first / measured:.2f}x' if first and measured else 'n/a'} | {fmt_mb(r.get('host_peak_bytes'))} |")


def capture_plan():
    """The memory plans of bench_capture's small model captured with gc off and with gc all, side by side."""
    sys.path[:0] = [os.path.join(ROOT, "python"), os.path.join(ROOT, "apps"), os.path.join(ROOT, "benchmarks")]
    import needle as ndl
    from matplotlib.figure import Figure
    from bench_capture import SMALL, training

    fig = Figure(figsize=(11, 4))
    rows = []
    for ax, gc in zip(fig.subplots(1, 2), (False, True)):
        step, X, y = training(SMALL, gc)
        step(X, y)
        prediction = ndl.memory.predict(step, X, y)
        captured = ndl.jit.capture(step)
        while not captured.programs:
            captured(X, y)
        plan, name = captured.memory_plan, "gc all" if gc else "gc off"
        plan.draw(ax, f"{name}: {len(plan.buffers)} buffers, arena {plan.arena_bytes / MB:.1f} MiB")
        own = sum(prediction.by_category.get(c, 0) for c in ("activations", "temporaries", "gradients"))
        rows.append(f"| {name} | {len(captured.listing())} | {len(plan.buffers)} | {plan.arena_bytes / MB:.2f} MiB | "
                    f"{plan.lower_bound_bytes / MB:.2f} MiB | {own / MB:.2f} MiB |")
    fig.tight_layout()
    fig.savefig(os.path.join(IMG, "capture-plan.png"), dpi=100)
    print("![the memory plans of the small model's captured step, gc off and gc all](img/capture-plan.png)\n")
    print("| step | backend calls | buffers | arena | most alive at once | the ledger's prediction of the step's own "
          "bytes |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    print("\n".join(rows))


def fmt_mb(n):
    return "n/a" if n is None else f"{n / MB:.1f} MB"


def fmt_s(n):
    return "n/a" if n is None else f"{n:.3f} s"


if __name__ == "__main__":
    {"timeline": timeline, "budget-sweep": budget_sweep, "capture-plan": capture_plan}[sys.argv[1]]()
