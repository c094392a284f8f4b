"""NDArray's operations against NumPy, the oracle, on every device, on compact and non-compact inputs: element-wise,
scalar and unary operations, the backends' strided entry points, reductions, matmul (reading transposed operands in
place), flip, pad, stack, split and the gathers and scatters. Views, errors and the devices: test_ndarray.py; the
shared helpers and op tables: ndarray_cases.py.
"""
import numpy as np
import pytest

from needle import backend_ndarray as nd

from conftest import COMPILED_DEVICES, DEVICES, peak_during
from ndarray_cases import EWISE_OPS, LAYOUTS, SCALAR_OPS, assert_same, make_view, with_kernels


# ----- element-wise and scalar operations ----------------------------------------------------------------------------


def _ewise_operands(shape, layout_a, layout_b, device, rng, positive):
    A, a = make_view(shape, layout_a, device, rng, positive=positive)
    B, b = make_view(shape, layout_b, device, rng, positive=positive)
    return A, a, B, b


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(EWISE_OPS))
@pytest.mark.parametrize("layout_a,layout_b", [("compact", "compact"), ("permuted", "sliced"),
                                               ("flipped", "broadcast"), ("broadcast", "permuted")])
def test_ewise(device, name, layout_a, layout_b, rng):
    ours, theirs, kind = EWISE_OPS[name]
    A, a, B, b = _ewise_operands((3, 4, 5), layout_a, layout_b, device, rng, positive=kind == "positive")
    if name in ("eq", "ge", "gt", "ne", "lt", "le") and layout_a == "compact":
        # Some equal elements, so equality is exercised both ways.
        B, b = A.compact() + 0.0, a.copy()
        B[0] = -5.0
        b[0] = -5.0
    assert_same(ours(A, B), theirs(a, b))




@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(SCALAR_OPS))
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("scalar", [1.5, -2.0, 3])
def test_scalar_ops(device, name, layout, scalar, rng):
    ours, theirs, kind = SCALAR_OPS[name]
    A, a = make_view((3, 4, 5), layout, device, rng, positive=kind == "positive")
    if name in ("eq", "ge", "gt"):
        A = A.compact()
        A[0, 0] = float(scalar)  # some elements equal the scalar
        a = A.numpy()
    if name == "power":
        scalar = abs(scalar) if layout != "compact" else scalar
    assert_same(ours(A, scalar), theirs(a, np.float32(scalar)), rtol=2e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name,ours,theirs", [
    ("log", nd.log, np.log), ("exp", nd.exp, np.exp), ("tanh", nd.tanh, np.tanh),
    ("log_method", lambda A: A.log(), np.log), ("exp_method", lambda A: A.exp(), np.exp),
    ("tanh_method", lambda A: A.tanh(), np.tanh),
])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_unary(device, name, ours, theirs, layout, rng):
    A, a = make_view((3, 4, 5), layout, device, rng, positive=name.startswith("log"))
    assert_same(ours(A), theirs(a), rtol=2e-6)


# Broadcast operands are read in place (stride 0) by the backends' strided entry points: every op, either side.
BROADCASTS = [((64, 1), (64, 100)), ((1, 100), (64, 100)), ((1, 1), (64, 100)), ((5, 1, 7), (3, 5, 4, 7)),
              ((1,), (3, 1, 2))]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["add", "sub", "mul", "div", "power", "maximum", "eq", "ge"])
@pytest.mark.parametrize("small,shape", BROADCASTS, ids=repr)
def test_ewise_with_broadcast_operands(device, name, small, shape, rng):
    ours, theirs, _ = EWISE_OPS[name]
    z = rng.uniform(0.5, 2.0, shape).astype(np.float32)
    b = rng.uniform(0.5, 2.0, small).astype(np.float32)
    b.flat[0] = z.flat[0]  # some equal elements for eq / ge
    Z, B = nd.array(z, device=device), nd.array(b, device=device).broadcast_to(shape)
    bb = np.broadcast_to(b, shape)
    assert_same(ours(Z, B), theirs(z, bb))
    assert_same(ours(B, Z), theirs(bb, z))
    assert_same(ours(B, B), theirs(bb, bb))
    assert_same(ours(Z.permute(tuple(reversed(range(Z.ndim)))), B.permute(tuple(reversed(range(B.ndim))))),
                theirs(z.T, bb.T))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("small,shape", BROADCASTS, ids=repr)
