"""needle.optim: 10 steps of SGD and Adam against a NumPy reference of the update rules (and torch's Adam)."""
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import needle as ndl
from needle import nn, optim

from conftest import DEVICES, requires_torch

STEPS = 10


def _problem(seed=0):
    rs = np.random.RandomState(seed)
    X = rs.randn(8, 4).astype(np.float32)
    Y = rs.randn(8, 3).astype(np.float32)
    W = rs.randn(4, 3).astype(np.float32)
    b = rs.randn(1, 3).astype(np.float32)
    return X, Y, W, b


def _needle_run(device, make_opt, seed=0):
    """Fit a Linear layer to (X, Y) with loss 0.5 * mean_rows |XW + b - Y|^2; return the params after each step."""
    X, Y, W, b = _problem(seed)
    layer = nn.Linear(4, 3, device=device)
    layer.weight.data = ndl.Tensor(W, device=device)
    layer.bias.data = ndl.Tensor(b, device=device)
    unused = nn.Parameter(ndl.Tensor(np.ones((2, 2), dtype=np.float32), device=device))
    opt = make_opt([layer.weight, layer.bias, unused])
    x = ndl.Tensor(X, device=device, requires_grad=False)
    y = ndl.Tensor(Y, device=device, requires_grad=False)
    history = []
    for _ in range(STEPS):
        opt.reset_grad()
        r = layer(x) - y
        ((r * r).sum() * (0.5 / X.shape[0])).backward()
        opt.step()
        history.append((layer.weight.numpy().copy(), layer.bias.numpy().copy()))
    assert unused.grad is None
    np.testing.assert_array_equal(unused.numpy(), np.ones((2, 2)))  # a parameter without a gradient is skipped
    return history


def _reference_grads(X, Y, W, b):
    r = X @ W + b - Y
    return X.T @ r / X.shape[0], r.sum(axis=0, keepdims=True) / X.shape[0]


def _reference_sgd(lr, momentum, weight_decay):
    X, Y, W, b = (a.astype(np.float64) for a in _problem())
    params, u, history = [W, b], [0.0, 0.0], []
    for _ in range(STEPS):
        grads = _reference_grads(X, Y, *params)
        for i, (p, g) in enumerate(zip(params, grads)):
            u[i] = momentum * u[i] + (1 - momentum) * (g + weight_decay * p)
            params[i] = p - lr * u[i]
        history.append(tuple(params))
    return history


def _reference_adam(lr, beta1, beta2, eps, weight_decay):
    X, Y, W, b = (a.astype(np.float64) for a in _problem())
    params, m, v, history = [W, b], [0.0, 0.0], [0.0, 0.0], []
    for t in range(1, STEPS + 1):
        grads = _reference_grads(X, Y, *params)
        for i, (p, g) in enumerate(zip(params, grads)):
            g = g + weight_decay * p
            m[i] = beta1 * m[i] + (1 - beta1) * g
            v[i] = beta2 * v[i] + (1 - beta2) * g * g
            m_hat, v_hat = m[i] / (1 - beta1**t), v[i] / (1 - beta2**t)
            params[i] = p - lr * m_hat / (np.sqrt(v_hat) + eps)
        history.append(tuple(params))
    return history


def _assert_histories(mine, expected, tol=1e-5):
    for step, (got, want) in enumerate(zip(mine, expected)):
        for name, a, e in zip(("weight", "bias"), got, want):
            np.testing.assert_allclose(a, e, rtol=tol, atol=tol * max(1.0, np.abs(e).max()),
                                       err_msg=f"{name} after step {step + 1}")


SGD_CASES = [(0.1, 0.0, 0.0), (0.1, 0.9, 0.0), (0.05, 0.5, 0.01), (0.2, 0.0, 0.1)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", SGD_CASES, ids=[f"lr{a}-m{b}-wd{c}" for a, b, c in SGD_CASES])
@pytest.mark.smoke
def test_sgd_matches_reference(device, case):
    lr, momentum, wd = case
    mine = _needle_run(device, lambda ps: optim.SGD(ps, lr=lr, momentum=momentum, weight_decay=wd))
    _assert_histories(mine, _reference_sgd(lr, momentum, wd))


ADAM_CASES = [(0.01, 0.9, 0.999, 1e-8, 0.0), (0.05, 0.8, 0.99, 1e-6, 0.01)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", ADAM_CASES, ids=["defaults", "custom-wd"])
@pytest.mark.smoke
def test_adam_matches_reference(device, case):
    lr, beta1, beta2, eps, wd = case
    make = lambda ps: optim.Adam(ps, lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=wd)  # noqa: E731
    if case == ADAM_CASES[0]:
        make = lambda ps: optim.Adam(ps, lr=lr)  # noqa: E731  (the defaults are the course's)
    _assert_histories(_needle_run(device, make), _reference_adam(lr, beta1, beta2, eps, wd))


@pytest.mark.parametrize("device", DEVICES)
def test_adam_matches_torch(device):
    torch = requires_torch()
    lr, wd = 0.03, 0.01
    mine = _needle_run(device, lambda ps: optim.Adam(ps, lr=lr, weight_decay=wd))
    X, Y, W, b = (torch.tensor(a) for a in _problem())
    W.requires_grad_(True)
    b.requires_grad_(True)
    opt = torch.optim.Adam([W, b], lr=lr, weight_decay=wd)  # torch adds weight_decay * theta to the gradient
    history = []
    for _ in range(STEPS):
        opt.zero_grad()
        r = X @ W + b - Y
        ((r * r).sum() * (0.5 / X.shape[0])).backward()
        opt.step()
        history.append((W.detach().numpy().copy(), b.detach().numpy().copy()))
    _assert_histories(mine, history)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("make", [lambda ps: optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.1),
                                  lambda ps: optim.Adam(ps, lr=0.1, weight_decay=0.1)], ids=["sgd", "adam"])
def test_step_keeps_grad_dtype_and_graph(device, make):
    rs = np.random.RandomState(1)
    p = nn.Parameter(ndl.Tensor(rs.randn(3, 2).astype(np.float32), device=device))
    before = p.numpy().copy()
    (p * p).sum().backward()
    grad, grad_values = p.grad, p.grad.numpy().copy()
    opt = make([p])
    opt.step()
    assert p.grad is grad
    np.testing.assert_array_equal(p.grad.numpy(), grad_values)  # the gradient was not modified in place
    assert not np.array_equal(p.numpy(), before)
    assert p.dtype == "float32" and p.is_leaf() and p.inputs == () and p.requires_grad
    opt.reset_grad()
    assert p.grad is None


@pytest.mark.smoke
def test_numpy_backend_keeps_parameter_dtype():
    """Under NEEDLE_BACKEND=np, NumPy float64 hyper-parameters must not promote float32 parameters."""
    code = textwrap.dedent("""
        import numpy as np
        import needle as ndl
        from needle import nn, optim
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
        print("ok")
    """)
    root = os.path.join(os.path.dirname(__file__), "..")
    env = dict(os.environ, NEEDLE_BACKEND="np",
               PYTHONPATH=os.pathsep.join([os.path.join(root, "python"), os.environ.get("PYTHONPATH", "")]))
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr
