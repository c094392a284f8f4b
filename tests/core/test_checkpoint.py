"""Gradient checkpointing: each test names the rule (needle/checkpoint.py, needle/backward.py) that it checks.

Graph-level tests build small graphs from ops and annotate regions by hand; model-level tests (LanguageModel,
layers) are in tests/integration/test_checkpoint_models.py.
"""
import ast
import gc as python_gc
import pathlib
import re
import warnings

import numpy as np
import pytest

import needle as ndl
from needle import autograd, checkpoint, checkpoint_budget, ops
from needle import backend_ndarray as nd

from conftest import count_computes

POLICIES = [
    dict(),
    dict(segment_len=1),
    dict(segment_len=2),
    dict(segment_len=3),
    dict(segment_len=4),
    dict(segment_len=5),
    dict(policy="sqrt"),
    dict(policy="selective"),
]
POLICY_IDS = ["all", "seg1", "seg2", "seg3", "seg4", "seg5", "sqrt", "selective"]


def _params(device, depth=4, width=6, seed=0):
    rs = np.random.RandomState(seed)
    return [ndl.Tensor(rs.randn(width, width).astype(np.float32) / width, device=device) for _ in range(depth)]


def _block(x, w):
    """A residual block with a norm-like interior: several cheap nodes around one matmul."""
    h = ops.relu(x @ w)
    mean = ops.broadcast_to(ops.reshape(ops.summation(h, (1,)) / h.shape[1], (h.shape[0], 1)), h.shape)
    centered = h - mean
    return x + ops.tanh(centered) * 0.5


def _model(params, x, gc=None, segment=False):
    """The loss of a stack of blocks; with `gc` (annotate kwargs) each block is a checkpointed region."""
    h = x
    for w in params:
        out = _block(h, w)
        if gc is not None:
            checkpoint.annotate(out, [h], **gc)
        h = out
    return ops.logsumexp(h, axes=(1,)).sum()


def _grads(device, gc, lazy, seed=0):
    params = _params(device, seed=seed)
    x = ndl.Tensor(np.random.RandomState(seed + 1).randn(5, 6).astype(np.float32), device=device,
                   requires_grad=False)
    with autograd.lazy_mode(lazy):
        loss = _model(params, x, gc)
        loss.backward()
    return loss.numpy(), [p.grad.numpy() for p in params]


@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
@pytest.mark.parametrize("gc", POLICIES, ids=POLICY_IDS)
def test_rule4_gradients_bit_identical(device, lazy, gc):
    """Rule 4: gradients with checkpointing are bit-identical to those without, in both modes."""
    loss_off, grads_off = _grads(device, None, lazy=False)
    loss_on, grads_on = _grads(device, gc, lazy=lazy)
    assert np.array_equal(loss_off, loss_on)
    for g_off, g_on in zip(grads_off, grads_on):
        assert np.array_equal(g_off, g_on)


@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
@pytest.mark.parametrize("gc", POLICIES, ids=POLICY_IDS)
@pytest.mark.smoke
def test_rule2_each_dropped_node_recomputed_at_most_once(lazy, gc):
    """Rule 2: a dropped value is recomputed at most once per backward pass (counted per node)."""
    device = nd.cpu_numpy()
    params = _params(device)
    x = ndl.Tensor(np.ones((5, 6), np.float32), device=device, requires_grad=False)
    with autograd.lazy_mode(lazy):
        loss = _model(params, x, gc)
        loss.realize_cached_data()
        graph = [n for n in autograd.find_topo_sort([loss]) if not n.is_leaf()]
        counts = count_computes(graph)
        loss.backward()
    dropped = [n for n in graph if n.drop]
    stats = checkpoint.last_backward_stats()
    assert max(counts.values(), default=0) <= 1
    assert all(counts.get(id(n), 0) <= 1 for n in dropped)
    assert stats["recomputed_nodes"] == sum(counts.values())
    assert stats["max_recomputes_per_node"] <= 1
    if gc == {} or gc.get("policy") == "selective":
        assert dropped and stats["recomputed_nodes"] > 0


