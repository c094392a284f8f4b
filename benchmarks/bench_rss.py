"""Resident memory and page faults per training step: what the CPU allocator gives back, and what it keeps.

    python benchmarks/bench_rss.py                  # the benchmark model (bench_step's), gc off and "all"
    python benchmarks/bench_rss.py --batch_size 8   # smaller
    python benchmarks/bench_rss.py --markdown       # a Markdown row per policy on stdout (figures.py)

Each policy runs in a fresh process (so its resident memory starts from the same interpreter). Per step it prints
the minor page faults, the resident memory above the process's before the model was built (RSS), the step's
allocator peak (peak_bytes, reset at every step) and the bound the allocator promises, 1.15 x peak + 32 MiB
(src/README.md, memory_stats): a repeated step is served by the allocator's cache of freed blocks (few faults),
and the cache never holds more than that bound. Then `del` of two 256 MiB arrays: the bytes go back to the OS at
once. The last line per policy is the summary docs/memory.md quotes.
"""
import argparse
import gc
import os
import resource
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path[:0] = [os.path.join(ROOT, "python"), os.path.join(ROOT, "apps"), os.path.dirname(os.path.abspath(__file__))]

from bench_step import add_model_arguments, needle_step_fn  # noqa: E402
from md_table import markdown_table, progress_to_stderr  # noqa: E402
from needle import backend_ndarray as nd  # noqa: E402

MiB = 1 << 20


def rss_bytes():
    gc.collect()
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def one_policy(args):
    """Train `args.steps` steps with gc `args.gc` in this process; print a line per step and a summary."""
    device = nd.cpu()
    start = rss_bytes()
    step = needle_step_fn(args, args.gc == "all")
    faults_seen, worst_ratio = [], 0.0
    for i in range(args.steps):
        nd.reset_peak_memory_stats(device)
        before = faults()
        step()
        taken = faults() - before
        stats = nd.memory_stats(device)
        peak, reserved = stats["peak_bytes"], stats["reserved_bytes"]
        rss = rss_bytes() - start
        bound = 1.15 * peak + 32 * MiB
        print(f"  step {i}: {taken:5d} page faults, RSS {rss / MiB:7.1f} MB (allocator: live + cached "
              f"{reserved / MiB:7.1f} MB), peak {peak / MiB:7.1f} MB, bound {bound / MiB:7.1f} MB")
        if i >= 2:  # the first steps fault their buffers in; a size recurs from its second request on
            faults_seen, worst_ratio = faults_seen + [taken], max(worst_ratio, rss / bound)
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
    p.add_argument("--gc", choices=["off", "all"], default=None, help="one policy in this process (default: both, "
                   "each in its own process)")
    p.add_argument("--markdown", action="store_true", help="print the table in Markdown on stdout, the rest on stderr")
    args = p.parse_args()
    if args.gc is not None:  # a child: its row, as a Markdown line on stdout with --markdown
        with progress_to_stderr(args.markdown):
            row = one_policy(args)
        if args.markdown:
            print(markdown_table(HEADER, [row]).splitlines()[-1])
        return
    rows = []
    with progress_to_stderr(args.markdown):
        print(f"bench_rss: batch {args.batch_size}, seq {args.seq_len}, embedding {args.embedding_size}, "
              f"{args.num_layers} layers, vocabulary {args.vocab}, OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}")
        for policy in ("off", "all"):
            child = subprocess.run([sys.executable, os.path.abspath(__file__), *sys.argv[1:], "--gc", policy],
                                   check=True, stdout=subprocess.PIPE if args.markdown else None, text=True)
            rows.append(child.stdout)
    if args.markdown:
        print("\n".join(markdown_table(HEADER, []).splitlines() + [r.strip() for r in rows]))


if __name__ == "__main__":
    main()
