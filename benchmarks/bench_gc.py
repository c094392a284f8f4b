"""Gradient checkpointing on the PTB Transformer LM: memory and time per policy, against the targets.

    python benchmarks/bench_gc.py                  # batch 128, seq_len 32, embedding = hidden = 256, 4 layers
    python benchmarks/bench_gc.py --quick          # a smaller model, for a first look
    python benchmarks/bench_gc.py --head fused --policies off all --skip_budget   # the same with the fused LM head
    python benchmarks/bench_gc.py --head_part      # the LM head + loss's own peak, full vs fused, and exit
    python benchmarks/bench_gc.py --skip_max_batch --markdown   # the policy and Budget tables in Markdown (stdout)

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

from md_table import markdown_table, progress_to_stderr

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


def policy_rows(med, runs):
    """Per policy: M_act, M_peak, M_floor (gc off's: the first gc policy's, in parentheses), T_step, and the changes
    from gc off, as numbers."""
    off = med["off"]
    gc_on = [n for n in med if n != "off"]
    rows = []
    for name, m in med.items():
        act_drop = 1 - m["activation_bytes"] / off["activation_bytes"]
        floor = m["floor_bytes"] if name != "off" else (med[gc_on[0]]["floor_bytes"] if gc_on else 0)
        reachable = (off["activation_bytes"] - floor) / off["activation_bytes"]
        rows.append((name, mb(m["activation_bytes"]), mb(m["peak_activation_bytes"]), mb(floor), m["time"],
                     act_drop * 100, act_drop / reachable * 100,
                     (1 - m["peak_activation_bytes"] / off["peak_activation_bytes"]) * 100,
                     (m["time"] / off["time"] - 1) * 100, runs[name][-1]["recomputed_nodes"]))
    return rows


def print_policies(rows):
    print(f"\n{'policy':>10s}{'M_act MB':>10s}{'M_peak MB':>11s}{'M_floor MB':>12s}{'T_step s':>10s}"
          f"{'M_act -':>9s}{'of floor':>10s}{'M_peak -':>10s}{'overhead':>10s}  recomputed/step")
    for name, act, peak, floor, t, act_drop, of_floor, peak_drop, overhead, recomputed in rows:
        print(f"{name:>10s}{act:10.1f}{peak:11.1f}{floor:12.1f}{t:10.3f}{act_drop:8.1f}%{of_floor:9.1f}%"
              f"{peak_drop:9.1f}%{overhead:+9.1f}%  {recomputed}")


def markdown_policies(rows):
    body = [[name, f"{act:.1f} MB", f"{peak:.1f} MB", f"({floor:.1f} MB)" if name == "off" else f"{floor:.1f} MB",
             f"{t:.3f} s"] + (["", "", "", ""] if name == "off" else
                              [f"{act_drop:.1f}%", f"{of_floor:.1f}%", f"{peak_drop:.1f}%", f"{overhead:+.1f}%"])
            + [recomputed] for name, act, peak, floor, t, act_drop, of_floor, peak_drop, overhead, recomputed in rows]
    return markdown_table(["policy", "M_act", "M_peak", "M_floor", "T_step", "M_act lower", "of what M_floor allows",
                           "M_peak lower", "overhead", "recomputed / step"], body, right=tuple(range(1, 10)))


def budget_rows(model_args, med, out):
    """Budget(b) at three quarters and a quarter of the way from gc "all"'s M_peak (about the least checkpointing
    reaches) to gc off's: (b, measured M_peak, predicted) in bytes; a smaller budget must never give a larger peak;
    and the line gc.py prints for an infeasible budget of 1 MB."""
    print("\nBudget(b): measured M_peak vs b and vs the planner's prediction")
    off = med["off"]["peak_activation_bytes"]
    least = med["all"]["peak_activation_bytes"] if "all" in med else off / 2
    rows = []
    for b in (least + 0.75 * (off - least), least + 0.25 * (off - least)):
        r = gc_run(model_args, True, "budget", extra=["--budget_mb", f"{mb(b):.3f}"], out=out)
        peak, pred = r["peak_activation_bytes"], r["predicted_peak_activation_bytes"]
        rows.append((b, peak, pred))
        print(f"  b = {mb(b):8.1f} MB: measured {mb(peak):8.1f} MB ({peak / b:.3f} b), predicted {mb(pred):8.1f} MB "
              f"({abs(pred / peak - 1) * 100:.1f}% off), T {r['time']:.3f} s")
    print(f"  smaller budget gives no larger peak: {rows[1][1] <= rows[0][1]}")
    try:
        gc_run(model_args, True, "budget", extra=["--budget_mb", "1"], out=out)
        infeasible = "accepted (it should have been refused)"
    except SystemExit as err:
        line = [x for x in str(err).splitlines() if "infeasible" in x]  # gc.py's one line on stderr
        infeasible = line[0].strip() if line else "failed"
    print(f"  Budget(1 MB): {infeasible}")
    return rows


def markdown_budget(rows):
    body = [[f"{mb(b):.1f} MB", f"{mb(peak):.1f} MB", f"{peak / b:.3f}", f"{mb(pred):.1f} MB",
             f"{abs(pred / peak - 1) * 100:.1f}%"] for b, peak, pred in rows]
    return markdown_table(["Budget b", "measured M_peak", "measured / b", "Budget's prediction", "prediction error"],
                          body, right=(0, 1, 2, 3, 4))


def parse_args():
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
    p.add_argument("--markdown", action="store_true",
                   help="print the policy table (and the Budget's) in Markdown on stdout, the rest on stderr")
    args = p.parse_args()
    if "off" not in args.policies:
        p.error("--policies: off is the reference of every ratio; include it")
    return args


def print_head_part(size):
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


def main():
    args = parse_args()
    size = ["--batch_size", "32", "--seq_len", "32", "--embedding_size", "128", "--hidden_size", "128",
            "--num_layers", "2", "--num_head", "4"] if args.quick else \
           ["--batch_size", "128", "--seq_len", "32", "--embedding_size", "256", "--hidden_size", "256",
            "--num_layers", "4", "--num_head", "4"]
    if args.head_part:
        return print_head_part(size)
    model_args = size + ["--max_batches", str(args.max_batches), "--warmup", "1", "--head", args.head]
    out = tempfile.mkdtemp(prefix="bench_gc_")
    with progress_to_stderr(args.markdown):
        print(f"bench_gc: {' '.join(size)}, {args.head} head; data {PTB if os.path.exists(PTB) else 'synthetic'}; "
              f"{args.repeats} repeats, interleaved; results in {out}")
        configs = [(name, use_gc, policy) for name, use_gc, policy in
                   [("off", False, None), ("all", True, None), ("sqrt", True, "sqrt"),
                    ("selective", True, "selective")] if name in args.policies]
        runs = {name: [] for name, _, _ in configs}
        for rep in range(args.repeats):
            for name, use_gc, policy in configs:
                r = gc_run(model_args, use_gc, policy, out=out)
                runs[name].append(r)
                print(f"  rep {rep} {name:>9s}: M_act {mb(r['activation_bytes']):8.1f} MB  M_peak "
                      f"{mb(r['peak_activation_bytes']):8.1f} MB  T {r['time']:.3f} s", flush=True)
        med = {name: {k: statistics.median(r[k] for r in rs) for k in
                      ("activation_bytes", "peak_activation_bytes", "floor_bytes", "time")}
               for name, rs in runs.items()}
        policies = policy_rows(med, runs)
        print_policies(policies)
        budgets = [] if args.skip_budget else budget_rows(model_args, med, out)
        if not args.skip_max_batch:
            cap = mb(med["off"]["peak_activation_bytes"] + runs["off"][0]["steps"][-1]["baseline_bytes"]) * 0.6
            print(f"\nlargest batch that trains under a cap of {cap:.0f} MB (bisection, fresh process per try):")
            cmd = [sys.executable, os.path.join(ROOT, "gc.py"), "max-batch", "--memory_limit_mb", f"{cap:.0f}",
                   "--policies", *[n for n in ("off", "all") if n in args.policies], "--data", PTB, "--out", out,
                   "--head", args.head, *size]
            print(subprocess.run(cmd, capture_output=True, text=True).stdout)
    if args.markdown:
        print(markdown_policies(policies))
        if budgets:
            print("\n" + markdown_budget(budgets))

if __name__ == "__main__":
    main()
