"""The fused layer norm (`ops.layer_norm`, src/README.md: layernorm_forward / layernorm_backward).

1. the kernels against the composite formula in float64 NumPy, in every dtype, and the NumPy face (on the NumPy
   reference here; tests/backend's test_layernorm_compiled.py runs these tests on the compiled devices);
2. the op: forward and all three gradients against the composite of needle's own ops (what LayerNorm1d was),
   a numerical gradient check, eager = lazy, and the allocator's peak inside the op (nothing beyond its outputs);
3. LayerNorm1d is one node now, and checkpointing a model around it stays bit-exact;
4. errors name the op and the shapes.
"""

import numpy as np
import pytest

import needle as ndl
from needle import autograd, checkpoint, nn, ops
from needle import backend_ndarray as nd
from needle import backend_numpy as np_face

TOL = {"float32": 2e-5, "bfloat16": 2e-2, "float16": 3e-3}


def reference(x, w, b, g, eps=1e-5):
    """float64 y and (dx, dw, db) of layer norm over the last axis."""
    x, w, b, g = (np.asarray(a, np.float64) for a in (x, w, b, g))
    mean = x.mean(-1, keepdims=True)
    rstd = 1 / np.sqrt(((x - mean) ** 2).mean(-1, keepdims=True) + eps)
    xhat = (x - mean) * rstd
    gw = g * w
    dx = rstd * (gw - gw.mean(-1, keepdims=True) - xhat * (gw * xhat).mean(-1, keepdims=True))
    axes = tuple(range(x.ndim - 1))
    return xhat * w + b, dx, (g * xhat).sum(axes), g.sum(axes)


def data(shape, seed=0):
    rng = np.random.default_rng(seed)
    n = shape[-1]
    return (rng.standard_normal(shape) * 3 + 1, rng.standard_normal(n), rng.standard_normal(n),
            rng.standard_normal(shape))


def assert_close(ours, expected, dtype):
    ours, expected = np.asarray(ours, np.float64), np.asarray(expected, np.float64)
    scale = max(1.0, np.abs(expected).max())
    np.testing.assert_allclose(ours, expected, rtol=0, atol=TOL[dtype] * scale)


# ----- 1. the kernels -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("shape", [(1, 1), (3, 5), (37, 50), (2, 3, 64), (1, 300), (70, 130)])
def test_kernels_match_the_formula(device, dtype, shape):
    x, w, b, g = data(shape)
    X, W, B, G = (nd.array(a.astype(np.float32), device=device).astype(dtype) for a in (x, w, b, g))
    # the reference takes the stored (rounded) inputs
    y_ref, dx_ref, dw_ref, db_ref = reference(*(a.numpy().astype(np.float64) for a in (X, W, B, G)))
    y = nd.layer_norm(X, W, B, 1e-5)
    dx, dw, db = nd.layer_norm_backward(X, W, G, 1e-5)
    for ours, want in ((y, y_ref), (dx, dx_ref), (dw, dw_ref), (db, db_ref)):
        assert ours.dtype == dtype and ours.shape == want.shape and ours.device == device
        assert_close(ours.numpy().astype(np.float64), want, dtype)


def test_np_face_matches_the_reference_backend():
    x, w, b, g = (a.astype(np.float32) for a in data((4, 6, 10)))
    y = np_face.layer_norm(x, w, b, 1e-5)
    grads = np_face.layer_norm_backward(x, w, g, 1e-5)
    ref = nd.cpu_numpy()
    X, W, B, G = (nd.array(a, device=ref) for a in (x, w, b, g))
    np.testing.assert_array_equal(y, nd.layer_norm(X, W, B, 1e-5).numpy())
    for ours, want in zip(grads, nd.layer_norm_backward(X, W, G, 1e-5)):
        np.testing.assert_allclose(ours, want.numpy(), rtol=1e-6, atol=1e-6)


# ----- 2. the op ----------------------------------------------------------------------------------------------------
def composite(x, w, b, eps=1e-5):
    """LayerNorm1d as it was: a dozen of needle's ops."""
    shape, last = x.shape, len(x.shape) - 1
    kept = tuple(shape[:-1]) + (1,)
    mean = ops.reshape(ops.summation(x, (last,)) / shape[-1], kept)
    centered = x - ops.broadcast_to(mean, shape)
    var = ops.reshape(ops.summation(centered * centered, (last,)) / shape[-1], kept)
    std = ops.broadcast_to((var + eps) ** 0.5, shape)
    row = (1,) * (len(shape) - 1) + (shape[-1],)
    return ops.broadcast_to(ops.reshape(w, row), shape) * (centered / std) + ops.broadcast_to(ops.reshape(b, row),
                                                                                                shape)