def test_rule2_chain_of_k_dropped_nodes_costs_k_recomputes():
    """Rule 2: a chain of k dropped nodes costs k recomputations, not O(k^2) (the earlier project's bug)."""
    device = nd.cpu_numpy()
    for k in (10, 100, 1000):
        x = ndl.Tensor(np.ones(4, np.float32), device=device)
        h = x
        for _ in range(k):
            h = ops.tanh(h) * 1.0001
        out = h * 1.0
        checkpoint.annotate(out, [x])
        out.sum().backward()
        # every interior node is dropped; tanh/mul-scalar each read their input or output once
        assert checkpoint.last_backward_stats()["recomputed_nodes"] <= 2 * k


@pytest.mark.smoke
def test_rule1_annotate_never_drops_leaves_inputs_or_output():
    """Rule 1: leaves (parameters, constants, masks), region inputs and the region output are never dropped."""
    device = nd.cpu_numpy()
    x = ndl.Tensor(np.ones((3, 3), np.float32), device=device)
    w = ndl.Tensor(np.ones((3, 3), np.float32), device=device)
    mask = ndl.init.randb(3, 3, p=0.5, device=device, dtype="float32")
    a = x @ w
    b = ops.relu(a) * mask
    out = b + x
    checkpoint.annotate(out, [x])
    assert not x.drop and not w.drop and not mask.drop and not out.drop
    assert a.drop and b.drop
    assert x.cached_data is not None and w.cached_data is not None and mask.cached_data is not None


def test_rule1_nested_regions_compose():
    """Rule 1: a node dropped by an inner region stays dropped; the outer region decides the rest."""
    device = nd.cpu_numpy()
    x = ndl.Tensor(np.ones((2, 2), np.float32), device=device)
    a = x * 2.0
    b = ops.exp(a)
    mid = b + 1.0
    checkpoint.annotate(mid, [x])
    out = ops.tanh(mid)
    checkpoint.annotate(out, [x], segment_len=1)  # keeps every candidate, but cannot un-drop a and b
    assert a.drop and b.drop
    assert not mid.drop and not out.drop


@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
def test_rule3_values_released_after_backward(lazy):
    """Rule 3: after backward no activation is held: only leaves and the output keep their data."""
    device = nd.cpu_numpy()
    params = _params(device)
    x = ndl.Tensor(np.ones((5, 6), np.float32), device=device, requires_grad=False)
    with autograd.lazy_mode(lazy):
        loss = _model(params, x, gc=None)
        loss.backward()
    for node in autograd.find_topo_sort([loss]):
        if node.is_leaf() or node is loss:
            assert node.cached_data is not None
        else:
            assert node.cached_data is None, type(node.op).__name__


@pytest.mark.devices("cpu", "cpu_numpy")
@pytest.mark.parametrize("gc", [None, dict(), dict(policy="sqrt")], ids=["off", "all", "sqrt"])
@pytest.mark.smoke
def test_rule3_memory_returns_to_baseline(device, gc):
    """Rule 3: after a step, the allocator's current bytes return to parameters + gradients; no leak."""
    params = _params(device)
    x = ndl.Tensor(np.ones((5, 6), np.float32), device=device, requires_grad=False)
    python_gc.collect()
    baseline = nd.memory_stats(device)["current_bytes"]
    held = []
    for _ in range(20):
        loss = _model(params, x, gc)
        loss.backward()
        held.append(nd.memory_stats(device)["current_bytes"])
        del loss
    grad_bytes = sum(4 * int(np.prod(p.shape)) for p in params)
    # only the gradients (+ the scalar loss and its ones out_grad) outlive a step
    assert held[-1] == held[1]
    assert held[-1] - baseline <= grad_bytes + 64