def test_scalar_and_unary_ops_on_broadcast_views(device, small, shape, rng):
    b = rng.uniform(0.5, 2.0, small).astype(np.float32)
    B, bb = nd.array(b, device=device).broadcast_to(shape), np.broadcast_to(b, shape)
    assert_same(B * 3.0, bb * np.float32(3.0))
    assert_same(2.0 - B, np.float32(2.0) - bb)
    assert_same(B**2.0, bb**2)
    assert_same(B**0.5, bb ** np.float32(0.5))
    assert_same(B.maximum(1.0), np.maximum(bb, np.float32(1.0)))
    for ours, theirs in [(nd.exp, np.exp), (nd.log, np.log), (nd.tanh, np.tanh)]:
        assert_same(ours(B), theirs(bb), rtol=2e-6)


def _strided_operand(device, rng, layout):
    """(backend handle, strides, offset, numpy view) of a (6, 7) operand laid out as `layout`."""
    if layout == "compact":
        base = rng.uniform(0.5, 2.0, (6, 7)).astype(np.float32)
        return nd.array(base, device=device).buffer, [7, 1], 0, base
    if layout == "reversed":  # negative strides, the offset at the far end
        base = rng.uniform(0.5, 2.0, (6, 7)).astype(np.float32)
        return nd.array(base, device=device).buffer, [-7, -1], 41, base[::-1, ::-1]
    if layout == "transposed":
        base = rng.uniform(0.5, 2.0, (7, 6)).astype(np.float32)
        return nd.array(base, device=device).buffer, [1, 6], 0, base.T
    if layout == "column":  # one value per row, repeated along the row (inner stride 0), at an offset
        base = rng.uniform(0.5, 2.0, 9).astype(np.float32)
        return nd.array(base, device=device).buffer, [1, 0], 2, np.broadcast_to(base[2:8, None], (6, 7))
    raise AssertionError(layout)


STRIDED_LAYOUTS = ["compact", "reversed", "transposed", "column"]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout_a", STRIDED_LAYOUTS)
@pytest.mark.parametrize("layout_b", STRIDED_LAYOUTS)
def test_backend_strided_functions(device, layout_a, layout_b, rng):
    """ewise_strided / scalar_strided / unary_strided called directly, against NumPy on the same views."""
    mod = device.mod
    ha, sa, oa, a = _strided_operand(device, rng, layout_a)
    hb, sb, ob, b = _strided_operand(device, rng, layout_b)
    out = nd.empty((6, 7), device=device)
    binary = {op: EWISE_OPS[op][1] for op in ("add", "sub", "mul", "div", "power", "maximum", "eq", "ge")}
    for op, func in binary.items():
        mod.ewise_strided(op, ha, sa, oa, hb, sb, ob, out.buffer, [6, 7])
        assert_same(out, func(a, b).astype(np.float32), rtol=2e-6)
        mod.scalar_strided(op, ha, sa, oa, 1.25, out.buffer, [6, 7])
        assert_same(out, func(a, np.float32(1.25)).astype(np.float32), rtol=2e-6)
    for op, func in {"log": np.log, "exp": np.exp, "tanh": np.tanh}.items():
        mod.unary_strided(op, hb, sb, ob, out.buffer, [6, 7])
        assert_same(out, func(b), rtol=2e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_backend_strided_functions_reject_bad_calls(device):
    mod = device.mod
    a = nd.array(np.ones((2, 3)), device=device)
    out = nd.empty((2, 3), device=device)
    with pytest.raises(ValueError, match="unknown op"):
        mod.ewise_strided("min", a.buffer, [3, 1], 0, a.buffer, [3, 1], 0, out.buffer, [2, 3])
    with pytest.raises(ValueError, match="unknown op"):
        mod.scalar_strided("sub_", a.buffer, [3, 1], 0, 1.0, out.buffer, [2, 3])
    with pytest.raises(ValueError, match="unknown op"):
        mod.unary_strided("sqrt", a.buffer, [3, 1], 0, out.buffer, [2, 3])
    with pytest.raises(ValueError, match="out must not be one of the inputs"):
        mod.ewise_strided("add", a.buffer, [1, 2], 0, a.buffer, [3, 1], 0, a.buffer, [2, 3])
    with pytest.raises(ValueError, match="out must not be one of the inputs"):
        mod.unary_strided("exp", a.buffer, [0, 1], 0, a.buffer, [2, 3])


@pytest.mark.parametrize("device", COMPILED_DEVICES)
def test_compiled_strided_functions_check_view_bounds(device):
    mod = device.mod
    a = nd.array(np.ones((2, 3)), device=device)
    out = nd.empty((2, 3), device=device)
    with pytest.raises(ValueError):
        mod.ewise_strided("add", a.buffer, [3, 1], 1, a.buffer, [3, 1], 0, out.buffer, [2, 3])
    with pytest.raises(ValueError):
        mod.scalar_strided("add", a.buffer, [4, 1], 0, 1.0, out.buffer, [2, 3])
    with pytest.raises(ValueError):
        mod.unary_strided("exp", a.buffer, [-3, 1], 0, out.buffer, [2, 3])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape,axes", [((70, 45), (1, 0)), ((5, 40, 33), (2, 0, 1)), ((1100, 1000), (1, 0))],
                         ids=repr)
