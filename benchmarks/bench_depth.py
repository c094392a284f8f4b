"""Checkpointing across depth (issue 46): how memory and recomputation grow with a stack's length.

    python benchmarks/bench_depth.py                # the three tables below, about two minutes on 2 cores
    python benchmarks/bench_depth.py --quick        # smaller stacks, for a look

1. nn.LSTM(32, 64) over T = 16, 64, 256 steps, eager, its stacked output not kept and the loss read from the final
   state: the bytes its graph holds after forward (saved_residuals, besides the parameters and the input), gc off
   and sqrt, and the fitted exponent p of c + a T^p (growth.py); gradients compared with gc off's, bit for bit.
2. The Transformer LM (embedding 32, 2 heads, batch 8 x seq_len 16) at 64 layers: recomputed nodes against the
   forward's node count, for sqrt and Revolve(4), and Revolve's rebuilt boundaries against the binomial formula.
3. Its step time at 64 layers, sqrt and Revolve(4) against gc off: the median of interleaved steps, one run.
"""
import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(ROOT, "python"), os.path.join(ROOT, "apps")]

import numpy as np  # noqa: E402

import needle as ndl  # noqa: E402
from needle import autograd, backward, checkpoint, nn  # noqa: E402
from needle.toolbox.revolve import runs  # noqa: E402
from experiment.growth import fitted_exponent  # noqa: E402
from models import LanguageModel  # noqa: E402

DEVICE = ndl.cpu()


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
    rows, held = [], {None: [], "sqrt": []}
    for steps in lengths:
        off, off_grads = lstm_held(steps, None)
        on, on_grads = lstm_held(steps, "sqrt")
        held[None].append(off)
        held["sqrt"].append(on)
        rows.append(f"  T = {steps:4d}: gc off {off:9,d} B, sqrt {on:7,d} B, gradients equal: "
                    f"{all(np.array_equal(a, b) for a, b in zip(off_grads, on_grads))}")
    fits = {k: fitted_exponent(lengths, v) for k, v in held.items()}
    return rows + [f"  p: gc off {fits[None]:.2f}, sqrt {fits['sqrt']:.2f}"]


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


def recompute_table(layers):
    rows = []
    for name, policy in (("sqrt", "sqrt"), ("Revolve(4)", checkpoint.Revolve(4))):
        x, y = batch()
        loss, _ = language_model(layers, policy).loss(x, y)
        forward = sum(1 for n in autograd.find_topo_sort([loss]) if not n.is_leaf())
        loss.backward()
        stats = backward.last_backward_stats()
        rows.append(f"  {name:10s}: recomputed {stats['recomputed_nodes']:6d} nodes = "
                    f"{stats['recomputed_nodes'] / forward:.2f}x the forward's {forward}; boundaries rebuilt "
                    f"{stats['recomputed_boundaries']}"
                    + (f" (formula t(l, s) - (l - 1) = {runs(layers, 4) - (layers - 1)})" if name != "sqrt" else ""))
    return rows


def time_table(layers, steps):
    """Median seconds of a step (forward, backward), the configurations interleaved step by step."""
    configs = {"off": None, "sqrt": "sqrt", "Revolve(4)": checkpoint.Revolve(4)}
    models = {name: language_model(layers, policy) for name, policy in configs.items()}
    x, y = batch()
    seconds = {name: [] for name in configs}
    for step in range(steps + 1):
        for name, model in models.items():
            start = time.perf_counter()
            loss, _ = model.loss(x, y)
            loss.backward()
            if step:  # the first: warm-up
                seconds[name].append(time.perf_counter() - start)
    off = statistics.median(seconds["off"])
    return [f"  {name:10s}: {statistics.median(s) * 1e3:7.1f} ms ({statistics.median(s) / off:.2f}x gc off)"
            for name, s in seconds.items()]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="T = 8, 32, 128 and 16 layers")
    args = p.parse_args()
    if not DEVICE.enabled():
        raise SystemExit("bench_depth: the C++ backend is not built; run `make` first")
    lengths, layers = ((8, 32, 128), 16) if args.quick else ((16, 64, 256), 64)
    print(f"1. nn.LSTM(32, 64), batch 8, eager: bytes held after forward (T = {', '.join(map(str, lengths))})")
    print("\n".join(lstm_table(lengths)))
    print(f"2. Transformer LM, {layers} layers: recomputation in one backward")
    print("\n".join(recompute_table(layers)))
    print(f"3. Transformer LM, {layers} layers: step time (forward + backward), median of 5 interleaved steps")
    print("\n".join(time_table(layers, 5)))


if __name__ == "__main__":
    main()
