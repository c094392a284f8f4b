"""The graph core: every op's gradient against central differences, and the course's autograd behaviours.

`OP_CASES` (op_cases.py) is one table of gradient cases, at least one per op class in `needle.ops` (a test checks
that none is missing). `test_op_gradient` runs each case in float32 on the NumPy reference device through
`conftest.check_gradients` (tests/backend/test_autograd_compiled.py on the compiled devices); `np_backend_checks.py`
runs the same table in float64 under NEEDLE_BACKEND=np (eps 1e-6, tolerance ~1e-6), which
`test_float64_oracle_under_np_backend` launches in a subprocess, because NEEDLE_BACKEND is read at import.
"""
import copy
import gc
import re
import os
import pickle
import subprocess
import sys
import weakref

import numpy as np
import pytest

import needle as ndl
from needle import autograd, backward, ops
from needle import backend_ndarray as nd

from conftest import check_gradients, numerical_gradient, random_out_grad, saves_violation
from op_cases import OP_CASES

REPO = os.path.join(os.path.dirname(__file__), "..", "..")

# The fused ops are checked in their own files (test_attention, test_layernorm, test_fused_linear, test_dropout,
# test_linear_cross_entropy) against the unfused graphs they replace.
# The few-bit ops' gradients are approximations by design (a numerical check would reject them): test_activations
# checks them against the fitted table, and their `saves`.
FUSED_OP_MODULES = {"ops_attention", "ops_dropout", "ops_fused", "ops_linear", "ops_norm", "ops_fewbit"}


@pytest.mark.smoke
def test_every_op_class_has_a_gradient_case():
    op_classes = {name for name in dir(ops) if isinstance(getattr(ops, name), type)
                  and issubclass(getattr(ops, name), autograd.Op)
                  and getattr(ops, name).__module__.rsplit(".", 1)[-1] not in FUSED_OP_MODULES}
    assert {"EWiseAdd", "Conv", "MakeTensorTuple", "TupleGetItem", "GatherRows"} <= op_classes
    assert op_classes - {case.op for case in OP_CASES.values()} == set()


@pytest.mark.parametrize("name", list(OP_CASES))
def test_op_gradient(device, name):
    case = OP_CASES[name]
    arrays = case.make(np.random.default_rng(sum(map(ord, name))))
    out = check_gradients(case.fn, *arrays, device=device)
    assert out.device == device and out.dtype == "float32"
    if case.ref is not None:
        expected = case.ref(*[a.astype(np.float32).astype(np.float64) for a in arrays])
        np.testing.assert_allclose(out.numpy(), expected, rtol=1e-4, atol=1e-4)


def test_float64_oracle_under_np_backend():
    """Run np_backend_checks.py (the OP_CASES and the fused ops in float64, eps 1e-6; broadcasting; the optimizers)
    in one fresh interpreter with NEEDLE_BACKEND=np: the backend is read once, at import."""
    env = dict(os.environ, NEEDLE_BACKEND="np")
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         os.path.join("tests", "core", "np_backend_checks.py")],
        check=False, cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )
    summary = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else ""
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-2000:]
    assert " passed" in summary and "skipped" not in summary and "failed" not in summary, summary


@pytest.mark.smoke
def test_op_errors_are_value_and_type_errors():
    a = ndl.Tensor(np.ones((2, 3)))
    b = ndl.Tensor(np.ones((3, 2)))
    for bad in [lambda: a + b, lambda: a * b, lambda: a / b, lambda: a**b, lambda: a @ a,
                lambda: ndl.summation(a, axes=2), lambda: ndl.logsumexp(a, axes=(0, 3)),
                lambda: ndl.reshape(a, (4, 2)), lambda: ndl.broadcast_to(a, (3, 3)),
                lambda: ndl.transpose(a, (0, 2)), lambda: ndl.stack([a, b], 0), lambda: ops.pad(a, ((1, 1),)),
                lambda: ops.slice_window(a, (1, 0), (2, 3)), lambda: ndl.conv(a, b)]:
        with pytest.raises(ValueError):
            bad()
    with pytest.raises(TypeError):
        ops.EWiseAdd()(a, np.ones((2, 3)))
    with pytest.raises(TypeError):
        ops.TupleGetItem(0)(a)


