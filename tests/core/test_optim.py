"""needle.optim: 10 steps of SGD and Adam against a NumPy reference of the update rules (and torch's Adam)."""
import numpy as np
import pytest

import needle as ndl
from needle import nn, optim

from conftest import requires_torch

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


@pytest.mark.parametrize("case", SGD_CASES, ids=[f"lr{a}-m{b}-wd{c}" for a, b, c in SGD_CASES])
@pytest.mark.smoke
def test_sgd_matches_reference(device, case):
    lr, momentum, wd = case
    mine = _needle_run(device, lambda ps: optim.SGD(ps, lr=lr, momentum=momentum, weight_decay=wd))
    _assert_histories(mine, _reference_sgd(lr, momentum, wd))


ADAM_CASES = [(0.01, 0.9, 0.999, 1e-8, 0.0), (0.05, 0.8, 0.99, 1e-6, 0.01)]


@pytest.mark.parametrize("case", ADAM_CASES, ids=["defaults", "custom-wd"])
@pytest.mark.smoke
def test_adam_matches_reference(device, case):
    lr, beta1, beta2, eps, wd = case
    make = lambda ps: optim.Adam(ps, lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=wd)  # noqa: E731
    if case == ADAM_CASES[0]:
        make = lambda ps: optim.Adam(ps, lr=lr)  # noqa: E731  (the defaults are the course's)
    _assert_histories(_needle_run(device, make), _reference_adam(lr, beta1, beta2, eps, wd))


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


# ----- state_dict / load_state_dict (resuming end to end: test_resume.py) ------------------------------------------
def _trained(make, device=None, steps=2):
    """(parameters, an optimizer made by `make` after `steps` steps on them)."""
    rs = np.random.RandomState(0)
    params = [nn.Parameter(ndl.Tensor(rs.randn(*shape).astype(np.float32), device=device))
              for shape in ((64, 8), (8,), (3, 3))]
    opt = make(params)
    for _ in range(steps):
        opt.reset_grad()
        sum(((p * p) * p).sum() for p in params).backward()
        opt.step()
    return params, opt


def test_adam_state_dict_has_pytorchs_layout_and_loads_back_exactly(device):
    params, opt = _trained(lambda ps: optim.Adam(ps, lr=0.01, beta1=0.8), device)
    state = opt.state_dict()
    assert list(state) == ["state", "param_groups"] and list(state["state"]) == [0, 1, 2]
    assert all(list(entry) == ["m", "v"] and all(type(a) is np.ndarray for a in entry.values())
               for entry in state["state"].values())
    group = state["param_groups"][0]
    assert group["params"] == [0, 1, 2] and group["t"] == 2 and group["lr"] == 0.01 and group["beta1"] == 0.8
    fresh = optim.Adam(params, lr=0.5)  # hyper-parameters come from the state dict, as in PyTorch
    fresh.load_state_dict(state)
    assert fresh.lr == 0.01 and fresh.beta1 == 0.8 and fresh.t == 2
    assert all(fresh.m[p].device == p.device for p in params)
    again = fresh.state_dict()
    for i in range(3):
        assert all(again["state"][i][s].tobytes() == state["state"][i][s].tobytes() for s in ("m", "v"))
    state["state"][0]["m"][:] = 7.0  # a copy: the optimizer's state is untouched
    assert not np.any(fresh.state_dict()["state"][0]["m"] == 7.0)


