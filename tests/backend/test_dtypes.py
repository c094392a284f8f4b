"""Dtypes: float32, float16, bfloat16 (floating) and int8, uint8, int32 (storage only), in NDArray.

The rule under test (src/README.md, "Dtypes"): arithmetic is float32 whatever the storage, so a 16-bit op is
round16(float32 op). The NumPy reference backend (`cpu_numpy()`) is the oracle; it is itself checked against
`np_op(x.astype(float32)).astype(dtype)` (ml_dtypes for bfloat16), and the compiled backends (`cpu()`, `cuda()`
when a GPU is present) must agree with it within TOLERANCE (dtype_cases.py). Topics, in order:

1. every NDArray op in every float dtype vs the reference, promotion;
2. astype and the conversion rules, numpy(), nbytes/itemsize, memory statistics;
3. round_stochastic;
4. integer dtypes: storage only.

Tensors in every dtype, autocast, GradScaler and the optimizers' master weights: tests/toolbox/test_precision.py.
"""
import math

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import needle as ndl
from needle import backend_ndarray as nd

from conftest import DEVICES
from dtype_cases import (CPU, FLOATS, HYPOTHESIS, INTS, NP, REF, as64, assert_close, assert_exact, check_op, int_rule,
                         lowbias32_bits, operand, oracle, rounded)
from ndarray_cases import EWISE_OPS, SCALAR_OPS, with_kernels


def _switch(device, request, getter, setter):
    """Run the C++ backend with the kernel `request.param` names ("default": as chosen at import)."""
    if request.param == "default":
        yield request.param
        return
    mod = device.mod
    if not hasattr(mod, setter):
        pytest.skip(f"{device} has a single implementation")
    original = getattr(mod, getter)()
    try:
        getattr(mod, setter)(request.param)
    except ValueError:
        pytest.skip(f"this CPU cannot run the {request.param} kernels")
    try:
        yield request.param
    finally:
        getattr(mod, setter)(original)


@pytest.fixture
def vector_isa(request, device):
    """The C++ exp/log/tanh/sum/max kernels of each instruction set this CPU runs (16-bit loads/stores included)."""
    yield from _switch(device, request, "vector_isa", "set_vector_isa")


@pytest.fixture
def matmul_kernel(request, device):
    """The C++ matmul micro-kernels (each has its own 16-bit packing) this CPU runs."""
    yield from _switch(device, request, "matmul_kernel", "set_matmul_kernel")



# ===== 1. every op in every float dtype vs the reference ============================================================
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("name", list(EWISE_OPS))
@pytest.mark.parametrize("layouts", [("compact", "compact"), ("permuted", "sliced"), ("broadcast", "compact")],
                         ids="-".join)
def test_ewise_ops_every_dtype(device, dtype, name, layouts, rng):
    """a op b in `dtype` (compact or strided views) is round(float32 op) on the reference, and within one ulp of
    it on the compiled backends; the result keeps the dtype."""
    ours, theirs, kind = EWISE_OPS[name]
    shape = (4, 5, 6)
    a = operand(rng, shape, layouts[0], dtype, kind if kind in ("positive", "discrete") else "normal")
    b = operand(rng, shape, layouts[1], dtype, kind if kind != "positive" else "normal")
    check_op(device, dtype, ours, theirs, [a, b])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("name", list(SCALAR_OPS))
@pytest.mark.parametrize("scalar", [0.5, -1.3, 3], ids=repr)
@pytest.mark.parametrize("lay", ["compact", "permuted"])
def test_scalar_ops_every_dtype(device, dtype, name, scalar, lay, rng):
    """a op python_scalar keeps a's dtype (Python numbers never promote) and is round(float32(a) op float32(s))."""
    ours, theirs, kind = SCALAR_OPS[name]
    base, view = operand(rng, (3, 4, 5), lay, dtype, kind)
    if name == "eq":
        base = np.where(rng.uniform(size=base.shape) < 0.3, np.float32(scalar), base).astype(np.float32)
        base = rounded(base, dtype)
    check_op(device, dtype, lambda a: ours(a, scalar), lambda a: theirs(a, np.float32(scalar)), [(base, view)])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_scalar_rtruediv_is_one_float32_op(device, dtype):
    """scalar / a in a 16-bit dtype is round16(float32(scalar) / float32(a)), as every other scalar op (the scalar
    is a float32, not rounded to 16 bits first): 1e5 / 1000 is 100 in float16, not inf; 0.1 / 15 in bfloat16 is
    round(0.1f / 15), not round(round(0.1) / 15) (one ulp apart)."""
    x = np.array([1000.0, 3.0, 7.0, 15.0, 19.0, 0.1], dtype=np.float32)
    x = rounded(x, dtype)
    for scalar in (100000.0, 0.1):
        a = nd.array(x, dtype=dtype, device=device)
        assert_exact(scalar / a, oracle(np.float32(scalar) / x, dtype), dtype)


@pytest.mark.parametrize("device, vector_isa", with_kernels(DEVICES, "set_vector_isa"), indirect=["vector_isa"])
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("name", ["log", "exp", "tanh"])
@pytest.mark.parametrize("lay", ["compact", "sliced"])
def test_unary_ops_every_dtype(device, dtype, name, lay, vector_isa, rng):
    """log/exp/tanh in `dtype` (compact or strided) are round(float32 op), also on NumPy's special values."""
    base, view = operand(rng, (5, 7), lay, dtype, "positive" if name == "log" else "normal")
    base = base * np.float32(3.0) if name != "log" else base
    special = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, -1.0, 1e-3, 20.0, -20.0, 89.0], dtype=np.float32)
    fn = {"log": np.log, "exp": np.exp, "tanh": np.tanh}[name]
    with np.errstate(all="ignore"):
        check_op(device, dtype, lambda a: getattr(a, name)(), fn, [(rounded(base, dtype), view)])
        check_op(device, dtype, lambda a: getattr(a, name)(), fn, [rounded(special, dtype)])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOATS)