# ----- the course's graph API -------------------------------------------------------------------------------------
@pytest.mark.smoke
def test_find_topo_sort_post_order():
    a1 = ndl.Tensor(np.asarray([[0.88282157]]))
    b1 = ndl.Tensor(np.asarray([[0.90170084]]))
    s1 = 3 * a1
    m1 = s1 * a1
    s2 = 4 * b1
    m2 = s2 * a1
    x = m1 + m2
    c1 = x - a1  # c1 = 3 * a1 * a1 + 4 * b1 * a1 - a1
    neg = c1.inputs[1]
    order = autograd.find_topo_sort([c1])
    assert [id(n) for n in order] == [id(n) for n in [a1, s1, m1, b1, s2, m2, x, neg, c1]]
    expected = [[[0.88282157]], [[2.64846471]], [[2.33812177]], [[0.90170084]], [[3.60680336]], [[3.1841638]],
                [[5.52228558]], [[-0.88282157]], [[4.63946401]]]
    np.testing.assert_allclose([n.numpy() for n in order], expected, rtol=1e-6)
    # several roots and a shared node: each node once, in first-visit post-order
    d = ndl.exp(a1)
    e = d + d
    f = d * b1
    order = autograd.find_topo_sort([e, f])
    assert [id(n) for n in order] == [id(n) for n in [a1, d, e, b1, f]]


@pytest.mark.smoke
def test_operator_overloads_build_the_course_graph():
    a = ndl.Tensor(np.ones((2, 2)))
    b = ndl.Tensor(np.ones((2, 2)))
    diff = a - b
    assert isinstance(diff.op, ops.EWiseAdd) and diff.inputs[0] is a
    assert isinstance(diff.inputs[1].op, ops.Negate) and diff.inputs[1].inputs[0] is b
    three_a = 3 * a
    assert isinstance(three_a.op, ops.MulScalar) and three_a.op.scalar == 3 and three_a.inputs == (a,)
    plus = a + 1.5
    assert isinstance(plus.op, ops.AddScalar) and plus.op.scalar == 1.5 and plus.inputs == (a,)
    assert len(autograd.find_topo_sort([plus])) == 2 and len(autograd.find_topo_sort([three_a])) == 2
    rsub = 2 - a
    assert isinstance(rsub.op, ops.AddScalar) and isinstance(rsub.inputs[0].op, ops.Negate)
    np.testing.assert_array_equal(rsub.numpy(), np.ones((2, 2)))
    assert isinstance((a / b).op, ops.EWiseDiv) and isinstance((a / 2).op, ops.DivScalar)
    assert isinstance((a ** b).op, ops.EWisePow) and isinstance((a ** 2).op, ops.PowerScalar)
    assert isinstance((a @ b).op, ops.MatMul) and isinstance((-a).op, ops.Negate)
    assert isinstance((1.5 + a).op, ops.AddScalar) and isinstance((a * b).op, ops.EWiseMul)


def test_gradients_are_differentiable_second_derivative():
    """x.grad is a Tensor in a graph: differentiating it again gives the Hessian-vector product."""
    rng = np.random.default_rng(1)
    x0 = rng.uniform(0.3, 1.2, (2, 3))
    v = rng.standard_normal((2, 3))

    def grad_dot_v(x_values):  # <∇f(x), v> with f(x) = Σ x³ tanh(x)
        x = ndl.Tensor(x_values.astype(np.float32), device=nd.cpu_numpy())
        (x * x * x * ndl.tanh(x)).sum().backward()
        return x, (x.grad * ndl.Tensor(v.astype(np.float32), device=nd.cpu_numpy(), requires_grad=False)).sum()

    x, s = grad_dot_v(x0)
    first = x.grad.numpy()
    t = np.tanh(x0)
    np.testing.assert_allclose(first, 3 * x0**2 * t + x0**3 * (1 - t**2), rtol=1e-5)
    assert x.grad.requires_grad and not x.grad.is_leaf()
    s.backward()  # x.grad is now H v
    numeric = numerical_gradient(lambda xv: float(grad_dot_v(xv)[1].numpy()), [x0.copy()], eps=1e-3)[0]
    np.testing.assert_allclose(x.grad.numpy(), numeric, rtol=1e-2, atol=1e-3)
    assert not np.allclose(x.grad.numpy(), first)


def test_x_grad_backward_simple():
    x = ndl.Tensor([[1.0, 2.0, 3.0]])
    (x * x * x).sum().backward()  # 3x²
    np.testing.assert_allclose(x.grad.numpy(), [[3.0, 12.0, 27.0]])
    x.grad.backward()  # Σ 3x² -> 6x
    np.testing.assert_allclose(x.grad.numpy(), [[6.0, 12.0, 18.0]])


