"""Optimizer memory on the PTB Transformer LM: state bytes, step time, offload, and training quality.

    python benchmarks/bench_optim.py                  # bytes and optimizer step time, the benchmark model
    python benchmarks/bench_optim.py --quality        # + 300 steps x 3 seeds per optimizer on the reduced PTB
    python benchmarks/bench_optim.py --markdown       # the tables alone on stdout, in Markdown (figures.py)

Bytes and time (one process, the same gradients for every optimizer): the model of gc.py's defaults (E = H = 256,
4 layers, the PTB vocabulary); for each optimizer the device bytes of its state after a step (exactly what the
allocator holds for it), bytes per parameter over the tensors it quantizes, the host bytes when offloaded, and
the median time of `opt.step()` alone over --repeats steps, as a ratio to Adam's measured in the same run.

Quality: `gc.py run --optimizer X` for --steps steps (batch --quality-batch) from the same initialization and
batches, per seed; the training loss at every 50th step, the mean over seeds, and its relative difference to
Adam's.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(ROOT, "python"), os.path.join(ROOT, "apps")]

import numpy as np  # noqa: E402
from md_table import markdown_table, progress_to_stderr  # noqa: E402

import needle as ndl  # noqa: E402
from needle import backend_ndarray as nd  # noqa: E402
from needle import optim  # noqa: E402

from models import LanguageModel  # noqa: E402

PTB = next((p for p in (os.path.join(ROOT, "data", "ptb"), os.path.join(ROOT, "..", "shared", "data", "ptb"))
            if os.path.exists(os.path.join(p, "train.txt"))), "synthetic")
PTB_VOCAB = 10000

# name -> (how gc.py spells it, a constructor at learning rate lr)
OPTIMIZERS = {
    "adam": ("adam", lambda ps, lr, model: optim.Adam(ps, lr=lr)),
    "adam weight decay": ("adam", lambda ps, lr, model: optim.Adam(ps, lr=lr, weight_decay=0.01)),
    "sgd momentum": ("sgd", lambda ps, lr, model: optim.SGD(ps, lr=lr, momentum=0.9, weight_decay=0.01)),
    "adam8bit": ("adam8bit", lambda ps, lr, model: optim.Adam8bit(ps, lr=lr,
                                                                  fp32_state_params=[model.embedding.weight])),
    "adafactor": ("adafactor", lambda ps, lr, model: optim.Adafactor(ps, lr=lr, relative_step=False,
                                                                     scale_parameter=False)),
    "adam offloaded": ("adam", lambda ps, lr, model: optim.Adam(ps, lr=lr, offload_state=True)),
    "adam8bit offloaded": ("adam8bit", lambda ps, lr, model: optim.Adam8bit(
        ps, lr=lr, fp32_state_params=[model.embedding.weight], offload_state=True)),
}


def build(args, device):
    np.random.seed(0)
    model = LanguageModel(args.embedding_size, PTB_VOCAB, args.embedding_size, num_layers=args.num_layers,
                          seq_model="transformer", seq_len=32, device=device, num_head=4,
                          dim_head=args.embedding_size // 4)
    params = model.parameters()
    rs = np.random.RandomState(1)
    for p in params:  # gradients of a realistic scale, the same for every optimizer
        p.grad = ndl.Tensor(rs.randn(*p.shape).astype(np.float32) * 1e-3, device=device)
    return model, params


def bytes_and_time(args):
    device = ndl.cpu() if nd.cpu().enabled() else ndl.cpu_numpy()
    rows = {}
    for name, (_, make) in OPTIMIZERS.items():
        model, params = build(args, device)
        opt = make(params, 1e-3, model)
        times = []
        for _ in range(args.repeats + 1):
            t0 = time.perf_counter()
            opt.step()
            times.append(time.perf_counter() - t0)
        n = sum(p.realize_cached_data().size for p in params)
        quantized = [p for p in params if getattr(opt, "quantizes", lambda p: False)(p)]
        q_n = sum(p.realize_cached_data().size for p in quantized)
        q_bytes = sum(sum(a.size * np.dtype(a.dtype).itemsize for a in opt.__dict__[slot][p])
                      for p in quantized for slot in ("m", "v")) if quantized and not opt.offload_state else None
        rows[name] = {"params": n, "state": opt.state_bytes(), "host": opt.host_state_bytes(),
                      "per_param_quantized": q_bytes / q_n if q_bytes else None,
                      "step": statistics.median(times[1:])}  # the first step allocates the state
    print(f"optimizer state, Transformer LM E = H = {args.embedding_size}, {args.num_layers} layers, vocabulary "
          f"{PTB_VOCAB} ({rows['adam']['params'] / 1e6:.2f} M parameters), device {device}, "
          f"{args.repeats} timed steps")
    print(f"{'optimizer':20s}{'device MB':>10s}{'x adam':>8s}{'host MB':>9s}{'B/param':>9s}{'B/param 8-bit':>15s}"
          f"{'step ms':>9s}{'x adam':>8s}")
    base = rows["adam"]
    for name, r in rows.items():
        q = "" if r["per_param_quantized"] is None else f"{r['per_param_quantized']:.3f}"
        print(f"{name:20s}{r['state'] / 2**20:10.2f}{r['state'] / base['state']:8.3f}{r['host'] / 2**20:9.2f}"
              f"{(r['state'] + r['host']) / r['params']:9.3f}{q:>15s}{r['step'] * 1e3:9.1f}"
              f"{r['step'] / base['step']:8.2f}")
    w = ndl.nn.Parameter(ndl.init.zeros(256, 1024, device=device))
    w.grad = ndl.init.ones(256, 1024, device=device)
    sizes = {}
    for make in (lambda ps: optim.Adam(ps, lr=1e-3), lambda ps: optim.Adafactor(ps)):
        opt = make([w])
        opt.step()
        sizes[type(opt).__name__] = opt.state_bytes()
    print(f"a 256 x 1024 weight: Adafactor's state {sizes['Adafactor']} B = "
          f"{sizes['Adafactor'] / sizes['Adam']:.2%} of Adam's {sizes['Adam']} B")
    return markdown_table(
        [f"optimizer ({base['params'] / 1e6:.2f} M parameters)", "device state MB", "× Adam", "host MB",
         "bytes / parameter", "on quantized tensors", "step ms", "× Adam"],
        [[name, f"{r['state'] / 2**20:.2f}", f"{r['state'] / base['state']:.3f}",
          f"{r['host'] / 2**20:.2f}", f"{(r['state'] + r['host']) / r['params']:.3f}",
          "" if r["per_param_quantized"] is None else f"{r['per_param_quantized']:.3f}", f"{r['step'] * 1e3:.1f}",
          f"{r['step'] / base['step']:.2f}"] for name, r in rows.items()], right=tuple(range(1, 8)))


def quality(args):
    out = tempfile.mkdtemp(prefix="bench_optim_")
    names = ["adam", "adam8bit", "adafactor"]
    curves = {name: [] for name in names}
    for seed in range(args.seeds):
        for name in names:
            path = os.path.join(out, f"{name}_{seed}.json")
            cmd = [sys.executable, os.path.join(ROOT, "gc.py"), "run", "--policy", "off", "--use-gc", "0",
                   "--optimizer", name, "--json", path, "--data", PTB, "--no-progress", "--batch-size",
                   str(args.quality_batch), "--max-batches", str(args.steps), "--epochs", str(args.epochs),
                   "--warmup", "0", "--seed", str(seed), "--lr", str(args.lr)]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                raise SystemExit(f"bench_optim: {' '.join(cmd)} failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
            with open(path) as f:
                curves[name].append([s["loss"] for s in json.load(f)["steps"]][:args.steps])
            print(f"  {name} seed {seed}: final loss {curves[name][-1][-1]:.4f}", file=sys.stderr, flush=True)
    steps = min(len(c) for runs in curves.values() for c in runs)
    marks = list(range(49, steps, 50))
    mean = {name: np.mean([c[:steps] for c in runs], axis=0) for name, runs in curves.items()}
    print(f"\nquality: training loss over {steps} steps (batch {args.quality_batch}, lr {args.lr}), mean of "
          f"{args.seeds} seeds, at every 50th step; in brackets the relative difference to Adam")
    print(f"{'optimizer':12s}" + "".join(f"{'step ' + str(i + 1):>17s}" for i in marks) + f"{'max |rel|':>11s}")
    for name in names:
        rel = [abs(mean[name][i] - mean["adam"][i]) / mean["adam"][i] for i in marks]
        print(f"{name:12s}" + "".join(f"{mean[name][i]:9.3f} ({r:5.1%})" for i, r in zip(marks, rel))
              + f"{max(rel):10.1%}")
    per_seed = {name: max(abs(c[i] - a[i]) / a[i] for c, a in zip(curves[name], curves["adam"]) for i in marks)
                for name in names}
    print("largest relative difference to Adam in any one seed: "
          + ", ".join(f"{name} {d:.1%}" for name, d in per_seed.items() if name != "adam"))
    rows = []
    for name in names:
        rel = [abs(mean[name][i] - mean["adam"][i]) / mean["adam"][i] for i in marks]
        rows.append([name] + [f"{mean[name][i]:.3f}" + ("" if name == "adam" else f" ({r:.1%})")
                              for i, r in zip(marks, rel)] + ["—" if name == "adam" else f"{max(rel):.1%}"])
    title = f"optimizer ({plural_seeds(args.seeds)}, batch {args.quality_batch}, lr {args.lr:g})"
    return markdown_table([title] + [f"step {i + 1}" for i in marks] + ["max \\|rel\\|"], rows,
                          right=tuple(range(1, len(marks) + 2)))


def plural_seeds(n):
    return "1 seed" if n == 1 else f"mean of {n} seeds"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--embedding-size", type=int, default=256)
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--repeats", type=int, default=10, help="timed optimizer steps per optimizer")
    p.add_argument("--quality", action="store_true", help="also train each optimizer --steps steps per seed")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--quality-batch", type=int, default=16)
    p.add_argument("--epochs", type=int, default=3, help="passes over the corpus (one pass of the reduced PTB is "
                                                          "144 steps at batch 16)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--skip-bytes", action="store_true")
    p.add_argument("--markdown", action="store_true", help="print the tables in Markdown on stdout, the rest on stderr")
    args = p.parse_args()
    tables = []
    with progress_to_stderr(args.markdown):
        print(f"bench_optim: data {PTB}")
        if not args.skip_bytes:
            tables.append(bytes_and_time(args))
        if args.quality:
            tables.append(quality(args))
    if args.markdown:
        print("\n\n".join(tables))


if __name__ == "__main__":
    main()
