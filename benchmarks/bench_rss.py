"""Resident memory and page faults per training step: what the CPU allocator gives back, and what it keeps.

    python benchmarks/bench_rss.py                  # the benchmark model (bench_step's), gc off and "all"
    python benchmarks/bench_rss.py --batch_size 8   # smaller
    python benchmarks/bench_rss.py --markdown       # a Markdown row per policy on stdout (figures.py)
    python benchmarks/bench_rss.py --goal           # issue 47's LM: 4 layers, width 64, batch 32 x 32, fused head

Each policy runs in a fresh process (so its resident memory starts from the same interpreter). Per step it prints
the minor page faults, the resident memory above the process's before the model was built (RSS), the step's
allocator peak (peak_bytes, reset at every step) and the bound the allocator promises, 1.15 x peak + 32 MiB
(src/README.md, memory_stats): a repeated step is served by the allocator's cache of freed blocks (few faults),
and the cache never holds more than that bound. Then `del` of two 256 MiB arrays: the bytes go back to the OS at
once. The last line per policy is the summary docs/memory.md quotes.

Over the whole run it also prints the run's peak RSS growth (the process's high-water mark over the steps, less
its resident memory before the first) beside the allocator's M_peak (the most its forward + backward held above
the step's start, as gc.py's M_peak) and the allocator's own growth (its most live bytes over the run, less those
before the first step: what the RSS growth would be with no cache, heap or interpreter around it), and after both
policies, how much gc "all" lowers each, in points (issue 47: the RSS growth should fall by at least M_peak's fall
less 5 points). --goal sets issue 47's model: gc.py's Transformer LM at width 64 (embedding = hidden = 64, 4
layers, PTB's vocabulary of 7,596 words), batch 32 x seq_len 32, the fused LM head, 10 steps.
"""
import argparse
import gc
import json
import os
import resource
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path[:0] = [os.path.join(ROOT, "python"), os.path.join(ROOT, "apps"), os.path.dirname(os.path.abspath(__file__))]


import needle as ndl  # noqa: E402
from bench_step import add_model_arguments, build_lm  # noqa: E402
from md_table import markdown_table, progress_to_stderr  # noqa: E402
from needle import backend_ndarray as nd  # noqa: E402

MiB = 1 << 20


def rss_bytes():
    gc.collect()
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def proc_status(key):
    """A field of /proc/self/status in bytes (VmRSS, VmHWM)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def reset_high_water():
    """VmHWM := VmRSS (Linux: writing 5 to /proc/self/clear_refs)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def lm_step_fns(args, gc_all):
    """bench_step's model (or, with --head fused, gc.py's fused LM head) as two closures: forward + backward,
    then Adam's step, so that M_peak is read between them as gc.py reads it."""
    model, opt, loss_fn, X, y = build_lm(args, gc_all)

    def forward_backward():
        opt.reset_grad()
        with ndl.autograd.lazy_mode(True):
            loss = model.loss(X, y)[0] if args.head == "fused" else loss_fn(model(X)[0], y)
            loss.backward()

    return forward_backward, opt.step