def test_load_state_dict_names_the_mismatch_and_changes_nothing():
    params, opt = _trained(lambda ps: optim.Adam(ps, lr=0.01))
    state = opt.state_dict()
    fresh = optim.Adam(params, lr=0.3)
    with pytest.raises(ValueError, match="the state dict is for 3 parameters, this optimizer has 2"):
        optim.Adam(params[:2]).load_state_dict(state)
    swapped = {"state": {**state["state"], 0: {"m": state["state"][0]["m"].T, "v": state["state"][0]["v"]}},
               "param_groups": state["param_groups"]}
    with pytest.raises(ValueError, match=r"parameter 0's state 'm' is \[\(\(8, 64\), 'float32'\)\] \(shape, dtype\)"
                                         r" in the state dict, but this optimizer needs \[\(\(64, 8\), 'float32'\)\]"):
        fresh.load_state_dict(swapped)
    with pytest.raises(ValueError, match="parameter 1 has state 'u' in the state dict; this optimizer's state is "
                                         "master, m, v"):
        fresh.load_state_dict({**state, "state": {1: {"u": np.zeros(8, np.float32)}}})
    with pytest.raises(ValueError, match="state key 5 is not a parameter index below 3"):
        fresh.load_state_dict({**state, "state": {5: {}}})
    with pytest.raises(ValueError, match="state key 'm' is not a parameter index below 3"):
        fresh.load_state_dict({**state, "state": {"m": {}}})
    group = {k: v for k, v in state["param_groups"][0].items() if k != "t"}
    with pytest.raises(ValueError, match="the parameter group lacks t"):
        fresh.load_state_dict({**state, "param_groups": [group]})
    with pytest.raises(ValueError, match="expected a dict with 'state'"):
        fresh.load_state_dict({"m": 1})
    assert fresh.lr == 0.3 and fresh.t == 0 and fresh.state_dict()["state"] == {}
    assert fresh.state_bytes() == 2 * 4 * sum(p.realize_cached_data().size for p in params)  # allocated, unwritten


def test_load_state_dict_checks_the_options_that_fix_the_states_layout():
    params, opt = _trained(lambda ps: optim.Adam8bit(ps, lr=0.01, min_8bit_size=64, block_size=64))
    state = opt.state_dict()
    q, absmax = state["state"][0]["m"]  # the 64 x 8 matrix: 8-bit codes and one absmax per block of 64
    assert q.dtype == np.uint8 and q.shape == (64, 8) and absmax.dtype == np.float32 and absmax.shape == (8,)
    assert state["state"][1]["m"].dtype == np.float32  # 8 elements: float32 state
    with pytest.raises(ValueError, match="saved with block_size=64, this optimizer has block_size=256"):
        optim.Adam8bit(params, lr=0.01, min_8bit_size=64).load_state_dict(state)
    with pytest.raises(ValueError, match=r"saved with fp32_state_params=\[\], this optimizer has "
                                         r"fp32_state_params=\[0\]"):
        optim.Adam8bit(params, lr=0.01, min_8bit_size=64, block_size=64,
                       fp32_state_params=[params[0]]).load_state_dict(state)
    with pytest.raises(ValueError, match="saved with master_weights=None, this optimizer has master_weights=True"):
        optim.Adam(params, master_weights=True).load_state_dict(_trained(lambda ps: optim.Adam(ps))[1].state_dict())
    factored = _trained(lambda ps: optim.Adafactor(ps))[1].state_dict()
    assert [list(factored["state"][i]) for i in range(3)] == [["row", "col"], ["v"], ["row", "col"]]
    assert factored["state"][0]["row"].shape == (64, 1) and factored["state"][0]["col"].shape == (1, 8)
    bad = {**factored, "state": {1: {"row": np.zeros((8, 1), np.float32)}}}
    with pytest.raises(ValueError, match=r"parameter 1 has state 'row' in the state dict, but this optimizer keeps "
                                         r"none for it \(shape \(8,\), dtype float32\)"):
        optim.Adafactor(params).load_state_dict(bad)


def test_grad_scaler_state_dict_round_trip_and_validation():
    scaler = ndl.amp.GradScaler(init_scale=1024.0, growth_interval=3)
    scaler._clean_steps = 2
    state = scaler.state_dict()
    fresh = ndl.amp.GradScaler()
    fresh.load_state_dict(state)
    assert fresh.get_scale() == 1024.0 and fresh.state_dict() == state
    for key, value, why in (("scale", float("nan"), "need a finite scale"), ("clean_steps", 3, "clean_steps <"),
                            ("backoff_factor", 1.5, "0 < backoff_factor < 1")):
        with pytest.raises(ValueError, match=why):
            fresh.load_state_dict({**state, key: value})
    with pytest.raises(ValueError, match="the state lacks scale"):
        fresh.load_state_dict({k: v for k, v in state.items() if k != "scale"})
    assert fresh.state_dict() == state  # a refused state changed nothing
    p = nn.Parameter(ndl.Tensor(np.ones(2, np.float32)))
    (p * 2.0).sum().backward()
    scaler.step(optim.SGD([p], lr=0.1))
    with pytest.raises(RuntimeError, match=r"between step\(\) and update\(\)"):
        scaler.state_dict()
    scaler.update()
    assert scaler.state_dict()["clean_steps"] == 0 and scaler.get_scale() == 2048.0


