"""Dtypes and mixed precision: float32, float16, bfloat16 (floating) and int8, uint8, int32 (storage only).

The rule under test (src/README.md, "Dtypes"): arithmetic is float32 whatever the storage, so a 16-bit op is
round16(float32 op). The NumPy reference backend (`cpu_numpy()`) is the oracle; it is itself checked against
`np_op(x.astype(float32)).astype(dtype)` (ml_dtypes for bfloat16), and the compiled backends (`cpu()`, `cuda()`
when a GPU is present) must agree with it within TOLERANCE. Topics, in order:

1. every NDArray op in every float dtype vs the reference, promotion;
2. astype and the conversion rules, numpy(), nbytes/itemsize, memory statistics;
3. round_stochastic;
4. integer dtypes: storage only;
5. Tensors: dtype=, astype (differentiable), init, the course's idioms;
6. autocast (and checkpointing under it);
7. GradScaler;
8. optimizers: master weights and stochastic rounding;
9. float32 is still the default everywhere.
"""
import math

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import needle as ndl
from needle import autograd, init, nn, ops, optim
from needle import backend_ndarray as nd

from conftest import DEVICES

# How far a compiled backend (cpu, cuda) may be from the reference, per dtype: rtol = 1 ulp of the dtype at 1.0
# (machine epsilon, so at least one ulp of every normal value), plus a small atol for results near zero, where
# float32 accumulation order (sums, matmuls) and cancellation decide the last bits. float32 gets a few ulp:
# exp/log/tanh are within ~1-2 ulp of the exact result and sums/matmuls accumulate in another order.
TOLERANCE = {
    "float32": dict(rtol=8 * 2.0**-23, atol=1e-5),
    "float16": dict(rtol=2.0**-10, atol=1e-4),
    "bfloat16": dict(rtol=2.0**-7, atol=1e-3),
}
FLOATS = ["float32", "float16", "bfloat16"]
INTS = ["int8", "uint8", "int32"]
NP = {"float32": np.dtype(np.float32), "float16": np.dtype(np.float16), "bfloat16": np.dtype(ml_dtypes.bfloat16),
      "int8": np.dtype(np.int8), "uint8": np.dtype(np.uint8), "int32": np.dtype(np.int32)}
REF = nd.cpu_numpy()
CPU = nd.cpu() if nd.cpu().enabled() else nd.cpu_numpy()  # the device models train on
HYPOTHESIS = settings(derandomize=True, max_examples=25, deadline=None, database=None,
                      suppress_health_check=[HealthCheck.too_slow])


# ----- helpers ------------------------------------------------------------------------------------------------------
def rounded(values, dtype):
    """float32 values rounded to `dtype` and back to float32: inputs every dtype holds exactly."""
    with np.errstate(over="ignore", invalid="ignore"):  # float16 overflow to inf is wanted here
        return np.asarray(values, dtype=np.float32).astype(NP[dtype]).astype(np.float32)


def oracle(values, dtype):
    """The rule: float32 results rounded once to `dtype` (ml_dtypes for bfloat16)."""
    with np.errstate(all="ignore"):
        return np.asarray(values, dtype=np.float32).astype(NP[dtype])


def as64(a):
    """An NDArray's (or numpy array's) values as float64, for comparisons."""
    return np.asarray(a.numpy() if isinstance(a, nd.NDArray) else a).astype(np.float64)


def assert_close(ours, expected, dtype):
    """`ours` (an NDArray) has `dtype` and is within TOLERANCE[dtype] of `expected` (NaN where it is NaN)."""
    assert isinstance(ours, nd.NDArray)
    assert ours.dtype == dtype, (ours.dtype, dtype)
    assert ours.numpy().dtype == NP[dtype]
    expected = as64(expected)
    assert ours.shape == expected.shape, (ours.shape, expected.shape)
    np.testing.assert_allclose(as64(ours), expected, equal_nan=True, **TOLERANCE[dtype])


def assert_exact(ours, expected, dtype):
    """`ours` (an NDArray) has `dtype` and exactly the values of `expected` (NaN where it is NaN)."""
    assert ours.dtype == dtype, (ours.dtype, dtype)
    assert ours.numpy().dtype == NP[dtype]
    np.testing.assert_array_equal(as64(ours), as64(expected))


def check_op(device, dtype, fn_nd, fn_np, arrays, exact_reference=True):
    """Apply `fn_nd` to the NDArrays built from `arrays` (float32 numpy arrays, already representable in `dtype`,
    or (array, view function) pairs) on the reference and on `device`:
    the reference must equal fn_np(float32 inputs) rounded to `dtype` (exactly for element-wise ops, within
    TOLERANCE for reductions and matmuls, whose float32 accumulation order is NumPy's), and `device` must be
    within TOLERANCE of the reference."""
    arrays = [a if isinstance(a, tuple) else (a, lambda v: v) for a in arrays]
    expected = oracle(fn_np(*[view(base) for base, view in arrays]), dtype)
    ref = fn_nd(*[view(nd.array(base, dtype=dtype, device=REF)) for base, view in arrays])
    if exact_reference:
        assert_exact(ref, expected, dtype)
    else:
        assert_close(ref, expected, dtype)
    if device != REF:
        ours = fn_nd(*[view(nd.array(base, dtype=dtype, device=device)) for base, view in arrays])
        assert_close(ours, ref.numpy(), dtype)
    return ref


def layout(shape, name):
    """(base shape, view function usable on numpy arrays and NDArrays) for a non-compact view of `shape`."""
    shape = tuple(shape)
    if name == "compact":
        return shape, lambda a: a
    if name == "permuted":  # stored with the axes reversed, then permuted back
        axes = tuple(reversed(range(len(shape))))
        return shape[::-1], lambda a: a.permute(axes) if isinstance(a, nd.NDArray) else a.transpose(axes)
    if name == "sliced":  # every other element of a bigger buffer, from an offset
        idx = tuple(slice(1, 1 + 2 * n, 2) for n in shape)
        return tuple(2 * n + 3 for n in shape), lambda a: a[idx]
    if name == "broadcast":  # the first axis repeated with stride 0
        return (1,) + shape[1:], lambda a: a.broadcast_to(shape) if isinstance(a, nd.NDArray) \
            else np.broadcast_to(a, shape)
    raise AssertionError(name)


def operand(rng, shape, name, dtype, kind="normal"):
    """(float32 base representable in dtype, view function) of the given layout."""
    base_shape, view = layout(shape, name)
    draw = {"normal": lambda s: rng.standard_normal(s),
            "positive": lambda s: rng.uniform(0.5, 2.0, s),
            "nonzero": lambda s: rng.uniform(0.5, 2.0, s) * rng.choice([-1.0, 1.0], s),
            "discrete": lambda s: rng.integers(-2, 3, s) * 0.5}[kind]  # many ties, for comparisons
    return rounded(draw(base_shape), dtype), view


def lowbias32_bits(values, seed):
    """round_stochastic's bits written from the contract's words alone (Python ints), for finite values."""
    out = []
    for i, v in enumerate(np.asarray(values, dtype=np.float32).view(np.uint32).tolist()):
        h = (i ^ ((seed * 0x9E3779B9) & 0xFFFFFFFF)) & 0xFFFFFFFF
        h ^= h >> 16
        h = (h * 0x7FEB352D) & 0xFFFFFFFF
        h ^= h >> 15
        h = (h * 0x846CA68B) & 0xFFFFFFFF
        h ^= h >> 16
        out.append(((v + (h & 0xFFFF)) & 0xFFFFFFFF) >> 16)
    return np.array(out, dtype=np.uint16)


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


@pytest.fixture(params=["default", "generic", "avx2", "avx512"])
def vector_isa(request, device):
    """The C++ exp/log/tanh/sum/max kernels of each instruction set this CPU runs (16-bit loads/stores included)."""
    yield from _switch(device, request, "vector_isa", "set_vector_isa")


@pytest.fixture(params=["default", "generic", "avx2", "avx512"])
def matmul_kernel(request, device):
    """The C++ matmul micro-kernels (each has its own 16-bit packing) this CPU runs."""
    yield from _switch(device, request, "matmul_kernel", "set_matmul_kernel")


@pytest.fixture(autouse=True)
def _no_autocast_leaks():
    """Every test starts and ends outside autocast (a failing test must not leave it on for the next)."""
    autograd.set_autocast(None)
    yield
    autograd.set_autocast(None)


# ===== 1. every op in every float dtype vs the reference ============================================================
EWISE = {
    "add": (lambda a, b: a + b, np.add, "normal"),
    "sub": (lambda a, b: a - b, np.subtract, "normal"),
    "mul": (lambda a, b: a * b, np.multiply, "normal"),
    "div": (lambda a, b: a / b, np.divide, "nonzero"),
    "power": (lambda a, b: a ** b, np.power, "positive"),
    "maximum": (lambda a, b: a.maximum(b), np.maximum, "normal"),
    "eq": (lambda a, b: a == b, np.equal, "discrete"),
    "ge": (lambda a, b: a >= b, np.greater_equal, "discrete"),
    "gt": (lambda a, b: a > b, np.greater, "discrete"),
    "ne": (lambda a, b: a != b, np.not_equal, "discrete"),
    "lt": (lambda a, b: a < b, np.less, "discrete"),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("name", list(EWISE))
@pytest.mark.parametrize("layouts", [("compact", "compact"), ("permuted", "sliced"), ("broadcast", "compact")],
                         ids="-".join)
def test_ewise_ops_every_dtype(device, dtype, name, layouts, rng):
    """a op b in `dtype` (compact or strided views) is round(float32 op) on the reference, and within one ulp of
    it on the compiled backends; the result keeps the dtype."""
    ours, theirs, kind = EWISE[name]
    shape = (4, 5, 6)
    a = operand(rng, shape, layouts[0], dtype, kind if kind in ("positive", "discrete") else "normal")
    b = operand(rng, shape, layouts[1], dtype, kind if kind != "positive" else "normal")
    check_op(device, dtype, ours, theirs, [a, b])


SCALAR = {
    "add": (lambda a, s: a + s, lambda a, s: a + s),
    "radd": (lambda a, s: s + a, lambda a, s: s + a),
    "sub": (lambda a, s: a - s, lambda a, s: a - s),
    "rsub": (lambda a, s: s - a, lambda a, s: s - a),
    "mul": (lambda a, s: a * s, lambda a, s: a * s),
    "div": (lambda a, s: a / s, lambda a, s: a / s),
    "power": (lambda a, s: abs_base(a) ** s, lambda a, s: np.abs(a) ** s),
    "maximum": (lambda a, s: a.maximum(s), np.maximum),
    "eq": (lambda a, s: a == s, np.equal),
    "ge": (lambda a, s: a >= s, np.greater_equal),
    "gt": (lambda a, s: a > s, np.greater),
    "neg": (lambda a, s: -a, lambda a, s: -a),
}


def abs_base(a):
    """|a| computed by needle itself (maximum(a, -a)), so power gets a positive base on both sides."""
    return a.maximum(-a)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("name", list(SCALAR))
@pytest.mark.parametrize("scalar", [0.5, -1.3, 3], ids=repr)
@pytest.mark.parametrize("lay", ["compact", "permuted"])
def test_scalar_ops_every_dtype(device, dtype, name, scalar, lay, rng):
    """a op python_scalar keeps a's dtype (Python numbers never promote) and is round(float32(a) op float32(s))."""
    ours, theirs = SCALAR[name]
    base, view = operand(rng, (3, 4, 5), lay, dtype)
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


@pytest.mark.parametrize("device", DEVICES)
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
            ours, theirs, _ = EWISE[name]
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


@pytest.mark.parametrize("device", DEVICES)
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


@pytest.mark.parametrize("device", DEVICES)
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
    ours, theirs, _ = EWISE[op]
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


def int_rule(values, dtype):
    """The contract: drop the fraction, saturate at the type's range, NaN -> 0."""
    info = np.iinfo(NP[dtype])
    wide = np.nan_to_num(np.asarray(values, np.float64), nan=0.0, posinf=info.max, neginf=info.min)
    return np.clip(np.trunc(wide), info.min, info.max).astype(NP[dtype])


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


# ===== 5. Tensors ==================================================================================================
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOATS + INTS)
def test_tensor_dtype_construction(device, dtype, rng):
    """ndl.Tensor(x, dtype=...) stores x (any NumPy dtype) converted by the contract's rules; t.dtype and
    t.numpy().dtype say so; Tensor(t) keeps the dtype; Tensor(t, dtype=other) converts."""
    x = rng.standard_normal((3, 4)) * 10
    t = ndl.Tensor(x, dtype=dtype, device=device)
    assert t.dtype == dtype and t.numpy().dtype == NP[dtype] and t.device == device
    if dtype in FLOATS:
        np.testing.assert_array_equal(t.numpy(), x.astype(np.float32).astype(NP[dtype]))
    else:
        np.testing.assert_array_equal(t.numpy(), int_rule(x.astype(np.float32), dtype))
    assert ndl.Tensor(t).dtype == dtype
    assert ndl.Tensor(t, dtype="float32").dtype == "float32"
    assert ndl.Tensor(t.numpy(), device=device).dtype == "float32"  # from NumPy without dtype=: float32


@pytest.mark.parametrize("src,dst", [("float32", "bfloat16"), ("float32", "float16"), ("bfloat16", "float32"),
                                     ("float16", "bfloat16")])
def test_tensor_astype_is_differentiable(src, dst, rng):
    """t.astype(dst) rounds like NDArray.astype, and the gradient comes back in t's dtype: d(sum(3 * t.astype))
    is 3 everywhere; a chain through another dtype gives the input dtype's gradient; astype to t's own dtype is t."""
    x = rounded(rng.standard_normal((4, 3)), src)
    t = ndl.Tensor(x, dtype=src, device=CPU)
    c = t.astype(dst)
    assert c.dtype == dst
    np.testing.assert_array_equal(c.numpy(), x.astype(NP[dst]))
    (c * 3.0).sum().backward()
    assert t.grad.dtype == src
    np.testing.assert_array_equal(t.grad.numpy().astype(np.float32), np.full((4, 3), 3.0, np.float32))
    assert t.astype(src) is t
    u = ndl.Tensor(x, dtype=src, device=CPU)
    w = ndl.Tensor(rounded(rng.standard_normal((3, 2)), dst), dtype=dst, device=CPU)
    out = (u.astype(dst) @ w).sum()
    out.backward()
    assert u.grad.dtype == src and w.grad.dtype == dst
    expected = np.broadcast_to(w.numpy().astype(np.float32).sum(axis=1), (4, 3))
    coarser = "bfloat16" if "bfloat16" in (src, dst) else "float16"
    np.testing.assert_allclose(u.grad.numpy().astype(np.float32), expected, **TOLERANCE[coarser])


def test_mixed_dtype_tensor_op_gradients_come_back_in_each_inputs_dtype(rng):
    """bf16 * f32 computes in float32; the bf16 input's gradient is bfloat16: each contribution (b from the
    product, 1 from the sum) is cast to bfloat16 and they are added in bfloat16; the f32 input's is float32."""
    a = ndl.Tensor(rounded(rng.standard_normal((3, 3)), "bfloat16"), dtype="bfloat16", device=CPU)
    b = ndl.Tensor(rng.standard_normal((3, 3)).astype(np.float32), device=CPU)
    out = (a * b + a).sum()
    assert (a * b).dtype == "float32" and out.dtype == "float32"
    out.backward()
    assert a.grad.dtype == "bfloat16" and b.grad.dtype == "float32"
    np.testing.assert_array_equal(a.grad.numpy(), oracle(rounded(b.numpy(), "bfloat16") + 1, "bfloat16"))
    np.testing.assert_array_equal(b.grad.numpy(), a.numpy().astype(np.float32))
    h = ndl.Tensor(rounded(rng.standard_normal((3, 3)), "float16"), dtype="float16", device=CPU)
    s = (h * 0.5 + a @ h).sum()  # bf16 @ f16 -> float32
    s.backward()
    assert h.grad.dtype == "float16" and a.grad.dtype == "bfloat16"


@pytest.mark.parametrize("dtype", FLOATS)
def test_init_functions_take_a_dtype(dtype):
    """init.rand/randn/zeros/ones(..., dtype=) give that dtype; rand/randn draw the float32 numbers of the same
    seed and round them (so seeded models match across dtypes); nn layers built with dtype= hold it."""
    for name in ("rand", "randn"):
        np.random.seed(0)
        t = getattr(init, name)(3, 4, dtype=dtype, device=CPU)
        np.random.seed(0)
        f = getattr(init, name)(3, 4, device=CPU)
        assert t.dtype == dtype and f.dtype == "float32"
        np.testing.assert_array_equal(t.numpy(), f.numpy().astype(NP[dtype]))
    assert init.zeros(2, 3, dtype=dtype, device=CPU).dtype == dtype
    ones = init.ones(2, 3, dtype=dtype, device=CPU)
    assert ones.dtype == dtype and (ones.numpy().astype(np.float32) == 1).all()
    assert init.zeros_like(ones).dtype == dtype and init.ones_like(ones).dtype == dtype
    lin = nn.Linear(4, 3, device=CPU, dtype=dtype)
    assert all(p.dtype == dtype for p in lin.parameters())


