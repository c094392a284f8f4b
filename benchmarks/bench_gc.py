"""Gradient checkpointing on the PTB Transformer LM: memory and time per policy, against the targets.

    python benchmarks/bench_gc.py                  # batch 128, seq_len 32, embedding = hidden = 256, 4 layers
    python benchmarks/bench_gc.py --quick          # a smaller model, for a first look
    python benchmarks/bench_gc.py --head fused --policies off all --skip_budget   # the same with the fused LM head
    python benchmarks/bench_gc.py --head_part      # the LM head + loss's own peak, full vs fused, and exit

Each configuration runs `gc.py` in a fresh process; the policies are interleaved and repeated, and the table
shows medians over the repeats. M_act, M_peak and M_floor are exact allocator byte counts (see gc.py). `--head`
is gc.py's: full (this benchmark's default, the course's SoftmaxLoss(model(x)) that docs/experiment.md's
checkpointing tables were measured with) or fused (model.loss(x, y), gc.py's default).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PTB = next((p for p in (os.path.join(ROOT, "data", "ptb"), os.path.join(ROOT, "..", "shared", "data", "ptb"))
            if os.path.exists(os.path.join(p, "train.txt"))), "synthetic")  # gc.py --data synthetic: no PTB here


def gc_run(model_args, use_gc, policy=None, extra=(), out=None):
    cmd = [sys.executable, os.path.join(ROOT, "gc.py"), "--use_gc", str(int(use_gc)), "--out", out, "--data", PTB,
           *model_args, *extra]
    if policy:
        cmd += ["--policy", policy]
    before = set(os.listdir(out))
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"bench_gc: {' '.join(cmd)} failed:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    (name,) = [f for f in set(os.listdir(out)) - before if f.endswith(".json")]
    with open(os.path.join(out, name)) as f:
        return json.load(f)


def mb(x):
    return x / 2**20


def head_part(head, tokens, hidden, vocab, chunk_size=None, seed=0):
    """The LM head + loss's own share of a step's peak: the allocator's peak over the head's forward and backward
    (down to the gradients of its input, weight and bias) minus the bytes held when it starts, in this process;
    (peak bytes, loss, seconds)."""
    import time

    sys.path.insert(0, os.path.join(ROOT, "python"))
    import numpy as np

    import needle as ndl
    from needle import backend_ndarray as nd

    device = ndl.cpu()
    rs = np.random.RandomState(seed)
    h = ndl.Tensor(rs.randn(tokens, hidden).astype("float32"), device=device, requires_grad=True)
    w = ndl.Tensor((rs.randn(hidden, vocab) * 0.01).astype("float32"), device=device, requires_grad=True)
    b = ndl.Tensor(np.zeros(vocab, dtype="float32"), device=device, requires_grad=True)
    y = ndl.Tensor(rs.randint(0, vocab, size=tokens).astype("float32"), device=device, requires_grad=False)
    before = nd.memory_stats(device)["current_bytes"]
    nd.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    if head == "fused":
        loss = ndl.ops.linear_cross_entropy(h, w, b, y, chunk_size=chunk_size)
    else:
        logits = h @ w + ndl.ops.broadcast_to(ndl.ops.reshape(b, (1, vocab)), (tokens, vocab))
        loss = ndl.nn.SoftmaxLoss()(logits, y)
        del logits
    loss.backward()
    seconds = time.perf_counter() - t0
    peak = nd.memory_stats(device)["peak_bytes"] - before
    return peak, float(loss.numpy()), seconds


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--max_batches", type=int, default=6)
    p.add_argument("--skip_max_batch", action="store_true")
    p.add_argument("--skip_budget", action="store_true")
    p.add_argument("--head", choices=["full", "fused"], default="full",
                   help="gc.py's --head: full (default here: the course's head, as docs/experiment.md's tables) "
                        "or fused")
    p.add_argument("--policies", nargs="+", choices=["off", "all", "sqrt", "selective"],
                   default=["off", "all", "sqrt", "selective"], help="the policies of the table (off is needed)")
    p.add_argument("--head_part", action="store_true",
                   help="measure the LM head + loss's own peak, full vs fused, at this model's size, and exit")
    args = p.parse_args()
    size = ["--batch_size", "32", "--seq_len", "32", "--embedding_size", "128", "--hidden_size", "128",
            "--num_layers", "2", "--num_head", "4"] if args.quick else \
           ["--batch_size", "128", "--seq_len", "32", "--embedding_size", "256", "--hidden_size", "256",
            "--num_layers", "4", "--num_head", "4"]
    if args.head_part:
        tokens, hidden = int(size[1]) * int(size[3]), int(size[5])
        vocab = 10000  # gc.py's synthetic corpus has PTB's vocabulary; a PTB folder, the words it holds
        if PTB != "synthetic":
            sys.path.insert(0, os.path.join(ROOT, "python"))
            from needle.data import Corpus

            vocab = len(Corpus(PTB).dictionary)
        print(f"bench_gc: the LM head + loss alone, {tokens} tokens x hidden {hidden} x vocabulary {vocab}")
        full = head_part("full", tokens, hidden, vocab)
        print(f"  full head: peak {mb(full[0]):7.1f} MB over its forward + backward, {full[2]:.3f} s "
              f"(loss {full[1]:.6f})")
        for chunk in (None, 256, 128):  # None: the op's default, logits of 2**20 elements (4 MiB) per chunk
            peak, loss, seconds = head_part("fused", tokens, hidden, vocab, chunk)
            rows = f"{chunk} rows" if chunk else "default"
            print(f"  fused head, chunk {rows:>8s}: peak {mb(peak):7.1f} MB ({(1 - peak / full[0]) * 100:.1f}% lower), "
                  f"{seconds:.3f} s (loss {loss:.6f})")
        return
    model_args = size + ["--max_batches", str(args.max_batches), "--warmup", "1", "--head", args.head]
    out = tempfile.mkdtemp(prefix="bench_gc_")
    print(f"bench_gc: {' '.join(size)}, {args.head} head; data {PTB if os.path.exists(PTB) else 'synthetic'}; "
          f"{args.repeats} repeats, interleaved; results in {out}")
    configs = [(name, use_gc, policy) for name, use_gc, policy in
               [("off", False, None), ("all", True, None), ("sqrt", True, "sqrt"), ("selective", True, "selective")]
               if name in args.policies]
    if "off" not in args.policies:
        p.error("--policies: off is the reference of every ratio; include it")
    runs = {name: [] for name, _, _ in configs}
    for rep in range(args.repeats):
        for name, use_gc, policy in configs:
            r = gc_run(model_args, use_gc, policy, out=out)
            runs[name].append(r)
            print(f"  rep {rep} {name:>9s}: M_act {mb(r['activation_bytes']):8.1f} MB  M_peak "
                  f"{mb(r['peak_activation_bytes']):8.1f} MB  T {r['time']:.3f} s", flush=True)

    med = {name: {k: statistics.median(r[k] for r in rs) for k in
                  ("activation_bytes", "peak_activation_bytes", "floor_bytes", "time")} for name, rs in runs.items()}
    off = med["off"]
    print(f"\n{'policy':>10s}{'M_act MB':>10s}{'M_peak MB':>11s}{'M_floor MB':>12s}{'T_step s':>10s}"
          f"{'M_act -':>9s}{'of floor':>10s}{'M_peak -':>10s}{'overhead':>10s}  recomputed/step")
    for name, m in med.items():
        act_drop = 1 - m["activation_bytes"] / off["activation_bytes"]
        gc_on = [n for n in med if n != "off"]
        floor = med[name]["floor_bytes"] if name != "off" else (med[gc_on[0]]["floor_bytes"] if gc_on else 0)
        reachable = (off["activation_bytes"] - floor) / off["activation_bytes"]
        print(f"{name:>10s}{mb(m['activation_bytes']):10.1f}{mb(m['peak_activation_bytes']):11.1f}"
              f"{mb(floor):12.1f}{m['time']:10.3f}{act_drop * 100:8.1f}%{act_drop / reachable * 100:9.1f}%"
              f"{(1 - m['peak_activation_bytes'] / off['peak_activation_bytes']) * 100:9.1f}%"
              f"{(m['time'] / off['time'] - 1) * 100:+9.1f}%  {runs[name][-1]['recomputed_nodes']}")

    if args.skip_budget:
        budgets = []
    else:
        # Budget: two budgets between the floor and gc off's peak; a smaller one must never give a larger peak.
        budgets = [0.7 * off["peak_activation_bytes"], 0.45 * off["peak_activation_bytes"]]
    if budgets:
        print("\nBudget(b): measured M_peak vs b and vs the planner's prediction")
        peaks = []
        for b in budgets:
            r = gc_run(model_args, True, "budget", extra=["--budget_mb", f"{mb(b):.3f}"], out=out)
            peaks.append(r["peak_activation_bytes"])
            pred = r["predicted_peak_activation_bytes"]
            print(f"  b = {mb(b):8.1f} MB: measured {mb(r['peak_activation_bytes']):8.1f} MB "
                  f"({r['peak_activation_bytes'] / b:.3f} b), predicted {mb(pred):8.1f} MB "
                  f"({abs(pred / r['peak_activation_bytes'] - 1) * 100:.1f}% off), T {r['time']:.3f} s")
        print(f"  smaller budget gives no larger peak: {peaks[1] <= peaks[0]}")
        try:
            gc_run(model_args, True, "budget", extra=["--budget_mb", "1"], out=out)
        except SystemExit as err:
            line = [x for x in str(err).splitlines() if "infeasible" in x]  # gc.py's one line on stderr
            print(f"  Budget(1 MB): {line[0].strip() if line else 'failed'}")

    if not args.skip_max_batch:
        cap = mb(off["peak_activation_bytes"] + runs["off"][0]["steps"][-1]["baseline_bytes"]) * 0.6
        print(f"\nlargest batch that trains under a cap of {cap:.0f} MB (bisection, fresh process per try):")
        cmd = [sys.executable, os.path.join(ROOT, "gc.py"), "max-batch", "--memory_limit_mb", f"{cap:.0f}",
               "--policies", *[n for n in ("off", "all") if n in args.policies], "--data", PTB, "--out", out,
               "--head", args.head, *size]
        print(subprocess.run(cmd, capture_output=True, text=True).stdout)


if __name__ == "__main__":
    main()
