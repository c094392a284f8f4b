"""What recording a step's memory costs: ndl.memory.record() on, against the same step with recording off.

    python benchmarks/bench_memory_record.py              # gc.py's demo model (batch 32, 4 layers, E = H = 256)
    python benchmarks/bench_memory_record.py --markdown   # the table alone (benchmarks/figures.py)

One model and optimizer train step after step; recorded and unrecorded steps alternate (ABAB...), so the machine's
noise falls on both alike, and each keeps its median. Recording is Python work per buffer made or given back (a
block, a weak reference, an event), so its cost is per event: the table gives events per step and microseconds
per event beside the ratio. Issue #28's goal: at most +10% per step when on. Off costs one attribute read per
allocation and per computed value; that is measured across revisions (farm-bench, see docs/memory.md).
"""
import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(ROOT, "python"), os.path.join(ROOT, "apps"), os.path.dirname(os.path.abspath(__file__))]

import needle as ndl  # noqa: E402
from bench_step import add_model_arguments, needle_step_fn  # noqa: E402


def measure(args):
    """{policy: (median seconds off, median seconds on, events per recorded step)}."""
    results = {}
    for policy in args.policies:
        step = needle_step_fn(args, gc=policy == "all")
        step()  # warm-up: the optimizer's state, the allocator's cache
        times = {False: [], True: []}
        events = 0
        for _ in range(args.repeats):
            for recorded in (False, True):
                start = time.perf_counter()
                if recorded:
                    with ndl.memory.record() as snap:
                        step()
                else:
                    step()
                times[recorded].append(time.perf_counter() - start)
                if recorded:
                    events = len(snap.events)
        results[policy] = (statistics.median(times[False]), statistics.median(times[True]), events)
    return results


def table(results):
    lines = ["| gc | step, not recorded | step, recorded | recorded / not | events per step | µs per event |",
             "| --- | --- | --- | --- | --- | --- |"]
    for policy, (off, on, events) in results.items():
        lines.append(f"| {policy} | {off:.3f} s | {on:.3f} s | {on / off:.3f} | {events:,} | "
                     f"{(on - off) / max(events, 1) * 1e6:.1f} |")
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_arguments(p)
    p.set_defaults(batch_size=32, vocab=7596)  # gc.py's demo model (the reduced PTB's vocabulary)
    p.add_argument("--repeats", type=int, default=11, help="recorded and unrecorded steps each, alternating")
    p.add_argument("--policies", nargs="+", default=["off", "all"], choices=["off", "all"])
    p.add_argument("--markdown", action="store_true", help="print the table alone")
    args = p.parse_args()
    if not ndl.cpu().enabled():
        raise SystemExit("bench_memory_record: the C++ backend is not built; run `make` first")
    if not args.markdown:
        print(f"bench_memory_record: batch {args.batch_size} x seq_len {args.seq_len}, embedding "
              f"{args.embedding_size}, hidden {args.hidden_size}, {args.num_layers} layers, vocab {args.vocab}, "
              f"{ndl.cpu().num_threads()} thread(s); median of {args.repeats} steps each, alternating")
    print(table(measure(args)))


if __name__ == "__main__":
    main()
