"""Fused attention (ops.scaled_dot_product_attention) against the unfused nn.MultiHeadAttention: memory and time.

    python benchmarks/bench_attention.py              # B8 H4 T1024 D64 causal; then the LM at seq_len 256
    python benchmarks/bench_attention.py --quick      # T256 and a smaller LM batch, for a first look
    OMP_NUM_THREADS=2 python benchmarks/bench_attention.py --repeats 5
    python benchmarks/bench_attention.py --markdown   # the two tables alone on stdout, in Markdown (figures.py)

1. The op alone, float32, causal, on the C++ CPU backend: the allocator's peak over forward + backward beyond what
   both paths must hold at the end (the output and the gradients of q, k and v), as a fraction of one float32
   B·H·T·T tensor (the issue's goal: <= 20%), for the fused op and for MultiHeadAttention (eval mode: no dropout
   mask, its leanest form); then their forward + backward times, interleaved repeats, medians. Forward and
   backward agree within the printed relative error.
2. The Transformer LM (apps/models.py, gc.py's model: embedding = hidden = 256, 4 layers, 4 heads of 64, a
   10000-word vocabulary, the fused LM head, training mode) at seq_len 256 with gc "all", at dropout 0 (the fused
   path is the default there) and 0.1 (fused_attention=True), and with 8 heads of 32: M_act (the
   bytes the allocator holds when backward starts, above those held before the forward pass: gc.py's
   definition) and M_peak with fused vs unfused attention (goal: M_act at least 2x lower), and the step's time
   (forward + backward). M_act's leaves are listed apart: with gc "all" they are most of what is kept (the
   unfused attention's B·H·T·T dropout mask per layer, and each TransformerLayer's three residual/MLP dropout
   masks; a TransformerLayer with fused_attention=True regenerates all of them from seeds and keeps none).
Thread count: OMP_NUM_THREADS (default: all cores), printed with the results.
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
from needle import backend_ndarray as nd  # noqa: E402
from needle import checkpoint, nn  # noqa: E402

from md_table import markdown_table, progress_to_stderr  # noqa: E402
from models import LanguageModel  # noqa: E402

F32 = 4


def mb(x):
    return x / 2**20


def attention_step(device, arrays, fused, causal=True):
    """(peak bytes above the start beyond out + dq + dk + dv, seconds, [out, dq, dk, dv]) of one forward + backward."""
    q, k, v = (ndl.Tensor(a, device=device) for a in arrays[:3])
    dout = ndl.Tensor(arrays[3], device=device, requires_grad=False)
    python_gc.collect()
    nd.reset_peak_memory_stats(device)
    base = nd.memory_stats(device)["current_bytes"]
    t0 = time.perf_counter()
    if fused:
        out = ndl.ops.scaled_dot_product_attention(q, k, v, causal=causal)
    else:
        out, _ = nn.MultiHeadAttention(causal=causal, device=device).eval()(q, k, v)
    out.backward(dout)
    seconds = time.perf_counter() - t0
    held = sum(F32 * int(np.prod(x.shape)) for x in (out, q, k, v))  # out and the three gradients
    peak = nd.memory_stats(device)["peak_bytes"] - base - held
    return peak, seconds, [out.numpy(), q.grad.numpy(), k.grad.numpy(), v.grad.numpy()]


def op_benchmark(args, device):
    B, H, T, D = args.batch, args.heads, args.seq, args.dim
    rs = np.random.RandomState(0)
    arrays = [rs.randn(B, H, T, D).astype(np.float32) for _ in range(4)]
    bhtt = F32 * B * H * T * T
    print(f"\n1. attention alone: B{B} H{H} T{T} D{D} causal, float32; one fp32 B·H·T·T tensor = {mb(bhtt):.1f} MB")
    runs = {True: [], False: []}
    for rep in range(args.repeats):
        for fused in (True, False):
            peak, seconds, values = attention_step(device, arrays, fused)
            runs[fused].append((peak, seconds, values))
            print(f"  rep {rep} {'fused  ' if fused else 'unfused'}: peak beyond out+grads {mb(peak):8.1f} MB  "
                  f"fwd+bwd {seconds:.3f} s", flush=True)
    fused_values, unfused_values = runs[True][-1][2], runs[False][-1][2]
    errors = [float(np.max(np.abs(a - b)) / np.max(np.abs(b))) for a, b in zip(fused_values, unfused_values)]
    peak_f, peak_u = (max(r[0] for r in runs[f]) for f in (True, False))
    time_f, time_u = (statistics.median(r[1] for r in runs[f]) for f in (True, False))
    print(f"  fused:   peak {mb(peak_f):8.1f} MB = {peak_f / bhtt * 100:5.1f}% of B·H·T·T (goal <= 20%: "
          f"{'met' if peak_f <= 0.2 * bhtt else 'MISSED'}), fwd+bwd median {time_f:.3f} s")
    print(f"  unfused: peak {mb(peak_u):8.1f} MB = {peak_u / bhtt * 100:5.1f}% of B·H·T·T, fwd+bwd median "
          f"{time_u:.3f} s")
    print(f"  time fused / unfused: {time_f / time_u:.2f}x (goal <= 1: {'met' if time_f <= time_u else 'MISSED'}); "
          f"max relative difference (out, dq, dk, dv): {', '.join(f'{e:.1e}' for e in errors)}")
    return markdown_table([f"B{B}·H{H}·T{T}·D{D}, causal, float32", "fused", "unfused (`MultiHeadAttention`, eval)"], [
        ["allocator peak over forward + backward beyond out, dq, dk, dv",
         f"{mb(peak_f):.1f} MB = {peak_f / bhtt * 100:.1f}% of one fp32 B·H·T·T tensor ({mb(bhtt):.0f} MB)",
         f"{mb(peak_u):.1f} MB = {peak_u / bhtt * 100:.0f}%"],
        [f"forward + backward, median of {args.repeats}", f"{time_f:.3f} s", f"{time_u:.3f} s"],
        ["largest relative difference (out, dq, dk, dv)", ", ".join(f"{e:.1e}" for e in errors), ""]])


def lm_step(args, device, fused, dropout, heads):
    """(M_act, M_peak, seconds, loss, leaf bytes) of one LM training step (forward + backward) with gc "all"."""
    np.random.seed(0)
    model = LanguageModel(args.embedding, args.vocab, args.embedding, num_layers=args.layers, seq_model="transformer",
                          seq_len=args.lm_seq, device=device, num_head=heads, dim_head=args.embedding // heads,
                          dropout=dropout)
    for layer in model.seq_model.layers:
        layer.fused_attention = fused  # True: the layer's dropouts regenerate their masks too (nothing kept)
    model.enable_gc()
    model.parameters()
    rs = np.random.RandomState(1)
    X = ndl.Tensor(rs.randint(0, args.vocab, (args.lm_seq, args.lm_batch)).astype(np.float32), device=device,
                   requires_grad=False)
    y = ndl.Tensor(rs.randint(0, args.vocab, args.lm_seq * args.lm_batch).astype(np.float32), device=device,
                   requires_grad=False)
    python_gc.collect()
    nd.reset_peak_memory_stats(device)
    base = nd.memory_stats(device)["current_bytes"]  # parameters and the batch
    t0 = time.perf_counter()
    loss, _ = model.loss(X, y)
    act = nd.memory_stats(device)["current_bytes"] - base
    # M_act's leaves: the dropout masks (drawn even at p = 0) and constants such as the causal mask
    leaves = sum(nbytes for _, reason, nbytes in checkpoint.saved_residuals(loss, exclude=model.parameters() + [X, y])
                 if reason == "leaf")
    loss.backward()
    seconds = time.perf_counter() - t0
    peak = nd.memory_stats(device)["peak_bytes"] - base
    return act, peak, seconds, float(loss.numpy()), leaves


def lm_benchmark(args, device):
    print(f"\n2. LM, gc 'all': batch {args.lm_batch} x seq_len {args.lm_seq}, E = H = {args.embedding}, "
          f"{args.layers} layers, vocabulary {args.vocab}, fused LM head, training mode")
    rows = []
    for dropout, heads in args.lm_configs:
        print(f"  dropout {dropout}, {heads} heads of {args.embedding // heads} (fused: fused_attention=True; "
              "unfused: False)")
        runs = {True: [], False: []}
        for rep in range(args.lm_repeats):
            for fused in (True, False):
                r = lm_step(args, device, fused, dropout, heads)
                runs[fused].append(r)
                print(f"    rep {rep} {'fused  ' if fused else 'unfused'}: M_act {mb(r[0]):7.1f} MB (leaves "
                      f"{mb(r[4]):6.1f} MB)  M_peak {mb(r[1]):7.1f} MB  step {r[2]:.3f} s  loss {r[3]:.6f}",
                      flush=True)
        act_f, act_u = (runs[f][-1][0] for f in (True, False))
        peak_f, peak_u = (runs[f][-1][1] for f in (True, False))
        time_f, time_u = (statistics.median(r[2] for r in runs[f]) for f in (True, False))
        print(f"    M_act unfused / fused: {act_u / act_f:.2f}x (goal >= 2: "
              f"{'met' if act_u >= 2 * act_f else 'MISSED'}); M_peak unfused / fused: {peak_u / peak_f:.2f}x; "
              f"step time fused / unfused: {time_f / time_u:.2f}x")
        rows.append([f"{heads} heads of {args.embedding // heads}, dropout {dropout:g}",
                     f"{mb(act_u):.1f} / {mb(act_f):.1f} MB: {act_u / act_f:.2f}×",
                     f"{mb(peak_u):.1f} / {mb(peak_f):.1f} MB: {peak_u / peak_f:.2f}×",
                     f"{time_f:.2f} / {time_u:.2f} s: {time_f / time_u:.2f}×"])
    return markdown_table([f"LM, seq_len {args.lm_seq}, batch {args.lm_batch}, E = H = {args.embedding}, "
                           f"{args.layers} layers, gc \"all\"", "M_act unfused / fused", "M_peak unfused / fused",
                           "step (fwd + bwd) fused / unfused"], rows)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="T 256 and an LM batch of 4")
    p.add_argument("--repeats", type=int, default=3, help="interleaved repeats of the op benchmark")
    p.add_argument("--lm_repeats", type=int, default=2)
    p.add_argument("--skip_lm", action="store_true")
    p.add_argument("--skip_op", action="store_true")
    p.add_argument("--lm_batch", type=int, default=16)
    p.add_argument("--lm_configs", nargs="+", default=["0:4", "0.1:4", "0:8"], metavar="DROPOUT:HEADS",
                   help="the LM's attention dropout and number of heads (of E / heads each), one run per pair")
    p.add_argument("--markdown", action="store_true", help="print the tables in Markdown on stdout, the rest on stderr")
    args = p.parse_args()
    args.lm_configs = [(float(c.split(":")[0]), int(c.split(":")[1])) for c in args.lm_configs]
    args.batch, args.heads, args.seq, args.dim = 8, 4, (256 if args.quick else 1024), 64
    args.embedding, args.layers, args.vocab, args.lm_seq = 256, 4, 10000, 256
    if args.quick:
        args.lm_batch = 4
    device = ndl.cpu()
    if not device.enabled():
        raise SystemExit("bench_attention: the C++ backend is not built (run `make`)")
    tables = []
    with progress_to_stderr(args.markdown):
        print(f"bench_attention: C++ CPU backend, {device.num_threads()} threads (OMP_NUM_THREADS="
              f"{os.environ.get('OMP_NUM_THREADS', 'unset')})")
        if not args.skip_op:
            tables.append(op_benchmark(args, device))
        if not args.skip_lm:
            tables.append(lm_benchmark(args, device))
    if args.markdown:
        print("\n\n".join(tables))


if __name__ == "__main__":
    main()