@pytest.mark.parametrize("gc", [dict(), dict(policy="sqrt"), dict(segment_len=2)], ids=["all", "sqrt", "seg2"])
@pytest.mark.devices("cpu", "cpu_numpy")
def test_rule3_dropped_values_use_less_memory_at_backward_start(device, gc):
    """Rule 3: in eager mode dropped values are released when the region's output exists."""
    params = _params(device, width=64)
    x = ndl.Tensor(np.ones((64, 64), np.float32), device=device, requires_grad=False)
    python_gc.collect()
    start = nd.memory_stats(device)["current_bytes"]
    loss_off = _model(params, x, None)
    held_off = nd.memory_stats(device)["current_bytes"] - start
    del loss_off
    python_gc.collect()
    start = nd.memory_stats(device)["current_bytes"]
    loss_on = _model(params, x, gc)  # held, so its graph's memory is what we measure
    held_on = nd.memory_stats(device)["current_bytes"] - start
    del loss_on
    assert held_on < held_off


def test_rule5_gradients_realized_when_backward_returns():
    """Rule 5: in lazy mode every leaf gradient is realized when backward returns (before any update)."""
    device = nd.cpu_numpy()
    params = _params(device)
    x = ndl.Tensor(np.ones((5, 6), np.float32), device=device, requires_grad=False)
    with autograd.lazy_mode(True):
        loss = _model(params, x, dict())
        loss.backward()
        for p in params:
            assert p.grad.cached_data is not None


@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
def test_rule4_adam_steps_bit_identical(lazy):
    """Rules 4 and 5: losses of consecutive in-place updates are bit-identical with and without gc."""
    device = nd.cpu_numpy()

    def run(gc):
        params = _params(device)
        x = ndl.Tensor(np.random.RandomState(3).randn(5, 6).astype(np.float32), device=device,
                       requires_grad=False)
        losses = []
        for _ in range(5):
            with autograd.lazy_mode(lazy):
                loss = _model(params, x, gc)
                losses.append(loss.numpy().copy())
                loss.backward()
            for p in params:  # plain SGD on the raw data, in place of an optimizer
                p.data = ndl.Tensor(p.realize_cached_data() - p.grad.realize_cached_data() * 0.1,
                                    device=device, requires_grad=False)
        return losses

    assert all(np.array_equal(a, b) for a, b in zip(run(None), run(dict())))


def test_rule4_recompute_checks_shape():
    """Rule 4: a recomputation that produces another shape than the forward pass raises a clear error."""
    device = nd.cpu_numpy()

    class Flaky(ops.AddScalar):
        calls = 0

        def compute(self, a):
            Flaky.calls += 1
            return a + 1.0 if Flaky.calls == 1 else ops.ops_mathematic.array_api.reshape(a, (a.size,)) + 1.0

    x = ndl.Tensor(np.ones((2, 3), np.float32), device=device)
    h = Flaky(1.0)(x)
    out = ops.log(h)  # log's gradient reads its input h, so the dropped h is recomputed
    checkpoint.annotate(out, [x])
    with pytest.raises(RuntimeError, match="rule 4"):
        out.sum().backward()


def test_annotate_rejects_bad_policy():
    with pytest.raises(ValueError, match="unknown checkpoint policy"):
        checkpoint.resolve_policy("everything")
    with pytest.raises(ValueError, match="segment_len"):
        checkpoint.resolve_policy(None, segment_len=0)


@pytest.mark.smoke
def test_policies_are_pure_functions():
    """Every policy maps a list of candidates to keep flags, deterministically."""
    device = nd.cpu_numpy()
    x = ndl.Tensor(np.ones((2, 2), np.float32), device=device)
    nodes = [x @ x]
    for _ in range(15):
        nodes.append(nodes[-1] + 1.0)
    assert checkpoint.nothing_saveable(nodes) == [False] * 16
    assert checkpoint.EverySegment(4)(nodes) == [(i + 1) % 4 == 0 for i in range(16)]
    # segments of ceil(sqrt 16) = 4; the last ends at the region output, which is kept anyway
    assert checkpoint.Sqrt()(nodes) == [i in (3, 7, 11) for i in range(16)]
    assert checkpoint.Sqrt()(nodes[:2]) == [False, False]
    assert checkpoint.dots_saveable(nodes) == [True] + [False] * 15