def test_nan_and_inf_in_binary_ops(device, dtype):
    """NaN and inf operands follow NumPy in every dtype: maximum propagates NaN, comparisons with NaN are 0,
    inf - inf is NaN; float16 overflow gives inf (65504 + 65504)."""
    vals = np.array([np.nan, 1.0, np.inf, -np.inf, 65504.0, np.nan, 0.0, -0.0], dtype=np.float32)
    other = np.array([1.0, np.nan, np.inf, 2.0, 65504.0, np.nan, -0.0, 0.0], dtype=np.float32)
    a, b = rounded(vals, dtype), rounded(other, dtype)
    with np.errstate(all="ignore"):
        for name in ("add", "sub", "mul", "maximum", "eq", "ge", "gt"):
            ours, theirs, _ = EWISE_OPS[name]
            check_op(device, dtype, ours, theirs, [a, b])


REDUCTIONS = {
    "sum": (lambda a, axis, k: a.sum(axis=axis, keepdims=k),
            lambda x, axis, k: np.sum(x.astype(np.float64), axis=axis, keepdims=k)),
    "max": (lambda a, axis, k: a.max(axis=axis, keepdims=k), lambda x, axis, k: np.max(x, axis=axis, keepdims=k)),
    "logsumexp": (lambda a, axis, k: a.logsumexp(axis=axis, keepdims=k),
                  lambda x, axis, k: _np_logsumexp(x.astype(np.float64), axis, k)),
}


def _np_logsumexp(x, axis, keepdims):
    """m + log sum exp(x - m); where the maximum m is not finite, m itself (the contract's rule)."""
    m = np.max(x, axis=axis, keepdims=True)
    with np.errstate(all="ignore"):
        out = m + np.log(np.sum(np.exp(x - m), axis=axis, keepdims=True))
    out = np.where(np.isfinite(m), out, m)
    return out if keepdims else np.squeeze(out, axis=axis)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("name", list(REDUCTIONS))
@pytest.mark.parametrize("axis", [None, 0, 2, (0, 1), (0, 2), -1], ids=repr)
@pytest.mark.parametrize("keepdims", [False, True])
def test_reductions_every_dtype(device, dtype, name, axis, keepdims, rng):
    """sum/max/logsumexp over axes in `dtype`: float32 accumulation, one rounding, the input's dtype out (the
    leading-axes sum goes through the matmul with ones; others through the row kernels)."""
    ours, theirs = REDUCTIONS[name]
    base, view = operand(rng, (4, 5, 6), "compact" if axis != 2 else "permuted", dtype)
    check_op(device, dtype, lambda a: ours(a, axis, keepdims), lambda x: theirs(x, axis, keepdims),
             [(base, view)], exact_reference=name == "max")


MATMUL_SHAPES = [((5, 7), (7, 3)), ((33, 65), (65, 17)), ((1, 9), (9, 1)), ((70, 3), (3, 130)), ((3, 0), (0, 4)),
                 ((3, 4, 5), (3, 5, 6)), ((2, 1, 4, 5), (3, 5, 6)), ((4, 5), (2, 5, 3)), ((2, 3, 4, 5), (5, 2))]


@pytest.mark.parametrize("device, matmul_kernel", with_kernels(DEVICES, "set_matmul_kernel"),
                         indirect=["matmul_kernel"])
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("shapes", MATMUL_SHAPES, ids=repr)
def test_matmul_every_dtype(device, dtype, shapes, matmul_kernel, rng):
    """2-D, batched and broadcast-batch matmuls in `dtype` accumulate in float32 and round once (every C++
    micro-kernel)."""
    a = rounded(rng.standard_normal(shapes[0]), dtype)
    b = rounded(rng.standard_normal(shapes[1]), dtype)
    check_op(device, dtype, lambda x, y: x @ y, lambda x, y: np.matmul(x.astype(np.float64), y), [a, b],
             exact_reference=False)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOATS)
def test_matmul_of_non_compact_operands(device, dtype, rng):
    """Transposed, sliced and broadcast 16-bit operands of a matmul (compacted by ndarray.py) give the same values."""
    a = operand(rng, (6, 9), "permuted", dtype)
    b = operand(rng, (9, 4), "sliced", dtype)
    check_op(device, dtype, lambda x, y: x @ y, lambda x, y: x.astype(np.float64) @ y, [a, b], exact_reference=False)
    c = operand(rng, (3, 6, 9), "broadcast", dtype)
    check_op(device, dtype, lambda x, y: x @ y, lambda x, y: np.matmul(x.astype(np.float64), y), [c, b],
             exact_reference=False)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("batched", [False, True])
def test_backend_matmul_with_float32_out(device, dtype, batched, rng):
    """The contract's one mixed case: 16-bit a and b with a float32 out keeps the float32 accumulator (no 16-bit
    rounding of the result); float32 a with 16-bit b raises TypeError."""
    k, m, n, p = 3, 4, 9, 5
    a = rounded(rng.standard_normal((k, m, n)), dtype)
    b = rounded(rng.standard_normal((k, n, p)), dtype)
    expected = np.matmul(a.astype(np.float64), b)
    A = nd.array(a, dtype=dtype, device=device)
    B = nd.array(b, dtype=dtype, device=device)
    out = nd.empty((k, m, p), dtype="float32", device=device)
    mod = device.mod
    if batched:
        mod.matmul_batched(A.buffer, B.buffer, out.buffer, k, m, n, p)
    else:
        out = nd.empty((m, p), dtype="float32", device=device)
        mod.matmul(A[0].compact().buffer, B[0].compact().buffer, out.buffer, m, n, p)
        expected = expected[0]
    np.testing.assert_allclose(out.numpy(), expected, rtol=1e-5, atol=1e-5)
    with pytest.raises(TypeError, match="matmul"):
        mod.matmul(A[0].compact().astype("float32").buffer, B[0].compact().buffer,
                   nd.empty((m, p), dtype="float32", device=device).buffer, m, n, p)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_strided_entry_points_are_float32_only(device, dtype):
    """ewise_strided / scalar_strided / unary_strided raise TypeError on 16-bit buffers (ndarray.py never calls
    them with one: it hands compact copies to the compact kernels)."""
    a = nd.array(np.ones((2, 3), np.float32), dtype=dtype, device=device)
    out = nd.empty((2, 3), dtype=dtype, device=device)
    mod = device.mod
    with pytest.raises(TypeError):
        mod.ewise_strided("add", a.buffer, [3, 1], 0, a.buffer, [3, 1], 0, out.buffer, [2, 3])
    with pytest.raises(TypeError):
        mod.scalar_strided("add", a.buffer, [3, 1], 0, 1.0, out.buffer, [2, 3])
    with pytest.raises(TypeError):
        mod.unary_strided("exp", a.buffer, [3, 1], 0, out.buffer, [2, 3])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOATS)
