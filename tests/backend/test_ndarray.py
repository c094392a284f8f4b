"""NDArray against NumPy, the oracle, on every device, on compact and non-compact inputs: creation and conversion,
views (compact, reshape, permute, broadcast, getitem, setitem), the property-based tests, errors (never a crash)
and the devices, including importing needle without the compiled module. The operations: test_ndarray_ops.py.

Each test builds the same array in NumPy (float32) and as an NDArray, applies the operation to both and compares.
Non-compact inputs come from `make_view()` (ndarray_cases.py): the same values as a permuted, sliced (offset +
step), flipped or broadcast view of a larger buffer. The property-based tests (hypothesis, derandomized) draw
random shapes, views and values.
"""
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import needle as ndl
from needle import backend_ndarray as nd

from conftest import DEVICES
from ndarray_cases import EWISE_OPS, HYPOTHESIS, LAYOUTS, assert_same, element_strides, make_view

REPO = os.path.join(os.path.dirname(__file__), "..", "..")


# ----- creation and conversion -------------------------------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.smoke
def test_array_from_numpy_list_and_ints(device):
    a = np.arange(12, dtype=np.float64).reshape(3, 4) / 7
    A = nd.array(a, device=device)
    assert A.shape == (3, 4) and A.strides == (4, 1) and A.device == device and A.dtype == "float32"
    assert A.size == 12 and A.ndim == 2 and len(A) == 3
    np.testing.assert_array_equal(A.numpy(), a.astype(np.float32))
    B = nd.array([[1, 2], [3, 4]], device=device)  # integers become float32
    assert B.numpy().dtype == np.float32
    np.testing.assert_array_equal(B.numpy(), [[1, 2], [3, 4]])
    C = nd.NDArray(np.array(3.5), device=device)
    assert C.shape == () and C.numpy() == np.float32(3.5)
    assert nd.array(np.zeros((0, 3)), device=device).shape == (0, 3)
    np.testing.assert_array_equal(nd.array(a.T[::2], device=device).numpy(), a.T[::2].astype(np.float32))  # strided
    assert nd.array(np.array([True, False]), device=device).numpy().tolist() == [1.0, 0.0]


@pytest.mark.parametrize("device", DEVICES)
def test_numpy_returns_a_copy_and_ndarray_copies(device):
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    A = nd.array(a, device=device)
    out = A.numpy()
    out[0, 0] = 100.0
    assert A.numpy()[0, 0] == 0.0
    B = nd.NDArray(A)  # a copy, not a view
    B[0, 0] = 50.0
    assert A.numpy()[0, 0] == 0.0 and B.numpy()[0, 0] == 50.0
    np.testing.assert_array_equal(np.asarray(A), a)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_numpy_into_copies_a_strided_view_into_a_reused_array_and_refuses_a_wrong_one(device, dtype):
    """offload.py parks values in reused host buffers: numpy_into writes into one, no array made per copy."""
    a = nd.array(np.arange(24, dtype=np.float32).reshape(2, 3, 4), device=device, dtype=dtype).permute((2, 0, 1))
    out = np.full((4, 2, 3), -1, dtype=nd.DTYPES[dtype])
    assert nd.array_api.copy_to_host(a, out) is out
    np.testing.assert_array_equal(out, a.numpy())
    with pytest.raises(ValueError, match="numpy_into"):
        a.numpy_into(np.empty((4, 2, 2), dtype=nd.DTYPES[dtype]))
    with pytest.raises(ValueError, match="numpy_into"):
        a.numpy_into(np.empty((4, 2, 3), dtype=np.float64))


@pytest.mark.parametrize("device", DEVICES)
def test_empty_full_zeros(device):
    E = nd.empty((2, 3), device=device)
    assert E.shape == (2, 3) and E.is_compact() and E.device == device
    F = nd.full((2, 3, 4), -1.25, device=device)
    np.testing.assert_array_equal(F.numpy(), np.full((2, 3, 4), -1.25, dtype=np.float32))
    np.testing.assert_array_equal(device.full((5,), 7.0).numpy(), np.full(5, 7.0, dtype=np.float32))
    assert device.empty((4, 1)).shape == (4, 1)
    np.testing.assert_array_equal(nd.zeros((3,), device=device).numpy(), np.zeros(3, np.float32))
    F.fill(2.0)
    np.testing.assert_array_equal(F.numpy(), np.full((2, 3, 4), 2.0, dtype=np.float32))


@pytest.mark.parametrize("device", DEVICES)
def test_device_rand_randn_one_hot_follow_numpy_global_rng(device):
    np.random.seed(3)
    r = device.rand(3, 4)
    n = device.randn(2, 5)
    np.random.seed(3)
    np.testing.assert_array_equal(r.numpy(), np.random.rand(3, 4).astype(np.float32))
    np.testing.assert_array_equal(n.numpy(), np.random.randn(2, 5).astype(np.float32))
    oh = device.one_hot(4, nd.array(np.array([3, 0, 3]), device=device))
    np.testing.assert_array_equal(oh.numpy(), np.eye(4, dtype=np.float32)[[3, 0, 3]])
    np.testing.assert_array_equal(device.one_hot(3, [1, 2]).numpy(), np.eye(3, dtype=np.float32)[[1, 2]])


@pytest.mark.parametrize("device", DEVICES)
def test_zero_dim_and_empty_arrays(device):
    A = nd.array(np.array(3.0), device=device)
    assert A.shape == () and A.strides == () and A.is_compact()
    assert (A + 1.0).numpy() == np.float32(4.0) and A.sum().shape == () and A[()].numpy() == np.float32(3.0)
    np.testing.assert_array_equal(A.broadcast_to((2, 2)).numpy(), np.full((2, 2), 3.0, np.float32))
    E = nd.array(np.zeros((0, 3)), device=device)
    assert (E + 1.0).shape == (0, 3) and E.sum(axis=1).shape == (0,) and E.permute((1, 0)).shape == (3, 0)
    np.testing.assert_array_equal((E.permute((1, 0)) @ nd.array(np.ones((0, 2)), device=device)).numpy(),
                                  np.zeros((3, 2), np.float32))  # an empty inner dimension sums to 0
    with pytest.raises(ValueError):
        E.max(axis=0)  # NumPy raises too: no identity for max


@pytest.mark.parametrize("device", DEVICES)
def test_flat_is_a_writable_view(device):
    A = nd.array(np.arange(6, dtype=np.float32).reshape(2, 3), device=device)
    flat = A.flat
    assert flat.shape == (6,)
    flat[4] = -1.0
    np.testing.assert_array_equal(A.numpy(), [[0, 1, 2], [3, -1, 5]])
    with pytest.raises(ValueError):
        _ = A.permute((1, 0)).flat


# ----- compact, views --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_compact_and_is_compact(device, layout, rng):
    A, a = make_view((3, 4, 2), layout, device, rng)
    assert A.is_compact() == (layout == "compact")
    C = A.compact()
    assert C.is_compact() and C.strides == (8, 2, 1)
    assert_same(C, a, rtol=0, atol=0)
    if layout == "compact":
        assert C is A  # compact arrays are not copied


@pytest.mark.parametrize("device", DEVICES)
def test_prefix_slice_with_compact_strides_is_not_compact(device):
    A = nd.array(np.arange(12, dtype=np.float32).reshape(4, 3), device=device)
    part = A[1:3]  # strides (3, 1) but a window of a bigger buffer
    assert part.strides == (3, 1) and not part.is_compact()
    assert_same(part.compact(), np.arange(12, dtype=np.float32).reshape(4, 3)[1:3], rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.smoke
def test_reshape_is_a_view_of_compact_arrays(device):
    a = np.arange(24, dtype=np.float32)
    A = nd.array(a, device=device)
    for shape in [(2, 3, 4), (4, 6), (24,), (1, 24, 1), (2, -1, 3), (-1,)]:
        R = A.reshape(shape)
        assert_same(R, a.reshape(shape), rtol=0, atol=0)
        assert R.strides == element_strides(a.reshape(shape))
    R = A.reshape((4, 6))
    R[1, 2] = -9.0  # the view shares A's buffer
    assert A.numpy()[8] == -9.0
    assert nd.reshape(A.permute((0,)), (6, 4)).shape == (6, 4)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["permuted", "sliced", "flipped", "broadcast"])
