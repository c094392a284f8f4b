"""Does the cost model know this machine? Calibrate, then put its predicted forward time beside the measured one.

    python benchmarks/bench_cost_model.py                # gc.py's demo model (batch 32, 4 layers, E = H = 256)
    python benchmarks/bench_cost_model.py --markdown     # the table alone
    python benchmarks/bench_cost_model.py --recalibrate  # measure the rates afresh instead of reading the cache

The checkpointing planner ranks values by what recomputing them costs, so what matters is that the model gets the
ops' relative costs right, kind by kind, and the whole pass roughly right. The forward pass of the Transformer LM
is built lazily and realized through a `backward.Compute` that times each op (the machine that recomputes values
in backward), `repeats` times after a warm-up; each kind keeps the median of its per-pass totals. Predicted: the
sum of `CostModel.compute_seconds` over the same ops. The whole-pass row's measurement is the realization's wall
time, walking included.
"""
import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(ROOT, "python"), os.path.join(ROOT, "apps"), os.path.dirname(os.path.abspath(__file__))]

import numpy as np  # noqa: E402

import needle as ndl  # noqa: E402
from needle import autograd, nn  # noqa: E402
from needle.backward import Compute  # noqa: E402
from needle.toolbox.cost_model import KINDS, Calibration, CostModel, op_work  # noqa: E402
from bench_step import add_model_arguments  # noqa: E402
from models import LanguageModel  # noqa: E402


class TimedCompute(Compute):
    """Compute that adds each op's seconds to its kind's total."""

    def __init__(self):
        super().__init__()
        self.seconds = {}

    def compute(self, node):
        start = time.perf_counter()
        super().compute(node)
        elapsed = time.perf_counter() - start
        kind = op_work(node)[0]
        self.seconds[kind] = self.seconds.get(kind, 0.0) + elapsed


def forward_graph(args, model, device):
    """The loss of one batch, as a lazy graph (nothing computed yet)."""
    rs = np.random.RandomState(0)
    X = ndl.Tensor(rs.randint(0, args.vocab, (args.seq_len, args.batch_size)).astype(np.float32), device=device,
                   requires_grad=False)
    y = ndl.Tensor(rs.randint(0, args.vocab, (args.seq_len * args.batch_size,)).astype(np.float32), device=device,
                   requires_grad=False)
    with autograd.lazy_mode(True):
        if args.head == "fused":
            return model.loss(X, y)[0]
        return nn.SoftmaxLoss()(model(X)[0], y)


def measure(args, cost):
    """{kind: (ops, predicted seconds, measured seconds)} and ("whole forward", predicted, measured) totals."""
    device = ndl.cpu()
    np.random.seed(0)
    model = LanguageModel(args.embedding_size, args.vocab, args.hidden_size, num_layers=args.num_layers,
                          seq_model="transformer", seq_len=args.seq_len, device=device, num_head=args.num_head,
                          dim_head=args.embedding_size // args.num_head)
    passes, walls = [], []
    for i in range(args.repeats + 1):  # the first is a warm-up (the allocator's cache)
        loss = forward_graph(args, model, device)
        computed = [n for n in autograd.find_topo_sort([loss]) if n.cached_data is None]
        machine = TimedCompute()
        start = time.perf_counter()
        autograd.realize([loss], lambda node: True, machine)
        if i:
            walls.append(time.perf_counter() - start)
            passes.append(machine.seconds)
    rows = {}
    for node in computed:
        kind = op_work(node)[0]
        count, predicted, _ = rows.get(kind, (0, 0.0, 0.0))
        rows[kind] = (count + 1, predicted + cost.compute_seconds(node), 0.0)
    rows = {k: (n, p, statistics.median(s.get(k, 0.0) for s in passes)) for k, (n, p, _) in rows.items()}
    total = (len(computed), sum(p for _, p, _ in rows.values()), statistics.median(walls))
    return rows, total


def table(rows, total, markdown):
    header = ("kind", "ops", "predicted ms", "measured ms", "predicted / measured")
    body = [(kind, *rows[kind]) for kind in KINDS if kind in rows] + [("whole forward", *total)]
    cells = [header] + [(k, str(n), f"{1e3 * p:.2f}", f"{1e3 * m:.2f}", f"{p / m:.2f}" if m else "-")
                        for k, n, p, m in body]
    if markdown:
        return "\n".join(["| " + " | ".join(c) + " |" for c in cells[:1]] + ["| --- " * len(header) + "|"]
                         + ["| " + " | ".join(c) + " |" for c in cells[1:]])
    widths = [max(len(c[i]) for c in cells) for i in range(len(header))]
    return "\n".join("  ".join(c[i].rjust(widths[i]) if i else c[i].ljust(widths[i]) for i in range(len(c)))
                     for c in cells)


def calibration_lines(calibration, seconds):
    source = "from the cache" if seconds is None else f"measured in {seconds:.2f} s"
    lines = [f"calibration ({source}): overhead "
             f"{1e6 * calibration.overhead_seconds:.1f} µs per op, host copies "
             + ", ".join(f"{d} {b / 1e9:.2f} GB/s" for d, b in calibration.host_bandwidth.items())]
    lines.append("rates: " + ", ".join(f"{k} {r / 1e9:.2f} G{'flop' if k in ('matmul', 'attention', 'conv') else 'B'}/s"
                                       for k, r in calibration.rates.items()))
    return lines


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_arguments(p)
    p.set_defaults(batch_size=32, vocab=7596)  # gc.py's demo model (the reduced PTB's vocabulary)
    p.add_argument("--head", choices=["full", "fused"], default="full",
                   help="the LM head: logits + SoftmaxLoss (full) or ops.linear_cross_entropy (fused)")
    p.add_argument("--repeats", type=int, default=5, help="timed forward passes after one warm-up")
    p.add_argument("--recalibrate", action="store_true", help="measure the rates afresh (not from the cache)")
    p.add_argument("--markdown", action="store_true", help="print the table alone, as Markdown")
    args = p.parse_args()
    if not ndl.cpu().enabled():
        raise SystemExit("bench_cost_model: the C++ backend is not built; run `make` first")
    start = time.perf_counter()
    calibration = (Calibration.measure if args.recalibrate else Calibration.load_or_measure)(ndl.cpu())
    seconds = time.perf_counter() - start if args.recalibrate else None
    rows, total = measure(args, CostModel(ndl.cpu(), calibration=calibration))
    if not args.markdown:
        print(f"bench_cost_model: batch {args.batch_size} x seq_len {args.seq_len}, embedding {args.embedding_size}, "
              f"hidden {args.hidden_size}, {args.num_layers} layers, vocab {args.vocab}, {args.head} head, "
              f"{ndl.cpu().num_threads()} thread(s); forward pass, median of {args.repeats}")
        print("\n".join(calibration_lines(calibration, seconds)))
    print(table(rows, total, args.markdown))


if __name__ == "__main__":
    main()