def test_setitem_flip_pad_stack_split_every_dtype(device, dtype, rng):
    """The data-movement operations keep the dtype and move values exactly (setitem converts into the target)."""
    x = rounded(rng.standard_normal((4, 5, 6)), dtype)
    y = rounded(rng.standard_normal((2, 5, 3)), dtype)
    for dev in {device, REF}:
        a = nd.array(x, dtype=dtype, device=dev)
        # flip (negative strides) and pad
        assert_exact(a.flip((0, 2)), np.flip(x, (0, 2)), dtype)
        assert_exact(a.pad(((1, 0), (0, 2), (1, 1))), np.pad(x, ((1, 0), (0, 2), (1, 1))), dtype)
        # stack / split
        parts = [nd.array(x[i], dtype=dtype, device=dev) for i in range(4)]
        assert_exact(nd.stack(parts, axis=1), np.stack(list(x), axis=1), dtype)
        for got, want in zip(nd.split(a, axis=2), np.split(x, 6, axis=2)):
            assert_exact(got, want[:, :, 0], dtype)
        # setitem of an array into a strided view, of a broadcast value, of a scalar, and of another dtype
        b = nd.array(x, dtype=dtype, device=dev)
        want = x.copy()
        b[1:3, :, ::2] = nd.array(y, dtype=dtype, device=dev)
        want[1:3, :, ::2] = y
        b[3, 1:4, :] = nd.array(x[0, 0], dtype=dtype, device=dev).reshape((1, 6))  # broadcast by setitem
        want[3, 1:4, :] = x[0, 0]
        b[0, 0, :] = 0.1  # rounded into the dtype through float32
        want[0, 0, :] = oracle(np.float32(0.1), dtype).astype(np.float32)
        b[0, 1, :] = nd.array(np.full(6, 1 / 3, np.float32), device=dev)  # a float32 value, converted on store
        want[0, 1, :] = oracle(np.float32(1 / 3), dtype).astype(np.float32)
        assert_exact(b, want, dtype)
        # a 16-bit source into a float32 strided view: exact (float32 holds every 16-bit value)
        wide = nd.array(np.zeros((6, 5), np.float32), device=dev)
        wide[::2, 1:] = nd.array(x[0, :3, :4], dtype=dtype, device=dev)
        want_wide = np.zeros((6, 5), np.float32)
        want_wide[::2, 1:] = x[0, :3, :4]
        assert_exact(wide, want_wide, "float32")
        # views of a 16-bit buffer are views (no copy): writing through one shows in the other
        v = b.permute((2, 1, 0))
        v[0, 0, 0] = 2.0
        assert float(b.numpy()[0, 0, 0]) == 2.0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("idx_dtype", ["float32", "int32", "int8", "uint8"])
def test_gathers_and_scatters_every_dtype(device, dtype, idx_dtype, rng):
    """take_rows copies rows exactly; scatter_add_rows (with repeated indices: each addition rounded, in order),
    take_along_rows, scatter_along_rows and softmax_xent_grad are float32 arithmetic rounded to `dtype`; index
    arrays may be of any dtype."""
    table = rounded(rng.standard_normal((7, 5)), dtype)
    ids = np.array([3, 0, 3, 6, 3, 1, 3, 3], dtype=np.float32)
    for dev in {device, REF}:
        T = nd.array(table, dtype=dtype, device=dev)
        I = nd.array(ids, dtype=idx_dtype, device=dev)
        assert_exact(nd.take_rows(T, I), table[ids.astype(int)], dtype)
    # scatter_add_rows: the reference rounds after every addition, in order
    src = rounded(rng.standard_normal((8, 5)), dtype)
    want = np.zeros((7, 5), dtype=NP[dtype])
    for i, r in enumerate(ids.astype(int)):
        want[r] = oracle(want[r].astype(np.float32) + src[i], dtype)
    cols = np.array([4, 0, 2, 2, 1, 3, 0], dtype=np.float32)
    g = rounded(rng.standard_normal(7), dtype)
    z = np.exp(table.astype(np.float64) - table.max(axis=1, keepdims=True))
    xent = z / z.sum(axis=1, keepdims=True) * g[:, None]
    xent[np.arange(7), cols.astype(int)] -= g
    scattered = np.zeros((7, 5), np.float32)
    scattered[np.arange(7), cols.astype(int)] = g
    results = {}
    for dev in [REF] + ([device] if device != REF else []):
        T, S = nd.array(table, dtype=dtype, device=dev), nd.array(src, dtype=dtype, device=dev)
        I, C = nd.array(ids, dtype=idx_dtype, device=dev), nd.array(cols, dtype=idx_dtype, device=dev)
        G = nd.array(g, dtype=dtype, device=dev)
        results[dev] = [nd.scatter_add_rows(S, I, 7), nd.take_along_rows(T, C), nd.scatter_along_rows(G, C, 5),
                        nd.softmax_xent_grad(T, C, G)]
    ref = results[REF]
    assert_exact(ref[0], want, dtype)
    assert_exact(ref[1], table[np.arange(7), cols.astype(int)], dtype)
    assert_exact(ref[2], scattered, dtype)
    assert_close(ref[3], oracle(xent, dtype), dtype)
    for got, r in zip(results.get(device, ref), ref):
        assert_close(got, r.numpy(), dtype)