@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
@pytest.mark.parametrize("shape", [(1, 1), (5, 8), (2, 3, 16)])
def test_op_equals_the_composite_forward_and_gradients(device, lazy, shape):
    x, w, b, g = data(shape, seed=1)
    results = []
    for fn in (ops.layer_norm, composite):
        X, W, B = (ndl.Tensor(a.astype(np.float32), device=device, requires_grad=True) for a in (x, w, b))
        with autograd.lazy_mode(lazy):
            y = fn(X, W, B)
            (y * ndl.Tensor(g.astype(np.float32), device=device)).sum().backward()
        results.append([y.numpy(), X.grad.numpy(), W.grad.numpy(), B.grad.numpy()])
    for ours, want in zip(*results):
        np.testing.assert_allclose(ours, want, rtol=1e-5, atol=2e-5)


def test_numerical_gradient_in_float64():
    """The backends compute in float32, so the gradient is checked against central differences of the float64
    formula (a float32 forward is too coarse for differences), at float32 accuracy."""
    x, w, b, g = data((3, 7), seed=2)
    X, W, B = (ndl.Tensor(a.astype(np.float32), device=nd.cpu_numpy(), requires_grad=True) for a in (x, w, b))
    (ops.layer_norm(X, W, B) * ndl.Tensor(g.astype(np.float32), device=nd.cpu_numpy())).sum().backward()
    h = 1e-6
    for tensor, values, index in ((X, x, (1, 4)), (W, w, (2,)), (B, b, (5,))):
        plus, minus = values.copy(), values.copy()
        plus[index] += h
        minus[index] -= h
        args = {id(X): x, id(W): w, id(B): b}
        f = []
        for v in (plus, minus):
            args[id(tensor)] = v
            f.append((reference(args[id(X)], args[id(W)], args[id(B)], g)[0] * g).sum())
        assert abs(tensor.grad.numpy()[index] - (f[0] - f[1]) / (2 * h)) < 1e-4


@pytest.mark.devices("cpu", "cpu_numpy")
def test_the_op_allocates_only_its_outputs(device):
    """Forward: the output; gradient: dx, dw, db. The declared workspace is 0 (the ledger's view)."""
    x = ndl.Tensor(np.ones((64, 32), np.float32), device=device, requires_grad=True)
    w = ndl.Tensor(np.ones(32, np.float32), device=device, requires_grad=True)
    b = ndl.Tensor(np.zeros(32, np.float32), device=device, requires_grad=True)
    nd.reset_peak_memory_stats(device)
    before = nd.memory_stats(device)["current_bytes"]
    ops.layer_norm(x, w, b).realize_cached_data()
    assert nd.memory_stats(device)["peak_bytes"] - before == 64 * 32 * 4
    data_ = [a.realize_cached_data() for a in (x, w)]
    g = nd.array(np.ones((64, 32), np.float32), device=device)
    nd.reset_peak_memory_stats(device)
    before = nd.memory_stats(device)["current_bytes"]
    grads = nd.layer_norm_backward(*data_, g, 1e-5)
    assert nd.memory_stats(device)["peak_bytes"] - before == (64 * 32 + 2 * 32) * 4
    assert ops.ops_norm.LayerNorm().workspace((64, 32), (32,), (32,)) == 0
    del grads