def test_course_idiom_cached_data_astype_numpy_types():
    """`t.cached_data.astype(np.uint8)` (and other NumPy type objects) works: NDArray.astype takes NumPy dtypes."""
    t = ndl.Tensor(np.array([[0.0, 1.9, 255.5, 300.0, -4.0]]), device=CPU)
    u = t.cached_data.astype(np.uint8)
    assert u.dtype == "uint8"
    np.testing.assert_array_equal(u.numpy(), [[0, 1, 255, 255, 0]])
    assert t.cached_data.astype(np.float16).dtype == "float16"
    assert t.cached_data.astype(ml_dtypes.bfloat16).dtype == "bfloat16"
    assert t.cached_data.astype(np.dtype("int32")).dtype == "int32"


def test_module_astype_keeps_parameter_identity():
    """Module.astype("bfloat16") converts every floating parameter and buffer in place (same objects) and
    returns the module; astype back restores float32 storage (rounded values)."""
    np.random.seed(0)
    model = nn.Sequential(nn.Linear(4, 5, device=CPU), nn.BatchNorm1d(5, device=CPU), nn.Linear(5, 2, device=CPU))
    params = model.parameters()
    before = [p.numpy().copy() for p in params]
    assert model.astype("bfloat16") is model
    assert [id(p) for p in model.parameters()] == [id(p) for p in params]
    for p, b in zip(params, before):
        assert p.dtype == "bfloat16"
        np.testing.assert_array_equal(p.numpy(), b.astype(NP["bfloat16"]))
    assert all(t.dtype == "bfloat16" for _, t in model.named_buffers())
    model.astype("float32")
    assert all(p.dtype == "float32" for p in params)


@pytest.mark.parametrize("dtype,length", [("bfloat16", 300), ("float16", 2100)])
def test_16bit_transformer_gathers_the_right_positional_embeddings(dtype, length):
    """A Transformer built in (or converted to) a 16-bit dtype adds position t's embedding row to step t for every
    t < sequence_len: with no layers and a zero input, the output is exactly the embedding table."""
    np.random.seed(0)
    model = nn.Transformer(4, 8, 0, num_head=1, dim_head=4, device=CPU, sequence_len=length + 64,
                           batch_first=True)
    model.astype(dtype)
    x = ndl.Tensor(np.zeros((1, length, 4)), dtype=dtype, device=CPU, requires_grad=False)
    out, _ = model(x)
    np.testing.assert_array_equal(out.numpy()[0], model.positional_embedding.weight.numpy()[:length])


# ===== 6. autocast =================================================================================================
def _mlp(seed=0):
    np.random.seed(seed)
    return nn.Sequential(nn.Linear(8, 16, device=CPU), nn.LayerNorm1d(16, device=CPU), nn.ReLU(),
                         nn.Linear(16, 4, device=CPU))


def _data(seed=1, n=12):
    rs = np.random.RandomState(seed)
    x = ndl.Tensor(rs.randn(n, 8).astype(np.float32), device=CPU, requires_grad=False)
    y = ndl.Tensor(rs.randint(0, 4, size=n).astype(np.float32), device=CPU, requires_grad=False)
    return x, y


def _mlp_loss_and_grads(dtype, gc=False, lazy=False):
    model = _mlp()
    if gc:
        model.enable_gc()
    x, y = _data()
    with ndl.autocast(dtype or "bfloat16", enabled=dtype is not None), autograd.lazy_mode(lazy):
        logits = model(x)
        loss = nn.SoftmaxLoss()(logits, y)
        loss.backward()
    return logits.dtype, loss, [p.grad for p in model.parameters()], model


def test_autocast_op_dtypes():
    """Inside autocast("bfloat16"/"float16"): a matmul (and element-wise arithmetic) of float32 tensors gives the
    low dtype; summation, logsumexp, logsoftmax and the softmax loss give float32; outside, float32 again;
    autocast rejects float32 and nests/turns off with enabled=False."""
    rs = np.random.RandomState(0)
    a = ndl.Tensor(rs.randn(3, 4).astype(np.float32), device=CPU)
    b = ndl.Tensor(rs.randn(4, 5).astype(np.float32), device=CPU)
    y = ndl.Tensor(np.array([0.0, 4.0, 2.0]), device=CPU, requires_grad=False)
    for low in ("bfloat16", "float16"):
        with ndl.autocast(low):
            assert ndl.amp.is_autocast_enabled()
            m = a @ b
            assert m.dtype == low
            assert (a * a + 1.0).dtype == low and ndl.exp(a).dtype == low and ndl.relu(a).dtype == low
            assert ndl.summation(m).dtype == "float32"
            assert ndl.logsumexp(m, axes=(1,)).dtype == "float32"
            assert ndl.logsoftmax(m).dtype == "float32"
            assert nn.SoftmaxLoss()(m, y).dtype == "float32"
            labels = y.astype("int32")  # integer labels: storage, never cast by autocast
            assert labels.dtype == "int32"
            assert nn.SoftmaxLoss()(m, labels).numpy() == nn.SoftmaxLoss()(m, y).numpy()
            with ndl.autocast(low, enabled=False):
                assert (a @ b).dtype == "float32" and not ndl.amp.is_autocast_enabled()
            assert (a @ b).dtype == low
            np.testing.assert_allclose(m.numpy().astype(np.float32), a.numpy() @ b.numpy(), rtol=2**-7 * 4,
                                       atol=2e-2)
        assert not ndl.amp.is_autocast_enabled() and (a @ b).dtype == "float32"
    with pytest.raises(ValueError):
        ndl.autocast("float32")


