"""GELU and SiLU (ops/ops_activation.py): the kernels against PyTorch, the ops and modules, the activation fused into
ops.linear, and a Transformer with either, exact under every checkpointing policy. The kernels run on the NumPy
reference here; tests/backend's test_ops_compiled.py runs rules 1 and 3 on the compiled backends, and rule 2 there.

Rules checked here:
  1. every backend's ewise_gelu / ewise_gelu_tanh / ewise_silu and their *_grad are PyTorch's functions within a
     few float32 ulp, in float32 and bfloat16, at the extremes too (huge inputs saturate, NaN stays NaN);
  2. the compiled backends agree with the NumPy reference (the specification) within a few ulp;
  3. bad input is a clear exception naming the op: an unknown kind, a gradient of another shape, an integer array,
     a bad `approximate`, bits outside 1..4, bits for relu;
  4. nn.GELU and nn.SiLU are PyTorch's modules, forward and backward;
  5. a Transformer with either activation computes the same gradients, bit for bit, with checkpointing off and
     under every policy, lazy and eager;
  6. activation is an argument of TransformerLayer, Transformer and LanguageModel; a model without an MLP refuses it;
  7. few-bit (bits=k): the forward is the exact one, to the bit; the gradient is g times the fitted level of x's
     code (fewbit.derivative_table), fused into linear or not, eager and lazy;
  8. few-bit keeps the codes, not x: its gradient reads only what `saves` declares (never x), the MLP's bytes kept
     on the activation's account fall by 1 - k/32, and under inputs from the fitted distribution the gradient's
     error is the table's expected error;
  9. a few-bit Transformer is bit-identical under every checkpointing policy, and the Budget's ledger is exact.
"""
import numpy as np
import pytest

import needle as ndl
from needle import autograd, checkpoint, nn, ops
from needle.toolbox import fewbit
from needle import backend_ndarray as nd
from models import LanguageModel

from conftest import random_out_grad, requires_torch, saves_violation

KINDS = ["gelu", "gelu_tanh", "silu"]
EXTREMES = np.array([0.0, -0.0, 1e-30, -1e-30, 3.0, -3.0, 10.0, -10.0, 30.0, -30.0, 100.0, -100.0, 1e4, -1e4],
                    dtype=np.float32)


def torch_function(torch, kind):
    return {"gelu": lambda t: torch.nn.functional.gelu(t),
            "gelu_tanh": lambda t: torch.nn.functional.gelu(t, approximate="tanh"),
            "silu": torch.nn.functional.silu}[kind]


def torch_values_and_grads(torch, kind, x, g):
    t = torch.tensor(x.astype(np.float64), requires_grad=True)  # float64: the exact function, to compare with
    y = torch_function(torch, kind)(t)
    y.backward(torch.tensor(g.astype(np.float64)))
    return y.detach().numpy(), t.grad.numpy()


def inputs(rng, n=4096):
    x = np.concatenate([rng.standard_normal(n).astype(np.float32) * 4, EXTREMES])
    return x, rng.standard_normal(x.shape).astype(np.float32)


