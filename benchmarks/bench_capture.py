"""ndl.jit.capture against the uncaptured step and PyTorch (issue 49), each figure the issue's goals name.

    OMP_NUM_THREADS=1 python benchmarks/bench_capture.py             # the small model and the benchmark model
    OMP_NUM_THREADS=1 python benchmarks/bench_capture.py --markdown  # a Markdown table on stdout (figures.py)
    OMP_NUM_THREADS=1 python benchmarks/bench_capture.py --small-only

The small model is the issue's: LanguageModel(30, 10000, 64, num_layers=8, seq_len=16) with its default 8 heads of
32, the course's full head, Adam, batch 16 x 16; the benchmark model is bench_step's (4 layers of width 256, batch
128 x 32). PyTorch runs the same architecture (bench_step's torch_step_fn). Step times are medians of `--repeats`
steps, the frameworks interleaved over `--rounds` rounds, each keeping its best median. "Python" is the share of a
replayed step spent outside the backend's kernels, profiled (cProfile: each backend call's own time against the
whole replay's); the capture's cost is its first call and the call that plans the arena (the second, or with Adam
the third: the first update differs from the later ones) against an uncaptured step.
"""
import argparse
import cProfile
import os
import pstats
import sys
import time
from types import SimpleNamespace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
threads = os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path[:0] = [os.path.join(ROOT, "python"), os.path.join(ROOT, "apps"), os.path.dirname(os.path.abspath(__file__))]

import needle as ndl  # noqa: E402
from needle import backend_ndarray as nd  # noqa: E402

from bench_step import build_lm, median_step, torch_step_fn  # noqa: E402
from md_table import markdown_table, progress_to_stderr  # noqa: E402

SMALL = SimpleNamespace(embedding_size=30, hidden_size=64, num_layers=8, seq_len=16, batch_size=16, num_head=8,
                        dim_head=32, vocab=10000)
BENCHMARK = SimpleNamespace(embedding_size=256, hidden_size=256, num_layers=4, seq_len=32, batch_size=128,
                            num_head=4, dim_head=None, vocab=10000)


def training(args, gc=False):
    """(the step fn(X, y), X, y, model): bench_step's model, Adam, the full head, lazy mode."""
    model, opt, loss_fn, X, y = build_lm(args, gc)

    def step(X, y):
        opt.reset_grad()
        with ndl.autograd.lazy_mode(True):
            out, _ = model(X)
            loss = loss_fn(out, y)
        loss.backward()
        opt.step()
        return loss
    return step, X, y


def step_times(args, repeats, rounds, torch_too):
    """{'uncaptured', 'captured'[, 'pytorch']: best median seconds}, interleaved over the rounds."""
    best = {}
    plain, X, y = training(args)
    captured_step, cX, cy = training(args)
    captured = ndl.jit.capture(captured_step)
    for _ in range(3):  # warm-up: the optimizer's state written; the captured one recorded and planned
        plain(X, y)
        captured(cX, cy)
    torch_step = torch_step_fn(args) if torch_too else None
    if torch_step:
        torch_step()
    for _ in range(rounds):
        for name, call in (("uncaptured", lambda: plain(X, y)), ("captured", lambda: captured(cX, cy)),
                           ("pytorch", torch_step)):
            if call:
                t = median_step(call, repeats)
                best[name] = min(t, best.get(name, t))
    return best


def python_share(args, replays=20):
    """The share of a replayed step outside the backend's kernels, profiled."""
    step, X, y = training(args)
    captured = ndl.jit.capture(step)
    for _ in range(3):
        captured(X, y)
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(replays):
        captured(X, y)
    profile.disable()
    total = kernels = 0.0
    for (path, _, name), (_, _, own, _, _) in pstats.Stats(profile).stats.items():
        total += own
        if path == "~" and "ndarray_backend" in name:
            kernels += own
    return 1 - kernels / total