def test_every_policy_is_called_with_the_candidates_and_the_outputs():
    """One calling convention, policy(candidates, outputs), for the built-in policies, a Budget and user
    callables alike: annotate hands every policy the region's outputs (no special case for the Budget)."""
    device = nd.cpu_numpy()
    x = ndl.Tensor(np.ones((2, 2), np.float32), device=device)
    h = ops.exp(x)
    out = ops.log(h + 1.0)
    calls = []

    def recording(candidates, outputs):
        calls.append((list(candidates), list(outputs)))
        return [True] * len(candidates)

    checkpoint.annotate(out, [x], policy=recording)
    assert len(calls) == 1 and calls[0][1] == [out] and [n is h for n in calls[0][0]] == [True, False]
    nodes, outs = calls[0]
    for policy in (checkpoint.nothing_saveable, checkpoint.dots_saveable, checkpoint.EverySegment(2),
                   checkpoint.Sqrt(), checkpoint.Budget(10**9), checkpoint_budget.Planned(())):
        assert len(policy(nodes, outs)) == len(nodes), policy


def test_sqrt_prefers_cuts_and_never_keeps_a_view_of_a_leaf():
    """Sqrt: segments of ceil(sqrt n); per segment a cut first, then the cheapest; views of leaves never."""
    device = nd.cpu_numpy()
    x = ndl.Tensor(np.ones((2, 2), np.float32), device=device)
    h0 = x * 2.0
    h1 = h0 + 1.0
    h2 = ops.exp(h0)  # the edge h0 -> h2 jumps over h1, and h1, h2 -> h3 jump over h2: only h0 cuts segment 0
    h3 = h1 * h2
    h4 = h3 + 1.0
    h5 = h4 * 2.0
    h6 = h5 + 1.0
    h7 = h6 + 1.0
    h8 = h7 + 1.0
    nodes = [h0, h1, h2, h3, h4, h5, h6, h7, h8]
    assert checkpoint.Sqrt()(nodes) == [n is h0 or n is h5 for n in nodes]  # the last segment gets none
    w = ndl.Tensor(np.ones((2,), np.float32), device=device)
    bias = ops.broadcast_to(ops.reshape(w, (1, 2)), (2, 2))
    assert checkpoint.Sqrt()([bias.inputs[0], bias, h0, h1]) == [False, False, False, False]


def test_budget_plans_a_region_whose_second_output_the_loss_does_not_use():
    """A region output outside the loss graph frees nothing when dropped; planning skips it (no KeyError)."""
    device = nd.cpu_numpy()
    budget = checkpoint.Budget(10**9)
    x = ndl.Tensor(np.ones((4, 5), np.float32), device=device)
    w = ndl.Tensor(np.ones((5, 5), np.float32), device=device)
    with autograd.lazy_mode(True):
        h = ops.relu(x @ w)
        a, b = ops.tanh(h), ops.exp(h) * 2.0
        checkpoint.annotate([a, b], [x], policy=budget)
        loss = a.sum()
        loss.backward()  # Budget decides here, before the lazy graph is computed
    assert budget.predicted_peak <= budget.bytes
    assert budget.planned


def test_to_dot_marks_dropped_and_recomputed_nodes():
    """viz.to_dot: valid DOT with kept, dropped, recomputed and leaf nodes styled apart."""
    pydot = pytest.importorskip("pydot", reason="pydot (a DOT parser) is a test dependency")
    device = nd.cpu_numpy()
    x = ndl.Tensor(np.ones((2, 2), np.float32), device=device)
    h = ops.exp(x * 2.0)
    out = h + 1.0
    checkpoint.annotate(out, [x])
    loss = ops.exp(out).sum()
    loss.backward()
    dot = ndl.viz.to_dot(loss)
    with warnings.catch_warnings():  # pydot's parser uses pyparsing names that newer pyparsing deprecates
        warnings.simplefilter("ignore", DeprecationWarning)
        graphs = pydot.graph_from_dot_data(dot)
    assert graphs and len(graphs[0].get_nodes()) >= 5
    graph_lines = [line for line in dot.splitlines() if line.lstrip().startswith("n")]  # the graph's own nodes
    styles = " ".join(graph_lines)
    assert "#ffcc80" in styles and "ellipse" in styles and "#dde8f7" in styles  # recomputed, leaf, kept
    assert dot.count("->") == sum(len(n.inputs) for n in autograd.find_topo_sort([loss]))