def test_reshape_of_non_compact_raises_but_functional_reshape_compacts(device, layout, rng):
    A, a = make_view((3, 4), layout, device, rng)
    with pytest.raises(ValueError, match="compact"):
        A.reshape((12,))
    assert_same(nd.reshape(A, (4, 3)), a.reshape(4, 3), rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_reshape_errors(device):
    A = nd.array(np.zeros((2, 3)), device=device)
    for bad in [(4, 2), (5,), (-1, -1), (-1, 4), (0, -1)]:
        with pytest.raises(ValueError):
            A.reshape(bad)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("axes", [(0, 1, 2), (2, 1, 0), (1, 2, 0), (0, 2, 1), (-1, 0, 1)])
def test_permute(device, layout, axes, rng):
    A, a = make_view((2, 3, 4), layout, device, rng)
    P = A.permute(axes)
    assert_same(P, a.transpose(axes), rtol=0, atol=0)
    assert P.strides == tuple(A.strides[ax] for ax in axes)
    if layout == "compact":
        assert P.strides == element_strides(a.transpose(axes))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("shape", [(3, 1, 4, 1), (2, 3, 1, 4, 5), (6, 3, 5, 4, 5)])
def test_broadcast_to(device, layout, shape, rng):
    A, a = make_view((3, 1, 4, 1), layout, device, rng)
    B = A.broadcast_to(shape)
    assert_same(B, np.broadcast_to(a, shape), rtol=0, atol=0)
    lead = len(shape) - 4
    assert all(s == 0 for s in B.strides[:lead])
    assert all(B.strides[lead + i] == 0 for i, (o, n) in enumerate(zip(A.shape, shape[lead:])) if o != n)
    if layout == "compact":  # NumPy's strides (a size-1 axis may have any stride; NumPy gives it 0)
        expected = element_strides(np.broadcast_to(a, shape))
        assert all(s == e for s, e, n in zip(B.strides, expected, shape) if n != 1)


GETITEM_INDICES = [
    (1,),
    (-1,),
    (0, 2),
    (-2, -1, -3),
    (slice(None),),
    (slice(1, 3),),
    (slice(1, None), slice(None, None, 2)),
    (slice(None, None, -1),),
    (slice(2, 0, -1), slice(3, None, -2), slice(1, 4, 3)),
    (1, slice(1, 3), 2),
    (slice(0, 1), -1),
    (slice(-2, None), 0, slice(None, None, 2)),
    (slice(3, 1),),  # empty
    (slice(-100, 100), slice(1, 100, 2)),  # clipped like NumPy
    (np.int64(2), slice(None), np.int32(-1)),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("idx", GETITEM_INDICES, ids=lambda i: repr(i).replace(" ", ""))
def test_getitem_matches_numpy_values_and_strides(device, idx):
    a = np.arange(4 * 5 * 6, dtype=np.float32).reshape(4, 5, 6)
    A = nd.array(a, device=device)
    V = A[idx]
    assert V.shape == a[idx].shape
    np.testing.assert_array_equal(V.numpy(), a[idx])
    if V.size:
        assert V.strides == element_strides(a[idx])
    assert A.numpy().tolist() == a.tolist()  # a view: nothing copied or changed
    for dim, sl in enumerate(i for i in idx if isinstance(i, slice)):
        assert A.process_slice(sl, dim) == slice(*sl.indices(A.shape[dim]))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("idx", GETITEM_INDICES, ids=lambda i: repr(i).replace(" ", ""))
def test_getitem_of_non_compact_views(device, layout, idx, rng):
    A, a = make_view((4, 5, 6), layout, device, rng)
    assert_same(A[idx], a[idx], rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.smoke
def test_getitem_chained_views_share_memory(device):
    a = np.arange(60, dtype=np.float32).reshape(3, 4, 5)
    A = nd.array(a, device=device)
    V = A.permute((2, 0, 1))[1:, ::-1][2, 1:3]
    v = a.transpose(2, 0, 1)[1:, ::-1][2, 1:3]
    np.testing.assert_array_equal(V.numpy(), v)
    assert V.strides == element_strides(v)
    V[0, 0] = -1.0
    v[0, 0] = -1.0
    np.testing.assert_array_equal(A.numpy(), a)


@pytest.mark.parametrize("device", DEVICES)
def test_buffer_is_shared_by_views_and_not_by_copies(device):
    """NDArray.buffer, the public accessor for the buffer under an array: every view has its array's, every
    computed or compacted array a new one; it is what backend functions take and it knows its size and dtype."""
    A = nd.array(np.arange(12, dtype=np.float32).reshape(3, 4), device=device)
    views = [A.reshape((4, 3)), A.permute((1, 0)), A[1:, ::2], A.broadcast_to((2, 3, 4)), A.flat, A.compact()]
    assert all(view.buffer is A.buffer for view in views)
    assert A.permute((1, 0)).compact().buffer is not A.buffer and (A + 0.0).buffer is not A.buffer
    assert A.buffer.size == 12 and A.buffer.dtype == "float32" and A.astype("float16").buffer.dtype == "float16"
    out = nd.empty((3, 4), device=device)
    device.mod.ewise_add(A.buffer, A.buffer, out.buffer)
    np.testing.assert_array_equal(out.numpy(), 2 * A.numpy())


SETITEM_INDICES = [
    (slice(None), 1),
    (slice(1, 3), slice(None, None, 2)),
    (slice(None, None, -1), slice(4, 0, -2)),
    (2,),
    (-1, -1),  # a 0-d target: it takes scalars only
    (slice(0, 0),),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("idx, value_layout", [
    pytest.param(idx, layout, id=f"{repr(idx).replace(' ', '')}-{layout}") for idx in SETITEM_INDICES
    for layout in ["compact", "permuted", "sliced", "broadcast", "scalar"] if layout == "scalar" or idx != (-1, -1)])
def test_setitem(device, idx, value_layout, rng):
    a = rng.standard_normal((4, 5)).astype(np.float32)
    A = nd.array(a, device=device)
    target_shape = a[idx].shape
    if value_layout == "scalar":
        value, expected = 3.25, 3.25
    else:
        value, expected = make_view(target_shape, value_layout, device, rng)
    A[idx] = value
    a[idx] = expected
    np.testing.assert_array_equal(A.numpy(), a)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.smoke
def test_setitem_on_views_writes_through(device, rng):
    a = rng.standard_normal((3, 4, 5)).astype(np.float32)
    A = nd.array(a, device=device)
    P = A.permute((2, 0, 1))  # (5, 3, 4)
    P[1:4, :, ::2] = 0.5
    a.transpose(2, 0, 1)[1:4, :, ::2] = 0.5
    np.testing.assert_array_equal(A.numpy(), a)
    S = A[1:, ::-1]  # (2, 4, 5), offset and negative stride
    v = rng.standard_normal((4, 5)).astype(np.float32)
    S[0] = nd.array(v, device=device)
    a[1:, ::-1][0] = v
    np.testing.assert_array_equal(A.numpy(), a)
    S[:, 1] = nd.array(v[:1], device=device)  # (1, 5) broadcast into (2, 5)
    a[1:, ::-1][:, 1] = v[:1]
    np.testing.assert_array_equal(A.numpy(), a)


@pytest.mark.parametrize("device", DEVICES)
def test_setitem_shape_mismatch_raises(device):
    A = nd.array(np.zeros((4, 5)), device=device)
    with pytest.raises(ValueError):
        A[1:3] = nd.array(np.ones((3, 5)), device=device)
    with pytest.raises(IndexError):
        A[4] = 1.0
    np.testing.assert_array_equal(A.numpy(), np.zeros((4, 5)))


# ----- property-based tests (hypothesis, derandomized: the same examples every run) --------------------------------
@st.composite
def strided_views(draw, max_ndim=4, max_side=5):
    """A recipe for a random view: a base shape and the view operations that turn it into the view."""
    ndim = draw(st.integers(1, max_ndim))
    shape = draw(st.lists(st.integers(1, max_side), min_size=ndim, max_size=ndim))
    slices = []
    base = []
    for n in shape:  # each axis: a slice with a random start, step (possibly negative) from a bigger axis
        step = draw(st.sampled_from([1, 1, 2, 3, -1, -2]))
        pad_lo, pad_hi = draw(st.integers(0, 2)), draw(st.integers(0, 2))
        size = pad_lo + abs(step) * (n - 1) + 1 + pad_hi
        base.append(size)
        if step > 0:
            slices.append(slice(pad_lo, pad_lo + step * (n - 1) + 1, step))
        else:
            start = pad_lo + abs(step) * (n - 1)
            slices.append(slice(start, None if pad_lo == 0 else pad_lo - 1, step))
    perm = draw(st.permutations(list(range(ndim))))
    seed = draw(st.integers(0, 2**31 - 1))
    return tuple(base), tuple(slices), tuple(perm), seed


def build_view(recipe, device, positive=False):
    base_shape, slices, perm, seed = recipe
    rng = np.random.default_rng(seed)
    base = (rng.uniform(0.5, 2.0, base_shape) if positive else rng.standard_normal(base_shape)).astype(np.float32)
    A = nd.array(base, device=device)[slices].permute(perm)
    a = base[slices].transpose(perm)
    assert A.shape == a.shape and A.strides == element_strides(a)  # views follow NumPy's strides exactly
    return A, a


@pytest.mark.parametrize("device", DEVICES)
@HYPOTHESIS
@given(recipe=strided_views(), other=st.data(), op=st.sampled_from(["add", "sub", "mul", "div", "maximum", "ge"]),
       scalar=st.floats(-3, 3, width=32))
def test_fuzz_ewise(device, recipe, other, op, scalar):
    A, a = build_view(recipe, device)
    shape = a.shape
    rng = np.random.default_rng(recipe[3] + 1)
    b = rng.standard_normal(shape).astype(np.float32)
    if other.draw(st.booleans()):
        B = nd.array(np.ascontiguousarray(b.T), device=device).permute(tuple(reversed(range(b.ndim))))
    else:
        B = nd.array(b, device=device)
    ours, theirs, _ = EWISE_OPS[op]
    if op == "div":
        b = np.where(np.abs(b) < 0.1, 1.0, b).astype(np.float32)
        B = nd.array(b, device=device)
        scalar = scalar if abs(scalar) >= 0.1 else 1.5
    assert_same(ours(A, B), theirs(a, b), rtol=1e-5, atol=1e-5)
    assert_same(ours(A, scalar), theirs(a, np.float32(scalar)), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
@HYPOTHESIS
@given(recipe=strided_views(), data=st.data(), keepdims=st.booleans(), op=st.sampled_from(["sum", "max"]))
def test_fuzz_reductions(device, recipe, data, keepdims, op):
    A, a = build_view(recipe, device)
    axes = data.draw(st.one_of(st.none(), st.lists(st.integers(0, a.ndim - 1), unique=True).map(tuple)))
    ours = getattr(A, op)(axis=axes, keepdims=keepdims)
    assert_same(ours, np.asarray(getattr(a, op)(axis=axes, keepdims=keepdims)), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
@HYPOTHESIS
@given(batch=st.lists(st.integers(1, 3), max_size=2), m=st.integers(1, 20), n=st.integers(1, 20),
       p=st.integers(1, 20), transpose_a=st.booleans(), transpose_b=st.booleans(), seed=st.integers(0, 1000),
       drop=st.integers(0, 2))
def test_fuzz_matmul(device, batch, m, n, p, transpose_a, transpose_b, seed, drop):
    rng = np.random.default_rng(seed)
    batch_b = batch[drop:]  # the second operand may have fewer batch axes (broadcast)
    a = rng.standard_normal(tuple(batch) + (m, n)).astype(np.float32)
    b = rng.standard_normal(tuple(batch_b) + (n, p)).astype(np.float32)

    def put(x, transpose):
        if not transpose:
            return nd.array(x, device=device)
        k = x.ndim
        swap = tuple(range(k - 2)) + (k - 1, k - 2)
        return nd.array(np.ascontiguousarray(x.transpose(swap)), device=device).permute(swap)

    assert_same(put(a, transpose_a) @ put(b, transpose_b), a @ b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("device", DEVICES)
@HYPOTHESIS
@given(recipe=strided_views(), data=st.data())
def test_fuzz_views_reshape_broadcast_getitem(device, recipe, data):
    A, a = build_view(recipe, device)
    # reshape (after compact) to a random factorization of the size
    C = A.compact()
    shape = data.draw(st.sampled_from([(a.size,), (1, a.size), (a.size, 1)] + [
        (d, a.size // d) for d in range(1, a.size + 1) if a.size % d == 0]))
    assert_same(C.reshape(shape), a.reshape(shape), rtol=0, atol=0)
    # broadcast: new leading axes, and size-1 axes repeated
    ones = tuple(1 if data.draw(st.booleans()) else n for n in a.shape)
    small = nd.array(np.ascontiguousarray(a[tuple(slice(0, k) for k in ones)]), device=device)
    target = tuple(data.draw(st.lists(st.integers(1, 3), max_size=2))) + a.shape
    B = small.broadcast_to(target)
    b = np.broadcast_to(a[tuple(slice(0, k) for k in ones)], target)
    assert_same(B, b, rtol=0, atol=0)
    # getitem of the view
    idx = tuple(
        data.draw(st.one_of(st.integers(-n, n - 1), st.builds(slice, st.integers(-n - 1, n), st.integers(-n - 1, n),
                                                                st.sampled_from([None, 1, 2, -1, -3]))))
        for n in a.shape[: data.draw(st.integers(1, a.ndim))]
    )
    assert_same(A[idx], a[idx], rtol=0, atol=0)
    if A[idx].size:
        assert A[idx].strides == element_strides(a[idx])


@pytest.mark.parametrize("device", DEVICES)
@HYPOTHESIS
@given(recipe=strided_views(max_ndim=3), data=st.data(), scalar=st.booleans())
def test_fuzz_setitem(device, recipe, data, scalar):
    base_shape, slices, perm, seed = recipe
    rng = np.random.default_rng(seed)
    base = rng.standard_normal(base_shape).astype(np.float32)
    A = nd.array(base, device=device)
    view_slices = tuple(slices)
    target = base[view_slices].transpose(perm)  # the values are drawn in the permuted layout
    if scalar:
        value = float(rng.standard_normal())
        A[view_slices] = value
        base[view_slices] = value
    else:
        v = rng.standard_normal(target.shape).astype(np.float32)
        # write the permuted values through the (un-permuted) slice
        inverse = tuple(np.argsort(perm))
        A[view_slices] = nd.array(v, device=device).permute(inverse)
        base[view_slices] = v.transpose(inverse)
    np.testing.assert_array_equal(A.numpy(), base)


# ----- errors: exceptions, never crashes ------------------------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
def test_wrong_dtype_raises_type_error(device):
    with pytest.raises(TypeError):
        nd.array(np.zeros(3), dtype="float64", device=device)
    with pytest.raises(TypeError):
        nd.array(np.zeros(3), dtype=np.float64, device=device)
    with pytest.raises(TypeError):
        nd.empty((2,), dtype="float64", device=device)
    with pytest.raises(TypeError):
        nd.full((2,), 1.0, dtype="int64", device=device)
    with pytest.raises(TypeError):
        device.empty((2,), dtype="float8")
    with pytest.raises(TypeError):
        nd.array(np.array([1, "a"], dtype=object), device=device)
    with pytest.raises(TypeError):
        nd.array(np.array(["x", "y"]), device=device)
    with pytest.raises(TypeError):
        nd.array(np.array([1 + 2j]), device=device)


@pytest.mark.parametrize("device", DEVICES)
def test_wrong_shapes_and_axes_raise_value_error(device):
    A = nd.array(np.zeros((2, 3)), device=device)
    B = nd.array(np.zeros((3, 2)), device=device)
    for bad in [lambda: A + B, lambda: A * B, lambda: A.maximum(B), lambda: A == B, lambda: A >= B,
                lambda: A / B, lambda: A**B]:
        with pytest.raises(ValueError):
            bad()
    with pytest.raises(ValueError):
        A.broadcast_to((2, 4))
    with pytest.raises(ValueError):
        A.broadcast_to((3,))
    with pytest.raises(ValueError):
        A @ A
    with pytest.raises(ValueError):
        nd.array(np.zeros(3), device=device) @ A
    with pytest.raises(ValueError):
        nd.array(np.zeros((2, 2, 3)), device=device) @ nd.array(np.zeros((3, 3, 2)), device=device)
    for axis in [2, -3, (0, 5)]:
        with pytest.raises(ValueError):
            A.sum(axis=axis)
        with pytest.raises(ValueError):
            A.max(axis=axis)
    with pytest.raises(ValueError):
        A.permute((0, 2))
    with pytest.raises(ValueError):
        A.permute((0, 0))
    with pytest.raises(ValueError):
        A.flip((3,))
    with pytest.raises(ValueError):
        nd.stack([A, B])
    with pytest.raises(ValueError):
        nd.NDArray.make((-1, 2), device=device)
    with pytest.raises(ValueError):
        A.as_strided((2, 3), (1,))


@pytest.mark.parametrize("device", DEVICES)
def test_out_of_range_index_raises_index_error(device):
    A = nd.array(np.zeros((2, 3)), device=device)
    for idx in [2, -3, (0, 3), (1, -4), (0, 0, 0)]:
        with pytest.raises(IndexError):
            A[idx]
        with pytest.raises(IndexError):
            A[idx] = 1.0
    with pytest.raises(TypeError):
        A[[0, 1]]


@pytest.mark.parametrize("device", DEVICES)
def test_as_strided_and_make_outside_the_buffer_raise_index_error(device):
    A = nd.array(np.arange(12, dtype=np.float32), device=device)
    np.testing.assert_array_equal(A.as_strided((3, 4), (4, 1)).numpy(), np.arange(12).reshape(3, 4))
    np.testing.assert_array_equal(A.as_strided((3, 2), (1, 0)).numpy(), [[0, 0], [1, 1], [2, 2]])
    for shape, strides in [((3, 5), (4, 1)), ((13,), (1,)), ((2,), (-1,)), ((4, 4), (4, 1)), ((2, 2), (100, 1))]:
        with pytest.raises(IndexError):
            A.as_strided(shape, strides)
    V = A[4:]  # offset 4: the buffer still ends at 12
    with pytest.raises(IndexError):
        V.as_strided((9,), (1,))
    np.testing.assert_array_equal(V.as_strided((2,), (-4,)).numpy(), [4, 0])
    with pytest.raises(IndexError):
        V.as_strided((3,), (-4,))
    with pytest.raises(IndexError):
        nd.NDArray.make((5,), device=device, handle=A.buffer, offset=8)
    with pytest.raises(IndexError):
        nd.NDArray.make((2,), device=device, handle=A.buffer, offset=-1)
    assert nd.NDArray.make((0,), device=device, handle=A.buffer, offset=0).shape == (0,)


def _other_device(device):
    return nd.cpu_numpy() if device != nd.cpu_numpy() else nd.cpu()


@pytest.mark.parametrize("device", DEVICES)
def test_device_mismatch_raises_value_error(device):
    other = _other_device(device)
    if not other.enabled():
        pytest.skip(f"{other} is not available")
    A = nd.array(np.ones((2, 2)), device=device)
    B = nd.array(np.ones((2, 2)), device=other)
    for bad in [lambda: A + B, lambda: A * B, lambda: A @ B, lambda: A.maximum(B), lambda: A >= B]:
        with pytest.raises(ValueError):
            bad()
    with pytest.raises(ValueError):
        A[0] = B[0]
    with pytest.raises(ValueError):
        nd.take_rows(A, nd.array(np.zeros(1), device=other))
    moved = A.to(other)
    assert moved.device == other and moved.numpy().tolist() == [[1, 1], [1, 1]]
    assert nd.NDArray(A, device=other).device == other


# ----- devices --------------------------------------------------------------------------------------------------------
def test_devices():
    assert str(ndl.cpu()) == "cpu()" and repr(ndl.cpu()) == "cpu()"
    assert str(ndl.cuda()) == "cuda()" and str(ndl.cpu_numpy()) == "cpu_numpy()"
    assert ndl.cpu() == nd.cpu() and ndl.cpu() != ndl.cpu_numpy() and ndl.cpu() != ndl.cuda()
    assert ndl.cpu_numpy().enabled()
    assert isinstance(ndl.cuda().enabled(), bool)
    if not os.path.exists("/dev/nvidia0"):
        assert not ndl.cuda().enabled()
        with pytest.raises(RuntimeError):
            nd.array(np.zeros(2), device=ndl.cuda())
    expected_default = ndl.cpu() if ndl.cpu().enabled() else ndl.cpu_numpy()
    assert ndl.default_device() == expected_default
    assert nd.array(np.zeros(2)).device == expected_default
    names = [str(d) for d in ndl.all_devices()]
    assert {"cpu()", "cuda()", "cpu_numpy()"} <= set(names)
    assert ndl.cpu().__tile_size__ >= 1 and callable(ndl.cpu_numpy().matmul_tiled)
    assert nd.cpu_numpy().__device_name__ == "cpu_numpy"
    if ndl.cpu().enabled():
        assert ndl.cpu().__device_name__ == "cpu"


def test_import_without_compiled_module():
    """Hide the compiled modules from the import system: needle imports, cpu_numpy works, cpu() says to `make`."""
    script = textwrap.dedent("""
        import sys
        from importlib.abc import MetaPathFinder

        class Hide(MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.startswith("needle.backend_ndarray.ndarray_backend_c"):
                    raise ModuleNotFoundError(f"No module named {name!r}", name=name)
                return None

        sys.meta_path.insert(0, Hide())
        sys.path.insert(0, "python")
        import numpy as np
        import needle as ndl
        from needle import backend_ndarray as nd

        assert "needle.backend_ndarray.ndarray_backend_cpu" not in sys.modules
        assert not ndl.cpu().enabled() and not ndl.cuda().enabled() and ndl.cpu_numpy().enabled()
        assert ndl.default_device() == ndl.cpu_numpy()
        a = nd.array(np.arange(6).reshape(2, 3))
        assert a.device == ndl.cpu_numpy() and (a @ a.permute((1, 0))).numpy().tolist() == [[5, 14], [14, 50]]
        x = ndl.Tensor([[1.0, 2.0]])
        (x * x).sum().backward()
        assert x.grad.numpy().tolist() == [[2.0, 4.0]]
        for use in [lambda: nd.array(np.zeros(2), device=ndl.cpu()), lambda: ndl.Tensor([1.0], device=ndl.cpu()),
                    lambda: nd.memory_stats(ndl.cpu()), lambda: ndl.cpu().matmul_tiled]:
            try:
                use()
            except RuntimeError as err:
                assert "make" in str(err), err
            else:
                raise AssertionError("using cpu() without the compiled module did not raise")
        print("OK")
    """)
    env = dict(os.environ, NEEDLE_BACKEND="nd")
    result = subprocess.run([sys.executable, "-c", script], check=False, cwd=REPO, env=env, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip() == "OK"


# ----- devices and arrays as Python values (copy, pickle, introspection) ----------------------------------------------
def _pickle_round_trip(value):
    import pickle

    return pickle.loads(pickle.dumps(value))


def _assert_plain_value(device):
    """What Python's protocols and pytest ask of any object: optional dunders are absent, copies and pickles equal."""
    import copy

    assert getattr(device, "__name__", None) is None  # pytest's parametrize ids ask this
    assert not hasattr(device, "no_such_attribute")
    with pytest.raises(AttributeError, match="no_such_attribute"):
        device.no_such_attribute
    assert repr(device) == device.name + "()" and device == getattr(nd, device.name)()
    assert copy.copy(device) == device and copy.deepcopy(device) == device
    assert _pickle_round_trip(device) == device


@pytest.mark.parametrize("name", ["cpu", "cuda", "cpu_numpy"])
def test_devices_are_plain_values(name):
    """Every device as this machine has it (here the cuda module may be built while no GPU exists)."""
    device = getattr(nd, name)()
    _assert_plain_value(device)
    assert _pickle_round_trip(device) is device  # a pickle names the device; loading it gives the same one


@pytest.mark.parametrize("name", ["cpu", "cuda"])
def test_device_without_its_module_is_a_plain_value_and_backend_calls_say_how_to_build(name, monkeypatch):
    device = getattr(nd, name)()
    monkeypatch.setattr(device, "mod", None)  # how a device whose compiled module failed to import looks
    assert not device.enabled()
    _assert_plain_value(device)
    # Only backend functions raise the build hint, as an error that getattr(..., default) and hasattr do not hide.
    for use in [lambda: device.ewise_add, lambda: device.__tile_size__, lambda: getattr(device, "matmul", None),
                lambda: nd.array(np.zeros(2), device=device), lambda: nd.memory_stats(device)]:
        with pytest.raises(nd.BackendNotBuiltError, match="make") as err:
            use()
        assert not isinstance(err.value, AttributeError) and isinstance(err.value, RuntimeError)


def test_parametrize_over_cpu_and_cuda_collects_without_compiled_modules(tmp_path):
    """A course test file parametrizes over [ndl.cpu(), ndl.cuda()]; pytest must collect it without any build."""
    (tmp_path / "conftest.py").write_text(textwrap.dedent(f"""
        import sys
        from importlib.abc import MetaPathFinder

        class Hide(MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.startswith("needle.backend_ndarray.ndarray_backend_c"):
                    raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
                return None

        sys.meta_path.insert(0, Hide())
        sys.path.insert(0, {os.path.join(os.path.abspath(REPO), "python")!r})
    """))
    (tmp_path / "test_course.py").write_text(textwrap.dedent("""
        import pytest
        import needle as ndl

        @pytest.mark.parametrize("device", [ndl.cpu(), ndl.cuda()])
        def test_device(device):
            assert not device.enabled()
    """))
    env = dict(os.environ, NEEDLE_BACKEND="nd")
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
                            check=False, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "2 passed" in result.stdout, result.stdout + result.stderr


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_ndarray_pickles_and_copies_by_value(device, layout, rng):
    import copy

    A, a = make_view((3, 4), layout, device, rng)
    for B in [_pickle_round_trip(A), copy.deepcopy(A), copy.copy(A)]:
        # The values, shape and device; a non-compact view comes back as its compact values, in a new buffer.
        assert B.shape == A.shape and B.device == device and B.is_compact()
        np.testing.assert_array_equal(B.numpy(), a)
        B.fill(7.0)
        np.testing.assert_array_equal(A.numpy(), a)  # the copy is independent of the original's buffer
    negative_zero = nd.array(np.float32(-0.0), device=device)
    assert np.signbit(copy.copy(negative_zero).numpy())  # a bit-exact copy, not `A + 0.0`


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("index", [True, False, np.bool_(True), np.False_, (0, True), (slice(None), np.True_)],
                         ids=["True", "False", "np.True_", "np.False_", "(0, True)", "(:, np.True_)"])
def test_bool_index_raises_instead_of_acting_as_int(device, index):
    A = nd.array(np.arange(6).reshape(2, 3), device=device)
    with pytest.raises(TypeError, match="NDArray ind.*bool"):
        A[index]
    with pytest.raises(TypeError, match="NDArray ind.*bool"):
        A[index] = 1.0
    np.testing.assert_array_equal(A.numpy(), np.arange(6).reshape(2, 3))


@pytest.mark.parametrize("device", DEVICES)
def test_a_write_through_a_broadcast_view_is_refused(device):
    """A broadcast view reaches one element from several indices: a write through it kept whichever value came
    last. NDArray refuses it (NumPy's broadcast views are read-only), and so does each backend's ewise_setitem."""
    A = nd.array(np.zeros((1, 4)), device=device)
    B = A.broadcast_to((3, 4))
    values = nd.array(np.arange(12, dtype=np.float32).reshape(3, 4), device=device)
    with pytest.raises(ValueError, match=r"setitem: .*strides \(0, 1\)\) repeats elements along axis 0"):
        B[:, :] = values
    with pytest.raises(ValueError, match="repeats elements along axis 0"):
        B[1:] = 5.0
    with pytest.raises(ValueError, match=r"ewise_setitem: the view of out repeats elements \(stride 0 along axis 0"):
        device.mod.ewise_setitem(values.buffer, A.buffer, [3, 4], [0, 1], 0)
    np.testing.assert_array_equal(A.numpy(), np.zeros((1, 4)))
    B[2:, 1:3] = 2.0  # one index per element: a write
    np.testing.assert_array_equal(A.numpy(), [[0, 2, 2, 0]])


@pytest.mark.parametrize("device", DEVICES)
def test_a_shape_of_non_integers_is_refused_naming_the_function(device):
    """int() truncated each extent: empty((2.5, 4)) made a (2, 4) array, and reshape((2.5, 4)) a (2, 4) view."""
    A = nd.array(np.zeros(8), device=device)
    makers = {"empty": lambda shape: nd.empty(shape, device=device),
              "zeros": lambda shape: nd.zeros(shape, device=device),
              "full": lambda shape: nd.full(shape, 1.0, device=device), "reshape": A.reshape,
              "NDArray.make": lambda shape: nd.NDArray.make(shape, device=device),
              "broadcast_to": lambda shape: A.reshape((1, 4, 2)).broadcast_to(shape[:1] + (4, 2))}
    for name, make in makers.items():
        for shape in [(2.5, 4), (np.float32(2.0), 4)]:
            with pytest.raises(TypeError, match=rf"^{name}: a shape must be a sequence of integers, got \("):
                make(shape)
    with pytest.raises(TypeError, match=r"^empty: a shape must be a sequence of integers"):
        device.empty((2, "4"))
    with pytest.raises(ValueError, match=r"^full: a shape must not be negative, got \(-1, 2\)"):
        nd.full((-1, 2), 0.0, device=device)
    assert nd.empty((np.int64(2), 4), device=device).shape == (2, 4)  # NumPy's integers are integers