@pytest.mark.parametrize("device, vector_isa", with_kernels(DEVICES, "set_vector_isa"), indirect=["vector_isa"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_row_reductions_of_16bit_long_rows(device, dtype, vector_isa, rng):
    """Long rows (vector kernels, tails) of 16-bit data: sum/max/logsumexp rows within one ulp of the reference;
    rows with -inf, +inf or NaN give NumPy's special values (logsumexp of a row of -inf is -inf)."""
    for n in (1, 15, 16, 17, 65, 1000):
        x = rounded(rng.standard_normal((3, n)), dtype)
        for name, (ours, theirs) in REDUCTIONS.items():
            check_op(device, dtype, lambda a: ours(a, 1, False), lambda v: theirs(v, 1, False), [x],
                     exact_reference=name == "max")
    special = rounded(rng.standard_normal((4, 17)), dtype)
    special[0, :] = -np.inf
    special[1, 3] = np.inf
    special[2, 5] = np.nan
    special[3, :] = 70000.0 if dtype == "float16" else 1e38  # 16-bit overflow of the sum: inf
    special = rounded(special, dtype)
    with np.errstate(all="ignore"):
        for name, (ours, theirs) in REDUCTIONS.items():
            want = oracle(theirs(special, 1, False), dtype)
            for dev in {device, REF}:
                got = ours(nd.array(special, dtype=dtype, device=dev), 1, False)
                np.testing.assert_array_equal(np.isnan(as64(got)), np.isnan(as64(want)))
                np.testing.assert_array_equal(np.isinf(as64(got)), np.isinf(as64(want)))


@settings(HYPOTHESIS)
@given(shape=st.lists(st.integers(1, 6), min_size=1, max_size=3), dtype=st.sampled_from(["float16", "bfloat16"]),
       op=st.sampled_from(["add", "sub", "mul", "div", "maximum"]), seed=st.integers(0, 2**16),
       scale=st.sampled_from([1e-6, 1.0, 300.0, 3e4]))
def test_property_ewise_16bit_is_round_of_float32(shape, dtype, op, seed, scale):
    """Property: for random shapes and magnitudes (float16 subnormals to near-overflow), a 16-bit element-wise op
    on every backend equals round16(the float32 op) within one ulp, and exactly on the reference."""
    rng = np.random.default_rng(seed)
    a = rounded(rng.standard_normal(shape) * scale, dtype)
    kind = "nonzero" if op == "div" else "normal"
    b = rounded(operand(rng, tuple(shape), "compact", "float32", kind)[0] * scale, dtype)
    ours, theirs, _ = EWISE_OPS[op]
    for device in [d.values[0] for d in DEVICES if d.values[0].enabled()]:
        with np.errstate(all="ignore"):
            check_op(device, dtype, ours, theirs, [a, b])


# ----- promotion ----------------------------------------------------------------------------------------------------
def test_promote_types_table():
    """promote_types: equal dtypes stay, any two different float dtypes give float32."""
    for a in FLOATS:
        for b in FLOATS:
            assert nd.promote_types(a, b) == (a if a == b else "float32")


@pytest.mark.parametrize("device", DEVICES)
def test_mixed_dtype_operands_promote(device, rng):
    """bf16 + f16 -> f32 and bf16 + f32 -> f32 (the values: float32 arithmetic on the exact inputs, no rounding of
    the result to 16 bits); bf16 * 0.5 -> bf16; f16 @ bf16 -> f32; a 16-bit array with an int8 array: TypeError."""
    x, y = rounded(rng.standard_normal((3, 4)), "bfloat16"), rounded(rng.standard_normal((3, 4)), "float16")
    z = rng.standard_normal((3, 4)).astype(np.float32)
    bf = nd.array(x, dtype="bfloat16", device=device)
    f16 = nd.array(y, dtype="float16", device=device)
    f32 = nd.array(z, device=device)
    assert_close(bf + f16, x + y, "float32")
    assert_close(f16 + bf, y + x, "float32")
    assert_close(bf + f32, x + z, "float32")
    assert_close(f32 * bf, z * x, "float32")
    assert_close(bf.maximum(f16), np.maximum(x, y), "float32")
    assert_exact(bf * 0.5, oracle(x * np.float32(0.5), "bfloat16"), "bfloat16")
    assert_exact(f16 + 1, oracle(y + np.float32(1), "float16"), "float16")
    assert_close(f16 @ bf.permute((1, 0)), y.astype(np.float64) @ x.T, "float32")
    assert_close(bf @ f32.permute((1, 0)), x.astype(np.float64) @ z.T, "float32")
    i8 = nd.array(np.ones((3, 4)), dtype="int8", device=device)
    for bad in (lambda: bf + i8, lambda: i8 * f32, lambda: bf @ i8.permute((1, 0))):
        with pytest.raises(TypeError, match="int8"):
            bad()


@pytest.mark.parametrize("device", DEVICES)
def test_stack_of_mixed_dtypes_promotes(device):
    """Stacking arrays of two float dtypes gives promote_types' dtype whatever their order, and no value is
    rounded (as NumPy's and PyTorch's stack): stack([bf16 1.0, f32 1/3]) holds 1/3 in float32."""
    a = nd.array(np.ones(3), dtype="bfloat16", device=device)
    c = nd.array(np.full(3, 1 / 3), device=device)
    for arrays in ([c, a], [a, c]):
        out = nd.stack(arrays)
        assert out.dtype == "float32"
        where = next(i for i, x in enumerate(arrays) if x is c)  # (list.index would compare with NDArray ==)
        np.testing.assert_array_equal(out.numpy()[where], np.full(3, 1 / 3, np.float32))


# ===== 2. astype and the conversion rules ===========================================================================
SPECIAL_F32 = np.array([0x00000000, 0x80000000, 0x3F800000, 0x3F808000, 0x3F818000, 0x3F808001, 0x3F80FFFF,
                        0x7F7FFFFF, 0x7F7F8000, 0x7F7F7FFF, 0xFF7FFFFF, 0x7F800000, 0xFF800000, 0x00000001,
                        0x00008000, 0x00018000, 0x80008001, 0x007FFFFF, 0x477FE000, 0x477FEFFF, 0x477FF000,
                        0x33800000, 0x33000001, 0x33000000, 0x387FC000, 0x38800000, 0xC77FF000],
                       dtype=np.uint32).view(np.float32)  # ties, overflow thresholds, subnormals of each format
NANS_F32 = np.array([0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF800001, 0x7FFFFFFF, 0x7FA00000],
                    dtype=np.uint32).view(np.float32)  # quiet and signalling, with and without payload
QUIET_NANS_F32 = NANS_F32[[0, 1, 4]]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_float32_to_16bit_rounds_to_nearest_even(device, dtype, rng):
    """float32 -> float16/bfloat16 on every device equals ml_dtypes/NumPy bit for bit: ties to even, overflow to
    +-inf (65520 -> inf in float16, max float32 -> inf in bfloat16), subnormals; every NaN stays a NaN."""
    values = np.concatenate([SPECIAL_F32, rng.standard_normal(500).astype(np.float32) * 1e3,
                             rng.standard_normal(500).astype(np.float32) * 1e-6])
    a = nd.array(values, device=device)
    got = a.astype(dtype).numpy()
    with np.errstate(all="ignore"):
        want = values.astype(NP[dtype])
    assert got.dtype == NP[dtype]
    np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))
    nans = nd.array(NANS_F32, device=device).astype(dtype).numpy()
    assert np.isnan(nans.astype(np.float32)).all()
    # the same through a strided source and through setitem into a 16-bit array
    strided = nd.array(values[::-1].copy(), device=device)[::-1]
    np.testing.assert_array_equal(strided.astype(dtype).numpy().view(np.uint16), want.view(np.uint16))
    target = nd.empty(values.shape, dtype=dtype, device=device)
    target[:] = a
    np.testing.assert_array_equal(target.numpy().view(np.uint16), want.view(np.uint16))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("src", ["float16", "bfloat16"])