@pytest.mark.smoke
def test_backward_replaces_grad_and_non_scalar_output_gets_ones():
    x = ndl.Tensor(np.arange(6.0).reshape(2, 3))
    y = x * 2.0
    y.backward()  # non-scalar: implicit ones
    np.testing.assert_array_equal(x.grad.numpy(), np.full((2, 3), 2.0))
    y.backward()  # again: replaced, not accumulated
    np.testing.assert_array_equal(x.grad.numpy(), np.full((2, 3), 2.0))
    y.backward(ndl.Tensor(np.arange(6.0).reshape(2, 3), requires_grad=False))
    np.testing.assert_array_equal(x.grad.numpy(), 2 * np.arange(6.0).reshape(2, 3))
    z = (x * x).sum()
    z.backward()
    np.testing.assert_array_equal(x.grad.numpy(), 2 * np.arange(6.0).reshape(2, 3))


def test_gradient_of_a_shared_input_sums_its_uses():
    x = ndl.Tensor([2.0, -1.0])
    w = ndl.Tensor([3.0, 4.0], requires_grad=False)
    y = (x * w + x * x + ndl.exp(x)).sum()
    y.backward()
    np.testing.assert_allclose(x.grad.numpy(), [3 + 4 + np.exp(2.0), 4 - 2 + np.exp(-1.0)], rtol=1e-6)
    assert w.grad is None


def test_gradient_as_tuple_is_callable_on_any_node():
    a = ndl.Tensor(np.ones((2, 3)))
    b = ndl.Tensor(np.full((3, 4), 2.0))
    c = a @ b
    grads = c.op.gradient_as_tuple(ndl.Tensor(np.ones((2, 4)), requires_grad=False), c)
    assert isinstance(grads, tuple) and len(grads) == 2
    np.testing.assert_array_equal(grads[0].numpy(), np.full((2, 3), 8.0))
    np.testing.assert_array_equal(grads[1].numpy(), np.full((3, 4), 2.0))
    neg = -a
    assert len(neg.op.gradient_as_tuple(ndl.Tensor(np.ones((2, 3))), neg)) == 1


def test_tensor_counter_returns_to_baseline():
    gc.collect()
    baseline = autograd.TENSOR_COUNTER
    x = ndl.Tensor(np.ones((3, 4)))
    w = ndl.Tensor(np.ones((4, 2)))
    loss = ndl.logsumexp(ndl.relu(x @ w), axes=1).sum()
    loss.backward()
    assert autograd.TENSOR_COUNTER > baseline + 4
    del x, w, loss
    gc.collect()
    assert autograd.TENSOR_COUNTER == baseline
    # a constructor that raises counts nothing
    for bad in [lambda: ndl.Tensor(np.ones(3), dtype="float64"), lambda: ndl.Tensor(np.array(["a"])),
                lambda: ndl.Tensor(np.ones(3)) + ndl.Tensor(np.ones(4))]:
        with pytest.raises((TypeError, ValueError)):
            bad()
    gc.collect()
    assert autograd.TENSOR_COUNTER == baseline


def test_tensor_construction_and_dtypes():
    for value in [np.ones((2, 3)), np.ones((2, 3), dtype=np.float64), np.ones((2, 3), dtype=np.int64),
                  [[1, 2, 3], [4, 5, 6]], nd.array(np.ones((2, 3)))]:
        t = ndl.Tensor(value)
        assert t.dtype == "float32" and t.shape == (2, 3) and isinstance(t.cached_data, nd.NDArray)
        assert t.is_leaf() and t.requires_grad and t.device == ndl.default_device()
    s = ndl.Tensor(2.5)
    assert s.shape == () and s.numpy() == np.float32(2.5)
    assert ndl.Tensor(np.float32(1.5)).shape == ()
    t = ndl.Tensor(np.ones(3), device=ndl.cpu_numpy(), requires_grad=False)
    assert t.device == ndl.cpu_numpy() and not t.requires_grad
    duplicate = ndl.Tensor(t)
    assert duplicate.device == t.device and duplicate.numpy().tolist() == [1, 1, 1]
    with pytest.raises(TypeError):
        ndl.Tensor(np.ones(3), dtype="float64")
    if ndl.cpu().enabled():
        moved = ndl.Tensor(t, device=ndl.cpu())
        assert moved.device == ndl.cpu() and moved.numpy().tolist() == [1, 1, 1]
    assert isinstance(t.numpy(), np.ndarray) and np.asarray(t).dtype == np.float32


