"""ops.linear: x W + b as one op (what nn.Linear computes).

Its forward and every gradient must be the bytes of the composite it replaces (reshape to rows, matmul, broadcast
bias add, reshape back) on every device, for inputs of any rank, with and without a bias, in float32 and under
autocast; a numerical gradient check; checkpointing on and off bit-identical; the Budget's ledger exact for it;
bad shapes a clear error.
"""
import gc as python_gc
import math

import numpy as np
import pytest

import needle as ndl
from needle import autograd, nn, ops
from needle import backend_ndarray as nd

from conftest import check_gradients


def composite(x, w, b=None, activation=None):
    shape = x.shape
    rows = math.prod(shape[:-1])
    out = ops.matmul(x if len(shape) == 2 else ops.reshape(x, (rows, shape[-1])), w)
    if b is not None:
        out = out + ops.broadcast_to(ops.reshape(b, (1, w.shape[1])), (rows, w.shape[1]))
    out = out if len(shape) == 2 else ops.reshape(out, tuple(shape[:-1]) + (w.shape[1],))
    if activation == "relu":
        return ops.relu(out)
    if activation in ("gelu", "gelu_tanh"):
        return ops.gelu(out, approximate="none" if activation == "gelu" else "tanh")
    return ops.silu(out) if activation == "silu" else out


def values_and_grads(fn, arrays, device, dtype="float32"):
    tensors = [ndl.Tensor(a, device=device) for a in arrays if a is not None]
    with ndl.autocast("bfloat16", enabled=dtype == "bfloat16"):
        out = fn(*tensors)
        loss = (out * out).sum()
    loss.backward()
    return [out.numpy()] + [t.grad.numpy() for t in tensors]


ACTIVATIONS = [None, "relu", "gelu", "gelu_tanh", "silu"]
SHAPES = [((4, 3), (3, 5)), ((2, 3, 4), (4, 6)), ((7,), (7, 2)), ((2, 1, 3, 5), (5, 1)), ((1, 1), (1, 1))]


@pytest.mark.parametrize("shapes", SHAPES, ids=[f"x{s[0]}" for s in SHAPES])
@pytest.mark.parametrize("bias", [None, "row", "flat"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_linear_has_the_composite_bytes(device, shapes, bias, dtype, activation):
    rng = np.random.default_rng(len(shapes[0]))
    x_shape, w_shape = shapes
    arrays = [rng.standard_normal(x_shape).astype(np.float32), rng.standard_normal(w_shape).astype(np.float32)]
    if bias:
        arrays.append(rng.standard_normal((1, w_shape[1]) if bias == "row" else (w_shape[1],)).astype(np.float32))
    if bias is None:
        arrays.append(None)
    fused = values_and_grads(lambda x, w, b=None: ops.linear(x, w, b, activation), arrays, device, dtype)
    expected = values_and_grads(lambda x, w, b=None: composite(x, w, b, activation), arrays, device, dtype)
    for i, (ours, want) in enumerate(zip(fused, expected)):
        assert ours.dtype == want.dtype and ours.shape == want.shape
        if dtype == "bfloat16" and i == 3:
            # Under autocast the op casts the (m,) bias once (as PyTorch's autocast linear does), so its gradient
            # is the row sum rounded to bfloat16; the composite cast the broadcast (rows, m) copy and summed the
            # widened gradient in float32.
            np.testing.assert_allclose(ours, want, rtol=2**-8, atol=1e-6)
        else:
            np.testing.assert_array_equal(ours.view(np.uint8), want.view(np.uint8))


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_linear_numerical_gradient(activation):
    rng = np.random.default_rng(1)
    check_gradients(lambda x, w, b: ops.linear(x, w, b, activation), rng.standard_normal((2, 3, 4)),
                    rng.standard_normal((4, 5)), rng.standard_normal((5,)))


@pytest.mark.filterwarnings("ignore::needle.checkpoint.NothingToDropWarning")  # one-op layers: nothing to drop
@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
@pytest.mark.parametrize("activation", [nn.ReLU, nn.GELU, nn.SiLU])
def test_linear_layers_gc_on_and_off_bit_identical(lazy, activation):
    def grads(gc):
        np.random.seed(0)
        model = nn.Sequential(nn.Linear(4, 8), activation(), nn.Linear(8, 3))
        if gc:
            model.enable_gc()
        x = ndl.Tensor(np.random.default_rng(2).standard_normal((2, 5, 4)).astype(np.float32), requires_grad=False)
        with autograd.lazy_mode(lazy):
            model(x).sum().backward()
        return [p.grad.numpy() for p in model.parameters()]

    for a, b in zip(grads(False), grads(True)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.devices("cpu", "cpu_numpy")
@pytest.mark.parametrize("activation, bits", [("relu", None), ("gelu", None), ("silu", None), ("gelu", 3),
                                              ("silu", 1)])
def test_ledger_predicts_a_linear_step_exactly(device, activation, bits):
    from needle.checkpoint_budget import predict_peak

    np.random.seed(0)
    first, second = nn.Linear(32, 64, device=device), nn.Linear(64, 16, device=device)

    def model(x):
        return second(first(x, activation=activation, activation_bits=bits))

    python_gc.collect()  # no earlier test's garbage freed during the step
    nd.reset_peak_memory_stats(device)
    base = nd.memory_stats(device)["current_bytes"]  # before the batch is made, as the ledger counts
    x = ndl.Tensor(np.ones((8, 10, 32), np.float32), device=device, requires_grad=False)
    with autograd.lazy_mode(True):
        loss = model(x).sum()
        predicted = predict_peak(loss, set())
        loss.backward()
    assert predicted == nd.memory_stats(device)["peak_bytes"] - base


def test_linear_errors_name_the_shapes():
    x = ndl.Tensor(np.ones((2, 3), np.float32))
    with pytest.raises(ValueError, match=r"linear: needs x \(\.\.\., n\).*x \(2, 3\), weight \(4, 5\)"):
        ops.linear(x, ndl.Tensor(np.ones((4, 5), np.float32)))
    with pytest.raises(ValueError, match=r"linear: activation must be None or one of relu, gelu, gelu_tanh, silu, "
                                         r"got 'tanh'"):
        ops.linear(x, ndl.Tensor(np.ones((3, 5), np.float32)), activation="tanh")
    with pytest.raises(ValueError, match=r"bias \(3,\)"):
        ops.linear(x, ndl.Tensor(np.ones((3, 5), np.float32)), ndl.Tensor(np.ones(3, np.float32)))
