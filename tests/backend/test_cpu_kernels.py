"""The C++ CPU backend's own kernels, called directly (raw `Array`s, no NDArray): the AVX512-BF16 dot-product matmul
and the block-wise 8-bit quantization.

1. bfloat16 matmul through VDPBF16PS (`set_matmul_bf16_dot`) against a float64 NumPy product of the same bfloat16
   inputs, and against the widening kernel, over shapes that hit every edge of its packing (odd k, k = 1, m and n
   not multiples of the 12 x 32 tile, k across a 512-deep block), batched, float32 and bfloat16 out.
2. `quantize_blockwise` / `dequantize_blockwise` against a small NumPy implementation of src/README.md's rows,
   byte for byte, and their error cases.
3. the float16 conversions (integer code, not the compiler's library calls) against NumPy's, bit for bit.
4. sizes whose products overflow 64 bits (matmul, the reductions, layer norm, attention, ...): a ValueError.

Skipped (with the reason) where the C++ module is not built; part 1 also where the CPU has no AVX512-BF16.
"""
import contextlib
import subprocess
import sys
import textwrap

import ml_dtypes
import numpy as np
import pytest

from needle import backend_ndarray as nd

CPU = nd.cpu()
pytestmark = pytest.mark.skipif(not CPU.enabled(), reason="C++ backend not built (run `make`)")
BF16 = np.dtype(ml_dtypes.bfloat16)
U = 2.0**-24  # unit roundoff of float32


def array(values, dtype):
    """A raw backend Array holding `values` (a numpy array of the storage dtype; bfloat16 goes in as its bits)."""
    values = np.ascontiguousarray(values)
    out = CPU.mod.Array(values.size, dtype)
    CPU.mod.from_numpy((values.view(np.uint16) if dtype == "bfloat16" else values).reshape(-1), out)
    return out


def read(arr, dtype=None):
    """The elements of a raw Array as a flat numpy array (bfloat16 viewed as ml_dtypes.bfloat16)."""
    values = CPU.mod.to_numpy(arr, [arr.size], [1], 0)
    return values.view(BF16) if arr.dtype == "bfloat16" else values


# ===== 1. the bfloat16 dot-product matmul ===========================================================================
@contextlib.contextmanager
def bf16_matmul_path(dot):
    """Run bfloat16 matmuls on the dot-product path (dot=True: the avx512 kernel with VDPBF16PS) or on the widening
    path (dot=False: the kernel chosen at import, bfloat16 widened while packing); the module's settings are
    restored after.  Skips the test where the CPU or the build has no dot-product path."""
    mod = CPU.mod
    if not hasattr(mod, "set_matmul_bf16_dot"):
        pytest.skip("this build of the C++ backend has no bfloat16 dot-product kernel")
    kernel, was_on = mod.matmul_kernel(), mod.matmul_bf16_dot()
    try:
        if dot:
            mod.set_matmul_kernel("avx512")
        mod.set_matmul_bf16_dot(dot)
    except ValueError as e:
        mod.set_matmul_kernel(kernel)
        pytest.skip(f"this CPU cannot run the bfloat16 dot-product kernel: {e}")
    try:
        assert mod.matmul_bf16_dot() is dot
        yield
    finally:
        mod.set_matmul_kernel(kernel)
        mod.set_matmul_bf16_dot(was_on)


@pytest.fixture(params=[True, False], ids=["dot", "widen"])
def bf16_dot(request):
    """Each test once on the dot-product path and once on the widening path."""
    with bf16_matmul_path(request.param):
        yield request.param


def bf16_operands(rng, *shape_pairs):
    return [rng.standard_normal(shape).astype(np.float32).astype(BF16) for shape in shape_pairs]