def test_tensor_rejects_unknown_keyword_arguments():
    """A misspelt keyword is an error naming it, not silently ignored (requires_gard=False would leave the
    Tensor requiring grad); Parameter, a Tensor, does the same."""
    with pytest.raises(TypeError, match=r"unknown keyword argument\(s\) 'requires_gard'.*requires_grad"):
        ndl.Tensor(np.ones(3), requires_gard=False)
    with pytest.raises(TypeError, match=r"'devcie', 'dtpye'"):
        ndl.nn.Parameter(np.ones(3), devcie=ndl.cpu_numpy(), dtpye="float32")
    assert not ndl.Tensor(np.ones(3), device=ndl.cpu_numpy(), dtype="float32", requires_grad=False).requires_grad


def test_detach_and_data_setter():
    x = ndl.Tensor(np.arange(4.0))
    y = x * 2
    d = y.detach()
    assert d.is_leaf() and not d.requires_grad and d.op is None and d.inputs == ()
    np.testing.assert_array_equal(d.numpy(), [0, 2, 4, 6])
    data = x.data
    assert data.is_leaf() and not data.requires_grad
    x.data = ndl.Tensor(np.ones(4))
    np.testing.assert_array_equal(x.numpy(), np.ones(4))
    np.testing.assert_array_equal(data.numpy(), np.arange(4.0))  # the old data did not change
    assert x.requires_grad and x.is_leaf()
    with pytest.raises(TypeError):
        x.data = np.ones(4)
    z = (x * 3).sum()
    z.backward()
    np.testing.assert_array_equal(x.grad.numpy(), np.full(4, 3.0))


def test_backward_checks_out_grad_shape_and_that_something_requires_grad():
    x = ndl.Tensor(np.ones((2, 3), np.float32))
    with pytest.raises(ValueError, match=r"out_grad has shape \(3, 2\), but the output has shape \(2, 3\)"):
        (x * 2).backward(ndl.Tensor(np.ones((3, 2), np.float32), requires_grad=False))
    assert x.grad is None
    with pytest.raises(TypeError, match="out_grad must be a Tensor"):
        (x * 2).backward(np.ones((2, 3), np.float32))
    constant = ndl.Tensor(np.ones(3), requires_grad=False)
    with pytest.raises(RuntimeError, match="does not require grad"):
        (constant * 2).sum().backward()


def test_versions_count_in_place_writes():
    """Rule 4c's counter: replacing data or writing into it bumps the version; computing or releasing does not. A
    node records its inputs' versions when it is built, lazy or not (a lazy graph reads them then)."""
    x = ndl.Tensor(np.zeros((2, 3), np.float32))
    y = ops.exp(x)
    assert (x.version, y.version) == (0, 0) and y._input_versions == (0,)
    x.data = x.data + 1.0
    x[0:1, 0:2] = 3.0
    x.cached_data = x.cached_data + 1.0  # course code writes cached_data directly, as an optimizer does
    assert x.version == 3 and y._input_versions == (0,)
    np.testing.assert_array_equal(x.numpy(), [[4, 4, 2], [2, 2, 2]])
    with autograd.lazy_mode(True):
        z = ops.exp(x)
        assert z.cached_data is None and z._input_versions == (3,)  # nothing computed yet, the versions recorded
        z.realize_cached_data()
    assert z._input_versions == (3,) and z.version == 0
    autograd.release(z)
    assert z.version == 0


@pytest.mark.parametrize("copier", ["pickle", "deepcopy"])
def test_tensors_and_models_copy_by_value(copier):
    def dup(obj):
        return pickle.loads(pickle.dumps(obj)) if copier == "pickle" else copy.deepcopy(obj)

    x = ndl.Tensor(np.arange(6, dtype=np.float32).reshape(2, 3))
    y = dup(x * 2)
    assert type(y) is ndl.Tensor and y.is_leaf() and y.requires_grad
    np.testing.assert_array_equal(y.numpy(), np.arange(6).reshape(2, 3) * 2)
    np.random.seed(0)
    model = ndl.nn.Sequential(ndl.nn.Linear(3, 2), ndl.nn.ReLU())
    model.parameters()  # names the parameters
    clone = dup(model)
    for p, q in zip(model.parameters(), clone.parameters()):
        assert type(q) is ndl.nn.Parameter and q is not p and q.name == p.name
        np.testing.assert_array_equal(p.numpy(), q.numpy())