def test_autocast_is_entered_and_left_through_autograd_set_autocast(monkeypatch):
    """amp.autocast changes the active context only through autograd.set_autocast (which returns the previous
    one), restoring it on exit, nested blocks included; autograd.active_autocast reads it."""
    entered = []
    real = autograd.set_autocast

    def recording(context):
        entered.append(context)
        return real(context)

    monkeypatch.setattr(autograd, "set_autocast", recording)
    monkeypatch.setattr(ndl.amp, "set_autocast", recording)
    outer, off = ndl.autocast("bfloat16"), ndl.autocast("float16", enabled=False)
    with outer:
        assert autograd.active_autocast() is outer
        with off:
            assert autograd.active_autocast() is None
        assert autograd.active_autocast() is outer
    assert autograd.active_autocast() is None
    assert entered == [outer, None, outer, None]
    assert real(outer) is None and real(None) is outer  # the setter returns the previous context


def test_tensor_tuple_ops_apply_autocast_too():
    """TensorTupleOp casts its inputs under autocast as TensorOp does (attention needs no code of its own): a
    tuple op declaring autocast="low" sees 16-bit inputs, one declaring nothing its inputs' dtype."""
    seen = []

    class Pair(autograd.TensorTupleOp):
        def compute(self, a, b):
            seen.append((str(a.dtype), str(b.dtype)))
            return a, b

    class LowPair(Pair):
        autocast = "low"

    rs = np.random.RandomState(0)
    a, b = (ndl.Tensor(rs.randn(2, 3).astype(np.float32), device=CPU) for _ in range(2))
    with ndl.autocast("bfloat16"):
        LowPair()(a, b).realize_cached_data()
        Pair()(a, b).realize_cached_data()
    LowPair()(a, b).realize_cached_data()
    assert seen == [("bfloat16", "bfloat16"), ("float32", "float32"), ("float32", "float32")]


@pytest.mark.parametrize("low,rtol", [("bfloat16", 4e-2), ("float16", 5e-3)])
def test_autocast_mlp_matches_float32(low, rtol):
    """An MLP with LayerNorm under autocast: low-dtype logits, float32 loss, float32 parameter gradients (the
    parameters stay float32), all within the 16-bit format's tolerance of the float32 run."""
    dt32, loss32, grads32, model32 = _mlp_loss_and_grads(None)
    dt16, loss16, grads16, model16 = _mlp_loss_and_grads(low)
    assert dt32 == "float32" and dt16 == low
    assert loss16.dtype == "float32"
    assert all(p.dtype == "float32" for p in model16.parameters())
    assert abs(float(loss16.numpy()) - float(loss32.numpy())) <= rtol * abs(float(loss32.numpy()))
    for g16, g32 in zip(grads16, grads32):
        assert g16.dtype == "float32"
        scale = np.abs(g32.numpy()).max()
        np.testing.assert_allclose(g16.numpy(), g32.numpy(), atol=rtol * scale * 2)


def _transformer_run(low, gc=False, dropout=0.0, backward_inside=True, lazy=False):
    np.random.seed(0)
    model = nn.Transformer(8, 16, 2, num_head=2, dim_head=4, device=CPU, sequence_len=8, dropout=dropout)
    if gc:
        model.enable_gc()
    rs = np.random.RandomState(1)
    x = ndl.Tensor(rs.randn(5, 2, 8).astype(np.float32), device=CPU, requires_grad=False)
    np.random.seed(2)  # dropout masks: the same draws with gc on and off
    with ndl.autocast(low or "bfloat16", enabled=low is not None), autograd.lazy_mode(lazy):
        out, _ = model(x)
        loss = (out * out).sum() / 80.0
        if backward_inside:
            loss.backward()
    if not backward_inside:
        with autograd.lazy_mode(lazy):
            loss.backward()
    return loss, [p.grad for p in model.parameters()]


@pytest.mark.parametrize("low,rtol", [("bfloat16", 5e-2), ("float16", 5e-3)])
def test_autocast_transformer_matches_float32(low, rtol):
    """nn.Transformer under autocast: float32 loss and parameter gradients, close to the float32 run's (gradients
    compared on the scale of the largest gradient: some are exactly 0 in float32, e.g. the key LayerNorm's bias,
    to which softmax is invariant, and only rounding noise in 16 bits)."""
    loss32, grads32 = _transformer_run(None)
    loss16, grads16 = _transformer_run(low)
    assert loss16.dtype == "float32"
    assert abs(float(loss16.numpy()) - float(loss32.numpy())) <= rtol * abs(float(loss32.numpy()))
    scale = max(np.abs(g.numpy()).max() for g in grads32)
    for g16, g32 in zip(grads16, grads32):
        assert g16.dtype == "float32"
        np.testing.assert_allclose(g16.numpy(), g32.numpy(), atol=rtol * scale)


@pytest.mark.filterwarnings("ignore::needle.checkpoint.NothingToDropWarning")  # one-op layers: nothing to drop
@pytest.mark.parametrize("low", [None, "bfloat16", "float16"], ids=["float32", "bf16", "fp16"])
@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
def test_checkpointing_under_autocast_is_exact(low, lazy):
    """enable_gc() recomputes the dropped activations (and their casts) bit for bit: the loss and every gradient
    equal gc off exactly, in float32 and in mixed bf16/fp16 (MLP with LayerNorm, eager and lazy)."""
    _, loss_off, grads_off, _ = _mlp_loss_and_grads(low)
    _, loss_on, grads_on, _ = _mlp_loss_and_grads(low, gc=True, lazy=lazy)
    assert np.array_equal(loss_off.numpy(), loss_on.numpy())
    for a, b in zip(grads_off, grads_on):
        assert a.dtype == b.dtype == "float32"
        assert np.array_equal(a.numpy(), b.numpy())