def test_every_16bit_pattern_converts_exactly(device, src):
    """All 65536 bit patterns of float16/bfloat16: to float32 is exact, back is the identity (NaN stays NaN), and
    to the other 16-bit format equals ml_dtypes' (through float32, which holds both exactly)."""
    bits = np.arange(2**16, dtype=np.uint32).astype(np.uint16)
    values = bits.view(NP[src])
    a = nd.array(values, dtype=src, device=device)
    wide = a.astype("float32")
    want = values.astype(np.float32)
    nan = np.isnan(want)
    np.testing.assert_array_equal(wide.numpy().view(np.uint32)[~nan], want.view(np.uint32)[~nan])
    assert np.isnan(wide.numpy()[nan]).all()
    back = wide.astype(src).numpy().view(np.uint16)
    np.testing.assert_array_equal(back[~nan], bits[~nan])
    other = "bfloat16" if src == "float16" else "float16"
    with np.errstate(all="ignore"):
        want_other = want.astype(NP[other])
    got_other = a.astype(other).numpy()
    np.testing.assert_array_equal(got_other.view(np.uint16)[~nan], want_other.view(np.uint16)[~nan])
    assert np.isnan(got_other[nan].astype(np.float32)).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_same_dtype_copies_are_bit_exact(device, dtype):
    """copy.copy, astype(same dtype) and compact() of a reversed view copy every 16-bit pattern exactly (-0.0,
    subnormals, inf); NaNs stay NaN (the reference may canonicalize a bfloat16 NaN's payload through float32)."""
    import copy

    bits = np.arange(2**16, dtype=np.uint32).astype(np.uint16)
    a = nd.array(bits.view(NP[dtype]), dtype=dtype, device=device)
    assert np.array_equal(a.numpy().view(np.uint16), bits)
    for got, want in ((copy.copy(a), bits), (a.astype(dtype), bits), (a[::-1].compact(), bits[::-1])):
        got = got.numpy()
        nan = np.isnan(want.view(NP[dtype]).astype(np.float32))
        np.testing.assert_array_equal(got.view(np.uint16)[~nan], want[~nan])
        assert np.isnan(got.astype(np.float32)[nan]).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_large_16bit_arrays_take_the_threaded_paths(device, dtype, rng):
    """Past 2**20 elements the C++ element-wise kernels and conversions run on several threads: add, exp, astype
    and round_stochastic of a (2**20 + 37)-element array still equal the reference."""
    n = (1 << 20) + 37
    x = rounded(rng.standard_normal(n), dtype)
    y = rounded(rng.standard_normal(n), dtype)
    check_op(device, dtype, lambda a, b: a + b, np.add, [x, y])
    check_op(device, dtype, lambda a: a.exp(), np.exp, [x])
    wide = rng.standard_normal(n).astype(np.float32)
    got = nd.array(wide, device=device).astype(dtype).numpy()
    np.testing.assert_array_equal(got.view(np.uint16), wide.astype(NP[dtype]).view(np.uint16))
    if dtype == "bfloat16":
        ref = nd.round_stochastic(nd.array(wide, device=REF), 5).numpy().view(np.uint16)
        np.testing.assert_array_equal(nd.round_stochastic(nd.array(wide, device=device), 5).numpy().view(np.uint16),
                                      ref)


@settings(HYPOTHESIS)
@given(bits=st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=64),
       dtype=st.sampled_from(["float16", "bfloat16"]))