def test_requires_grad_false_inputs_make_constants():
    a = ndl.Tensor(np.ones(3), requires_grad=False)
    b = a * 2 + 1
    assert not b.requires_grad and b.is_leaf()  # eager mode: no graph kept for constants
    np.testing.assert_array_equal(b.numpy(), np.full(3, 3.0))


# ----- LAZY_MODE ----------------------------------------------------------------------------------------------------
def _mlp_step(device, counter=None):
    rng = np.random.default_rng(7)
    X = ndl.Tensor(rng.standard_normal((8, 5)), device=device, requires_grad=False)
    W1 = ndl.Tensor(rng.standard_normal((5, 6)), device=device)
    b1 = ndl.Tensor(rng.standard_normal((1, 6)), device=device)
    W2 = ndl.Tensor(rng.standard_normal((6, 3)), device=device)
    h = ndl.relu(X @ W1 + ndl.broadcast_to(b1, (8, 6)))
    logits = ndl.tanh(h) @ W2
    loss = (ndl.logsumexp(logits, axes=1) - ndl.logsoftmax(logits).sum(axes=1) / 3).sum() / 8
    return loss, h, logits, (W1, b1, W2)


class _ComputeCounter:
    """Counts Op.compute calls, per op class, by wrapping every op class's compute."""

    def __init__(self, monkeypatch):
        self.calls = {}
        for name in ops.__all__:
            cls = getattr(ops, name)
            if isinstance(cls, type) and issubclass(cls, autograd.Op) and "compute" in vars(cls):
                monkeypatch.setattr(cls, "compute", self._wrap(name, vars(cls)["compute"]))

    def _wrap(self, name, compute):
        def counted(op, *args):
            self.calls[name] = self.calls.get(name, 0) + 1
            return compute(op, *args)
        return counted

    def total(self):
        return sum(self.calls.values())


@pytest.mark.smoke
def test_lazy_and_eager_give_identical_numbers(device, monkeypatch):
    results = {}
    for lazy in (False, True):
        monkeypatch.setattr(autograd, "LAZY_MODE", lazy)
        counter = _ComputeCounter(monkeypatch)
        loss, h, logits, params = _mlp_step(device)
        if lazy:  # nothing computed until needed
            assert counter.total() == 0
            assert loss.cached_data is None and h.cached_data is None and logits.cached_data is None
        else:
            assert loss.cached_data is not None and counter.total() > 0
        loss.backward()
        results[lazy] = [loss.numpy()] + [p.grad.numpy() for p in params]
        monkeypatch.undo()
    for eager_value, lazy_value in zip(results[False], results[True]):
        assert np.array_equal(eager_value, lazy_value)
    assert autograd.LAZY_MODE is False


def test_lazy_mode_context_manager_and_realize():
    with autograd.lazy_mode():
        assert autograd.LAZY_MODE is True
        x = ndl.Tensor(np.array([1.0, 2.0]), requires_grad=False)
        y = ndl.exp(x) + 1.0
        assert y.cached_data is None and y.inputs[0].cached_data is None
        assert y.shape == (2,)  # shape needs the value: realized here
        np.testing.assert_allclose(y.numpy(), np.exp([1.0, 2.0]) + 1, rtol=1e-6)
        assert y.cached_data is not None
    assert autograd.LAZY_MODE is False
    with pytest.raises(ZeroDivisionError), autograd.lazy_mode():
        raise ZeroDivisionError
    assert autograd.LAZY_MODE is False


def _shape_graph(x, w):
    """Every op whose output shape is not its input's: conv, dilate, pad, slice, stack/split and tuples."""
    c = ndl.conv(x, w, stride=2, padding=1)                       # (2, 3, 3, 4)
    d = ops.undilate(ops.dilate(c, (1, 2), 1), (1, 2), 1)         # (2, 6, 6, 4) -> (2, 3, 3, 4)
    p = ops.slice_window(ops.pad(d, ((0, 0), (1, 1), (0, 2), (0, 0))), (0, 1, 0, 0), (2, 3, 5, 4))
    parts = ops.split(p, axis=3)                                  # 4 x (2, 3, 5)
    t = ops.make_tuple(parts[0], parts[3])
    return ops.stack([ops.tuple_get_item(t, 1), parts[1]], axis=1).sum()


def test_lazy_shape_inference_covers_every_shape_changing_op(device, monkeypatch):
    """In lazy mode every intermediate's shape is known without computing anything, and equals the eager one."""
    rng = np.random.default_rng(7)
    x_np, w_np = rng.standard_normal((2, 5, 5, 3)), rng.standard_normal((3, 3, 3, 4))
    counter = _ComputeCounter(monkeypatch)
    with autograd.lazy_mode():
        x, w = ndl.Tensor(x_np, device=device), ndl.Tensor(w_np, device=device)
        out = _shape_graph(x, w)
        graph = autograd.find_topo_sort([out])
        lazy_shapes = [tuple(n.shape) for n in graph]
        assert counter.total() == 0 and all(n.cached_data is None for n in graph if not n.is_leaf())
    monkeypatch.undo()
    eager = autograd.find_topo_sort([_shape_graph(ndl.Tensor(x_np, device=device), ndl.Tensor(w_np, device=device))])
    assert lazy_shapes == [tuple(n.shape) for n in eager]


# ----- deep graphs: iterative traversals, linear work ------------------------------------------------------------
@pytest.mark.parametrize("lazy", [False, True])
def test_deep_chain_20k_ops_forward_and_backward(lazy, monkeypatch):
    """No RecursionError anywhere (build, realize, topo sort, backward, teardown); the backward computes one
    gradient op per node. 20 000 ops are 20 times Python's recursion limit, so any recursive walk fails here, and
    the limit is checked not to have been raised to let one through (the 100 000-op teardown: the next test)."""
    n = 20_000
    assert n >= 20 * sys.getrecursionlimit()
    monkeypatch.setattr(autograd, "LAZY_MODE", lazy)
    counter = _ComputeCounter(monkeypatch)
    x = ndl.Tensor(np.array([1.0, 2.0]), device=nd.cpu_numpy())
    y = x
    for _ in range(n):
        y = y * 1.00001
    assert counter.calls.get("MulScalar", 0) == (0 if lazy else n)
    factor = float(np.float32(1.00001)) ** n  # the scalar is rounded to float32, as the data
    np.testing.assert_allclose(y.numpy(), np.array([1.0, 2.0]) * factor, rtol=1e-3)
    assert counter.calls["MulScalar"] == n  # realized once, in both modes
    y.backward()
    assert counter.calls["MulScalar"] == 2 * n  # backward: out_grad * c, once per node
    assert counter.total() == 2 * n
    np.testing.assert_allclose(x.grad.numpy(), np.full(2, factor), rtol=1e-3)
    del y
    gc.collect()
    assert n >= 20 * sys.getrecursionlimit()  # nothing raised it on the way


def test_deep_chain_100k_ops_builds_sorts_and_tears_down():
    """A 100 000-op chain (lazy: recorded, not computed) is built, topologically sorted and freed without a
    RecursionError or a C stack overflow (freeing a chain of that depth recursively in C would overflow the stack;
    20 000 may not)."""
    n = 100_000
    x = ndl.Tensor(np.array([1.0, 2.0]), device=nd.cpu_numpy())
    with autograd.lazy_mode():
        y = x
        for _ in range(n):
            y = y * 1.00001
        order = autograd.find_topo_sort([y])
    assert len(order) == n + 1 and order[0] is x and order[-1] is y
    ref = weakref.ref(order[1])
    del y, order
    gc.collect()
    assert ref() is None  # the whole chain was freed


def _chain(n):
    """A chain of 3n ops mixing a scalar op, a pass-through gradient (add) and a new leaf at every step."""
    x = ndl.Tensor(np.array([0.5]), device=nd.cpu_numpy())
    y = x
    for _ in range(n):
        w = ndl.Tensor(np.array([1.01]), device=nd.cpu_numpy())
        y = ndl.tanh(y * 1.5 + 1.0) * w
    return x, y


