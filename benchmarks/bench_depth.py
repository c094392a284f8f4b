"""Checkpointing across depth (issue 46): how memory and recomputation grow with a stack's length.

    python benchmarks/bench_depth.py                # the tables below, about three minutes on 2 cores
    python benchmarks/bench_depth.py --quick        # smaller stacks, for a look
    python benchmarks/bench_depth.py --markdown     # the tables alone on stdout (figures.py: figure "depth")

1. The Transformer LM (embedding 32, feed-forward 32, 2 heads, vocabulary 100, batch 8 x seq_len 16, lazy) at 4, 16
   and 64 layers: M_act (the allocator's bytes held when backward starts, less those before the step) and M_peak,
   gc off, sqrt and Revolve(4), with the exponent p of c + a L^p fitted to the increments (growth.py).
2. nn.LSTM(32, 64) over T = 16, 64, 256 steps, eager, its stacked output not kept and the loss read from the final
   state: the bytes its graph holds after forward (saved_residuals, besides the parameters and the input), gc off
   and sqrt, and p; gradients compared with gc off's, bit for bit.
3. The Transformer LM at 64 layers: recomputed nodes against the forward's node count, boundaries rebuilt (Revolve's
   against the binomial formula), and the step's time (forward and backward) against gc off's: the median of 5
   interleaved steps after one of warm-up, in one run, each timed with Python's garbage collector held off.
"""
import argparse
import gc as python_gc
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(ROOT, "python"), os.path.join(ROOT, "apps")]

import numpy as np  # noqa: E402

import needle as ndl  # noqa: E402
from needle import autograd, backward, checkpoint, nn  # noqa: E402
from needle.backend_ndarray import memory_stats, reset_peak_memory_stats  # noqa: E402
from needle.toolbox.revolve import runs  # noqa: E402
from experiment.growth import fitted_exponent  # noqa: E402
from md_table import markdown_table, progress_to_stderr  # noqa: E402
from models import LanguageModel  # noqa: E402

DEVICE = ndl.cpu()
POLICIES = {"off": None, "sqrt": "sqrt", "Revolve(4)": checkpoint.Revolve(4)}


def language_model(layers, policy):
    np.random.seed(0)
    model = LanguageModel(32, 100, 32, num_layers=layers, seq_model="transformer", seq_len=16, device=DEVICE,
                          num_head=2, dim_head=16)
    if policy is not None:
        model.enable_gc(policy=policy)
    return model


def batch():
    rs = np.random.RandomState(0)
    x = ndl.Tensor(rs.randint(0, 100, (16, 8)).astype("float32"), device=DEVICE, requires_grad=False)
    y = ndl.Tensor(rs.randint(0, 100, (128,)).astype("float32"), device=DEVICE, requires_grad=False)
    return x, y


def lm_memory(layers, policy):
    """(M_act, M_peak) of one lazy step: bytes held when backward starts, the peak, less those before."""
    model, (x, y) = language_model(layers, policy), batch()
    python_gc.collect()
    base = memory_stats(DEVICE)["current_bytes"]
    reset_peak_memory_stats(DEVICE)
    with autograd.lazy_mode(True):
        loss, _ = model.loss(x, y)
        autograd.run_deferred([loss])
        loss.realize_cached_data()
        held = memory_stats(DEVICE)["current_bytes"] - base
        loss.backward()
    return held, memory_stats(DEVICE)["peak_bytes"] - base


def memory_table(depths):
    rows = []
    for name, policy in POLICIES.items():
        acts, peaks = zip(*(lm_memory(layers, policy) for layers in depths))
        rows.append([name] + [f"{a / 2**20:.3f} / {p / 2**20:.2f}" for a, p in zip(acts, peaks)]
                    + [_p(fitted_exponent(depths, acts)), _p(fitted_exponent(depths, peaks))])
    header = ["policy"] + [f"{d} layers: M_act / M_peak (MiB)" for d in depths] + ["p (M_act)", "p (M_peak)"]
    return markdown_table(header, rows, right=range(1, len(depths) + 3))


def _p(p):
    return "does not grow" if p is None else f"{p:.2f}"


