"""Everything checked under NEEDLE_BACKEND=np, in one interpreter: the float64 NumPy oracle for every op gradient
case of op_cases.OP_CASES and for the fused ops (attention, layer norm, the LM head), broadcasting as NumPy does,
and the optimizers' dtypes and state under that backend.

Not collected by a plain `pytest` run (the name does not match test_*.py): NEEDLE_BACKEND is read once, at import,
so these checks need their own interpreter. `test_autograd.py::test_float64_oracle_under_np_backend` runs

    NEEDLE_BACKEND=np python -m pytest tests/core/np_backend_checks.py

Values are plain float64 numpy.ndarray here, so central differences with eps=1e-6 agree with the analytic
gradients to ~1e-6 relative (float32 checks need eps=1e-2 and 1e-2 tolerances).
"""
import importlib

import numpy as np
import pytest

import needle as ndl
from needle import nn, optim
from needle.backend_selection import BACKEND

from conftest import numerical_gradient

if BACKEND != "np":
    pytest.skip("run with NEEDLE_BACKEND=np (see the module docstring)", allow_module_level=True)

from op_cases import BINARY_OPS, OP_CASES  # noqa: E402  (only under NEEDLE_BACKEND=np)


def check_gradients_float64(fn, *arrays, seed=0, rtol=1e-6, atol=1e-7):
    """needle's gradient of fn against central differences (eps 1e-6) in float64, in a random direction."""
    rs = np.random.RandomState(seed)
    tensors = [ndl.Tensor(a) for a in arrays]
    out = fn(*tensors)
    assert out.dtype == np.float64
    projection = rs.randn(*out.shape)
    (out * ndl.Tensor(projection, requires_grad=False)).sum().backward()

    def scalar(*xs):
        return float((fn(*[ndl.Tensor(x) for x in xs]).numpy() * projection).sum())

    numeric = numerical_gradient(scalar, [a.copy() for a in arrays], eps=1e-6)
    for i, (t, g) in enumerate(zip(tensors, numeric)):
        assert t.grad is not None, f"input {i} got no gradient"
        assert t.grad.dtype == np.float64 and isinstance(t.grad.realize_cached_data(), np.ndarray)
        np.testing.assert_allclose(t.grad.numpy(), g, rtol=rtol, atol=atol, err_msg=f"gradient of input {i}")
    return out


@pytest.mark.parametrize("name", list(OP_CASES))
def test_op_gradient_float64(name):
    case = OP_CASES[name]
    arrays = case.make(np.random.default_rng(sum(map(ord, name))))
    out = check_gradients_float64(case.fn, *arrays)
    if case.ref is not None:
        np.testing.assert_allclose(out.numpy(), case.ref(*arrays), rtol=1e-12, atol=1e-12)


def test_float64_stays_float64_and_values_are_numpy():
    x = ndl.Tensor(np.array([[1.0, 2.0]], dtype=np.float64))
    assert x.dtype == np.float64 and type(x.realize_cached_data()) is np.ndarray
    assert ndl.Tensor(np.ones(2, dtype=np.float32)).dtype == np.float32
    y = (x * x).sum()
    assert y.dtype == np.float64 and isinstance(y.realize_cached_data(), np.ndarray)
    y.backward()
    assert x.grad.dtype == np.float64
    np.testing.assert_array_equal(x.grad.numpy(), [[2.0, 4.0]])


def test_course_style_finite_differences_perturb_cached_data_in_place():
    rng = np.random.default_rng(0)
    a = ndl.Tensor(rng.standard_normal((3, 4)))
    b = ndl.Tensor(rng.standard_normal((4, 2)))

    def f():
        return float(ndl.tanh(a @ b).sum().numpy())

    ndl.tanh(a @ b).sum().backward()
    data = a.realize_cached_data()
    assert data.flags.writeable
    numeric = np.zeros(a.shape)
    for j in range(data.size):
        data.flat[j] += 1e-6
        plus = f()
        data.flat[j] -= 2e-6
        minus = f()
        data.flat[j] += 1e-6
        numeric.flat[j] = (plus - minus) / 2e-6
    np.testing.assert_allclose(a.grad.numpy(), numeric, rtol=1e-6, atol=1e-8)


# ----- broadcasting: element-wise ops under NEEDLE_BACKEND=np broadcast as NumPy does --------------------------------
# (The course's NumPy backend let numpy.ndarray broadcast; the nd backend keeps its equal-shapes rule, see
# test_np_broadcast.py.) Each gradient is summed back to its input's shape: over added leading axes and over
# size-1 axes that were stretched.
BROADCAST_SHAPES = [((1, 3), (3,)), ((3,), (2, 3)), ((2, 1, 4), (3, 1)), ((4, 1), (1, 5)), ((2, 3), ())]