@pytest.mark.parametrize("lazy", [False, True])
def test_backward_work_is_linear_in_depth(lazy, monkeypatch):
    """Count the nodes every find_topo_sort call visits and the ops computed during backward: both grow linearly
    with the depth (doubling the depth doubles the work), even with a leaf at every step."""
    visited = []
    real_topo_sort = autograd.find_topo_sort

    def counting_topo_sort(node_list, expand=None):
        order = real_topo_sort(node_list, expand)
        visited.append(len(order))
        return order

    monkeypatch.setattr(autograd, "LAZY_MODE", lazy)
    work = {}
    for n in (1_000, 2_000):
        _, y = _chain(n)
        y.realize_cached_data()
        num_nodes = len(real_topo_sort([y]))
        assert num_nodes == 1 + 5 * n  # x, then one leaf and four ops per step
        counter = _ComputeCounter(monkeypatch)
        visited.clear()
        for module in (autograd, backward):  # realization's walks and the plan's
            monkeypatch.setattr(module, "find_topo_sort", counting_topo_sort)
        y.backward()
        for module in (autograd, backward):
            monkeypatch.setattr(module, "find_topo_sort", real_topo_sort)
        assert max(visited) == num_nodes  # the one full walk; every other walk is local to one step
        assert sum(visited) <= 10 * num_nodes  # a bounded walk per step
        assert counter.total() <= 4 * num_nodes
        work[n] = (sum(visited), counter.total())
    assert work[2_000][0] <= 2 * work[1_000][0] + 10
    assert work[2_000][1] <= 2 * work[1_000][1] + 10


def test_find_topo_sort_deep_and_wide():
    x = ndl.Tensor(np.array([1.0]), device=nd.cpu_numpy(), requires_grad=True)
    with autograd.lazy_mode():
        y = x
        for _ in range(50_000):
            y = y + x  # every node also reaches back to the leaf
        order = autograd.find_topo_sort([y])
    assert len(order) == 50_001 and order[0] is x and order[-1] is y
    np.testing.assert_array_equal(y.numpy(), [50_001.0])


# ----- the op contract: `gradient` returns one entry per input; `saves` tells the truth ---------------------------
def _case_nodes(name):
    """The op nodes of OP_CASES[name]'s forward graph, built eagerly on the NumPy reference device."""
    case = OP_CASES[name]
    arrays = case.make(np.random.default_rng(sum(map(ord, name))))
    out = case.fn(*[ndl.Tensor(a.astype(np.float32), device=nd.cpu_numpy()) for a in arrays])
    nodes = [n for n in autograd.find_topo_sort([out]) if not n.is_leaf() and n.requires_grad]
    assert case.op in {type(n.op).__name__ for n in nodes}, f"{name}: no {case.op} node in the graph"
    return nodes


@pytest.mark.parametrize("name", list(OP_CASES))
def test_gradient_returns_a_tuple_with_one_entry_per_input(name):
    """STYLE.md's op contract, checked on `gradient` itself (not only through gradient_as_tuple)."""
    rng = np.random.default_rng(0)
    for node in _case_nodes(name):
        with autograd.lazy_mode(True):
            grads = node.op.gradient(random_out_grad(node, rng), node)
        assert type(grads) is tuple, f"{type(node.op).__name__}.gradient returned a {type(grads).__name__}"
        assert len(grads) == len(node.inputs), type(node.op).__name__
        assert all(g is None or isinstance(g, autograd.Value) for g in grads), type(node.op).__name__


@pytest.mark.parametrize("name", list(OP_CASES))
def test_saves_declares_every_forward_value_the_gradient_reads(name):
    """`saves` is what the backward plan keeps or recomputes (autograd.reads), so a gradient reading anything else
    would read a released value. Every op node of every case is checked with the undeclared values hidden."""
    rng = np.random.default_rng(0)
    violations = [saves_violation(node, random_out_grad(node, rng)) for node in _case_nodes(name)]
    assert [v for v in violations if v is not None] == []


class _MulSavingNothing(ops.EWiseMul):
    saves = "none"  # a lie: d/da = out_grad * b reads the inputs


class _ExpSavingItsInput(ops.Exp):
    saves = "inputs"  # a lie: d/da = out_grad * exp(a) reads the output


class _ExpSavingBoth(ops.Exp):
    saves = "both"  # more than it reads: wasteful, but true


@pytest.mark.smoke
def test_saves_checker_reports_an_op_that_reads_undeclared_values():
    """The checker above catches both kinds of lie (a hidden input, a hidden output) and accepts a superset."""
    rng = np.random.default_rng(0)
    a, b = (ndl.Tensor(rng.standard_normal((2, 3)).astype(np.float32), device=nd.cpu_numpy()) for _ in range(2))
    g = ndl.Tensor(rng.standard_normal((2, 3)).astype(np.float32), device=nd.cpu_numpy())
    assert saves_violation(ops.EWiseMul()(a, b), g) is None
    lying_mul = saves_violation(_MulSavingNothing()(a, b), g)
    assert lying_mul is not None and "saves='none'" in lying_mul and "read input" in lying_mul
    lying_exp = saves_violation(_ExpSavingItsInput()(a), g)
    assert lying_exp is not None and "saves='inputs'" in lying_exp and "read its output" in lying_exp
    assert saves_violation(_ExpSavingBoth()(a), g) is None