# ----- rule 4c: backward reads what the forward pass read ------------------------------------------------------
GC_CHOICES = [None, dict(), dict(segment_len=2), dict(policy="sqrt"), dict(policy="selective")]
GC_IDS = ["off", "all", "seg2", "sqrt", "selective"]


def _mlp(device, gc):
    np.random.seed(0)
    model = ndl.nn.Sequential(ndl.nn.Linear(6, 8, device=device), ndl.nn.ReLU(), ndl.nn.Linear(8, 3, device=device))
    if gc is not None:
        model.enable_gc(**gc)
    x = ndl.Tensor(np.random.RandomState(1).randn(4, 6).astype(np.float32), device=device, requires_grad=False)
    return model, x


def _write_sgd(model, x):
    opt = ndl.optim.SGD(model.parameters(), lr=0.5)
    model(x).sum().backward()  # gradients to step with
    return opt.step


def _write_data(model, x):
    w = model.modules[2].weight
    return lambda: setattr(w, "data", w.data * 2.0)


def _write_item(model, x):
    w = model.modules[2].weight
    return lambda: w.__setitem__((slice(0, 1), slice(0, 1)), 5.0)


@pytest.mark.filterwarnings("ignore::needle.checkpoint.NothingToDropWarning")  # one-op layers: nothing to drop
@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
@pytest.mark.parametrize("gc", GC_CHOICES, ids=GC_IDS)
@pytest.mark.parametrize("write", [_write_sgd, _write_data, _write_item], ids=["optimizer", "data", "setitem"])
def test_rule4c_value_modified_between_forward_and_backward_raises(lazy, gc, write):
    """Rule 4c: an in-place write between forward and backward raises, naming the op, tensor and fix."""
    model, x = _mlp(nd.cpu_numpy(), gc)
    modify = write(model, x)
    with autograd.lazy_mode(lazy):
        loss = model(x).sum()
        loss.realize_cached_data()  # the forward pass reads the weights now
        modify()
        with pytest.raises(RuntimeError, match=r"modified in place.*backward\(\) before optimizer\.step\(\)") as e:
            loss.backward()
    if write is _write_sgd:  # every weight was written: the first op backward checks (or recomputes) names its own
        assert "Linear" in str(e.value) and re.search(r"a Parameter 'modules\.\d\.weight' of shape", str(e.value))
    else:
        assert "Linear" in str(e.value) and "(8, 3)" in str(e.value) and "'modules.2.weight'" in str(e.value)


@pytest.mark.filterwarnings("ignore::needle.checkpoint.NothingToDropWarning")  # one-op layers: nothing to drop
@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
@pytest.mark.parametrize("gc", GC_CHOICES, ids=GC_IDS)
def test_rule4c_writes_after_backward_and_before_forward_are_fine(lazy, gc):
    """Rule 4c: the usual loop (forward, backward, step) never trips the check; versions count the writes."""
    model, x = _mlp(nd.cpu_numpy(), gc)
    opt = ndl.optim.Adam(model.parameters(), lr=0.01)
    w = model.modules[0].weight
    for step in range(3):
        with autograd.lazy_mode(lazy):
            model(x).sum().backward()
        opt.step()
        assert w.version == step + 1


def test_rule4c_recompute_reads_forward_version():
    """Rule 4c: a dropped value whose input changed is not silently recomputed from the new input.

    tanh's gradient reads only its output and the add's gradient reads nothing, so with checkpointing off the
    write is harmless (and allowed); with the region dropped, recomputing the output would read the new w.
    """
    device = nd.cpu_numpy()
    for gc in (False, True):
        x = ndl.Tensor(np.ones((2, 3), np.float32), device=device)
        w = ndl.Tensor(np.full((2, 3), 0.5, np.float32), device=device)
        out = ops.tanh(x + w)
        loss = ops.summation(out * 2.0)
        if gc:
            checkpoint.annotate(loss, [x, w])
        w.data = w.data * 3.0
        if gc:
            with pytest.raises(RuntimeError, match="EWiseAdd: cannot recompute it.*rule 4c"):
                loss.backward()
        else:
            loss.backward()
            np.testing.assert_allclose(x.grad.numpy(), 2 * (1 - np.tanh(1.5) ** 2), rtol=1e-6)