def capture_costs(args):
    """(the first call, the planning call) as multiples of an uncaptured step (the median of 5 before them); the
    arena against the ledger's prediction of the step's own bytes; allocations over 20 replays; resident growth
    over 200 replays."""
    step, X, y = training(args)
    step(X, y)  # (the state written, as a step of a run that is captured later finds it)
    uncaptured_seconds = median_step(lambda: step(X, y), 5)
    prediction = ndl.memory.predict(step, X, y)
    own = sum(prediction.by_category.get(c, 0) for c in ("activations", "temporaries", "gradients"))
    captured = ndl.jit.capture(step)
    calls = []
    while not captured.programs:
        t = time.perf_counter()
        captured(X, y)
        calls.append(time.perf_counter() - t)
    captured(X, y)  # the first replay: it moves the outputs the planning call left into the arena (frees only)
    before = nd.memory_stats(ndl.cpu())["allocations"]
    for _ in range(20):
        captured(X, y)
    allocations = nd.memory_stats(ndl.cpu())["allocations"] - before
    rss = resident_in_use()
    for _ in range(200):
        captured(X, y)
    return {"first": calls[0] / uncaptured_seconds, "planning": calls[-1] / uncaptured_seconds,
            "calls": len(calls), "arena": captured.memory_plan.arena_bytes, "own": own, "allocations": allocations,
            "rss_growth": resident_in_use() - rss}


def resident_in_use():
    """The process's resident bytes less the allocator's cache of freed blocks (resident, but free: gc.py's RSS
    figures count it unused too), so that the cache of the uncaptured calls going back is not read as a fall."""
    with open("/proc/self/statm") as f:
        resident = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return resident - nd.memory_stats(ndl.cpu())["cached_bytes"]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--small-only", action="store_true", help="the small model alone")
    p.add_argument("--no-torch", action="store_true")
    p.add_argument("--markdown", action="store_true")
    args = p.parse_args()
    rows = []
    with progress_to_stderr(args.markdown):
        print(f"bench_capture: {threads} thread(s); medians of {args.repeats} steps, best of {args.rounds} rounds")
        costs = capture_costs(SMALL)  # first, in a process that has run nothing else
        small = step_times(SMALL, args.repeats, args.rounds, not args.no_torch)
        print("small model:", {k: f"{v * 1e3:.1f} ms" for k, v in small.items()})
        share = python_share(SMALL)
        print(f"python share of a replay {share:.1%}; capture costs {costs}")
        torch_ms = small.get("pytorch")
        rows += [["small model: uncaptured step", f"{small['uncaptured'] * 1e3:.1f} ms",
                  f"{small['uncaptured'] / torch_ms:.2f}× PyTorch's" if torch_ms else ""],
                 ["small model: captured step (a replay)", f"{small['captured'] * 1e3:.1f} ms",
                  f"{small['captured'] / torch_ms:.2f}× PyTorch's" if torch_ms else ""],
                 ["small model: PyTorch eager step", f"{torch_ms * 1e3:.1f} ms" if torch_ms else "(not installed)",
                  ""],
                 ["Python's share of a replay (profiled)", f"{share:.1%}", "goal ≤ 10%"],
                 ["capture: the first call / the planning call", f"{costs['first']:.2f}× / {costs['planning']:.2f}×",
                  f"of an uncaptured step ({costs['calls']} calls recorded)"],
                 ["allocations over 20 replays (after the first)", str(costs["allocations"]), "goal 0"],
                 ["resident growth over 200 replays (less the allocator's cache)",
                  f"{costs['rss_growth'] / 2**20:.2f} MB", "goal ≤ 1 MB"],
                 ["arena / the ledger's predicted bytes of the step", f"{costs['arena'] / costs['own']:.3f}",
                  f"{costs['arena']:,} B / {costs['own']:,} B"]]
        if not args.small_only:
            big = step_times(BENCHMARK, max(3, args.repeats // 3), args.rounds, False)
            print("benchmark model:", {k: f"{v * 1e3:.1f} ms" for k, v in big.items()})
            rows.append(["benchmark model: captured / uncaptured step",
                         f"{big['captured'] / big['uncaptured']:.2f}",
                         f"{big['captured'] * 1e3:.0f} ms / {big['uncaptured'] * 1e3:.0f} ms"])
    print(markdown_table(["", "measured", "beside"], rows))


if __name__ == "__main__":
    main()
