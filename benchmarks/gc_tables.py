"""gc.py's runs as Markdown tables, for the pages (benchmarks/figures.py runs these).

    python benchmarks/gc_tables.py demo       # `python gc.py` (the demo, `make demo`): gc off vs "all"
    python benchmarks/gc_tables.py ablate     # `python gc.py ablate`: every technique, the same model and steps
    python benchmarks/gc_tables.py heads      # the full vs the fused LM head at the benchmark model, gc off and all
    python benchmarks/gc_tables.py parallel   # per-rank memory of `mpiexec -n 2 gc.py run --parallel dp|zero1|zero2`
    python benchmarks/gc_tables.py writeup    # `gc.py run --preset writeup`: the write-up's experiment, gc off vs on

Each runs gc.py in fresh processes with its console on stderr, writing its JSON into a temporary folder, and
prints the table from those JSON files on stdout. The data is gc.py's default (data/ptb, then ../shared/data/ptb).
"""
import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile

from bench_gc import head_part  # the LM head + loss measured alone, in this process
from md_table import markdown_table, progress_to_stderr

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GC = os.path.join(ROOT, "gc.py")
BENCHMARK_MODEL = ["--batch-size", "128", "--seq-len", "32", "--embedding-size", "256", "--hidden-size", "256",
                   "--num-layers", "4", "--num-head", "4"]


def gc_py(*argv, launcher=()):
    """Run gc.py (under `launcher`, e.g. mpiexec) with its output on stderr; a failure ends this script."""
    cmd = [*launcher, sys.executable, GC, *argv]
    print(f"gc_tables: {' '.join(cmd)}", file=sys.stderr, flush=True)
    if subprocess.run(cmd, cwd=ROOT, stdout=sys.stderr).returncode != 0:
        raise SystemExit(f"gc_tables: {' '.join(cmd)} failed")


def read(path):
    with open(path) as f:
        return json.load(f)


def mb(nbytes):
    return "" if nbytes is None else f"{nbytes / 2**20:.1f} MB"


def change(new, old):
    return f"{(new / old - 1) * 100:+.1f}%" if new is not None and old else ""


def demo(out):
    """The demo's two passes: per policy M_act, M_peak, RSS_peak, T_step and the loss; then gc all's changes."""
    gc_py("--out", out)
    runs = sorted((read(p) for p in glob.glob(os.path.join(out, "*.json"))), key=lambda r: r["use_gc"])
    if [r["use_gc"] for r in runs] != [False, True]:
        raise SystemExit(f"gc_tables: the demo wrote {len(runs)} JSON files into {out}, not gc off's and gc on's")
    off, on = runs
    rows = [[f"gc {r['policy'] if r['use_gc'] else 'off'}", mb(r["activation_bytes"]), mb(r["peak_activation_bytes"]),
             mb(r["rss_peak_bytes"]), f"{r['step_time_seconds']:.3f} s",
             f"{r['steps'][0]['loss']:.2f} → {r['loss']:.2f}"] for r in runs]
    rows.append(["change", change(on["activation_bytes"], off["activation_bytes"]),
                 change(on["peak_activation_bytes"], off["peak_activation_bytes"]),
                 change(on["rss_peak_bytes"], off["rss_peak_bytes"]),
                 change(on["step_time_seconds"], off["step_time_seconds"]), ""])
    first, last = off["steps"][0]["step"], off["steps"][-1]["step"]  # gc.py counts steps from 0, as its lines do
    header = ["`python gc.py`", "M_act", "M_peak", "RSS_peak", "T_step", f"loss, step {first} → {last}"]
    return markdown_table(header, rows, right=(1, 2, 3, 4))


def ablate(out):
    """`gc.py ablate`'s rows, as its console table has them (the step's peak of all live bytes beside M_peak)."""
    gc_py("ablate", "--out", out)
    result = read(os.path.join(out, "ablation.json"))
    rows = []
    for r in result["rows"]:
        if "failed" in r:
            rows.append([r["row"], r["setup"], f"failed: {r['failed']}"] + [""] * 11)
            continue
        base = r["row"] == "baseline"
        diff = r.get("loss_diff")
        rows.append([r["row"], r["setup"], mb(r["activation_bytes"]), mb(r["peak_activation_bytes"]),
                     "" if base or r.get("peak_change") is None else f"{r['peak_change'] * 100:+.1f}%",
                     mb(r.get("peak_bytes")),
                     "" if base or r.get("peak_bytes_change") is None else f"{r['peak_bytes_change'] * 100:+.1f}%",
                     mb((r.get("param_bytes") or 0) + (r.get("grad_bytes") or 0)), mb(r.get("optimizer_bytes")),
                     mb(r.get("rss_peak_bytes")), f"{r['step_time_seconds']:.3f} s",
                     "" if base or r.get("time_change") is None else f"{r['time_change'] * 100:+.1f}%",
                     "" if r["loss"] is None else f"{r['loss']:.4f}",
                     "" if base or diff is None else "0" if diff == 0 else f"{diff:+.1e}"])
    header = ["row", "setup", "M_act", "M_peak", "vs baseline", "step peak", "vs baseline", "P+G", "state", "RSS_peak",
              "T_step", "vs baseline", "final loss", "− baseline's"]
    return markdown_table(header, rows, right=tuple(range(2, 14)))


