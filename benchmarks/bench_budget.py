"""How good is the Budget's plan? Its predicted peak and time beside the optimum's (checkpoint_budget.optimal), over a
sweep of budgets, with the measured M_peak of a step.

    python benchmarks/bench_budget.py                     # issue #29's small model: 16 layers, E = H = 64, 4 heads
    python benchmarks/bench_budget.py --markdown          # the table alone (the figures script runs this)
    python benchmarks/bench_budget.py --host-bandwidth 16e9 --num_layers 4 --points 5

Ten budgets b from recompute-only's least peak (Budget(1)'s minimum_peak) to gc off's measured peak. At each:
Budget(b) and Budget(b, offload=True) plan a lazy step on their own (enable_gc(policy=...), no plan() call) and
it runs, so their predicted peak and time sit beside the M_peak measured by the allocator; `optimal` solves the
same choice as a MILP on the same graph, recompute-only and with offloading. Times are a step's predicted seconds
by this machine's cost model: its ops forward and backward and the update, plus what the plan adds (recomputation,
exposed copies); the Budget's `predicted_time` less its `trace_seconds` (which the optimum cannot know) beside the
optimum's, and their ratio (issue #29: within 5%). "infeasible": no plan reaches b. Only activations: the optimum
does not park gradients, and the sweep starts where recompute-only can plan, above where the Budget must.
"""
import argparse
import gc
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(ROOT, "python"), os.path.join(ROOT, "apps"), os.path.dirname(os.path.abspath(__file__))]

import numpy as np  # noqa: E402

import needle as ndl  # noqa: E402
from needle import autograd, checkpoint, checkpoint_budget, nn  # noqa: E402
from needle.backend_ndarray import memory_stats, reset_peak_memory_stats  # noqa: E402
from needle.costs import CostModel as CoreCostModel  # noqa: E402
from needle.toolbox.cost_model import Calibration, CostModel  # noqa: E402
from bench_step import add_model_arguments  # noqa: E402
from md_table import markdown_table  # noqa: E402
from models import LanguageModel  # noqa: E402

DEVICE = ndl.cpu()