def lstm_held(steps, policy):
    """(bytes held after forward besides parameters and input, the parameters' gradients)."""
    np.random.seed(0)
    lstm = nn.LSTM(32, 64, device=DEVICE)
    if policy is not None:
        lstm.enable_gc(policy=policy)
    x = ndl.Tensor(np.random.RandomState(1).randn(steps, 8, 32).astype("float32"), device=DEVICE)
    _, (h, _) = lstm(x)
    loss = (h * h).sum()
    held = sum(b for _, _, b in checkpoint.saved_residuals(loss, exclude=lstm.parameters() + [x]))
    loss.backward()
    return held, [p.grad.numpy() for p in lstm.parameters()]


def lstm_table(lengths):
    """(the table, whether sqrt's gradients equal gc off's at every length)."""
    held = {name: [lstm_held(steps, policy) for steps in lengths] for name, policy in (("off", None), ("sqrt", "sqrt"))}
    same = all(np.array_equal(a, b) for off, on in zip(held["off"], held["sqrt"]) for a, b in zip(off[1], on[1]))
    rows = [[name] + [f"{b:,}" for b, _ in results] + [_p(fitted_exponent(lengths, [b for b, _ in results]))]
            for name, results in held.items()]
    header = ["policy"] + [f"T = {t}: bytes held" for t in lengths] + ["p"]
    return markdown_table(header, rows, right=range(1, len(lengths) + 2)), same


def step_table(layers, steps=5):
    models = {name: language_model(layers, policy) for name, policy in POLICIES.items()}
    x, y = batch()
    seconds, counts = {name: [] for name in POLICIES}, {}
    for step in range(steps + 1):
        for name, model in models.items():
            python_gc.collect()  # Python's collector held off while a step is timed, as timeit does: a full
            python_gc.disable()  # collection of the 64 layers' objects lands in whichever step runs then
            start = time.perf_counter()
            loss, _ = model.loss(x, y)
            forward = sum(1 for n in autograd.find_topo_sort([loss]) if not n.is_leaf()) if not step else 0
            loss.backward()
            elapsed = time.perf_counter() - start
            python_gc.enable()
            if step:  # the first: warm-up, and the counts
                seconds[name].append(elapsed)
            else:
                counts[name] = (forward, backward.last_backward_stats())
    off = statistics.median(seconds["off"])
    rows = []
    for name, (forward, stats) in counts.items():
        rebuilt = stats["recomputed_boundaries"]
        formula = f" (formula: {runs(layers, 4) - (layers - 1)})" if name.startswith("Revolve") else ""
        rows.append([name, f"{stats['recomputed_nodes']:,} ({stats['recomputed_nodes'] / forward:.2f}x)",
                     f"{rebuilt}{formula}", f"{statistics.median(seconds[name]) * 1e3:.0f}",
                     f"{statistics.median(seconds[name]) / off:.2f}x"])
    header = ["policy", f"recomputed nodes (x the forward's {forward:,})", "boundaries rebuilt", "step (ms)",
              "against gc off"]
    return markdown_table(header, rows, right=(1, 2, 3, 4))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="4/8/16 layers, T = 8, 32, 128, steps timed at 16 layers")
    p.add_argument("--markdown", action="store_true", help="the tables alone on stdout, in Markdown")
    args = p.parse_args()
    if not DEVICE.enabled():
        raise SystemExit("bench_depth: the C++ backend is not built; run `make` first")
    depths, lengths, layers = ((4, 8, 16), (8, 32, 128), 16) if args.quick else ((4, 16, 64), (16, 64, 256), 64)
    start = time.perf_counter()
    with progress_to_stderr(args.markdown):
        print(f"bench_depth: cpu(), {os.environ.get('OMP_NUM_THREADS', 'all')} threads")
    memory = memory_table(depths)
    lstm, same = lstm_table(lengths)
    steps = step_table(layers)
    print(f"Transformer LM (embedding 32, 2 heads, batch 8 x 16, lazy), one step; p: the exponent of c + a L^p:\n\n"
          f"{memory}\n\nnn.LSTM(32, 64), batch 8, eager: bytes its graph holds after forward (gradients equal gc "
          f"off's: {same}); p of c + a T^p:\n\n{lstm}\n\nTransformer LM, {layers} layers: one backward's "
          f"recomputation, and the step's median time (5 interleaved steps, Python's collector held off):\n\n{steps}")
    with progress_to_stderr(args.markdown):
        print(f"bench_depth took {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
