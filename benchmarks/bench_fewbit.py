"""Few-bit derivatives (issue #30): the fitted tables, their picture, and what k bits per element cost in quality
and time against the exact GELU, on a small Transformer LM trained by gc.py on the reduced PTB.

    python benchmarks/bench_fewbit.py              # the tables; writes docs/img/fewbit-derivative.png
    python benchmarks/bench_fewbit.py --markdown   # the same, for benchmarks/figures.py
    python benchmarks/bench_fewbit.py --steps 50 --seeds 1   # a quick look

The model: embedding = hidden = 64, 2 layers, 4 heads of 16, seq 32, batch 16, gc off, eager (the issue's test
model, with PTB's vocabulary). Per configuration and seed, one `gc.py run` of --steps steps; the loss is the mean
of the last 20 steps' training losses, reported as the mean over the seeds and the worst seed's; T_step is gc.py's
median step time (the mean over seeds); M_act is gc.py's (bytes held after the forward pass). "activation bytes
per layer" is what the first layer's fused MLP op holds on the activation's account (the pre-activation, or its
codes), read from the model itself.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(ROOT, "python"), os.path.join(ROOT, "apps")]

import numpy as np  # noqa: E402

import needle as ndl  # noqa: E402
from needle import autograd, fewbit, ops  # noqa: E402
from needle.backend_ndarray.ndarray_backend_numpy import activation_derivative  # noqa: E402
from models import LanguageModel  # noqa: E402

MODEL = ["--embedding-size", "64", "--hidden-size", "64", "--num-layers", "2", "--num-head", "4", "--seq-len", "32",
         "--batch-size", "16", "--use-gc", "0", "--no-lazy"]
CONFIGS = [("relu", "relu", None), ("gelu", "gelu", None)] + [(f"gelu, {k} bits", "gelu", k) for k in fewbit.BITS]
PNG = os.path.join(ROOT, "docs", "img", "fewbit-derivative.png")
KB = 1024


def fitted_tables():
    rows = ["| activation | bits | boundaries | levels | E[(f' − q)²] | / Var f' |",
            "| --- | --- | --- | --- | --- | --- |"]
    for kind in ("gelu", "silu"):
        for bits in fewbit.BITS:
            t = fewbit.derivative_table(kind, bits)
            rows.append(f"| {kind} | {bits} | {' '.join(f'{b:.2f}' for b in t.boundaries)} | "
                        f"{' '.join(f'{v:.3f}' for v in t.levels)} | {t.expected_error:.2e} | "
                        f"{t.expected_error / t.variance:.4f} |")
    return "\n".join(rows)


def draw():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    x = np.linspace(-4, 4, 2001)
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6), sharey=True)
    for ax, kind in zip(axes, ("gelu", "silu")):
        ax.plot(x, activation_derivative(kind, x), color="black", lw=2, label=f"exact {kind}'")
        for bits in (1, 2, 3):
            ax.step(x, fewbit.quantized_derivative(kind, bits, x), where="post", lw=1.2, label=f"{bits} bits")
        ax.set_title(f"{kind}: derivative and its fitted few-bit levels (x ~ {fewbit.DISTRIBUTION})")
        ax.set_xlabel("x")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(PNG), exist_ok=True)
    fig.savefig(PNG, dpi=110)
    plt.close(fig)


def activation_bytes(activation, bits):
    """Bytes the first layer's fused MLP op holds on the activation's account after forward (eager); 0 for relu."""
    if activation == "relu":
        return 0
    np.random.seed(0)
    model = LanguageModel(64, 500, 64, num_layers=2, seq_model="transformer", seq_len=32, num_head=4, dim_head=16,
                          activation=activation, activation_bits=bits)
    rng = np.random.default_rng(0)
    loss, _ = model.loss(ndl.Tensor(rng.integers(0, 500, (32, 16)), requires_grad=False),
                         ndl.Tensor(rng.integers(0, 500, (32 * 16,)), requires_grad=False))
    node = next(n for n in autograd.find_topo_sort([loss]) if isinstance(n.op, ops.LinearActivation))
    return node.cached_data[1].nbytes


def gc_run(out, activation, bits, seed, steps):
    path = os.path.join(out, f"{activation}-{bits}-{seed}.json")
    argv = [sys.executable, os.path.join(ROOT, "gc.py"), "run", *MODEL, "--activation", activation, "--seed",
            str(seed), "--max-batches", str(steps), "--json", path, "--no-progress"]
    if bits is not None:
        argv += ["--activation-bits", str(bits)]
    subprocess.run(argv, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    with open(path) as f:
        record = json.load(f)
    losses = [s["loss"] for s in record["steps"]][-20:]
    return statistics.mean(losses), record["step_time_seconds"], record["activation_bytes"]


def quality_table(steps, seeds):
    results = {}
    with tempfile.TemporaryDirectory() as out:
        for name, activation, bits in CONFIGS:
            runs = [gc_run(out, activation, bits, seed, steps) for seed in range(seeds)]
            results[name] = (activation, bits, runs)
    exact_loss = statistics.mean(r[0] for r in results["gelu"][2])
    exact_time = statistics.mean(r[1] for r in results["gelu"][2])
    exact_bytes = activation_bytes("gelu", None)
    rows = ["| MLP activation | activation bytes per layer | vs exact gelu | M_act | loss (mean, worst seed) | "
            "vs exact gelu | T_step | vs exact gelu |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, (activation, bits, runs) in results.items():
        held = activation_bytes(activation, bits)
        losses = [r[0] for r in runs]
        mean_loss, worst = statistics.mean(losses), max(losses)
        t_step, m_act = statistics.mean(r[1] for r in runs), statistics.mean(r[2] for r in runs)
        rows.append(f"| {name} | {held / KB:.0f} KB | {held / exact_bytes:.3f} | {m_act / KB:.0f} KB | "
                    f"{mean_loss:.4f}, {worst:.4f} | {100 * (mean_loss / exact_loss - 1):+.2f}% | "
                    f"{1000 * t_step:.1f} ms | {100 * (t_step / exact_time - 1):+.1f}% |")
    return "\n".join(rows)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--markdown", action="store_true", help="the tables alone")
    args = p.parse_args()
    draw()
    if not args.markdown:
        print(f"bench_fewbit: fitted tables (x ~ {fewbit.DISTRIBUTION}); picture: {os.path.relpath(PNG, ROOT)}")
    print(fitted_tables())
    print()
    print(f"{args.steps} steps of gc.py's model (embedding = hidden = 64, 2 layers, 4 heads of 16, seq 32, batch 16, "
          f"gc off, eager) on the reduced PTB, {args.seeds} seeds:\n")
    print(quality_table(args.steps, args.seeds))
    print("\n![the derivative of GELU and SiLU and their fitted 1-, 2- and 3-bit levels](img/fewbit-derivative.png)")


if __name__ == "__main__":
    main()