def heads(out):
    """gc off and all with the full and the fused head at the benchmark model; then the head + loss alone."""
    runs = {}
    for policy in ("off", "all"):
        for head in ("full", "fused"):
            path = os.path.join(out, f"{policy}-{head}.json")
            gc_py("run", *BENCHMARK_MODEL, "--max-batches", "4", "--warmup", "2", "--head", head, "--json", path,
                  *(["--policy", "off"] if policy == "off" else ["--use-gc", "1", "--policy", "all"]))
            runs[policy, head] = read(path)
    rows = []
    for (policy, head), r in runs.items():
        full = runs[policy, "full"]
        versus = "" if head == "full" else \
            (f"M_peak {change(r['peak_activation_bytes'], full['peak_activation_bytes'])}, "
             f"T_step {change(r['step_time_seconds'], full['step_time_seconds'])}")
        rows.append([f"gc {policy}, {head} head", mb(r["activation_bytes"]), mb(r["peak_activation_bytes"]),
                     f"{r['step_time_seconds']:.3f} s", versus])
    r = runs["off", "full"]
    tokens, vocab = r["batch_size"] * r["seq_len"], r["vocab_size"]
    parts = {head: head_part(head, tokens, r["hidden_size"], vocab) for head in ("full", "fused")}
    for head, (peak, _, seconds) in parts.items():
        rows.append([f"the head + loss alone, {head} ({tokens} tokens × {vocab} words)", "", mb(peak),
                     f"{seconds:.3f} s", "" if head == "full" else
                     f"peak {change(peak, parts['full'][0])}, time {change(seconds, parts['full'][2])}"])
    return markdown_table(["benchmark model", "M_act", "M_peak", "T_step", "vs the full head"], rows,
                          right=(1, 2, 3))


def parallel(out):
    """Per-rank memory of data parallelism and ZeRO-1/2 on 2 ranks, against one process, the demo model, gc off."""
    flags = ["run", "--policy", "off", "--max-batches", "6"]
    one = os.path.join(out, "one.json")
    gc_py(*flags, "--json", one)
    r = read(one)
    rows = [["one process", "", mb(r["param_bytes"]), mb(r["grad_bytes"]), mb(r["optimizer_bytes"]),
             mb(r["activation_bytes"]), mb(r["peak_activation_bytes"])]]
    for kind in ("dp", "zero1", "zero2"):
        path = os.path.join(out, f"{kind}.json")
        gc_py(*flags, "--parallel", kind, "--json", path, launcher=("mpiexec", "-n", "2"))
        rows += [[f"`--parallel {kind}`", m["rank"], mb(m["param_bytes"]), mb(m["grad_bytes"]),
                  mb(m["optimizer_bytes"]), mb(m["activation_bytes"]), mb(m["peak_activation_bytes"])]
                 for m in read(path)["per_rank"]]
    return markdown_table(["run", "rank", "parameters", "gradients", "Adam state", "M_act", "M_peak"], rows,
                          right=(1, 2, 3, 4, 5, 6))


def writeup(out):
    """The write-up's two measures, gc off, gc on and whole-step, per device: the mean over its runs ± their standard
    deviation."""
    gc_py("run", "--preset", "writeup", "--out", out)
    result = read(os.path.join(out, "writeup.json"))
    rows = []
    for table in result["tables"]:
        passes = list(table["passes"].items())
        for name, p in passes:
            peak, time = p["peak_bytes"], p["time_per_batch_seconds"]
            rows.append([name, table["device"], f"{peak['mean'] / 2**20:.1f} ± {peak['std'] / 2**20:.1f}",
                         f"{time['mean']:.3f} ± {time['std']:.3f}"])
        (_, off), *others = passes
        for name, p in others:
            rows.append([f"{name.split(' (')[0]} against off", table["device"],
                         change(p["peak_bytes"]["mean"], off["peak_bytes"]["mean"]),
                         change(p["time_per_batch_seconds"]["mean"], off["time_per_batch_seconds"]["mean"])])
    runs = len(result["tables"][0]["passes"]["gc off"]["runs"])
    return markdown_table([f"`gc.py run --preset writeup`, {runs} runs", "device", "peak memory (MB)",
                           "time per batch (s)"], rows, right=(2, 3))


TABLES = {"demo": demo, "ablate": ablate, "heads": heads, "parallel": parallel, "writeup": writeup}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("table", choices=list(TABLES))
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="gc_tables_") as out, progress_to_stderr(True):
        table = TABLES[args.table](out)
    print(table)


if __name__ == "__main__":
    main()