def test_transposed_views_of_many_tiles(device, shape, axes, rng):
    """Transposed operands are walked in tiles (C++): partial tiles, several outer dims, threads (1.1M elements)."""
    a = rng.uniform(0.5, 2.0, shape).astype(np.float32)
    A = nd.array(a, device=device).permute(axes)
    at = a.transpose(axes)
    b = rng.standard_normal(at.shape).astype(np.float32)
    B = nd.array(b, device=device)
    assert_same(A.compact(), at, rtol=0, atol=0)
    assert_same(A + B, at + b, rtol=0, atol=0)
    assert_same(B - A, b - at, rtol=0, atol=0)
    assert_same(A * 3.0, at * np.float32(3.0), rtol=0, atol=0)
    assert_same(A.log(), np.log(at), rtol=2e-6)
    out = nd.array(np.zeros(shape), device=device)
    view = out.permute(axes)
    view[tuple(slice(None) for _ in axes)] = B  # ewise_setitem into a transposed view
    np.testing.assert_array_equal(out.numpy(), b.transpose(np.argsort(axes)))


# The C++ backend has one exp/log/tanh/sum/max implementation per instruction set: check each this CPU runs
# (ndarray_cases.with_kernels: the parameters).
@pytest.fixture
def vector_isa(request, device):
    if request.param == "default":
        yield request.param
        return
    mod = device.mod
    if not hasattr(mod, "set_vector_isa"):
        pytest.skip(f"{device} has a single implementation")
    original = mod.vector_isa()
    try:
        mod.set_vector_isa(request.param)
    except ValueError:
        pytest.skip(f"this CPU cannot run the {request.param} kernels")
    yield request.param
    mod.set_vector_isa(original)


SPECIAL_VALUES = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-40, -1e-40, 1.0, -1.0, 0.5, 0.625, -0.625,
                           9.0, 9.1, -9.1, 20.0, 44.0, 88.0, 88.72283, 88.72284, 89.0, -87.0, -103.0, -104.0, 150.0,
                           -150.0, 1e30, 3.4e38, 1.17549435e-38, 2.0**-149], dtype=np.float32)


@pytest.mark.parametrize("device, vector_isa", with_kernels(DEVICES, "set_vector_isa"), indirect=["vector_isa"])
@pytest.mark.parametrize("name", ["exp", "log", "tanh"])
def test_unary_special_values_and_accuracy(device, vector_isa, name, rng):
    func = getattr(np, name)
    with np.errstate(all="ignore"):  # overflow, log of negatives: the NumPy backend would warn too
        expected = func(SPECIAL_VALUES)
        got = getattr(nd.array(SPECIAL_VALUES, device=device), name)().numpy()
    np.testing.assert_allclose(got, expected, rtol=3e-7, atol=0)  # NaN where NumPy has NaN, inf where inf
    assert np.array_equal(np.signbit(got[:2]), np.signbit(expected[:2]))  # the sign of zero
    if name == "tanh":
        assert np.all(got[SPECIAL_VALUES >= 10] == 1.0) and np.all(got[SPECIAL_VALUES <= -10] == -1.0)  # saturated
    # many values, an odd count (vector tails) past the threshold where the C++ backend uses threads,
    # compared with float64 references: the compiled backends within 2 float32 ulp (NumPy's own float32
    # functions, which the reference backend calls, within 4)
    max_ulp = 4 if device.name == "cpu_numpy" else 2
    lo, hi = {"exp": (-100.0, 88.0), "log": (1e-30, 1e30), "tanh": (-10.0, 10.0)}[name]
    x = rng.uniform(lo, hi, 100_003).astype(np.float32)
    if name == "log":
        x = np.exp(rng.uniform(np.log(1e-30), np.log(1e30), x.size)).astype(np.float32)
    x[:5000] = rng.uniform(-1.0, 1.0, 5000) if name != "log" else rng.uniform(0.5, 2.0, 5000)
    exact = func(x.astype(np.float64))
    got = getattr(nd.array(x, device=device), name)().numpy()
    tiny = np.abs(exact) < np.finfo(np.float32).tiny  # denormal results: compare absolutely
    ulp = np.spacing(np.abs(exact.astype(np.float32)))
    assert np.all(np.abs(got - exact)[~tiny] <= max_ulp * ulp[~tiny])
    assert np.all(np.abs(got - exact)[tiny] <= max_ulp * np.finfo(np.float32).smallest_subnormal)