@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
@pytest.mark.parametrize("gc", [None] + POLICIES, ids=["off"] + POLICY_IDS)
def test_rule4c_a_released_value_read_after_the_step_raises_instead_of_changing(lazy, gc):
    """Rule 4c outside backward: backward released the blocks' values after their last use. Read after backward,
    one is recomputed bit for bit; read after the parameters changed, recomputing it would give the updated
    model's number, so it raises, naming the op, the input, both versions and why (it returned the new number)."""
    device = nd.cpu_numpy()
    params = _params(device)
    x = ndl.Tensor(np.random.RandomState(1).randn(5, 6).astype(np.float32), device=device, requires_grad=False)
    with autograd.lazy_mode(lazy):
        h, outs = x, []
        for w in params:  # _model, keeping each block's output at hand
            outs.append(_block(h, w))
            if gc is not None:
                checkpoint.annotate(outs[-1], [h], **gc)
            h = outs[-1]
        loss = ops.logsumexp(h, axes=(1,)).sum()
        inner, last = outs[0].inputs[1], outs[-1]  # tanh(...) * 0.5 in the first block; the last block's output
        forward = [inner.numpy(), last.numpy()]
        loss.backward()
    assert inner.cached_data is None and last.cached_data is None  # released (rule 3)
    assert np.array_equal(inner.numpy(), forward[0])  # recomputed from unchanged inputs: the same number
    for p in params:  # an optimizer's step on the raw data
        p.data = p.data - 0.1 * p.grad
    with pytest.raises(RuntimeError, match=r"MatMul: cannot recompute it: one of its inputs, a Tensor of shape "
                                           r"\(6, 6\), was modified in place .*\(version 1, .*version 0\)") as e:
        last.numpy()
    assert "released" in str(e.value) and "rule 4c" in str(e.value)
    assert last.cached_data is None  # no value of the updated model is left behind


@pytest.mark.filterwarnings("ignore::needle.checkpoint.NothingToDropWarning")  # one-op layers: nothing to drop
@pytest.mark.parametrize("gc", GC_CHOICES, ids=GC_IDS)
@pytest.mark.parametrize("write", [_write_sgd, _write_data, _write_item], ids=["optimizer", "data", "setitem"])
@pytest.mark.parametrize("then", ["realize", "numpy", "backward"])
def test_rule4c_a_lazy_graph_written_under_before_it_is_computed_raises(gc, write, then):
    """Rule 4c in lazy mode: a graph records the versions of its inputs when it is built. An in-place write between
    building and computing it (realize, numpy(), backward) raises as eager mode does, naming the op, the tensor
    and both versions (it used to compute forward and backward with the new weights)."""
    model, x = _mlp(nd.cpu_numpy(), gc)
    modify = write(model, x)
    with autograd.lazy_mode(True):
        loss = model(x).sum()
        assert all(n.cached_data is None for n in autograd.find_topo_sort([loss]) if not n.is_leaf())
        modify()
        with pytest.raises(RuntimeError, match=r"Linear: cannot compute it: .* was modified in place after the "
                                               r"graph was built \(version 1, the graph read version 0\)") as e:
            {"realize": loss.realize_cached_data, "numpy": loss.numpy, "backward": loss.backward}[then]()
    assert re.search(r"'modules\.[02]\.weight'", str(e.value)) and "rule 4c" in str(e.value)