@pytest.mark.parametrize("low", [None, "bfloat16", "float16"], ids=["float32", "bf16", "fp16"])
@pytest.mark.parametrize("backward_inside", [True, False], ids=["backward-in-block", "backward-after-block"])
@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
def test_checkpointing_transformer_under_autocast_is_exact(low, backward_inside, lazy):
    """The same for nn.Transformer (attention, LayerNorm, MLP blocks, dropout 0.1) with gc on: loss and gradients
    bit-identical to gc off, whether backward runs inside the autocast block or after it, eager or lazy."""
    kwargs = dict(dropout=0.1, backward_inside=backward_inside, lazy=lazy)
    loss_off, grads_off = _transformer_run(low, **kwargs)
    loss_on, grads_on = _transformer_run(low, gc=True, **kwargs)
    assert np.array_equal(loss_off.numpy(), loss_on.numpy())
    for a, b in zip(grads_off, grads_on):
        assert np.array_equal(a.numpy(), b.numpy())


def test_autocast_block_reused_for_two_steps_sees_updated_weights():
    """The 16-bit copy of a parameter is cached per autocast block: a second block (the next training step, after
    the optimizer changed the weights) uses the new weights, even with the same autocast object."""
    model = _mlp()
    x, y = _data()
    ac = ndl.autocast("bfloat16")
    opt = optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for _ in range(2):
        with ac:
            loss = nn.SoftmaxLoss()(model(x), y)
        loss.backward()
        opt.step()
        losses.append(float(loss.numpy()))
        with ndl.autocast("bfloat16"):
            fresh = float(nn.SoftmaxLoss()(model(x), y).numpy())
    with ac:
        again = float(nn.SoftmaxLoss()(model(x), y).numpy())
    assert again == fresh and again != losses[0]


@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
def test_a_training_loop_inside_one_autocast_block_reads_the_current_weights(lazy):
    """The block's 16-bit copy of a parameter is remade once the parameter was written (its version moved on), so
    each step of a training loop inside one autocast block computes with the current weights, as a fresh block
    does: a released copy would have to be recomputed from changed weights (rule 4c refuses), and the copy of a
    one-element parameter, kept (rule 1), would hold the old value."""
    rs = np.random.RandomState(0)
    w = ndl.Tensor(rs.randn(8, 4).astype(np.float32), device=CPU)
    scale = ndl.Tensor(np.array([1.5], np.float32), device=CPU)  # one element: its 16-bit copy is kept
    x, y = _data()
    opt = optim.SGD([w, scale], lr=0.5)

    def loss_fn():
        return nn.SoftmaxLoss()((x @ w) * ops.broadcast_to(ops.reshape(scale, (1, 1)), (12, 4)), y)

    with ndl.autocast("bfloat16"), autograd.lazy_mode(lazy):
        for _ in range(3):
            loss = loss_fn()
            with ndl.autocast("bfloat16"):  # a fresh block: fresh copies of the current weights
                fresh = loss_fn()
            assert np.array_equal(loss.numpy(), fresh.numpy())
            loss.backward()
            opt.step()
    assert scale.version == 3


# ===== 7. GradScaler ===============================================================================================
def _regression(seed=0):
    np.random.seed(seed)
    rs = np.random.RandomState(seed)
    x = ndl.Tensor(rs.randn(32, 6).astype(np.float32), device=CPU, requires_grad=False)
    w_true = rs.randn(6, 1).astype(np.float32)
    y = ndl.Tensor(x.numpy() @ w_true, device=CPU, requires_grad=False)
    model = nn.Linear(6, 1, device=CPU)
    return model, x, y


def _mse(model, x, y):
    d = model(x) - y
    return (d * d).sum() / 32.0


def test_grad_scaler_skips_a_step_with_inf_and_halves_the_scale():
    """A float16 backward whose scaled loss overflows (scale 2**40) gives inf gradients: step() returns False,
    the parameters are unchanged, update() halves the scale. An inf put into a gradient by hand: the same."""
    model, x, y = _regression()
    opt = optim.SGD(model.parameters(), lr=0.01)
    scaler = ndl.amp.GradScaler(init_scale=2.0**40)
    before = [p.numpy().copy() for p in model.parameters()]
    with ndl.autocast("float16"):
        loss = _mse(model, x, y)
    scaler.scale(loss).backward()
    assert not np.isfinite(model.weight.grad.numpy()).all()
    assert scaler.step(opt) is False
    for p, b in zip(model.parameters(), before):
        np.testing.assert_array_equal(p.numpy(), b)
    scaler.update()
    assert scaler.get_scale() == 2.0**39
    # by hand: a NaN/inf in one gradient of an otherwise clean backward
    scaler = ndl.amp.GradScaler(init_scale=8.0)
    with ndl.autocast("float16"):
        loss = _mse(model, x, y)
    scaler.scale(loss).backward()
    g = model.bias.grad.numpy().copy()
    g[0, 0] = np.inf
    model.bias.grad = ndl.Tensor(g, device=CPU, requires_grad=False)
    assert scaler.step(opt) is False
    for p, b in zip(model.parameters(), before):
        np.testing.assert_array_equal(p.numpy(), b)
    scaler.update()
    assert scaler.get_scale() == 4.0


def test_grad_scaler_unscales_and_grows_after_growth_interval():
    """Clean steps: the gradients the optimizer sees are the unscaled ones (equal to an unscaled backward's); after
    `growth_interval` clean steps in a row the scale doubles, and a skip resets the count."""
    model, x, y = _regression()
    loss = _mse(model, x, y)
    loss.backward()
    plain = [p.grad.numpy().copy() for p in model.parameters()]
    scaler = ndl.amp.GradScaler(init_scale=1024.0, growth_interval=3)
    opt = optim.SGD(model.parameters(), lr=0.0)  # lr 0: the parameters (and so the gradients) stay put
    scales = []
    for step in range(7):
        opt.reset_grad()
        scaler.scale(_mse(model, x, y)).backward()
        if step == 4:  # one bad step in the middle
            model.bias.grad = ndl.Tensor(np.full((1, 1), np.nan, np.float32), device=CPU, requires_grad=False)
        taken = scaler.step(opt)
        assert taken == (step != 4)
        if taken:
            for p, g in zip(model.parameters(), plain):
                np.testing.assert_allclose(p.grad.numpy(), g, rtol=1e-6, atol=1e-7)
        scaler.update()
        scales.append(scaler.get_scale())
    assert scales == [1024.0, 1024.0, 2048.0, 2048.0, 1024.0, 1024.0, 1024.0]
    assert scaler.state_dict()["scale"] == 1024.0 and scaler.state_dict()["clean_steps"] == 2