# ----- input that used to pass silently (issue 26, items 3 and 10) ---------------------------------------------------
@pytest.mark.parametrize("cls", [optim.SGD, optim.Adam, optim.Adam8bit, optim.Adafactor])
def test_a_parameter_listed_twice_is_an_error(cls):
    # It was updated twice a step, silently; PyTorch raises too. An error, not something to de-duplicate.
    a = nn.Parameter(np.ones((2, 3), dtype="float32"))
    b = nn.Parameter(np.ones((3,), dtype="float32"))
    message = r"the same Parameter \(shape \(2, 3\)\) is listed twice, at positions 0 and 2"
    with pytest.raises(ValueError, match=message):
        cls([a, b, a], **({"lr": 0.1} if cls is optim.Adam8bit else {}))


def test_adafactor_steps_past_a_zero_size_parameter():
    np.random.seed(0)
    empty = nn.Parameter(np.zeros((0, 4), dtype="float32"))
    w = nn.Parameter(np.random.randn(3, 4).astype("float32"))
    reference = nn.Parameter(w.numpy())
    opt, ref_opt = optim.Adafactor([empty, w]), optim.Adafactor([reference])
    for params, o in ((empty, w), opt), ((reference,), ref_opt):
        (params[-1] * params[-1]).sum().backward()
        if len(params) == 2:
            empty.grad = ndl.Tensor(np.zeros((0, 4), dtype="float32"))
        o.step()
    assert empty.shape == (0, 4)
    np.testing.assert_array_equal(w.numpy(), reference.numpy())  # the other parameters update as without it


@pytest.mark.parametrize("kw", [dict(init_scale=float("nan")), dict(init_scale=float("inf")),
                                dict(growth_factor=float("nan")), dict(backoff_factor=float("nan")),
                                dict(init_scale=0.0)])
def test_grad_scaler_rejects_nan_and_infinite_settings(kw):
    with pytest.raises(ValueError, match="GradScaler: need a finite init_scale > 0"):
        ndl.amp.GradScaler(**kw)


@pytest.mark.parametrize("field, value", [("lr", float("nan")), ("beta1", 5.0), ("t", -3), ("t", 2.5),
                                          ("eps", 0.0), ("weight_decay", -1.0)])
def test_load_state_dict_refuses_a_hand_edited_hyperparameter_and_changes_nothing(field, value):
    """Issue 45: a state dict with lr NaN, beta1 5 or t -3 was accepted, and a failed load had already changed lr."""
    w = ndl.Tensor(np.ones((3, 2), np.float32), device=ndl.cpu_numpy(), requires_grad=True)
    opt = ndl.optim.Adam([w], lr=0.1)
    state = opt.state_dict()
    state["param_groups"][0][field] = value
    state["param_groups"][0]["lr"] = 0.5 if field != "lr" else value  # a change that must not happen on failure
    with pytest.raises(ValueError, match=f"Adam: {field} must"):
        opt.load_state_dict(state)
    assert (opt.lr, opt.beta1, opt.t, opt.eps) == (0.1, 0.9, 0, 1e-8)


def test_optimizers_refuse_what_would_fail_later():
    """Issue 45: Adam(eps=0) gave NaN on a zero gradient; SGD([1, 2]) was accepted until the first step."""
    w = ndl.Tensor(np.ones((3, 2), np.float32), device=ndl.cpu_numpy(), requires_grad=True)
    with pytest.raises(ValueError, match=r"Adam: eps must be in \(0, inf\)"):
        ndl.optim.Adam([w], eps=0)
    with pytest.raises(TypeError, match="SGD: params must be Tensors .* got int at position 0"):
        ndl.optim.SGD([1, 2])
    with pytest.raises(ValueError, match="Adafactor: decay_rate must be in"):
        ndl.optim.Adafactor([w], decay_rate=0.5)
