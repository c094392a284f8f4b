"""Keep, drop or offload on the issue's small 16-layer model: what offloading reaches, against recomputation alone.

    python benchmarks/bench_offload.py              # embedding 64, 4 heads of 16, vocabulary 500, batch 16, seq 32
    python benchmarks/bench_offload.py --markdown   # the table alone (benchmarks/figures.py)

For recompute-only (Budget(b)) and keep/drop/offload (Budget(b, offload=True)), lazy mode: the least feasible
peak (offloading's, where nothing else fits, with the parameters' gradients parked too); then, at budgets 10% above
each least peak and at gc off's peak x 0.5, the measured M_peak of 4 steps of 3 fresh models (each <= b, and the
prediction beside the allocator), the host bytes, whether gradients were parked, the time of the first step
(planning included) over the median of the later ones (the median over the 3 models), and the median step time.
Both planners read this machine's cost model (cost_model.py, calibrated once and cached).
"""
import argparse
import gc
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(ROOT, "python"), os.path.join(ROOT, "apps")]

import numpy as np  # noqa: E402

import needle as ndl  # noqa: E402
from needle import checkpoint, nn  # noqa: E402
from needle.backend_ndarray import memory_stats, reset_peak_memory_stats  # noqa: E402
from models import LanguageModel  # noqa: E402

MB = 2**20


def make_model(args):
    np.random.seed(0)
    return LanguageModel(args.embedding, args.vocab, args.embedding, num_layers=args.layers, seq_model="transformer",
                         seq_len=args.seq_len, device=ndl.cpu(), num_head=args.heads,
                         dim_head=args.embedding // args.heads)


def make_step(model, args):
    rs = np.random.RandomState(0)
    X = ndl.Tensor(rs.randint(0, args.vocab, (args.seq_len, args.batch)), device=ndl.cpu(), requires_grad=False)
    y = ndl.Tensor(rs.randint(0, args.vocab, (args.seq_len * args.batch,)), device=ndl.cpu(), requires_grad=False)
    opt = ndl.optim.Adam(model.parameters(), lr=1e-3)

    def step():
        """(seconds, M_peak): the allocator's peak over forward + backward minus what the step started with."""
        opt.reset_grad()
        gc.collect()
        base = memory_stats(ndl.cpu())["current_bytes"]
        reset_peak_memory_stats(ndl.cpu())
        start = time.perf_counter()
        with ndl.autograd.lazy_mode(True):
            loss = nn.SoftmaxLoss()(model(X)[0], y)
        loss.backward()
        peak = memory_stats(ndl.cpu())["peak_bytes"] - base
        opt.step()
        return time.perf_counter() - start, peak
    return step


def least_peak(args, offload):
    probe = checkpoint.Budget(10**12, offload=offload, calibrate=True)
    model = make_model(args)
    model.enable_gc(policy=probe)
    make_step(model, args)()
    return probe.minimum_peak


def run(args, budget_bytes, offload):
    """One budget: the peaks and times of `steps` steps of a fresh model, `repeats` times (a first step is a single
    sample: its ratio to the later steps is the median over the repeats)."""
    firsts, peaks, times = [], [], []
    for _ in range(args.repeats):
        budget = checkpoint.Budget(int(budget_bytes), offload=offload, calibrate=True)
        model = make_model(args)
        model.enable_gc(policy=budget)
        step = make_step(model, args)
        results = [step() for _ in range(args.steps)]
        stats = checkpoint.last_backward_stats()
        later = statistics.median(t for t, _ in results[1:])
        firsts.append(results[0][0] / later)
        peaks += [p for _, p in results]
        times.append(later)
    return {"b": budget.bytes, "peaks": peaks, "predicted": budget.predicted_peak, "host": stats["host_peak_bytes"],
            "first": statistics.median(firsts), "time": statistics.median(times),
            "gradients": "parked" if budget.parks_gradients else "on the device"}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--embedding", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=500)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq_len", type=int, default=32)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3, help="fresh models per budget (each with its first step)")
    p.add_argument("--markdown", action="store_true", help="print the table alone")
    args = p.parse_args()
    _, off_peak = make_step(make_model(args), args)()
    least = {offload: least_peak(args, offload) for offload in (False, True)}
    rows = ["| planner | least feasible M_peak | b | measured M_peak, 4 steps x 3 models (max / b) | "
            "predicted / measured | host peak | gradients | first step / later | step time |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    # 10% above each planner's least peak (recompute-only's is infeasible below its own), then gc off's x 0.5
    both = (False, True)
    for b, planners in ((1.1 * least[True], (True,)), (1.1 * least[False], both), (0.5 * off_peak, both)):
        for offload in planners:
            r = run(args, b, offload)
            rows.append(f"| {'keep/drop/offload' if offload else 'recompute only'} | {least[offload] / MB:.2f} MB | "
                        f"{r['b'] / MB:.2f} MB | {max(r['peaks']) / MB:.2f} MB ({max(r['peaks']) / r['b']:.3f}) | "
                        f"{r['predicted'] / r['peaks'][-1]:.3f} | {r['host'] / MB:.2f} MB | {r['gradients']} | "
                        f"{r['first']:.2f}x | "
                        f"{r['time']:.3f} s |")
    if not args.markdown:
        print(f"bench_offload: {args.layers} layers, embedding {args.embedding}, {args.heads} heads, vocabulary "
              f"{args.vocab}, batch {args.batch} x seq {args.seq_len}, lazy; gc off's M_peak {off_peak / MB:.2f} MB; "
              f"offloading's least peak / recompute-only's: {least[True] / least[False]:.3f}")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