def test_grad_scaler_training_recovers_from_overflow():
    """float16 autocast training of a tiny regression with a scale that starts far too large (2**40): the first
    steps are skipped and back off, then training proceeds and the loss falls well below its start."""
    model, x, y = _regression()
    opt = optim.Adam(model.parameters(), lr=0.05)
    scaler = ndl.amp.GradScaler(init_scale=2.0**40, growth_interval=5)
    losses, taken = [], []
    for _ in range(60):
        opt.reset_grad()
        with ndl.autocast("float16"):
            loss = _mse(model, x, y)
        scaler.scale(loss).backward()
        taken.append(scaler.step(opt))
        scaler.update()
        losses.append(float(loss.numpy()))
    assert not taken[0] and sum(taken) >= 30
    assert scaler.get_scale() < 2.0**40
    assert np.isfinite(losses).all()
    assert losses[-1] < 0.1 * losses[0]
    assert min(losses[-5:]) <= min(losses[:10])


def test_grad_scaler_validates_and_can_be_disabled():
    """Bad hyper-parameters raise ValueError; enabled=False passes losses through and always steps."""
    for kwargs in (dict(growth_factor=1.0), dict(backoff_factor=1.0), dict(growth_interval=0), dict(init_scale=0)):
        with pytest.raises(ValueError):
            ndl.amp.GradScaler(**kwargs)
    model, x, y = _regression()
    scaler = ndl.amp.GradScaler(enabled=False)
    loss = _mse(model, x, y)
    assert scaler.scale(loss) is loss and scaler.get_scale() == 1.0
    loss.backward()
    before = model.weight.numpy().copy()
    assert scaler.step(optim.SGD(model.parameters(), lr=0.1)) is True
    assert not np.array_equal(model.weight.numpy(), before)


# ===== 8. optimizers: master weights and stochastic rounding =======================================================
def _tiny_update_run(opt_name, dtype="bfloat16", steps=50, **kwargs):
    """A (64, 1) 16-bit parameter of value 1.0 whose gradient is a constant 1e-4: each update (SGD with lr=1, or
    Adam with lr=1e-4) is 1e-4, below half a step at 1.0 (bfloat16: 2**-8 = 3.9e-3, float16: 2**-11 = 4.9e-4).
    Returns (the parameter, the optimizer)."""
    np.random.seed(0)
    lin = nn.Linear(64, 1, bias=False, device=CPU)
    lin.weight.cached_data = nd.array(np.ones((64, 1), np.float32), device=CPU)
    lin.astype(dtype)
    p = lin.weight
    if opt_name == "sgd":
        opt = optim.SGD([p], lr=1.0, **kwargs)
    else:
        opt = optim.Adam([p], lr=1e-4, **kwargs)
    for _ in range(steps):
        p.grad = ndl.Tensor(np.full((64, 1), 1e-4, np.float32), dtype=dtype, device=CPU, requires_grad=False)
        opt.step()
    return p, opt