def one_policy(args):
    """Train `args.steps` steps with gc `args.gc` in this process; print a line per step and a summary."""
    device = nd.cpu()
    start = rss_bytes()
    forward_backward, optimizer_step = lm_step_fns(args, args.gc == "all")
    faults_seen, worst_ratio = [], 0.0
    run_start, live_start, run_live, m_peak = rss_bytes(), nd.memory_stats(device)["current_bytes"], 0, 0
    reset_high_water()
    for i in range(args.steps):
        nd.reset_peak_memory_stats(device)
        baseline = nd.memory_stats(device)["current_bytes"]
        before = faults()
        forward_backward()
        m_peak = max(m_peak, nd.memory_stats(device)["peak_bytes"] - baseline)
        optimizer_step()
        taken = faults() - before
        stats = nd.memory_stats(device)
        peak, reserved = stats["peak_bytes"], stats["reserved_bytes"]
        run_live = max(run_live, peak - live_start)
        rss = rss_bytes() - start
        bound = 1.15 * peak + 32 * MiB
        print(f"  step {i}: {taken:5d} page faults, RSS {rss / MiB:7.1f} MB (allocator: live + cached "
              f"{reserved / MiB:7.1f} MB), peak {peak / MiB:7.1f} MB, bound {bound / MiB:7.1f} MB")
        if i >= 2:  # the first steps fault their buffers in; a size recurs from its second request on
            faults_seen, worst_ratio = faults_seen + [taken], max(worst_ratio, rss / bound)
    run = {"rss_growth": proc_status("VmHWM") - run_start, "m_peak": m_peak, "allocator_growth": run_live}
    print(f"gc {args.gc}: the run's peak RSS growth {run['rss_growth'] / MiB:.1f} MB (the allocator's own growth "
          f"{run_live / MiB:.1f} MB), M_peak {m_peak / MiB:.1f} MB")
    print("RUN " + json.dumps(run), file=sys.stderr)
    held = rss_bytes()
    a, b = nd.full((64 * MiB,), 1.0, device=device), nd.full((64 * MiB,), 1.0, device=device)
    grown = rss_bytes() - held
    del a, b
    given_back = held + grown - rss_bytes()
    print(f"gc {args.gc}: steps 3-{args.steps}: at most {max(faults_seen)} page faults a step, RSS at most "
          f"{worst_ratio:.2f} x the bound; del of 2 x 256 MiB arrays gave back {given_back / MiB:.0f} of "
          f"{grown / MiB:.0f} MB at once")
    return [args.gc, f"{min(faults_seen):,}–{max(faults_seen):,}", f"{rss / MiB:.1f} MB", f"{reserved / MiB:.1f} MB",
            f"{peak / MiB:.1f} MB", f"{bound / MiB:.1f} MB", f"{worst_ratio:.2f}",
            f"{given_back / MiB:.0f} of {grown / MiB:.0f} MB"]


HEADER = ["gc", "page faults per step (steps 3 on)", "RSS after the last step", "allocator: live + cached",
          "step peak", "bound 1.15 × peak + 32 MiB", "RSS / bound, at most", "`del` of 2 × 256 MiB: back at once"]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_arguments(p)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--head", choices=["full", "fused"], default="full", help="the LM head: bench_step's full one "
                   "(SoftmaxLoss of the whole logits), or gc.py's fused one (model.loss)")
    p.add_argument("--goal", action="store_true", help="issue 47's model: --batch_size 32 --embedding_size 64 "
                   "--hidden_size 64 --vocab 7596 --head fused --steps 10 (flags given after it win)")
    p.add_argument("--gc", choices=["off", "all"], default=None, help="one policy in this process (default: both, "
                   "each in its own process)")
    p.add_argument("--markdown", action="store_true", help="print the table in Markdown on stdout, the rest on stderr")
    argv = sys.argv[1:]
    if "--goal" in argv:
        argv = ["--batch_size", "32", "--embedding_size", "64", "--hidden_size", "64", "--vocab", "7596", "--head",
                "fused", "--steps", "10"] + argv
    args = p.parse_args(argv)
    if args.steps < 3:
        p.error(f"--steps must be at least 3 (the figures read steps 3 on, once settled), got {args.steps}")
    if args.gc is not None:  # a child: its row, as a Markdown line on stdout with --markdown
        with progress_to_stderr(args.markdown):
            row = one_policy(args)
        if args.markdown:
            print(markdown_table(HEADER, [row]).splitlines()[-1])
        return
    rows, runs = [], {}
    with progress_to_stderr(args.markdown):
        print(f"bench_rss: batch {args.batch_size}, seq {args.seq_len}, embedding {args.embedding_size}, "
              f"{args.num_layers} layers, vocabulary {args.vocab}, OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}")
        for policy in ("off", "all"):
            child = subprocess.run([sys.executable, os.path.abspath(__file__), *argv, "--gc", policy],
                                   check=True, stdout=subprocess.PIPE if args.markdown else None,
                                   stderr=subprocess.PIPE, text=True)
            sys.stderr.write("".join(line + "\n" for line in child.stderr.splitlines() if not line.startswith("RUN ")))
            runs[policy] = json.loads(child.stderr.split("RUN ")[-1].splitlines()[0])
            rows.append(child.stdout)
        fall = {k: 100 * (1 - runs["all"][k] / runs["off"][k]) for k in runs["off"]}
        print(f"gc all against off: M_peak {fall['m_peak']:.1f}% lower; the run's peak RSS growth "
              f"{fall['rss_growth']:.1f}% lower ({fall['rss_growth'] - fall['m_peak']:+.1f} points against M_peak); "
              f"the allocator's own growth {fall['allocator_growth']:.1f}% lower")
    if args.markdown:
        print("\n".join(markdown_table(HEADER, []).splitlines() + [r.strip() for r in rows]))


if __name__ == "__main__":
    main()