def make_model(args, policy):
    np.random.seed(0)
    model = LanguageModel(args.embedding_size, args.vocab, args.hidden_size, num_layers=args.num_layers,
                          seq_model="transformer", seq_len=args.seq_len, device=DEVICE, num_head=args.num_head,
                          dim_head=args.embedding_size // args.num_head)
    if policy is not None:
        model.enable_gc(policy=policy)
    return model


def lazy_loss(args, model):
    rs = np.random.RandomState(0)
    X = ndl.Tensor(rs.randint(0, args.vocab, (args.seq_len, args.batch_size)).astype(np.float32), device=DEVICE,
                   requires_grad=False)
    y = ndl.Tensor(rs.randint(0, args.vocab, (args.seq_len * args.batch_size,)).astype(np.float32), device=DEVICE,
                   requires_grad=False)
    with autograd.lazy_mode(True):
        return nn.SoftmaxLoss()(model(X)[0], y)


def measured_peak(args, model):
    """M_peak of one lazy step: the allocator's peak minus the bytes held when it starts."""
    for p in model.parameters():
        p.grad = None
    gc.collect()
    base = memory_stats(DEVICE)["current_bytes"]
    reset_peak_memory_stats(DEVICE)
    lazy_loss(args, model).backward()
    return memory_stats(DEVICE)["peak_bytes"] - base


def budget_row(args, bytes, offload, host_bandwidth):
    """(predicted peak, predicted time or None, measured M_peak) of a step under Budget(bytes, offload), or None.
    Priced by this machine's calibration, or with --teaching by the core's fixed rates (the teaching Budget's)."""
    if args.teaching:
        budget = checkpoint.Budget(bytes, offload=offload, host_bandwidth=host_bandwidth, cost_model=CoreCostModel())
    else:
        budget = checkpoint.Budget(bytes, offload=offload, host_bandwidth=host_bandwidth, calibrate=True)
    try:
        peak = measured_peak(args, make_model(args, budget))
    except ValueError:  # InfeasibleBudget: raised before anything is computed
        return None
    # its predicted time less the trace it timed (Python building the graph, which the optimum, planning from the
    # graph alone, cannot know): both then price the same thing, the step's ops and update and what the plan adds
    return budget.predicted_peak, budget.predicted_time - budget.trace_seconds, peak


def optimal_row(args, bytes, offload, host_bandwidth, cost_model):
    """The OptimalPlan on a fresh lazy step of the annotated model (regions: the Budget's groups), or None."""
    loss = lazy_loss(args, make_model(args, "all"))  # optimal ignores the drop flags, it reads the regions
    try:
        return checkpoint_budget.optimal(loss, bytes, offload=offload, host_bandwidth=host_bandwidth,
                                         cost_model=cost_model)
    except ValueError:
        return None


def sweep(args, cost_model):
    off_peak = measured_peak(args, make_model(args, None))
    probe = checkpoint.Budget(1)
    try:
        lazy_loss(args, make_model(args, probe)).backward()
    except ValueError:
        pass
    low = probe.minimum_peak
    rows = []
    for b in np.linspace(low, off_peak, args.points).astype(int):
        b = int(b)
        row = [b]
        for offload in (False, True):
            row.append(budget_row(args, b, offload, args.host_bandwidth))
            row.append(optimal_row(args, b, offload, args.host_bandwidth, cost_model))
        rows.append(row)
    return off_peak, low, rows


def _mb(n):
    return f"{n / 2**20:.2f}"


def _ms(seconds):
    return "n/a" if seconds is None else f"{1e3 * seconds:.2f}"


def _ratio(budget, plan):
    """The Budget's predicted step time over the optimum's (issue #29: within 5%)."""
    return "n/a" if budget is None or plan is None or budget[1] is None else f"{budget[1] / plan.predicted_time:.3f}"


def cells(row):
    b, recompute, best, both, best_both = row
    out = [_mb(b)]
    for budget, plan in ((recompute, best), (both, best_both)):
        if budget is None:
            out += ["infeasible"] * 3
        else:
            out += [_mb(budget[0]), _ms(budget[1]), _mb(budget[2])]
        if plan is None:
            out += ["infeasible"] * 3
        else:
            out += [_mb(plan.predicted_peak), _ms(plan.predicted_time), f"{plan.solve_seconds:.2f}"]
        out.append(_ratio(budget, plan))
    return out


HEADER = ("b MB", "Budget peak MB", "Budget ms", "M_peak MB", "optimal peak MB", "optimal ms", "solve s",
          "Budget / optimal time", "Budget+offload peak MB", "Budget+offload ms", "M_peak MB (offload)",
          "optimal+offload peak MB", "optimal+offload ms", "solve s (offload)", "Budget / optimal time (offload)")


def table(rows, markdown):
    body = [HEADER] + [tuple(cells(r)) for r in rows]
    if markdown:
        return "\n".join(["| " + " | ".join(body[0]) + " |", "| --- " * len(HEADER) + "|"]
                         + ["| " + " | ".join(c) + " |" for c in body[1:]])
    widths = [max(len(c[i]) for c in body) for i in range(len(HEADER))]
    return "\n".join("  ".join(c[i].rjust(widths[i]) for i in range(len(c))) for c in body)


# --models: the depth table of issue 46, models the Budget was not tuned on (batch 16 x 32, E = H = 64 unless said)
MODELS = [("2 layers", dict(num_layers=2)), ("8 layers", dict(num_layers=8)), ("32 layers", dict(num_layers=32)),
          ("16 layers (the docs' model)", dict()),
          ("8 layers, E 128, H 256, batch 32", dict(num_layers=8, embedding_size=128, hidden_size=256, batch_size=32))]


def ratio_range(rows, column):
    """'min - max' of the Budget's time over the optimum's across a sweep's rows (column 1: recompute only, 3: with
    offloading), where both planned."""
    ratios = [row[column][1] / row[column + 1].predicted_time for row in rows
              if row[column] is not None and row[column + 1] is not None and row[column][1] is not None]
    return f"{min(ratios):.3f} - {max(ratios):.3f}" if ratios else "n/a"


def models_table(args, calibration):
    """One row per (model, cost model): the range of Budget / optimal over a sweep of `args.points` budgets."""
    rows = []
    for name, overrides in MODELS:
        for teaching in (False, True):
            config = argparse.Namespace(**{**vars(args), **overrides, "teaching": teaching})
            cost_model = CoreCostModel() if teaching else CostModel(DEVICE, calibration=calibration)
            _, _, sweep_rows = sweep(config, cost_model)
            rows.append([name, "teaching" if teaching else "calibrated", ratio_range(sweep_rows, 1),
                         ratio_range(sweep_rows, 3)])
            print(f"bench_budget --models: {name}, {rows[-1][1]}: {rows[-1][2]}, offload {rows[-1][3]}",
                  file=sys.stderr)
    return markdown_table(["model", "cost model", "Budget / optimal", "with offloading"], rows, right=(2, 3))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_arguments(p)
    p.set_defaults(batch_size=16, seq_len=32, embedding_size=64, hidden_size=64, num_layers=16, num_head=4, vocab=500)
    p.add_argument("--points", type=int, default=10, help="budgets in the sweep")
    p.add_argument("--host-bandwidth", dest="host_bandwidth", type=float, default=None,
                   help="bytes/s to plan copies with (16e9: PCIe 4); default: this machine's, measured")
    p.add_argument("--nominal", action="store_true", help="price plans with Calibration.nominal(), not this machine's")
    p.add_argument("--teaching", action="store_true",
                   help="price both with the core's fixed rates (costs.CostModel(): the teaching Budget's, no clock)")
    p.add_argument("--models", action="store_true",
                   help="instead: five models, both cost models, the range of Budget / optimal over each sweep")
    p.add_argument("--markdown", action="store_true", help="print the table alone, as Markdown")
    args = p.parse_args()
    if args.markdown:  # HiGHS's C code may print to file descriptor 1: everything but the table goes to stderr
        table_out = os.fdopen(os.dup(1), "w")
        os.dup2(2, 1)
        sys.stdout = sys.stderr
    if not DEVICE.enabled():
        raise SystemExit("bench_budget: the C++ backend is not built; run `make` first")
    if args.models:
        result = models_table(args, Calibration.nominal() if args.nominal else Calibration.load_or_measure(DEVICE))
        print(result, file=table_out if args.markdown else sys.stdout, flush=True)
        return
    if args.teaching:
        cost_model = CoreCostModel()
    else:
        calibration = Calibration.nominal() if args.nominal else Calibration.load_or_measure(DEVICE)
        cost_model = CostModel(DEVICE, calibration=calibration)
    start = time.perf_counter()
    off_peak, low, rows = sweep(args, cost_model)
    if not args.markdown:
        print(f"bench_budget: batch {args.batch_size} x seq_len {args.seq_len}, embedding {args.embedding_size}, "
              f"hidden {args.hidden_size}, {args.num_layers} layers, {args.num_head} heads, vocab {args.vocab}, lazy; "
              f"{'the core fixed rates' if args.teaching else 'nominal' if args.nominal else 'this machine'}'s "
              f"cost model"
              + (f", copies planned at {args.host_bandwidth / 1e9:g} GB/s" if args.host_bandwidth else ""))
        print(f"gc off's M_peak {_mb(off_peak)} MB; recompute-only Budget's least peak {_mb(low)} MB; "
              f"+ms: seconds a plan adds to a step (recompute + exposed copies); sweep took "
              f"{time.perf_counter() - start:.0f} s")
    print(table(rows, args.markdown), file=table_out if args.markdown else sys.stdout, flush=True)


if __name__ == "__main__":
    main()