def test_rule4c_lazy_writes_between_graphs_are_fine():
    """Rule 4c in lazy mode compares with the versions a graph was built with, so what a training loop writes
    between graphs never trips it: .data on a leaf before building, gradient accumulation over several lazy
    graphs each differentiated before the step, GradScaler's unscale and step. The numbers equal eager mode's."""
    def train(lazy):
        model, x = _mlp(nd.cpu_numpy(), None)
        params = model.parameters()
        opt, scaler = ndl.optim.SGD(params, lr=0.1), ndl.amp.GradScaler(init_scale=4.0)
        w = model.modules[0].weight
        w.data = w.data * 0.5  # a write before the graph is built
        losses = []
        for _ in range(2):
            sums = [None] * len(params)
            for micro in range(2):  # two lazy graphs, their gradients summed outside the graph
                with autograd.lazy_mode(lazy):
                    loss = (model(x) * (micro + 1.0)).sum()
                    scaler.scale(loss).backward()
                losses.append(loss)
                for i, p in enumerate(params):
                    g = p.grad.realize_cached_data()
                    sums[i] = g if sums[i] is None else sums[i] + g
            for p, total in zip(params, sums):
                p.grad = ndl.Tensor(total, device=p.device, requires_grad=False)
            scaler.step(opt)
            scaler.update()
        return [loss.numpy() for loss in losses], [p.numpy() for p in params]

    (eager_losses, eager_params), (lazy_losses, lazy_params) = train(False), train(True)
    for a, b in zip(eager_losses + eager_params, lazy_losses + lazy_params):
        assert np.array_equal(a, b)
    assert eager_losses[0] * 2 == eager_losses[1] and eager_losses[2] != eager_losses[0]  # steps were taken


def test_rule2_statistics_count_recomputations_per_node():
    """Rule 2's statistic is counted, not set: a node recomputed twice in one pass reports 2."""
    device = nd.cpu_numpy()
    x = ndl.Tensor(np.ones((2, 3), np.float32), device=device)
    h = ops.exp(x)
    out = ops.log(h + 1.0)
    checkpoint.annotate(out, [x])
    machine = autograd.Compute()
    machine.recompute(h)
    assert machine.stats["max_recomputes_per_node"] == 1
    autograd.release(h)
    machine.recompute(h)
    assert machine.stats["max_recomputes_per_node"] == 2 and machine.stats["recomputed_nodes"] == 2


@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
@pytest.mark.parametrize("gc", POLICIES, ids=POLICY_IDS)
def test_rules_1_2_3_hold_on_the_backward_plan(lazy, gc):
    """Rules 1-3 asserted on the plan itself: each value recomputed at most once, before the first step that
    reads it; every non-leaf value except the root released exactly once, after its last use; leaves never."""
    params = _params(nd.cpu_numpy())
    x = ndl.Tensor(np.ones((5, 6), np.float32), device=nd.cpu_numpy(), requires_grad=False)
    with autograd.lazy_mode(lazy):
        loss = _model(params, x, gc)
        loss.realize_cached_data()
    plan = autograd.plan_backward(loss)
    recomputed = [id(n) for n in plan.recomputed()]
    assert len(recomputed) == len(set(recomputed))  # rule 2
    assert set(recomputed) <= {id(n) for n in autograd.find_topo_sort([loss]) if n.cached_data is None}
    released = [n for n in plan.unused] + [n for step in plan.steps for n in step.release]
    graph = autograd.find_topo_sort([loss])
    assert sorted(id(n) for n in released) == sorted(id(n) for n in graph if not n.is_leaf() and n is not loss)
    position = {id(step.node): i for i, step in enumerate(plan.steps)}
    for i, step in enumerate(plan.steps):  # a released value is read by no later step (rule 3)
        for n in step.release:
            for later in plan.steps[i + 1:]:
                if not later.node.is_leaf():
                    assert n not in autograd.reads(later.node) and all(
                        n not in r.inputs for r in later.recompute)
        for n in step.recompute:  # recomputed before the step that first needs it (rule 2)
            assert position[id(step.node)] == i


