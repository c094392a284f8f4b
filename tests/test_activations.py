"""GELU and SiLU (ops/ops_activation.py): the kernels on every backend against PyTorch, the ops and modules, the
activation fused into ops.linear, and a Transformer with either, exact under every checkpointing policy.

Rules checked here:
  1. every backend's ewise_gelu / ewise_gelu_tanh / ewise_silu and their *_grad are PyTorch's functions within a
     few float32 ulp, in float32 and bfloat16, at the extremes too (huge inputs saturate, NaN stays NaN);
  2. the compiled backends agree with the NumPy reference (the specification) within a few ulp;
  3. bad input is a clear exception naming the op: an unknown kind, a gradient of another shape, an integer array,
     a bad `approximate`, bits the op does not have yet;
  4. nn.GELU and nn.SiLU are PyTorch's modules, forward and backward;
  5. a Transformer with either activation computes the same gradients, bit for bit, with checkpointing off and
     under every policy, lazy and eager;
  6. activation is an argument of TransformerLayer, Transformer and LanguageModel; a model without an MLP refuses it.
"""
import numpy as np
import pytest

import needle as ndl
from needle import autograd, checkpoint, nn, ops
from needle import backend_ndarray as nd
from models import LanguageModel

from conftest import DEVICES, requires_torch

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
@pytest.mark.parametrize("device", DEVICES)
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


@pytest.mark.parametrize("device", DEVICES)
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


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", KINDS)
def test_rule_1_huge_inputs_saturate_and_nan_stays_nan(device, kind):
    a = nd.array(np.array([1e30, np.nan, -1e30], dtype=np.float32), device=device)
    y = a.activation(kind).numpy()
    assert y[0] == np.float32(1e30) and np.isnan(y[1]) and y[2] == 0.0
    dx = a.activation_grad(nd.array(np.ones(3, np.float32), device=device), kind).numpy()
    assert dx[0] == 1.0 and np.isnan(dx[1]) and dx[2] == 0.0


# ----- rule 2: the compiled backends agree with the reference -------------------------------------------------------
@pytest.mark.skipif(not nd.cpu().enabled(), reason="C++ backend not built (run `make`)")
@pytest.mark.parametrize("kind", KINDS)
def test_rule_2_cpu_agrees_with_the_numpy_reference(kind):
    x, g = inputs(np.random.default_rng(3))
    results = []
    for device in (nd.cpu(), nd.cpu_numpy()):
        a = nd.array(x, device=device)
        results.append((a.activation(kind).numpy(), a.activation_grad(nd.array(g, device=device), kind).numpy()))
    (y, dx), (ref_y, ref_dx) = results
    np.testing.assert_allclose(y, ref_y, rtol=4e-6, atol=1e-7)
    np.testing.assert_allclose(dx, ref_dx, rtol=1e-5, atol=1e-6)


# ----- rule 3: bad input ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
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
    with pytest.raises(NotImplementedError, match="silu: bits=2: few-bit derivatives are not implemented yet"):
        ops.silu(x, bits=2)
    with pytest.raises(ValueError, match="GELU: approximate must be 'none' or 'tanh'"):
        nn.GELU(approximate="sigmoid")
    with pytest.raises(ValueError, match="TransformerLayer: activation must be one of relu, gelu, gelu_tanh, silu"):
        nn.TransformerLayer(8, 2, 4, 16, activation="swish")
    with pytest.raises(NotImplementedError, match="TransformerLayer: bits=3"):
        nn.TransformerLayer(8, 2, 4, 16, activation="gelu", activation_bits=3)


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
def transformer_grads(activation, gc, lazy):
    np.random.seed(0)
    model = LanguageModel(16, 50, 16, num_layers=2, seq_model="transformer", seq_len=8, num_head=2, dim_head=8,
                          activation=activation)
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
@pytest.mark.parametrize("activation", ["gelu", "silu"])
@pytest.mark.parametrize("policy", ["all", "selective", "sqrt", "budget"])
def test_rule_5_a_transformer_with_gelu_or_silu_is_bit_identical_under_every_policy(activation, policy, lazy):
    off = transformer_grads(activation, None, lazy)
    gc = (lambda: checkpoint.Budget(2**20)) if policy == "budget" else (None if policy == "all" else policy)
    on = transformer_grads(activation, gc or "all", lazy)
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
