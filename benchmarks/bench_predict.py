"""ndl.memory.predict against the allocator (issue 48): every row of gc.py ablate that runs in one process, on the
demo model, each predicted by a dry run and measured by a real step, and what a dry run costs beside a step.

    python benchmarks/bench_predict.py                   # the demo model (gc.py's defaults), lazy and eager
    python benchmarks/bench_predict.py --markdown        # a Markdown table on stdout (figures.py)
    python benchmarks/bench_predict.py --num-layers 6 --embedding-size 128 --hidden-size 192   # another model
    python benchmarks/bench_predict.py --max-batch 256   # gc.py max-batch --dry-run against the real search

A row is the configuration gc.py ablate trains it with (its Budget rows at ablate's b); predicted is
`ndl.memory.predict`'s peak_bytes, measured the allocator's peak_bytes over a later real step of the same plain
training step (gc.py explain's: reset_grad, forward and loss, backward, the optimizer's step). The dry run's time is
the fastest of three, the step's too. Accumulation rows are the micro-batch's step predicted and gc.py's gradient
sums around it (gc.py explain's "~"); their dry run is timed against the whole step (all its micro-batches).
"""
import argparse
import os
import re
import subprocess
import sys
import time
from dataclasses import replace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(ROOT, "python"), os.path.join(ROOT, "apps"), os.path.dirname(os.path.abspath(__file__))]

import needle as ndl  # noqa: E402
from experiment.ablations import ABLATIONS  # noqa: E402
from experiment.commands import explain as gc_explain  # noqa: E402
from experiment.commands.ablate import ablation_budget  # noqa: E402
from experiment.data import load_data, resolve_data  # noqa: E402
from experiment.records import read_json  # noqa: E402
from experiment.setup import pick_device  # noqa: E402
from md_table import markdown_table, progress_to_stderr  # noqa: E402

HEADER = ["row", "mode", "predicted peak", "measured peak", "predicted − measured", "predicted M_act",
          "measured M_act", "dry run / step time"]


def timed(fn, repeats=3):
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def one_row(name, model_flags, lazy, data, vocab, device):
    config, k = gc_explain.ablation_row_config(name, model_flags, lazy)
    if config.policy == "budget":
        _, _, least, off = ablation_budget(config, data, vocab, device)
        config = replace(config, budget_mb=(least + (off - least) * (0.75 if config.offload else 0.5)) / 2**20)
    row = gc_explain.lever_row(name, {"accumulation_steps": k} if k > 1 else {}, config, (0, 0), data, vocab,
                               device, verify=True)
    # the dry run (of one micro-batch's step, with accumulation) against the step it predicts (all k micro-batches)
    one = replace(config, batch_size=config.batch_size // k)
    step, micro, _ = gc_explain.build(replace(one, accumulation_steps=1), data, vocab, device)
    whole, micro_k, _ = gc_explain.build(replace(one, accumulation_steps=k), data, vocab, device)
    step(micro)
    whole(micro_k)
    ratio = timed(lambda: ndl.memory.predict(step, micro, device=device)) / timed(lambda: whole(micro_k))
    p, m = row["predicted_peak_bytes"], row["measured_peak_bytes"]
    mark = "~" if k > 1 else ""
    return [name, "lazy" if lazy else "eager", f"{mark}{p:,} B", f"{m:,} B",
            f"{p - m:+,} B ({100 * (p / m - 1):+.3f}%)", f"{row['predicted_activation_bytes'] / 2**20:.2f} MB",
            f"{row['measured_activation_bytes'] / 2**20:.2f} MB", f"{ratio:.3f}"]


def max_batch(cap_mb, model_flags):
    """gc.py max-batch, real and --dry-run, on the same model and cap: their answers and seconds."""
    out = {}
    for dry in (False, True):
        folder = os.path.join(ROOT, "results", f"bench_predict_max_batch_{'dry' if dry else 'real'}")
        cmd = [sys.executable, os.path.join(ROOT, "gc.py"), "max-batch", "--memory-limit-mb", str(cap_mb),
               "--policies", "off", "all", "--out", folder, "--no-progress", *model_flags] + (["--dry-run"] * dry)
        t0 = time.perf_counter()
        log = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        out[dry] = (time.perf_counter() - t0, re.findall(r"^\s*(\w+): largest batch under .* = (\d+)$", log, re.M))
    tries = read_json(os.path.join(folder, "max_batch.json"))["tries"]  # the dry run's (the loop's last)
    steps = sum(t["seconds"] for t in tries if t.get("confirmed"))
    for dry, (seconds, lines) in out.items():
        print(f"{'--dry-run' if dry else 'real search'}: {seconds:.1f} s; largest batch " +
              ", ".join(f"{policy} {batch}" for policy, batch in lines))
    same = out[True][1] == out[False][1]
    print(f"dry run / real: {out[True][0] / out[False][0]:.3f} of the time; the same answers: {same}")
    print(f"of which the real steps that confirm its answers: {steps:.1f} s, {steps / out[False][0]:.3f} of the "
          f"real search (the least a dry run that trains each answer once can take)")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--markdown", action="store_true")
    p.add_argument("--rows", nargs="+", default=None, help="ablation rows (default: every one of one process)")
    p.add_argument("--max-batch", type=float, default=None, metavar="MB", help="compare gc.py max-batch's searches")
    args, model_flags = p.parse_known_args()
    model_flags = model_flags or []
    if args.max_batch is not None:
        return max_batch(args.max_batch, model_flags)
    data, vocab = load_data(resolve_data(None))
    device = pick_device(None)
    rows = args.rows or [n for n, (_, flags) in ABLATIONS.items() if not flags.get("parallel")]
    table = []
    with progress_to_stderr(args.markdown):
        for lazy in (True, False):
            for name in rows:
                table.append(one_row(name, model_flags, lazy, data, vocab, device))
                print(" | ".join(table[-1]), file=sys.stderr, flush=True)
    print(markdown_table(HEADER, table))


if __name__ == "__main__":
    main()