@pytest.mark.parametrize("axes, error, message", [
    ((0, 0), ValueError, "Summation: axes (0, 0) name an axis twice"),
    ((1, -1), ValueError, "Summation: axes (1, -1) name an axis twice"),
    (1.0, TypeError, "Summation: axes must be None, an int or a tuple of ints, got 1.0"),
    ((0, "1"), TypeError, "Summation: axes must be None, an int or a tuple of ints"),
])
def test_summation_rejects_repeated_or_non_integer_axes(axes, error, message):
    # (0, 0) was deduplicated silently and 1.0 said "'float' object is not iterable" (issue 26, item 10)
    x = ndl.Tensor(np.ones((2, 3), dtype="float32"))
    with pytest.raises(error, match=re.escape(message)):
        x.sum(axes)
    assert ops.summation(x, (np.int64(1),)).shape == (2,)  # NumPy integers are integers


def _shared_weight_step(T=16, lazy=False):
    """A weight read at T time steps, as an RNN's: (its gradient, the allocator's peak over backward, the ledger's)."""
    device = nd.cpu_numpy()
    rs = np.random.RandomState(0)
    w = ndl.Tensor(rs.randn(32, 32).astype(np.float32) * 0.3, device=device, requires_grad=True)
    xs = [ndl.Tensor(rs.randn(8, 32).astype(np.float32), device=device) for _ in range(T)]
    gc.collect()
    base = device.memory_stats()["current_bytes"]
    with autograd.lazy_mode(lazy):
        h = xs[0]
        for x in xs[1:]:
            h = ops.tanh(h @ w) + x
        loss = h.sum()
        from needle.checkpoint_budget import predict_peak
        predicted = predict_peak(loss, set())
        nd.reset_peak_memory_stats(device)
        loss.backward()
    return w.grad.numpy(), device.memory_stats()["peak_bytes"] - base, predicted


@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
def test_a_shared_weights_gradient_parts_are_summed_as_they_arrive(lazy, monkeypatch):
    """A weight read at T steps gets T gradient parts; backward sums them as they arrive (`backward._accumulate`),
    so one partial sum waits instead of every part. The rounding is the same: the parts are added in the order they
    arrive, which is the order the step consuming them would add them in, so the gradient is bit-identical to
    summing them all at the end (here: accumulation switched off). The ledger predicts the lower peak exactly."""
    grad, peak, predicted = _shared_weight_step(lazy=lazy)
    monkeypatch.setattr(backward, "_accumulate", lambda *args: None)
    grad_at_end, peak_at_end, predicted_at_end = _shared_weight_step(lazy=lazy)
    assert np.array_equal(grad, grad_at_end)
    assert peak < peak_at_end and (predicted, predicted_at_end) == (peak, peak_at_end)


def test_bad_conv_arguments_and_dtype_spellings_get_one_clear_error():
    """Issue 45: conv(stride=0) was a ZeroDivisionError; autocast("bf16") and astype("bfloat") said only "data type
    not understood". The usual short spellings are accepted; anything else names the API and what it accepts."""
    x = ndl.Tensor(np.ones((1, 4, 4, 2), np.float32), device=nd.cpu_numpy())
    w = ndl.Tensor(np.ones((3, 3, 2, 2), np.float32), device=nd.cpu_numpy())
    with pytest.raises(ValueError, match="conv: stride must be an integer >= 1, got 0"):
        ops.conv(x, w, stride=0)
    with pytest.raises(ValueError, match="conv: padding must be an integer >= 0, got -1"):
        ops.conv(x, w, padding=-1)
    assert x.astype("bf16").dtype == "bfloat16" and ndl.autocast("bf16").dtype == "bfloat16"
    with pytest.raises(TypeError, match=r"Linear.astype: dtype must be one of float32, .* got 'bfloat'"):
        ndl.nn.Linear(2, 2, device=nd.cpu_numpy()).astype("bfloat")
    with pytest.raises(TypeError, match="cast: dtype must be one of"):
        x.astype("float8")
    with pytest.raises(ValueError, match="autocast: dtype must be 'bfloat16' or 'float16'"):
        ndl.autocast("float32")