@pytest.mark.parametrize("shapes", BROADCAST_SHAPES, ids=str)
@pytest.mark.parametrize("name", list(BINARY_OPS))
def test_elementwise_ops_broadcast_like_numpy(name, shapes):
    fn, ref = BINARY_OPS[name]
    rng = np.random.default_rng(sum(map(ord, name)))
    # Positive inputs away from 0: valid bases for power and divisors for divide.
    a, b = (rng.uniform(0.5, 2.0, shape) for shape in shapes)
    out = check_gradients_float64(fn, a, b)  # values against central differences, float64
    np.testing.assert_allclose(out.numpy(), ref(a, b), rtol=1e-12, atol=1e-12)
    assert out.shape == np.broadcast_shapes(a.shape, b.shape)
    ta, tb = ndl.Tensor(a), ndl.Tensor(b)
    fn(ta, tb).sum().backward()
    assert ta.grad.shape == a.shape and tb.grad.shape == b.shape


def test_power_of_a_row_by_a_vector_the_course_example():
    a, b = ndl.Tensor([[1.0, 2.0, 3.0]]), ndl.Tensor(np.ones(3) * 2)
    out = ndl.power(a, b)
    np.testing.assert_array_equal(out.numpy(), [[1.0, 4.0, 9.0]])
    out.sum().backward()
    np.testing.assert_allclose(a.grad.numpy(), [[2.0, 4.0, 6.0]])
    np.testing.assert_allclose(b.grad.numpy(), [0.0, 4 * np.log(2), 9 * np.log(3)])


def test_broadcast_gradients_are_differentiable():
    # x.grad is itself a graph (summed back to x's shape): its gradient must reach x and w too.
    rng = np.random.default_rng(1)
    x, w = ndl.Tensor(rng.standard_normal((3,))), ndl.Tensor(rng.standard_normal((2, 3)))
    (x * x * w).sum().backward()  # x.grad = sum over rows of 2 x w
    np.testing.assert_allclose(x.grad.numpy(), (2 * x.numpy() * w.numpy()).sum(0), rtol=1e-12)
    x.grad.sum().backward()  # d/dx sum_j 2 x_j sum_i w_ij = 2 sum_i w_ij
    np.testing.assert_allclose(x.grad.numpy(), 2 * w.numpy().sum(0), rtol=1e-12)
    np.testing.assert_allclose(w.grad.numpy(), 2 * np.broadcast_to(x.numpy(), (2, 3)), rtol=1e-12)


def test_broadcast_shapes_in_lazy_mode():
    # Shape inference must not take the first input's shape when the two differ.
    with ndl.autograd.lazy_mode(True):
        out = ndl.Tensor(np.ones(3)) * ndl.Tensor(np.ones((2, 3)))
        assert out.shape == (2, 3)
    np.testing.assert_array_equal(out.numpy(), np.ones((2, 3)))


# ----- the fused ops in float64 (their cases' float64_checks) ---------------------------------------------------------
@pytest.mark.parametrize("cases", ["attention_cases", "layernorm_cases", "linear_cross_entropy_cases"])
def test_fused_op_float64_checks(cases):
    """float64 in, float64 out, the unfused numbers within 1e-6 and central differences (eps 1e-6) within 1e-6."""
    importlib.import_module(cases).float64_checks()


# ----- the optimizers under this backend -----------------------------------------------------------------------------
def test_numpy_backend_keeps_parameter_dtype():
    """Under NEEDLE_BACKEND=np, NumPy float64 hyper-parameters must not promote float32 parameters."""
    assert ndl.BACKEND == "np"
    for make in (lambda ps: optim.SGD(ps, lr=np.float64(0.1), momentum=np.float64(0.9),
                                      weight_decay=np.float64(0.01)),
                 lambda ps: optim.Adam(ps, lr=np.float64(0.1), weight_decay=np.float64(0.01))):
        p32 = nn.Parameter(ndl.Tensor(np.ones((2, 2), dtype=np.float32)))
        p64 = nn.Parameter(ndl.Tensor(np.ones((2, 2), dtype=np.float64), dtype="float64"))
        opt = make([p32, p64])
        for _ in range(2):
            ((p32 * p32).sum() + (p64 * p64).sum()).backward()
            opt.step()
        assert p32.realize_cached_data().dtype == np.float32, p32.realize_cached_data().dtype
        assert p64.realize_cached_data().dtype == np.float64, p64.realize_cached_data().dtype
        assert not np.allclose(p32.numpy(), 1.0)


def test_numpy_backend_state_dict_round_trip(tmp_path):
    """Under NEEDLE_BACKEND=np the state is NumPy arrays in the parameters' dtypes (float64 too)."""
    for make in (lambda ps: optim.Adam(ps, lr=0.1), lambda ps: optim.Adafactor(ps, beta1=0.9)):
        p32 = nn.Parameter(ndl.Tensor(np.ones((2, 3), dtype=np.float32)))
        p64 = nn.Parameter(ndl.Tensor(np.ones((3,), dtype=np.float64), dtype="float64"))
        opt = make([p32, p64])
        for _ in range(2):
            ((p32 * p32).sum() + (p64 * p64 * p64).sum()).backward()
            opt.step()
        state = opt.state_dict()
        fresh = make([p32, p64])
        fresh.load_state_dict(ndl.load(ndl.save(state, str(tmp_path / "state.npz"))))
        for i, entry in fresh.state_dict()["state"].items():
            for slot, a in entry.items():
                assert a.dtype == state["state"][i][slot].dtype == (np.float64 if i else np.float32), slot
                assert a.tobytes() == state["state"][i][slot].tobytes()