def backend_matmul(a, b, out_dtype):
    """a @ b by the C++ module for bfloat16 (..., m, n) @ (..., n, p): `matmul` for 2-D, else `matmul_batched`."""
    *batch, m, n = a.shape
    p = b.shape[-1]
    out = CPU.mod.Array(a.size // n * p, out_dtype)
    if batch:
        CPU.mod.matmul_batched(array(a, "bfloat16"), array(b, "bfloat16"), out, batch[0], m, n, p)
    else:
        CPU.mod.matmul(array(a, "bfloat16"), array(b, "bfloat16"), out, m, n, p)
    return read(out).astype(np.float64).reshape(*batch, m, p)


def check_against_float64(got, a, b, out_dtype):
    """`got` is a float32-accumulated a @ b (rounded to out_dtype): within the float32 accumulation bound of the
    exact product.

    Why this tolerance: each product of two bfloat16 values is exact in float32, so the only errors are the float32
    additions.  Every element sums n products through at most n additions into its accumulator plus one per 512- (or
    256-) deep block added into C, t <= n + n // 256 + 1 roundings in any order, and Higham's bound for a sum
    computed with t roundings is |error| <= t·u/(1 - t·u) · Σ_k |a_ik b_kj| (u = 2^-24).  This holds for the widening
    kernel's order and for VDPBF16PS's (which adds a pair's upper product first) alike, so it is the tolerance of
    both, with 1% slack for the 1/(1 - t·u).  A bfloat16 out adds one rounding to nearest: 2^-8 of the value.
    """
    exact = np.matmul(a.astype(np.float64), b.astype(np.float64))
    n = a.shape[-1]
    t = n + n // 256 + 1
    bound = 1.01 * t * U * np.matmul(np.abs(a.astype(np.float64)), np.abs(b.astype(np.float64)))
    if out_dtype == "bfloat16":
        bound = bound + 2.0**-8 * (np.abs(exact) + bound)
    assert got.shape == exact.shape
    excess = np.abs(got - exact) - bound
    assert excess.max(initial=-1.0) <= 0, f"worst element exceeds the bound by {excess.max()}"


# (m, n, p): k = n is odd, 1, 2, even; m and p are below, at and beyond the 12 x 32 tile; n crosses KC = 512.
MATMUL_SHAPES = [(1, 1, 1), (1, 7, 1), (3, 1, 5), (12, 1, 32), (5, 2, 3), (13, 3, 33), (12, 32, 32), (11, 33, 31),
                 (25, 64, 65), (24, 511, 64), (37, 513, 47), (7, 1024, 9), (50, 1025, 70), (97, 130, 1)]


@pytest.mark.parametrize("out_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("shape", MATMUL_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_bf16_matmul_vs_float64(bf16_dot, shape, out_dtype):
    """Both bfloat16 paths are within the float32-accumulation bound of the exact product of the bfloat16 inputs."""
    m, n, p = shape
    a, b = bf16_operands(np.random.default_rng(m * 10007 + n * 101 + p), (m, n), (n, p))
    check_against_float64(backend_matmul(a, b, out_dtype), a, b, out_dtype)


@pytest.mark.parametrize("shape", [(3, 7, 9, 5), (6, 12, 33, 40), (2, 300, 300, 200)],
                         ids=["small", "spread", "one_by_one"])
def test_bf16_matmul_batched(bf16_dot, shape):
    """matmul_batched on both paths: many small products spread over threads, and big ones one after another."""
    batch, m, n, p = shape
    a, b = bf16_operands(np.random.default_rng(batch + m), (batch, m, n), (batch, n, p))
    got = backend_matmul(a, b, "float32")
    check_against_float64(got, a, b, "float32")
    for i in (0, batch - 1):  # a batch gives exactly what a loop of matmuls gives
        np.testing.assert_array_equal(got[i], backend_matmul(a[i], b[i], "float32"))


@pytest.mark.parametrize("n", [1, 2])
def test_bf16_matmul_exact_for_one_and_two_terms(bf16_dot, n):
    """With k <= 2 a result has at most one rounding (a bfloat16 product is exact in float32, and 0 + the first
    product is exact), so both paths give the correctly rounded float32 of the exact sum, bit for bit."""
    a, b = bf16_operands(np.random.default_rng(n), (30, n), (n, 40))
    exact = np.matmul(a.astype(np.float64), b.astype(np.float64)).astype(np.float32)
    np.testing.assert_array_equal(backend_matmul(a, b, "float32"), exact)


@pytest.mark.parametrize("n", [1, 2, 37, 512, 513, 1000])
def test_bf16_out_is_the_rounded_float32_out(n):
    """On the dot-product path a bfloat16 out is exactly the float32 out rounded to nearest, ties to even (rounded in
    the kernel's registers for n <= 512, by the Accumulator's pass beyond): integer data (many exact ties), a sum
    halfway between the largest bfloat16 and 2^128 (rounds to inf), NaN; matmul and matmul_batched."""
    rng = np.random.default_rng(n)
    a = rng.integers(-16, 17, (2, 29, n)).astype(np.float32).astype(BF16)
    b = rng.integers(-16, 17, (2, n, 45)).astype(np.float32).astype(BF16)
    if n >= 2:  # out[0, 0, 0] = 2^127 · (1.9921875 + 2^-8): float32 exactly, a bfloat16 tie that rounds up to inf
        a[0, 0] = 0
        a[0, 0, :2] = 2.0**127
        b[0, :2] = 0
        b[0, :2, 0] = [1.9921875, 2.0**-8]
    a[0, 1, 0] = np.nan
    with bf16_matmul_path(True):
        as_float32 = backend_matmul(a, b, "float32").astype(np.float32)
        batched, single = backend_matmul(a, b, "bfloat16"), backend_matmul(a[0], b[0], "bfloat16")
    for got, expected in ((batched, as_float32), (single, as_float32[0])):
        expected = expected.astype(BF16).astype(np.float64)  # ml_dtypes: nearest, ties to even
        np.testing.assert_array_equal(np.isnan(got), np.isnan(expected))
        assert np.array_equal(got[~np.isnan(got)], expected[~np.isnan(expected)])
    assert np.all(np.isnan(single[1]))
    if n >= 2:
        assert as_float32[0, 0, 0] == np.float32(2.0**127 * 1.99609375) and single[0, 0] == np.inf


def test_bf16_dot_path_agrees_with_widening_path():
    """The two paths differ only in the order of float32 additions: within twice the bound of each (an odd k, edge
    tiles and two k blocks)."""
    a, b = bf16_operands(np.random.default_rng(7), (45, 777), (777, 70))
    with bf16_matmul_path(True):
        with_dot = backend_matmul(a, b, "float32")
    with bf16_matmul_path(False):
        widened = backend_matmul(a, b, "float32")
    bound = 2 * 1.01 * (777 + 3 + 1) * U * (np.abs(a.astype(np.float64)) @ np.abs(b.astype(np.float64)))
    assert np.all(np.abs(with_dot - widened) <= bound)
    assert not np.array_equal(with_dot, widened)  # the dot-product path really ran: its order differs somewhere


def test_bf16_matmul_non_finite_values(bf16_dot):
    """inf and NaN inputs give what float arithmetic gives, and the zero padding (odd k, edge tiles) never turns
    into NaN: a row with +inf times positive columns is +inf, a NaN row is NaN, the rest stay finite."""
    m, n, p = 13, 5, 33
    a = np.abs(np.random.default_rng(3).standard_normal((m, n))).astype(BF16) + BF16.type(0.5)
    b = np.abs(np.random.default_rng(4).standard_normal((n, p))).astype(BF16) + BF16.type(0.5)
    a[0, n - 1] = np.inf  # the last k of an odd n: paired with the zero padding
    a[1, 0] = np.nan
    got = backend_matmul(a, b, "float32")
    assert np.all(got[0] == np.inf)
    assert np.all(np.isnan(got[1]))
    assert np.all(np.isfinite(got[2:]))
    check_against_float64(got[2:], a[2:], b, "float32")


def test_bf16_dot_flushes_denormals():
    """The documented difference: VDPBF16PS flushes a denormal product (here 2^-70 · 2^-70 = 2^-140) to zero, the
    widening path keeps it."""
    a = np.full((2, 3), 2.0**-70, np.float32).astype(BF16)
    b = np.full((3, 2), 2.0**-70, np.float32).astype(BF16)
    with bf16_matmul_path(True):
        flushed = backend_matmul(a, b, "float32")
    with bf16_matmul_path(False):
        kept = backend_matmul(a, b, "float32")
    assert np.all(flushed == 0)
    np.testing.assert_array_equal(kept, np.float32(3 * 2.0**-140))


def test_bf16_dot_switch():
    """matmul_bf16_dot() reads the switch that set_matmul_bf16_dot sets; switching it on where the CPU lacks
    AVX512-BF16 raises ValueError, and there it reads False."""
    mod = CPU.mod
    if not hasattr(mod, "set_matmul_bf16_dot"):
        pytest.skip("this build of the C++ backend has no bfloat16 dot-product kernel")
    was_on = mod.matmul_bf16_dot()
    try:
        for on in (False, True, False):
            try:
                mod.set_matmul_bf16_dot(on)
            except ValueError:
                assert on and not mod.matmul_bf16_dot()
                continue
            assert mod.matmul_bf16_dot() is on
    finally:
        mod.set_matmul_bf16_dot(was_on)


# ===== 2. block-wise 8-bit quantization =============================================================================
CODE = np.sort(np.concatenate([np.linspace(-1, 1, 255), [0.5001]])).astype(np.float32)  # strictly ascending


def reference_quantize(a, code, block_size):
    """src/README.md's quantize_blockwise in NumPy, float32 throughout: (uint8 indices, float32 absmax)."""
    n = a.size
    blocks = -(-n // block_size)
    padded = np.zeros(blocks * block_size, np.float32)
    padded[:n] = a
    padded = padded.reshape(blocks, block_size)  # zero padding never changes a block's absmax
    absmax = np.abs(padded).max(axis=1)  # NaN where the block holds one
    scale = np.where(absmax == 0, np.float32(1), absmax)[:, None]
    with np.errstate(invalid="ignore"):  # inf / inf
        x = np.where(absmax[:, None] == 0, np.float32(0), padded / scale).astype(np.float32)
    lo = np.maximum(np.searchsorted(code, x, side="right") - 1, 0)  # the largest j with code[j] <= x, else 0
    lo[np.isnan(x)] = 0  # (searchsorted puts NaN after everything)
    hi = np.minimum(lo + 1, 255)
    q = np.where(code[hi] - x < x - code[lo], hi, lo)  # float32 subtractions, ties to lo
    return q.reshape(-1)[:n].astype(np.uint8), absmax.astype(np.float32)


def backend_quantize(a, code, block_size):
    n = a.size
    out = CPU.mod.Array(n, "uint8")
    absmax = CPU.mod.Array(-(-n // block_size), "float32")
    CPU.mod.quantize_blockwise(array(a, "float32"), array(code, "float32"), out, absmax, block_size)
    return read(out), read(absmax)


def backend_dequantize(q, code, absmax, block_size):
    out = CPU.mod.Array(q.size, "float32")
    CPU.mod.dequantize_blockwise(array(q, "uint8"), array(code, "float32"), array(absmax, "float32"), out,
                                 block_size)
    return read(out)


def assert_same_bytes(got, expected):
    assert got.dtype == expected.dtype and got.shape == expected.shape
    assert got.tobytes() == expected.tobytes(), f"first difference at {np.flatnonzero(got != expected)[:5]}"


def check_round_trip(a, block_size, code=CODE):
    q, absmax = backend_quantize(a, code, block_size)
    q_ref, absmax_ref = reference_quantize(a, code, block_size)
    assert_same_bytes(absmax, absmax_ref)
    assert_same_bytes(q, q_ref)
    with np.errstate(invalid="ignore"):  # code 0 times an inf absmax
        expected = code[q_ref] * np.repeat(absmax_ref, block_size)[: a.size]
    assert_same_bytes(backend_dequantize(q, code, absmax, block_size), expected)
    return q, absmax


@pytest.mark.parametrize("block_size", [1, 7, 64, 256, 4096])
@pytest.mark.parametrize("n", [1, 1000, 4096, 70001])
def test_quantize_random(n, block_size):
    """Random data, sizes that are and are not multiples of block_size, block_size 1 and 4096: same bytes as the
    reference, and a dequantized value within half a code step of the original."""
    a = (np.random.default_rng(n + block_size).standard_normal(n) * 3).astype(np.float32)
    q, absmax = check_round_trip(a, block_size)
    back = backend_dequantize(q, CODE, absmax, block_size)
    step = np.max(np.diff(CODE.astype(np.float64)))
    assert np.all(np.abs(back - a) <= (step / 2 + 1e-6) * np.repeat(absmax, block_size)[:n])


def test_quantize_zeros_and_signed_zero():
    """A block of all zeros has absmax 0 and maps to the code value nearest 0; zeros inside a block, -0.0 too."""
    a = np.random.default_rng(1).standard_normal(300).astype(np.float32)
    a[:64] = 0.0  # a whole block of zeros
    a[64:128:3] = 0.0
    a[130] = -0.0
    a[192:256] = -0.0  # a block of negative zeros: absmax +0
    q, absmax = check_round_trip(a, 64)
    assert absmax[0] == 0 and absmax[3] == 0
    assert np.all(q[:64] == np.argmin(np.abs(CODE)))


def test_quantize_non_finite():
    """A NaN makes its block's absmax NaN and every index of that block 0; ±inf makes absmax inf, the inf elements
    NaN / 0 (inf / inf) and the finite ones ±0."""
    a = np.random.default_rng(2).standard_normal(40).astype(np.float32)
    a[3] = np.nan
    a[12] = np.inf
    a[25] = -np.inf
    a[33], a[34] = -np.nan, np.inf
    q, absmax = check_round_trip(a, 10)
    assert np.isnan(absmax[0]) and np.all(q[:10] == 0)
    assert absmax[1] == np.inf and absmax[2] == np.inf


def test_quantize_ties_and_code_edges():
    """x exactly on a code value, exactly halfway between two (ties go to the lower index), and values at ±absmax
    (the ends of the code) — with a code whose midpoints are exact in float32."""
    code = (np.arange(256, dtype=np.float32) - 128) / 128  # step 2^-7: midpoints are exact
    a = np.concatenate([code, code[:-1] + np.float32(2.0**-8), [-1.0, 1.0]]).astype(np.float32)
    check_round_trip(a, a.size, code)
    q, _ = backend_quantize(a, code, a.size)
    assert np.array_equal(q[:256], np.arange(256))
    assert np.array_equal(q[256:511], np.arange(255))  # halfway: the lower index
    # absmax 3, 5, 7: a = midpoint * absmax is exact, so a / absmax is exactly the midpoint (a tie, the lower index),
    # where a * (1 / absmax) would be off by an ulp in either direction: the contract's float32 division matters.
    # (Blocks of 256 are quantized 8 elements at a time; blocks of 2, [absmax, tie], one at a time.)
    mids = code[:-1] + np.float32(2.0**-8)
    for m in (3, 5, 7):
        b = np.concatenate([mids * np.float32(m), [m]]).astype(np.float32)
        q, _ = check_round_trip(b, b.size, code)
        assert np.array_equal(q[:255], np.arange(255))
        pairs = np.stack([np.full(255, m, np.float32), mids * np.float32(m)], axis=1).reshape(-1)
        q, _ = check_round_trip(pairs, 2, code)
        assert np.array_equal(q[1::2], np.arange(255))


def test_quantize_empty():
    q, absmax = backend_quantize(np.zeros(0, np.float32), CODE, 16)
    assert q.size == 0 and absmax.size == 0


def test_quantize_errors():
    """TypeError for a wrong dtype; ValueError naming the array, its size and the expected one; block_size >= 1."""
    mod = CPU.mod
    a, code = array(np.ones(10, np.float32), "float32"), array(CODE, "float32")
    out, absmax = mod.Array(10, "uint8"), mod.Array(3, "float32")
    mod.quantize_blockwise(a, code, out, absmax, 4)
    with pytest.raises(TypeError, match="quantize_blockwise"):
        mod.quantize_blockwise(array(np.ones(10, np.float16), "float16"), code, out, absmax, 4)
    with pytest.raises(TypeError, match="quantize_blockwise"):
        mod.quantize_blockwise(a, code, mod.Array(10, "int8"), absmax, 4)
    with pytest.raises(ValueError, match="absmax has 3 elements, expected 4"):
        mod.quantize_blockwise(a, code, out, absmax, 3)
    with pytest.raises(ValueError, match="out has 9 elements, expected 10"):
        mod.quantize_blockwise(a, code, mod.Array(9, "uint8"), absmax, 4)
    with pytest.raises(ValueError, match="code has 255 elements, expected 256"):
        mod.quantize_blockwise(a, array(CODE[:255], "float32"), out, absmax, 4)
    for bad in (0, -1):
        with pytest.raises(ValueError, match="block_size"):
            mod.quantize_blockwise(a, code, out, absmax, bad)
        with pytest.raises(ValueError, match="block_size"):
            mod.dequantize_blockwise(out, code, absmax, a, bad)
    with pytest.raises(TypeError, match="dequantize_blockwise"):
        mod.dequantize_blockwise(a, code, absmax, mod.Array(10, "float32"), 4)
    with pytest.raises(TypeError, match="dequantize_blockwise"):
        mod.dequantize_blockwise(out, code, absmax, mod.Array(10, "bfloat16"), 4)
    with pytest.raises(ValueError, match="out has 11 elements, expected 10"):
        mod.dequantize_blockwise(out, code, absmax, mod.Array(11, "float32"), 4)
    with pytest.raises(ValueError, match="absmax has 3 elements, expected 10"):
        mod.dequantize_blockwise(out, code, absmax, mod.Array(10, "float32"), 1)


# ===== 3. float16 conversions (integer arithmetic, no library calls) ================================================
def test_every_float16_widens_as_numpy_does():
    """All 65,536 patterns: float16 -> float32 equals NumPy's (a NaN stays NaN, with its sign)."""
    halves = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16)
    widened = nd.array(halves, device=CPU, dtype="float16").astype("float32").numpy()
    expected = halves.astype(np.float32)
    nan = np.isnan(expected)
    np.testing.assert_array_equal(np.isnan(widened), nan)
    np.testing.assert_array_equal(widened.view(np.uint32)[~nan], expected.view(np.uint32)[~nan])
    np.testing.assert_array_equal(np.signbit(widened[nan]), np.signbit(expected[nan]))


def test_float32_narrows_to_float16_as_numpy_does():
    """Round to nearest, ties to even, across the whole range: subnormal halves, the overflow boundary (65520 is
    the first value that rounds to inf), every exponent, ties, signed zeros and infinities."""
    rng = np.random.default_rng(0)
    mantissas = rng.integers(0, 1 << 23, 1 << 18, dtype=np.uint32)
    exponents = rng.integers(90, 160, 1 << 18, dtype=np.uint32)  # 2^-37 .. 2^32: zero, subnormal, normal, inf
    signs = rng.integers(0, 2, 1 << 18, dtype=np.uint32) << 31
    values = (signs | exponents << 23 | mantissas).view(np.float32)
    ties = (np.arange(-2048, 2048, dtype=np.float32) + 0.5) * np.float32(2**-10)  # halfway between halves in [-2, 2)
    edges = np.array([65504, 65519.996, 65520, 65536, 2**-24, 2**-25, 1.5 * 2**-25, 2**-14, -0.0, np.inf, -np.inf],
                     dtype=np.float32)
    values = np.concatenate([values, ties, edges])
    with np.errstate(over="ignore"):
        expected = values.astype(np.float16)
    narrowed = nd.array(values, device=CPU).astype("float16").numpy()
    np.testing.assert_array_equal(narrowed.view(np.uint16), expected.view(np.uint16))


# ===== 4. sizes whose product overflows 64 bits ======================================================================
# Each call's sizes multiply past 2^64 and wrap around to its (empty or small) buffers' sizes, so unchecked products
# passed the size checks and the kernel walked far past the buffers (a segfault), or nothing ran and the call said
# nothing. `zeros(n)`: a buffer of n zeros (valid labels for the functions that read them).
OVERFLOWING_CALLS = """
big, w = 2**62, 2**32
calls = {
    "reduce_sum": lambda: m.reduce_sum(zeros(0), zeros(4), big),
    "reduce_max": lambda: m.reduce_max(zeros(0), zeros(4), big),
    "reduce_logsumexp": lambda: m.reduce_logsumexp(zeros(0), zeros(4), big),
    "matmul": lambda: m.matmul(zeros(0), zeros(0), zeros(0), w, w, w),
    "matmul_batched": lambda: m.matmul_batched(zeros(0), zeros(0), zeros(0), w, w, w, w),
    "softmax_xent_grad": lambda: m.softmax_xent_grad(zeros(0), zeros(4), zeros(4), zeros(0), big),
    "layernorm_forward": lambda: m.layernorm_forward(zeros(0), zeros(4), zeros(4), zeros(0), big, 4, 1e-5),
    "layernorm_backward": lambda: m.layernorm_backward(zeros(0), zeros(4), zeros(0), zeros(0), zeros(4), zeros(4),
                                                       big, 4, 1e-5),
    "attention_forward": lambda: m.attention_forward(zeros(0), zeros(0), zeros(0), zeros(0), zeros(0), big, 4, 4, 4,
                                                     4, 1.0, False, 0.0, 0),
    "take_along_rows": lambda: m.take_along_rows(zeros(0), zeros(4), zeros(4), big),
}
"""


def test_sizes_whose_product_overflows_are_a_value_error_not_a_wrapped_size():
    script = textwrap.dedent("""
        from needle import backend_ndarray as nd
        m = nd.cpu().mod

        def zeros(n):
            a = m.Array(n)
            m.fill(a, 0.0)
            return a
    """) + OVERFLOWING_CALLS + textwrap.dedent("""
        for name, call in calls.items():
            try:
                call()
                print(name, "accepted")
            except ValueError as err:
                print(name, err)
            """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr  # (-11: the segfault)
    lines = out.stdout.splitlines()
    assert len(lines) == 10, out.stdout
    for line in lines:
        name, _, message = line.partition(" ")
        assert message.startswith(f"{name}: ") and "more than a 64-bit size can count" in message, line
