"""What leaving the device costs: the step-time overhead over gc off of recompute-only and of keep/drop/offload,
at the same budgets, on gc.py's model with 16 layers (issue #29: the combination's at most half of recompute-only's).

    python benchmarks/bench_offload_overhead.py              # 16 layers, embedding = hidden = 256, batch 32 x 32
    python benchmarks/bench_offload_overhead.py --markdown   # the table alone (benchmarks/figures.py)

Budgets: five, from recompute-only's least M_peak to gc off's M_peak x 0.9. At each, three planners: Budget(b)
(recompute only), Budget(b, offload=True) (planned with this machine's measured copy bandwidth) and
Budget(b, offload=True, host_bandwidth=16e9) (planned as if copies ran over PCIe 4; run here, on this machine's
copies). Every configuration is a model of its own, built once; after a first step (planning) the steps run in
rounds, one step of each configuration per round, each round in another order (rotated by one), so that a slow
minute of a shared machine slows all of them alike and no configuration always runs first. A configuration's
overhead is paired: the median over the rounds of its step's time over gc off's step in the same round, minus 1.
A second gc-off model runs in the rounds as a control: its overhead should be 0, and what it shows (its median,
plus half its rounds' interquartile range) is how large an overhead noise alone makes here; a ratio is given only
where recompute-only's overhead is above that. The ratio is the combination's overhead over recompute-only's.
Beside it, the ratio the planners predicted (`predicted_added_time`), which no noise touches, and the copy time the
computing thread still waited for (the median of `copy_seconds_exposed`: on cpu() the copies run on the backend's
copy thread, beside the compute).
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
from needle import checkpoint  # noqa: E402
from needle.backend_ndarray import memory_stats, reset_peak_memory_stats  # noqa: E402
from models import LanguageModel  # noqa: E402

MB = 2**20
DEVICE = ndl.cpu()
PCIE4 = 16e9


class Config:
    """One model under one policy, with its optimizer and batch: `step()` times a training step."""

    def __init__(self, args, name, policy):
        np.random.seed(0)
        self.name, self.policy, self.times, self.peak, self.exposed = name, policy, [], None, []
        self.model = LanguageModel(args.embedding, args.vocab, args.embedding, num_layers=args.layers,
                                   seq_model="transformer", seq_len=args.seq_len, device=DEVICE, num_head=4,
                                   dim_head=args.embedding // 4)
        head = self.model.linear.weight
        head.cached_data = head.realize_cached_data() * 0.1  # gc.py's --head-init-scale
        if policy is not None:
            self.model.enable_gc(policy=policy)
        rs = np.random.RandomState(0)
        self.x = ndl.Tensor(rs.randint(0, args.vocab, (args.seq_len, args.batch)), device=DEVICE, requires_grad=False)
        self.y = ndl.Tensor(rs.randint(0, args.vocab, (args.seq_len * args.batch,)), device=DEVICE,
                            requires_grad=False)
        self.opt = ndl.optim.Adam(self.model.parameters(), lr=1e-3)

    def step(self):
        """One step (gc.py's: lazy forward with the fused head, backward, Adam); its seconds and M_peak."""
        self.opt.reset_grad()
        gc.collect()
        base = memory_stats(DEVICE)["current_bytes"]
        reset_peak_memory_stats(DEVICE)
        start = time.perf_counter()
        with ndl.autograd.lazy_mode(True):
            loss, _ = self.model.loss(self.x, self.y)
        loss.backward()
        peak = memory_stats(DEVICE)["peak_bytes"] - base
        # (the stores' traffic is in the stats only where a store held a value: none for gc off or recompute only)
        self.exposed.append(checkpoint.last_backward_stats().get("copy_seconds_exposed", 0.0))
        self.opt.step()
        return time.perf_counter() - start, peak

    def median(self):
        return statistics.median(self.times)


def least_peak(args):
    probe = checkpoint.Budget(2**62)
    Config(args, "probe", probe).step()
    return probe.minimum_peak


def overhead(config, off):
    """The paired overhead: the median over the rounds of config's step time over gc off's in the same round, - 1."""
    return statistics.median(t / t_off for t, t_off in zip(config.times, off.times)) - 1


def noise_of(control, off):
    """How large an overhead noise alone makes: the control's (a second gc-off model's) paired overhead, in size,
    plus half the interquartile range of its rounds' ratios."""
    q1, _, q3 = statistics.quantiles([t / t_off for t, t_off in zip(control.times, off.times)], n=4)
    return abs(overhead(control, off)) + (q3 - q1) / 2


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--embedding", type=int, default=256)
    p.add_argument("--vocab", type=int, default=10000)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seq_len", type=int, default=32)
    p.add_argument("--budgets", type=int, default=5)
    p.add_argument("--rounds", type=int, default=11)
    p.add_argument("--markdown", action="store_true", help="print the table alone")
    args = p.parse_args()
    if args.rounds < 2 or args.budgets < 1:
        p.error(f"--rounds must be at least 2 (the control's spread is their quartiles) and --budgets at least 1; "
                f"got --rounds {args.rounds}, --budgets {args.budgets}")

    off, control = Config(args, "gc off", None), Config(args, "gc off (control)", None)
    off_peak = off.step()[1]
    control.step()
    least = least_peak(args)
    budgets = [int(b) for b in np.linspace(least, 0.9 * off_peak, args.budgets)]
    rows = [(b, Config(args, "recompute", checkpoint.Budget(b, calibrate=True)),
             Config(args, "offload", checkpoint.Budget(b, offload=True, calibrate=True)),
             Config(args, "offload 16e9", checkpoint.Budget(b, offload=True, host_bandwidth=PCIE4, calibrate=True)))
            for b in budgets]
    configs = [off, control] + [c for row in rows for c in row[1:]]
    for c in configs[2:]:
        c.peak = c.step()[1]  # the first step plans
    for r in range(args.rounds):
        for c in configs[r % len(configs):] + configs[:r % len(configs)]:
            seconds, peak = c.step()
            c.times.append(seconds)
            c.peak = max(c.peak or 0, peak)

    # An overhead under what the control shows is noise, and a ratio of noise is no figure.
    noise = noise_of(control, off)

    def cell(c, recompute):
        measurable = overhead(recompute, off) > noise
        ratio = f"{overhead(c, off) / overhead(recompute, off):.2f}" if measurable else "n/a (noise)"
        predicted = c.policy.predicted_added_time / recompute.policy.predicted_added_time \
            if recompute.policy.predicted_added_time else float("nan")
        return (f"{c.peak / MB:.1f} MB, {100 * overhead(c, off):+.1f}% | {ratio} (predicted {predicted:.2f}) | "
                f"{c.policy.predicted_host_peak / MB:.0f} MB, {1e3 * statistics.median(c.exposed):.0f} ms")

    out = ["| budget | recompute only: M_peak, overhead | recompute + offload (measured bandwidth) | ratio | "
           "host peak, copy time exposed | recompute + offload (planned at 16 GB/s) | ratio | "
           "host peak, copy time exposed |",
           "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for b, recompute, both, both_pcie in rows:
        out.append(f"| {b / MB:.0f} MB | {recompute.peak / MB:.1f} MB, {100 * overhead(recompute, off):+.1f}% | "
                   f"{cell(both, recompute)} | {cell(both_pcie, recompute)} |")
    if not args.markdown:
        print(f"bench_offload_overhead: {args.layers} layers, embedding {args.embedding}, vocabulary {args.vocab}, "
              f"batch {args.batch} x seq {args.seq_len}, lazy, fused head; gc off: M_peak {off_peak / MB:.1f} MB, "
              f"{off.median():.3f} s a step (median of {args.rounds} rounds); a second gc-off model's overhead "
              f"{100 * overhead(control, off):+.1f}%, noise ±{100 * noise:.1f}%")
    else:
        print(f"gc off: M_peak {off_peak / MB:.1f} MB, {off.median():.3f} s a step; a second gc-off model, the "
              f"control: {100 * overhead(control, off):+.1f}% (noise: ±{100 * noise:.1f}%, a smaller overhead is no "
              f"figure); paired medians of {args.rounds} interleaved rounds, each in another order.\n")
    print("\n".join(out))


if __name__ == "__main__":
    main()