# ----- 3. LayerNorm1d ---------------------------------------------------------------------------------------------
def test_layernorm1d_is_one_node_and_matches_the_composite():
    np.random.seed(0)
    layer = nn.LayerNorm1d(16)
    x = ndl.Tensor(np.random.randn(4, 16).astype(np.float32), requires_grad=True)
    y = layer(x)
    assert isinstance(y.op, ops.ops_norm.LayerNorm) and y.inputs[0] is x
    np.testing.assert_allclose(y.numpy(), composite(x, layer.weight, layer.bias).numpy(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("policy", ["all", "sqrt", "selective"])
def test_a_transformer_with_fused_layer_norm_is_bit_exact_under_checkpointing(policy):
    results = []
    for gc in (False, True):
        np.random.seed(3)
        model = nn.Transformer(8, 16, 2, num_head=2, dim_head=4, device=nd.cpu_numpy(), batch_first=True,
                               sequence_len=6)
        if gc:
            model.enable_gc(policy=policy)
        x = ndl.Tensor(np.random.RandomState(4).randn(2, 6, 8).astype(np.float32), device=nd.cpu_numpy())
        out, _ = model(x)
        (out * out).sum().backward()
        results.append([out.numpy()] + [p.grad.numpy() for p in model.parameters()])
    if policy != "selective":
        assert checkpoint.last_backward_stats()["recomputed_nodes"] > 0
    for a, c in zip(*results):
        np.testing.assert_array_equal(a, c)


def test_under_autocast_the_input_is_cast_once_to_the_low_dtype():
    """A bf16 activation with float32 parameters: autocast casts the parameters down; x is not widened to float32
    first (that float32 copy would be kept for backward: twice x's bytes)."""
    x = ndl.Tensor(np.ones((4, 8), np.float32), dtype="bfloat16", requires_grad=True)
    w, b = (ndl.Tensor(np.ones(8, np.float32), requires_grad=True) for _ in range(2))
    with ndl.autocast("bfloat16"):
        y = ops.layer_norm(x, w, b)
    assert y.dtype == "bfloat16" and y.inputs[0] is x
    assert all(str(node.dtype) != "float32" for node in y.inputs)


# ----- 4. errors ------------------------------------------------------------------------------------------------------
@pytest.mark.devices("cpu", "cpu_numpy")
def test_bad_shapes_and_dtypes_are_clear_errors(device):
    x = ndl.Tensor(np.ones((3, 4), np.float32))
    with pytest.raises(ValueError, match=r"layer_norm: needs x \(\.\.\., n\).*got x \(3, 4\), weight \(5,\)"):
        ops.layer_norm(x, ndl.Tensor(np.ones(5, np.float32)), ndl.Tensor(np.ones(4, np.float32)))
    with pytest.raises(ValueError, match=r"layer_norm: .*got x \(\)"):
        ops.layer_norm(ndl.Tensor(np.float32(1)), ndl.Tensor(np.ones(1, np.float32)),
                       ndl.Tensor(np.ones(1, np.float32)))
    ref = nd.cpu_numpy()
    with pytest.raises(ValueError, match=r"layer_norm: b must have shape \(4,\), got \(3,\)"):
        nd.layer_norm(nd.array(np.ones((3, 4)), device=ref), nd.array(np.ones(4), device=ref),
                      nd.array(np.ones(3), device=ref), 1e-5)
    mod = device.mod
    a16 = mod.Array(12, "float16")
    good = [mod.Array(12), mod.Array(4), mod.Array(4), mod.Array(12)]
    with pytest.raises(TypeError, match=r"layernorm_forward"):
        mod.layernorm_forward(a16, *good[1:], 3, 4, 1e-5)
    with pytest.raises(ValueError, match=r"layernorm_forward\b.*\bw\b.*\b4\b|layernorm_forward\b.*\bw\b"):
        mod.layernorm_forward(good[0], mod.Array(5), good[2], good[3], 3, 4, 1e-5)
    with pytest.raises(ValueError, match=r"layernorm_backward\b.*\beps\b"):
        mod.layernorm_backward(good[0], good[1], good[3], mod.Array(12), mod.Array(4), mod.Array(4), 3, 4, -1.0)


def test_numpy_face_computes_float64_in_float64():
    # Under NEEDLE_BACKEND=np a float64 input was computed in float32 and returned as float64 (issue 26, item 3);
    # the float64 gradient check under that backend: np_backend_checks.py (layernorm_cases.float64_checks).
    x, w, b, g = data((3, 7), seed=4)
    assert np_face.layer_norm(x, w, b, 1e-5).dtype == np.float64
    assert all(a.dtype == np.float64 for a in np_face.layer_norm_backward(x, w, g, 1e-5))
    f32 = [a.astype(np.float32) for a in (x, w, b)]
    assert np_face.layer_norm(*f32, 1e-5).dtype == np.float32  # float32 keeps the contract's arithmetic