# ----- rule 1: the kernels are PyTorch's functions ----------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_rule_1_kernels_match_pytorch_in_float32(device, kind):
    torch = requires_torch()
    x, g = inputs(np.random.default_rng(1))
    want_y, want_dx = torch_values_and_grads(torch, kind, x, g)
    a = nd.array(x, device=device)
    y = a.activation(kind).numpy()
    dx = a.activation_grad(nd.array(g, device=device), kind).numpy()
    np.testing.assert_allclose(y, want_y, rtol=4e-6, atol=1e-7)
    np.testing.assert_allclose(dx, want_dx, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", KINDS)
def test_rule_1_bfloat16_is_the_float32_result_rounded_once(device, kind):
    x, g = inputs(np.random.default_rng(2), n=512)
    x16, g16 = (nd.array(v, device=device).astype("bfloat16") for v in (x, g))
    exact = nd.array(x16.numpy().astype(np.float32), device=device).activation(kind)
    got = x16.activation(kind)
    assert got.dtype == "bfloat16"
    # float32 arithmetic, one rounding on store: within one bfloat16 ulp of the float32 result rounded
    np.testing.assert_allclose(got.numpy().astype(np.float32), exact.numpy(), rtol=2**-8, atol=1e-30)
    grad = x16.activation_grad(g16, kind)
    assert grad.dtype == "bfloat16" and grad.shape == x16.shape


@pytest.mark.parametrize("kind", KINDS)
def test_rule_1_huge_inputs_saturate_and_nan_stays_nan(device, kind):
    a = nd.array(np.array([1e30, np.nan, -1e30], dtype=np.float32), device=device)
    y = a.activation(kind).numpy()
    assert y[0] == np.float32(1e30) and np.isnan(y[1]) and y[2] == 0.0
    dx = a.activation_grad(nd.array(np.ones(3, np.float32), device=device), kind).numpy()
    assert dx[0] == 1.0 and np.isnan(dx[1]) and dx[2] == 0.0


# ----- rule 3: bad input ----------------------------------------------------------------------------------------
def test_rule_3_bad_kernel_input_is_a_clear_error(device):
    a = nd.array(np.ones((2, 3), np.float32), device=device)
    with pytest.raises(ValueError, match="activation: unknown activation 'relu6'"):
        a.activation("relu6")
    with pytest.raises(ValueError, match=r"activation_grad gelu: grad must be an NDArray like the input \(2, 3\)"):
        a.activation_grad(nd.array(np.ones(6, np.float32), device=device), "gelu")
    with pytest.raises(TypeError, match="activation silu"):
        a.astype("int32").activation("silu")


def test_rule_3_bad_op_and_module_arguments_name_what_was_wrong():
    x = ndl.Tensor(np.ones(3, np.float32))
    with pytest.raises(ValueError, match="gelu: approximate must be 'none' or 'tanh', got 'erf'"):
        ops.gelu(x, approximate="erf")
    with pytest.raises(ValueError, match="silu: bits must be None .* or one of 1, 2, 3, 4, got 5"):
        ops.silu(x, bits=5)
    with pytest.raises(ValueError, match="GELU: approximate must be 'none' or 'tanh'"):
        nn.GELU(approximate="sigmoid")
    with pytest.raises(ValueError, match="SiLU: bits must be None"):
        nn.SiLU(bits=0)
    with pytest.raises(ValueError, match="TransformerLayer: activation must be one of relu, gelu, gelu_tanh, silu"):
        nn.TransformerLayer(8, 2, 4, 16, activation="swish")
    with pytest.raises(ValueError, match="TransformerLayer: relu's derivative is 0 or 1, so its mask takes 1 bit"):
        nn.TransformerLayer(8, 2, 4, 16, activation="relu", activation_bits=3)
    with pytest.raises(ValueError, match="linear: activation_bits is for an activation"):
        ops.linear(ndl.Tensor(np.ones((2, 3), np.float32)), ndl.Tensor(np.ones((3, 4), np.float32)),
                   activation=None, activation_bits=2)
    with pytest.raises(ValueError, match="ReLU: relu's derivative is 0 or 1.*got 2"):
        nn.ReLU(bits=2)


# ----- rule 4: the modules are PyTorch's ------------------------------------------------------------------------
@pytest.mark.parametrize("module, approximate", [("GELU", "none"), ("GELU", "tanh"), ("SiLU", None)])
def test_rule_4_modules_match_pytorch_forward_and_backward(module, approximate):
    torch = requires_torch()
    rng = np.random.default_rng(4)
    x = rng.standard_normal((3, 5, 7)).astype(np.float32)
    ours = nn.GELU(approximate) if module == "GELU" else nn.SiLU()
    theirs = torch.nn.GELU(approximate=approximate) if module == "GELU" else torch.nn.SiLU()
    t = ndl.Tensor(x)
    y = ours(t)
    (y * y).sum().backward()
    tx = torch.tensor(x, requires_grad=True)
    ty = theirs(tx)
    (ty * ty).sum().backward()
    np.testing.assert_allclose(y.numpy(), ty.detach().numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(t.grad.numpy(), tx.grad.numpy(), rtol=1e-5, atol=1e-5)


# ----- rule 5: exact under checkpointing -------------------------------------------------------------------------
def transformer_grads(activation, gc, lazy, bits=None):
    np.random.seed(0)
    model = LanguageModel(16, 50, 16, num_layers=2, seq_model="transformer", seq_len=8, num_head=2, dim_head=8,
                          activation=activation, activation_bits=bits)
    if gc is not None:
        model.enable_gc(policy=gc() if callable(gc) else gc)
    rng = np.random.default_rng(5)
    x = ndl.Tensor(rng.integers(0, 50, (8, 4)), requires_grad=False)
    y = ndl.Tensor(rng.integers(0, 50, (32,)), requires_grad=False)
    with autograd.lazy_mode(lazy):
        loss, _ = model.loss(x, y)
        loss.backward()
    return [p.grad.numpy() for p in model.parameters()]


@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
@pytest.mark.parametrize("activation, bits", [("gelu", None), ("silu", None), ("gelu", 3)],
                         ids=["gelu", "silu", "gelu-3-bit"])
@pytest.mark.parametrize("policy", ["all", "selective", "sqrt", "budget"])
def test_rule_5_and_9_a_transformer_with_gelu_or_silu_is_bit_identical_under_every_policy(activation, bits, policy,
                                                                                          lazy):
    off = transformer_grads(activation, None, lazy, bits)
    gc = (lambda: checkpoint.Budget(2**20)) if policy == "budget" else (None if policy == "all" else policy)
    on = transformer_grads(activation, gc or "all", lazy, bits)
    assert len(on) == len(off)
    for a, b in zip(on, off):
        np.testing.assert_array_equal(a, b)


# ----- rule 6: the arguments reach every layer --------------------------------------------------------------------
def test_rule_6_the_activation_reaches_every_layer_and_an_rnn_refuses_it():
    model = LanguageModel(16, 50, 16, num_layers=3, seq_model="transformer", seq_len=8, num_head=2, dim_head=8,
                          activation="gelu_tanh")
    assert [layer.activation for layer in model.seq_model.layers] == ["gelu_tanh"] * 3
    assert not any(isinstance(m, nn.ReLU) for m in model.modules()) if hasattr(model, "modules") else True
    with pytest.raises(ValueError, match="LanguageModel: activation and activation_bits configure the transformer"):
        LanguageModel(16, 50, 16, seq_model="lstm", activation="gelu")


# ----- rules 7 and 8: few-bit derivatives ----------------------------------------------------------------------
def few_bit_and_exact(fn, x, g, lazy):
    """(output, x's gradient) of fn(x) for out_grad g."""
    with autograd.lazy_mode(lazy):
        t = ndl.Tensor(x)
        y = fn(t)
        (y * ndl.Tensor(g, requires_grad=False)).sum().backward()
    return y.numpy(), t.grad.numpy()


@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
@pytest.mark.parametrize("kind, bits", [("gelu", 1), ("gelu", 3), ("gelu_tanh", 2), ("silu", 4)])
@pytest.mark.parametrize("fused", [False, True], ids=["op", "fused-linear"])
def test_rule_7_few_bit_forward_is_exact_and_its_gradient_is_the_fitted_level(kind, bits, fused, lazy):
    rng = np.random.default_rng(7)
    x = rng.standard_normal((6, 10)).astype(np.float32)
    g = rng.standard_normal((6, 10)).astype(np.float32)
    approximate = "tanh" if kind == "gelu_tanh" else "none"
    eye = ndl.Tensor(np.eye(10, dtype=np.float32), requires_grad=False)  # linear(x, I) = x: z is x itself

    def apply(t, b):
        if fused:
            return ops.linear(t, eye, activation=kind, activation_bits=b)
        return ops.silu(t, bits=b) if kind == "silu" else ops.gelu(t, approximate, bits=b)
    y_few, dx_few = few_bit_and_exact(lambda t: apply(t, bits), x, g, lazy)
    y_exact, _ = few_bit_and_exact(lambda t: apply(t, None), x, g, lazy)
    np.testing.assert_array_equal(y_few, y_exact)
    want = g * np.float32(fewbit.derivative_table(kind, bits).levels)[fewbit.derivative_table(kind, bits).codes(x)]
    np.testing.assert_allclose(dx_few, want, rtol=1e-6, atol=1e-7)


def mlp_activation_bytes(bits, activation="gelu"):
    """Bytes the first layer's fused MLP op holds after the forward pass beyond f(z) (which linear2 keeps anyway):
    the pre-activation z, or its codes (the issue's small model, eager)."""
    np.random.seed(0)
    model = LanguageModel(64, 500, 64, num_layers=2, seq_model="transformer", seq_len=32, num_head=4, dim_head=16,
                          activation=activation, activation_bits=bits)
    rng = np.random.default_rng(8)
    x = ndl.Tensor(rng.integers(0, 500, (32, 16)), requires_grad=False)
    loss, _ = model.loss(x, ndl.Tensor(rng.integers(0, 500, (32 * 16,)), requires_grad=False))
    (node,) = [n for n in autograd.find_topo_sort([loss]) if isinstance(n.op, ops.LinearActivation)][:1]
    y, second = node.cached_data
    return second.nbytes, y.nbytes


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_rule_8_few_bit_keeps_bits_per_element_instead_of_the_pre_activation(bits):
    exact, y_bytes = mlp_activation_bytes(None)
    few, _ = mlp_activation_bytes(bits)
    assert exact == y_bytes  # the float32 pre-activation, as large as f(z)
    assert few == -(-exact // 4 * bits // 8)  # bits per element, packed
    if bits == 3:
        assert few <= 0.15 * exact  # the goal: the activation's share >= 85% lower at 3 bits


@pytest.mark.parametrize("kind", ["gelu", "silu"])
def test_rule_8_under_the_fitted_distribution_the_gradient_error_is_the_tables(kind):
    x = np.random.default_rng(9).standard_normal(100_000).astype(np.float32)
    ones = np.ones_like(x)
    _, exact = few_bit_and_exact(lambda t: ops.silu(t) if kind == "silu" else ops.gelu(t), x, ones, False)
    for bits in (2, 3):
        _, few = few_bit_and_exact(lambda t: ops.silu(t, bits=bits) if kind == "silu" else ops.gelu(t, bits=bits),
                                   x, ones, False)
        error = np.mean((few.astype(np.float64) - exact) ** 2)
        assert error == pytest.approx(fewbit.derivative_table(kind, bits).expected_error, rel=0.05)


@pytest.mark.parametrize("fused", [False, True], ids=["op", "fused-linear"])
def test_rule_8_few_bit_gradients_read_only_what_saves_declares_and_never_x(fused):
    rng = np.random.default_rng(10)
    x = ndl.Tensor(rng.standard_normal((4, 6)).astype(np.float32), device=nd.cpu_numpy())
    w = ndl.Tensor(np.eye(6, dtype=np.float32), device=nd.cpu_numpy())
    y = ops.linear(x, w, activation="gelu", activation_bits=3) if fused else ops.gelu(x, bits=3)
    node = y.inputs[0]  # the tuple: (f(x), codes)
    assert isinstance(node.op, ops.LinearActivation if fused else ops.FewBitActivation)
    if not fused:  # (fused: x is linear's input, read for W's gradient; the pre-activation is no graph value)
        assert all(value is not x for value in autograd.reads(node))
    assert saves_violation(node, random_out_grad(node, rng)) is None
    with autograd.lazy_mode(True):
        (grad,) = [g for g in node.op.gradient_as_tuple(random_out_grad(node, rng), node) if g is not None][:1]
    few = grad if isinstance(grad.op, ops.FewBitGrad) else next(
        n for n in autograd.find_topo_sort([grad]) if isinstance(n.op, ops.FewBitGrad))
    assert saves_violation(few, random_out_grad(few, rng)) is None