@pytest.mark.parametrize("opt_name", ["sgd", "adam"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_master_weights_accumulate_updates_smaller_than_a_16bit_step(opt_name, dtype):
    """Default master_weights: the optimizer keeps a float32 master copy of each 16-bit parameter; 50 updates of
    1e-4 move it by 5e-3 and the 16-bit parameter follows (rounded). With master_weights=False (round to nearest)
    every update is lost (each is under half a step): the parameter never moves, and Adam's state is 16-bit.
    (Not checked for pure-float16 Adam: g**2 * (1 - beta2) = 1e-11 underflows float16's second moment to 0, so
    its steps grow instead: the range problem that makes master weights the default.)"""
    p, opt = _tiny_update_run(opt_name, dtype)
    assert p.dtype == dtype
    master = opt.master[p]
    assert master.dtype == "float32"
    np.testing.assert_allclose(master.numpy(), 1.0 - 50 * 1e-4, rtol=1e-4)
    np.testing.assert_array_equal(p.numpy(), master.numpy().astype(NP[dtype]))
    assert opt.state_bytes() >= 64 * 4
    if dtype == "float16" and opt_name == "adam":
        return
    q, pure = _tiny_update_run(opt_name, dtype, master_weights=False)
    assert not pure.master and q.dtype == dtype
    np.testing.assert_array_equal(q.numpy().astype(np.float32), np.ones((64, 1), np.float32))
    if opt_name == "adam":  # pure 16-bit state
        assert pure.m[q].dtype == dtype and pure.v[q].dtype == dtype


@pytest.mark.parametrize("opt_name", ["sgd", "adam"])
def test_stochastic_rounding_keeps_tiny_updates_on_average(opt_name):
    """master_weights=False, stochastic_rounding=True: no master copy, the bf16 parameter rounds up or down at
    random, and the mean over its 64 elements after 50 updates of 1e-4 is near 1 - 5e-3 (round to nearest: 1.0)."""
    p, opt = _tiny_update_run(opt_name, master_weights=False, stochastic_rounding=True)
    assert p.dtype == "bfloat16" and not opt.master
    mean = float(p.numpy().astype(np.float64).mean())
    assert abs(mean - (1.0 - 5e-3)) < 1.5e-3, mean
    assert len(np.unique(p.numpy().astype(np.float32))) > 1  # the elements went different ways


def test_stochastic_rounding_argument_checks():
    """stochastic_rounding=True raises ValueError with float16 (or float32) parameters and with
    master_weights=True."""
    half = nn.Linear(3, 2, device=CPU).astype("float16")
    with pytest.raises(ValueError, match="bfloat16"):
        optim.SGD(half.parameters(), master_weights=False, stochastic_rounding=True)
    with pytest.raises(ValueError, match="bfloat16"):
        optim.Adam(nn.Linear(3, 2, device=CPU).parameters(), master_weights=False, stochastic_rounding=True)
    bf = nn.Linear(3, 2, device=CPU).astype("bfloat16")
    for cls in (optim.SGD, optim.Adam):
        with pytest.raises(ValueError, match="master_weights"):
            cls(bf.parameters(), master_weights=True, stochastic_rounding=True)


@pytest.mark.parametrize("cls", [optim.SGD, optim.Adam])
def test_stochastic_rounding_with_default_master_weights_is_consistent(cls):
    """stochastic_rounding=True without master_weights= either raises ValueError (as master_weights=True does) or
    means pure bf16 training (no float32 master copies)."""
    bf = nn.Linear(3, 2, device=CPU).astype("bfloat16")
    try:
        opt = cls(bf.parameters(), lr=0.1, stochastic_rounding=True)
    except ValueError:
        return
    for p in bf.parameters():
        p.grad = ndl.Tensor(np.ones(p.shape), dtype="bfloat16", device=CPU, requires_grad=False)
    opt.step()
    assert not opt.master, f"{len(opt.master)} float32 master copies kept besides stochastic rounding"


@pytest.mark.parametrize("opt_name", ["sgd", "adam"])
def test_16bit_training_with_master_weights_tracks_float32(opt_name):
    """A bf16 model (module.astype) trained with master weights follows the float32 model's losses closely and
    keeps its parameters bfloat16 (gradients bfloat16, updates float32)."""
    losses = {}
    for dtype in ("float32", "bfloat16"):
        model, x, y = _regression()
        model.astype(dtype)
        opt = (optim.SGD(model.parameters(), lr=0.05, momentum=0.9) if opt_name == "sgd"
               else optim.Adam(model.parameters(), lr=0.05))
        losses[dtype] = []
        for _ in range(30):
            opt.reset_grad()
            loss = _mse(model, x, y)
            loss.backward()
            assert all(p.grad.dtype == dtype for p in model.parameters())
            opt.step()
            losses[dtype].append(float(loss.numpy()))
        assert all(p.dtype == dtype for p in model.parameters())
    assert losses["bfloat16"][-1] < 0.2 * losses["bfloat16"][0]
    np.testing.assert_allclose(losses["bfloat16"], losses["float32"], rtol=0.1, atol=1e-2)


# ===== 9. float32 stays the default ================================================================================
def test_float32_is_the_default_everywhere():
    """Without dtype=: NDArrays, Tensors (also from float64/int64 NumPy arrays), init, nn layers, op results,
    gradients and optimizer states are float32; autocast is off; the optimizer keeps no master copies."""
    assert nd.array([1, 2, 3], device=REF).dtype == "float32"
    assert nd.empty((2,), device=CPU).dtype == "float32" and nd.full((2,), 1, device=CPU).dtype == "float32"
    assert ndl.Tensor(np.arange(3, dtype=np.int64), device=CPU).dtype == "float32"
    assert ndl.Tensor(np.ones(3, dtype=np.float64), device=CPU).dtype == "float32"
    assert init.randn(2, 2, device=CPU).dtype == "float32" and init.zeros(2, device=CPU).dtype == "float32"
    assert not ndl.amp.is_autocast_enabled()
    model, x, y = _regression()
    loss = _mse(model, x, y)
    assert loss.dtype == "float32" and model(x).dtype == "float32"
    loss.backward()
    assert all(p.dtype == "float32" and p.grad.dtype == "float32" for p in model.parameters())
    opt = optim.Adam(model.parameters(), lr=0.01)
    opt.step()
    assert not opt.master and all(m.dtype == "float32" for m in opt.m.values())
    assert all(p.dtype == "float32" for p in model.parameters())


@pytest.mark.parametrize("device", DEVICES)
def test_float32_results_unchanged_by_the_dtype_machinery(device, rng):
    """float32 arithmetic is still exact float32: a + b, a * s, a @ b on the reference equal NumPy's float32
    results bit for bit, and the compiled backends agree within float32 tolerance."""
    a = rng.standard_normal((5, 6)).astype(np.float32)
    b = rng.standard_normal((5, 6)).astype(np.float32)
    check_op(device, "float32", lambda x, y: x + y, np.add, [a, b])
    check_op(device, "float32", lambda x: x * 0.3, lambda x: x * np.float32(0.3), [a])
    check_op(device, "float32", lambda x, y: x @ y.permute((1, 0)), lambda x, y: x @ y.T, [a, b],
             exact_reference=False)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_backward_inside_an_autocast_block_equals_backward_after_it(dtype):
    # The gradient ops ran under autocast too: layer norm's gradient raised "needs floating arrays of one dtype"
    # and other gradients were computed in other dtypes than after the block.
    grads = []
    for inside in (True, False):
        np.random.seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm1d(16), nn.ReLU(), nn.Linear(16, 4))
        x = ndl.Tensor(np.random.randn(5, 8).astype(np.float32), requires_grad=False)
        with ndl.autocast(dtype):
            loss = (model(x) * model(x)).sum()
            if inside:
                loss.backward()
        if not inside:
            loss.backward()
        grads.append([p.grad.numpy() for p in model.parameters()])
    for a, b in zip(*grads):
        np.testing.assert_array_equal(a, b)