def test_property_random_float32_bits_convert_like_ml_dtypes(bits, dtype):
    """Property: any float32 bit pattern converts to float16/bfloat16 on every backend as ml_dtypes/NumPy does."""
    values = np.array(bits, dtype=np.uint32).view(np.float32)
    with np.errstate(all="ignore"):
        want = values.astype(NP[dtype])
    nan = np.isnan(values)
    for device in [d.values[0] for d in DEVICES if d.values[0].enabled()]:
        got = nd.array(values, device=device).astype(dtype).numpy()
        np.testing.assert_array_equal(got.view(np.uint16)[~nan], want.view(np.uint16)[~nan])
        assert np.isnan(got[nan].astype(np.float32)).all()


FLOAT_TO_INT = np.array([0.0, -0.0, 0.99, -0.99, 1.5, -1.5, 2.5, -2.5, 127.9, 128.0, -128.9, -129.0, 255.9, 256.0,
                         -1.0, 3e9, -3e9, 2147483520.0, -2147483648.0, np.inf, -np.inf, np.nan, -np.nan, 65504.0],
                        dtype=np.float32)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("src", FLOATS)
@pytest.mark.parametrize("dst", INTS)
def test_float_to_int_truncates_saturates_and_maps_nan_to_zero(device, src, dst):
    """float -> int8/uint8/int32: toward zero, saturating (inf and 3e9 too), NaN -> 0 — via astype, setitem and
    fill."""
    values = rounded(FLOAT_TO_INT, src)
    want = int_rule(values, dst)
    a = nd.array(values, dtype=src, device=device)
    got = a.astype(dst)
    assert got.dtype == dst and got.numpy().dtype == NP[dst]
    np.testing.assert_array_equal(got.numpy(), want)
    target = nd.empty(values.shape, dtype=dst, device=device)
    target[:] = a
    np.testing.assert_array_equal(target.numpy(), want)
    for v in (300.7, -300.7, -1.7, float("nan"), float("inf"), 42.9):
        f = nd.full((3,), v, dtype=dst, device=device)
        np.testing.assert_array_equal(f.numpy(), int_rule(np.float32(v), dst).repeat(3))
        target[1:3] = v  # scalar_setitem
        assert target.numpy()[1] == int_rule(np.float32(v), dst)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("src", INTS)
@pytest.mark.parametrize("dst", INTS + FLOATS)
def test_int_to_int_saturates_and_int_to_float(device, src, dst):
    """int -> int saturates (uint8 200 -> int8 127, int8 -5 -> uint8 0, int32 1e6 -> uint8 255); int -> float is
    through float32 (large int32 overflow to inf in float16)."""
    info = np.iinfo(NP[src])
    values = np.unique(np.clip(np.array([0, 1, -1, 5, -5, 127, 128, -128, -129, 200, 255, 256, 1000, -1000, 65504,
                                         65520, 10**6, -10**6, 2**24 + 1, 2**24 + 2**16 + 1, 2**31 - 1, -2**31],
                                        dtype=np.int64), info.min, info.max)).astype(NP[src])
    a = nd.array(values, dtype=src, device=device)
    got = a.astype(dst).numpy()
    if dst in INTS:
        dinfo = np.iinfo(NP[dst])
        want = np.clip(values.astype(np.int64), dinfo.min, dinfo.max).astype(NP[dst])
    else:
        with np.errstate(over="ignore"):
            want = values.astype(np.float32).astype(NP[dst])
    assert got.dtype == NP[dst]
    np.testing.assert_array_equal(got.astype(np.float64), want.astype(np.float64))


@pytest.mark.parametrize("device", DEVICES)
def test_fill_and_construction_round_through_float32(device):
    """A Python float becomes a float32 first on every backend, then the storage dtype: 1 + 2**-8 + 2**-30 fills a
    bfloat16 array with 1.0 (the float32 is a tie, to even), not 1 + 2**-7; 1e5 fills float16 with inf."""
    v = 1 + 2.0**-8 + 2.0**-30
    assert float(nd.full((2,), v, dtype="bfloat16", device=device).numpy()[0]) == 1.0
    assert np.isinf(nd.full((2,), 1e5, dtype="float16", device=device).numpy()).all()
    from_f64 = nd.array(np.array([v, 0.1]), dtype="bfloat16", device=device).numpy()
    np.testing.assert_array_equal(from_f64.view(np.uint16),
                                  np.array([v, 0.1]).astype(np.float32).astype(NP["bfloat16"]).view(np.uint16))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOATS + INTS)
def test_numpy_dtype_nbytes_itemsize_and_round_trip(device, dtype, rng):
    """numpy() gives the matching NumPy dtype (ml_dtypes.bfloat16 for bfloat16), also for strided views;
    itemsize/nbytes follow the dtype; astype to the same dtype is a copy; NDArray(x) of an NDArray keeps its dtype;
    a pickle round trip keeps dtype and bits."""
    import pickle

    values = (rng.standard_normal((3, 4)) * 50).astype(np.float32)
    a = nd.array(values, dtype=dtype, device=device)
    assert a.dtype == dtype
    assert a.numpy().dtype == NP[dtype]
    assert a.permute((1, 0)).numpy().dtype == NP[dtype]
    np.testing.assert_array_equal(a.permute((1, 0)).numpy(), a.numpy().T)
    assert a.itemsize == NP[dtype].itemsize and a.nbytes == 12 * NP[dtype].itemsize
    assert a[:, 1:3].nbytes == 6 * NP[dtype].itemsize
    same = a.astype(dtype)
    assert same.buffer is not a.buffer and same.dtype == dtype
    np.testing.assert_array_equal(same.numpy(), a.numpy())
    assert nd.NDArray(a).dtype == dtype
    assert nd.NDArray(a.numpy(), device=device, dtype=dtype).dtype == dtype
    b = pickle.loads(pickle.dumps(a))
    assert b.dtype == dtype and b.device == device
    np.testing.assert_array_equal(b.numpy(), a.numpy())
    assert nd.array(np.asarray(a.numpy()), dtype=None, device=device).dtype == "float32"  # None: float32


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOATS + INTS)
def test_memory_stats_count_size_times_itemsize(device, dtype):
    """Allocating an array of n elements raises current_bytes by n * itemsize (and allocations by one); freeing
    it gives them back."""
    import gc

    gc.collect()
    before = device.memory_stats()
    a = nd.empty((1001,), dtype=dtype, device=device)
    during = device.memory_stats()
    assert during["current_bytes"] - before["current_bytes"] == 1001 * NP[dtype].itemsize
    assert during["allocations"] - before["allocations"] == 1
    assert a.buffer.itemsize == NP[dtype].itemsize and a.buffer.dtype == dtype and a.buffer.size == 1001
    del a
    gc.collect()
    assert device.memory_stats()["current_bytes"] == before["current_bytes"]


