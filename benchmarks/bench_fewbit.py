"""Few-bit derivatives (issue #30): the fitted tables, their picture, and what k bits per element cost in quality
and time against the exact GELU, on a small Transformer LM trained by gc.py on the reduced PTB.

    python benchmarks/bench_fewbit.py              # the tables; writes docs/img/fewbit-derivative.png
    python benchmarks/bench_fewbit.py --markdown   # the same, for benchmarks/figures.py
    python benchmarks/bench_fewbit.py --steps 50 --seeds 1   # a quick look
    python benchmarks/bench_fewbit.py --readme --steps 100     # the README's table, on gc.py's default model

The model: embedding = hidden = 64, 2 layers, 4 heads of 16, seq 32, batch 16, gc off, eager (the issue's test
model, with PTB's vocabulary). Per configuration and seed, one `gc.py run` of --steps steps; the loss is the mean of
the last 20 steps' training losses, reported as the mean over the seeds and the worst seed's; T_step is gc.py's
median step time (the mean over seeds); M_act and M_peak are gc.py's (bytes held after the forward pass; the most
bytes the step's forward and backward held, gradients included: compression must lower the first and never raise the
second). "activation bytes per layer" is what the first layer's fused MLP op holds on the activation's account (the
pre-activation, or its codes), read from the model itself.
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
from needle import autograd, ops  # noqa: E402
from needle.toolbox import fewbit  # noqa: E402
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


def gc_run(out, activation, bits, seed, steps, extra=(), model=MODEL):
    """(the mean of the last 20 steps' losses, gc.py's median T_step, M_act, M_peak) of one `gc.py run`."""
    path = os.path.join(out, f"{activation}-{bits}-{'_'.join(extra)}-{seed}.json")
    argv = [sys.executable, os.path.join(ROOT, "gc.py"), "run", *model, "--activation", activation, "--seed",
            str(seed), "--max-batches", str(steps), "--json", path, "--no-progress", *extra]
    if bits is not None:
        argv += ["--activation-bits", str(bits)]
    subprocess.run(argv, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    with open(path) as f:
        record = json.load(f)
    losses = [s["loss"] for s in record["steps"]][-20:]
    return (statistics.mean(losses), record["step_time_seconds"], record["activation_bytes"],
            record["peak_activation_bytes"])


# Compressed saved activations (checkpoint.compress) on top of 3-bit GELU: (name, gc.py flags). gc on with --policy
# off and --compress-bits is compression alone (everything kept, compressed).
COMPRESSED = [("gelu, 3 bits, compress 8", ["--use-gc", "1", "--policy", "off", "--compress-bits", "8"]),
              ("gelu, 3 bits, compress 4", ["--use-gc", "1", "--policy", "off", "--compress-bits", "4"]),
              ("gelu, 3 bits, compress 2", ["--use-gc", "1", "--policy", "off", "--compress-bits", "2"]),
              ("gelu, 3 bits, selective + compress 8", ["--use-gc", "1", "--policy", "selective",
                                                        "--compress-bits", "8"])]


def compression_table(steps, seeds, results):
    """Each compression configuration against the exact GELU model with gc off (`results`: quality_table's runs):
    M_act and M_peak, loss, T_step (means over the seeds; the loss's worst seed too)."""
    rows = ["| configuration | M_act | vs exact gelu | M_peak | vs exact gelu | loss (mean, worst seed) | "
            "vs exact gelu | T_step | vs exact gelu |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    exact = results["gelu"][2]
    with tempfile.TemporaryDirectory() as out:
        configs = [("gelu (exact), gc off", None, exact), ("gelu, 3 bits, gc off", 3, results["gelu, 3 bits"][2])]
        configs += [(name, 3, [gc_run(out, "gelu", 3, seed, steps, flags) for seed in range(seeds)])
                    for name, flags in COMPRESSED]
    base_loss, base_time, base_act, base_peak = (statistics.mean(r[k] for r in exact) for k in range(4))
    for name, _, runs in configs:
        losses = [r[0] for r in runs]
        loss, t_step, m_act, m_peak = (statistics.mean(r[k] for r in runs) for k in range(4))
        rows.append(f"| {name} | {m_act / KB:.0f} KB | {m_act / base_act:.3f} | {m_peak / KB:.0f} KB | "
                    f"{m_peak / base_peak:.3f} | {loss:.4f}, {max(losses):.4f} | "
                    f"{100 * (loss / base_loss - 1):+.2f}% | {1000 * t_step:.1f} ms | "
                    f"{100 * (t_step / base_time - 1):+.1f}% |")
    return "\n".join(rows)


README_MODEL = ["--embedding-size", "256", "--hidden-size", "256", "--num-layers", "4", "--num-head", "4",
                "--seq-len", "32", "--batch-size", "32", "--no-lazy"]  # gc.py's defaults, the demo's model


def readme_table(steps):
    """bits -> bytes -> loss -> time on the benchmark model (gc.py's defaults, GELU), one seed."""
    rows = ["| GELU's backward keeps | saved activations | M_act | vs exact | M_peak | vs exact | loss after "
            f"{steps} steps | vs exact | T_step | vs exact |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    configs = [("its input, 32 bits", "exact", None, ["--use-gc", "0"]),
               ("a 3-bit code", "exact", 3, ["--use-gc", "0"]),
               ("a 3-bit code", "8-bit codes", 3, ["--use-gc", "1", "--policy", "off", "--compress-bits", "8"]),
               ("a 3-bit code", "4-bit codes", 3, ["--use-gc", "1", "--policy", "off", "--compress-bits", "4"]),
               ("a 3-bit code", "2-bit codes", 3, ["--use-gc", "1", "--policy", "off", "--compress-bits", "2"]),
               ("a 3-bit code", "selective's, 8-bit codes", 3,
                ["--use-gc", "1", "--policy", "selective", "--compress-bits", "8"])]
    with tempfile.TemporaryDirectory() as out:
        results = [(what, kept, gc_run(out, "gelu", bits, 0, steps, flags, README_MODEL))
                   for what, kept, bits, flags in configs]
    base_loss, base_time, base_act, base_peak = results[0][2]
    for what, kept, (loss, t_step, m_act, m_peak) in results:
        rows.append(f"| {what} | {kept} | {m_act / 2**20:.1f} MB | {m_act / base_act:.3f} | {m_peak / 2**20:.1f} MB | "
                    f"{m_peak / base_peak:.3f} | {loss:.4f} | "
                    f"{100 * (loss / base_loss - 1):+.2f}% | {1000 * t_step:.0f} ms | "
                    f"{100 * (t_step / base_time - 1):+.1f}% |")
    return "\n".join(rows)


def quality_table(steps, seeds):
    """(the table, the runs: {name: (activation, bits, [(loss, T_step, M_act) per seed])})."""
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
    return "\n".join(rows), results


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--markdown", action="store_true", help="the tables alone")
    p.add_argument("--readme", action="store_true",
                   help="the README's table instead: bits -> bytes -> loss -> time on gc.py's default model")
    args = p.parse_args()
    if args.readme:
        print(readme_table(args.steps))
        return
    draw()
    if not args.markdown:
        print(f"bench_fewbit: fitted tables (x ~ {fewbit.DISTRIBUTION}); picture: {os.path.relpath(PNG, ROOT)}")
    print(fitted_tables())
    print()
    print(f"{args.steps} steps of gc.py's model (embedding = hidden = 64, 2 layers, 4 heads of 16, seq 32, batch 16, "
          f"gc off, eager) on the reduced PTB, {args.seeds} seeds:\n")
    table, results = quality_table(args.steps, args.seeds)
    print(table)
    print(f"\nCompressed saved activations (checkpoint.compress, gc.py --compress-bits) on the same model, "
          f"{args.steps} steps, {args.seeds} seeds:\n")
    print(compression_table(args.steps, args.seeds, results))
    print("\n![the derivative of GELU and SiLU and their fitted 1-, 2- and 3-bit levels](img/fewbit-derivative.png)")


if __name__ == "__main__":
    main()
