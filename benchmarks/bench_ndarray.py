"""needle's C++ backend vs NumPy (OpenBLAS) on the same machine, same thread count, in one run.

    python benchmarks/bench_ndarray.py              # threads = OMP_NUM_THREADS (default: all cores)
    OMP_NUM_THREADS=1 python benchmarks/bench_ndarray.py
    python benchmarks/bench_ndarray.py --markdown   # the same, as one Markdown table on stdout (figures.py)

Prints matmul GFLOP/s (square 256/512/1024 and the language model's shapes) and element-wise / reduction
throughput (GB/s), each the median of repeated runs after a warm-up, with the ratio needle / NumPy; for matmul
also needle's bfloat16 (bfloat16 out, and float32 out) with the ratio to needle's float32 from the same run; for
checkpoint.compress's kernels (quantize_stochastic, dequantize_linear) the NumPy column is their NumPy reference.
"""
import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
threads = os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count()))
os.environ.setdefault("OPENBLAS_NUM_THREADS", threads)  # before numpy is imported
sys.path.insert(0, os.path.join(ROOT, "python"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402

from md_table import markdown_table, progress_to_stderr  # noqa: E402
from needle import backend_ndarray as nd  # noqa: E402
from needle import backend_numpy  # noqa: E402
from needle.backend_ndarray import array_api  # noqa: E402


def median_time(fn, repeats=7, min_time=0.05):
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        n, start = 0, time.perf_counter()
        while True:
            fn()
            n += 1
            elapsed = time.perf_counter() - start
            if elapsed >= min_time:
                break
        times.append(elapsed / n)
    return statistics.median(times)


def bench_matmul(shapes):
    mod = nd.cpu().mod
    dot = getattr(mod, "matmul_bf16_dot", lambda: False)() and mod.matmul_kernel() == "avx512"
    print(f"matmul ({threads} thread(s)), GFLOP/s — median of 7 after warm-up; ratio: needle / NumPy (float32),")
    print(f"needle / needle float32 of this run (bf16 rows; kernel {mod.matmul_kernel()}, bf16 dot product "
          f"{'on' if dot else 'off'}). bf16: bfloat16 out; bf16 -> f32: float32 out")
    print(f"{'shape':>26s}{'':13s}{'needle':>10s}{'numpy':>10s}{'ratio':>8s}")
    rows = []
    for m, n, p in shapes:
        a, b = np.random.randn(m, n).astype(np.float32), np.random.randn(n, p).astype(np.float32)
        A, B = nd.array(a, device=nd.cpu()), nd.array(b, device=nd.cpu())
        A16, B16 = A.astype("bfloat16"), B.astype("bfloat16")
        out32 = nd.empty((m, p), dtype="float32", device=nd.cpu())
        flops = 2.0 * m * n * p
        t_needle = median_time(lambda: A @ B)
        t_numpy = median_time(lambda: a @ b)
        t_bf16 = median_time(lambda: A16 @ B16)
        t_bf16_f32 = median_time(lambda: mod.matmul(A16.buffer, B16.buffer, out32.buffer, m, n, p))
        fp32 = flops / t_needle / 1e9
        rows.append((m, n, p, fp32, flops / t_numpy / 1e9, t_numpy / t_needle,
                     flops / t_bf16 / 1e9, flops / t_bf16_f32 / 1e9))
        print(f"{f'{m}x{n} @ {n}x{p}':>26s}  {'float32':11s}{fp32:10.1f}{rows[-1][4]:10.1f}{rows[-1][5]:8.2f}")
        for name, gflops in (("bf16", rows[-1][6]), ("bf16 -> f32", rows[-1][7])):
            print(f"{'':26s}  {name:11s}{gflops:10.1f}{'':10s}{gflops / fp32:8.2f}")
    return rows


def bench_elementwise(size=1 << 22):
    print(f"\nelement-wise and reductions on {size:,} float32, GB/s moved — median of 7 after warm-up")
    print(f"{'op':>26s}{'needle':>10s}{'numpy':>10s}{'ratio':>8s}")
    x, y = np.random.rand(size).astype(np.float32) + 0.5, np.random.rand(size).astype(np.float32) + 0.5
    X, Y = nd.array(x, device=nd.cpu()), nd.array(y, device=nd.cpu())
    x2, X2 = x.reshape(1024, -1), X.reshape((1024, size // 1024))
    cases = [
        ("a + b", lambda: X + Y, lambda: x + y, 3),
        ("a * b", lambda: X * Y, lambda: x * y, 3),
        ("a + 1.0", lambda: X + 1.0, lambda: x + np.float32(1.0), 2),
        ("maximum(a, 0)", lambda: X.maximum(0.0), lambda: np.maximum(x, np.float32(0)), 2),
        ("exp(a)", lambda: X.exp(), lambda: np.exp(x), 2),
        ("tanh(a)", lambda: X.tanh(), lambda: np.tanh(x), 2),
        ("sum (rows)", lambda: X2.sum(axis=1), lambda: x2.sum(axis=1), 1),
        ("max (rows)", lambda: X2.max(axis=1), lambda: x2.max(axis=1), 1),
    ]
    # checkpoint.compress's kernels against their NumPy reference: float32 read and codes written, or back
    for bits in (8, 4):
        codes, scales = array_api.quantize_stochastic(X, bits, 64, 1)
        np_codes, np_scales = backend_numpy.quantize_stochastic(x, bits, 64, 1)
        moved = 1 + bits / 32  # arrays of `size` float32 (the scales aside)
        cases += [
            (f"quantize_stochastic {bits} bits", lambda b=bits: array_api.quantize_stochastic(X, b, 64, 1),
             lambda b=bits: backend_numpy.quantize_stochastic(x, b, 64, 1), moved),
            (f"dequantize_linear {bits} bits",
             lambda b=bits, c=codes, s=scales: array_api.dequantize_linear(c, s, X.shape, b, 64),
             lambda b=bits, c=np_codes, s=np_scales: backend_numpy.dequantize_linear(c, s, x.shape, b, 64), moved)]
    rows = []
    for name, f_needle, f_numpy, arrays in cases:
        nbytes = arrays * 4 * size
        t_needle, t_numpy = median_time(f_needle), median_time(f_numpy)
        rows.append((name, nbytes / t_needle / 1e9, nbytes / t_numpy / 1e9, t_numpy / t_needle))
        print(f"{name:>26s}{rows[-1][1]:10.1f}{rows[-1][2]:10.1f}{rows[-1][3]:8.2f}")
    return rows


def markdown(matmul, elementwise):
    """One table: GFLOP/s of every matmul shape (with needle's bfloat16 beside it), GB/s of every element-wise op."""
    rows = [[f"matmul {m}×{n} @ {n}×{p} (GFLOP/s)", f"{ours:.1f}", f"{theirs:.1f}", f"{ratio:.2f}",
             f"{bf16:.1f} ({bf16 / ours:.2f}×)"] for m, n, p, ours, theirs, ratio, bf16, _ in matmul]
    rows += [[f"{name} (GB/s)", f"{ours:.1f}", f"{theirs:.1f}", f"{ratio:.2f}", ""]
             for name, ours, theirs, ratio in elementwise]
    return markdown_table([f"{threads} thread(s)", "needle", "NumPy", "needle / NumPy",
                           "needle bfloat16 (× its float32)"], rows, right=(1, 2, 3, 4))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--markdown", action="store_true", help="print one Markdown table on stdout, the rest on stderr")
    args = p.parse_args()
    if not nd.cpu().enabled():
        raise SystemExit("bench_ndarray: the C++ backend is not built; run `make` first")
    np.random.seed(0)
    with progress_to_stderr(args.markdown):
        matmul = bench_matmul([(256, 256, 256), (512, 512, 512), (1024, 1024, 1024), (4096, 256, 256),
                               (4096, 256, 1024), (4096, 256, 10000)])
        elementwise = bench_elementwise()
    if args.markdown:
        print(markdown(matmul, elementwise))


if __name__ == "__main__":
    main()