def test_unknown_dtypes_raise_type_error():
    """float64, int64, bool or a made-up name are not storage dtypes: TypeError naming the allowed ones."""
    for bad in ("float64", "int64", np.float64, "bool", "float8"):
        with pytest.raises(TypeError, match="bfloat16"):
            nd.empty((2,), dtype=bad, device=REF)
    assert nd.array([1.0], dtype=np.float16, device=REF).dtype == "float16"
    assert nd.array([1.0], dtype=ml_dtypes.bfloat16, device=REF).dtype == "bfloat16"
    assert nd.array([1.0], dtype=np.dtype("uint8"), device=REF).dtype == "uint8"


# ===== 3. round_stochastic ==========================================================================================
def _stochastic_inputs(rng):
    return np.concatenate([
        rng.standard_normal(2000).astype(np.float32),
        (rng.standard_normal(500) * 1e30).astype(np.float32),
        (rng.standard_normal(500) * 1e-39).astype(np.float32),  # subnormals
        SPECIAL_F32, np.array([np.inf, -np.inf, 3.0, -3.0], np.float32)])


@pytest.mark.parametrize("device", DEVICES)
def test_round_stochastic_bits_match_the_reference_and_the_contract(device, rng):
    """Bit-identical on every backend for any seed, including 0 and >= 2**32; the reference matches the contract's
    formula written out with Python ints (upper 16 bits of bits + (lowbias32 hash & 0xFFFF))."""
    values = _stochastic_inputs(rng)
    for seed in (0, 1, 12345, 2**32 + 7, -3):
        ref = nd.round_stochastic(nd.array(values, device=REF), seed).numpy().view(np.uint16)
        got = nd.round_stochastic(nd.array(values, device=device), seed)
        assert got.dtype == "bfloat16" and got.shape == values.shape
        np.testing.assert_array_equal(got.numpy().view(np.uint16), ref)
        finite = np.isfinite(values)
        np.testing.assert_array_equal(ref[finite], lowbias32_bits(values, seed & 0xFFFFFFFF)[finite])
    # a non-compact float32 input is compacted first (same bits as its compact copy)
    m = nd.array(values[:2000].reshape(40, 50), device=device)
    np.testing.assert_array_equal(nd.round_stochastic(m.permute((1, 0)), 3).numpy().view(np.uint16),
                                  nd.round_stochastic(m.permute((1, 0)).compact(), 3).numpy().view(np.uint16))


@pytest.mark.parametrize("device", DEVICES)
def test_round_stochastic_is_one_of_the_two_neighbours_exact_values_and_specials(device, rng):
    """Each result is the bfloat16 just below or just above (in magnitude) the input; bfloat16 values stay exact
    for every seed; NaN stays NaN and +-inf stay +-inf; float16/bfloat16 inputs raise TypeError."""
    x = rng.standard_normal(3000).astype(np.float32)
    got = nd.round_stochastic(nd.array(x, device=device), 11).numpy().view(np.uint16).astype(np.uint32)
    down = (x.view(np.uint32) >> 16)  # truncation toward zero (same sign)
    assert np.all((got == down) | (got == down + 1))
    exact = rounded(x, "bfloat16")
    for seed in range(5):
        np.testing.assert_array_equal(nd.round_stochastic(nd.array(exact, device=device), seed).numpy().astype(
            np.float32), exact)
    specials = np.concatenate([QUIET_NANS_F32, np.array([np.inf, -np.inf], np.float32)])
    out = nd.round_stochastic(nd.array(specials, device=device), 9).numpy().astype(np.float32)
    assert np.isnan(out[:3]).all()
    np.testing.assert_array_equal(out[3:], [np.inf, -np.inf])
    for dtype in ("float16", "bfloat16", "int32"):
        with pytest.raises(TypeError, match="float32"):
            nd.round_stochastic(nd.array(x, dtype=dtype, device=device), 0)