def test_predictor_and_executor_walk_the_same_plan():
    """The Budget's ledger and the real backward run one loop: their event sequences are identical.

    Both are driven by autograd.realize and autograd.run_backward; a code path that served only one of them
    (a special case for the executor, a shortcut in the ledger) would change one sequence and fail here.
    """
    class Recording:
        def __init__(self, machine, log):
            self.machine, self.log = machine, log

        def __getattr__(self, name):
            method = getattr(self.machine, name)

            def record(*args, **kwargs):
                if name in ("compute", "recompute", "release", "set_grad"):
                    self.log.append((name, node_number(args[0])))
                return method(*args, **kwargs)
            return record

    for gc in POLICIES:
        params = _params(nd.cpu_numpy())
        x = ndl.Tensor(np.ones((5, 6), np.float32), device=nd.cpu_numpy(), requires_grad=False)
        with autograd.lazy_mode(True):
            loss = _model(params, x, gc)
        graph = autograd.find_topo_sort([loss])
        numbers = {id(n): i for i, n in enumerate(graph)}

        def node_number(node):  # forward values by position; gradient nodes by their op
            return numbers.get(id(node), type(node.op).__name__ if node.op else "leaf")

        dropped = {id(n) for n in graph if n.drop}
        predicted, executed = [], []
        out_grad = ndl.Tensor(np.ones(()), device=nd.cpu_numpy(), requires_grad=True)
        ledger = Recording(checkpoint_budget.Ledger(loss, out_grad), predicted)
        autograd.realize([loss], lambda n: id(n) not in dropped, ledger)
        autograd.run_backward(autograd.plan_backward(loss, ledger.has), out_grad, ledger)
        with autograd.lazy_mode(True):
            run = Recording(autograd.Compute(), executed)
            autograd.realize([loss], lambda n: not n.drop, run)
            autograd.run_backward(autograd.plan_backward(loss), out_grad, run)
        assert predicted == executed and len(executed) > len(graph)


def test_compute_and_the_ledger_are_machines():
    """Realization and backward are written against autograd.Machine; the executor and the Budget's ledger both
    declare it and define every one of its methods themselves (none falls back to the protocol's empty stub)."""
    methods = [name for name in vars(autograd.Machine) if not name.startswith("_")]
    assert {"has", "compute", "recompute", "check_reads", "release", "set_grad", "value"} <= set(methods)
    for machine in (autograd.Compute, checkpoint_budget.Ledger):
        assert autograd.Machine in machine.__mro__  # declared, not only shaped alike
        for name in methods:
            assert getattr(machine, name) is not getattr(autograd.Machine, name), (machine.__name__, name)


def test_no_import_cycle_involves_the_checkpointing_modules():
    """Imports go one way: checkpoint -> checkpoint_budget -> backward, autograd (and ops); autograd and backward
    import none of checkpoint, checkpoint_budget, amp, nn."""
    package = pathlib.Path(ndl.__file__).parent

    def imported(module):
        tree = ast.parse((package / f"{module}.py").read_text())
        names = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                names |= {node.module} if node.module else {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("needle."):
                names.add(node.module.split(".")[1])
        return names

    for core in ("autograd", "backward"):  # the graph core knows nothing of the modules built on it
        assert not imported(core) & {"checkpoint", "checkpoint_budget", "amp", "nn"}, core
    assert "checkpoint" not in imported("checkpoint_budget")
    for name in ("ops_mathematic", "ops_logarithmic", "ops_tuple"):
        tree = ast.parse((package / "ops" / f"{name}.py").read_text())
        modules = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        assert not any("checkpoint" in m for m in modules), name


def test_last_backward_stats_are_plain_numbers_from_both_modules():
    """The statistics hold counts and bytes only (no raw object ids that go stale), from either module."""
    x = ndl.Tensor(np.ones((2, 3), np.float32), device=nd.cpu_numpy())
    out = ops.log(ops.exp(x) + 1.0)
    checkpoint.annotate(out, [x])
    out.sum().backward()
    stats = checkpoint.last_backward_stats()
    assert stats == autograd.last_backward_stats()
    assert stats["recomputed_nodes"] >= 1 and stats["max_recomputes_per_node"] == 1
    assert all(v is None or isinstance(v, int) or (k.endswith("_seconds_exposed") and isinstance(v, float))
               for k, v in stats.items()), stats
