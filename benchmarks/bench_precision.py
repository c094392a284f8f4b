"""Precision on the PTB Transformer LM: memory, quality and the PyTorch autocast reference.

    python benchmarks/bench_precision.py                 # memory: batch 128, seq 32, E = H = 256, 4 layers
    python benchmarks/bench_precision.py --quality       # + 300 Adam steps per precision (smaller batch)
    python benchmarks/bench_precision.py --quick          # a smaller model, for a first look
    python benchmarks/bench_precision.py --markdown       # the tables alone on stdout, in Markdown (figures.py)

Memory: each (precision, gc off / gc all) runs `gc.py run` in a fresh process; M_act (values held when backward
starts), M_peak (forward + backward) are the allocator's exact byte counts, and the parameters' and the
optimizer's bytes are listed apart (mixed precision keeps float32 weights and adds 16-bit copies of them during the
step; pure bf16 halves both). PyTorch's reference is the same model under `torch.autocast("cpu", torch.bfloat16)`:
its M_act is the bytes of the tensors autograd saves for backward (unique storages, via saved_tensors_hooks),
the closest CPU equivalent of needle's count.

Quality: the training loss of each precision over --steps Adam steps on the same batches from the same
initialization, compared with float32's at every 50th step (relative difference).
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

from md_table import markdown_table, progress_to_stderr

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PTB = next((p for p in (os.path.join(ROOT, "data", "ptb"), os.path.join(ROOT, "..", "shared", "data", "ptb"))
            if os.path.exists(os.path.join(p, "train.txt"))), "synthetic")
PRECISIONS = ["fp32", "mixed-bf16", "mixed-fp16", "bf16"]


def gc_run(model_args, precision, use_gc, out, extra=()):
    path = os.path.join(out, f"{precision}_{use_gc}_{len(os.listdir(out))}.json")
    cmd = [sys.executable, os.path.join(ROOT, "gc.py"), "run", "--policy", "all" if use_gc else "off",
           "--use-gc", str(int(use_gc)), "--precision", precision, "--json", path, "--data", PTB, "--no-progress",
           *model_args, *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"bench_precision: {' '.join(cmd)} failed:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    with open(path) as f:
        return json.load(f)


def mb(x):
    return f"{x / 2**20:9.1f}"


def memory_table(args, model_args, out):
    rows = {}
    for precision in PRECISIONS:
        for use_gc in (False, True):
            r = gc_run(model_args, precision, use_gc, out, ["--max-batches", str(args.batches), "--warmup", "1"])
            last = r["steps"][-1]
            rows[precision, use_gc] = {"act": r["activation_bytes"], "peak": r["peak_activation_bytes"],
                                       "params": last["param_bytes"], "opt": last["optimizer_bytes"],
                                       "time": r["step_time_seconds"], "loss": r["loss"]}
    print(f"\nmemory, batch {args.batch_size} x seq_len {args.seq_len}, E = H = {args.embedding_size}, "
          f"{args.num_layers} layers, head {args.head} (MB; x = ratio to fp32 in the same gc setting)")
    print(f"{'precision':12s}{'gc':>5s}{'M_act':>10s}{'x':>7s}{'M_peak':>10s}{'x':>7s}{'params':>10s}"
          f"{'optimizer':>11s}{'T_step s':>10s}{'x':>7s}")
    for (precision, use_gc), r in rows.items():
        base = rows["fp32", use_gc]
        print(f"{precision:12s}{'all' if use_gc else 'off':>5s}{mb(r['act'])}{r['act'] / base['act']:7.2f}"
              f"{mb(r['peak'])}{r['peak'] / base['peak']:7.2f}{mb(r['params'])}{mb(r['opt']):>11s}"
              f"{r['time']:10.3f}{r['time'] / base['time']:7.2f}")
    return markdown_table(
        [f"batch {args.batch_size}, seq {args.seq_len}, E = H = {args.embedding_size}, {args.num_layers} layers, "
         f"{args.head} head", "gc", "M_act MB", "× fp32", "M_peak MB", "× fp32", "params MB", "Adam state MB",
         "T_step", "× fp32"],
        [memory_row(precision, use_gc, r, rows["fp32", use_gc]) for (precision, use_gc), r in rows.items()],
        right=tuple(range(2, 10)))


def memory_row(precision, use_gc, r, fp32):
    return [precision, "all" if use_gc else "off", f"{r['act'] / 2**20:.1f}", f"{r['act'] / fp32['act']:.2f}",
            f"{r['peak'] / 2**20:.1f}", f"{r['peak'] / fp32['peak']:.2f}", f"{r['params'] / 2**20:.1f}",
            f"{r['opt'] / 2**20:.1f}", f"{r['time']:.3f} s", f"{r['time'] / fp32['time']:.2f}"]


def torch_reference(args):
    """M_act (saved tensors' bytes) and step time of the same model in PyTorch, fp32 and bf16 autocast."""
    try:
        import torch
    except ImportError:
        print("\nPyTorch reference left out (pip install torch==2.13.0)")
        return
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import time

    from bench_step import torch_step_fn  # the same architecture as needle's LanguageModel

    ns = argparse.Namespace(batch_size=args.batch_size, seq_len=args.seq_len, embedding_size=args.embedding_size,
                            hidden_size=args.embedding_size, num_layers=args.num_layers, num_head=4, vocab=10000)
    print("\nPyTorch reference (same architecture; M_act = bytes autograd saves for backward)")
    for label, autocast in (("fp32", False), ("autocast bf16", True)):
        model, step = torch_step_fn(ns, autocast=autocast, return_model=True)
        saved = {}

        def pack(t):
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            step()
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
        params = sum(p.numel() * p.element_size() for p in model.parameters())
        saved_bytes = sum(saved.values()) - params  # weights saved by matmuls are not activations
        print(f"  {label:14s} M_act {mb(max(saved_bytes, 0))} MB   T_step {sorted(times)[1]:.3f} s")


def quality(args, out):
    model_args = ["--batch-size", str(args.quality_batch), "--seq-len", str(args.seq_len), "--embedding-size",
                  str(args.embedding_size), "--hidden-size", str(args.embedding_size), "--num-layers",
                  str(args.num_layers), "--head", args.head]
    curves = {}
    # mixed-fp16 twice: GradScaler at PyTorch's initial scale 2^16, whose overflowing first steps are skipped
    # (their batches are not trained on in the first pass over the corpus), and at 2^13, where none is.
    for name, precision, extra in (("fp32", "fp32", []), ("mixed-bf16", "mixed-bf16", []),
                                   ("mixed-fp16", "mixed-fp16", []),
                                   ("mixed-fp16 2^13", "mixed-fp16", ["--init-scale", "8192"]),
                                   ("bf16", "bf16", []), ("bf16 +SR", "bf16", ["--stochastic-rounding"])):
        # Enough epochs of the (reduced) corpus for --steps steps; only the first --steps are compared.
        r = gc_run(model_args, precision, False, out, ["--max-batches", str(args.steps), "--epochs",
                                                          str(args.epochs), "--warmup", "0", *extra])
        curves[name] = [s["loss"] for s in r["steps"]][:args.steps]
    steps = min(len(c) for c in curves.values())
    marks = list(range(49, steps, 50))
    print(f"\nquality: training loss over {args.steps} Adam steps (batch {args.quality_batch}), at every 50th step; "
          "in brackets the relative difference to fp32")
    print(f"{'precision':14s}" + "".join(f"{'step ' + str(i + 1):>17s}" for i in marks) + f"{'max |rel|':>11s}")
    for name, curve in curves.items():
        rel = [abs(curve[i] - curves["fp32"][i]) / curves["fp32"][i] for i in marks]
        print(f"{name:14s}" + "".join(f"{curve[i]:9.3f} ({r:5.1%})" for i, r in zip(marks, rel))
              + f"{max(rel):10.1%}")
    rows = []
    for name, curve in curves.items():
        rel = [abs(curve[i] - curves["fp32"][i]) / curves["fp32"][i] for i in marks]
        values = [f"{curve[i]:.3f}" + ("" if name == "fp32" else f" ({r:.1%})") for i, r in zip(marks, rel)]
        rows.append([QUALITY_NAMES[name]] + values + ["—" if name == "fp32" else f"{max(rel):.1%}"])
    return markdown_table([f"precision (batch {args.quality_batch})"] + [f"step {i + 1}" for i in marks]
                          + ["max \\|rel\\|"], rows, right=tuple(range(1, len(marks) + 2)))


QUALITY_NAMES = {"fp32": "fp32", "mixed-bf16": "mixed-bf16", "mixed-fp16": "mixed-fp16 + GradScaler",
                 "mixed-fp16 2^13": "mixed-fp16, GradScaler(init_scale=2**13)", "bf16": "bf16, round to nearest",
                 "bf16 +SR": "bf16 + stochastic rounding"}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--embedding-size", type=int, default=256)
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--head", default="full", choices=["full", "fused"])
    p.add_argument("--batches", type=int, default=3, help="steps per memory run (the first is warm-up)")
    p.add_argument("--quality", action="store_true", help="also train each precision for --steps steps")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--quality-batch", type=int, default=16)
    p.add_argument("--epochs", type=int, default=3, help="quality runs: passes over the corpus (PTB's reduced "
                   "training text gives 144 steps of batch 16 x 32 tokens per pass)")
    p.add_argument("--skip-memory", action="store_true")
    p.add_argument("--quick", action="store_true", help="batch 16, 2 layers")
    p.add_argument("--markdown", action="store_true", help="print the tables in Markdown on stdout, the rest on stderr")
    args = p.parse_args()
    if args.quick:
        args.batch_size, args.num_layers = 16, 2
    model_args = ["--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len), "--embedding-size",
                  str(args.embedding_size), "--hidden-size", str(args.embedding_size), "--num-layers",
                  str(args.num_layers), "--head", args.head]
    tables = []
    with tempfile.TemporaryDirectory() as out, progress_to_stderr(args.markdown):
        print(f"bench_precision: data {PTB}")
        if not args.skip_memory:
            tables.append(memory_table(args, model_args, out))
            torch_reference(args)
        if args.quality:
            tables.append(quality(args, out))
    if args.markdown:
        print("\n\n".join(tables))


if __name__ == "__main__":
    main()