@pytest.mark.parametrize("device, vector_isa", with_kernels(DEVICES, "set_vector_isa"), indirect=["vector_isa"])
@pytest.mark.parametrize("row", [1, 3, 7, 15, 16, 17, 31, 63, 64, 65, 127, 1000, 4099])
def test_row_reductions_every_length_and_nan(device, vector_isa, row, rng):
    a = rng.standard_normal((9, row)).astype(np.float32)
    a[2] -= 100.0  # an all-negative row
    a[4, row - 1] = 50.0  # the maximum in the last (tail) element
    a[6, row // 2] = np.nan
    a[7, 0] = np.inf
    a[8, row - 1] = -np.inf
    A = nd.array(a, device=device)
    np.testing.assert_array_equal(A.max(axis=1).numpy(), a.max(axis=1))
    np.testing.assert_allclose(A.sum(axis=1).numpy(), a.astype(np.float64).sum(axis=1), rtol=1e-6, atol=1e-5)
    big = rng.standard_normal((300, row)).astype(np.float32)  # enough rows for threads
    np.testing.assert_array_equal(nd.array(big, device=device).max(axis=1).numpy(), big.max(axis=1))


@pytest.mark.parametrize("device", DEVICES)
def test_ewise_results_are_new_compact_arrays(device, rng):
    A, a = make_view((3, 4), "permuted", device, rng)
    out = A + 1.0
    assert out.is_compact() and out.shape == (3, 4)
    out[0, 0] = 99.0
    np.testing.assert_array_equal(A.numpy(), a)  # the input is untouched


# ----- reductions -----------------------------------------------------------------------------------------------------
REDUCE_AXES = [None, 0, 1, 2, -1, -3, (0, 2), (2, 0), (0, 1, 2), (1, -1), ()]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", ["sum", "max"])
@pytest.mark.parametrize("axis", REDUCE_AXES, ids=repr)
@pytest.mark.parametrize("keepdims", [False, True])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_reductions(device, op, axis, keepdims, layout, rng):
    A, a = make_view((3, 4, 5), layout, device, rng)
    ours = getattr(A, op)(axis=axis, keepdims=keepdims)
    theirs = getattr(a, op)(axis=axis, keepdims=keepdims)
    assert_same(ours, np.asarray(theirs, dtype=np.float32), rtol=1e-5, atol=1e-5)
    functional = getattr(nd, op)(A, axis=axis, keepdims=keepdims)
    np.testing.assert_array_equal(functional.numpy(), ours.numpy())


@pytest.mark.parametrize("device", DEVICES)
def test_sum_of_many_elements_and_max_of_negatives(device, rng):
    a = rng.standard_normal((7, 1031)).astype(np.float32)
    A = nd.array(a, device=device)
    assert_same(A.sum(axis=1), a.sum(axis=1), rtol=1e-4, atol=1e-4)
    assert_same((A - 100.0).max(axis=0), (a - 100).max(axis=0), rtol=0, atol=0)


# ----- matmul ---------------------------------------------------------------------------------------------------------
MATMUL_SIZES = [(1, 1, 1), (1, 7, 1), (7, 1, 7), (2, 3, 4), (8, 8, 8), (63, 65, 17), (64, 64, 64), (65, 63, 129),
                (129, 7, 65), (16, 32, 8)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("m,n,p", MATMUL_SIZES)
def test_matmul_2d(device, m, n, p, rng):
    a = rng.standard_normal((m, n)).astype(np.float32)
    b = rng.standard_normal((n, p)).astype(np.float32)
    A, B = nd.array(a, device=device), nd.array(b, device=device)
    assert_same(A @ B, a @ b, rtol=1e-4, atol=1e-4)
    assert_same(nd.matmul(A, B), a @ b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout_a,layout_b", [("permuted", "compact"), ("sliced", "flipped"),
                                               ("broadcast", "permuted"), ("flipped", "sliced")])
def test_matmul_non_compact(device, layout_a, layout_b, rng):
    A, a = make_view((9, 7), layout_a, device, rng)
    B, b = make_view((7, 5), layout_b, device, rng)
    assert_same(A @ B, a @ b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape_a,shape_b", [
    ((3, 5, 4), (3, 4, 2)),
    ((6, 6, 5, 4), (4, 3)),
    ((5, 4), (6, 6, 4, 3)),
    ((2, 1, 3, 4), (5, 4, 6)),
    ((1, 7, 1), (3, 1, 65)),
    ((2, 3, 4, 5), (2, 3, 5, 1)),
])
@pytest.mark.smoke
def test_matmul_batched_and_broadcast(device, shape_a, shape_b, rng):
    a = rng.standard_normal(shape_a).astype(np.float32)
    b = rng.standard_normal(shape_b).astype(np.float32)
    assert_same(nd.array(a, device=device) @ nd.array(b, device=device), a @ b, rtol=1e-4, atol=1e-4)
    # and through non-compact (permuted) operands
    A = nd.array(np.ascontiguousarray(np.swapaxes(a, -1, -2)), device=device).permute(
        tuple(range(a.ndim - 2)) + (a.ndim - 1, a.ndim - 2))
    assert not A.is_compact() or min(a.shape[-2:]) == 1
    assert_same(A @ nd.array(b, device=device), a @ b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("batch,m,n,p", [(1, 3, 4, 5), (7, 5, 3, 4), (64, 16, 8, 16), (5, 1, 9, 1), (3, 70, 65, 130),
                                         (2, 256, 256, 260), (4, 0, 3, 2), (2, 3, 0, 4), (0, 2, 2, 2)])
def test_backend_matmul_batched(device, batch, m, n, p, rng):
    a = rng.standard_normal((batch, m, n)).astype(np.float32)
    b = rng.standard_normal((batch, n, p)).astype(np.float32)
    A, B = nd.array(a, device=device), nd.array(b, device=device)
    out = nd.empty((batch, m, p), device=device)
    device.mod.matmul_batched(A.buffer, B.buffer, out.buffer, batch, m, n, p)
    assert_same(out, a @ b, rtol=1e-4, atol=1e-4)
    assert_same(A @ B, a @ b, rtol=1e-4, atol=1e-4)
    if device.name == "cpu" and batch:  # each product is computed exactly as a 2-D matmul would
        loop = np.stack([(A[i] @ B[i]).numpy() for i in range(batch)])
        np.testing.assert_array_equal(out.numpy(), loop)
    if device.name != "cpu_numpy":  # (the reference does not check sizes)
        with pytest.raises(ValueError):
            device.mod.matmul_batched(A.buffer, B.buffer, out.buffer, batch + 1, m, n, p)
    X = nd.array(rng.standard_normal((2, 3, 3)), device=device)
    with pytest.raises(ValueError, match="out must not be one of the inputs"):
        device.mod.matmul_batched(X.buffer, X.buffer, X.buffer, 2, 3, 3, 3)


@pytest.mark.parametrize("device", DEVICES)
def test_attention_shaped_batched_matmul(device, rng):
    """(batch, heads, T, d) @ (batch, heads, d, T) and back: many small products in one backend call."""
    q = rng.standard_normal((4, 8, 32, 16)).astype(np.float32)
    k = rng.standard_normal((4, 8, 32, 16)).astype(np.float32)
    Q, K = nd.array(q, device=device), nd.array(k, device=device)
    scores = Q @ K.permute((0, 1, 3, 2))
    assert_same(scores, q @ np.swapaxes(k, -1, -2), rtol=1e-4, atol=1e-4)
    assert_same(scores @ K, (q @ np.swapaxes(k, -1, -2)) @ k, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("device", DEVICES)
def test_matmul_tiled_kernel(device, rng):
    T = device.__tile_size__
    m, n, p = 2 * T, 3 * T, T
    a = rng.standard_normal((m, n)).astype(np.float32)
    b = rng.standard_normal((n, p)).astype(np.float32)
    tiles = lambda x, r, c: np.ascontiguousarray(x.reshape(r // T, T, c // T, T).transpose(0, 2, 1, 3))
    A, B = nd.array(tiles(a, m, n), device=device), nd.array(tiles(b, n, p), device=device)
    out = nd.empty((m // T, p // T, T, T), device=device)
    device.matmul_tiled(A.buffer, B.buffer, out.buffer, m, n, p)
    np.testing.assert_allclose(out.numpy(), tiles(a @ b, m, p), rtol=1e-4, atol=1e-4)


# ----- flip, pad, stack, split, take_rows, scatter_add_rows ----------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("axes", [(0,), (1, 2), (0, 1, 2), (-1,), None, 2, ()], ids=repr)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_flip(device, axes, layout, rng):
    A, a = make_view((3, 4, 5), layout, device, rng)
    out = nd.flip(A, axes)
    assert out.is_compact()
    assert_same(out, np.flip(a, axes), rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("pads", [((0, 0), (0, 0), (0, 0)), ((1, 2), (0, 0), (3, 1)), ((0, 1), (2, 0), (1, 1))])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_pad(device, pads, layout, rng):
    A, a = make_view((3, 4, 5), layout, device, rng)
    out = A.pad(pads)
    assert_same(out, np.pad(a, pads), rtol=0, atol=0)
    assert_same(nd.pad(A, pads), np.pad(a, pads), rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_pad_errors(device):
    A = nd.array(np.zeros((2, 3)), device=device)
    with pytest.raises(ValueError):
        A.pad(((1, 1),))
    with pytest.raises(ValueError):
        A.pad(((1, 1), (-1, 0)))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("axis", [0, 1, 2, -1])
@pytest.mark.parametrize("layout", ["compact", "permuted", "sliced"])
def test_stack_and_split(device, axis, layout, rng):
    views = [make_view((3, 4), layout, device, rng) for _ in range(3)]
    stacked = nd.stack([v[0] for v in views], axis=axis)
    expected = np.stack([v[1] for v in views], axis=axis)
    assert_same(stacked, expected, rtol=0, atol=0)
    parts = nd.split(stacked, axis=axis)
    assert len(parts) == 3
    for part, (_, v) in zip(parts, views):
        assert_same(part, v, rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["compact", "permuted", "sliced", "flipped"])
def test_take_rows_and_scatter_add_rows(device, layout, rng):
    T, t = make_view((6, 4), layout, device, rng)
    ids = np.array([5, 0, 2, 2, 5, 1, 0], dtype=np.float32)
    I = nd.array(ids, device=device)
    assert_same(nd.take_rows(T, I), t[ids.astype(int)], rtol=0, atol=0)
    R, r = make_view((7, 4), layout, device, rng)
    expected = np.zeros((6, 4), dtype=np.float32)
    np.add.at(expected, ids.astype(int), r)
    assert_same(nd.scatter_add_rows(R, I, 6), expected, rtol=1e-6, atol=1e-6)
    # ids given as a non-compact view
    I2 = nd.array(np.array([[1, 9], [4, 9]], dtype=np.float32), device=device)[:, 0]
    assert_same(nd.take_rows(T, I2), t[[1, 4]], rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bad", [6.0, -1.0, 1.5, 100.0])
def test_take_rows_and_scatter_add_rows_raise_index_error(device, bad):
    T = nd.array(np.zeros((6, 4)), device=device)
    I = nd.array(np.array([0.0, bad, 2.0]), device=device)
    with pytest.raises(IndexError):
        nd.take_rows(T, I)
    with pytest.raises(IndexError):
        nd.scatter_add_rows(nd.array(np.ones((3, 4)), device=device), I, 6)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["compact", "permuted", "sliced"])
def test_take_along_rows_and_scatter_along_rows(device, layout, rng):
    T, t = make_view((5, 4), layout, device, rng)
    ids = np.array([3, 0, 0, 2, 1], dtype=np.float32)
    I = nd.array(ids, device=device)
    assert_same(nd.take_along_rows(T, I), t[np.arange(5), ids.astype(int)], rtol=0, atol=0)
    V, v = make_view((5,), layout, device, rng)
    expected = np.zeros((5, 4), dtype=np.float32)
    expected[np.arange(5), ids.astype(int)] = v
    assert_same(nd.scatter_along_rows(V, I, 4), expected, rtol=0, atol=0)
    with pytest.raises(IndexError):
        nd.take_along_rows(T, nd.array(np.array([0, 4, 0, 0, 0.0]), device=device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["compact", "permuted", "sliced"])
@pytest.mark.parametrize("axis", [None, 0, 1, (0, 1)])
def test_logsumexp_matches_numpy(device, layout, axis, rng):
    A, a = make_view((6, 37), layout, device, rng)
    a = a.astype(np.float64) * 30  # large values: a naive log(sum(exp)) would overflow
    A = nd.array(a.astype(np.float32), device=device)
    m = a.max(axis=axis, keepdims=True)
    expected = m + np.log(np.exp(a - m).sum(axis=axis, keepdims=True))
    assert_same(A.logsumexp(axis=axis, keepdims=True), expected, rtol=1e-5, atol=1e-5)
    assert_same(nd.logsumexp(A, axis=axis), np.squeeze(expected, axis=axis), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_logsumexp_special_values(device):
    a = np.array([[-np.inf, -np.inf], [np.inf, 1.0], [np.nan, 1.0], [0.0, -np.inf]], dtype=np.float32)
    got = nd.logsumexp(nd.array(a, device=device), axis=1).numpy()
    np.testing.assert_array_equal(got, np.array([-np.inf, np.inf, np.nan, 0.0], dtype=np.float32))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["compact", "permuted", "sliced"])
def test_softmax_xent_grad_matches_numpy(device, layout, rng):
    Z, z = make_view((5, 33), layout, device, rng)
    ids = np.array([3, 0, 32, 2, 1], dtype=np.float32)
    g = rng.standard_normal(5).astype(np.float32)
    got = nd.softmax_xent_grad(Z, nd.array(ids, device=device), nd.array(g, device=device))
    z = z.astype(np.float64)
    expected = np.exp(z - z.max(1, keepdims=True))
    expected = expected / expected.sum(1, keepdims=True)
    expected[np.arange(5), ids.astype(int)] -= 1
    assert_same(got, expected * g[:, None], rtol=1e-5, atol=1e-6)
    with pytest.raises(IndexError):
        nd.softmax_xent_grad(Z, nd.array(np.array([0, 33, 0, 0, 0.0]), device=device), nd.array(g, device=device))
    with pytest.raises(ValueError, match="softmax_xent_grad"):
        nd.softmax_xent_grad(Z, nd.array(ids[:4], device=device), nd.array(g, device=device))


# ----- matmul reads a transposed operand in place ----------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("mnp", [(300, 200, 150), (5, 3, 4), (64, 1, 7), (2, 50, 9), (40, 30, 1), (257, 129, 65)])
def test_matmul_of_transposed_operands_equals_compact_copies_and_copies_nothing(device, dtype, mnp):
    """x.permute((1, 0)) of a compact matrix goes to the backend as it is (trans_a / trans_b): the same bytes as
    the product of compact copies (packed or not, every dtype), and the allocator's peak is that product's (its
    output, and for 16-bit its float32 accumulator): no transposed copy."""
    m, n, p = mnp
    rng = np.random.default_rng(m * n * p)
    A, B = rng.standard_normal((m, n)).astype(np.float32), rng.standard_normal((n, p)).astype(np.float32)
    a, b = (nd.array(x, device=device).astype(dtype) for x in (A, B))
    a_t, b_t = (nd.array(x.T.copy(), device=device).astype(dtype).permute((1, 0)) for x in (A, B))
    assert not a_t.is_compact() or m == 1 or n == 1

    compact_peak, expected = peak_during(device, lambda: a @ b)
    for x, y in ((a_t, b), (a, b_t), (a_t, b_t)):
        peak, out = peak_during(device, lambda: x @ y)
        assert peak == compact_peak
        np.testing.assert_array_equal(out.numpy().view(np.uint8), expected.numpy().view(np.uint8))