@pytest.mark.parametrize("device", DEVICES)
def test_round_stochastic_of_signalling_nans_is_silent_nan(device):
    """Signalling NaNs (0x7F800001, 0x7FA00000, ...) round to NaN without a warning, as astype converts them."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = nd.round_stochastic(nd.array(NANS_F32, device=device), 3).numpy().astype(np.float32)
        silent = nd.array(NANS_F32, device=device).astype("bfloat16").numpy().astype(np.float32)
    assert np.isnan(out).all() and np.isnan(silent).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("value", [1.0 + 0.3 * 2.0**-7, -5.3e-3, 1234.567, 3.0e-20])
def test_round_stochastic_is_unbiased(device, value):
    """The mean of many stochastic roundings of one value (100 000 elements of one array, and one element over
    2000 seeds) is within 5 standard errors of the value; rounding to nearest is off by a fraction of a step."""
    x = np.float32(value)
    lo = np.array([x], np.float32).astype(NP["bfloat16"])  # any neighbour gives the step
    step = abs(float(np.nextafter(lo, np.array([np.inf], NP["bfloat16"]))[0]) - float(lo[0])) or 2.0**-133
    n = 100_000
    means = [nd.round_stochastic(nd.array(np.full(n, x), device=device), 4).numpy().astype(np.float64).mean()]
    per_seed = [nd.round_stochastic(nd.array(np.full(1, x), device=device), s).numpy()[0] for s in range(2000)]
    means.append(np.mean(np.array(per_seed).astype(np.float64)))
    for mean, count in zip(means, (n, 2000)):
        stderr = step * 0.5 / math.sqrt(count)
        assert abs(mean - float(x)) < 5 * stderr + 1e-3 * step, (mean, float(x), stderr)
    nearest = float(np.float32(value).astype(NP["bfloat16"]))
    assert abs(means[0] - float(x)) < abs(nearest - float(x))


def test_round_stochastic_seeds_give_different_noise():
    """Different seeds give different roundings; one seed gives the same roundings twice."""
    x = nd.array(np.full(256, 1.0 + 0.5 * 2.0**-7, np.float32), device=CPU)
    a, b, c = (nd.round_stochastic(x, s).numpy().view(np.uint16) for s in (1, 2, 1))
    np.testing.assert_array_equal(a, c)
    assert (a != b).any()


# ===== 4. integer dtypes are storage ================================================================================
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", INTS)
def test_integer_arrays_refuse_arithmetic(device, dtype):
    """add, mul, sub, div, scalar ops, comparisons, matmul, sum, max, logsumexp, exp, log on an integer array raise
    a TypeError naming the operation and the dtype (and saying to convert first)."""
    a = nd.array(np.arange(6).reshape(2, 3), dtype=dtype, device=device)
    b = nd.array(np.arange(6).reshape(3, 2), dtype=dtype, device=device)
    cases = [("add", lambda: a + a), ("mul", lambda: a * a), ("add", lambda: a + 1), ("mul", lambda: a * 2.0),
             ("div", lambda: a / 2), ("ge", lambda: a >= 1), ("power", lambda: a ** 2),
             ("maximum", lambda: a.maximum(0)), ("matmul", lambda: a @ b), ("sum", lambda: a.sum()),
             ("max", lambda: a.max(axis=0)), ("logsumexp", lambda: a.logsumexp()), ("exp", lambda: a.exp()),
             ("log", lambda: a.log()), ("tanh", lambda: a.permute((1, 0)).tanh())]
    for name, fn in cases:
        with pytest.raises(TypeError, match=f"(?s){name}.*{dtype}.*astype"):
            fn()
    with pytest.raises(TypeError, match=dtype):
        a + a.astype("float32")
    with pytest.raises(TypeError, match=dtype):
        a - a
    # the backend refuses them too (the contract), never computing garbage
    out = nd.empty((2, 3), dtype=dtype, device=device)
    with pytest.raises(TypeError):
        device.mod.ewise_add(a.buffer, a.buffer, out.buffer)
    with pytest.raises(TypeError):
        device.mod.reduce_sum(a.buffer, nd.empty((2,), dtype=dtype, device=device).buffer, 3)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", INTS)
def test_integer_arrays_support_storage_operations(device, dtype, rng):
    """astype (both ways), setitem of arrays and scalars, fill, views (permute, slice, broadcast, reshape, flip,
    pad, stack), numpy() and take_rows (as the indices and as the table)."""
    values = rng.integers(0, 100, size=(4, 5)).astype(NP[dtype])
    a = nd.array(values, dtype=dtype, device=device)
    np.testing.assert_array_equal(a.numpy(), values)
    np.testing.assert_array_equal(a.astype("float32").numpy(), values.astype(np.float32))
    np.testing.assert_array_equal(a.astype("bfloat16").astype(dtype).numpy(), values)
    np.testing.assert_array_equal(a.permute((1, 0)).compact().numpy(), values.T)
    np.testing.assert_array_equal(a[1:3, ::2].numpy(), values[1:3, ::2])
    np.testing.assert_array_equal(a[0:1].broadcast_to((3, 5)).compact().numpy(), np.broadcast_to(values[0:1], (3, 5)))
    np.testing.assert_array_equal(a.reshape((5, 4)).numpy(), values.reshape(5, 4))
    np.testing.assert_array_equal(a.flip((0,)).numpy(), values[::-1])
    np.testing.assert_array_equal(a.pad(((1, 0), (0, 1))).numpy(), np.pad(values, ((1, 0), (0, 1))))
    np.testing.assert_array_equal(nd.stack([a, a], axis=0).numpy(), np.stack([values, values]))
    b = nd.array(values, dtype=dtype, device=device)
    b[0, :] = 7
    b[1:3, 1:3] = nd.array(np.full((2, 2), 9), dtype=dtype, device=device)
    b[3, :] = nd.array(np.full(5, 12.9, np.float32), device=device)  # a float32 array, truncated on store
    want = values.copy()
    want[0, :], want[1:3, 1:3], want[3, :] = 7, 9, 12
    np.testing.assert_array_equal(b.numpy(), want)
    b.fill(3)
    assert (b.numpy() == 3).all() and b.dtype == dtype
    table = nd.array(rng.standard_normal((6, 3)).astype(np.float32), dtype="bfloat16", device=device)
    ids = nd.array(np.array([5, 0, 2, 2]), dtype=dtype, device=device)
    np.testing.assert_array_equal(nd.take_rows(table, ids).numpy(), table.numpy()[[5, 0, 2, 2]])
    np.testing.assert_array_equal(nd.take_rows(a, nd.array(np.array([3, 1]), dtype="int32", device=device)).numpy(),
                                  values[[3, 1]])
    with pytest.raises(IndexError):
        nd.take_rows(table, nd.array(np.array([6]), dtype=dtype, device=device))


def test_integer_tensors_refuse_arithmetic_but_store():
    """A Tensor of integers (labels) keeps its dtype; arithmetic on it raises TypeError; astype converts."""
    y = ndl.Tensor(np.array([0, 2, 1]), dtype="int32", device=CPU, requires_grad=False)
    assert y.dtype == "int32"
    with pytest.raises(TypeError, match="int32"):
        y + y
    assert y.astype("float32").dtype == "float32"
    np.testing.assert_array_equal(y.astype("float32").numpy(), [0, 2, 1])
